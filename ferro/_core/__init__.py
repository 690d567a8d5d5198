"""ferro's compiled core: framed transport, reduction kernels and native collectives, without the GIL.

Nothing here knows about process groups or collectives; the layers above
decide policy and this package moves bytes.
"""

try:
    from ferro._core import arena, collectives, reduce, shm, state, status, transport
except ImportError as exc:  # pragma: no cover - only hit on a broken install
    raise ImportError(
        "ferro's compiled core is not built. Install the package with "
        "`pip install .` (or `pip install -e .` for development), which compiles "
        "it with Cython and a C compiler."
    ) from exc

__all__ = ["arena", "collectives", "reduce", "shm", "state", "status", "transport"]

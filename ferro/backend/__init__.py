"""Process groups: the Backend interface, its implementations, and the one list of them by name.

:data:`BACKENDS` maps a backend's name to how a rank joins a job with it.
``init_process_group(backend=...)``, ``ferro bench --backend`` and the test
harness (``run_processes(backend=...)``) all read this list, so a backend added
here is usable everywhere at once. ``"auto"`` is not a backend but a choice
among them (:func:`ferro.collective.process_group.init_process_group`). Backends that are
planned but not part of this ferro are listed too, and joining one raises
:class:`~ferro.BackendUnavailableError` saying so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType

from ferro.backend.base import Backend, FramedBackend
from ferro.backend.hierarchical import HierarchicalBackend
from ferro.backend.joined import JoinSpec
from ferro.backend.native import NativeCollectives
from ferro.backend.shm import ShmBackend
from ferro.backend.simulated import SimulatedBackend
from ferro.backend.sub import SubBackend, sub_group
from ferro.backend.tcp import TcpBackend
from ferro.errors import BackendUnavailableError, ConfigurationError

__all__ = [
    "BACKENDS",
    "Backend",
    "BackendEntry",
    "FramedBackend",
    "HierarchicalBackend",
    "JoinSpec",
    "NativeCollectives",
    "ShmBackend",
    "SimulatedBackend",
    "SubBackend",
    "TcpBackend",
    "available_backends",
    "backend_entry",
    "join_backend",
    "sub_group",
]


@dataclass(frozen=True)
class BackendEntry:
    """One backend of the registry.

    Attributes:
        name: What users pass as ``backend=``.
        description: One line for help texts.
        join: ``join(spec)`` returns this rank's group, or None when the backend is not available.
        unavailable: Why it is not available (and what would make it so), when ``join`` is None.
        gpu: It moves GPU memory and needs a GPU, its driver and libnccl (checked when joining).
        backend_class: Returns the backend's class (importing no optional library), whose ``SUPPORT`` the
            reference's backend table shows; None for a backend that is not part of this ferro.

    """

    name: str
    description: str
    join: Callable[[JoinSpec], Backend] | None
    unavailable: str = ""
    gpu: bool = False
    backend_class: Callable[[], type[Backend]] | None = None


def _mpi_class() -> type[Backend]:
    from ferro.backend.mpi.backend import MpiBackend  # the module loads mpi4py only when a group is made

    return MpiBackend


def _nccl_class() -> type[Backend]:
    from ferro.backend.nccl.backend import NcclBackend  # libnccl and the driver load when a group is made

    return NcclBackend


def _hybrid_class() -> type[Backend]:
    from ferro.backend.nccl.backend import HybridBackend

    return HybridBackend


def _join_mpi(spec: JoinSpec) -> Backend:
    from ferro.backend.mpi import MpiBackend  # imports mpi4py (and so initialises MPI) only here

    return MpiBackend.join(spec)


def _join_nccl(spec: JoinSpec) -> Backend:
    from ferro.backend.nccl import NcclBackend  # imports no library: those load when the group is made

    return NcclBackend.join(spec)


def _join_hybrid(spec: JoinSpec) -> Backend:
    from ferro.backend.nccl import HybridBackend

    return HybridBackend.join(spec)


BACKENDS = MappingProxyType({entry.name: entry for entry in (
    BackendEntry("tcp", "a full mesh of authenticated TCP connections, any hosts", TcpBackend.join,
                 backend_class=lambda: TcpBackend),
    BackendEntry("shm", "shared memory, every rank on one host", ShmBackend.join, backend_class=lambda: ShmBackend),
    BackendEntry("hierarchical", "shared memory inside each host, TCP between one leader per host",
                 HierarchicalBackend.join, backend_class=lambda: HierarchicalBackend),
    BackendEntry("mpi", "the cluster's MPI, through mpi4py (ranks started by mpirun or srun)", _join_mpi,
                 backend_class=_mpi_class),
    BackendEntry("ucc", "UCC collectives", None,
                 "UCC has no Python binding; Open MPI reaches UCC's collectives itself (its coll/ucc component): use "
                 "backend='mpi' with an Open MPI built with UCC, selected by `mpirun --mca coll_ucc_enable 1 "
                 "--mca coll_ucc_priority 100 ...`"),
    BackendEntry("nccl", "NCCL on GPUs (one per rank), through ctypes", _join_nccl, gpu=True,
                 backend_class=_nccl_class),
    BackendEntry("hybrid", "TCP for host memory, NCCL for GPU memory", _join_hybrid, gpu=True,
                 backend_class=_hybrid_class),
)})
"""Every backend by name, in the order help texts list them. Read-only."""


def available_backends(gpu: bool | None = None) -> list[str]:
    """Names of the backends this ferro can join with, in registry order.

    Args:
        gpu: True for the GPU backends only, False for the host ones only, None for both.
            A GPU backend is listed even where no GPU is; joining it then says what is missing.

    """
    return [name for name, entry in BACKENDS.items()
            if entry.join is not None and (gpu is None or entry.gpu == gpu)]


def backend_entry(name: str) -> BackendEntry:
    """Return the registry's entry for ``name``, checked to be available here.

    Raises:
        ConfigurationError: No backend has that name.
        BackendUnavailableError: The backend exists but cannot run here (the message says why).

    """
    entry = BACKENDS.get(name)
    if entry is None:
        raise ConfigurationError(f"unknown backend {name!r}; use 'auto' or one of {', '.join(available_backends())}")
    if entry.join is None:
        raise BackendUnavailableError(f"backend {name!r}: {entry.unavailable}")
    return entry


def join_backend(name: str, spec: JoinSpec) -> Backend:
    """Join the job described by ``spec`` with the backend called ``name``.

    Raises:
        ConfigurationError, BackendUnavailableError: As :func:`backend_entry`.

    """
    join = backend_entry(name).join
    assert join is not None  # backend_entry checked it
    return join(spec)

"""torch's plugin hook for ferro: ``import torch`` registers the ``"ferro"`` process-group backend by name.

torch calls every ``torch.backends`` entry point at the end of ``import torch``
(``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns that off). ferro's points here, so
``torch.distributed.init_process_group("ferro")`` works in any process where
ferro is installed, with no ``import ferro`` in user code: Ray Train, Lightning
and accelerate build their process groups in workers that never import it.

This is the one module of the distribution outside the ``ferro`` package, on
purpose: importing ``ferro.anything`` runs ``ferro/__init__.py`` (NumPy, the
compiled core, about half a second), and ``import torch`` must stay as cheap
as it was. Registering costs a dictionary entry; ferro itself is imported when
torch first builds a ``"ferro"`` group.
"""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["register"]


def register() -> None:
    """Register ``"ferro"`` with ``torch.distributed``; torch calls this while it is imported.

    A failure here would make ``import torch`` itself fail, so it is turned
    into a warning: ``import ferro.interop.torch`` registers the backend too.
    """
    try:
        import torch.distributed as dist

        if dist.is_available() and "FERRO" not in dist.Backend._plugins:
            dist.Backend.register_backend("ferro", _create_process_group, extended_api=True, devices=["cpu"])
    except Exception as exc:  # noqa: BLE001 - never break `import torch`
        warnings.warn(f"ferro could not register its torch.distributed backend 'ferro' ({type(exc).__name__}: "
                      f"{exc}); `import ferro.interop.torch` registers it explicitly", RuntimeWarning, stacklevel=2)


def _create_process_group(options: Any, backend_options: Any) -> Any:
    from ferro.interop.torch import create_process_group  # the first "ferro" group imports ferro

    return create_process_group(options, backend_options)

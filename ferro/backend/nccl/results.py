"""The one place where an ``ncclResult_t`` becomes a ferro exception.

Each failed NCCL call raises the ferro error of its kind, carrying NCCL's own
description (``ncclGetErrorString``) and its last error message
(``ncclGetLastError``), which names what actually went wrong:

* ``ncclRemoteError`` (a peer failed or exited) -> :class:`~ferro.PeerLostError`;
* ``ncclSystemError`` (a socket or another OS call) -> :class:`~ferro.TransportError`;
* ``ncclTimeout`` -> :class:`~ferro.DistributedTimeoutError`;
* the rest (a CUDA error inside NCCL, an internal error, an invalid argument or
  usage) -> :class:`~ferro.NcclError`, whose ``result`` keeps the code.
"""

from __future__ import annotations

from typing import Any

from ferro.errors import DistributedError, DistributedTimeoutError, NcclError, PeerLostError, TransportError

__all__ = ["IN_PROGRESS", "RESULT_NAMES", "SUCCESS", "check", "nccl_error"]

SUCCESS = 0
UNHANDLED_CUDA_ERROR = 1
SYSTEM_ERROR = 2
INTERNAL_ERROR = 3
INVALID_ARGUMENT = 4
INVALID_USAGE = 5
REMOTE_ERROR = 6
IN_PROGRESS = 7
TIMEOUT = 8

RESULT_NAMES = {
    SUCCESS: "ncclSuccess",
    UNHANDLED_CUDA_ERROR: "ncclUnhandledCudaError",
    SYSTEM_ERROR: "ncclSystemError",
    INTERNAL_ERROR: "ncclInternalError",
    INVALID_ARGUMENT: "ncclInvalidArgument",
    INVALID_USAGE: "ncclInvalidUsage",
    REMOTE_ERROR: "ncclRemoteError",
    IN_PROGRESS: "ncclInProgress",
    TIMEOUT: "ncclTimeout",
}

_HINTS = {
    REMOTE_ERROR: "a peer rank failed or exited",
    SYSTEM_ERROR: "a system call failed (network: check NCCL_SOCKET_IFNAME)",
    UNHANDLED_CUDA_ERROR: "a CUDA call inside NCCL failed",
    INVALID_USAGE: "NCCL was called in a way it does not allow",
}


def nccl_error(lib: Any, result: int, call: str, rank: int, comm: Any = None) -> DistributedError:
    """Return the ferro exception for ``result`` from NCCL's ``call`` on ``rank`` (see the module docstring).

    Args:
        lib: The loaded library (:class:`~ferro.backend.nccl.library.NcclLibrary`), for NCCL's texts.
        result: The ``ncclResult_t``.
        call: What was called, for the message (``"ncclAllReduce"``).
        rank: The calling rank.
        comm: The communicator, whose last error NCCL reports (None: the last error of any).

    """
    name = RESULT_NAMES.get(result, f"ncclResult_t {result}")
    described = lib.ncclGetErrorString(result)
    last = lib.ncclGetLastError(comm)
    message = f"rank {rank}: NCCL {call} failed: {name}"
    if described:
        message += f" ({described.decode(errors='replace')})"
    if last:
        message += f": {last.decode(errors='replace').strip()}"
    hint = _HINTS.get(result)
    if hint:
        message += f" [{hint}; NCCL_DEBUG=WARN prints NCCL's own log]"
    if result == REMOTE_ERROR:
        return PeerLostError(message)
    if result == SYSTEM_ERROR:
        return TransportError(message)
    if result == TIMEOUT:
        return DistributedTimeoutError(message)
    return NcclError(message, result)


def check(lib: Any, result: int, call: str, rank: int, comm: Any = None) -> None:
    """Raise :func:`nccl_error` unless ``result`` is ``ncclSuccess``."""
    if result != SUCCESS:
        raise nccl_error(lib, result, call, rank, comm)

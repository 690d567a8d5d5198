"""NCCL through ctypes: the ``nccl`` and ``hybrid`` process groups, with no compile-time CUDA dependency.

Nothing here loads a library at import: libnccl and the CUDA driver are
opened by the first NCCL group (:mod:`ferro.backend.nccl.library`,
:mod:`ferro.backend.nccl.cuda`).
"""

from ferro.backend.nccl.backend import HybridBackend, NcclBackend, require_nccl
from ferro.backend.nccl.communicator import Communicator, DeviceWork
from ferro.backend.nccl.library import nccl_version

__all__ = ["Communicator", "DeviceWork", "HybridBackend", "NcclBackend", "nccl_version", "require_nccl"]

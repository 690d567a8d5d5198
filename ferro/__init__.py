"""ferro: distributed training for Python with a compiled, GIL-free core.

The public names live here; everything else is reachable by module path but
should not be needed. Classes and functions re-exported here show as ``ferro.X``
in reprs and tracebacks, wherever in the layers they live.

The process groups and collectives load with ``import ferro``; the layers above
them (DDP, FSDP, pipelines, checkpoints, distributed tensors, RPC, elastic
training, ``ferro.nn``) load on first use of one of their names, so a rank that
only runs collectives starts sooner (``import ferro`` 0.45 -> 0.35 s on the
2-core VM, with compiled bytecode).
"""

import importlib as _importlib
import sys
import typing as _typing

from ferro.backend import Backend, HierarchicalBackend, ShmBackend, SimulatedBackend, SubBackend, TcpBackend
from ferro.backend.mpi import MpiBackend
from ferro.backend.nccl import HybridBackend, NcclBackend, nccl_version
from ferro.collective import (
    all_gather,
    all_gather_object,
    all_to_all,
    all_to_all_single_uneven,
    allreduce,
    async_all_gather,
    async_reduce_scatter,
    barrier,
    broadcast,
    broadcast_object,
    gather,
    p2p,
    process_group,
    reduce,
    reduce_scatter,
    scatter,
)
from ferro.collective.flight_recorder import dump_flight_record, flight_records, set_flight_recorder_size
from ferro.collective.gpu import gpu_allreduce, gpu_broadcast
from ferro.collective.p2p import irecv, irecv_any, isend, recv, recv_any, recv_into, send, sendrecv
from ferro.collective.process_group import (
    destroy_process_group,
    get_default_group,
    get_rank,
    get_world_size,
    init_process_group,
    is_initialized,
    new_group,
)
from ferro.collective.work import PendingCollective
from ferro.errors import (
    AuthenticationError,
    BackendClosedError,
    BackendUnavailableError,
    CheckpointCorruptError,
    CheckpointError,
    CollectiveMismatchError,
    ConfigurationError,
    ConnectionBrokenError,
    CudaError,
    DistributedError,
    DistributedTimeoutError,
    InvalidBufferError,
    InvalidRankError,
    InvalidWorldSizeError,
    MembershipError,
    MpiError,
    NcclError,
    PeerLostError,
    ProtocolError,
    QuorumLostError,
    RankFailedError,
    RemoteError,
    SelfSendError,
    SizeMismatchError,
    StoreError,
    StoreKeyTimeoutError,
    TransportError,
)
from ferro.rendezvous.store import Store, StoreServer
from ferro.types import ReduceOp

if _typing.TYPE_CHECKING:  # loaded on first use (see _LAZY); imported here for type checkers and IDEs
    from ferro import checkpoint, dtensor, elastic, nn, rpc
    from ferro.dtensor import device_mesh as device_mesh
    from ferro.dtensor.device_mesh import DeviceMesh, init_device_mesh
    from ferro.parallel import (
        DDP,
        FSDP,
        MixedPrecision,
        ShardingStrategy,
        SyncBatchNorm,
        convert_sync_batchnorm,
        pipeline,
        size_based_policy,
    )

from ferro._version import __version__  # noqa: E402 - the one place the version is written

# Sorted within each group; the groups follow the layers, bottom up.
__all__ = [
    # errors (ferro.errors)
    "AuthenticationError",
    "BackendClosedError",
    "BackendUnavailableError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CollectiveMismatchError",
    "ConfigurationError",
    "ConnectionBrokenError",
    "CudaError",
    "DistributedError",
    "DistributedTimeoutError",
    "InvalidBufferError",
    "InvalidRankError",
    "InvalidWorldSizeError",
    "MembershipError",
    "MpiError",
    "NcclError",
    "PeerLostError",
    "ProtocolError",
    "QuorumLostError",
    "RankFailedError",
    "RemoteError",
    "SelfSendError",
    "SizeMismatchError",
    "StoreError",
    "StoreKeyTimeoutError",
    "TransportError",
    # types
    "ReduceOp",
    # rendezvous
    "Store",
    "StoreServer",
    # process groups (ferro.backend)
    "Backend",
    "HierarchicalBackend",
    "HybridBackend",
    "MpiBackend",
    "NcclBackend",
    "ShmBackend",
    "SimulatedBackend",
    "SubBackend",
    "TcpBackend",
    "nccl_version",
    # the default group (ferro.process_group)
    "destroy_process_group",
    "get_default_group",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "is_initialized",
    "new_group",
    # collectives (ferro.collective)
    "PendingCollective",
    "all_gather",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single_uneven",
    "allreduce",
    "async_all_gather",
    "async_reduce_scatter",
    "barrier",
    "broadcast",
    "broadcast_object",
    "gather",
    "gpu_allreduce",
    "gpu_broadcast",
    "reduce",
    "reduce_scatter",
    "scatter",
    # point to point (ferro.p2p)
    "irecv",
    "irecv_any",
    "isend",
    "recv",
    "recv_any",
    "recv_into",
    "send",
    "sendrecv",
    # diagnosis (ferro.collective.flight_recorder)
    "dump_flight_record",
    "flight_records",
    "set_flight_recorder_size",
    # parallelism and state
    "DDP",
    "DeviceMesh",
    "FSDP",
    "MixedPrecision",
    "ShardingStrategy",
    "SyncBatchNorm",
    "convert_sync_batchnorm",
    "init_device_mesh",
    "size_based_policy",
    # namespaces
    "checkpoint",
    "dtensor",
    "elastic",
    "nn",
    "p2p",
    "pipeline",
    "rpc",
    "__version__",
]

# Module paths users import that live inside a layer's folder: `import ferro.p2p` gets the very
# module object, not a copy (a copy of process_group would hold a default group of its own).
# `ferro.pipeline` and `ferro.device_mesh`, which load on first use, are files that do the same.
for _path, _module in (("p2p", p2p), ("process_group", process_group)):
    sys.modules[f"{__name__}.{_path}"] = _module
del _path, _module

# The names that load on first use: name -> (module, attribute, or None for the module itself).
_LAZY: dict[str, tuple[str, str | None]] = {
    "checkpoint": ("ferro.checkpoint", None),
    "dtensor": ("ferro.dtensor", None),
    "elastic": ("ferro.elastic", None),
    "nn": ("ferro.nn", None),
    "parallel": ("ferro.parallel", None),  # not in __all__, but `ferro.parallel.X` read after `import ferro`
    "rpc": ("ferro.rpc", None),
    "pipeline": ("ferro.parallel.pipeline", None),
    "device_mesh": ("ferro.dtensor.device_mesh", None),
    "DeviceMesh": ("ferro.dtensor.device_mesh", "DeviceMesh"),
    "init_device_mesh": ("ferro.dtensor.device_mesh", "init_device_mesh"),
    **{name: ("ferro.parallel", name) for name in ("DDP", "FSDP", "MixedPrecision", "ShardingStrategy",
                                                    "SyncBatchNorm", "convert_sync_batchnorm",
                                                    "size_based_policy")},
}


def __getattr__(name: str) -> _typing.Any:
    """Load a name of :data:`_LAZY` on first use (PEP 562), and keep it here."""
    try:
        module, attribute = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = _importlib.import_module(module)
    if attribute is not None:
        value = getattr(value, attribute)
    _show_as_ferro(name, value)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def _show_as_ferro(name: str, value: _typing.Any) -> None:
    """Make a re-exported class or function read ``ferro.X`` in reprs and tracebacks, as httpx does.

    Pickles stay loadable: ``ferro.X`` resolves to the same object.
    """
    if isinstance(value, type) or callable(value) and hasattr(value, "__qualname__"):
        if getattr(value, "__module__", "").startswith("ferro.") and value.__qualname__ == name:
            value.__module__ = __name__


for _name in __all__:
    if _name not in _LAZY:
        _show_as_ferro(_name, globals()[_name])
del _name

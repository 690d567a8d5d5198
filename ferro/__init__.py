"""ferro: distributed training for Python with a compiled, GIL-free core.

The public names live here; everything else is reachable by module path but
should not be needed. Classes and functions re-exported here show as ``ferro.X``
in reprs and tracebacks, wherever in the layers they live.
"""

import sys

from ferro import checkpoint, dtensor, elastic, nn, rpc
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
from ferro.dtensor import device_mesh
from ferro.dtensor.device_mesh import DeviceMesh, init_device_mesh
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
from ferro.rendezvous.store import Store, StoreServer
from ferro.types import ReduceOp

__version__ = "0.1.0"

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

# Module paths users import that live inside a layer's folder: `import ferro.p2p` and
# `from ferro.pipeline import Schedule1F1B` get the very module objects, not copies (a copy of
# process_group would hold a default group of its own).
for _path, _module in (("p2p", p2p), ("process_group", process_group), ("pipeline", pipeline),
                       ("device_mesh", device_mesh)):
    sys.modules[f"{__name__}.{_path}"] = _module
del _path, _module


def _show_as_ferro() -> None:
    """Make re-exported classes and functions read ``ferro.X`` in reprs and tracebacks, as httpx does.

    Pickles stay loadable: ``ferro.X`` resolves to the same object.
    """
    public = globals()
    for name in __all__:
        value = public[name]
        if isinstance(value, type) or callable(value) and hasattr(value, "__qualname__"):
            if getattr(value, "__module__", "").startswith("ferro.") and value.__qualname__ == name:
                value.__module__ = __name__


_show_as_ferro()

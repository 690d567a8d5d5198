"""ferro: distributed training for Python with a compiled, GIL-free core.

The public names live here; everything else is reachable by module path but
should not be needed.
"""

from ferro import nn, p2p
from ferro.backend import Backend, HierarchicalBackend, ShmBackend, SimulatedBackend, SubBackend, TcpBackend
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
    reduce,
    reduce_scatter,
    scatter,
)
from ferro.device_mesh import DeviceMesh, init_device_mesh
from ferro.errors import (
    AuthenticationError,
    BackendClosedError,
    BackendUnavailableError,
    CollectiveMismatchError,
    ConfigurationError,
    ConnectionBrokenError,
    DistributedError,
    DistributedTimeoutError,
    InvalidBufferError,
    InvalidRankError,
    InvalidWorldSizeError,
    PeerLostError,
    ProtocolError,
    RankFailedError,
    SelfSendError,
    SizeMismatchError,
    StoreError,
    TransportError,
)
from ferro.p2p import irecv, isend, recv, recv_into, send, sendrecv
from ferro.parallel import DDP, FSDP, MixedPrecision, ShardingStrategy, size_based_policy
from ferro.process_group import (
    destroy_process_group,
    get_default_group,
    get_rank,
    get_world_size,
    init_process_group,
    is_initialized,
    new_group,
)
from ferro.rendezvous.store import Store, StoreServer
from ferro.types import ReduceOp
from ferro.work import PendingCollective

__version__ = "0.1.0"

__all__ = [
    "all_gather",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single_uneven",
    "allreduce",
    "async_all_gather",
    "async_reduce_scatter",
    "AuthenticationError",
    "Backend",
    "BackendClosedError",
    "BackendUnavailableError",
    "barrier",
    "broadcast",
    "broadcast_object",
    "CollectiveMismatchError",
    "ConfigurationError",
    "ConnectionBrokenError",
    "DDP",
    "DeviceMesh",
    "destroy_process_group",
    "DistributedError",
    "DistributedTimeoutError",
    "FSDP",
    "gather",
    "get_default_group",
    "get_rank",
    "get_world_size",
    "init_device_mesh",
    "init_process_group",
    "irecv",
    "isend",
    "InvalidBufferError",
    "InvalidRankError",
    "InvalidWorldSizeError",
    "MixedPrecision",
    "is_initialized",
    "new_group",
    "nn",
    "p2p",
    "PeerLostError",
    "PendingCollective",
    "ProtocolError",
    "RankFailedError",
    "recv",
    "recv_into",
    "reduce",
    "reduce_scatter",
    "ReduceOp",
    "scatter",
    "SelfSendError",
    "ShardingStrategy",
    "size_based_policy",
    "send",
    "sendrecv",
    "HierarchicalBackend",
    "ShmBackend",
    "SimulatedBackend",
    "SizeMismatchError",
    "Store",
    "StoreError",
    "StoreServer",
    "SubBackend",
    "TcpBackend",
    "TransportError",
    "__version__",
]

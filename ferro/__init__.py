"""ferro: distributed training for Python with a compiled, GIL-free core.

The public names live here; everything else is reachable by module path but
should not be needed.
"""

from ferro.backend import Backend, SimulatedBackend, SubBackend, TcpBackend, new_group
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
from ferro.store import Store, StoreServer

__version__ = "0.1.0"

__all__ = [
    "AuthenticationError",
    "Backend",
    "BackendClosedError",
    "BackendUnavailableError",
    "CollectiveMismatchError",
    "ConfigurationError",
    "ConnectionBrokenError",
    "DistributedError",
    "DistributedTimeoutError",
    "InvalidBufferError",
    "InvalidRankError",
    "InvalidWorldSizeError",
    "PeerLostError",
    "ProtocolError",
    "RankFailedError",
    "SelfSendError",
    "SimulatedBackend",
    "SizeMismatchError",
    "Store",
    "StoreError",
    "StoreServer",
    "SubBackend",
    "TcpBackend",
    "TransportError",
    "__version__",
    "new_group",
]

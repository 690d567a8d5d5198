"""Process groups: the Backend interface and its implementations."""

from ferro.backend.base import Backend, FramedBackend
from ferro.backend.hierarchical import HierarchicalBackend
from ferro.backend.shm import ShmBackend
from ferro.backend.simulated import SimulatedBackend
from ferro.backend.sub import SubBackend, new_group
from ferro.backend.tcp import TcpBackend

__all__ = [
    "Backend",
    "FramedBackend",
    "HierarchicalBackend",
    "ShmBackend",
    "SimulatedBackend",
    "SubBackend",
    "TcpBackend",
    "new_group",
]

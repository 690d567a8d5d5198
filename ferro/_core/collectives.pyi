"""Type stub for the native collectives (ferro/_core/collectives.pyx)."""

from collections.abc import Callable, Sequence
from typing import Any

from ferro._core.direct import DirectCall
from ferro._core.transport import Connection

ALGORITHM_RING: int
ALGORITHM_RECURSIVE_DOUBLING: int
ALGORITHM_HALVING_DOUBLING: int
ALGORITHMS: dict[str, int]
DEFAULT_SEGMENT_BYTES: int
RING_LEAD_FRAMES: int
DIRECT_REDUCE_SCATTER_BYTES: int
STEP_REDUCE: int
ALGORITHM_BINOMIAL_TREE: int
ALGORITHM_CHAIN: int
ALGORITHM_BRUCK: int
ALGORITHM_PAIRWISE: int
ALGORITHM_BRUCK_ALL_TO_ALL: int
ALGORITHM_DISSEMINATION: int
ALGORITHM_REDUCE_TREE: int
ALGORITHM_REDUCE_RING_GATHER: int
ALGORITHM_REDUCE_CHAIN: int
ALGORITHM_SCATTER_ALL_GATHER: int
BROADCAST_PLANS: dict[str, int]
REDUCE_PLANS: dict[str, int]
FORCEABLE_PLANS: dict[str, dict[str, int]]
STEP_PACK: int
DEFAULT_LATENCY_BYTES: float
DEFAULT_COPY_RATIO: float
DEFAULT_WINDOW_BYTES: int
FLIGHT_BUDGET_SECONDS: float
CHAIN_SEGMENT_SMALLEST: int
CHAIN_SEGMENT_LARGEST: int
STEP_SEND_SOURCE: int
STEP_RECV_BASE: int
STEP_DIVIDE: int

def chain_segment(nbytes: int, n: int, latency_bytes: float = ...) -> int: ...
def ring_piece(length: int, segment: int, smallest: int, itemsize: int) -> int: ...
def choose(
    op: str, nbytes: int, n: int, latency_bytes: float = ..., copy_ratio: float = ..., partner_ratio: float = ...,
    measured: bool = ...,
) -> str: ...
def plan_steps(
    algorithm: int, rank: int, n: int, count: int, itemsize: int, phases: int = ..., mean: bool = ...,
    source: bool = ..., root: int = ..., segment: int = ...,
) -> list[tuple[int, int, int, int, int, int, int, int]]: ...

PARTNER_CURVE_POINTS: int

class Mesh:
    connections: list[Connection | None]
    rank: int
    n: int
    latency_bytes: float
    copy_ratio: float
    partner_ratio: float
    window_bytes: int
    segment_bytes: int
    piece_bytes: int
    pace_bytes: float
    line_pace: float
    pace_from_bytes: int
    paced_calls: int
    measured: bool
    connector: Callable[[int, float], Connection] | None
    forced_broadcast: int
    forced_all_gather: int
    forced_all_to_all: int
    forced_reduce: int
    def __init__(
        self, connections: Sequence[Connection | None], rank: int, latency_bytes: float = ..., copy_ratio: float = ...,
        partner_ratio: float = ...,
        connector: Callable[[int, float], Connection] | None = ...,
    ) -> None: ...
    def attach(self, peer: int, conn: Connection) -> None: ...
    def choose(self, op: str, nbytes: int) -> str: ...
    partner_count: int
    def set_partner_curve(self, points: list[tuple[int, float]]) -> None: ...
    def partner_curve(self) -> list[tuple[int, float]]: ...
    def partner_at(self, nbytes: int) -> float: ...
    def force(self, op: str, name: str | None) -> None: ...
    def forced(self) -> dict[str, str]: ...
    def plan_settings(self) -> str: ...
    @property
    def near_peers(self) -> list[int]: ...

class DirectMeshAllreduce(DirectCall):
    def __call__(self, x: Any, op: Any, timeout: float | None) -> bool: ...

class DirectMeshBroadcast(DirectCall):
    def __call__(self, x: Any, root: Any, timeout: float | None) -> bool: ...

class DirectMeshReduce(DirectCall):
    def __call__(self, x: Any, dst: Any, op: Any, timeout: float | None) -> bool: ...

class DirectMeshAllToAll(DirectCall):
    def __call__(self, x: Any, out: Any, timeout: float | None) -> Any: ...

class DirectMeshAllGather(DirectCall):
    def __call__(self, x: Any, out: Any, tag: Any, timeout: float | None) -> Any: ...

class DirectMeshReduceScatter(DirectCall):
    def __call__(self, x: Any, op: Any, out: Any, tag: Any, timeout: float | None) -> Any: ...

class DirectMeshBarrier(DirectCall):
    def __call__(self, timeout: float | None) -> bool: ...

def allreduce(
    mesh: Mesh,
    buf: Any,
    dtype: int,
    op: int,
    itemsize: int,
    fingerprint: int,
    timeout: float,
    algorithm: int,
    segment_bytes: int = ...,
    divisor: float = ...,
) -> None: ...
def ring(
    mesh: Mesh,
    buf: Any,
    bounds: list[int],
    dtype: int,
    op: int,
    itemsize: int,
    fingerprint: int,
    timeout: float,
    reduce_scatter: bool,
    all_gather: bool,
    segment_bytes: int = ...,
    divisor: float = ...,
    ends: list[int] | None = ...,
    source: Any = ...,
) -> None: ...
def broadcast(
    mesh: Mesh,
    buf: Any,
    root: int,
    fingerprint: int,
    timeout: float,
    segment_bytes: int = ...,
    algorithm: int = ...,
) -> None: ...
def all_gather(mesh: Mesh, buf: Any, nbytes: int, fingerprint: int, timeout: float) -> None: ...
def reduce(
    mesh: Mesh,
    buf: Any,
    root: int,
    dtype: int,
    op: int,
    itemsize: int,
    fingerprint: int,
    timeout: float,
    divisor: float = ...,
    algorithm: int = ...,
) -> None: ...
def all_to_all(
    mesh: Mesh,
    send_buf: Any,
    send_offsets: list[int],
    recv_buf: Any,
    recv_offsets: list[int],
    fingerprint: int,
    timeout: float,
    even: bool = ...,
) -> None: ...
def barrier(mesh: Mesh, timeout: float) -> None: ...

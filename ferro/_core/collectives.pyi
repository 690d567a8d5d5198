"""Type stub for the native collectives (ferro/_core/collectives.pyx)."""

from typing import Any

from ferro._core.transport import Connection

ALGORITHM_RING: int
ALGORITHM_RECURSIVE_DOUBLING: int
DEFAULT_SEGMENT_BYTES: int

def allreduce(
    connections: tuple[Connection | None, ...],
    rank: int,
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
    connections: tuple[Connection | None, ...],
    rank: int,
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
) -> None: ...
def broadcast(
    connections: tuple[Connection | None, ...],
    rank: int,
    buf: Any,
    root: int,
    fingerprint: int,
    timeout: float,
    chain: bool,
    segment_bytes: int = ...,
) -> None: ...
def all_to_all(
    connections: tuple[Connection | None, ...],
    rank: int,
    send_buf: Any,
    send_offsets: list[int],
    recv_buf: Any,
    recv_offsets: list[int],
    fingerprint: int,
    timeout: float,
) -> None: ...
def barrier(connections: tuple[Connection | None, ...], rank: int, timeout: float) -> None: ...

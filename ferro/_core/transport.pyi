"""Type stub for the compiled transport (ferro/_core/transport.pyx)."""

import socket
from typing import Any

from ferro._core.state import GroupState

HEADER_SIZE: int
PROTOCOL_VERSION: int
KIND_DATA: int
KIND_BARRIER: int
KIND_COLLECTIVE: int
KIND_ABORT: int
MAX_ABORT_BYTES: int
ABORT_PEER_LOST: int
ABORT_MISMATCH: int
ABORT_TIMEOUT: int
ABORT_OTHER: int

def kind_name(kind: int) -> str: ...
def broken_by(status: int) -> str: ...
def describe_buffer_problem(obj: object, writable: bool) -> str: ...
def abort_payload(code: int, peer: int, message: str) -> bytes: ...
def abort_error(payload: bytes, sender: int, where: str) -> Exception: ...
def mismatch_error(where: str, peer: int, kind: int, fingerprint: int, seen_kind: int, seen_fingerprint: int,
                   seq: int) -> Exception: ...
def size_error(where: str, peer: int, length: int, capacity: int, exact: bool, seq: int) -> Exception: ...

class Connection:
    def __init__(
        self,
        sock: socket.socket,
        local_rank: int,
        peer_rank: int,
        spin_us: float = 50.0,
        stage_bytes: int = 65536,
        group_state: GroupState | None = None,
        yield_us: float = 200.0,
    ) -> None: ...
    @property
    def peer(self) -> int: ...
    @property
    def local_rank(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    @property
    def broken(self) -> str | None: ...
    @property
    def send_seq(self) -> int: ...
    @property
    def recv_seq(self) -> int: ...
    @property
    def spin_us(self) -> float: ...
    @property
    def yield_us(self) -> float: ...
    def fileno(self) -> int: ...
    def frame_waiting(self) -> bool: ...
    def stop_sending(self) -> None: ...
    def linger(self, deadline: float) -> None: ...
    def close(self) -> None: ...
    def send(
        self, buf: Any, *, kind: int = 1, fingerprint: int = 0, timeout: float = -1.0, op: str = "send"
    ) -> None: ...
    def recv_into(
        self,
        buf: Any,
        *,
        kind: int = 1,
        fingerprint: int = 0,
        timeout: float = -1.0,
        exact: bool = True,
        op: str = "recv",
    ) -> int: ...

def sendrecv(
    send_conn: Connection,
    send_buf: Any,
    recv_conn: Connection,
    recv_buf: Any,
    *,
    kind: int = 1,
    fingerprint: int = 0,
    timeout: float = -1.0,
    exact: bool = True,
    op: str = "sendrecv",
) -> int: ...

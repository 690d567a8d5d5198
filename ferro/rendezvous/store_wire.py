"""The store's wire format, shared by its client (:mod:`ferro.rendezvous.store`) and server (:mod:`.store_server`).

Each message is a little-endian u32 length and a body; a request body is an op
byte and arguments, a response body a status byte and arguments; each argument
is a u32 length and its bytes. Lengths are checked against ``MAX_MESSAGE_BYTES``
before anything is allocated.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

__all__ = ["MAX_MESSAGE_BYTES", "Op", "Status", "arity_error", "pack", "unpack"]

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
U32 = struct.Struct("<I")


class Op:
    """Operation codes (torch's TCPStore operations, plus the batched and queue ones)."""

    SET, GET, WAIT, ADD, COMPARE_SET, DELETE, CHECK, NUM_KEYS = range(1, 9)
    MULTI_GET, MULTI_SET, APPEND, QUEUE_PUSH, QUEUE_POP, QUEUE_LEN = range(9, 15)
    PRESENT = 15  # ferro's own: which of these keys are set (one byte each), without waiting


class Status:
    """Response status codes."""

    OK, TIMED_OUT, FAILED = 0, 1, 2


# How many arguments each operation takes: (at least, at most or None for any number).
_ARITY: dict[int, tuple[int, int | None]] = {
    Op.SET: (2, 2), Op.GET: (2, 2), Op.WAIT: (1, None), Op.ADD: (2, 2), Op.COMPARE_SET: (3, 3), Op.DELETE: (1, 1),
    Op.CHECK: (0, None), Op.NUM_KEYS: (0, 0), Op.MULTI_GET: (1, None), Op.MULTI_SET: (0, None), Op.APPEND: (2, 2),
    Op.QUEUE_PUSH: (2, 2), Op.QUEUE_POP: (2, 2), Op.QUEUE_LEN: (1, 1), Op.PRESENT: (0, None)}
# Operations whose first argument is how long the server may wait, in milliseconds.
WAITING = frozenset({Op.GET, Op.WAIT, Op.MULTI_GET, Op.QUEUE_POP})


def arity_error(code: int, args: Sequence[bytes]) -> str | None:
    """Return why ``args`` do not fit operation ``code``, or None when they do."""
    arity = _ARITY.get(code)
    if arity is None:
        return f"unknown store operation {code}"
    if len(args) < arity[0] or (arity[1] is not None and len(args) > arity[1]):
        return f"store operation {code} got {len(args)} argument(s)"
    if code == Op.MULTI_SET and len(args) % 2:
        return "multi_set needs a value for every key"
    if code in WAITING and not args[0].isdigit():
        return "the wait limit is not a number of milliseconds"
    return None


def pack(code: int, args: Sequence[bytes]) -> bytes:
    """Frame one message: the length, the code byte and each argument with its length."""
    parts = [bytes([code])]
    for arg in args:
        parts.append(U32.pack(len(arg)))
        parts.append(arg)
    body = b"".join(parts)
    return U32.pack(len(body)) + body


def unpack(body: bytes | memoryview) -> tuple[int, list[bytes]]:
    """Split a message body into its code and arguments.

    Raises:
        ValueError: The body is empty or an argument's length runs past its end.

    """
    if not body:
        raise ValueError("empty message")
    args: list[bytes] = []
    offset, end = 1, len(body)
    while offset < end:
        if offset + 4 > end:
            raise ValueError("truncated argument length")
        (n,) = U32.unpack_from(body, offset)
        offset += 4
        if offset + n > end:
            raise ValueError("argument longer than its message")
        args.append(bytes(body[offset : offset + n]))
        offset += n
    return body[0], args

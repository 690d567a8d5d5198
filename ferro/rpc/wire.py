"""RPC messages on an authenticated socket: a fixed header, the pickled body, then raw buffers.

Arrays and tensors travel *out of band*: the body is pickled with protocol 5
and a buffer callback, so a NumPy array's or a CPU tensor's memory is sent
straight from where it lies (``sendmsg``) and received into one new buffer that
the unpickled array then views. Nothing is copied into pickled bytes.

Header, little-endian: ``magic "FRPC" | kind u32 | call id u64 | body length u64 |
buffer count u32``, then one u64 length per buffer. Lengths are checked against
limits before anything is allocated, so a frame that lies about its size is
refused (:class:`~ferro.ProtocolError`) instead of exhausting memory.
"""

from __future__ import annotations

import enum
import io
import pickle
import socket
import struct
import threading
from typing import Any

import numpy as np

from ferro._buffers import is_torch_tensor
from ferro.errors import PeerLostError, ProtocolError

__all__ = ["MAX_BODY_BYTES", "MAX_BUFFERS", "Kind", "Message", "Receiver", "decode", "encode", "send_message"]

_HEADER = struct.Struct("<4sIQQI")
_MAGIC = b"FRPC"
MAX_BODY_BYTES = 1 << 31  # pickled structure, not data: 2 GiB is already absurd
MAX_BUFFERS = 1 << 16
MAX_BUFFER_BYTES = 1 << 40  # one array or tensor


class Kind(enum.IntEnum):
    """What a message is."""

    REQUEST = 1  # call a function: body (fn, args, kwargs)
    RESPONSE = 2  # the call's return value
    ERROR = 3  # the call raised: body (exception or None, traceback text, type name)
    DONE = 4  # this worker has no call outstanding and will start none (graceful shutdown)


class Message:
    """A decoded message."""

    __slots__ = ("body", "call_id", "kind")

    def __init__(self, kind: Kind, call_id: int, body: Any) -> None:
        self.kind, self.call_id, self.body = kind, call_id, body


def _rebuild_tensor(array: np.ndarray, dtype: str, shape: tuple[int, ...], requires_grad: bool) -> Any:
    import torch

    tensor = torch.from_numpy(array)
    if str(tensor.dtype) != dtype:
        tensor = tensor.view(getattr(torch, dtype.replace("torch.", "")))
    return tensor.reshape(shape).requires_grad_(requires_grad)


def _torch_int16() -> Any:
    import torch

    return torch.int16


class _Pickler(pickle.Pickler):
    """Protocol 5; CPU tensors become NumPy views (out of band) plus their dtype and shape."""

    def reducer_override(self, obj: Any) -> Any:
        if is_torch_tensor(obj) and obj.device.type == "cpu" and str(obj.layout) == "torch.strided":
            tensor = obj.detach().contiguous()
            if str(tensor.dtype) == "torch.bfloat16":
                array = tensor.view(_torch_int16()).numpy()
            else:
                array = tensor.numpy()
            return _rebuild_tensor, (array, str(obj.dtype), tuple(obj.shape), bool(obj.requires_grad))
        return NotImplemented


def encode(kind: Kind, call_id: int, body: Any) -> list[Any]:
    """Return the message as a list of buffers for ``sendmsg`` (header, body, then each raw buffer)."""
    buffers: list[pickle.PickleBuffer] = []
    stream = io.BytesIO()
    _Pickler(stream, protocol=5, buffer_callback=buffers.append).dump(body)
    raws = [b.raw() for b in buffers]
    header = _HEADER.pack(_MAGIC, int(kind), call_id, stream.getbuffer().nbytes, len(raws))
    lengths = struct.pack(f"<{len(raws)}Q", *(r.nbytes for r in raws))
    return [header + lengths, stream.getbuffer(), *raws]


def decode(kind: int, call_id: int, body: bytes, buffers: list[bytearray]) -> Message:
    """Unpickle a received message (arrays view ``buffers``)."""
    return Message(Kind(kind), call_id, pickle.loads(body, buffers=buffers))


def send_message(sock: socket.socket, lock: threading.Lock, parts: list[Any]) -> None:
    """Send one encoded message whole (one writer at a time on a socket)."""
    views = [memoryview(p).cast("B") for p in parts if memoryview(p).nbytes]
    with lock:
        while views:
            sent = sock.sendmsg(views)
            while views and sent >= views[0].nbytes:
                sent -= views[0].nbytes
                views.pop(0)
            if views and sent:
                views[0] = views[0][sent:]


class Receiver:
    """Reads messages from one socket through a 64 KiB staging buffer.

    A small message (header, lengths and body, even its buffers) usually
    arrives in one ``recv``; large buffers are received straight into their
    own memory. The staging buffer never holds more than the socket delivered.
    """

    STAGE_BYTES = 64 * 1024

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._stage = bytearray(self.STAGE_BYTES)
        self._view = memoryview(self._stage)
        self._start = self._end = 0

    def _fill(self, wanted: int) -> None:
        """Have at least ``wanted`` (<= STAGE_BYTES) bytes staged."""
        if self._end - self._start >= wanted:
            return
        if self._start:  # move what is left to the front
            left = self._end - self._start
            self._stage[:left] = self._stage[self._start:self._end]
            self._start, self._end = 0, left
        while self._end < wanted:
            got = self._sock.recv_into(self._view[self._end:])
            if got == 0:
                raise PeerLostError("the connection closed")
            self._end += got

    def _take(self, n: int) -> bytes:
        self._fill(n)
        data = bytes(self._view[self._start:self._start + n])
        self._start += n
        return data

    def _read_into(self, target: memoryview) -> None:
        staged = min(self._end - self._start, target.nbytes)
        target[:staged] = self._view[self._start:self._start + staged]
        self._start += staged
        rest = target[staged:]
        if rest.nbytes > self.STAGE_BYTES // 2:
            _recv_into(self._sock, rest)  # large: straight into its own memory
        elif rest.nbytes:
            rest[:] = self._take(rest.nbytes)

    def receive(self) -> tuple[int, int, bytes, list[bytearray]]:
        """Receive one message: ``(kind, call id, body bytes, raw buffers)``.

        Raises:
            PeerLostError: The connection closed.
            ProtocolError: Not an RPC frame, or lengths past the limits.

        """
        magic, kind, call_id, body_len, count = _HEADER.unpack(self._take(_HEADER.size))
        if magic != _MAGIC or kind not in Kind.__members__.values():
            raise ProtocolError(f"rpc: not an RPC frame (magic {bytes(magic)!r}, kind {kind})")
        if body_len > MAX_BODY_BYTES or count > MAX_BUFFERS:
            raise ProtocolError(f"rpc: a frame claims {body_len} body bytes and {count} buffers (limits "
                                f"{MAX_BODY_BYTES}, {MAX_BUFFERS})")
        lengths_raw = bytearray(8 * count)
        self._read_into(memoryview(lengths_raw))
        lengths = struct.unpack(f"<{count}Q", lengths_raw) if count else ()
        if any(n > MAX_BUFFER_BYTES for n in lengths):
            raise ProtocolError(f"rpc: a frame claims a buffer of {max(lengths)} bytes (limit {MAX_BUFFER_BYTES})")
        body = bytearray(body_len)
        self._read_into(memoryview(body))
        buffers = []
        for n in lengths:
            buffer = bytearray(n)
            self._read_into(memoryview(buffer))
            buffers.append(buffer)
        return kind, call_id, bytes(body), buffers


def _recv_into(sock: socket.socket, buffer: memoryview) -> None:
    while buffer.nbytes:
        got = sock.recv_into(buffer)
        if got == 0:
            raise PeerLostError("the connection closed")
        buffer = buffer[got:]

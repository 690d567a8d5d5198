"""The compiled transport on socket pairs: framing, validation, failure semantics."""

import socket
import struct
import threading

import numpy as np
import pytest

from ferro._core import transport as t
from ferro.errors import (
    BackendClosedError,
    CollectiveMismatchError,
    ConnectionBrokenError,
    DistributedTimeoutError,
    InvalidBufferError,
    PeerLostError,
    ProtocolError,
    SizeMismatchError,
)

DTYPES = [np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
          np.uint32, np.uint64, np.bool_, np.complex64]


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    left, right = t.Connection(a, 0, 1), t.Connection(b, 1, 0)
    yield left, right
    left.close()
    right.close()


@pytest.fixture
def raw_pair():
    """A connection on one end and the bare socket on the other, to forge frames."""
    a, b = socket.socketpair()
    conn = t.Connection(a, 1, 0)
    yield conn, b
    conn.close()
    b.close()


def header(kind=t.KIND_DATA, length=0, seq=0, fingerprint=0, magic=None):
    magic = (0x4F5246 | (t.PROTOCOL_VERSION << 24)) if magic is None else magic
    return struct.pack("<IIQQQ", magic, kind, length, seq, fingerprint)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_round_trip_every_dtype(pair, dtype):
    left, right = pair
    rng = np.random.default_rng(0)
    data = (rng.standard_normal(1001) * 100).astype(dtype)
    out = np.empty_like(data)
    left.send(data)
    assert right.recv_into(out) == data.nbytes
    np.testing.assert_array_equal(out, data)


@pytest.mark.parametrize("make", [bytes, bytearray, lambda b: memoryview(bytearray(b))],
                         ids=["bytes", "bytearray", "memoryview"])
def test_round_trip_builtin_buffers(pair, make):
    left, right = pair
    payload = make(b"ferro" * 100)
    out = bytearray(500)
    left.send(payload)
    right.recv_into(out)
    assert bytes(out) == bytes(payload)


def test_multidimensional_array_is_sent_by_its_bytes(pair):
    left, right = pair
    data = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    out = np.empty(24, dtype=np.float32)
    left.send(data)
    right.recv_into(out)
    np.testing.assert_array_equal(out, data.ravel())


def test_empty_message(pair):
    left, right = pair
    left.send(b"")
    assert right.recv_into(bytearray(0)) == 0
    left.send(np.arange(3.0))  # the stream continues in step after an empty frame
    out = np.empty(3)
    right.recv_into(out)
    np.testing.assert_array_equal(out, [0.0, 1.0, 2.0])


def test_wire_format_is_little_endian_header_then_payload(raw_pair):
    conn, raw = raw_pair
    a, b = socket.socketpair()
    sender = t.Connection(a, 0, 1)
    sender.send(np.array([1, 2], dtype="<u4"), kind=t.KIND_DATA, fingerprint=0xABCDEF)
    sender.send(b"xyz", kind=t.KIND_BARRIER)
    wire = b.recv(1024)
    sender.close()
    b.close()
    assert wire[:32] == header(t.KIND_DATA, 8, 0, 0xABCDEF)
    assert wire[32:40] == b"\x01\x00\x00\x00\x02\x00\x00\x00"
    assert wire[40:72] == header(t.KIND_BARRIER, 3, 1, 0)
    assert wire[72:] == b"xyz"


def test_larger_frame_than_buffer_is_refused_and_kept(pair):
    left, right = pair
    data = np.arange(10, dtype=np.float32)
    left.send(data)
    small = np.zeros(5, dtype=np.float32)
    with pytest.raises(SizeMismatchError) as info:
        right.recv_into(small)
    assert "40-byte" in str(info.value) and "20 bytes" in str(info.value)
    assert (info.value.expected, info.value.actual) == (20, 40)
    np.testing.assert_array_equal(small, 0)  # the buffer was not touched
    out = np.empty(10, dtype=np.float32)
    right.recv_into(out)  # nothing was lost
    np.testing.assert_array_equal(out, data)


def test_exact_receive_refuses_shorter_frame_but_inexact_accepts_it(pair):
    left, right = pair
    left.send(b"abc")
    out = bytearray(8)
    with pytest.raises(SizeMismatchError, match="expects exactly 8 bytes"):
        right.recv_into(out)
    assert right.recv_into(out, exact=False) == 3
    assert bytes(out[:3]) == b"abc"


def test_kind_mismatch_names_both_calls_and_keeps_the_frame(pair):
    left, right = pair
    left.send(b"", kind=t.KIND_BARRIER)
    with pytest.raises(CollectiveMismatchError, match="expected a point-to-point data frame.*sent a barrier frame"):
        right.recv_into(bytearray(0))
    right.recv_into(bytearray(0), kind=t.KIND_BARRIER)


def test_fingerprint_mismatch_is_reported(pair):
    left, right = pair
    left.send(b"1234", fingerprint=7)
    with pytest.raises(CollectiveMismatchError, match="fingerprint 0x7"):
        right.recv_into(bytearray(4), fingerprint=8)


def test_frame_that_lies_about_its_length_is_refused_without_allocating(raw_pair):
    conn, raw = raw_pair
    raw.sendall(header(length=1 << 60))
    with pytest.raises(SizeMismatchError, match=str(1 << 60)):
        conn.recv_into(bytearray(16))


def test_foreign_bytes_break_the_connection(raw_pair):
    conn, raw = raw_pair
    raw.sendall(b"GET / HTTP/1.1\r\nHost: example\r\n\r\n")  # longer than a header
    with pytest.raises(ProtocolError, match="not ferro protocol"):
        conn.recv_into(bytearray(4))
    with pytest.raises(ConnectionBrokenError, match="foreign header"):
        conn.recv_into(bytearray(4))


def test_out_of_sequence_frame_is_a_protocol_error(raw_pair):
    conn, raw = raw_pair
    raw.sendall(header(length=0, seq=5))
    with pytest.raises(ProtocolError, match="seq 5 arrived where seq 0 was due"):
        conn.recv_into(bytearray(0))


def test_timeout_before_a_frame_leaves_connection_usable(pair):
    left, right = pair
    with pytest.raises(DistributedTimeoutError, match="no frame was consumed"):
        right.recv_into(bytearray(4), timeout=0.05)
    left.send(b"late")
    out = bytearray(4)
    right.recv_into(out, timeout=5)
    assert out == b"late"


def test_timeout_in_the_middle_of_a_frame_breaks_the_connection(raw_pair):
    conn, raw = raw_pair
    raw.sendall(header(length=100) + b"x" * 10)
    with pytest.raises(DistributedTimeoutError, match="middle of a frame"):
        conn.recv_into(bytearray(100), timeout=0.05)
    assert conn.broken is not None
    with pytest.raises(ConnectionBrokenError, match="timeout in the middle of a frame"):
        conn.recv_into(bytearray(100), timeout=0.05)


def test_partial_header_is_kept_across_a_timeout(raw_pair):
    conn, raw = raw_pair
    frame = header(length=4) + b"abcd"
    raw.sendall(frame[:10])
    with pytest.raises(DistributedTimeoutError):
        conn.recv_into(bytearray(4), timeout=0.05)
    raw.sendall(frame[10:])
    out = bytearray(4)
    conn.recv_into(out, timeout=5)
    assert out == b"abcd"


def test_peer_closing_is_peer_lost_with_its_rank(pair):
    left, right = pair
    left.close()
    with pytest.raises(PeerLostError) as info:
        right.recv_into(bytearray(4), timeout=5)
    assert info.value.peer == 0
    assert isinstance(info.value, ConnectionError)


def test_peer_closing_mid_frame(raw_pair):
    conn, raw = raw_pair
    raw.sendall(header(length=100) + b"x" * 10)
    raw.close()
    with pytest.raises(PeerLostError):
        conn.recv_into(bytearray(100), timeout=5)


def test_send_to_closed_peer_is_peer_lost(pair):
    left, right = pair
    right.close()
    with pytest.raises(PeerLostError):
        for _ in range(100):  # the first sends may still land in the kernel buffer
            left.send(np.zeros(1 << 16), timeout=5)


def test_operations_after_close_raise_closed(pair):
    left, _ = pair
    left.close()
    with pytest.raises(BackendClosedError, match="closed by this process"):
        left.send(b"x")


def test_non_contiguous_buffer_is_refused(pair):
    left, _ = pair
    with pytest.raises(InvalidBufferError, match="not C-contiguous"):
        left.send(np.arange(10.0)[::2])


def test_read_only_receive_buffer_is_refused(pair):
    left, right = pair
    frozen = np.zeros(4)
    frozen.flags.writeable = False
    with pytest.raises(InvalidBufferError, match="read-only"):
        right.recv_into(frozen)
    with pytest.raises(InvalidBufferError, match="read-only"):
        right.recv_into(b"immutable")


def test_non_buffer_is_refused(pair):
    left, _ = pair
    with pytest.raises(InvalidBufferError, match="got list"):
        left.send([1, 2, 3])


def test_full_duplex_exchange_of_large_messages_does_not_deadlock(pair):
    left, right = pair
    n = 16 * 1024 * 1024 // 8  # 16 MB each way, far beyond the socket buffers
    a = np.random.default_rng(1).random(n)
    b = np.random.default_rng(2).random(n)
    got_a, got_b = np.empty(n), np.empty(n)
    other = threading.Thread(target=lambda: t.sendrecv(right, b, right, got_a, timeout=30))
    other.start()
    t.sendrecv(left, a, left, got_b, timeout=30)
    other.join(30)
    np.testing.assert_array_equal(got_a, a)
    np.testing.assert_array_equal(got_b, b)


def test_sendrecv_receive_error_still_finishes_the_send(pair):
    left, right = pair
    right.send(b"12345678")
    with pytest.raises(SizeMismatchError):
        t.sendrecv(left, b"abcd", left, bytearray(4), timeout=5)
    out = bytearray(4)
    right.recv_into(out, timeout=5)  # the send half completed, so the stream is whole
    assert out == b"abcd"


def test_sequence_numbers_advance_per_direction(pair):
    left, right = pair
    for _ in range(3):
        left.send(b"")
        right.recv_into(bytearray(0))
    assert (left.send_seq, left.recv_seq, right.send_seq, right.recv_seq) == (3, 0, 0, 3)


def test_concurrent_senders_never_interleave_frames(pair):
    left, right = pair
    n_threads, n_frames, n = 4, 50, 100_000  # frames far larger than one socket write

    def sender(tag):
        for _ in range(n_frames):
            left.send(np.full(n, tag, np.int32), timeout=30)

    threads = [threading.Thread(target=sender, args=(tag,)) for tag in range(n_threads)]
    for thread in threads:
        thread.start()
    counts = [0] * n_threads
    out = np.empty(n, np.int32)
    for _ in range(n_threads * n_frames):
        right.recv_into(out, timeout=30)
        assert (out == out[0]).all(), "a frame mixed bytes of two senders"
        counts[out[0]] += 1
    for thread in threads:
        thread.join(30)
    assert counts == [n_frames] * n_threads


def test_short_garbage_then_close_is_peer_lost_not_a_hang(raw_pair):
    conn, raw = raw_pair
    raw.sendall(b"\x00" * 10)  # less than a header
    raw.close()
    with pytest.raises(PeerLostError):
        conn.recv_into(bytearray(4), timeout=30)


def test_close_from_another_thread_wakes_a_blocked_receive(pair):
    left, right = pair
    errors = []

    def blocked():
        try:
            right.recv_into(bytearray(8), timeout=30)
        except Exception as exc:  # noqa: BLE001 - the test inspects whatever arrives
            errors.append(exc)

    thread = threading.Thread(target=blocked)
    thread.start()
    thread.join(0.2)  # let it block
    right.close()
    thread.join(10)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], BackendClosedError), errors


def _tcp_pair_with_a_backlog():
    """Two TCP connections where A has queued a big frame and then a notice that B has not read yet,
    while B's frame to A lies unread at A: closing A plainly now resets the connection."""
    listener = socket.create_server(("127.0.0.1", 0))
    b_sock = socket.create_connection(listener.getsockname())
    a_sock, _ = listener.accept()
    listener.close()
    b_sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)  # B's window fills at once
    a_sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)  # the rest waits in A's send queue
    a, b = t.Connection(a_sock, 0, 1), t.Connection(b_sock, 1, 0)
    b.send(np.arange(1024, dtype=np.float64), timeout=10)  # unread at A
    big = np.arange(40_000, dtype=np.float64)  # 320 KB: more than B's window, less than A's send queue
    a.send(big, timeout=10)
    a.send(b"the notice", timeout=10)
    return a, b, big


def _read_everything(b, big):
    first, notice = np.empty_like(big), bytearray(10)
    try:
        b.recv_into(first, timeout=10)
        b.recv_into(notice, timeout=10)
        return np.array_equal(first, big) and bytes(notice) == b"the notice"
    except (ConnectionBrokenError, PeerLostError) as exc:
        return type(exc).__name__
    finally:
        b.close()


@pytest.mark.parametrize("closing", ["close", "linger"])
def test_linger_delivers_what_was_queued_where_a_plain_close_resets_it(closing):
    a, b, big = _tcp_pair_with_a_backlog()
    seen = []
    reader = threading.Thread(target=lambda: seen.append(_read_everything(b, big)))
    if closing == "close":
        a.close()  # unread bytes at A: the kernel resets the connection and drops A's queue
        reader.start()
        reader.join(30)
        assert seen and seen[0] in ("ConnectionBrokenError", "PeerLostError")
    else:
        reader.start()
        import time

        a.stop_sending()
        a.linger(time.monotonic() + 30)  # returns once B has read everything and closed
        reader.join(30)
        assert seen == [True]
    assert a.closed

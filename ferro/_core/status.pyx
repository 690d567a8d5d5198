# cython: language_level=3
"""The one place where the compiled core's statuses become exceptions.

TCP connections, shared-memory rings and the collective arena all report a
:c:type:`Failure` (a status code plus the context it needs: the peer, this
rank's call, the header the peer sent) and turn it into an exception here, so
a status means the same everywhere: ``ST_CLOSED`` is always "this process
closed it" (:class:`~ferro.BackendClosedError`), ``ST_BROKEN`` always "an
earlier error left it unusable" (:class:`~ferro.ConnectionBrokenError`).
Abort notices (a peer that gave up on a collective, and why) are decoded here
too.
"""

from libc.string cimport memset

import os

from ferro.errors import (
    BackendClosedError,
    CollectiveMismatchError,
    ConnectionBrokenError,
    DistributedTimeoutError,
    PeerLostError,
    ProtocolError,
    SizeMismatchError,
    TransportError,
)

cdef extern from "frame.h":
    enum:
        FERRO_FRAME_MAGIC
        FERRO_PROTOCOL_VERSION

# Frame kinds (frame.h's FERRO_KIND_*). A receiver states the kind it expects; a frame of
# another kind is a mismatch between the two ranks' calls, reported with both names.
KIND_DATA = 1
KIND_BARRIER = 2
KIND_COLLECTIVE = 3
KIND_ABORT = 4
_KIND_NAMES = {KIND_DATA: "point-to-point data", KIND_BARRIER: "barrier", KIND_COLLECTIVE: "collective",
               KIND_ABORT: "abort"}

# An abort notice tells the peers why this rank gave up on a collective; it is small, so
# the receiver can read it whatever buffer it had posted.
MAX_ABORT_BYTES = 4096
ABORT_PEER_LOST = 1
ABORT_MISMATCH = 2
ABORT_TIMEOUT = 3
ABORT_OTHER = 4

_BROKEN_BY = {
    ST_TIMEOUT: "a timeout in the middle of a frame",
    ST_PEER_CLOSED: "the peer closed the connection",
    ST_OS_ERROR: "an operating-system error",
    ST_BAD_MAGIC: "a frame with a foreign header",
    ST_BAD_SEQ: "a frame out of sequence",
    ST_INTR: "an interrupt (Ctrl-C) in the middle of a frame",
    ST_ABORTED: "the other half of an exchange failed in the middle of a frame",
}


def kind_name(uint64_t kind) -> str:
    """Return the human-readable name of a frame kind."""
    return _KIND_NAMES.get(kind, f"kind {kind}")


def broken_by(int status) -> str:
    """Say what a status that broke a channel was, for later errors on it."""
    return _BROKEN_BY.get(status, f"status {status}")


cdef void describe_receive(Failure* f, int status, int peer, bint mid_frame, uint32_t kind, uint64_t fingerprint,
                           uint64_t capacity, bint exact, uint64_t seq, SeenHeader* seen) noexcept:
    """Fill ``f`` for a failed receive: this rank's call, the frame due, and the header the peer sent."""
    memset(f, 0, sizeof(Failure))
    f.status = status
    f.peer = peer
    f.mid_frame = mid_frame
    f.kind = kind
    f.fingerprint = fingerprint
    f.capacity = capacity
    f.exact = exact
    f.seq = seq
    f.seen = seen[0]


cdef object failure_error(Failure* f, str where, double timeout, str detail):
    """The exception for a failed operation, or None for ST_INTR (a signal handler's exception is pending).

    Args:
        f: What failed.
        where: Who saw it doing what, e.g. ``"rank 0: recv from rank 1"``.
        timeout: The operation's timeout, for timeout messages.
        detail: What the transport adds (which frame was due, why it was unusable).
    """
    status = f.status
    if status == ST_INTR:
        return None
    if status == ST_CLOSED:
        return BackendClosedError(f"{where}: this process closed the group while the operation waited")
    if status == ST_TIMEOUT:
        tail = "; it stopped in the middle of a frame, so that channel is now unusable" if f.mid_frame else ""
        # ": timeout after": torch's own suite expects a backend's timeout to say " timeout " (or " Timed out ").
        return DistributedTimeoutError(f"{where}: timeout after {timeout:g} s{detail}{tail}",
                                       f.peer if f.peer >= 0 else None)
    if status == ST_PEER_CLOSED:
        return PeerLostError(f"{where}: rank {f.peer} exited, crashed or closed its group{detail}", f.peer)
    if status == ST_OS_ERROR:
        return TransportError(f"{where} failed: {os.strerror(f.os_errno)} (errno {f.os_errno}){detail}")
    if status == ST_BAD_MAGIC:
        return ProtocolError(
            f"{where}: the frame starts with 0x{f.seen.magic:08x}, not ferro protocol {FERRO_PROTOCOL_VERSION}'s "
            f"0x{FERRO_FRAME_MAGIC:08x}: another program or another ferro version is on the other end; "
            f"the channel is now unusable")
    if status == ST_BAD_SEQ:
        return ProtocolError(
            f"{where}: frame seq {f.seen.seq} arrived where seq {f.seq} was due: the stream is corrupt; "
            f"the channel is now unusable")
    if status == ST_MISMATCH:
        return mismatch_error(where, f.peer, f.kind, f.fingerprint, f.seen.kind, f.seen.fingerprint, f.seen.seq)
    if status == ST_TOO_LARGE or status == ST_SIZE_MISMATCH:
        return size_error(where, f.peer, f.seen.length, f.capacity, status == ST_SIZE_MISMATCH, f.seen.seq)
    if status == ST_BROKEN or status == ST_ABORTED:
        return ConnectionBrokenError(f"{where}: unusable after an earlier error ({detail.lstrip('; ')})")
    return TransportError(f"{where}: unexpected status {status}{detail}")


def mismatch_error(str where, int peer, uint32_t kind, uint64_t fingerprint, uint32_t seen_kind,
                   uint64_t seen_fingerprint, uint64_t seq) -> Exception:
    """The error for a frame (or call) refused because the peer made another call; nothing was consumed."""
    return CollectiveMismatchError(
        f"{where}: this rank expected a {kind_name(kind)} frame (fingerprint 0x{fingerprint:x}) but "
        f"rank {peer} sent a {kind_name(seen_kind)} frame (fingerprint 0x{seen_fingerprint:x}) "
        f"at seq {seq}: the two ranks made different calls; the frame was not consumed",
        peer, (kind, fingerprint), (seen_kind, seen_fingerprint))


def size_error(str where, int peer, uint64_t length, uint64_t capacity, bint exact, uint64_t seq) -> Exception:
    """The error for a frame refused for its size; it stays unconsumed."""
    relation = "expects exactly" if exact else "holds"
    return SizeMismatchError(
        f"{where}: rank {peer} sent a {length}-byte payload but the receive buffer {relation} {capacity} bytes "
        f"(frame seq {seq}); the frame was not consumed", expected=capacity, actual=length)


def abort_payload(int code, int peer, str message) -> bytes:
    """Encode an abort notice: a code, the rank it concerns (-1 for none) and a message."""
    text = message.encode("utf-8", "replace")[: MAX_ABORT_BYTES - 5]
    return bytes([code]) + peer.to_bytes(4, "little", signed=True) + text


def abort_error(bytes payload, int sender, str where) -> Exception:
    """The exception an abort notice from rank ``sender`` stands for."""
    if len(payload) < 5:
        return ProtocolError(f"{where}: rank {sender} sent a malformed abort notice")
    code = payload[0]
    peer = int.from_bytes(payload[1:5], "little", signed=True)
    text = payload[5:].decode("utf-8", "replace")
    message = f"{where}: rank {sender} gave up on the collective: {text}"
    if code == ABORT_PEER_LOST:
        return PeerLostError(message, peer if peer >= 0 else sender)
    if code == ABORT_MISMATCH:
        return CollectiveMismatchError(message, sender)
    if code == ABORT_TIMEOUT:
        return DistributedTimeoutError(message, peer if peer >= 0 else sender)
    return ConnectionBrokenError(message)

"""The exceptions ferro raises, in one tree rooted at :class:`DistributedError`.

Every subclass also inherits the builtin exception it specialises, so code that
already catches ``TimeoutError``, ``ConnectionError`` or ``ValueError`` keeps
working. Messages name the rank that saw the problem, the peer involved, the
operation and, where there is one, the frame's sequence number.

This module imports nothing from the rest of ferro: every layer imports it.
"""

from __future__ import annotations

__all__ = [
    "AuthenticationError",
    "BackendClosedError",
    "BackendUnavailableError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CollectiveMismatchError",
    "ConfigurationError",
    "ConnectionBrokenError",
    "CudaError",
    "DistributedError",
    "DistributedTimeoutError",
    "InvalidBufferError",
    "InvalidRankError",
    "InvalidWorldSizeError",
    "MembershipError",
    "MpiError",
    "NcclError",
    "PeerLostError",
    "ProtocolError",
    "QuorumLostError",
    "RankFailedError",
    "RemoteError",
    "SelfSendError",
    "SizeMismatchError",
    "StoreError",
    "StoreKeyTimeoutError",
    "TransportError",
]


class DistributedError(Exception):
    """Base class of every error ferro raises on purpose."""


class DistributedTimeoutError(DistributedError, TimeoutError):
    """A blocking operation did not finish within its timeout.

    After a timeout in the middle of a frame the connection involved is marked
    broken (see :class:`ConnectionBrokenError`); a timeout while waiting for a
    frame to start leaves it usable.

    Attributes:
        peer: The rank the operation was waiting for, when it waited for one
            (``ferro run`` names that rank as the cause), else ``None``.

    """

    def __init__(self, message: str, peer: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer

    def __reduce__(self):  # keep ``peer`` across pickling
        return (type(self), (str(self), self.peer))


class StoreKeyTimeoutError(DistributedTimeoutError):
    """Store keys were not set in time; :attr:`missing` names them (rendezvous turns them into the ranks missing).

    Attributes:
        missing: The keys still unset when the wait gave up.

    """

    def __init__(self, message: str, missing: tuple[str, ...]) -> None:
        super().__init__(message)
        self.missing = missing

    def __reduce__(self):  # keep ``missing`` across pickling
        return (type(self), (str(self), self.missing))


class PeerLostError(DistributedError, ConnectionError):
    """The peer at the other end of a connection went away (exited, crashed, closed).

    Attributes:
        peer: The rank of the lost peer, or ``None`` when the peer is not a rank
            (the rendezvous store, for instance).

    """

    def __init__(self, message: str, peer: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer

    def __reduce__(self):  # keep ``peer`` across pickling (the test harness ships errors between processes)
        return (type(self), (str(self), self.peer))


class ConnectionBrokenError(DistributedError, ConnectionError):
    """A connection was left unusable by an earlier error in the middle of a frame.

    Byte streams cannot be resynchronised once a frame was half sent or half
    received, so every later operation on that connection raises this error,
    naming the original cause, instead of reading garbage.
    """


class TransportError(DistributedError, ConnectionError):
    """An operating-system error on a connection that is not a lost peer or a timeout."""


class ProtocolError(DistributedError, ConnectionError):
    """A frame header that cannot be valid: wrong magic, version or sequence number."""


class AuthenticationError(DistributedError, ConnectionError):
    """A connection was refused because one side does not hold the job secret."""


class CollectiveMismatchError(DistributedError, RuntimeError):
    """Two ranks made different calls at the same point of their common stream.

    The frame's header carries the sender's operation kind and fingerprint; the
    receiver compares them with its own call before touching its buffer, and the
    frame stays unconsumed.

    Attributes:
        peer: The rank whose frame did not match (or that reported the mismatch).
        expected: ``(kind, fingerprint)`` of this rank's call, when known.
        actual: ``(kind, fingerprint)`` of the peer's frame, when known.

    """

    def __init__(self, message: str, peer: int | None = None, expected: tuple[int, int] | None = None,
                 actual: tuple[int, int] | None = None) -> None:
        super().__init__(message)
        self.peer = peer
        self.expected = expected
        self.actual = actual

    def __reduce__(self):
        return (type(self), (str(self), self.peer, self.expected, self.actual))


class SizeMismatchError(DistributedError, ValueError):
    """A frame's payload does not fit the receive buffer; nothing was consumed.

    Attributes:
        expected: Bytes the receiver posted.
        actual: Bytes the sender sent.

    """

    def __init__(self, message: str, expected: int | None = None, actual: int | None = None) -> None:
        super().__init__(message)
        self.expected = expected
        self.actual = actual

    def __reduce__(self):
        return (type(self), (str(self), self.expected, self.actual))


class InvalidRankError(DistributedError, ValueError):
    """A rank outside ``[0, world_size)`` (or not a member of the group)."""


class InvalidWorldSizeError(DistributedError, ValueError):
    """A world size that is not a positive integer, or that ranks disagree on."""


class SelfSendError(DistributedError, ValueError):
    """A point-to-point send or receive whose peer is the calling rank itself."""


class InvalidBufferError(DistributedError, ValueError):
    """A buffer ferro cannot use: not a buffer, not C-contiguous, or read-only where it must be written."""


class BackendUnavailableError(DistributedError, RuntimeError):
    """A backend or feature that cannot work in this process (missing library, no GPU, not built)."""


class BackendClosedError(DistributedError, RuntimeError):
    """An operation on a process group that this process already closed.

    Compare :class:`PeerLostError`: *you* closed it, rather than the other side broke it.
    """


class ConfigurationError(DistributedError, ValueError):
    """Missing or contradictory configuration; the message says which setting to fix."""


class QuorumLostError(DistributedError, RuntimeError):
    """An elastic job has fewer live ranks than its ``min_size``: training stops on every rank.

    Attributes:
        members: The ranks' member ids that were still alive.
        min_size: The minimum the job was given.

    """

    def __init__(self, message: str, members: tuple[str, ...] = (), min_size: int = 1) -> None:
        super().__init__(message)
        self.members = members
        self.min_size = min_size

    def __reduce__(self):
        return (type(self), (str(self), self.members, self.min_size))


class MembershipError(DistributedError, RuntimeError):
    """An elastic job's epoch formed without this process (it arrived after the others stopped waiting)."""


class StoreError(DistributedError, ValueError):
    """A store request the store could not carry out (``add`` on a value that is not an integer)."""


class RankFailedError(DistributedError, RuntimeError):
    """A rank started by :mod:`ferro.testing` failed; carries its traceback text.

    Attributes:
        rank: The rank that failed first.
        remote_traceback: The formatted traceback from that rank (may be empty
            when the rank died without raising, e.g. from a signal).

    """

    def __init__(self, message: str, rank: int | None = None, remote_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback

    def __reduce__(self):
        return (type(self), (str(self), self.rank, self.remote_traceback))


class CheckpointError(DistributedError, ValueError):
    """A checkpoint cannot be saved or loaded as asked.

    Nothing is committed at the path, a key is missing from it, a shape or dtype
    differs, ranks disagree about a value, or a writer failed.
    """


class CheckpointCorruptError(CheckpointError):
    """A checkpoint's file is truncated, missing, or fails its checksum; the message names the file and tensor."""


class NcclError(DistributedError, RuntimeError):
    """NCCL reported an error that is not a lost peer, a system error or a timeout (those raise their own class).

    The message carries NCCL's own text (``ncclGetLastError``).

    Attributes:
        result: The ``ncclResult_t`` code.

    """

    def __init__(self, message: str, result: int = -1) -> None:
        super().__init__(message)
        self.result = result

    def __reduce__(self):
        return (type(self), (str(self), self.result))


class CudaError(DistributedError, RuntimeError):
    """A CUDA driver call made by ferro failed.

    Attributes:
        code: The ``CUresult``.

    """

    def __init__(self, message: str, code: int = -1) -> None:
        super().__init__(message)
        self.code = code

    def __reduce__(self):
        return (type(self), (str(self), self.code))


class MpiError(DistributedError, RuntimeError):
    """The MPI library reported an error; the message carries MPI's own error string.

    Attributes:
        error_class: MPI's error class (``MPI_ERR_*``), or -1.

    """

    def __init__(self, message: str, error_class: int = -1) -> None:
        super().__init__(message)
        self.error_class = error_class

    def __reduce__(self):
        return (type(self), (str(self), self.error_class))


class RemoteError(DistributedError, RuntimeError):
    """A remote procedure call raised on its worker, and the exception itself could not travel back.

    Exceptions that pickle re-raise on the caller as themselves, with the remote
    traceback as their cause; this one stands in for the others.

    Attributes:
        worker: The name of the worker the call ran on.
        remote_type: The qualified name of the exception's type there.
        remote_traceback: The formatted traceback on the worker.

    """

    def __init__(self, message: str, worker: str = "", remote_type: str = "", remote_traceback: str = "") -> None:
        super().__init__(message)
        self.worker, self.remote_type, self.remote_traceback = worker, remote_type, remote_traceback

    def __reduce__(self):
        return (type(self), (str(self), self.worker, self.remote_type, self.remote_traceback))


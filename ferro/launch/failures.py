"""What a rank started by ``ferro run`` leaves behind when an exception ends it, for the launcher to name the cause.

One rank's failure closes its connections, and its peers then fail too, each
with a :class:`~ferro.errors.PeerLostError` naming the rank it lost. Under load
such a peer can exit before the rank that failed first, and the launcher, which
sees only exit codes, used to name it. A frozen rank is subtler still: it exits
last, if ever, and the first to exit is a healthy rank whose
:class:`~ferro.errors.DistributedTimeoutError` names the rank it waited for. So
each rank writes one small record as its exception leaves the target: a line
saying what the error was, and the peer it lost or waited for in vain, if that
was the error. The launcher follows those names from the first rank that
exited to the one that failed (or stopped) on its own.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from ferro import environment

__all__ = ["ERROR_FILE_ENV", "FailureRecord", "read_failure", "record_failure"]

#: Where ``ferro run`` asks a rank to write its record (one file per rank and attempt).
ERROR_FILE_ENV = "FERRO_ERROR_FILE"
_MAX_ERROR_CHARS = 300
_MAX_CHAIN = 16  # causes and contexts searched for a lost peer
# torch re-raises an error from a future's callback (DDP's gradient buckets) as a RuntimeError holding only its text,
# "...: PeerLostError: rank 0: allreduce from rank 1: ...": the ferro class and the first rank after the reporter's.
_WRAPPED = re.compile(r"\b(PeerLostError|DistributedTimeoutError): rank \d+: .*?\brank (\d+)\b")


@dataclass(frozen=True)
class FailureRecord:
    """How an exception ended a rank.

    Attributes:
        error: ``"ValueError: the message"``, first line only and shortened.
        lost_peer: The rank whose loss the error was (a ``PeerLostError``, raised
            or behind the raised one), else None.
        waited_on: The rank the error timed out waiting for (a
            ``DistributedTimeoutError`` with a peer), else None. With neither,
            the rank failed on its own.

    """

    error: str
    lost_peer: int | None
    waited_on: int | None = None


def record_failure(exc: BaseException) -> None:
    """Write ``exc``'s record where ``$FERRO_ERROR_FILE`` says; nothing without it, or for a clean ``sys.exit``."""
    path = environment.get(ERROR_FILE_ENV)
    if not path or (isinstance(exc, SystemExit) and exc.code in (None, 0)):
        return
    lines = str(exc).strip().splitlines()
    error = f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")[:_MAX_ERROR_CHARS]
    lost_peer, waited_on = _blamed_peer(exc)
    record = {"error": error, "lost_peer": lost_peer, "waited_on": waited_on}
    try:
        with open(f"{path}.tmp", "w") as file:
            json.dump(record, file)
        os.replace(f"{path}.tmp", path)  # whole or absent: the launcher may read it as the rank exits
    except OSError:
        pass  # the rank's own traceback still reaches the output; only the launcher's summary is poorer


def read_failure(path: str) -> FailureRecord | None:
    """Return the record a rank wrote at ``path``, or None (it died without one: a signal, ``os._exit``)."""
    try:
        with open(path) as file:
            data = json.load(file)
        lost, waited = data.get("lost_peer"), data.get("waited_on")
        return FailureRecord(str(data["error"]), lost if isinstance(lost, int) else None,
                             waited if isinstance(waited, int) else None)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _blamed_peer(exc: BaseException) -> tuple[int | None, int | None]:
    """Return ``(lost_peer, waited_on)``: what the first lost-peer or timeout error in ``exc``'s chain names."""
    from ferro.errors import DistributedTimeoutError, PeerLostError  # ferro is imported by now; this module stays light

    seen: BaseException | None = exc
    for _ in range(_MAX_CHAIN):
        if seen is None:
            break
        if isinstance(seen, PeerLostError):
            return seen.peer, None
        if isinstance(seen, DistributedTimeoutError):
            return None, seen.peer
        wrapped = _WRAPPED.search(str(seen)) if isinstance(seen, RuntimeError) else None
        if wrapped is not None:
            peer = int(wrapped.group(2))
            return (peer, None) if wrapped.group(1) == "PeerLostError" else (None, peer)
        seen = seen.__cause__ or seen.__context__
    return None, None

"""What a rank started by ``ferro run`` leaves behind when an exception ends it, for the launcher to name the cause.

One rank's failure closes its connections, and its peers then fail too, each
with a :class:`~ferro.errors.PeerLostError` naming the rank it lost. Under load
such a peer can exit before the rank that failed first, and the launcher, which
sees only exit codes, used to name it. So each rank writes one small record as
its exception leaves the target: a line saying what the error was, and the peer
whose loss it was, if that was the error. The launcher follows those names from
the first rank that exited to the one that failed on its own.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

__all__ = ["ERROR_FILE_ENV", "FailureRecord", "read_failure", "record_failure"]

#: Where ``ferro run`` asks a rank to write its record (one file per rank and attempt).
ERROR_FILE_ENV = "FERRO_ERROR_FILE"
_MAX_ERROR_CHARS = 300
_MAX_CHAIN = 16  # causes and contexts searched for a lost peer


@dataclass(frozen=True)
class FailureRecord:
    """How an exception ended a rank.

    Attributes:
        error: ``"ValueError: the message"``, first line only and shortened.
        lost_peer: The rank whose loss the error was (a ``PeerLostError``, raised
            or behind the raised one), else None: the rank failed on its own.

    """

    error: str
    lost_peer: int | None


def record_failure(exc: BaseException) -> None:
    """Write ``exc``'s record where ``$FERRO_ERROR_FILE`` says; nothing without it, or for a clean ``sys.exit``."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path or (isinstance(exc, SystemExit) and exc.code in (None, 0)):
        return
    lines = str(exc).strip().splitlines()
    error = f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")[:_MAX_ERROR_CHARS]
    record = {"error": error, "lost_peer": _lost_peer(exc)}
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
        lost = data.get("lost_peer")
        return FailureRecord(str(data["error"]), lost if isinstance(lost, int) else None)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _lost_peer(exc: BaseException) -> int | None:
    from ferro.errors import PeerLostError  # ferro is imported by now; this module stays light for the agent

    seen: BaseException | None = exc
    for _ in range(_MAX_CHAIN):
        if seen is None:
            break
        if isinstance(seen, PeerLostError) and seen.peer is not None:
            return seen.peer
        seen = seen.__cause__ or seen.__context__
    return None

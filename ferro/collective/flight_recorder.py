"""The flight recorder: every group's latest calls, and the dump that turns them into a file a person can read.

Each group records its calls where they run (``ferro/_core/recorder.h``): a ring
of the latest ``FERRO_FLIGHT_RECORDER_SIZE`` calls (default 2048; 0 turns it
off) with their sequence number in the group, operation, fingerprint, bytes,
peer, times, state and the user's call site. This module reads the rings of
every live group of the process and writes them, with the stacks of all its
threads, as one JSON file per rank: ``rank-<rank>.json`` in the dump folder
(``$FERRO_DUMP_DIR``, else ``<tmp>/ferro-dumps/<job>``).

Dumps happen on a failed collective (a timeout, a lost peer, a mismatch), on
``SIGUSR1`` (see :mod:`ferro.collective.hang_watch`), when a hang watchdog
asks, and on demand (:func:`dump_flight_record`). ``ferro doctor DIR`` reads
all ranks' dumps and says which rank did not arrive where.

The entries use the field names of torch's flight recorder where the meaning
is the same (``record_id``, ``collective_seq_id``, ``profiling_name``,
``time_created_ns``, ``state``, ``frames``, ...); ``ferro doctor --torch DIR``
writes them in the pickled layout torch's analyser (``torchfrtrace``) reads.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ferro import environment
from ferro._core import state as _state
from ferro.errors import ConfigurationError
from ferro.rendezvous.env import detect
from ferro.types import collective_name, describe_fingerprint, dtype_by_code

__all__ = ["DUMP_DIR_ENV", "SIZE_ENV", "dump_dir", "dump_flight_record", "flight_records", "job_name",
           "set_flight_recorder_size", "where_is"]

log = logging.getLogger("ferro.collective.flight_recorder")

#: Where dumps go (a folder; ``ferro run`` sets it for its ranks).
DUMP_DIR_ENV = "FERRO_DUMP_DIR"
#: Records each group keeps (0: the recorder is off).
SIZE_ENV = "FERRO_FLIGHT_RECORDER_SIZE"
#: Set to 0 to write no dump when a collective fails.
DUMP_ON_FAILURE_ENV = "FERRO_DUMP_ON_FAILURE"
FORMAT = "ferro-flight-recorder"
VERSION = 1

_LIBRARY = str(Path(__file__).resolve().parent.parent) + os.sep  # the ferro package
_STATES = {1: "scheduled", 2: "started", 3: "completed", 4: "failed"}
_KINDS = {0: "collective", 1: "send", 2: "recv", 3: "sendrecv"}


def _configure() -> None:
    include_torch_frames()
    size = environment.get(SIZE_ENV)
    if size:
        try:
            _state.set_recorder_capacity(int(size))
        except ValueError:
            raise ConfigurationError(
                f"{SIZE_ENV}={size!r}: give the number of calls each group's flight recorder keeps (0: off)"
            ) from None


def _extra_prefixes() -> list[str]:
    # Frames of torch sit between a user's call and ferro's when ferro serves torch's API (torch.distributed,
    # DDP's hooks run by autograd): its folder counts as the library's, so a call site is the user's line.
    torch = sys.modules.get("torch")
    location = getattr(torch, "__file__", None)
    if not location:
        return []
    return [str(Path(location).resolve().parent) + os.sep]  # torch's autograd engine calls DDP's hooks, too


def include_torch_frames() -> None:
    """Count torch's frames, if torch is loaded, as library frames for call sites (the interop layer calls this)."""
    _state.set_library_prefixes([_LIBRARY, *_extra_prefixes()])


def set_flight_recorder_size(records: int) -> None:
    """Keep the latest ``records`` calls of every group (0 turns the recorder off); drops what was recorded."""
    _state.set_recorder_capacity(records)


def job_name(environ: dict[str, str] | None = None) -> str:
    """Return the job's dump-folder name: its launcher's id (ferro run, torchrun, SLURM, Open MPI), else the ppid."""
    env = os.environ if environ is None else environ
    own = environment.get("FERRO_RUN_ID", environ=env)
    if own:
        return f"ferro-{own}"
    for key in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "OMPI_MCA_ess_base_jobid"):
        if env.get(key):
            return f"{key.split('_')[0].lower()}-{env[key]}"
    return f"ppid-{os.getppid()}"


def dump_dir() -> Path:
    """Return the folder dumps go to: ``$FERRO_DUMP_DIR``, else ``<tmp>/ferro-dumps/<job>``."""
    given = environment.get(DUMP_DIR_ENV)
    return Path(given) if given else Path(tempfile.gettempdir()) / "ferro-dumps" / job_name()


def job_rank(groups: list[dict[str, Any]]) -> int | None:
    """Return this process's rank in the job.

    The launcher's (``RANK``, Open MPI's, PMI's), else its rank in the largest
    of ``groups`` (described as in a dump), else None.
    """
    try:
        launched = detect(os.environ)
    except ConfigurationError:
        launched = None  # half-set variables: init_process_group says so; a dump goes on without them
    if launched is not None:
        return launched.rank
    sized = [g for g in groups if g.get("world_size")]
    if not sized:
        return None
    largest = max(sized, key=lambda g: g["world_size"])
    return int(largest["ranks"][largest["rank"]])


def _site(code: Any, offset: int) -> dict[str, Any] | None:
    if code is None:
        return None
    line = code.co_firstlineno
    for start, end, number in code.co_lines():
        if start <= offset < end and number is not None:
            line = number
            break
    return {"name": code.co_name, "filename": code.co_filename, "line": line}


def _group_ranks(group: Any) -> list[int]:
    ranks = list(range(group.world_size))
    while getattr(group, "member_ranks", None) is None and hasattr(group, "parent") and hasattr(group, "ranks"):
        ranks = [group.ranks[r] for r in ranks]
        group = group.parent
    named = getattr(group, "member_ranks", None)
    return [named[r] for r in ranks] if named is not None else ranks


def _describe_group(state: Any, ordinals: dict[tuple[int, ...], int]) -> dict[str, Any]:
    group = state.owner() if state.owner is not None else None
    if group is None:
        return {"pg_id": f"group-{state.created}", "desc": "a group already closed", "rank": None,
                "world_size": None, "ranks": None}
    ranks = _group_ranks(group)
    key = tuple(ranks)
    ordinal = ordinals.get(key, 0)
    ordinals[key] = ordinal + 1
    # A labelled group (an elastic epoch) has the same name on every member, however many groups each made.
    label = getattr(group, "label", None)
    pg_id = f"{label} {ranks}" if label else f"{ranks}#{ordinal}"
    return {"pg_id": pg_id, "desc": type(group).__name__, "rank": group.rank,
            "world_size": group.world_size, "ranks": ranks, "closed": bool(getattr(group, "closed", False))}


def _entry(record: tuple[Any, ...], group: dict[str, Any], to_unix: int) -> dict[str, Any]:
    seq, collective, kind, fingerprint, nbytes, peer, queued, started, ended, state, code, offset, number = record
    name = collective_name(collective)
    # Recorder times are CLOCK_MONOTONIC ns, 0 for "not known"; to_unix turns them into Unix ns.
    created, began, finished = (t + to_unix if t else None for t in (queued, started, ended))
    frame = _site(code, offset)
    entry: dict[str, Any] = {
        # Collectives are numbered alike on every rank; a rank's point-to-point calls are not (one rank sends a
        # state to three, each of those receives once), so each side numbers its own, as torch's recorder does.
        "record_id": seq, "collective_seq_id": number, "p2p_seq_id": seq if kind != 0 else None,
        "pg_id": group["pg_id"],
        "process_group": [group["pg_id"], group["desc"]], "profiling_name": f"ferro:{name}", "op": name,
        "kind": _KINDS.get(kind, "collective"), "is_p2p": kind != 0 or name == "p2p",
        "fingerprint": f"{fingerprint:016x}" if fingerprint else None,
        "call": _describe_call(name, kind, fingerprint, nbytes, peer),
        "nbytes": nbytes, "peer": None if peer < 0 else peer, "state": _STATES.get(state, "unknown"),
        "time_created_ns": created, "time_discovered_started_ns": began, "time_discovered_completed_ns": finished,
        "duration_ms": (finished - began) / 1e6 if finished and began else (
            0.0 if state == 3 and not began else None),  # done, never waited for a peer: as fast as it gets
        "frames": [frame] if frame else [],
        "site": f"{frame['filename']}:{frame['line']}" if frame else None,
    }
    dtype = (fingerprint >> 53 & 0x1F) - 1 if fingerprint else -1
    if dtype >= 0:
        try:
            found = dtype_by_code(dtype)
        except (KeyError, ValueError):
            found = None
        if found is not None:
            entry["dtype"] = found.name
    return entry


def _describe_call(name: str, kind: int, fingerprint: int, nbytes: int, peer: int) -> str:
    if kind == 1:
        return f"send of {nbytes} bytes to rank {peer}"
    if kind == 2:
        return f"recv from {'any rank' if peer < 0 else f'rank {peer}'}"
    if kind == 3:
        return f"sendrecv of {nbytes} bytes with rank {peer}"
    if fingerprint:
        return describe_fingerprint(fingerprint)
    return f"{name}({nbytes} bytes)" if nbytes else f"{name}()"


# Where a thread "is" skips the standard library too: a rank waiting in queue.get() or polling a path is at the
# user's line that called it (the whole stack is in the dump).
_STANDARD_LIBRARY = str(Path(sysconfig.get_paths()["stdlib"]).resolve()) + os.sep


# NumPy's and torch's own frames too: a rank stuck behind a DataLoader worker is at the user's `for batch in
# loader`, not in torch/utils/data/dataloader.py, and one evaluating is at its line, not in numpy's _methods.py.
_FRAMEWORKS = tuple(f"-packages{os.sep}{name}{os.sep}" for name in ("torch", "numpy"))


def _is_library(filename: str) -> bool:
    if filename.startswith((_LIBRARY, "<frozen ")) or any(part in filename for part in _FRAMEWORKS):
        return True  # site-packages may lie inside the standard library's folder (pyenv, a system Python)
    return filename.startswith(_STANDARD_LIBRARY) and "-packages" + os.sep not in filename


def _frames(frame: Any) -> list[dict[str, Any]]:
    found = []
    while frame is not None:
        found.append({"name": frame.f_code.co_name, "filename": frame.f_code.co_filename, "line": frame.f_lineno})
        frame = frame.f_back
    return found


def where_is(frames: list[dict[str, Any]]) -> str | None:
    """Return where a thread is in the user's code, as ``file:line in function``.

    That is the innermost of ``frames`` (innermost first) outside ferro, NumPy,
    torch and the standard library, else the innermost; None without frames.
    """
    at = next((frame for frame in frames if not _is_library(frame["filename"])), frames[0] if frames else None)
    return f"{at['filename']}:{at['line']} in {at['name']}" if at else None


def _threads() -> list[dict[str, Any]]:
    names = {t.ident: t for t in threading.enumerate()}
    found = []
    for ident, frame in sys._current_frames().items():
        thread = names.get(ident)
        frames = _frames(frame)
        found.append({"name": thread.name if thread else f"thread {ident}", "ident": ident,
                      "native_id": getattr(thread, "native_id", None), "daemon": bool(thread and thread.daemon),
                      "main": thread is threading.main_thread(), "frames": frames, "where": where_is(frames)})
    found.sort(key=lambda t: (not t["main"], t["name"]))
    return found


def describe_groups(states: Iterable[Any] | None = None) -> list[tuple[Any, dict[str, Any]]]:
    """Return ``(state, description)`` of every live group that made a call: ids, ranks, calls made and ended."""
    ordinals: dict[tuple[int, ...], int] = {}
    described = []
    for state in _state.live_states() if states is None else states:
        calls, completed, capacity = state.progress()
        if calls:
            group = _describe_group(state, ordinals)
            group.update(calls=calls, completed=completed, capacity=capacity, collectives=state.collectives_made())
            described.append((state, group))
    return described


def flight_records(states: Iterable[Any] | None = None) -> list[dict[str, Any]]:
    """Every live group's description and recorded calls (as in a dump's ``"groups"``), oldest call first."""
    to_unix = time.time_ns() - _state.monotonic_ns()
    return [dict(group, entries=[_entry(record, group, to_unix) for record in state.records()])
            for state, group in describe_groups(states)]


def py_spy() -> str | None:
    """Return the path of py-spy (on ``PATH``, or beside this Python: a virtual environment used unactivated)."""
    beside = Path(sys.executable).parent / "py-spy"
    return shutil.which("py-spy") or (str(beside) if beside.is_file() else None)


def py_spy_stacks(pid: int, native: bool) -> list[dict[str, Any]] | None:
    """Return every thread's stack of process ``pid`` as py-spy reads it (None without py-spy, or if it failed).

    ``native``: native frames too; py-spy pauses the process for that read (a process may read itself; about
    0.1 s), and cannot on a stopped one. Without it, py-spy reads without pausing, a stopped process included.
    """
    spy = py_spy()
    if spy is None:
        return None
    try:
        out = subprocess.run([spy, "dump", "--pid", str(pid), "--json", "--native" if native else "--nonblocking"],
                             capture_output=True, text=True, timeout=20)
        threads = json.loads(out.stdout) if out.returncode == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None
    if not isinstance(threads, list):
        return None
    return [{"name": t.get("thread_name") or f"thread {t.get('os_thread_id')}", "native_id": t.get("os_thread_id"),
             "frames": [{"name": f.get("name"), "filename": f.get("filename") or f.get("short_filename"),
                         "line": f.get("line")} for f in t.get("frames", [])]} for t in threads]


def snapshot(reason: str, round_id: str | None = None, signal_traceback: str | None = None,
             native: bool = False) -> dict[str, Any]:
    """Return this rank's dump as a dict: its groups' records, its threads' stacks, where its main thread is.

    ``native``: add every thread's native stack too, where py-spy is installed (``native_threads``).
    """
    threads = _threads()
    main = next((t for t in threads if t["main"]), None)
    groups = flight_records()
    return {
        "format": FORMAT, "version": VERSION, "source": "rank", "rank": job_rank(groups),
        "host": socket.gethostname(), "pid": os.getpid(), "job": job_name(), "reason": reason, "round": round_id,
        "time_ns": time.time_ns(), "groups": groups, "threads": threads,
        "where": main["where"] if main else None, "signal_traceback": signal_traceback,
        "native_threads": py_spy_stacks(os.getpid(), native=True) if native else None,
    }


def write_dump(data: dict[str, Any], folder: Path | None = None) -> Path:
    """Write a dump atomically as ``rank-<rank>.json`` (``pid-<pid>.json`` without a rank) in ``folder``."""
    folder = dump_dir() if folder is None else folder
    folder.mkdir(parents=True, exist_ok=True)
    name = f"rank-{data['rank']}.json" if data.get("rank") is not None else f"pid-{data['pid']}.json"
    return write_json(folder / name, data)


def write_json(path: Path, data: dict[str, Any]) -> Path:
    """Write ``data`` to ``path`` whole or not at all (a temporary file, then a rename): readers never see half."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(data, indent=1, default=str))
    os.replace(temporary, path)
    return path


def dump_flight_record(reason: str = "on demand", folder: str | os.PathLike[str] | None = None,
                       native: bool = True) -> Path:
    """Write this rank's flight record and thread stacks to the dump folder; return the file's path.

    Args:
        reason: Why (kept in the file).
        folder: Where (default ``$FERRO_DUMP_DIR``, else ``<tmp>/ferro-dumps/<job>``).
        native: Add native stacks where py-spy is installed (``pip install 'ferro[doctor]'``; about 0.1 s).

    Example::

        # every rank, after a suspicious step:
        ferro.dump_flight_record("step 120 took 30 s")
        # then: ferro doctor /tmp/ferro-dumps/<job>

    """
    return write_dump(snapshot(reason, native=native), Path(folder) if folder is not None else None)


def request_round(folder: Path, by: str) -> str:
    """Ask every rank's hang watch to write its dump (``request.json`` in ``folder``); return the round's id."""
    round_id = uuid.uuid4().hex
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / "request.json", {"round": round_id, "by": by, "time_ns": time.time_ns()})
    return round_id


def dump_on_failure(reason: str) -> None:
    """Write the dump of a failed collective (unless ``FERRO_DUMP_ON_FAILURE=0``); never raises.

    It also asks the other ranks' hang watches for theirs, so the dump folder
    holds the whole job's view, the rank that caused the failure included.
    """
    if environment.get(DUMP_ON_FAILURE_ENV, "1") == "0" or _state.recorder_capacity() == 0:
        return
    try:
        folder = dump_dir()
        round_id = request_round(folder, reason)
        path = write_dump(snapshot(reason, round_id), folder)
    except Exception as exc:  # a dump must never hide the failure it documents
        log.warning("could not write the flight record: %s", exc)
        return
    log.warning("flight record written to %s (ferro doctor %s reads every rank's)", path, path.parent)


_configure()

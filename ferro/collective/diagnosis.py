"""Reading every rank's flight record at once: which rank did not arrive where, who called what, who lags.

:func:`load_dumps` reads a dump folder (``rank-<r>.json``, as
:mod:`ferro.collective.flight_recorder` writes them, and the outside views the
hang watch writes for ranks that could not answer); :func:`diagnose` lines the
ranks' records up by their sequence number in each group, which is the same on
every rank for the same call, and returns a :class:`Diagnosis` whose
:meth:`~Diagnosis.report` is what ``ferro doctor`` prints:

* a **hang**: the ranks waiting in the group's latest call, the ranks that never
  made it, and where each of those is (its main thread's innermost frame outside
  ferro, and its stack);
* a **mismatch**: at one sequence number, ranks made different calls (operation,
  dtype, size, op or root); the odd ones out are named with their call sites;
* a **straggler** report over the last calls every rank completed: per rank, the
  median time it waited in a collective. The rank that arrives last waits least.

:func:`chrome_trace` turns the records into a Chrome/Perfetto trace, one process per rank.
"""

from __future__ import annotations

import json
import os
import re
import statistics
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ferro.types import THREAD_TAG_BITS

__all__ = ["Diagnosis", "Finding", "chrome_trace", "cpu_share", "diagnose", "holds_up", "idle_outside_calls",
           "in_a_call", "load_dumps"]

#: The least the others must wait (median, ms) for a rank to be called a straggler: below, it is noise.
STRAGGLER_WAIT_MS = 1.0
#: The fewest calls a straggler is named from (a job's first calls wait on its start-up, not on a straggler).
STRAGGLER_MIN_CALLS = 20
#: The share of a core its main thread used from which a rank the others wait for counts as working, not hung.
#: A rank asleep, blocked on a lock or a queue, stopped or frozen uses next to none (0-1 %); one computing on a
#: machine with eight busy processes per core still gets about 12 % (16 ranks on 2 cores read 19 % here, so a
#: quarter of a core was too high). A loop that spins forever counts as working too; the collective timeout
#: (``FERRO_TIMEOUT``) ends that one.
WORKING_CPU_SHARE = 0.05


def load_dumps(folder: str | os.PathLike[str], round_id: str | None = None) -> dict[int, dict[str, Any]]:
    """Read every ``rank-<r>.json`` of ``folder`` (only those of round ``round_id`` when given), by rank."""
    dumps: dict[int, dict[str, Any]] = {}
    for path in sorted(Path(folder).glob("rank-*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # half-written by a rank that died writing it: the others still tell the story
        if round_id is not None and data.get("round") != round_id:
            continue
        rank = data.get("rank")
        if isinstance(rank, int):
            dumps[rank] = data
    return dumps


@dataclass
class Finding:
    """One thing the records show: its kind (``hang`` or ``mismatch``), its culprits, its text."""

    kind: str
    group: str
    culprits: list[int]
    summary: str
    details: list[str] = field(default_factory=list)


@dataclass
class Diagnosis:
    """What :func:`diagnose` found across the ranks' dumps.

    Attributes:
        ranks: The ranks that answered.
        missing: The ranks that did not.
        findings: Hangs and mismatches, the largest groups first.
        stragglers: The straggler report's lines.
        working: The culprits of hangs whose CPU use says they are working (:data:`WORKING_CPU_SHARE`).
        wheres: Where each culprit is, as the summaries say it.

    """

    ranks: list[int]
    missing: list[int]
    findings: list[Finding]
    stragglers: list[str]
    working: list[int] = field(default_factory=list)
    wheres: dict[int, str] = field(default_factory=dict)

    def culprits(self) -> list[int]:
        """Return the ranks the findings blame, in order of appearance."""
        found: list[int] = []
        for finding in self.findings:
            found.extend(r for r in finding.culprits if r not in found)
        return found

    def hung(self) -> list[int]:
        """Return the culprits that are stuck: those of a mismatch, and those of a hang that are not working."""
        return [r for r in self.culprits()
                if r not in self.working or any(f.kind == "mismatch" and r in f.culprits for f in self.findings)]

    def working_note(self) -> str:
        """Say, in one line, which awaited ranks are working and where (for a hang that is not one)."""
        ranks = [r for r in self.culprits() if r in self.working]
        return (f"rank{'s' if len(ranks) > 1 else ''} {_ranges(ranks)} did not arrive where the others wait, but "
                f"{'they are' if len(ranks) > 1 else 'it is'} working, not hung: "
                + "; ".join(f"rank {r} is at {self.wheres.get(r, 'unknown')}" for r in ranks)
                + "; watching on")

    def report(self, stragglers: bool = True) -> str:
        """Return the text ``ferro doctor`` prints (``stragglers=False``: without the straggler report)."""
        lines = [f"ferro doctor: dumps of ranks {_ranges(self.ranks)}"
                 + (f"; no dump from ranks {_ranges(self.missing)}" if self.missing else "")]
        if not self.findings:
            lines.append("no hang and no mismatch: every rank's latest call in every group completed alike")
        for finding in self.findings:
            lines.append(f"{finding.kind.upper()} in group {finding.group}: {finding.summary}")
            lines.extend(f"  {line}" for line in finding.details)
        if stragglers:
            lines.extend(self.stragglers)
        if self.findings:
            lines.append(f"verdict: {self.findings[0].summary}")
        return "\n".join(lines)


def _ranges(ranks: Iterable[int]) -> str:
    return ", ".join(str(r) for r in sorted(ranks)) or "none"


def _where(dump: dict[str, Any] | None) -> str:
    if dump is None:
        return "unknown"
    return str(dump.get("where") or "unknown")


def cpu_share(dump: dict[str, Any] | None) -> float | None:
    """Return the cores a rank kept busy just before its dump (its ``activity``), or None when not measured."""
    share = ((dump or {}).get("activity") or {}).get("cpu_share")
    return float(share) if share is not None else None


def _activity(dump: dict[str, Any] | None) -> str:
    share = cpu_share(dump)
    if share is None:
        return ""
    return f"working: {share:.0%} CPU" if share >= WORKING_CPU_SHARE else f"idle: {share:.0%} CPU"


def _place(rank: int, dumps: dict[int, dict[str, Any]], ended: dict[int, str]) -> str:
    """Where a culprit is, for a summary: its line and whether it works, or how it ended."""
    if rank in ended:
        return f"no longer running: it {ended[rank]}"
    dump = dumps.get(rank)
    activity = _activity(dump)
    return _where(dump) + (f" ({activity})" if activity else "")


def _is_launcher_frame(filename: str) -> bool:
    # ferro run's bootstrap running the user's script: runpy, then ferro/launch/bootstrap.py.
    return filename == "<frozen runpy>" or filename.endswith("runpy.py") or filename.replace("\\", "/").endswith(
        "ferro/launch/bootstrap.py")


def _user_frames(frames: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Return the frames of the rank's own program: innermost first, up to ``ferro run``'s bootstrap.

    Everything outside that frame (the bootstrap, runpy and, in a native stack, the C start-up below them) is the
    same for every rank of every job, and only hides the user's frames in a report.
    """
    for index, frame in enumerate(frames):
        if _is_launcher_frame(str(frame.get("filename", ""))):
            return frames[:index]
    return frames


def _stack(dump: dict[str, Any] | None, limit: int = 12) -> list[str]:
    if dump is None:
        return []
    threads = dump.get("threads") or []
    main = next((t for t in threads if t.get("main")), threads[0] if threads else None)
    if not main:
        return []
    frames = _user_frames(main.get("frames") or [])
    lines = [f"stack of rank {dump.get('rank')}'s {main.get('name', 'main')} thread (innermost first):"]
    lines.extend(f"  {f['filename']}:{f['line']} in {f['name']}" for f in frames[:limit])
    if len(frames) > limit:
        lines.append(f"  ... {len(frames) - limit} more")
    native = next((t for t in dump.get("native_threads") or [] if t.get("native_id") == dump.get("pid")), None)
    if native and native.get("frames"):
        lines.append("its native stack (py-spy, innermost first):")
        lines.extend(f"  {f['name']} ({f['filename']}:{f['line']})" for f in _user_frames(native["frames"])[:limit])
    return lines


def _state_of(dump: dict[str, Any] | None) -> str:
    if dump is None:
        return "sent no dump"
    if dump.get("source") == "outside":
        return str(dump.get("process_state") or "did not answer")
    return ""


def _short(entry: dict[str, Any]) -> str:
    # The call as a person reads it: without the shape's hash and the issuing thread's tag.
    return re.sub(r", (shape hash [0-9a-f]+|from thread tag [0-9a-f]+)", "", str(entry["call"]))


def _call_key(entry: dict[str, Any]) -> tuple[Any, ...]:
    # What ranks must agree on: the fingerprint without its thread tag, else the operation and size.
    fingerprint = entry.get("fingerprint")
    if fingerprint:
        return (entry.get("op"), int(fingerprint, 16) & ~THREAD_TAG_BITS)
    return (entry.get("op"), entry.get("kind"), entry.get("nbytes") if entry.get("kind") == "collective" else None)


def _groups(dumps: dict[int, dict[str, Any]]) -> dict[str, dict[int, dict[str, Any]]]:
    """``{pg_id: {job rank: that rank's group record}}``."""
    found: dict[str, dict[int, dict[str, Any]]] = {}
    for rank, dump in dumps.items():
        for group in dump.get("groups") or []:
            found.setdefault(group["pg_id"], {})[rank] = group
    return found


def _expected(records: dict[int, dict[str, Any]]) -> list[int]:
    """Return the group's members (job ranks), from any rank's description of it."""
    for group in records.values():
        if group.get("ranks"):
            return list(group["ranks"])
    return sorted(records)


def diagnose(dumps: dict[int, dict[str, Any]], world_size: int | None = None, last: int = 50,
             ended: dict[int, str] | None = None, live_for: float | None = None) -> Diagnosis:
    """Line the ranks' records up and say what went wrong, and which ranks lag.

    Args:
        dumps: By job rank, as :func:`load_dumps` returns them.
        world_size: Ranks in the job (default: the largest group's size).
        last: How many of the latest calls every rank completed the straggler report looks at.
        ended: Ranks known to have ended, and how (``"exited with code 1 (TypeError: ...)"``),
            as their launcher saw it: said in place of where they are.
        live_for: Report only hangs that hold a rank up now: one still waits in the call, in a group
            still open, for at least this many seconds (:func:`holds_up`). A launcher deciding whom to
            kill passes it; ``ferro doctor``, reading a job's history, does not.

    Returns:
        The findings, hang and mismatch first, then the straggler report.

    """
    by_group = _groups(dumps)
    sizes = [len(_expected(recs)) for recs in by_group.values()]
    world = world_size or max(sizes + [max(dumps) + 1 if dumps else 0])
    answered = sorted(r for r, d in dumps.items() if d.get("source") != "outside")
    missing = [r for r in range(world) if r not in answered]
    findings: list[Finding] = []
    stragglers: list[str] = []
    # The largest groups first: a hang of the world explains the sub-groups' hangs.
    for pg_id, records in sorted(by_group.items(), key=lambda item: -len(_expected(item[1]))):
        expected = _expected(records)
        mismatch = _mismatch(pg_id, records)
        if mismatch is not None:
            findings.append(mismatch)
            continue
        hang = _hang(pg_id, records, expected, dumps, ended or {}) or _p2p_hang(pg_id, records, expected, dumps,
                                                                                  ended or {})
        if hang is not None and live_for is not None and not holds_up(records, dumps, live_for):
            hang = None
        if hang is not None and not any(f.kind == "hang" and set(hang.culprits) <= set(f.culprits)
                                        for f in findings):
            findings.append(hang)
        if len(expected) > 1:
            stragglers.extend(_straggler(pg_id, records, expected, last))
    culprits = {r for f in findings if f.kind == "hang" for r in f.culprits}
    working = sorted(r for r in culprits if r not in (ended or {}) and (cpu_share(dumps.get(r)) or 0.0)
                     >= WORKING_CPU_SHARE)
    wheres = {r: _place(r, dumps, ended or {}) for r in culprits}
    return Diagnosis(answered, missing, findings, stragglers, working, wheres)


def _collectives(group: dict[str, Any]) -> list[dict[str, Any]]:
    """Return a group record's collective calls: point-to-point ones pair two ranks, never all of them."""
    return [e for e in group.get("entries") or [] if not e.get("is_p2p")]


def _mismatch(pg_id: str, records: dict[int, dict[str, Any]]) -> Finding | None:
    calls: dict[int, dict[int, dict[str, Any]]] = {}
    for rank, group in records.items():
        for entry in _collectives(group):
            calls.setdefault(entry["collective_seq_id"], {})[rank] = entry
    for seq in sorted(calls):
        at = calls[seq]
        if len(at) < 2:
            continue
        kinds = Counter(_call_key(e) for e in at.values())
        if len(kinds) < 2:
            continue
        common = kinds.most_common(1)[0][0]
        odd = sorted(r for r, e in at.items() if _call_key(e) != common)
        usual = sorted(r for r, e in at.items() if _call_key(e) == common)
        sample = at[usual[0]]
        details = [f"ranks {_ranges(usual)} called {_short(sample)} at {sample.get('site')}"]
        details.extend(f"rank {r} called {_short(at[r])} at {at[r].get('site')}" for r in odd)
        summary = (f"at call #{seq} rank{'s' if len(odd) > 1 else ''} {_ranges(odd)} called "
                   f"{_short(at[odd[0]])} at {at[odd[0]].get('site')}, but ranks {_ranges(usual)} called "
                   f"{_short(sample)} at {sample.get('site')}")
        return Finding("mismatch", pg_id, odd, summary, details)
    return None


def _hang(pg_id: str, records: dict[int, dict[str, Any]], expected: list[int],
          dumps: dict[int, dict[str, Any]], ended: dict[int, str]) -> Finding | None:
    made = {r: int(records[r].get("collectives", records[r].get("calls")) or 0) for r in records}
    latest = max(made.values(), default=0)
    last_entry: dict[int, Any] = {r: next(reversed(_collectives(records[r])), None) for r in records}
    # A rank that gave up (its timeout) waited as long as it could: it counts with those still waiting.
    waiting = sorted(r for r in records if made[r] == latest and last_entry[r]
                     and last_entry[r]["state"] in ("started", "scheduled", "failed"))
    if not waiting:
        return None
    behind = sorted(r for r in expected if r not in records or made.get(r, 0) < latest)
    silent = sorted(r for r in expected if r not in dumps or dumps[r].get("source") == "outside")
    culprits = sorted(set(behind) | set(silent))  # a silent rank has no records, so it is never among the waiting
    unrecorded: list[int] = []
    if any(r in ended for r in culprits):
        # A rank ended, and the launcher stopped the others: one stopped before it wrote its record is silent
        # through no fault of its own (seen in CI: the crashed rank's neighbour, slow to see the loss). The rank
        # that ended explains the call; saying the other is "at unknown" would blame it.
        unrecorded = [r for r in culprits if r not in ended and r not in dumps]
        culprits = [r for r in culprits if r not in unrecorded]
    if not culprits:
        return None
    call = last_entry[waiting[0]]
    sites = sorted({str(last_entry[r].get("site")) for r in waiting})
    since = [_waited(last_entry[r], dumps.get(r)) for r in waiting]
    waited = max((s for s in since if s is not None), default=None)
    gave_up = [r for r in waiting if last_entry[r]["state"] == "failed"]
    verb = "waited" if gave_up else "wait"
    details = [f"ranks {_ranges(waiting)} {verb} in call #{latest}: {_short(call)} at {', '.join(sites)}"
               + (f", for {waited:.1f} s" if waited is not None and not gave_up else "")
               + (f" (ranks {_ranges(gave_up)} gave up: timed out or told so)" if gave_up else "")]
    for rank in culprits:
        dump = dumps.get(rank)
        previous = last_entry.get(rank)
        state = _state_of(dump)
        if previous is not None and made.get(rank, 0) < latest:
            last = f"its last call was #{made[rank]} {previous['op']} ({previous['state']}, at {previous.get('site')})"
        elif rank in records:
            last = f"its last call was #{made.get(rank, 0)}"
        else:
            last = "it made no call in this group" if dump is not None and dump.get("source") != "outside" else (
                "its records are unknown")
        if rank in ended:
            details.append(f"rank {rank} never arrived: {last}; {_place(rank, dumps, ended)}")
            continue
        activity = ", ".join(part for part in (state, _activity(dump)) if part)
        details.append(f"rank {rank} never arrived: {last}; it is at {_where(dump)}"
                       + (f" ({activity})" if activity else ""))
        details.extend(f"  {line}" for line in _stack(dump))
    if unrecorded:
        details.append(f"rank{'s' if len(unrecorded) > 1 else ''} {_ranges(unrecorded)} wrote no record: stopped "
                       "with the others after the failure, before writing one")
    places = "; ".join(f"rank {r} is {_place(r, dumps, ended)}" if r in ended else f"rank {r} is at "
                       f"{_place(r, dumps, ended)}" for r in culprits)
    summary = (f"rank{'s' if len(culprits) > 1 else ''} {_ranges(culprits)} did not arrive at call #{latest} "
               f"({_short(call)}), which rank{'s' if len(waiting) > 1 else ''} {_ranges(waiting)} "
               f"{verb}{'s' if len(waiting) == 1 and verb == 'wait' else ''} in; {places}")
    return Finding("hang", pg_id, culprits, summary, details)


def in_a_call(dump: dict[str, Any]) -> bool:
    """Whether a rank's dump shows it inside a call of one of its groups (started or queued, not ended)."""
    for group in dump.get("groups") or []:
        entries = group.get("entries") or []
        if entries and entries[-1].get("state") in ("started", "scheduled"):
            return True
    return False


def holds_up(records: dict[int, dict[str, Any]], dumps: dict[int, dict[str, Any]], stalled: float) -> bool:
    """Whether a group's records show a rank waiting in a call now, in the open group, for ``stalled`` seconds.

    A hang found in records can be over: its waiters gave up and moved on (an elastic job's
    earlier epoch, closed since), or they only just called (a snapshot taken while a peer
    sleeps between steps). Seen in CI: a launcher killed two healthy ranks on such records.

    Args:
        records: One group's records, by job rank (as :func:`diagnose` lines them up).
        dumps: The dumps they came from, by job rank (for the time each was taken).
        stalled: The seconds a wait must have lasted.

    """
    for rank, group in records.items():
        entries = group.get("entries") or []
        if group.get("closed") or not entries or entries[-1].get("state") not in ("started", "scheduled"):
            continue
        waited = _waited(entries[-1], dumps.get(rank))
        if waited is not None and waited >= stalled:
            return True
    return False


def has_exited(dump: dict[str, Any]) -> bool:
    """Return whether a dump is the launcher's outside view of a process that no longer runs."""
    return dump.get("source") == "outside" and str(dump.get("process_state", "")).endswith("has exited")


def idle_outside_calls(dumps: dict[int, dict[str, Any]], stalled: float) -> list[int]:
    """Return the ranks stuck by themselves, idle outside any call.

    That is: no call made or ended for ``stalled`` seconds, none in flight, not waiting
    inside ferro (an elastic rendezvous), and idle (:data:`WORKING_CPU_SHARE`).

    Such a rank holds nobody up yet, so no hang finding names it; under ``ferro run --restart-policy rank``
    the others may have trained on without it, and it would otherwise keep the job from ending.
    """
    found = []
    for rank, dump in sorted(dumps.items()):
        if dump.get("source") == "outside":
            share, waited = cpu_share(dump), None
            if share is not None and share < WORKING_CPU_SHARE and not has_exited(dump):
                found.append(rank)  # could not answer (stopped, or frozen in C) and uses no CPU
            continue
        waited = (dump.get("progress") or {}).get("stalled_for")
        share = cpu_share(dump)
        if (waited is not None and waited >= stalled and not dump.get("inside") and not in_a_call(dump)
                and share is not None and share < WORKING_CPU_SHARE):
            found.append(rank)
    return found


def _p2p_hang(pg_id: str, records: dict[int, dict[str, Any]], expected: list[int],
              dumps: dict[int, dict[str, Any]], ended: dict[int, str]) -> Finding | None:
    """Find a rank waiting in a send or receive whose peer is not waiting in the matching call with it."""
    waiting: dict[int, dict[str, Any]] = {}
    for rank, group in records.items():
        entries = group.get("entries") or []
        last = entries[-1] if entries else None
        if last and last.get("is_p2p") and last.get("peer") is not None and last["state"] in (
                "started", "scheduled", "failed") and 0 <= last["peer"] < len(expected):
            waiting[rank] = last
    pairs = [(rank, expected[entry["peer"]]) for rank, entry in sorted(waiting.items())]
    blamed = [(rank, peer) for rank, peer in pairs if (peer, rank) not in pairs]  # two waiting on each other pair up
    if not blamed:
        return None
    culprits = sorted({peer for _, peer in blamed})
    details = [f"rank {rank} waits in {_short(waiting[rank])} at {waiting[rank].get('site')}" for rank, _ in blamed]
    details += [f"rank {peer} is at {_place(peer, dumps, ended)}" for peer in culprits]
    summary = "; ".join(f"rank {rank} waits in {_short(waiting[rank])} at {waiting[rank].get('site')}, and rank "
                        f"{peer} is at {_place(peer, dumps, ended)}" for rank, peer in blamed)
    return Finding("hang", pg_id, culprits, summary, details)


def _waited(entry: dict[str, Any], dump: dict[str, Any] | None) -> float | None:
    started = entry.get("time_discovered_started_ns") or entry.get("time_created_ns")
    if dump is None:
        return None
    if started:
        return (dump["time_ns"] - started) / 1e9
    seen = (dump.get("progress") or {}).get("stalled_for")
    return float(seen) if seen is not None else None


def _straggler(pg_id: str, records: dict[int, dict[str, Any]], expected: list[int], last: int) -> list[str]:
    done: dict[int, dict[int, float]] = {}
    for rank, group in records.items():
        for entry in group.get("entries") or []:
            if entry["state"] == "completed" and entry.get("duration_ms") is not None and entry["kind"] == "collective":
                done.setdefault(entry["collective_seq_id"], {})[rank] = entry["duration_ms"]
    common = sorted(seq for seq, ranks in done.items() if len(ranks) == len(expected))[-last:]
    if len(common) < 5:
        return []
    medians = {r: statistics.median(done[seq][r] for seq in common) for r in expected}
    last_in = Counter(min(done[seq], key=lambda r: done[seq][r]) for seq in common)
    slowest, times = last_in.most_common(1)[0]
    others = statistics.median(medians[r] for r in expected if r != slowest)
    lines = [f"straggler report for group {pg_id}, over its last {len(common)} calls every rank completed "
             f"(the rank that arrives last waits least):"]
    lines.extend(f"  rank {r}: median wait {medians[r]:.3f} ms, arrived last in {last_in.get(r, 0)} calls"
                 for r in expected)
    if (len(common) >= STRAGGLER_MIN_CALLS and times >= 0.5 * len(common) and medians[slowest] < 0.5 * others
            and others >= STRAGGLER_WAIT_MS):
        site = _common_site(records.get(slowest), common)
        lines.append(f"  straggler: rank {slowest} arrived last in {times} of {len(common)} calls; the others "
                     f"waited a median {others:.3f} ms for it (its calls are made at {site})")
    else:
        lines.append("  no straggler: no rank arrived last in most of them and kept the others waiting"
                     + (f" (too few calls to tell: {len(common)} < {STRAGGLER_MIN_CALLS})"
                        if len(common) < STRAGGLER_MIN_CALLS else ""))
    return lines


def _common_site(group: dict[str, Any] | None, seqs: list[int]) -> str:
    if not group:
        return "unknown"
    wanted = set(seqs)
    sites = Counter(e.get("site") for e in _collectives(group) if e["collective_seq_id"] in wanted)
    return str(sites.most_common(1)[0][0]) if sites else "unknown"


def straggler_of(report: Iterable[str]) -> int | None:
    """Return the rank a straggler report names, or None."""
    for line in report:
        if line.strip().startswith("straggler: rank "):
            return int(line.strip().split()[2])
    return None


def chrome_trace(dumps: dict[int, dict[str, Any]], last: int = 200) -> dict[str, Any]:
    """Return a Chrome/Perfetto trace (ui.perfetto.dev) of each rank's last calls in each group."""
    events: list[dict[str, Any]] = []
    for rank, dump in sorted(dumps.items()):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        for index, group in enumerate(dump.get("groups") or []):
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": index,
                           "args": {"name": f"group {group['pg_id']}"}})
            for entry in (group.get("entries") or [])[-last:]:
                start = entry.get("time_discovered_started_ns") or entry.get("time_created_ns")
                end = entry.get("time_discovered_completed_ns")
                args = {"seq": entry["collective_seq_id"], "call": entry["call"], "state": entry["state"],
                        "site": entry.get("site")}
                if start and end:
                    events.append({"name": entry["op"], "ph": "X", "pid": rank, "tid": index, "ts": start / 1e3,
                                   "dur": max(end - start, 0) / 1e3, "args": args})
                elif start:
                    events.append({"name": entry["op"], "ph": "i", "s": "t", "pid": rank, "tid": index,
                                   "ts": start / 1e3, "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms"}

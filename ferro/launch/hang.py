"""``ferro run``'s hang watchdog: collect every rank's flight record when the job stalls, say why, stop it.

The ranks' hang watches (:mod:`ferro.collective.hang_watch`) notice when none of
their groups made or ended a call for ``--hang-timeout`` seconds and leave a
``suspect-<rank>.json`` in the job's dump folder. The launcher looks for those
every 0.1 s; on one it asks every rank for its dump (a collection round), looks
from outside at the ranks that cannot answer, and judges
(:func:`ferro.collective.diagnosis.diagnose`). When no rank completed a call for
the timeout and the records show a hang or a mismatch, it prints the verdict,
stops the job and exits with :data:`~ferro.collective.hang_watch.HANG_EXIT_CODE`.
When a rank fails on its own (a mismatch, a timeout), the dumps the ranks wrote
as they failed are judged the same way and the verdict follows the failure report.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ferro import environment
from ferro.collective import diagnosis, hang_watch
from ferro.collective.flight_recorder import DUMP_DIR_ENV
from ferro.collective.hang_watch import HANG_EXIT_CODE, HANG_TIMEOUT_ENV, LAUNCHER_COLLECTS_ENV

__all__ = ["HANG_EXIT_CODE", "HangVerdict", "HangWatchdog"]

CHECK_SECONDS = 0.1
#: A rank whose progress moved within this share of the timeout is busy, not stuck.
STALLED_SHARE = 0.8


@dataclass(frozen=True)
class HangVerdict:
    """What the watchdog concluded from one collection round.

    Attributes:
        text: What to print (the verdict, or a note that the awaited ranks are working).
        hung: The ranks judged stuck (empty for a note).
        stuck: Whether the whole job is stuck: no rank made progress within the timeout.
        pids: The process each hung rank's dump came from (a rank replaced since is another process).

    """

    text: str
    hung: list[int] = field(default_factory=list)
    stuck: bool = False
    pids: dict[int, int] = field(default_factory=dict)


def _rank_of_file(name: str) -> int | None:
    """Return the rank a per-rank file of the dump folder belongs to (``hello-3.json``: 3), None for job-wide ones."""
    stem, _, suffix = name.rpartition(".")
    prefix, _, number = stem.rpartition("-")
    if suffix == "json" and prefix in ("hello", "suspect", "rank") and number.isdigit():
        return int(number)
    return None


class HangWatchdog:
    """One node's watchdog.

    The rule, on a rank's suspicion (no call made or ended for ``hang_timeout``
    seconds): collect every rank's dump and look at the ranks the others wait
    for. One that uses next to no CPU (asleep, blocked on a lock or a queue,
    stopped, frozen) is hung. One that keeps a core busy is working (a long
    evaluation, a checkpoint): it is reported, not stopped, and looked at again a
    timeout later; a loop that spins forever is ended by the collective timeout
    instead. With ``per_rank`` (``--restart-policy rank``) a rank idle outside any
    call for the timeout is hung too, even while the others train on without it.

    Args:
        hang_timeout: Seconds without progress on every rank (0: off; dumps on failure still judged).
        dump_dir: The job's dump folder (default ``$FERRO_DUMP_DIR``, else ``<tmp>/ferro-dumps/run-<port>``).
        world_size: Ranks in the job.
        local_ranks: The job ranks this node starts.
        port: The job's master port (names the default folder, the same on every node).
        per_rank: Judge each rank on its own too (the in-place launcher replaces hung ranks).

    """

    def __init__(self, hang_timeout: float, dump_dir: str | None, world_size: int, local_ranks: list[int],
                 port: int, per_rank: bool = False) -> None:
        given = dump_dir or environment.get(DUMP_DIR_ENV)
        self.folder = Path(given) if given else Path(tempfile.gettempdir()) / "ferro-dumps" / f"run-{port}"
        self.hang_timeout = hang_timeout
        self.world_size = world_size
        self.local_ranks = local_ranks
        self.per_rank = per_rank
        self.started = time.time()
        self.next_check = 0.0
        self.recheck_at: float | None = None  # when to look again at ranks found working, or silent once
        self.silent_before: tuple[float, dict[int, Any]] = (0.0, {})  # the last round's silent idle ranks: pids
        self.folder.mkdir(parents=True, exist_ok=True)
        self._clear_earlier_jobs_files()

    def _clear_earlier_jobs_files(self) -> None:
        """Delete what an earlier job left in the folder (it is named by the port, so a later job reuses it).

        Several nodes may share the folder (one file system, or emulated hosts on one machine), and they
        start at different moments: a node clears only its own ranks' files, and the node of rank 0 the
        job-wide ones. Clearing by age alone deleted another node's fresh ``hello`` files, and two nodes
        clearing at once raced (CI: one node's ``stat`` found a file the other had just deleted).
        """
        every_rank = len(self.local_ranks) >= self.world_size
        for old in list(self.folder.iterdir()):
            owner = _rank_of_file(old.name)
            ours = (owner if owner is not None else 0) in self.local_ranks  # job-wide files: rank 0's node's
            if not (every_rank or ours):
                continue
            try:
                if old.is_file() and old.stat().st_mtime < self.started:
                    old.unlink(missing_ok=True)
            except FileNotFoundError:
                pass  # another launcher of the job cleared it first

    def environment(self) -> dict[str, str]:
        """Return what the ranks need: where dumps go, the timeout, and that the launcher collects."""
        return {DUMP_DIR_ENV: str(self.folder), HANG_TIMEOUT_ENV: f"{self.hang_timeout:g}",
                LAUNCHER_COLLECTS_ENV: "launcher"}

    def check(self) -> HangVerdict | None:
        """Return what a collection round concluded when a rank is suspected, else None (cheap then)."""
        now = time.monotonic()
        if self.hang_timeout <= 0 or now < self.next_check:
            return None
        self.next_check = now + CHECK_SECONDS
        suspects = list(self.folder.glob("suspect-*.json"))
        due = self.recheck_at is not None and now >= self.recheck_at
        if not suspects and not due:
            return None
        for path in suspects:
            path.unlink(missing_ok=True)
        self.recheck_at = None
        dumps = hang_watch.collect(self.folder, self.world_size, by="ferro run's hang watchdog",
                                   ranks=self.local_ranks if len(self.local_ranks) < self.world_size else None)
        if any(diagnosis.has_exited(d) for d in dumps.values()):
            # A rank ended while the round ran: the job is finishing, or a rank failed and the launcher's exit
            # handling reports it. Seen in CI: rank 0 ended a long evaluation as the round began, ranks 0, 2
            # and 3 finished and exited before answering, and the one stale answer read as a hang.
            return None
        stalled = STALLED_SHARE * self.hang_timeout
        progressing = any(d.get("source") != "outside" and (d.get("progress") or {}).get("stalled_for", 0.0) < stalled
                          for d in dumps.values())
        # Ranks judged on their own, while others train on, are judged only on waits going on now: records of
        # an abandoned epoch, or a peer caught between steps, are no hang (CI: two healthy ranks were killed so).
        found = diagnosis.diagnose(dumps, self.world_size, live_for=stalled if self.per_rank else None)
        hung = found.hung()  # a rank of another node is that node's launcher's to kill (HangVerdict.pids)
        alone = diagnosis.idle_outside_calls(dumps, stalled) if self.per_rank else []
        alone, unconfirmed = self._confirmed_silent(alone, dumps, now)
        hung += [r for r in alone if r not in hung]
        if unconfirmed:
            self.recheck_at = now + self.hang_timeout / 2  # silent again then: hung; answering late is no hang
        if found.working and not hung:
            # Still not arrived a timeout later: look again.
            self.recheck_at = min(self.recheck_at or float("inf"), now + self.hang_timeout)
            return HangVerdict(found.working_note())
        if not hung or (progressing and not self.per_rank):
            return None  # some rank still makes progress: busy elsewhere, not stuck
        header = (f"no rank made or ended a call for {self.hang_timeout:g} s (--hang-timeout); the job is stuck"
                  if not progressing else
                  f"rank{'s' if len(hung) > 1 else ''} {', '.join(map(str, hung))} made or ended no call for "
                  f"{self.hang_timeout:g} s (--hang-timeout) and {'are' if len(hung) > 1 else 'is'} idle: hung")
        report = found.report(stragglers=False) if found.findings else _alone_report(alone, dumps)
        text = f"{header}\n{report}\ndumps in {self.folder} (ferro doctor {self.folder})"
        (self.folder / "verdict.txt").write_text(text + "\n")
        pids = {r: int(dumps[r]["pid"]) for r in hung if isinstance((dumps.get(r) or {}).get("pid"), int)}
        return HangVerdict(text, hung, stuck=not progressing, pids=pids)

    def _confirmed_silent(self, alone: list[int], dumps: dict[int, dict[str, Any]], now: float
                          ) -> tuple[list[int], list[int]]:
        """Split ranks idle outside any call into ``(judged, held over)``.

        A rank that answered for itself is judged now. One that did not answer (seen from outside)
        is judged only when the same process was silent and idle in the round before too, at most two
        timeouts earlier: on a busy machine a healthy rank sleeping between steps can miss one round's
        answer window (seen in CI).
        """
        silent = {r: dumps[r].get("pid") for r in alone if dumps[r].get("source") == "outside"}
        when, before = self.silent_before
        recent = now - when <= 2 * self.hang_timeout
        confirmed = {r for r, pid in silent.items() if pid is not None and recent and before.get(r) == pid}
        self.silent_before = (now, silent)
        return ([r for r in alone if r not in silent or r in confirmed],
                [r for r in silent if r not in confirmed])

    def explain_failure(self, ended: dict[int, str] | None = None) -> str | None:
        """Judge the dumps the ranks wrote as they failed; return the report when it names a culprit.

        Args:
            ended: Ranks the launcher saw end, and how: a culprit among them is said to have ended so,
                not to be somewhere unknown.

        """
        dumps = {r: d for r, d in diagnosis.load_dumps(self.folder).items()
                 if d.get("time_ns", 0) / 1e9 >= self.started}
        if not dumps:
            return None
        found = diagnosis.diagnose(dumps, self.world_size, ended=ended)
        if not found.findings:
            return None
        return f"{found.report(stragglers=False)}\ndumps in {self.folder} (ferro doctor {self.folder})"


def _alone_report(ranks: list[int], dumps: dict[int, dict[str, Any]]) -> str:
    """Say where each rank idle outside any call is (no finding names them: nobody waits for them yet)."""
    lines = []
    for rank in ranks:
        dump = dumps.get(rank) or {}
        lines.append(f"rank {rank} is at {dump.get('where') or 'unknown'}, outside any call, idle "
                     f"({diagnosis.cpu_share(dump) or 0.0:.0%} CPU)")
    lines.append(f"verdict: {'; '.join(lines)}")
    return "\n".join(lines)

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

import os
import tempfile
import time
from pathlib import Path

from ferro.collective import diagnosis, hang_watch
from ferro.collective.flight_recorder import DUMP_DIR_ENV
from ferro.collective.hang_watch import HANG_EXIT_CODE, HANG_TIMEOUT_ENV, LAUNCHER_COLLECTS_ENV

__all__ = ["HANG_EXIT_CODE", "HangWatchdog"]

CHECK_SECONDS = 0.1
#: A rank whose progress moved within this share of the timeout is busy, not stuck.
STALLED_SHARE = 0.8


class HangWatchdog:
    """One node's watchdog.

    Args:
        hang_timeout: Seconds without progress on every rank (0: off; dumps on failure still judged).
        dump_dir: The job's dump folder (default ``$FERRO_DUMP_DIR``, else ``<tmp>/ferro-dumps/run-<port>``).
        world_size: Ranks in the job.
        local_ranks: The job ranks this node starts.
        port: The job's master port (names the default folder, the same on every node).

    """

    def __init__(self, hang_timeout: float, dump_dir: str | None, world_size: int, local_ranks: list[int],
                 port: int) -> None:
        given = dump_dir or os.environ.get(DUMP_DIR_ENV)
        self.folder = Path(given) if given else Path(tempfile.gettempdir()) / "ferro-dumps" / f"run-{port}"
        self.hang_timeout = hang_timeout
        self.world_size = world_size
        self.local_ranks = local_ranks
        self.started = time.time()
        self.next_check = 0.0
        self.folder.mkdir(parents=True, exist_ok=True)
        for old in self.folder.iterdir():  # an earlier job's files (the folder is named by the port)
            if old.is_file() and old.stat().st_mtime < self.started:
                old.unlink(missing_ok=True)

    def environment(self) -> dict[str, str]:
        """Return what the ranks need: where dumps go, the timeout, and that the launcher collects."""
        return {DUMP_DIR_ENV: str(self.folder), HANG_TIMEOUT_ENV: f"{self.hang_timeout:g}",
                LAUNCHER_COLLECTS_ENV: "launcher"}

    def check(self) -> str | None:
        """Return the verdict when the job is stuck (then stop it), else None. Cheap when nothing is suspected."""
        now = time.monotonic()
        if self.hang_timeout <= 0 or now < self.next_check:
            return None
        self.next_check = now + CHECK_SECONDS
        suspects = list(self.folder.glob("suspect-*.json"))
        if not suspects:
            return None
        for path in suspects:
            path.unlink(missing_ok=True)
        dumps = hang_watch.collect(self.folder, self.world_size, by="ferro run's hang watchdog",
                                   ranks=self.local_ranks if len(self.local_ranks) < self.world_size else None)
        if any(d.get("source") != "outside"
               and (d.get("progress") or {}).get("stalled_for", 0.0) < STALLED_SHARE * self.hang_timeout
               for d in dumps.values()):
            return None  # some rank still makes progress: busy elsewhere, not stuck
        found = diagnosis.diagnose(dumps, self.world_size)
        header = (f"no rank made or ended a call for {self.hang_timeout:g} s (--hang-timeout); "
                  f"the job is stuck")
        report = (found.report(stragglers=False) if found.findings
                  else "no hang in the records: every rank is outside ferro's calls")
        text = f"{header}\n{report}\ndumps in {self.folder} (ferro doctor {self.folder})"
        (self.folder / "verdict.txt").write_text(text + "\n")
        return text

    def explain_failure(self) -> str | None:
        """Judge the dumps the ranks wrote as they failed; return the report when it names a culprit."""
        dumps = {r: d for r, d in diagnosis.load_dumps(self.folder).items()
                 if d.get("time_ns", 0) / 1e9 >= self.started}
        if not dumps:
            return None
        found = diagnosis.diagnose(dumps, self.world_size)
        if not found.findings:
            return None
        return f"{found.report(stragglers=False)}\ndumps in {self.folder} (ferro doctor {self.folder})"

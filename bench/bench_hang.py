"""What a user is told when a job hangs, and how soon: ferro run's watchdog beside torch's gloo.

Each case of ``tests/hangs/cases.py`` runs on 4 ranks twice: under ``ferro run
--hang-timeout T`` and under ``torchrun`` on gloo with ``TORCH_DISTRIBUTED_DEBUG=DETAIL``
and a process-group timeout of T seconds (torch's default for gloo is 30 minutes).
Every output line is stamped as it arrives; the table gives, per case and
library, the seconds from the fault (the culprit prints ``FAULT`` just before it
misbehaves) to the first line that says what happened, that line, and whether
it names the culprit rank.

    python bench/bench_hang.py --timeout 3
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

CASES = Path(__file__).resolve().parent.parent / "tests" / "hangs" / "cases.py"
CULPRITS = {"skip": 2, "spin": 1, "stop": 3, "size": 0, "slow": 3}
# The first line of each library's output that tells the user what went wrong.
# The first line that says where the culprit is: a verdict, a straggler report, or (for a rank that keeps a
# core busy, such as the spin) the note that it works there.
FERRO_TELLS = re.compile(r"ferro run: verdict: |straggler: rank |but it is working, not hung: ")
TORCH_TELLS = re.compile(r"(Error|error|mismatch|Mismatch|Timed out|timed out|Exception|exitcode)")


def _stamped(command: list[str], env: dict[str, str], cwd: str, limit: float) -> list[tuple[float, str]]:
    """Run ``command``; return its output lines (stdout and stderr) with the wall-clock time each arrived."""
    process = subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    lines: queue.Queue[tuple[float, str]] = queue.Queue()

    def pump(stream: object) -> None:
        for line in stream:  # type: ignore[attr-defined]
            lines.put((time.time(), line.rstrip("\n")))

    pumps = [threading.Thread(target=pump, args=(s,), daemon=True) for s in (process.stdout, process.stderr)]
    for thread in pumps:
        thread.start()
    try:
        process.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        process.wait()
        lines.put((time.time(), f"(still running after {limit:g} s: killed)"))
    for thread in pumps:
        thread.join(timeout=5)
    found = []
    while not lines.empty():
        found.append(lines.get())
    return sorted(found)


def _first(lines: list[tuple[float, str]], pattern: re.Pattern[str], after: float) -> tuple[float, str] | None:
    for stamp, line in lines:
        if stamp >= after and pattern.search(line):
            return stamp, line
    return None


def run_case(case: str, library: str, timeout: float, limit: float) -> dict[str, object]:
    """Run one case under one library; return the delay to the first telling line, the line, and the culprit."""
    workdir = tempfile.mkdtemp(prefix=f"hang-{library}-")
    env = dict(os.environ, CASE_TIMEOUT=f"{timeout:g}", FERRO_TIMEOUT="120", PYTHONUNBUFFERED="1")
    if library == "ferro":
        command = [sys.executable, "-m", "ferro", "run", "--nproc-per-node", "4", "--hang-timeout", f"{timeout:g}",
                   "--dump-dir", os.path.join(workdir, "dumps"), str(CASES), case]
        pattern = FERRO_TELLS
    else:
        env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        torchrun = shutil.which("torchrun") or "torchrun"
        command = [torchrun, "--nproc-per-node", "4", "--master-port", str(29400 + os.getpid() % 500), str(CASES),
                   case, "--torch"]
        pattern = TORCH_TELLS
    if library == "ferro" and case == "slow":
        lines = _stamped(command, env, workdir, limit)
        doctor = subprocess.run([sys.executable, "-m", "ferro", "doctor", os.path.join(workdir, "dumps")],
                                capture_output=True, text=True, timeout=120)
        end = time.time()
        lines += [(end, line) for line in doctor.stdout.splitlines()]
    else:
        lines = _stamped(command, env, workdir, limit)
    fault = next((stamp for stamp, line in lines if "FAULT" in line), lines[0][0] if lines else time.time())
    told = _first(lines, pattern, fault)
    shutil.rmtree(workdir, ignore_errors=True)
    culprit = CULPRITS[case]
    if told is None:
        return {"delay": None, "line": "(nothing)", "names_culprit": False}
    stamp, line = told
    # "rank N" or "Ranks N" in the text; not torch's "[rankN]:" prefix, which names the rank that reports.
    names = bool(re.search(rf"(?<!\[)\b[Rr]anks? {culprit}\b", line))
    return {"delay": stamp - fault, "line": line.strip()[:220], "names_culprit": names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=3.0, help="ferro's --hang-timeout and torch's pg timeout")
    parser.add_argument("--cases", default="skip,spin,stop,size,slow")
    parser.add_argument("--limit", type=float, default=120.0, help="seconds before a run is killed")
    args = parser.parse_args()
    print(f"4 ranks on this host; ferro run --hang-timeout {args.timeout:g} vs torchrun + gloo "
          f"(timeout {args.timeout:g} s, TORCH_DISTRIBUTED_DEBUG=DETAIL)")
    for case in args.cases.split(","):
        for library in ("ferro", "torch"):
            result = run_case(case, library, args.timeout, args.limit)
            delay = f"{result['delay']:.1f} s" if result["delay"] is not None else "never"
            print(f"{case:<5} {library:<6} {delay:>7}  names rank {CULPRITS[case]}: "
                  f"{'yes' if result['names_culprit'] else 'no ':<3}  {result['line']}", flush=True)


if __name__ == "__main__":
    main()

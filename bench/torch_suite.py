"""Run torch's own distributed test suite over "ferro" and over "gloo", and count what passes.

The suite is ``DistributedTest._DistTestBase`` in
``torch/testing/_internal/distributed/distributed_test.py`` (285 tests in torch
2.13), run as torch's ``test/distributed/test_distributed_spawn.py`` runs it:
each test in fresh processes, one per rank, file:// rendezvous. Two modes:

* ``shipped``: ``BACKEND=ferro``, the suite as it ships. Tests it reserves for
  gloo by name skip, and groups it asks of "gloo" by name are gloo's.
* ``as-gloo``: ``BACKEND=gloo``, with ferro standing in for every group the
  suite asks gloo for (``init_process_group``/``new_group`` with "gloo" get
  "ferro"), so the gloo-only tests run on ferro too. For gloo itself the two
  modes are the same run.

Usage::

    pip install expecttest            # torch's test utilities need it
    python bench/torch_suite.py                       # both backends, both modes, every test
    python bench/torch_suite.py -k 'all_reduce|send_recv' --backends ferro --modes as-gloo
    python bench/torch_suite.py --json results.json   # every test's outcome, for comparing runs

Prints pass/skip/fail counts per backend and mode, then every test that
passes on gloo but not on ferro, with the first line of its error. Needs no
GPU: CUDA and NCCL tests skip, as they do for gloo.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import unittest

_WORKER_ENV = "FERRO_TORCH_SUITE_WORKER"  # "<backend>:<mode>" in the process that runs the tests


def _stand_in_for_gloo() -> None:
    """Make every group the suite asks of "gloo" a "ferro" group (mode as-gloo; also in the spawned ranks)."""
    import torch.distributed as dist

    import ferro.interop.torch  # noqa: F401 - registers "ferro" (the entry point does too, where installed)

    def swapped(backend):
        return "ferro" if isinstance(backend, str) and backend.lower() == "gloo" else backend

    real_init, real_new_group = dist.init_process_group, dist.new_group

    def init_process_group(backend=None, *args, **kwargs):
        return real_init(swapped(backend) or "ferro", *args, **kwargs)

    def new_group(ranks=None, timeout=None, backend=None, *args, **kwargs):
        return real_new_group(ranks, timeout, swapped(backend), *args, **kwargs)

    dist.init_process_group, dist.new_group = init_process_group, new_group


def _suite_class():
    from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend

    class TorchDistributedSuite(TestDistBackend, DistributedTest._DistTestBase):
        """torch's suite, each test in freshly spawned ranks (as ``test_distributed_spawn.py`` runs it)."""

        def setUp(self):
            super().setUp()
            self._spawn_processes()

    TorchDistributedSuite.__module__ = __name__
    TorchDistributedSuite.__qualname__ = "TorchDistributedSuite"
    return TorchDistributedSuite


if os.environ.get(_WORKER_ENV):  # in the worker and in every rank it spawns (they import this module again)
    if os.environ[_WORKER_ENV].endswith(":as-gloo"):
        _stand_in_for_gloo()
    TorchDistributedSuite = _suite_class()


class _Outcomes(unittest.TextTestResult):
    """Records each test's outcome by name: pass, skip (with the reason) or fail (the error's last line)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.outcomes: dict[str, tuple[str, str]] = {}

    def addSuccess(self, test):  # noqa: N802 - unittest's name
        super().addSuccess(test)
        self.outcomes[test._testMethodName] = ("pass", "")

    def addSkip(self, test, reason):  # noqa: N802
        super().addSkip(test, reason)
        self.outcomes[test._testMethodName] = ("skip", str(reason)[:200])

    def _failed(self, test, err):
        lines = [line for line in self._exc_info_to_string(err, test).splitlines() if line.strip()]
        error = next((line for line in reversed(lines) if re.match(r"^\s*[\w.]*(Error|Exception|Exit)\b", line)),
                     lines[-1] if lines else "")
        self.outcomes[test._testMethodName] = ("fail", error.strip()[:300])

    def addFailure(self, test, err):  # noqa: N802
        super().addFailure(test, err)
        self._failed(test, err)

    def addError(self, test, err):  # noqa: N802
        super().addError(test, err)
        self._failed(test, err)


def _work(pattern: str, out: str) -> None:
    """Run the selected tests here (a worker) and write their outcomes to ``out``."""
    loader = unittest.TestLoader()
    names = [n for n in loader.getTestCaseNames(TorchDistributedSuite) if re.search(pattern, n)]
    suite = unittest.TestSuite(TorchDistributedSuite(name) for name in names)
    runner = unittest.TextTestRunner(resultclass=_Outcomes, verbosity=1, stream=sys.stderr)
    result = runner.run(suite)
    with open(out, "w") as f:
        json.dump(result.outcomes, f, indent=1, sort_keys=True)


def _run_worker(backend: str, mode: str, pattern: str, world_size: int, timeout: float) -> dict[str, list[str]]:
    with tempfile.TemporaryDirectory(prefix="torch-suite-") as temp:
        out = os.path.join(temp, "outcomes.json")
        stand_in = mode if backend == "ferro" else "shipped"  # gloo is gloo in either mode
        env = {**os.environ, _WORKER_ENV: f"{backend}:{stand_in}", "WORLD_SIZE": str(world_size),
               "BACKEND": "gloo" if backend == "gloo" or mode == "as-gloo" else backend,
               "TEMP_DIR": temp, "FERRO_SECRET": os.environ.get("FERRO_SECRET") or os.urandom(16).hex()}
        started = time.monotonic()
        subprocess.run([sys.executable, os.path.abspath(__file__), "--work", pattern, out], env=env,
                       timeout=timeout, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(f"  {backend:6} {mode:8} ran in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
        with open(out) as f:
            return json.load(f)


def main() -> None:
    """Run the suite per backend and mode; print the counts and what passes on gloo only."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", "--pattern", default=".", help="regular expression the test names must match")
    parser.add_argument("--backends", default="ferro,gloo")
    parser.add_argument("--modes", default="shipped,as-gloo")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=7200, help="seconds for each backend and mode")
    parser.add_argument("--json", help="write every test's outcome here")
    parser.add_argument("--work", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.work:
        _work(*args.work)
        return
    results: dict[str, dict[str, list[str]]] = {}
    for mode in args.modes.split(","):
        for backend in args.backends.split(","):
            if backend == "gloo" and mode == "as-gloo" and "gloo:shipped" in results:
                results["gloo:as-gloo"] = results["gloo:shipped"]  # the same run
                continue
            results[f"{backend}:{mode}"] = _run_worker(backend, mode, args.pattern, args.world_size, args.timeout)
    print(f"\ntorch {__import__('torch').__version__}, {args.world_size} ranks, tests matching {args.pattern!r}")
    print(f"{'backend':8} {'mode':9} {'tests':>6} {'pass':>6} {'skip':>6} {'fail':>6}")
    for key, outcomes in results.items():
        backend, mode = key.split(":")
        counts = {kind: sum(1 for o, _ in outcomes.values() if o == kind) for kind in ("pass", "skip", "fail")}
        print(f"{backend:8} {mode:9} {len(outcomes):6} {counts['pass']:6} {counts['skip']:6} {counts['fail']:6}")
    gloo = results.get("gloo:shipped") or results.get("gloo:as-gloo") or {}
    for mode in args.modes.split(","):
        ours = results.get(f"ferro:{mode}", {})
        behind = sorted(name for name, (o, _) in gloo.items() if o == "pass" and ours.get(name, ("?",))[0] != "pass")
        print(f"\npass on gloo, not on ferro ({mode}): {len(behind)}")
        for name in behind:
            outcome, why = ours.get(name, ("missing", ""))
            print(f"  {name}: {outcome} {why}")
    failing = sorted(name for name, (o, _) in gloo.items() if o == "fail")
    print(f"\nfail on gloo itself: {len(failing)}")
    for name in failing:
        print(f"  {name}: {gloo[name][1]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()

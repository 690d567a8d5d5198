"""The flight recorder, the dumps, the hang watch and ferro doctor: which rank, where, and why."""

import inspect
import json
import os
import pickle
import queue
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import ferro
from ferro.collective import diagnosis, flight_recorder, hang_watch
from ferro.testing import run_processes, run_threads
from ferro.types import describe_fingerprint, dtype_by_name, fingerprint

FERRO = [sys.executable, "-m", "ferro"]
CASES = Path(__file__).parent / "hangs" / "cases.py"
SECRET = "0123456789abcdef0123456789abcdef"


def _line(marker):
    """The line of cases.py carrying ``# marker``."""
    for number, text in enumerate(CASES.read_text().splitlines(), 1):
        if text.rstrip().endswith(f"# {marker}"):
            return f"{CASES}:{number}"
    raise AssertionError(f"no line marked {marker}")


def _here():
    frame = inspect.currentframe().f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno + 1}"  # the line after the call


# -- the recorder -------------------------------------------------------------------------------------------------

def _record_calls(group):
    x = np.ones(3, np.float32)
    sites = [_here()]
    ferro.allreduce(x, group=group)
    sites.append(_here())
    ferro.broadcast(x, 0, group=group)
    sites.append(_here())
    ferro.all_gather(x, group=group)
    sites.append(_here())
    ferro.reduce_scatter(np.ones(4, np.float64), group=group)
    if group.rank == 0:
        sites.append(_here())
        ferro.send(x, 1, group=group)
    else:
        sites.append(_here())
        ferro.recv(0, group=group)
    (mine,) = ferro.flight_records([group.state])  # this group's only: other tests' groups may still live here
    return sites, mine


@pytest.mark.parametrize("backend", ["tcp", "shm", "simulated"])
def test_every_call_is_recorded_with_its_seq_call_and_call_site(backend):
    if backend == "simulated":
        results = run_threads(_record_calls, 2)
    else:
        results = run_processes(_record_calls, 2, backend=backend, timeout=120)
    for rank, (sites, group) in enumerate(results):
        entries = group["entries"]
        assert group["rank"] == rank and group["calls"] == group["completed"] == 5
        assert [e["record_id"] for e in entries] == [1, 2, 3, 4, 5]
        # Collectives are numbered alike on every rank; the send (recv) after them keeps the last collective's
        # number, as torch's recorder does, and numbers itself among the rank's point-to-point calls.
        assert [e["collective_seq_id"] for e in entries] == [1, 2, 3, 4, 4] and group["collectives"] == 4
        assert [e["p2p_seq_id"] for e in entries] == [None, None, None, None, 5]
        assert [e["op"] for e in entries] == ["allreduce", "broadcast", "all_gather", "reduce_scatter", "p2p"]
        assert [e["site"] for e in entries] == sites
        assert all(e["state"] == "completed" for e in entries)
        assert entries[0]["nbytes"] == 12 and entries[0]["dtype"] == "float32"
        assert entries[3]["nbytes"] == 32 and entries[3]["dtype"] == "float64"
        assert entries[4]["kind"] == ("send" if rank == 0 else "recv") and entries[4]["peer"] == 1 - rank
        ended = [e["time_discovered_completed_ns"] for e in entries if e["time_discovered_completed_ns"]]
        assert ended == sorted(ended)
    # The same call has the same number and fingerprint on every rank: what lines the ranks up.
    assert [e["fingerprint"] for e in results[0][1]["entries"][:4]] == \
        [e["fingerprint"] for e in results[1][1]["entries"][:4]]


def _ring(group):
    ferro.set_flight_recorder_size(8)
    x = np.ones(1)
    for _ in range(20):
        ferro.allreduce(x, group=group)
    kept = [e["collective_seq_id"] for e in ferro.flight_records()[-1]["entries"]]
    ferro.set_flight_recorder_size(0)
    for _ in range(3):
        ferro.allreduce(x, group=group)
    (off,) = ferro.flight_records()
    ferro.set_flight_recorder_size(2048)
    return kept, off


def test_the_ring_keeps_the_latest_calls_and_the_recorder_can_be_off():
    for kept, off in run_processes(_ring, 2, backend="shm", timeout=60):
        assert kept == list(range(13, 21))
        assert off["entries"] == [] and off["calls"] == off["completed"] == 23  # off: counted, not recorded


def test_bad_recorder_size_is_refused():
    with pytest.raises(ValueError, match=">= 0"):
        ferro.set_flight_recorder_size(-1)


# -- dumps --------------------------------------------------------------------------------------------------------

def _mismatch(group, folder):
    os.environ["FERRO_DUMP_DIR"] = folder
    x = np.ones(2 if group.rank == 1 else 1, np.float32)
    ferro.allreduce(np.ones(1, np.float32), group=group)
    try:
        ferro.allreduce(x, group=group)
    except ferro.CollectiveMismatchError:
        return "mismatch"
    return "no error"


def test_a_failed_collective_dumps_and_doctor_names_the_odd_rank(tmp_path):
    results = run_processes(_mismatch, 3, args=(str(tmp_path),), backend="tcp", timeout=60)
    assert results == ["mismatch"] * 3
    dumps = diagnosis.load_dumps(tmp_path)
    assert sorted(dumps) == [0, 1, 2]
    found = diagnosis.diagnose(dumps)
    assert [f.kind for f in found.findings] == ["mismatch"] and found.culprits() == [1]
    assert "at call #2 rank 1 called allreduce(float32, SUM, 2 elements)" in found.findings[0].summary
    assert all(d["reason"] and "differ" in d["reason"] for d in dumps.values())


def _signal_dump(group, folder):
    os.environ["FERRO_DUMP_DIR"] = folder
    ferro.allreduce(np.ones(1), group=group)
    hang_watch.start_hang_watch(0)
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        path = Path(folder) / f"rank-{group.rank}.json"
        deadline = time.monotonic() + 20
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return json.loads(path.read_text())
    finally:
        hang_watch.stop_hang_watch()


def _stall_after_a_call(group):
    watch = hang_watch._Watch(100.0, group.rank)  # its thread not started: this test polls by hand
    try:
        ferro.allreduce(np.ones(1), group=group)
        watch._watch_progress()  # one poll of its thread
        watch.changed -= 50.0  # the last progress the watch saw was 50 s ago
        ferro.allreduce(np.ones(1), group=group)  # a call made since its last poll
        return watch._snapshot("test", None)["progress"]["stalled_for"]
    finally:
        for fd in (watch.read_end, watch.write_end):
            os.close(fd)


def test_a_dump_counts_the_calls_made_since_the_watch_s_last_poll():
    """Seen in CI: a rank 0.15 s into a new epoch's calls dumped '4.7 s stalled' and the launcher killed it."""
    for stalled in run_processes(_stall_after_a_call, 2, backend="shm", timeout=60):
        assert 0.0 <= stalled < 5.0, stalled


def test_sigusr1_writes_the_record_and_every_thread_s_stack(tmp_path):
    for rank, dump in enumerate(run_processes(_signal_dump, 2, args=(str(tmp_path),), backend="shm", timeout=60)):
        assert dump["reason"] == "signal SIGUSR1" and dump["rank"] == rank
        assert "_signal_dump" in dump["signal_traceback"]  # faulthandler's view at the signal
        assert dump["groups"][-1]["entries"][0]["op"] == "allreduce"
        assert dump["where"].startswith(f"{__file__}:")
        assert any(t["name"] == "ferro-hang-watch" for t in dump["threads"])
        # Native stacks through py-spy (the doctor extra, in the test extra): the main thread's C frames too.
        native = {t["native_id"]: t for t in dump["native_threads"]}
        assert any(f["name"] == "_signal_dump" for f in native[dump["pid"]]["frames"])


# -- the hangs, at 4 ranks under ferro run ------------------------------------------------------------------------

def _ferro_run(case, tmp_path, hang_timeout=3, collective_timeout=60):
    folder = tmp_path / "dumps"
    env = dict(os.environ, FERRO_SECRET=SECRET, FERRO_TIMEOUT=str(collective_timeout))
    env.pop("FERRO_DUMP_DIR", None)
    done = subprocess.run([*FERRO, "run", "--nproc-per-node", "4", "--hang-timeout", str(hang_timeout),
                           "--dump-dir", str(folder), str(CASES), case], capture_output=True, text=True,
                          timeout=180, cwd=tmp_path, env=env)
    return done, folder


def _verdict(stderr):
    return next(line for line in stderr.splitlines() if line.startswith("ferro run: verdict: "))


def _no_secret(folder):
    for path in folder.iterdir():
        assert SECRET not in path.read_text(errors="replace"), path


@pytest.mark.parametrize("case, culprit, marker, call", [
    # Rank 2 skipped one of 8 allreduces, then went on to evaluate: the others wait in their 8th, its 7th matched.
    ("skip", 2, "CULPRIT evaluate", 8),
    ("stop", 3, "CULPRIT stop", 6),  # SIGSTOPped before it: read from outside, by py-spy
])
def test_the_watchdog_names_the_rank_that_did_not_arrive_and_its_line(tmp_path, case, culprit, marker, call):
    done, folder = _ferro_run(case, tmp_path)
    # 86: the watchdog stopped it, not the 60 s collective timeout (FERRO_TIMEOUT=60), which exits with 1.
    assert done.returncode == hang_watch.HANG_EXIT_CODE, done.stderr[-3000:]
    verdict = _verdict(done.stderr)
    waiting = ", ".join(str(r) for r in range(4) if r != culprit)
    assert f"rank {culprit} did not arrive at call #{call}" in verdict, verdict
    assert f"which ranks {waiting} wait in" in verdict and _line(marker) in verdict, verdict
    assert f"wait in call #{call}: allreduce(float32, SUM, 1 elements) at {_line('WAIT')}" in done.stderr
    # ferro doctor reads the same dumps to the same verdict.
    doctor = subprocess.run([*FERRO, "doctor", str(folder)], capture_output=True, text=True, timeout=60,
                            cwd=tmp_path)  # not the clone's root, whose ferro/ is the uncompiled source
    assert doctor.returncode == 1 and f"verdict: rank {culprit} did not arrive" in doctor.stdout
    assert _line(marker) in doctor.stdout
    _no_secret(folder)


def test_a_rank_working_longer_than_the_hang_timeout_is_reported_not_stopped(tmp_path):
    """Rank 0 computes for 7 s before the 6th allreduce, --hang-timeout 3: the job is healthy and finishes."""
    done, folder = _ferro_run("evaluate", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    note = next(line for line in done.stderr.splitlines() if "working, not hung" in line)
    assert note.startswith("ferro run: rank 0 did not arrive where the others wait, but it is working, not hung: "
                           f"rank 0 is at {_line('CULPRIT evaluate-batch')}"), note
    assert "% CPU" in note and "stopping the job" not in done.stderr
    assert all(f"rank {rank} done" in done.stdout for rank in range(4)), done.stdout


def test_a_rank_spinning_forever_is_reported_working_and_ended_by_the_collective_timeout(tmp_path):
    """A busy loop looks like work from outside (its CPU use): the watchdog says where it is, the timeout ends it."""
    done, folder = _ferro_run("spin", tmp_path, collective_timeout=8)
    assert done.returncode == 1, done.stderr[-3000:]
    assert (f"rank 1 did not arrive where the others wait, but it is working, not hung: rank 1 is at "
            f"{_line('CULPRIT spin')}") in done.stderr
    assert "ferro run: rank 1 stopped responding" in done.stderr, done.stderr[-3000:]
    assert "verdict: rank 1 did not arrive at call #6" in done.stderr and _line("CULPRIT spin") in _verdict(
        done.stderr)


def test_a_crashed_rank_is_said_to_have_ended_not_to_be_somewhere_unknown(tmp_path):
    done, folder = _ferro_run("crash", tmp_path)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "ferro run: rank 1 exited with code 1 (TypeError: object of type 'int' has no len())" in done.stderr
    verdict = _verdict(done.stderr)
    assert ("rank 1 is no longer running: it exited with code 1 (TypeError: object of type 'int' has no len())"
            in verdict), verdict
    assert "unknown" not in verdict, verdict


def test_the_verdict_names_every_hung_rank_and_its_line(tmp_path):
    done, folder = _ferro_run("two", tmp_path)
    assert done.returncode == hang_watch.HANG_EXIT_CODE, done.stderr[-3000:]
    verdict = _verdict(done.stderr)
    assert "ranks 1, 2 did not arrive at call #6" in verdict, verdict
    assert f"rank 1 is at {_line('CULPRIT two-1')}" in verdict and f"rank 2 is at {_line('CULPRIT two-2')}" in verdict


def test_where_skips_torch_frames_to_the_user_s_line():
    """A rank stuck behind a DataLoader worker waits in torch's dataloader.py, called from the user's loop."""
    dataloader = pytest.importorskip("torch.utils.data.dataloader")
    frames = [{"name": "get", "filename": queue.__file__, "line": 180},
              {"name": "_get_data", "filename": dataloader.__file__, "line": 1100},
              {"name": "__next__", "filename": dataloader.__file__, "line": 700},
              {"name": "train", "filename": "/home/me/train.py", "line": 42}]
    assert flight_recorder.where_is(frames) == "/home/me/train.py:42 in train"


def test_only_a_reduction_shows_its_op():
    float32 = dtype_by_name("float32").code
    assert "SUM" not in describe_fingerprint(fingerprint("broadcast", float32, 0, 0, 16))
    assert describe_fingerprint(fingerprint("broadcast", float32, 0, 2, 16)).startswith("broadcast(float32, root 2, 16")
    assert describe_fingerprint(fingerprint("allreduce", float32, 3, 0, 16)).startswith("allreduce(float32, MAX, 16")


def test_a_rank_calling_another_size_is_named_with_its_line(tmp_path):
    done, folder = _ferro_run("size", tmp_path)
    assert done.returncode == 1, done.stderr[-3000:]
    verdict = _verdict(done.stderr)
    assert verdict.startswith(f"ferro run: verdict: at call #6 rank 0 called allreduce(float32, SUM, 2 elements) "
                              f"at {_line('CULPRIT size')}, but ranks 1, 2, 3 called allreduce(float32, SUM, 1 "
                              f"elements) at {_line('WAIT')}"), verdict
    _no_secret(folder)


def test_doctor_names_the_straggler_and_writes_traces(tmp_path):
    done, folder = _ferro_run("slow", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    trace, torch_dir = tmp_path / "trace.json", tmp_path / "torch"
    doctor = subprocess.run([*FERRO, "doctor", str(folder), "--trace", str(trace), "--torch", str(torch_dir)],
                            capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert doctor.returncode == 0, doctor.stderr
    report = doctor.stdout.splitlines()
    assert diagnosis.straggler_of(report) == 3, doctor.stdout
    assert f"its calls are made at {_line('WAIT')}" in doctor.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1, 2, 3}
    assert sum(1 for e in events if e.get("ph") == "X" and e["pid"] == 0) >= 40  # rank 0 waited in each call
    # torch's own analyser reads the converted dumps and finds the ranks' calls in agreement.
    layout = pickle.loads((torch_dir / "rank0").read_bytes())
    assert layout["version"] == "2.10" and len(layout["entries"]) == 50
    pytest.importorskip("torch")
    analysed = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(torch_dir)],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert analysed.returncode == 0, analysed.stderr[-2000:]
    _no_secret(folder)


def test_without_ferro_run_the_first_rank_to_notice_collects_and_stops_the_job(tmp_path):
    """Under torchrun, mpirun or srun: the ranks' own hang watch gives the verdict."""
    folder = tmp_path / "dumps"
    port = str(29000 + os.getpid() % 1000)
    ranks = []
    for rank in range(4):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="4", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   FERRO_SECRET=SECRET, FERRO_TIMEOUT="60", FERRO_HANG_TIMEOUT="3", FERRO_DUMP_DIR=str(folder))
        env.pop("FERRO_HANG_COLLECTOR", None)
        ranks.append(subprocess.Popen([sys.executable, str(CASES), "two"], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, cwd=tmp_path))
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and all(p.poll() is None for p in ranks):
            time.sleep(0.1)
        collectors = [p for p in ranks if p.poll() == hang_watch.HANG_EXIT_CODE]
        assert collectors, [p.poll() for p in ranks]
        stderr = collectors[0].stderr.read()
        assert "verdict: ranks 1, 2 did not arrive at call #6" in stderr and _line("CULPRIT two-1") in stderr, stderr
        assert "ranks 1, 2 did not arrive" in (folder / "verdict.txt").read_text()
    finally:
        for process in ranks:
            process.kill()
            process.wait()


# -- the diagnosis itself -----------------------------------------------------------------------------------------

def _dump(rank, calls, state="completed", where="train.py:9 in main", durations=None):
    entries = [{"collective_seq_id": s, "op": "allreduce", "kind": "collective", "is_p2p": False,
                "fingerprint": "0420000000100000", "call": "allreduce(float32, SUM, 1 elements)", "nbytes": 4,
                "state": state if s == calls else "completed", "site": "train.py:5",
                "duration_ms": (durations or {}).get(s, 1.0), "time_created_ns": None,
                "time_discovered_started_ns": None, "time_discovered_completed_ns": None}
               for s in range(1, calls + 1)]
    group = {"pg_id": "[0, 1, 2]#0", "desc": "TcpBackend", "rank": rank, "world_size": 3, "ranks": [0, 1, 2],
             "calls": calls, "completed": calls - (state != "completed"), "entries": entries}
    return {"rank": rank, "source": "rank", "time_ns": 0, "where": where, "groups": [group], "threads": []}


def test_a_rank_with_no_dump_and_no_outside_view_is_still_the_culprit():
    dumps = {0: _dump(0, 4, "started"), 1: _dump(1, 4, "started")}
    found = diagnosis.diagnose(dumps, 3)
    assert found.missing == [2] and found.culprits() == [2]
    assert "rank 2 did not arrive at call #4" in found.findings[0].summary


def test_a_rank_stopped_before_its_record_is_not_blamed_beside_the_rank_that_crashed():
    """CI: rank 1 crashed; rank 0 was stopped by the launcher before it wrote its record; rank 2 waited."""
    dumps = {2: _dump(2, 6, "failed")}
    ended = {1: "exited with code 1 (TypeError: object of type 'int' has no len())"}
    found = diagnosis.diagnose(dumps, 3, ended=ended)
    assert found.culprits() == [1]
    summary = found.findings[0].summary
    assert "rank 1 did not arrive at call #6" in summary and "unknown" not in summary, summary
    assert "rank 0 wrote no record: stopped with the others after the failure" in found.report()
    # Without a rank that ended (the hang watch, ferro doctor), a silent rank is still the culprit.
    assert diagnosis.diagnose(dumps, 3).culprits() == [0, 1]


def test_the_verdict_says_rank_or_ranks_as_many_wait():
    one_waits = diagnosis.diagnose({0: _dump(0, 4, "started"), 1: _dump(1, 3)}, 3).findings[0].summary
    assert "which rank 0 waits in;" in one_waits and "ranks 0 wait" not in one_waits, one_waits
    two_wait = diagnosis.diagnose({0: _dump(0, 4, "started"), 1: _dump(1, 4, "started"), 2: _dump(2, 3)},
                                  3).findings[0].summary
    assert "which ranks 0, 1 wait in;" in two_wait, two_wait


def test_a_stack_ends_at_the_user_s_module_not_in_ferro_run_s_bootstrap():
    dump = _dump(1, 3, where="cases.py:86 in main")
    bootstrap = "/site-packages/ferro/launch/bootstrap.py"
    dump["threads"] = [{"main": True, "name": "MainThread", "frames": [
        {"filename": "cases.py", "line": 86, "name": "main"}, {"filename": "cases.py", "line": 98, "name": "<module>"},
        {"filename": "<frozen runpy>", "line": 88, "name": "_run_code"},
        {"filename": bootstrap, "line": 152, "name": "_run_target"}]}]
    dump["pid"] = 7
    dump["native_threads"] = [{"native_id": 7, "frames": [
        {"filename": "/usr/lib/libc.so.6", "line": 0, "name": "clock_nanosleep"},
        {"filename": "cases.py", "line": 86, "name": "main"}, {"filename": "cases.py", "line": 98, "name": "<module>"},
        {"filename": "<frozen runpy>", "line": 88, "name": "_run_code"},
        {"filename": bootstrap, "line": 159, "name": "<module>"},
        {"filename": "/usr/lib/libc.so.6", "line": 0, "name": "0x7f7086a4524a"}]}]
    lines = diagnosis._stack(dump)
    assert lines[1:3] == ["  cases.py:86 in main", "  cases.py:98 in <module>"] and "runpy" not in "".join(lines)
    assert lines[-1] == "  <module> (cases.py:98)" and "bootstrap" not in "".join(lines), lines
    # Under torchrun or mpirun there is no bootstrap: the whole stack is the user's.
    dump["threads"][0]["frames"] = dump["threads"][0]["frames"][:2]
    assert diagnosis._stack(dump)[1:3] == ["  cases.py:86 in main", "  cases.py:98 in <module>"]


def test_no_finding_when_every_rank_completed_alike():
    found = diagnosis.diagnose({r: _dump(r, 6) for r in range(3)})
    assert found.findings == [] and "no hang and no mismatch" in found.report()


def test_a_straggler_needs_to_make_the_others_wait():
    quick = {s: 0.0 for s in range(1, 31)}
    # Rank 2 arrives last in every call, but the others wait 0.01 ms: noise, not a straggler.
    dumps = {r: _dump(r, 30, durations=quick if r == 2 else {s: 0.01 for s in quick}) for r in range(3)}
    assert diagnosis.straggler_of(diagnosis.diagnose(dumps).stragglers) is None
    dumps = {r: _dump(r, 30, durations=quick if r == 2 else {s: 30.0 for s in quick}) for r in range(3)}
    assert diagnosis.straggler_of(diagnosis.diagnose(dumps).stragglers) == 2
    # ... over enough calls: a job's first few wait on its start-up.
    dumps = {r: _dump(r, 10, durations=quick if r == 2 else {s: 30.0 for s in quick}) for r in range(3)}
    assert diagnosis.straggler_of(diagnosis.diagnose(dumps).stragglers) is None


def _watchdog_round(tmp_path, monkeypatch, dumps):
    from ferro.launch.hang import HangWatchdog

    watchdog = HangWatchdog(3.0, str(tmp_path), 3, [0, 1, 2], port=1)
    (tmp_path / "suspect-0.json").write_text("{}")
    monkeypatch.setattr(hang_watch, "collect", lambda *args, **kwargs: dumps)
    return watchdog.check()


def test_a_round_that_finds_an_awaited_rank_exited_is_the_job_ending_not_a_hang(tmp_path, monkeypatch):
    """Seen in CI: the awaited ranks finished and exited as the round ran; only a stale wait answered."""
    waiting = {r: _dump(r, 6, "started") for r in (0, 1)}
    for dump in waiting.values():
        dump["progress"] = {"stalled_for": 6.8}
    gone = {"rank": 2, "source": "outside", "pid": 1, "time_ns": 0, "groups": [], "threads": [], "where": None,
            "process_state": "process 1 did not answer; its state: S (sleeping)", "activity": {"cpu_share": 0.0}}
    verdict = _watchdog_round(tmp_path, monkeypatch, {**waiting, 2: gone})
    assert verdict is not None and verdict.hung == [2] and verdict.stuck  # alive and idle: hung
    gone = {**gone, "process_state": "process 1 has exited"}
    gone.pop("activity")
    assert _watchdog_round(tmp_path, monkeypatch, {**waiting, 2: gone}) is None


def _elastic_dumps(waited_in_open_group):
    """Ranks 0 and 2 of an elastic job: epoch 0 ([0, 1, 2], closed) abandoned at call #6, epoch 1 ([0, 2]) open.

    In epoch 1 rank 0 waits in call #4 for ``waited_in_open_group`` seconds and rank 2, asleep between
    steps, has made 3 calls. Rank 1 is a replacement that has joined no epoch yet.
    """
    dumps = {}
    for rank in (0, 2):
        old = _dump(rank, 6, "failed")["groups"][0]
        old.update(pg_id="epoch 0 [0, 1, 2]", closed=True)
        new = _dump(rank, 4 if rank == 0 else 3, "started" if rank == 0 else "completed")["groups"][0]
        new.update(pg_id="epoch 1 [0, 2]", ranks=[0, 2], world_size=2, rank=[0, 2].index(rank), closed=False)
        stalled = waited_in_open_group if rank == 0 else 0.3
        dumps[rank] = {"rank": rank, "source": "rank", "pid": 100 + rank, "time_ns": 0, "where": "train.py:9",
                       "groups": [old, new], "threads": [], "progress": {"stalled_for": stalled},
                       "activity": {"cpu_share": 0.0}, "inside": None}
    dumps[1] = {"rank": 1, "source": "rank", "pid": 101, "time_ns": 0, "where": "train.py:3", "groups": [],
                "threads": [], "progress": {"stalled_for": 0.5}, "activity": {"cpu_share": 0.0},
                "inside": "a join request"}
    return dumps


def _per_rank_watchdog(tmp_path, monkeypatch, rounds):
    """A ``--restart-policy rank`` watchdog (timeout 3 s) and its verdict on each of ``rounds`` (dumps)."""
    from ferro.launch.hang import HangWatchdog

    watchdog = HangWatchdog(3.0, str(tmp_path), 3, [0, 1, 2], port=1, per_rank=True)
    verdicts = []
    for dumps in rounds:
        (tmp_path / "suspect-0.json").write_text("{}")
        watchdog.next_check = 0.0
        monkeypatch.setattr(hang_watch, "collect", lambda *args, dumps=dumps, **kwargs: dumps)
        verdicts.append(watchdog.check())
    return verdicts


def test_ranks_judged_on_their_own_are_judged_on_waits_going_on_now(tmp_path, monkeypatch):
    """Seen in CI: an abandoned epoch's records and a peer caught between steps got two healthy ranks killed."""
    # Epoch 0's waiters gave up and moved on, and rank 0 has waited 0.1 s in epoch 1: no hang holds anyone up.
    assert _per_rank_watchdog(tmp_path, monkeypatch, [_elastic_dumps(0.1)]) == [None]
    # ferro doctor, reading the history, still reports both (the same dumps, without live_for).
    found = diagnosis.diagnose(_elastic_dumps(0.1), 3)
    assert sorted(r for f in found.findings for r in f.culprits) == [1, 2], found.report()
    # Rank 0 waiting 2.5 s (beyond 0.8 of the timeout) for rank 2, which is idle: rank 2 is hung.
    [verdict] = _per_rank_watchdog(tmp_path, monkeypatch, [_elastic_dumps(2.5)])
    assert verdict is not None and verdict.hung == [2] and verdict.pids == {2: 102}, verdict


def test_a_rank_that_does_not_answer_is_hung_only_when_silent_twice(tmp_path, monkeypatch):
    """Seen in CI: a replacement sleeping between steps missed one round's answer window and was killed."""
    def silent(pid):
        return {**_elastic_dumps(0.1), 1: {"rank": 1, "source": "outside", "pid": pid, "time_ns": 0, "groups": [],
                                           "threads": [], "where": None, "activity": {"cpu_share": 0.0},
                                           "process_state": f"process {pid} did not answer; its state: S"}}

    first, second = _per_rank_watchdog(tmp_path, monkeypatch, [silent(201), silent(201)])
    assert first is None and second is not None and second.hung == [1] and second.pids == {1: 201}, second
    # Another process each round (the rank was replaced between them): each is silent once, neither is hung.
    assert _per_rank_watchdog(tmp_path, monkeypatch, [silent(201), silent(202)]) == [None, None]
    # Silent once, then it answers: not hung.
    assert _per_rank_watchdog(tmp_path, monkeypatch, [silent(201), _elastic_dumps(0.1)]) == [None, None]


def test_nodes_sharing_a_dump_folder_each_clear_only_their_own_ranks_earlier_files(tmp_path):
    """Seen in CI: two emulated hosts' launchers share /tmp; the later one deleted the other's fresh files."""
    from ferro.launch.hang import HangWatchdog

    earlier = time.time() - 3600
    stale = ["hello-0.json", "hello-3.json", "rank-2.json", "suspect-1.json", "request.json", "verdict.txt"]
    for name in stale:
        (tmp_path / name).write_text("{}")
        os.utime(tmp_path / name, (earlier, earlier))
    HangWatchdog(3.0, str(tmp_path), 4, [0, 1], port=1)  # the node of ranks 0 and 1 starts first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hello-3.json", "rank-2.json"]
    (tmp_path / "hello-0.json").write_text("{}")  # its rank 0 says hello before the other node starts
    time.sleep(0.01)
    HangWatchdog(3.0, str(tmp_path), 4, [2, 3], port=1)
    # The other node clears its own ranks' stale files and leaves rank 0's fresh one.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hello-0.json"]

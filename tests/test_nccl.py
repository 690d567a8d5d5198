"""NCCL through ctypes, on machines without a GPU: the loader, the mappings, the error ladder, the exact
prototypes (checked by a stub libnccl that records what it receives), the groups' control flow over real
processes and sockets (set-up, watchdog, blame, routing of the hybrid group), and the clear errors where
no GPU, driver or libnccl exists. The GPU itself is exercised by test_nccl_gpu.py where one is present.
"""

import ctypes
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from _nccl_stub import FakeGpuArray, compile_stub, read_log, stub_env

import ferro
from ferro.backend.nccl import cuda, library
from ferro.backend.nccl.library import Candidate, candidates, decode_version
from ferro.backend.nccl.results import nccl_error
from ferro.backend.nccl.types import reduction
from ferro.errors import (
    BackendUnavailableError,
    ConfigurationError,
    DistributedTimeoutError,
    InvalidBufferError,
    NcclError,
    PeerLostError,
    TransportError,
)
from ferro.testing import run_processes
from ferro.types import ReduceOp

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the stubs are Linux shared objects")


@pytest.fixture(scope="module")
def stubs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stubs")
    return compile_stub("nccl", folder / "libnccl_stub.so"), compile_stub("cuda", folder / "libcuda_stub.so")


@pytest.fixture
def stubbed(stubs, tmp_path, monkeypatch):
    """This process loads the stubs (the loaders' caches are cleared around the test); returns the log path."""
    log = tmp_path / "stub.log"
    for key, value in stub_env(*stubs, log).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("FERRO_SECRET", "stub-test")
    library.load_library.cache_clear()
    cuda.load_driver.cache_clear()
    yield log
    library.load_library.cache_clear()
    cuda.load_driver.cache_clear()


def _python(code: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    full = {**os.environ, **env}
    full["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(ferro.__file__).parents[1]), full.get("PYTHONPATH"))
                                         if p)
    return subprocess.run([sys.executable, "-c", code], env=full, cwd=cwd, capture_output=True, text=True,
                          timeout=120)


# --- the loader --------------------------------------------------------------------------------------

def test_candidates_follow_the_documented_order(tmp_path):
    wheel = tmp_path / "site" / "nvidia" / "nccl" / "lib"
    wheel.mkdir(parents=True)
    (wheel / "libnccl.so.2").write_bytes(b"")
    found = candidates({"FERRO_NCCL_LIBRARY": "/opt/mine/libnccl.so"}, [str(tmp_path / "site"), "/nowhere"],
                       ["/usr/lib/libc.so.6", "/torch/lib/libnccl.so.2.27.3", "/other/libnccl.so.2"])
    assert [c.source for c in found] == ["FERRO_NCCL_LIBRARY", "already loaded in this process",
                                         "the nvidia-nccl wheel", "the system's libraries"]
    assert found[0].path == "/opt/mine/libnccl.so"
    assert found[1].path == "/torch/lib/libnccl.so.2.27.3"  # the first one loaded, once
    assert found[2].path == str(wheel / "libnccl.so.2")
    assert candidates({}, [], []) == [Candidate("the system's libraries", found[3].path)]


def test_loader_picks_the_wheel_then_what_the_process_loaded(stubs, tmp_path):
    nccl, _ = stubs
    wheel = tmp_path / "site" / "nvidia" / "nccl" / "lib"
    wheel.mkdir(parents=True)
    (wheel / "libnccl.so.2").write_bytes(nccl.read_bytes())
    other = tmp_path / "torchlib"
    other.mkdir()
    (other / "libnccl.so.2").write_bytes(nccl.read_bytes())
    code = ("import ctypes, sys; sys.path.insert(0, {site!r}); {preload}"
            "from ferro.backend.nccl.library import load_library; lib = load_library(); "
            "print(lib.source, '|', lib.path, '|', lib.version)")
    env = {"FERRO_NCCL_LIBRARY": ""}
    plain = _python(code.format(site=str(tmp_path / "site"), preload=""), env, tmp_path)
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.split(" | ") == ["the nvidia-nccl wheel", str(wheel / "libnccl.so.2"), "(2, 27, 3)\n"]
    preloaded = _python(code.format(site=str(tmp_path / "site"),
                                    preload=f"ctypes.CDLL({str(other / 'libnccl.so.2')!r}); "), env, tmp_path)
    assert preloaded.returncode == 0, preloaded.stderr
    assert preloaded.stdout.split(" | ")[:2] == ["already loaded in this process", str(other / "libnccl.so.2")]


def test_missing_library_and_old_versions_are_refused_clearly(stubs, tmp_path):
    nccl, _ = stubs
    code = ("from ferro.backend.nccl.library import load_library\ntry:\n    load_library()\n"
            "except Exception as e:\n    print(type(e).__name__, e)")
    missing = _python(code, {"FERRO_NCCL_LIBRARY": str(tmp_path / "nope.so")}, tmp_path)
    assert missing.stdout.startswith("BackendUnavailableError NCCL: libnccl not found")
    assert "nope.so" in missing.stdout and "pip install nvidia-nccl-cu12" in missing.stdout
    old = _python(code, {"FERRO_NCCL_LIBRARY": str(nccl), "FERRO_STUB_NCCL_VERSION": "21500"}, tmp_path)
    assert "is NCCL 2.15.0; ferro needs 2.18.0 or newer" in old.stdout


def test_versions_decode_both_schemes():
    assert decode_version(22703) == (2, 27, 3)
    assert decode_version(23007) == (2, 30, 7)
    assert decode_version(2708) == (2, 7, 8)


# --- enums, dtypes, errors ----------------------------------------------------------------------------

def test_dtype_and_op_mapping_matches_nccl_h():
    version = (2, 27, 3)
    assert reduction("float32", ReduceOp.SUM, "allreduce", version) == (7, 0, 1)
    assert reduction("float16", ReduceOp.MEAN, "allreduce", version) == (6, 4, 1)
    assert reduction("bfloat16", ReduceOp.MAX, "allreduce", version) == (9, 2, 1)
    assert reduction("int64", ReduceOp.MIN, "allreduce", version) == (4, 3, 1)
    assert reduction("uint8", ReduceOp.PRODUCT, "allreduce", version) == (1, 1, 1)
    assert reduction("float64", ReduceOp.AVG, "allreduce", version) == (8, 4, 1)
    assert reduction("complex64", ReduceOp.SUM, "allreduce", version) == (7, 0, 2)  # pairs of float32
    assert reduction("float8_e4m3fn", ReduceOp.SUM, "allreduce", version) == (10, 0, 1)


@pytest.mark.parametrize(("dtype", "op", "says"), [
    ("int32", ReduceOp.BAND, "NCCL has no BAND reduction"),
    ("int32", ReduceOp.BXOR, "NCCL has no BXOR reduction"),
    ("int16", ReduceOp.SUM, "NCCL cannot reduce int16"),
    ("bool", ReduceOp.MAX, "NCCL cannot reduce bool"),
    ("int32", ReduceOp.MEAN, "MEAN of int32 would not be an integer"),
    ("complex64", ReduceOp.MAX, "MAX of complex64 is not defined"),
])
def test_what_nccl_lacks_is_refused_by_name(dtype, op, says):
    with pytest.raises(InvalidBufferError, match=says):
        reduction(dtype, op, "allreduce", (2, 27, 3))


def test_float8_needs_a_recent_nccl():
    with pytest.raises(InvalidBufferError, match="float8_e5m2 needs NCCL 2.24.0 or newer; this one is 2.20.1"):
        reduction("float8_e5m2", ReduceOp.SUM, "allreduce", (2, 20, 1))


class _Texts:
    """What nccl_error reads from a library: its error strings."""

    def ncclGetErrorString(self, result):
        return f"string {result}".encode()

    def ncclGetLastError(self, comm):
        return b"peer 10.0.0.2 closed the connection\n"


@pytest.mark.parametrize(("result", "kind", "name"), [
    (6, PeerLostError, "ncclRemoteError"),
    (2, TransportError, "ncclSystemError"),
    (8, DistributedTimeoutError, "ncclTimeout"),
    (1, NcclError, "ncclUnhandledCudaError"),
    (3, NcclError, "ncclInternalError"),
    (4, NcclError, "ncclInvalidArgument"),
    (5, NcclError, "ncclInvalidUsage"),
])
def test_error_ladder_maps_each_result_and_keeps_nccls_text(result, kind, name):
    error = nccl_error(_Texts(), result, "ncclAllReduce", 3)
    assert type(error) is kind
    assert str(error).startswith(f"rank 3: NCCL ncclAllReduce failed: {name} (string {result}): peer 10.0.0.2 "
                                 f"closed the connection")
    if kind is NcclError:
        assert error.result == result


# --- exact prototypes, against the recording stub -------------------------------------------------------

def test_prototypes_pass_size_t_counts_and_the_unique_id_by_value(stubbed):
    lib = library.load_library()
    assert lib.source == "FERRO_NCCL_LIBRARY"
    unique_id = library.UniqueId()
    assert lib.ncclGetUniqueId(ctypes.byref(unique_id)) == 0
    raw = ctypes.string_at(ctypes.addressof(unique_id), 128)
    assert raw[5] == 0 and raw[6] == (6 * 7 + 3)  # whole, zero byte included
    comm = ctypes.c_void_p()
    config = library.Config.non_blocking()
    assert lib.ncclCommInitRankConfig(ctypes.byref(comm), 4, unique_id, 2, ctypes.byref(config)) == 7
    huge = 2**33 + 5  # past 32 bits: an int prototype would truncate or refuse it
    assert lib.ncclAllReduce(0x1000, 0x1000, huge, 7, 4, comm, 0x77) == 0
    assert lib.ncclSend(0x2000, huge, 1, 3, comm, 0x78) == 0
    assert lib.ncclReduce(0x1000, 0x2000, huge, 9, 2, 1, comm, 0x79) == 0
    log = read_log(stubbed)
    expected_sum = sum(b * (i + 1) for i, b in enumerate(raw))
    assert log[1] == (f"ncclCommInitRankConfig nranks=4 rank=2 id_sum={expected_sum} config_size=40 magic=cafebeef "
                      f"version=21700 blocking=0")
    assert log[2] == f"ncclAllReduce count={huge} dtype=7 op=4 stream=0x77 inplace=1"
    assert log[3] == f"ncclSend count={huge} dtype=1 peer=3 stream=0x78"
    assert log[4] == f"ncclReduce count={huge} dtype=9 op=2 root=1 stream=0x79"


def test_injected_results_become_ferro_errors_with_nccls_last_error(stubbed, monkeypatch):
    group = ferro.NcclBackend(0, 1, master_port=_port(), timeout=20)
    try:
        monkeypatch.setenv("FERRO_STUB_FAIL", "ncclAllReduce=6")
        with pytest.raises(PeerLostError, match=r"ncclRemoteError \(stub error string 6\): stub: injected failure "
                                                r"in ncclAllReduce \[a peer rank failed or exited"):
            ferro.allreduce(FakeGpuArray(np.ones(3, np.float32)), group=group)
        # the communicator was aborted: every later call says so and why
        monkeypatch.delenv("FERRO_STUB_FAIL")
        with pytest.raises(PeerLostError, match="aborted after an earlier failure"):
            ferro.allreduce(FakeGpuArray(np.ones(3, np.float32)), group=group)
        assert "ncclCommAbort" in read_log(stubbed)
    finally:
        group.close()


def _port() -> int:
    from ferro.rendezvous.settings import free_port

    return free_port()


# --- one rank over the stubs: the control flow of every call ------------------------------------------

def test_world_size_one_group_runs_every_call_on_the_callers_stream(stubbed):
    group = ferro.NcclBackend(0, 1, master_port=_port(), timeout=20)
    try:
        x = np.arange(6, dtype=np.float32)
        assert ferro.allreduce(FakeGpuArray(x, stream=0x31), ReduceOp.MEAN, group=group).array is x
        out = np.zeros(6, np.float32)
        ferro.all_gather(FakeGpuArray(x), out=FakeGpuArray(out), group=group)
        np.testing.assert_array_equal(out, x)  # one rank: the gather is a copy
        ferro.broadcast(FakeGpuArray(np.zeros(5, np.float64)), root=0, group=group)
        ferro.reduce(FakeGpuArray(np.zeros(4, np.int64)), dst=0, op=ReduceOp.MAX, group=group)
        work = ferro.allreduce(FakeGpuArray(x, stream=0x32), group=group, async_op=True)
        assert work.synchronize() is not None and work.is_completed()
        work.wait()
        ferro.barrier(group=group)
        log = read_log(stubbed)
        own = hex(group.device_collectives.stream)
    finally:
        group.close()
    calls = [line for line in log if line.startswith("nccl")]
    assert calls[2:8] == [
        "ncclAllReduce count=6 dtype=7 op=4 stream=0x31 inplace=1",
        "ncclAllGather count=24 dtype=1 stream=0x7",  # bytes: 6 float32
        "ncclBroadcast count=40 dtype=1 root=0 stream=0x7",
        "ncclReduce count=4 dtype=4 op=2 root=0 stream=0x7",
        # async: on the communicator's own stream, after the caller's
        f"ncclAllReduce count=6 dtype=7 op=0 stream={own} inplace=1",
        f"ncclAllReduce count=1 dtype=2 op=0 stream={own} inplace=1",  # the barrier: one int32
    ]
    async_part = log[log.index(f"ncclAllReduce count=6 dtype=7 op=0 stream={own} inplace=1") - 2:]
    assert async_part[0].startswith("cuEventRecord") and async_part[0].endswith("stream=0x32")
    assert async_part[1].startswith(f"cuStreamWaitEvent stream={own}")
    assert read_log(stubbed)[-2:] == ["ncclCommFinalize", "ncclCommDestroy"]


def test_a_finished_operation_reads_completed_without_the_watchdog(stubbed, monkeypatch):
    """Launches do not wake the watchdog (each wake cost the caller its poll), so is_completed() retires work itself."""
    from ferro.backend.nccl import watchdog

    monkeypatch.setattr(watchdog, "POLL_IDLE_SECONDS", 120.0)  # the watchdog, once idle, does not look again
    group = ferro.NcclBackend(0, 1, master_port=_port(), timeout=20)
    try:
        time.sleep(0.2)  # past the watchdog's first look, into its idle wait
        x = np.arange(6, dtype=np.float32)
        work = ferro.allreduce(FakeGpuArray(x), group=group, async_op=True)
        assert work.is_completed()  # the stub's events are done at once
        assert "done" in repr(work)
        assert not group.device_collectives.busy
    finally:
        group.close()


def test_nccl_group_refuses_host_memory_and_stays_usable(stubbed):
    group = ferro.NcclBackend(0, 1, master_port=_port(), timeout=20)
    try:
        with pytest.raises(InvalidBufferError, match="moves GPU memory only; for host arrays and objects use "
                                                     "backend='hybrid'"):
            ferro.allreduce(np.ones(3), group=group)
        with pytest.raises(InvalidBufferError, match="moves GPU memory only"):
            ferro.broadcast_object({"a": 1}, group=group)
        with pytest.raises(InvalidBufferError, match="NCCL has no BOR reduction"):
            ferro.allreduce(FakeGpuArray(np.ones(3, np.int32)), ReduceOp.BOR, group=group)
        with pytest.raises(InvalidBufferError, match="read-only"):
            ferro.allreduce(FakeGpuArray(np.ones(3, np.float32), readonly=True), group=group)
        with pytest.raises(InvalidBufferError, match="not C-contiguous"):
            ferro.allreduce(FakeGpuArray(np.ones((4, 4), np.float32)[:, ::2]), group=group)
        with pytest.raises(InvalidBufferError, match="allocates GPU results for PyTorch tensors and CuPy arrays"):
            ferro.reduce_scatter(FakeGpuArray(np.ones(4, np.float32)), group=group)
        x = np.full(3, 2.0, np.float32)
        ferro.allreduce(FakeGpuArray(x), group=group)  # none of the refusals broke the group
        assert group.failure is None
    finally:
        group.close()


def test_set_up_that_never_finishes_times_out_and_aborts(stubbed, monkeypatch):
    monkeypatch.setenv("FERRO_STUB_INIT_HANG", "1")
    with pytest.raises(DistributedTimeoutError, match="creating the NCCL communicator of 1 ranks did not finish in "
                                                      "time: NCCL was still connecting"):
        ferro.NcclBackend(0, 1, master_port=_port(), timeout=1.5)
    assert read_log(stubbed)[-1] == "ncclCommAbort"


def test_a_rank_that_never_comes_is_named(stubbed):
    with pytest.raises(DistributedTimeoutError, match=r"rank\(s\) \[1\] did not join the NCCL group"):
        ferro.NcclBackend(0, 2, master_port=_port(), timeout=2)


def test_asynchronous_nccl_errors_fail_the_group(stubbed, monkeypatch):
    group = ferro.NcclBackend(0, 1, master_port=_port(), timeout=20)
    try:
        monkeypatch.setenv("FERRO_STUB_ASYNC_ERROR", "2")
        deadline = time.monotonic() + 30
        while group.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)  # the watchdog polls ncclCommGetAsyncError
        assert "ncclSystemError" in (group.failure or "")
        with pytest.raises(TransportError, match="stub: injected asynchronous error 2"):
            ferro.allreduce(FakeGpuArray(np.ones(2, np.float32)), group=group)
    finally:
        group.close()


# --- several ranks over the stubs: real processes, real sockets ----------------------------------------

def _pid_and_device(group):
    return os.getpid(), group.device_collectives.device


def test_ranks_take_their_local_gpu(stubs, tmp_path):
    env = stub_env(*stubs, tmp_path / "log", FERRO_STUB_DEVICES="2")
    results = run_processes(_pid_and_device, 2, backend="nccl", env=env, timeout=120)
    assert [device for _, device in results] == [0, 1]


def _expect_duplicate(rank, world_size, slow_reader):
    if rank == slow_reader:  # reads the GPU reports late, as a loaded rank does, after rank 0 has refused them
        from ferro.rendezvous.store import Store

        get = Store.get

        def late_get(self, key, timeout=None):
            time.sleep(0.5)
            return get(self, key, timeout)

        Store.get = late_get
    try:
        ferro.NcclBackend(rank, world_size, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=30)
    except ConfigurationError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("slow_reader", [None, 1], ids=["together", "rank1_reads_late"])
def test_two_ranks_on_one_gpu_are_named(stubs, tmp_path, slow_reader):
    # Rank 0 serves the store and closes it with its refusal: a rank still reading got "store closed" instead.
    env = stub_env(*stubs, tmp_path / "log", FERRO_STUB_DEVICES="1")
    messages = run_processes(_expect_duplicate, 2, backend=None, args=(slow_reader,), env=env, timeout=120)
    for rank, message in enumerate(messages):
        assert message.startswith(f"rank {rank}: rank 0 (cuda:0) and rank 1 (cuda:0) use the same GPU (PCI "
                                  f"0000:01:00.0) on one host"), message
        assert "torch.cuda.set_device" in message and "NCCL_MULTI_RANK_GPU_ENABLE=1" in message


def _hybrid_routing(group):
    rank = group.rank
    host = np.full(4, rank + 1.0)
    ferro.allreduce(host, group=group)  # TCP
    tcp_bytes = group.stats()["allreduce"]["bytes_sent"]
    device = np.full(4, rank + 1.0, np.float32)
    ferro.allreduce(FakeGpuArray(device), group=group)  # NCCL (the stub leaves one rank's data)
    after = group.stats()["allreduce"]["bytes_sent"]
    obj = ferro.broadcast_object({"from": rank}, root=1, group=group)
    ferro.barrier(group=group)
    evens = ferro.new_group([0], group=group)  # rank 1 takes part in the split, left out
    both = ferro.new_group([0, 1], group=group)
    sub = np.full(2, rank + 1.0)
    ferro.allreduce(sub, group=both)
    ferro.allreduce(FakeGpuArray(np.ones(2, np.float32)), group=both)
    return os.getpid(), host.tolist(), tcp_bytes, after, obj, evens is None, sub.tolist()


def test_hybrid_sends_host_memory_over_tcp_and_gpu_memory_to_nccl(stubs, tmp_path):
    log = tmp_path / "log"
    results = run_processes(_hybrid_routing, 2, backend="hybrid",
                            env=stub_env(*stubs, log, FERRO_STUB_DEVICES="2"), timeout=120)
    for rank, (pid, host, tcp_bytes, after, obj, left_out, sub) in enumerate(results):
        assert host == [3.0] * 4 and sub == [3.0, 3.0]
        assert tcp_bytes > 0 and after == tcp_bytes  # the GPU allreduce moved nothing over TCP
        assert obj == {"from": 1}
        assert left_out == (rank == 1)
        lines = read_log(log, pid)
        assert "ncclAllReduce count=4 dtype=7 op=0 stream=0x7 inplace=1" in lines
        splits = [line for line in lines if line.startswith("ncclCommSplit")]
        # new_group([0]): rank 0 joins with a color, rank 1 with NCCL_SPLIT_NOCOLOR; then both join [0, 1]
        assert splits[0].startswith("ncclCommSplit color=-1") == (rank == 1)
        assert splits[1].startswith("ncclCommSplit color=") and f"key={rank}" in splits[1]
        assert lines.count("ncclAllReduce count=2 dtype=7 op=0 stream=0x7 inplace=1") == 1  # on the sub-group


def _stuck_on_rank_0(group):
    store_key = "test/rank0-done"
    if group.rank == 0:
        os.environ["FERRO_STUB_EVENT_HANG"] = "1"  # the allreduce "runs" on the GPU and never completes
        work = ferro.allreduce(FakeGpuArray(np.ones(8, np.float32)), group=group, async_op=True, timeout=3)
        try:
            work.synchronize()
            message = "completed"
        except DistributedTimeoutError as exc:
            message = str(exc)
        os.environ.pop("FERRO_STUB_EVENT_HANG")
        group.store.set(store_key, b"1")
        return os.getpid(), message
    group.store.get(store_key, timeout=60)  # rank 1 never calls the allreduce
    return os.getpid(), ""


def test_watchdog_blames_the_rank_that_did_not_issue_the_call(stubs, tmp_path):
    log = tmp_path / "log"
    results = run_processes(_stuck_on_rank_0, 2, backend="nccl", env=stub_env(*stubs, log, FERRO_STUB_DEVICES="2"),
                            timeout=120)
    pid, message = results[0]
    assert message.startswith("rank 0: NCCL operation #1 (allreduce float32[8]) did not complete within its "
                              "timeout: rank 1 has not issued #1: its last is #0 (none)"), message
    assert "ncclCommAbort" in read_log(log, pid)


def _rank_1_dies(group):
    if group.rank == 1:
        os._exit(3)
    time.sleep(1.5)  # rank 1's heartbeat (0.3 s) goes stale
    os.environ["FERRO_STUB_EVENT_HANG"] = "1"
    work = ferro.allreduce(FakeGpuArray(np.ones(8, np.float32)), group=group, async_op=True, timeout=1)
    try:
        work.synchronize()
    except DistributedTimeoutError as exc:
        return str(exc)
    return "completed"


def test_watchdog_names_a_dead_rank(stubs, tmp_path):
    env = stub_env(*stubs, tmp_path / "log", FERRO_NCCL_HEARTBEAT_S="0.3", FERRO_STUB_DEVICES="2")
    results = run_processes(_rank_1_dies, 2, backend="nccl", env=env, timeout=120, allow_exit=[1])
    assert "rank 1 stopped reporting" in results[0] and "(its process died or froze)" in results[0], results[0]


# --- no GPU, no driver, no NCCL; and the host round trip -------------------------------------------------

def test_without_a_gpu_init_fails_at_once_naming_what_is_missing(tmp_path, stubs):
    # rank 1 of 2 with no store anywhere: had ferro started the rendezvous first, this would wait out its timeout
    code = ("import ferro\ntry:\n    ferro.init_process_group('{backend}', init_method='tcp://127.0.0.1:9', "
            "rank=1, world_size=2, timeout=600)\nexcept ferro.BackendUnavailableError as e:\n    print(e)")
    for backend in ("nccl", "hybrid"):
        nothing = _python(code.format(backend=backend),
                          {"FERRO_NCCL_LIBRARY": str(tmp_path / "none.so"),
                           "FERRO_CUDA_DRIVER_LIBRARY": str(tmp_path / "libcuda-none.so"), "FERRO_SECRET": "s"},
                          tmp_path)
        assert nothing.stdout.startswith(f"backend '{backend}' cannot run in this process: no NVIDIA driver"), \
            nothing.stdout + nothing.stderr
        assert "libnccl not found" in nothing.stdout and "pip install nvidia-nccl-cu12" in nothing.stdout
    no_gpu = _python(code.format(backend="nccl"), {**stub_env(*stubs, tmp_path / "log"),
                                                   "FERRO_STUB_CUDA_INIT": "100", "FERRO_SECRET": "s"}, tmp_path)
    assert "no usable GPU" in no_gpu.stdout and "no CUDA-capable GPU is visible" in no_gpu.stdout, no_gpu.stdout
    assert "libnccl" not in no_gpu.stdout  # the stub libnccl loaded: only the GPU is missing


def test_gpu_buffers_on_a_host_group_are_refused_with_the_way_out():
    from ferro.testing import run_threads

    run_threads(_refuse_gpu_on_host_group, 1)


def _refuse_gpu_on_host_group(group):
    with pytest.raises(InvalidBufferError, match="in GPU memory, but this group .* moves host memory only: use "
                                                 "backend='nccl' or 'hybrid'"):
        ferro.allreduce(FakeGpuArray(np.ones(2, np.float32)), group=group)
    with pytest.raises(BackendUnavailableError, match="FERRO_ENABLE_GPU_FALLBACK=1"):
        ferro.gpu_allreduce(FakeGpuArray(np.ones(2, np.float32)), group=group)


def _round_trip(group):
    os.environ["FERRO_ENABLE_GPU_FALLBACK"] = "1"
    x = np.arange(5, dtype=np.float64) * (group.rank + 1)
    ferro.gpu_allreduce(FakeGpuArray(x), group=group)
    y = np.arange(3, dtype=np.int32) + 10 * group.rank
    ferro.gpu_broadcast(FakeGpuArray(y), root=1, group=group)
    return os.getpid(), x.tolist(), y.tolist()


def test_host_round_trip_when_enabled_gives_exact_results_over_tcp(stubs, tmp_path):
    log = tmp_path / "log"
    results = run_processes(_round_trip, 3, env=stub_env(*stubs, log), timeout=120)
    for pid, x, y in results:
        assert x == (np.arange(5, dtype=np.float64) * 6).tolist()
        assert y == [10, 11, 12]
        lines = read_log(log, pid)
        assert lines.count("cuMemcpyDtoH bytes=40") == 1 and lines.count("cuMemcpyHtoD bytes=12") == 1

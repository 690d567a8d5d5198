"""Distributed checkpoints: exact across layouts and world sizes, crash-safe, verified, and async without tearing."""

import json
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
from test_fsdp import numpy_model  # the same Linear/Tanh stack FSDP is tested on

import ferro
from ferro import checkpoint, nn
from ferro.dtensor import Partial, Replicate, Shard, distribute_tensor
from ferro.parallel.fsdp import ShardedEntry
from ferro.testing import run_processes, run_threads

pytest.importorskip("safetensors")
torch = pytest.importorskip("torch")

SIZES = [7, 5, 3, 2, 1]  # no size divisible by 4; Linear(2, 1) holds 3 elements, so at 4 ranks one share is empty
BATCH = 12  # divisible by 1, 2, 3 and 4: equal shares, so every world size trains on the same mean gradient
LR, WEIGHT_DECAY = 0.05, 0.1
SAVED_AT = 2
STEPS = 4


def batches():
    rng = np.random.default_rng(3)
    return [(rng.standard_normal((BATCH, SIZES[0])), rng.standard_normal((BATCH, SIZES[-1]))) for _ in range(STEPS)]


def make_model(seed):
    return numpy_model(seed, SIZES)


def build(kind, group, seed=0):
    """A model held as ``kind`` ("fsdp", "ddp" or "plain") and its Adam optimizer."""
    model = make_model(seed)
    if kind == "fsdp":
        net = ferro.FSDP(model, group=group, sharding_strategy="full_shard",
                         auto_wrap_policy=lambda m: isinstance(m, nn.Linear))
        return net, nn.Adam(net.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    net = ferro.DDP(model, group=group) if kind == "ddp" else model
    return net, nn.Adam(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)


def train(net, optimizer, data, group):
    rank, world = (0, 1) if group is None else (group.rank, group.world_size)
    for x, y in data:
        x, y = np.array_split(x, world)[rank], np.array_split(y, world)[rank]
        optimizer.zero_grad()
        criterion = nn.MSELoss()
        criterion(net(x), y)
        net.backward(criterion.backward())
        optimizer.step()


def full_state(net, optimizer):
    """The whole model and Adam state by parameter name (collective under FSDP)."""
    if isinstance(net, ferro.FSDP):
        params = {k: np.array(v) for k, v in net.full_state_dict().items()}
        optim = {name: {k: np.array(v) for k, v in entry.items()}
                 for name, entry in net.full_optim_state_dict(optimizer)["state"].items()}
        return params, optim
    module = net.module if isinstance(net, ferro.DDP) else net
    optim = {name: {k: np.array(v) for k, v in optimizer.state[p].items()} for name, p in module.named_parameters()}
    return module.state_dict(), optim


def extras(group):
    """Plain values a real job saves: step, data-loader position, the data RNG's state (equal on every rank)."""
    rng = np.random.default_rng(11)
    rng.standard_normal(5)
    return {"step": SAVED_AT, "loader": {"epoch": 0, "position": SAVED_AT * BATCH, "order": (3, 1, 2)},
            "rng": rng.bit_generator.state}


def rank_save(group, kind, path):
    net, optimizer = build(kind, group)
    data = batches()
    train(net, optimizer, data[:SAVED_AT], group)
    state = checkpoint.get_state_dict(net, optimizer) | extras(group)
    empty = sum(isinstance(v, ShardedEntry) and v.local.size == 0 for v in state["model"].values())
    checkpoint.save(state, path, group)
    saved = full_state(net, optimizer)
    train(net, optimizer, data[SAVED_AT:], group)
    return {"saved": saved, "continued": full_state(net, optimizer)[0], "empty_shares": empty}


def rank_resume(group, kind, path):
    net, optimizer = build(kind, group, seed=77)  # other initial values: the load must replace all of them
    state = checkpoint.get_state_dict(net, optimizer) | {"step": 0, "loader": None, "rng": None}
    checkpoint.load(state, path, group)
    checkpoint.set_state_dict(net, optimizer, state)
    loaded = full_state(net, optimizer)
    train(net, optimizer, batches()[state["step"]:], group)
    return {"loaded": loaded, "continued": full_state(net, optimizer)[0],
            "plain": {k: state[k] for k in ("step", "loader", "rng")}}


def assert_bit_exact(loaded, saved):
    params, optim = loaded
    assert list(params) == list(saved[0])
    for name, value in saved[0].items():
        assert np.array_equal(params[name], value), name
    assert optim.keys() == saved[1].keys()
    for name, entry in saved[1].items():
        assert entry.keys() == optim[name].keys()
        for key, value in entry.items():
            assert np.array_equal(optim[name][key], value), f"{name} {key}"


def assert_close(continued, expected):
    for name, value in expected.items():
        np.testing.assert_allclose(continued[name], value, rtol=0, atol=1e-12, err_msg=name)


@pytest.fixture(scope="module")
def saved_at_four(tmp_path_factory):
    """FSDP FULL_SHARD at 4 real processes: trained 2 steps, saved, then trained on at 4 ranks."""
    path = str(tmp_path_factory.mktemp("fsdp4") / "step_2")
    results = run_processes(rank_save, 4, args=("fsdp", path), timeout=120)
    assert sum(r["empty_shares"] for r in results) >= 2  # a rank holds nothing of Linear(2, 1)'s two parameters
    return path, results[0]


@pytest.mark.parametrize(("kind", "world_size", "harness"),
                         [("plain", 1, None), ("fsdp", 2, "threads"), ("fsdp", 3, "processes"),
                          ("ddp", 2, "processes"), ("fsdp", 4, "threads")],
                         ids=["one-process", "fsdp-2-simulated", "fsdp-3", "ddp-2", "fsdp-4-simulated"])
def test_fsdp_at_four_resumes_at_any_layout(saved_at_four, kind, world_size, harness):
    path, reference = saved_at_four
    if harness is None:
        results = [rank_resume(None, kind, path)]
    elif harness == "threads":
        results = run_threads(rank_resume, world_size, args=(kind, path), timeout=120)
    else:
        results = run_processes(rank_resume, world_size, args=(kind, path), timeout=120)
    plain = extras(None)
    for result in results:
        assert_bit_exact(result["loaded"], reference["saved"])
        assert_close(result["continued"], reference["continued"])
        assert result["plain"] == {"step": plain["step"], "loader": plain["loader"], "rng": plain["rng"]}
        assert isinstance(result["plain"]["loader"]["order"], tuple)


def rank_load_as_dtensors(group, path):
    """Load FSDP's flat shards of every weight into DTensors, column- and row-sharded over 3 ranks."""
    mesh = ferro.init_device_mesh((group.world_size,), group=group)
    model = make_model(0)
    out = {}
    for placement in (Shard(0), Shard(1)):
        state = {"model": {name: distribute_tensor(np.zeros_like(p.data), mesh, [placement])
                           for name, p in model.named_parameters() if p.data.ndim == 2}}
        checkpoint.load(state, path, group)
        out[placement.dim] = {name: d.full_tensor() for name, d in state["model"].items()}
    return out


def test_fsdp_flat_shards_load_into_dtensors(saved_at_four):
    path, reference = saved_at_four
    for result in run_threads(rank_load_as_dtensors, 3, args=(path,), timeout=120):
        for loaded in result.values():
            assert loaded.keys() == {k for k, v in reference["saved"][0].items() if v.ndim == 2}
            for name, value in loaded.items():
                assert np.array_equal(value, reference["saved"][0][name]), name


def rank_save_dtensors(group, path):
    mesh = ferro.init_device_mesh((group.world_size,), group=group)
    full = {"w": np.arange(35.0).reshape(5, 7), "t": torch.arange(24.0).reshape(6, 4), "r": np.arange(3.0)}
    state = {"w": distribute_tensor(full["w"], mesh, [Shard(1)]), "t": distribute_tensor(full["t"], mesh, [Shard(0)]),
             "r": distribute_tensor(full["r"], mesh, [Replicate()]), "step": 3}
    checkpoint.save(state, path, group)
    try:
        checkpoint.save({"p": distribute_tensor(full["w"], mesh, [Partial()])}, path + "-partial", group)
    except ferro.CheckpointError as exc:
        return str(exc)
    return None


def rank_load_dtensors(group, path):
    mesh = ferro.init_device_mesh((group.world_size,), group=group)
    state = {"w": distribute_tensor(np.zeros((5, 7)), mesh, [Shard(0)]),
             "t": distribute_tensor(torch.zeros(6, 4), mesh, [Shard(1)]),
             "r": distribute_tensor(np.zeros(3), mesh, [Shard(0)]), "step": 0}
    checkpoint.load(state, path, group)
    return {k: (np.asarray(v.full_tensor()), type(v.to_local()).__name__) for k, v in state.items() if k != "step"}


def test_dtensors_save_at_two_and_load_at_three_and_at_one(tmp_path):
    path = str(tmp_path / "dt")
    refusals = run_processes(rank_save_dtensors, 2, args=(path,), timeout=120)
    assert all("p is a DTensor placed [Partial(sum)]: a Partial holds terms" in r for r in refusals)
    want = {"w": np.arange(35.0).reshape(5, 7), "t": np.arange(24.0).reshape(6, 4), "r": np.arange(3.0)}
    for result in run_threads(rank_load_dtensors, 3, args=(path,), timeout=120):
        assert {k: t for k, (_, t) in result.items()} == {"w": "ndarray", "t": "Tensor", "r": "ndarray"}
        for name, (value, _) in result.items():
            assert np.array_equal(value, want[name]), name
    plain = {"w": np.zeros((5, 7)), "t": torch.zeros(6, 4), "r": np.zeros(3), "step": 0}
    checkpoint.load(plain, path)
    assert plain["step"] == 3 and all(np.array_equal(np.asarray(plain[k]), v) for k, v in want.items())


def test_one_process_resumes_at_four_fsdp_ranks(tmp_path):
    path = str(tmp_path / "step_2")
    reference = rank_save(None, "plain", path)
    assert [f for f in os.listdir(path) if f.endswith(".safetensors")] == ["data-" + _save_id(path) + "-r00000"
                                                                          ".safetensors"]
    for result in run_processes(rank_resume, 4, args=("fsdp", path), timeout=120):
        assert_bit_exact(result["loaded"], reference["saved"])
        assert_close(result["continued"], reference["continued"])


def _save_id(path):
    with open(os.path.join(path, "metadata.json")) as f:
        return json.load(f)["save_id"]


def data_bytes(path):
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def rank_replicated(group, path):
    """DDP: every rank holds the whole model (8 tensors of 64 KiB); the save must write each byte once."""
    model = nn.Sequential(*[nn.Linear(64, 128, rng=np.random.default_rng(i), dtype=np.float64) for i in range(8)])
    ddp = ferro.DDP(model, group=group)
    checkpoint.save(checkpoint.get_state_dict(ddp), path, group)
    mine = [f for f in os.listdir(path) if f.endswith(f"-r{group.rank:05d}.safetensors")]
    return model.state_dict(), len(mine)


def test_replicated_state_is_written_once_spread_over_the_ranks(tmp_path):
    path = str(tmp_path / "ddp")
    results = run_processes(rank_replicated, 4, args=(path,), timeout=120)
    expected, _ = results[0]
    model_bytes = sum(v.nbytes for v in expected.values())
    assert data_bytes(path) <= 1.02 * model_bytes
    assert all(files == 1 for _, files in results)  # every rank wrote a share, not rank 0 alone
    state = {"model": {k: np.zeros_like(v) for k, v in expected.items()}}
    checkpoint.load(state, path)
    for name, value in expected.items():
        assert np.array_equal(state["model"][name], value)


def rank_hybrid(group, path):
    mesh = ferro.init_device_mesh((2, 2), ("replicate", "shard"), group=group)
    model = make_model(0)
    fsdp = ferro.FSDP(model, group=group, device_mesh=mesh, sharding_strategy="hybrid_shard",
                      auto_wrap_policy=lambda m: isinstance(m, nn.Linear))
    checkpoint.save({"model": fsdp.sharded_state_dict()}, path, group)
    return {k: np.array(v) for k, v in fsdp.full_state_dict().items()}


def test_hybrid_shard_replicas_are_written_once(tmp_path):
    path = str(tmp_path / "hybrid")
    full = run_threads(rank_hybrid, 4, args=(path,), timeout=120)[0]
    assert data_bytes(path) <= 1.02 * sum(v.nbytes for v in full.values()) + 4 * 512  # + each file's header
    state = {"model": {k: np.zeros_like(v) for k, v in full.items()}}
    checkpoint.load(state, path)
    assert all(np.array_equal(state["model"][k], v) for k, v in full.items())


# --- crash safety ----------------------------------------------------------------------------------------------

KILL_ELEMENTS = 1 << 19  # 4 MiB of float64 over the ranks


def expected_values(step):
    return step * 1e6 + np.arange(KILL_ELEMENTS, dtype=np.float64)


def rank_save_until_killed(group, root, victims, delay):
    """Save step after step (each into its own directory and into one overwritten in place) until SIGKILLed."""
    if group.rank in victims:
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
    lo, hi = group.rank * KILL_ELEMENTS // 4, (group.rank + 1) * KILL_ELEMENTS // 4
    step = 0
    try:
        while step < 500:
            step += 1
            state = {"w": ShardedEntry(expected_values(step)[lo:hi], (KILL_ELEMENTS,), lo, hi),
                     "replicated": np.full(1000, float(step)), "step": step}
            checkpoint.save(state, checkpoint.step_path(root, step), group, timeout=10)
            checkpoint.save(state, os.path.join(root, "rolling"), group, timeout=10)
    except ferro.DistributedError:
        return step  # a peer died: the survivors stop
    return step


def check_directory(path):
    """A directory loads iff it was committed, and what it loads is exactly one step's values."""
    state = {"w": np.zeros(KILL_ELEMENTS), "replicated": np.zeros(1000), "step": None}
    committed = os.path.exists(os.path.join(path, "metadata.json"))
    if not committed:
        with pytest.raises(ferro.CheckpointError, match="no committed checkpoint"):
            checkpoint.load(state, path)
        return None
    checkpoint.load(state, path)
    step = state["step"]
    assert np.array_equal(state["w"], expected_values(step)) and (state["replicated"] == step).all(), path
    return step


@pytest.mark.parametrize("round_", range(3))  # one victim twice, every rank once (round 2)
def test_sigkill_during_saves_never_leaves_a_loadable_wrong_checkpoint(tmp_path, round_):
    rng = np.random.default_rng(round_)
    victims = list(range(4)) if round_ % 3 == 2 else [int(rng.integers(4))]
    delay = float(rng.uniform(0.2, 1.5))
    root = str(tmp_path)
    run_processes(rank_save_until_killed, 4, args=(root, victims, delay), allow_exit=range(4), timeout=120)
    committed = {}
    for name in os.listdir(root):
        step = check_directory(os.path.join(root, name))
        if step is not None:
            committed[name] = step
            if name.startswith("step_"):
                assert step == int(name[len("step_"):])
    steps = [s for n, s in committed.items() if n.startswith("step_")]
    assert steps, "no save committed before the kill: the delay is too short to test anything"
    latest = checkpoint.latest(root)
    assert latest == checkpoint.step_path(root, max(steps))
    # "rolling" is overwritten after each step_<N>: it holds the last step or the one before, never a mix.
    assert committed.get("rolling") in ({max(steps), max(steps) - 1} - {0}) | ({None} if max(steps) == 1 else set())


# --- damaged files and mismatches --------------------------------------------------------------------------------

def small_state():
    return {"model": {"a": np.arange(3 << 20, dtype=np.float32),  # 12 MiB: three checksum chunks
                      "b": torch.arange(10, dtype=torch.bfloat16)}, "step": 5}


def blank_state():
    return {"model": {"a": np.full(3 << 20, -1, np.float32), "b": torch.full((10,), -1, dtype=torch.bfloat16)},
            "step": None}


def assert_untouched(state):
    assert (state["model"]["a"] == -1).all() and (state["model"]["b"] == -1).all() and state["step"] is None


def only_data_file(path):
    (name,) = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    return os.path.join(path, name)


def test_round_trip_of_numpy_torch_bfloat16_and_plain_values(tmp_path):
    checkpoint.save(small_state(), tmp_path)
    state = blank_state()
    checkpoint.load(state, tmp_path)
    assert np.array_equal(state["model"]["a"], small_state()["model"]["a"])
    assert torch.equal(state["model"]["b"], small_state()["model"]["b"]) and state["step"] == 5


def test_a_flipped_byte_is_named_and_nothing_is_loaded(tmp_path):
    checkpoint.save(small_state(), tmp_path)
    target = only_data_file(tmp_path)
    with open(target, "r+b") as f:  # a byte in the middle chunk of "a"
        f.seek(os.path.getsize(target) - (6 << 20))
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    state = blank_state()
    with pytest.raises(ferro.CheckpointCorruptError, match=f"{os.path.basename(target)}.*model.a.*checksum"):
        checkpoint.load(state, tmp_path)
    assert_untouched(state)
    # Loading only what lies outside the damaged chunk still works: only the chunks read are verified.
    partial = {"model": {"b": torch.zeros(10, dtype=torch.bfloat16)}}
    checkpoint.load(partial, tmp_path)
    assert torch.equal(partial["model"]["b"], small_state()["model"]["b"])


def test_a_truncated_or_missing_file_is_named(tmp_path):
    checkpoint.save(small_state(), tmp_path)
    target = only_data_file(tmp_path)
    os.truncate(target, os.path.getsize(target) - 100)
    state = blank_state()
    with pytest.raises(ferro.CheckpointCorruptError, match=f"{os.path.basename(target)}.*truncated"):
        checkpoint.load(state, tmp_path)
    assert_untouched(state)
    assert checkpoint.latest(tmp_path.parent) is None  # not a step_<N> layout, and not complete either
    os.remove(target)
    with pytest.raises(ferro.CheckpointCorruptError, match=f"{os.path.basename(target)}: missing"):
        checkpoint.load(state, tmp_path)
    assert_untouched(state)


def test_damaged_metadata_is_refused(tmp_path):
    checkpoint.save(small_state(), tmp_path)
    with open(tmp_path / "metadata.json", "r+b") as f:
        f.truncate(200)
    with pytest.raises(ferro.CheckpointCorruptError, match="metadata.json: not valid JSON"):
        checkpoint.load(blank_state(), tmp_path)


@pytest.mark.parametrize(("change", "message"), [
    (lambda s: s["model"].update(c=np.zeros(2)), "model.c is not in the checkpoint"),
    (lambda s: s["model"].update(a=np.zeros(5, np.float32)), r"model.a is F32 \[3145728\] in the checkpoint, the "
                                                             r"state dict has F32 \[5\]"),
    (lambda s: s["model"].update(a=np.zeros(3 << 20, np.float64)), "model.a is F32 .* the state dict has F64"),
    (lambda s: s.update(epoch=0), "epoch is not in the checkpoint"),
], ids=["missing-key", "shape", "dtype", "missing-value"])
def test_mismatches_are_named_and_nothing_is_loaded(tmp_path, change, message):
    checkpoint.save(small_state(), tmp_path)
    state = blank_state()
    change(state)
    with pytest.raises(ferro.CheckpointError, match=message):
        checkpoint.load(state, tmp_path)
    assert (state["model"]["b"] == -1).all() and state["step"] is None


def test_loading_where_nothing_was_committed(tmp_path):
    with pytest.raises(ferro.CheckpointError, match="does not exist"):
        checkpoint.load({}, tmp_path / "nowhere")
    with pytest.raises(ferro.CheckpointError, match="no committed checkpoint"):
        checkpoint.load({}, tmp_path)


def rank_load_half(group, path):
    n = 3 << 20
    lo, hi = group.rank * n // 2, (group.rank + 1) * n // 2
    local = np.full(hi - lo, -1, np.float32)
    try:
        checkpoint.load({"model": {"a": ShardedEntry(local, (n,), lo, hi)}}, path, group)
    except ferro.CheckpointError as exc:
        return str(exc), bool((local == -1).all())
    return None, bool((local == -1).all())


def test_one_rank_meeting_damage_stops_every_rank_before_anything_is_loaded(tmp_path):
    checkpoint.save(small_state(), tmp_path)
    target = only_data_file(tmp_path)
    with open(target, "r+b") as f:  # the last chunk of "a": only rank 1 reads it
        f.seek(os.path.getsize(target) - 20 - 1000)
        f.write(b"\x00\x01\x02")
    (error0, untouched0), (error1, untouched1) = run_threads(rank_load_half, 2, args=(str(tmp_path),))
    assert "checksum" in error1 and untouched1
    assert "rank 1 cannot load it" in error0 and "nothing was loaded on any rank" in error0 and untouched0


def rank_disagree(group, path, what):
    state = {"w": np.zeros(4), "step": 3}
    if what == "value" and group.rank == 1:
        state["step"] = 4
    if what == "shape" and group.rank == 1:
        state["w"] = np.zeros(5)
    if what == "gap":
        state["w"] = ShardedEntry(np.zeros(2), (8,), 4 * group.rank, 4 * group.rank + 2)
    with pytest.raises(ferro.CheckpointError) as info:
        checkpoint.save(state, path, group)
    return str(info.value)


@pytest.mark.parametrize(("what", "message"), [
    ("value", r"ranks disagree on the value of step \(rank 0: 3, rank 1: 4\).*a key per rank"),
    ("shape", r"ranks disagree on w: rank 0 has F64 \[4\], rank 1 has F64 \[5\]"),
    ("gap", r"no rank holds elements \[2, \.\.\.\) of w"),
])
def test_ranks_that_save_different_things_are_told_which(tmp_path, what, message):
    import re

    for text in run_threads(rank_disagree, 2, args=(str(tmp_path), what)):
        assert re.search(message, text), text
    assert not os.path.exists(tmp_path / "metadata.json")


def _point_metadata_at(directory, file_name, save_id=None):
    """Edit a committed checkpoint's metadata so that its one data file is named ``file_name``."""
    where = directory / "metadata.json"
    meta = json.loads(where.read_text())
    (old,) = meta["files"]
    meta["files"] = {file_name: meta["files"][old]}
    for tensor in meta["tensors"]:
        for piece in tensor["pieces"]:
            piece["file"] = file_name
    if save_id is not None:
        meta["save_id"] = save_id
    where.write_text(json.dumps(meta))


def test_a_load_reads_no_file_outside_its_directory(tmp_path):
    # Another job's committed checkpoint, and this job's, whose metadata an attacker edits to name the other's file.
    other, ours = checkpoint.step_path(tmp_path / "otherjob", 9), checkpoint.step_path(tmp_path / "job", 1)
    checkpoint.save({"w": np.full(4, 9.0)}, other)
    checkpoint.save({"w": np.full(4, 1.0)}, ours)
    outside = os.path.relpath(only_data_file(other), ours)  # ../../otherjob/step_9/data-<its id>-r00000.safetensors
    _point_metadata_at(tmp_path / "job" / "step_1", outside, save_id=_save_id(other))
    state = {"w": np.zeros(4)}
    with pytest.raises(ferro.CheckpointCorruptError, match="not one this save writes.*inside the directory"):
        checkpoint.load(state, ours)
    assert (state["w"] == 0).all()
    assert checkpoint.latest(tmp_path / "job") is None  # not committed: its files are not its own
    for name in ("/etc/passwd", "../../../../../../etc/passwd", "sub/data.safetensors", ""):
        _point_metadata_at(tmp_path / "job" / "step_1", name)
        with pytest.raises(ferro.CheckpointCorruptError, match="not one this save writes") as raised:
            checkpoint.load(state, ours)
        assert "root:" not in str(raised.value) and (state["w"] == 0).all()


def test_a_load_refuses_a_symlink_or_fifo_in_place_of_a_data_file_without_blocking(tmp_path):
    checkpoint.save({"w": np.full(4, 1.0)}, tmp_path / "ckpt")
    data = only_data_file(tmp_path / "ckpt")
    size = os.path.getsize(data)
    secret = tmp_path / "secret.safetensors"
    secret.write_bytes(b"\x08" + b"\x00" * 7 + b"{}      " + b"s" * (size - 16))  # same size, elsewhere
    os.remove(data)
    os.symlink(secret, data)
    state = {"w": np.zeros(4)}
    with pytest.raises(ferro.CheckpointCorruptError, match="a symlink, not a regular file"):
        checkpoint.load(state, tmp_path / "ckpt", timeout=5)
    assert checkpoint.latest(tmp_path) is None
    os.remove(data)
    os.mkfifo(data)  # open() of a FIFO with no writer blocks forever: the load must not
    outcome = {}
    loader = threading.Thread(target=lambda: outcome.update(error=_raised(checkpoint.load, state, tmp_path / "ckpt",
                                                                           timeout=5)), daemon=True)
    loader.start()
    loader.join(30)
    assert not loader.is_alive(), "checkpoint.load blocked on a FIFO"
    assert isinstance(outcome["error"], ferro.CheckpointCorruptError), outcome
    assert "a FIFO, not a regular file" in str(outcome["error"]) and (state["w"] == 0).all()
    os.remove(data)
    os.mkfifo(tmp_path / "ckpt" / "metadata.json.fifo")
    os.replace(tmp_path / "ckpt" / "metadata.json.fifo", tmp_path / "ckpt" / "metadata.json")
    loader = threading.Thread(target=lambda: outcome.update(error=_raised(checkpoint.load, state, tmp_path / "ckpt",
                                                                           timeout=5)), daemon=True)
    loader.start()
    loader.join(30)
    assert not loader.is_alive(), "checkpoint.load blocked on a FIFO metadata.json"
    assert "metadata.json: a FIFO" in str(outcome["error"]), outcome


def _raised(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # handed back to the test's thread
        return exc
    return None


@pytest.mark.parametrize("state, first, second", [
    ({"a.b": np.ones(2), "a": {"b": np.zeros(2)}}, "['a.b']", "['a']['b']"),
    ({"a": {"1": np.ones(2), 1: np.zeros(2)}}, "['a']['1']", "['a'][1]"),
    ({"a.b": 3, "a": {"b": np.zeros(2)}}, "['a.b']", "['a']['b']"),
], ids=["dotted-key", "str-and-int-key", "value-and-tensor"])
def test_keys_whose_names_collide_are_refused_before_anything_is_written(tmp_path, state, first, second):
    with pytest.raises(ferro.CheckpointError) as raised:
        checkpoint.save(state, tmp_path / "ckpt")
    assert first in str(raised.value) and second in str(raised.value), raised.value
    assert not (tmp_path / "ckpt").exists() or os.listdir(tmp_path / "ckpt") == []


def test_latest_finds_the_highest_committed_step(tmp_path):
    assert checkpoint.latest(tmp_path / "none") is None and checkpoint.latest(tmp_path) is None
    for step in (1, 2, 10):
        checkpoint.save({"w": np.full(3, float(step))}, checkpoint.step_path(tmp_path, step))
    os.remove(tmp_path / "step_10" / "metadata.json")  # a save that died before its commit
    os.remove(only_data_file(tmp_path / "step_2"))  # committed, but a file is gone
    os.makedirs(tmp_path / "step_99")
    assert checkpoint.latest(tmp_path) == checkpoint.step_path(tmp_path, 1)


def test_saving_over_a_checkpoint_replaces_it_and_removes_the_old_files(tmp_path):
    checkpoint.save({"w": np.zeros(4)}, tmp_path)
    old = only_data_file(tmp_path)
    checkpoint.save({"w": np.ones(4)}, tmp_path)
    assert not os.path.exists(old)
    state = {"w": np.zeros(4)}
    checkpoint.load(state, tmp_path)
    assert (state["w"] == 1).all()


def test_unstorable_values_are_refused(tmp_path):
    with pytest.raises(ferro.CheckpointError, match="lock cannot be stored"):
        checkpoint.save({"lock": threading.Lock()}, tmp_path)
    with pytest.raises(ferro.CheckpointError, match="not contiguous"):
        checkpoint.save({"w": np.zeros((4, 4))[:, 1]}, tmp_path)
    checkpoint.save({"w": np.ones(4)}, tmp_path)
    with pytest.raises(ferro.CheckpointError, match="read-only"):
        frozen = np.zeros(4)
        frozen.flags.writeable = False
        checkpoint.load({"w": frozen}, tmp_path)


# --- async ---------------------------------------------------------------------------------------------------

def test_async_save_stores_the_values_of_the_call(tmp_path):
    state = {"w": np.arange(1 << 20, dtype=np.float64), "t": torch.arange(1000.0), "step": 1}
    future = checkpoint.async_save(state, tmp_path / "a")
    state["w"] += 1  # in place, at once
    state["t"].add_(1)
    state["step"] = 2
    second = checkpoint.async_save(state, tmp_path / "b")  # waits for the first
    assert future.done() and future.result() == str(tmp_path / "a")
    second.result()
    for path, offset in (("a", 0), ("b", 1)):
        loaded = {"w": np.zeros(1 << 20), "t": torch.zeros(1000), "step": None}
        checkpoint.load(loaded, tmp_path / path)
        assert np.array_equal(loaded["w"], np.arange(1 << 20) + offset)
        assert torch.equal(loaded["t"], torch.arange(1000.0) + offset) and loaded["step"] == 1 + offset


def rank_async_with_failure(group, path):
    future = checkpoint.async_save({"w": np.full(8, float(group.rank)), "r": np.zeros(3)}, path, group)
    try:
        future.result(timeout=30)
    except ferro.CheckpointError as exc:
        return str(exc)
    return "the save succeeded"


def test_async_save_reports_a_writer_failure_and_commits_nothing(tmp_path, monkeypatch):
    import ferro.checkpoint.api as api

    real = api.write_data_file

    def failing(directory, name, pieces, metadata):
        if name.endswith("r00001.safetensors"):
            raise OSError(28, "No space left on device")
        return real(directory, name, pieces, metadata)

    monkeypatch.setattr(api, "write_data_file", failing)
    for text in run_threads(rank_async_with_failure, 2, args=(str(tmp_path),)):
        assert "rank 1 could not write its part (OSError: [Errno 28] No space left on device)" in text
    assert not os.path.exists(tmp_path / "metadata.json")


def rank_async_while_training(group, path):
    """The caller keeps using its group (collectives, in-place updates) while the writer commits."""
    rng = np.random.default_rng(group.rank)
    local = rng.standard_normal(1 << 18)
    before = local.copy()
    n = (1 << 18) * group.world_size
    future = checkpoint.async_save({"w": ShardedEntry(local, (n,), group.rank << 18, (group.rank + 1) << 18)},
                                   path, group)
    for _ in range(20):
        ferro.allreduce(local, group=group)
        local /= group.world_size
    future.result(timeout=60)
    return before


def test_async_save_over_processes_while_the_group_keeps_working(tmp_path):
    befores = run_processes(rank_async_while_training, 2, args=(str(tmp_path),), timeout=120)
    state = {"w": np.zeros(2 << 18)}
    checkpoint.load(state, tmp_path)
    assert np.array_equal(state["w"], np.concatenate(befores))


# --- torch and the command line --------------------------------------------------------------------------------

def rank_torch_fsdp(group, path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5, dtype=torch.float64), torch.nn.Tanh(),
                                torch.nn.Linear(5, 3, dtype=torch.float64))
    fsdp = ferro.FSDP(model, group=group, auto_wrap_policy=lambda m: isinstance(m, torch.nn.Linear))
    optimizer = torch.optim.Adam(fsdp.parameters(), lr=LR)
    x = torch.from_numpy(np.random.default_rng(group.rank).standard_normal((4, 7)))
    fsdp(x).square().mean().backward()
    optimizer.step()
    checkpoint.save(checkpoint.get_state_dict(fsdp, optimizer), path, group)
    full = {k: v.clone() for k, v in fsdp.full_state_dict().items()}
    optim = fsdp.full_optim_state_dict(optimizer)["state"]
    return full, {n: {k: v.clone() for k, v in e.items()} for n, e in optim.items()}


def test_torch_fsdp_checkpoint_loads_into_a_plain_torch_model(tmp_path):
    full, optim = run_threads(rank_torch_fsdp, 3, args=(str(tmp_path),))[0]
    model = torch.nn.Sequential(torch.nn.Linear(7, 5, dtype=torch.float64), torch.nn.Tanh(),
                                torch.nn.Linear(5, 3, dtype=torch.float64))
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    state = checkpoint.get_state_dict(model, optimizer)
    checkpoint.load(state, tmp_path)
    checkpoint.set_state_dict(model, optimizer, state)
    for name, value in model.state_dict().items():
        assert torch.equal(value, full[name]), name
    for name, param in model.named_parameters():
        for key, value in optimizer.state[param].items():
            assert torch.equal(value, optim[name][key]), f"{name} {key}"


def run_cli(cwd, *args):
    # Away from the repository root: `-m ferro` there would import the source tree, not the installed package.
    return subprocess.run([sys.executable, "-m", "ferro", "ckpt", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


def test_ckpt_inspect_and_consolidate(tmp_path):
    from safetensors.numpy import load_file

    n = 10
    for rank_state in run_threads(lambda g: checkpoint.save(
            {"m": {"w": ShardedEntry(np.arange(n, dtype=np.float32)[g.rank * 5:(g.rank + 1) * 5], (2, 5),
                                     g.rank * 5, (g.rank + 1) * 5)}, "step": 7}, str(tmp_path / "c"), g), 2):
        assert rank_state == str(tmp_path / "c")
    shown = run_cli(tmp_path, "inspect", str(tmp_path / "c"))
    assert shown.returncode == 0, shown.stderr
    assert "m.w" in shown.stdout and "F32" in shown.stdout and "2x5" in shown.stdout and "-r00001" in shown.stdout
    assert "step = 7" in shown.stdout
    out = tmp_path / "model.safetensors"
    made = run_cli(tmp_path, "consolidate", str(tmp_path / "c"), "--out", str(out))
    assert made.returncode == 0, made.stderr
    assert np.array_equal(load_file(str(out))["m.w"], np.arange(n, dtype=np.float32).reshape(2, 5))
    missing = run_cli(tmp_path, "inspect", str(tmp_path / "nothing"))
    assert missing.returncode == 1 and "no checkpoint at" in missing.stderr and "Traceback" not in missing.stderr

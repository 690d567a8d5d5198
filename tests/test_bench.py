"""ferro bench: the nccl-tests table, --check, output files, --compare, and Ctrl-C."""

import csv
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

FERRO = [sys.executable, "-m", "ferro"]
NUMBER = r"(?:\d+(?:\.\d+)?|N/A)"
# size count type redop root | time algbw busbw #wrong | time algbw busbw #wrong | algorithm
ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\w+)\s+(\w+)\s+(-?\d+)\s+" + r"\s+".join([NUMBER] * 8)
                 + r"(?:\s+(?P<algorithm>\S.*?))?\s*$")


def parse_rows(text):
    rows = []
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        match = ROW.match(line)
        assert match, f"not an nccl-tests row: {line!r}"
        fields = line.split()
        rows.append({"size": int(fields[0]), "count": int(fields[1]), "type": fields[2], "redop": fields[3],
                     "oop_time": fields[5], "oop_busbw": fields[7], "oop_wrong": fields[8], "ip_wrong": fields[12],
                     "algorithm": match.group("algorithm") or ""})
    return rows


def test_table_parses_check_finds_nothing_wrong_and_files_are_written(tmp_path):
    csv_path, json_path, png_path = tmp_path / "r.csv", tmp_path / "r.json", tmp_path / "r.png"
    done = subprocess.run([*FERRO, "bench", "all", "-n", "2", "-b", "8", "-e", "64K", "-f", "16", "--check",
                           "--iters", "3", "--warmup", "1", "--csv", str(csv_path), "--json", str(json_path),
                           "--plot", str(png_path)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rows = parse_rows(done.stdout)
    sizes = [8, 128, 2048, 32768]
    assert len(rows) == 7 * len(sizes) + 1  # seven ops over the sizes, plus one barrier row
    assert all(row["algorithm"] for row in rows), "every row names the algorithm that ran"
    for row in rows:
        assert row["oop_wrong"] in ("0", "N/A") and row["ip_wrong"] in ("0", "N/A")
        assert float(row["oop_time"]) > 0
    assert sum(row["oop_wrong"] == "0" for row in rows) >= 7 * len(sizes)  # checked everywhere but the barrier
    assert re.search(r"# Avg bus bandwidth\s+:\s+\d+\.\d+", done.stdout)
    assert "# Out of bounds values : 0 OK" in done.stdout
    with open(csv_path) as f:
        written_csv = list(csv.DictReader(f))
    assert len(written_csv) == len(rows)
    assert [row["algorithm"] for row in written_csv] == [row["algorithm"] for row in rows]
    assert all(float(row["cpu_us"]) >= 0 for row in written_csv)
    written = json.loads(json_path.read_text())
    assert len(written) == len(rows)
    assert all(row["cpu_us"] is not None and row["cpu_us"] >= 0 for row in written)  # Linux: /proc/stat
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bus_bandwidth_uses_the_nccl_tests_factors(tmp_path):
    json_path = tmp_path / "r.json"
    done = subprocess.run([*FERRO, "bench", "allreduce", "all_gather", "broadcast", "-n", "2", "-b", "1M", "-e", "1M",
                           "--iters", "2", "--warmup", "1", "--json", str(json_path)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    for row in json.loads(json_path.read_text()):
        algbw = row["size"] / (row["oop_time_us"] * 1e-6) / 1e9
        factor = {"allreduce": 1.0, "all_gather": 0.5, "broadcast": 1.0}[row["op"]]  # 2(n-1)/n, (n-1)/n, 1 at n=2
        assert row["oop_busbw"] == pytest.approx(algbw * factor)


def test_compare_prints_ferros_ratio_to_gloo(tmp_path):
    done = subprocess.run([*FERRO, "bench", "allreduce", "-n", "2", "-b", "1K", "-e", "4K", "-f", "4", "--iters", "3",
                           "--warmup", "1", "--compare", "torch-gloo"], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "allreduce on torch-gloo, 2 ranks" in done.stdout
    lines = [line for line in done.stdout.splitlines() if re.match(r"^\s+allreduce\s+\d+\s", line)]
    assert len(lines) == 2
    for line in lines:
        assert re.search(r"\d+\.\d+x$", line)


def test_compare_sweeps_several_world_sizes_beside_another_ferro_backend(tmp_path):
    done = subprocess.run([*FERRO, "bench", "allreduce", "-n", "1,2", "--backend", "shm", "-b", "8", "-e", "64",
                           "-f", "8", "--iters", "2", "--warmup", "1", "--compare", "ferro-tcp"], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    for world_size in (1, 2):
        assert f"ferro-shm beside its peers, {world_size} ranks" in done.stdout
        assert f"allreduce on ferro-tcp, {world_size} ranks" in done.stdout
    lines = [line for line in done.stdout.splitlines() if re.match(r"^\s+allreduce\s+\d+\s", line)]
    assert len(lines) == 4  # two sizes, two world sizes
    for line in lines:
        memcpy, ferro_us, peer_us = (float(v) for v in line.split()[2:5])
        assert memcpy > 0 and ferro_us > 0 and peer_us > 0 and re.search(r"\d+\.\d+x$", line)


def test_bench_runs_as_the_ranks_of_ferro_run(tmp_path):
    done = subprocess.run([*FERRO, "run", "--nproc-per-node", "2", "--no-prefix", "-m", "ferro", "bench", "allreduce",
                           "-b", "8", "-e", "64", "-f", "8", "--iters", "2", "--check"], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rows = parse_rows(done.stdout)  # printed once, by rank 0
    assert [row["size"] for row in rows] == [8, 64] and all(row["oop_wrong"] == "0" for row in rows)


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_under_load_every_op_stays_exact_and_the_compute_threads_ran(tmp_path, backend):
    """--load 2: two matmul threads in each rank beside the sweep; --check still finds nothing wrong."""
    done = subprocess.run([*FERRO, "bench", "all", "-n", "3", "--backend", backend, "-b", "8", "-e", "64K", "-f", "32",
                           "--iters", "4", "--warmup", "1", "--check", "--load", "2", "--compare", f"ferro-"
                           f"{'tcp' if backend == 'shm' else 'shm'}"], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rows = parse_rows("\n".join(line for line in done.stdout.splitlines() if not re.match(r"^\s+[a-z_]+\s+\d+\s",
                                                                                          line)))
    assert len(rows) == 2 * (7 * 3 + 1)  # two libraries: seven ops over 8, 256 and 8K bytes, plus a barrier
    assert all(row["oop_wrong"] in ("0", "N/A") and row["ip_wrong"] in ("0", "N/A") for row in rows)
    assert done.stdout.count("# beside 2 compute thread(s) per rank (numpy matmuls)") == 2
    rates = [float(m) for m in re.findall(r"the compute threads of rank 0 ran at (\d+\.\d+) GFLOP/s", done.stdout)]
    assert len(rates) == 2 and min(rates) > 0
    assert "ranks beside 2 compute thread(s) per rank" in done.stdout


def test_a_compute_load_multiplies_until_it_exits_and_refuses_bad_settings():
    import threading

    from ferro.tools.bench.load import ComputeLoad, single_threaded_blas

    before = threading.active_count()
    with ComputeLoad(2) as load:
        time.sleep(0.3)
        assert threading.active_count() == before + 2
    assert threading.active_count() == before  # joined on exit
    assert load.gflops > 0
    assert ComputeLoad(0).__enter__().gflops == 0.0
    for threads, kind, words in ((-1, "numpy", "give 0 or more"), (1, "jax", "choose from numpy, torch")):
        with pytest.raises(ValueError, match=words):
            ComputeLoad(threads, kind)
    environ = {"OMP_NUM_THREADS": "4"}
    single_threaded_blas(environ)
    assert environ == {"OMP_NUM_THREADS": "4", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                       "BLIS_NUM_THREADS": "1"}  # a user's own setting stays


def test_bad_arguments_get_clear_errors(tmp_path):
    for args, words in ((["frobnicate", "-n", "2"], "unknown op"), (["-n", "2", "--compare", "nccl"], "--compare"),
                        (["-n", "2,x"], "rank count"), (["-n", "2", "--backend", "tcp", "--compare", "ferro-tcp"],
                                                         "being measured"),
                        (["allreduce"], "give -n"), (["-n", "2", "--load", "-1"], "compute threads"),
                        (["-n", "2", "--load", "1", "--load-kind", "jax"], "invalid choice")):
        done = subprocess.run([*FERRO, "bench", *args], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                              env={k: v for k, v in __import__("os").environ.items()
                                   if k not in ("RANK", "WORLD_SIZE")})
        assert done.returncode == 2 and words in done.stderr, done.stderr


def test_ctrl_c_keeps_the_rows_measured_so_far(tmp_path):
    json_path = tmp_path / "partial.json"
    bench = subprocess.Popen([*FERRO, "bench", "allreduce", "-n", "2", "-b", "1K", "-e", "1G", "-f", "2", "--iters",
                              "50", "--json", str(json_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=tmp_path)
    seen = []
    deadline = time.monotonic() + 120
    while len(seen) < 2 and time.monotonic() < deadline:
        line = bench.stdout.readline()
        if ROW.match(line):
            seen.append(line)
    bench.send_signal(signal.SIGINT)
    rest, _ = bench.communicate(timeout=60)
    assert len(seen) == 2
    assert bench.returncode != 0
    assert "interrupted" in rest
    assert len(json.loads(json_path.read_text())) >= 2


def test_a_sweep_of_several_world_sizes_plots_a_line_per_size():
    # -n 2,4: each library's rows of both sizes must not become one line zigzagging between them.
    from ferro.tools.bench.plot import lines
    from ferro.tools.bench.table import Row

    def row(library, world, size):
        return Row(library, "allreduce", size, size // 4, "float32", "sum", -1, world, 10.0 * world, 9.0 * world,
                   None, None)

    rows = [row(lib, world, size) for world in (4, 2) for lib in ("ferro-tcp", "mpi") for size in (4096, 8, 64)]
    drawn = lines(rows)
    assert sorted(drawn) == ["ferro-tcp allreduce, 2 ranks", "ferro-tcp allreduce, 4 ranks",
                             "mpi allreduce, 2 ranks", "mpi allreduce, 4 ranks"]
    for label, points in drawn.items():
        assert [p.size for p in points] == [8, 64, 4096]
        assert {p.world_size for p in points} == {int(label.split(", ")[1].split()[0])}
    assert sorted(lines([row("ferro-tcp", 2, 8)])) == ["ferro-tcp allreduce"]  # one size: no suffix


def test_comparison_divides_by_the_time_it_prints():
    # ferro has an in-place time, MPI's all_gather has none: the row falls back to out-of-place for every
    # column, says so, and each ratio is the peer's time over the ferro time printed beside it.
    from ferro.tools.bench.cli import _comparison
    from ferro.tools.bench.table import Row

    def row(library, oop, ip):
        return Row(library, "all_gather", 1024, 256, "float32", "none", -1, 4, oop, ip, None, None)

    both_in_place = _comparison([row("ferro-tcp", 100.0, 50.0), row("torch-gloo", 400.0, 300.0)], "ferro-tcp",
                                ["torch-gloo"], {1024: 1.0}, 4).splitlines()[-1].split()
    assert both_in_place[0] == "all_gather" and both_in_place[3:] == ["50.0", "300.0", "6.00x"]
    one_lacks_it = _comparison([row("ferro-tcp", 100.0, 50.0), row("torch-gloo", 400.0, 300.0),
                                row("mpi", 150.0, None)], "ferro-tcp", ["torch-gloo", "mpi"], {1024: 1.0},
                               4).splitlines()[-1].split()
    assert one_lacks_it[:2] == ["all_gather", "oop"]
    assert one_lacks_it[4:] == ["100.0", "400.0", "4.00x", "150.0", "1.50x"]
    # Wide figures keep their columns apart: a peer 1362x slower, a copy of 12345678 us.
    wide = _comparison([row("ferro-tcp", 3.8, 3.8), row("ferro-shm", 5175.6, 5175.6)], "ferro-tcp", ["ferro-shm"],
                       {1024: 12345678.0}, 1).splitlines()[-1].split()
    assert wide[2:] == ["12345678.0", "3.8", "5175.6", "1362.00x"]


def test_rows_name_the_algorithm_the_variable_forces(tmp_path):
    env = dict(os.environ, FERRO_ALGORITHM_ALLREDUCE="ring")
    done = subprocess.run([*FERRO, "bench", "allreduce", "-n", "4", "--backend", "tcp", "-b", "8", "-e", "1M",
                           "-f", "128", "--iters", "2", "--warmup", "1", "--check"], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    rows = parse_rows(done.stdout)
    assert [row["algorithm"] for row in rows] == ["ring"] * 3 and all(row["oop_wrong"] == "0" for row in rows)
    done = subprocess.run([*FERRO, "bench", "allreduce", "-n", "4", "--backend", "tcp", "-b", "8", "-e", "1M",
                           "-f", "128", "--iters", "2", "--warmup", "1"], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert [row["algorithm"] for row in parse_rows(done.stdout)] == ["recursive_doubling", "recursive_doubling",
                                                                     "halving_doubling"]


def test_fit_writes_a_cost_model_from_ring_allreduces(tmp_path):
    from ferro.backend.cost_model import CostModel, load_cost_model

    model_path = tmp_path / "model.json"
    CostModel(1e-3, 1e-6, 0.0, "written by hand", line_rate=5e6).save(model_path)  # a line rate the user knows
    # Up to 8 MiB, so the per-byte cost stands far above a busy machine's noise (to 256 KiB it once fitted zero).
    done = subprocess.run([*FERRO, "bench", "allreduce", "-n", "2", "--backend", "tcp", "-b", "8", "-e", "8M",
                           "-f", "32", "--iters", "3", "--warmup", "1", "--fit", str(model_path)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr + done.stdout
    timed = [row["algorithm"] for row in parse_rows(done.stdout.split("# cost model")[0])]
    assert timed == ["ring"] * 5 + ["recursive_doubling"] * 5 + ["halving_doubling"] * 5  # each forced in turn
    model = load_cost_model(str(model_path))
    assert model is not None and model.alpha > 0 and model.beta > 0 and "2 ranks" in model.fitted_on
    assert set(model.per_algorithm) == set(model.measured) == {"ring", "recursive_doubling", "halving_doubling"}
    assert model.world_size == 2 and [size for size, _ in model.measured["ring"]] == [8, 256, 8192, 262144, 8388608]
    assert model.line_rate == 5e6 and "written by hand" not in model.fitted_on  # refitted; the rate stays
    assert "chosen by the model" in done.stdout


def test_fit_records_the_line_rate_it_is_given_and_refuses_a_bad_one(tmp_path):
    import argparse

    from ferro.backend.cost_model import load_cost_model
    from ferro.tools.bench.fit import fit_model
    from ferro.tools.bench.table import Row
    from ferro.tools.emulate import payload_rate

    # Two sizes of each algorithm, as a 4-rank run would time them: the fit itself needs no ranks.
    rows = [Row("ferro-tcp", "allreduce", size, size // 4, "float32", "sum", -1, 4, seconds * 1e6, None, None, None,
                name) for name in ("ring", "recursive_doubling", "halving_doubling")
            for size, seconds in ((4096, 1e-4), (1 << 20, 2e-3))]
    path = tmp_path / "model.json"
    args = argparse.Namespace(fit=str(path), emulate=None, line_rate="25gbit")
    assert fit_model(args, rows) == 0
    assert load_cost_model(str(path)).line_rate == pytest.approx(payload_rate("25gbit"))
    for argv, why in ((["--line-rate", "25gbit"], "goes with --fit"),
                      (["--fit", str(path), "--line-rate", "25gb"], "kbit, mbit or gbit")):
        code, _, err = _simulated(["allreduce", "-n", "2", *argv])
        assert code == 2 and why in err, err


def test_fit_bounds_stalled_sizes_keeps_costs_nonnegative_and_refuses_rows_without_a_per_byte_cost(tmp_path):
    import argparse

    import numpy as np

    from ferro.backend.cost_model import CostModel, load_cost_model
    from ferro.tools.bench.fit import fit_model, never_faster_when_larger, nonnegative_fit
    from ferro.tools.bench.table import Row

    # Exact data fit exactly; data whose free fit has a negative alpha are fitted by beta alone (least squares).
    sizes = np.array([1e3, 1e5, 1e7])
    exact = np.stack([np.ones(3), sizes], axis=1) / (2e-5 + 1e-9 * sizes)[:, None]
    assert np.allclose(nonnegative_fit(exact), (2e-5, 1e-9), rtol=1e-9)
    slope_only = np.stack([np.ones(3), sizes], axis=1) / (1e-9 * sizes * np.array([0.5, 1.0, 1.0]))[:, None]
    alpha, beta = nonnegative_fit(slope_only)
    column = slope_only[:, 1]
    assert alpha == 0.0 and beta == pytest.approx(column.sum() / (column @ column), rel=1e-12)
    assert np.linalg.lstsq(slope_only, np.ones(3), rcond=None)[0][0] < 0  # the free fit's alpha was negative

    # A small size slower than larger ones was stalled: it is bounded by the larger sizes' times.
    stalled = never_faster_when_larger(np.array([5e-2, 3e-5, 4e-5, 3e-4, 5e-3]))
    assert stalled.tolist() == [3e-5, 3e-5, 4e-5, 3e-4, 5e-3]
    # Times that do not grow with size (noise over a transfer too small to see): no per-byte cost, no model.
    path = tmp_path / "model.json"
    CostModel(1e-3, 1e-6, 0.0, "the user's").save(path)
    rows = [Row("ferro-tcp", "allreduce", size, size // 4, "float32", "sum", -1, 2, seconds * 1e6, None, None, None,
                name) for name in ("ring", "recursive_doubling", "halving_doubling")
            for size, seconds in ((8, 3e-4), (262144, 1.2e-4))]
    args = argparse.Namespace(fit=str(path), emulate=None, line_rate=None)
    assert fit_model(args, rows) == 1
    assert load_cost_model(str(path)).fitted_on == "the user's"


def test_fit_takes_the_time_forms_from_4_kib_and_times_every_size(tmp_path):
    import argparse

    from ferro.backend.cost_model import CostModel, load_cost_model
    from ferro.tools.bench.fit import FORM_MIN_BYTES, fit_model
    from ferro.tools.bench.table import Row

    assert FORM_MIN_BYTES == 4096
    # From 4 KiB each algorithm's times follow its form exactly; below, the ranks wait on shared cores, half as
    # long again (as on an emulated cluster): the forms come back exact, and the table keeps 4 B.
    truth, n = {"ring": (8e-5, 7e-8), "recursive_doubling": (1e-4, 9e-8), "halving_doubling": (6e-5, 8e-8)}, 16
    rows = []
    for name, (alpha, beta) in truth.items():
        for size in (4, 64, 1024, 4096, 1 << 16, 1 << 20):
            seconds = CostModel(alpha, beta).allreduce(name, size, n)
            if size < 4096:
                seconds *= 1.5
            rows.append(Row("ferro-tcp", "allreduce", size, max(1, size // 4), "float32", "sum", -1, n, seconds * 1e6,
                            None, None, None, name))
    path = tmp_path / "model.json"
    assert fit_model(argparse.Namespace(fit=str(path), emulate=None, line_rate=None, iters=20), rows) == 0
    model = load_cost_model(str(path))
    for name, costs in truth.items():
        assert model.per_algorithm[name] == pytest.approx(costs, rel=1e-6), name
        assert [size for size, _ in model.measured[name]] == [4, 64, 1024, 4096, 1 << 16, 1 << 20]
    assert (model.alpha, model.beta) == pytest.approx(truth["ring"], rel=1e-6)


def _simulated(args):
    import contextlib
    import io

    from ferro.tools.bench.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(args)
    return code, out.getvalue(), err.getvalue()


def test_simulate_prints_every_op_s_choice_beside_every_plan_and_the_bound():
    from ferro._core import collectives as native
    from ferro.tools.bench import simulate

    ops = ["allreduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all"]
    code, out, _ = _simulated([*ops, "--simulate", "16x1@100mbit", "-b", "4K", "-e", "4M", "-f", "32"])
    assert code == 0
    sections = out.split("#\n# ")[1:]
    assert [section.splitlines()[0] for section in sections] == ops
    network = simulate.parse_network("16x1@100mbit")
    row_form = re.compile(r"^\s*(\d+)\s+\d+\s+\w+\s+\w+\s+-?\d+\s+([a-z_ -]+?)\s+([\d.]+)\s+[\d.]+\s+(.*)$")
    for op, section in zip(ops, sections, strict=True):
        names = sorted(simulate.OP_ALGORITHMS[op])
        rows = [row_form.match(line) for line in section.splitlines()[2:]]
        assert all(rows) and [int(row.group(1)) for row in rows] == [4096, 131072, 4194304], (op, section)
        for row in rows:
            size, chosen, time_us = int(row.group(1)), row.group(2), float(row.group(3))
            *predicted, bound = (float(value) for value in row.group(4).split())
            assert len(predicted) == len(names) and chosen in names, (op, row.group(0))
            if op in ("broadcast", "reduce", "all_gather", "all_to_all"):  # the mesh's own forms, its defaults
                assert chosen == native.choose(op, size, 16), (op, size)
            assert bound == pytest.approx(simulate.lower_bound(network, size, op) * 1e6, rel=1e-3)
            assert min(predicted) >= bound * 0.999, (op, row.group(0))
            assert time_us == predicted[names.index(chosen)], (op, row.group(0))


def test_simulate_where_hosts_hold_several_ranks_chooses_the_hierarchy_s_two_level_plans():
    """``--backend auto`` (the default) runs the hierarchy on 4 hosts of 2 ranks; ``tcp`` the flat plans."""
    from ferro.collective.resolve import resolve_allreduce_algorithm
    from ferro.tools.bench import simulate, two_level

    network = simulate.parse_network("4x2@1gbit")
    for backend, size in (("auto", 4096), ("auto", 4 << 20), ("tcp", 4 << 20)):
        code, out, _ = _simulated(["allreduce", "--simulate", "4x2@1gbit", "-b", str(size), "-e", str(size),
                                   "--backend", backend])
        assert code == 0
        header, row = [line for line in out.splitlines() if line.startswith(("# ", "  "))][-2:]
        values = row.split()
        if backend == "auto":  # the leaders' choice for one piece among the 4 hosts, and its replay
            leaders = resolve_allreduce_algorithm(size // (8 if size > 4096 else 1), 4)
            assert header.split()[-2] == "two-level"
            assert row.split()[5:7] == ["two-level", leaders], row
            assert float(values[7]) == pytest.approx(
                two_level.predict_two_level(network, leaders, size) * 1e6, abs=0.1)
            assert float(values[-2]) == float(values[7])
        else:
            assert "two-level" not in header and values[5] == resolve_allreduce_algorithm(size, 8)


def test_simulate_refuses_what_it_cannot_replay():
    code, _, err = _simulated(["sendrecv", "--simulate", "4x1@1gbit"])
    assert code == 2 and "point-to-point" in err
    code, _, err = _simulated(["allreduce", "--simulate", "4 hosts"])
    assert code == 2 and "HOSTSxRANKS@RATE" in err


def test_fit_shares_the_machine_s_cpu_out_over_the_plans_messages_and_bytes(tmp_path):
    import argparse

    from ferro.backend.cost_model import load_cost_model
    from ferro.tools.bench import simulate
    from ferro.tools.bench.fit import fit_model
    from ferro.tools.bench.table import Row

    # Rows whose CPU per call is exactly 25 us per message and 2 ns per byte sent (plus the replay's reduce
    # rate) of the frames each plan moves at 8 ranks on 2 emulated hosts: the fit gives those costs back.
    per_message, per_byte, n = 25e-6, 2e-9, 8
    network = simulate.Network(2, 4, 1.0)
    rows = []
    for name in ("ring", "recursive_doubling", "halving_doubling"):
        for size, seconds in ((4096, 1e-3), (1 << 16, 4e-3), (1 << 20, 5e-2)):
            messages, sent, reduced = simulate.traffic(network, name, size)
            cpu = messages * per_message + sent * per_byte + reduced / network.reduce_rate
            rows.append(Row("ferro-tcp", "allreduce", size, size // 4, "float32", "sum", -1, n, seconds * 1e6, None,
                            None, None, name, cpu * 1e6))
    path = tmp_path / "model.json"
    args = argparse.Namespace(fit=str(path), emulate="2x4@100mbit", line_rate=None, iters=20)
    assert fit_model(args, rows) == 0
    fitted = load_cost_model(str(path)).cpu
    assert fitted[0] == pytest.approx(per_message, rel=1e-9) and fitted[1] == pytest.approx(per_byte, rel=1e-9)
    assert fitted[2] == os.cpu_count()
    # Rows without CPU figures (off Linux) leave the model's CPU unmeasured.
    assert fit_model(args, [dataclasses.replace(row, cpu_us=None) for row in rows]) == 0
    assert load_cost_model(str(path)).cpu == (0.0, 0.0, 0)


def test_traffic_counts_the_frames_the_replay_sends():
    from ferro.tools.bench import simulate

    network = simulate.Network(4, 1, 1.0)
    # Recursive doubling at 4 ranks: 2 rounds, each rank sends and reduces the whole message once a round.
    assert simulate.traffic(network, "recursive_doubling", 4096) == (8, 8 * 4096, 8 * 4096)
    # The ring of a small message: 2 (n - 1) steps of one chunk each per rank, the first n - 1 reducing.
    assert simulate.traffic(network, "ring", 4096) == (4 * 6, 4 * 6 * 1024, 4 * 3 * 1024)
    # A broadcast by binomial tree reaches each of the other ranks once.
    assert simulate.traffic(network, "binomial tree", 4096, op="broadcast")[:2] == (3, 3 * 4096)


def test_the_machine_s_busy_cpu_counts_a_busy_loop_and_no_more_than_the_cores_could_run():
    from ferro.tools.bench.worker import machine_busy_seconds

    wall_start, busy_start = time.monotonic(), machine_busy_seconds()
    while time.monotonic() - wall_start < 0.5:  # one core busy for half a second
        pass
    busy, wall = machine_busy_seconds() - busy_start, time.monotonic() - wall_start
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert 0.5 - 2 * tick <= busy <= wall * os.cpu_count() + 2 * tick * os.cpu_count()


def _scale_sweep_script():
    """bench/bench_scale_collectives.py as a module (bench/ is scripts, not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / "bench_scale_collectives.py"
    spec = importlib.util.spec_from_file_location("_bench_scale_collectives", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_scale_sweep_plot_draws_a_panel_per_op_and_a_line_per_library_from_the_rows(tmp_path, monkeypatch):
    import matplotlib.figure

    script = _scale_sweep_script()

    def row(op, size, measured, predicted, peers):
        return {"cluster": "4x1@100mbit", "op": op, "size": size, "algorithm": "ring", "measured_us": measured,
                "predicted_us": predicted, "bound_us": measured / 2, "peers_us": peers}

    rows = [row("allreduce", 1024, 10.0, 11.0, {"torch-gloo": 30.0, "stream": 5.0}),
            row("allreduce", 4096, 20.0, None, {"torch-gloo": 60.0, "stream": 9.0}),  # no replay: no point
            row("allreduce", 4096, 99.0, 99.0, {"torch-gloo": 99.0}),  # a size given twice: the first stands
            row("reduce_scatter", 1024, 7.0, 8.0, {"mpi": 70.0})]
    drawn = {}
    save = matplotlib.figure.Figure.savefig

    def capture(figure, path, **options):
        drawn.update({axis.get_title(): {line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
                                         for line in axis.get_lines()} for axis in figure.axes if axis.get_visible()})
        return save(figure, path, **options)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", capture)
    script.plot(rows, str(tmp_path / "sweep.png"))
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(drawn) == {"4x1@100mbit allreduce", "4x1@100mbit reduce_scatter"}
    allreduce, reduce_scatter = drawn["4x1@100mbit allreduce"], drawn["4x1@100mbit reduce_scatter"]
    assert allreduce == {"ferro": ([1024, 4096], [10.0, 20.0]), "ferro predicted": ([1024], [11.0]),
                         "bound": ([1024, 4096], [5.0, 10.0]), "stream": ([1024, 4096], [5.0, 9.0]),
                         "gloo": ([1024, 4096], [30.0, 60.0])}
    assert reduce_scatter == {"ferro": ([1024], [7.0]), "ferro predicted": ([1024], [8.0]), "bound": ([1024], [3.5]),
                              "Open MPI": ([1024], [70.0])}
    # One op on several clusters: a panel per cluster, side by side in rows of three (not one tall column).
    placed = {}

    def where(figure, path, **options):
        placed.update({axis.get_title(): axis.get_subplotspec().get_geometry()[:2] for axis in figure.axes
                       if axis.get_visible()})
        return save(figure, path, **options)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", where)
    clusters = ["8x1@100mbit", "16x1@100mbit", "32x1@100mbit", "8x2@200mbit"]
    script.plot([dict(row("all_to_all", 1024, 10.0, 11.0, {}), cluster=c) for c in clusters], str(tmp_path / "a.png"))
    assert placed == {f"{c} all_to_all": (2, 3) for c in clusters}  # 2 rows of 3 columns, the last row part-full

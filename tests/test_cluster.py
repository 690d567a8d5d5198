"""The emulated cluster: hosts as network namespaces behind a bridge, links shaped by tc, ferro jobs across them."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from ferro.errors import ConfigurationError
from ferro.tools.emulate import EmulatedCluster, bucket_bytes, cluster_unavailable, parse_emulation

FERRO = [sys.executable, "-m", "ferro"]
needs_cluster = pytest.mark.skipif(cluster_unavailable() is not None, reason=str(cluster_unavailable()))


def test_emulation_specs_are_parsed_and_bad_ones_refused():
    assert parse_emulation("2x2@1gbit") == (2, 2, "1gbit")
    assert parse_emulation("4x1@10GBIT") == (4, 1, "10gbit")
    assert parse_emulation("3x8@100mbit") == (3, 8, "100mbit")
    for bad in ("2x2", "2x2@1gb", "0x2@1gbit", "x2@1gbit", "2*2@1gbit"):
        with pytest.raises(ConfigurationError, match="HOSTSxRANKS@RATE|at least 1"):
            parse_emulation(bad)


def _namespaces():
    return set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())


@needs_cluster
def test_links_are_shaped_both_ways_and_the_namespaces_go_away():
    with EmulatedCluster(2, "100mbit") as cluster:
        names = [*cluster.namespaces, cluster.switch]
        assert set(names) <= _namespaces()
        for host in range(2):
            shown = subprocess.run(cluster.command(host, ["tc", "qdisc", "show", "dev", "eth0"]),
                                   capture_output=True, text=True).stdout
            assert "tbf" in shown and "rate 100Mbit" in shown, shown
            # The bucket the simulator models these links with (bench/bench_scale_collectives.py).
            assert bucket_bytes("100mbit") == 65536 and "burst 64Kb" in shown, shown
            switch_side = subprocess.run(["tc", "-n", cluster.switch, "qdisc", "show", "dev", f"port{host}"],
                                         capture_output=True, text=True).stdout
            assert "rate 100Mbit" in switch_side, switch_side
        # The switch forwards without the firewall's hooks, where br_netfilter put them on every bridge.
        bridge = subprocess.run(["ip", "netns", "exec", cluster.switch, "sh", "-c",
                                 "cat /proc/sys/net/bridge/bridge-nf-call-* 2>/dev/null"],
                                capture_output=True, text=True).stdout.split()
        assert set(bridge) <= {"0"}, bridge
        # The hosts reach each other, and only through the bridge: their own loopbacks are their own.
        connect = f"import socket; socket.create_connection(('{cluster.address(1)}', 9), timeout=5)"
        ping = subprocess.run(cluster.command(0, [sys.executable, "-c", connect]), capture_output=True, text=True)
        assert "Connection refused" in ping.stderr, ping.stderr  # reached host 1, which listens on nothing
    assert not set(names) & _namespaces()


JOB = """
    import json, os
    import numpy as np, ferro
    group = ferro.init_process_group(timeout=60)
    x = np.full(4, float(group.rank + 1))
    ferro.allreduce(x)
    print("RESULT " + json.dumps({"rank": group.rank, "sum": x.tolist(), "backend": type(group).__name__}))
    ferro.destroy_process_group()
"""


@needs_cluster
def test_a_job_across_two_emulated_hosts_of_two_ranks_runs_hierarchical(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    with EmulatedCluster(2, "1gbit") as cluster:
        launchers = []
        for host in range(2):
            env = dict(os.environ, FERRO_SECRET="0123456789abcdef0123456789abcdef", FERRO_HOST_ID=f"host{host}",
                       FERRO_BIND_ADDR=cluster.address(host))
            command = cluster.command(host, [*FERRO, "run", "--nnodes", "2", "--node-rank", str(host),
                                             "--nproc-per-node", "2", "--master-addr", cluster.address(0),
                                             "--master-port", "29611", str(script)])
            launchers.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                              text=True, cwd=tmp_path))
        outputs = [p.communicate(timeout=120) for p in launchers]
    results = {}
    report = "\n".join(f"host {host} exited {launcher.returncode}:\n{err[-2500:]}"
                       for host, ((_, err), launcher) in enumerate(zip(outputs, launchers, strict=True)))
    for (out, _), launcher in zip(outputs, launchers, strict=True):
        assert launcher.returncode == 0, report  # both hosts: the one that failed first may be either
        for line in out.splitlines():
            if "RESULT " in line:
                found = json.loads(line.split("RESULT ", 1)[1])
                results[found["rank"]] = found
    assert sorted(results) == [0, 1, 2, 3]
    assert all(r["sum"] == [10.0] * 4 and r["backend"] == "HierarchicalBackend" for r in results.values())


def test_bench_refuses_a_bad_emulation_and_a_rank_count_that_disagrees(tmp_path):
    # cwd: not the clone's root, whose ferro/ is the uncompiled source tree
    bad = subprocess.run([*FERRO, "bench", "--emulate", "2x2", "allreduce"], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert bad.returncode == 2 and "HOSTSxRANKS@RATE" in bad.stderr
    if cluster_unavailable() is None:
        other = subprocess.run([*FERRO, "bench", "--emulate", "2x2@1gbit", "-n", "3", "allreduce"],
                               capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert other.returncode == 2 and "is 4 ranks" in other.stderr


@needs_cluster
def test_bench_runs_ferro_and_gloo_on_an_emulated_cluster(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "rows.json"
    done = subprocess.run([*FERRO, "bench", "--emulate", "2x1@1gbit", "-b", "4K", "-e", "64K", "-f", "4",
                           "--iters", "3", "--warmup", "1", "--check", "--compare", "torch-gloo,mpi,stream", "--json",
                           str(out), "allreduce"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    libraries = {r["library"] for r in rows}
    # Two hosts of one rank: no two ranks share a host, so auto picks TCP, across the namespaces' link. Open MPI
    # ran through the launch agent, one daemon per namespace; the stream rows are the links' line-rate times.
    assert libraries == {"ferro-tcp", "torch-gloo", "mpi", "stream"}, libraries
    assert "fraction of line rate" in done.stdout
    stream = sorted((r for r in rows if r["library"] == "stream"), key=lambda r: r["size"])
    assert [r["size"] for r in stream] == [4096, 16384, 65536]
    assert stream[0]["oop_time_us"] > 0 and stream[2]["oop_time_us"] > 3 * stream[0]["oop_time_us"]
    assert all(r["world_size"] == 2 for r in rows)
    # --check verifies ferro's results (the worker checks ferro's rows only): every element right.
    assert all(r["oop_wrong"] == 0 and r["ip_wrong"] == 0 for r in rows if r["library"] == "ferro-tcp")


@needs_cluster
def test_a_stream_reference_that_fails_costs_its_rows_not_the_libraries(tmp_path, monkeypatch, capsys):
    # Seen at 32x1: one host's stream carried nothing in its window, and the division by its rate of 0 lost the
    # whole sweep's rows.
    from ferro.tools.bench import cli

    def nothing_received(cluster):
        raise RuntimeError("host 3 received nothing in 3 s")

    monkeypatch.setattr(cli, "measure_stream", nothing_received)
    monkeypatch.chdir(tmp_path)  # the ranks' python -m must find the installed ferro, not the source tree
    out = tmp_path / "rows.json"
    code = cli.main(["--emulate", "2x1@1gbit", "-b", "4K", "-e", "4K", "--iters", "2", "--warmup", "1", "--compare",
                     "stream", "--json", str(out), "allreduce"])
    assert code == 0
    assert "# stream: not measured (host 3 received nothing in 3 s); no stream rows" in capsys.readouterr().out
    assert {r["library"] for r in json.loads(out.read_text())} == {"ferro-tcp"}


def test_the_line_rate_reference_counts_each_op_s_bytes_on_a_host_s_link():
    from ferro.tools.bench.stream import link_bytes, stream_rows
    from ferro.tools.bench.table import Row

    assert link_bytes("allreduce", 1000, 2) == 1000  # 2 (H-1)/H
    assert link_bytes("allreduce", 1000, 4) == 1500
    assert link_bytes("all_gather", 1000, 4) == 750 and link_bytes("reduce_scatter", 1000, 2) == 500
    assert link_bytes("broadcast", 1000, 4) == link_bytes("reduce", 1000, 4) == 1000  # the root's host, once
    assert link_bytes("all_to_all", 1000, 4) == 750 and link_bytes("all_to_all", 1000, 4, ranks_per_host=2) == 1500
    assert link_bytes("sendrecv", 1000, 2) is None and link_bytes("allreduce", 1000, 1) is None
    template = [Row("ferro-hierarchical", "allreduce", 1 << 20, 1 << 18, "float32", "sum", -1, 4, 1.0, 1.0, None,
                    None), Row("ferro-hierarchical", "all_to_all", 1 << 20, 1 << 18, "float32", "none", -1, 4, 1.0,
                               None, None, None), Row("ferro-hierarchical", "sendrecv", 1 << 20, 1 << 18, "float32",
                                                      "none", -1, 4, 1.0, None, None, None)]
    allreduce, all_to_all = stream_rows(125e6, template, hosts=2)  # sendrecv is not modelled
    assert allreduce.library == "stream" and allreduce.op == "allreduce" and allreduce.world_size == 4
    assert allreduce.oop_time_us == allreduce.ip_time_us == pytest.approx((1 << 20) / 125e6 * 1e6)
    # Two ranks a host each send half their megabyte to the other host: a megabyte on the link.
    assert all_to_all.oop_time_us == pytest.approx((1 << 20) / 125e6 * 1e6) and all_to_all.ip_time_us is None


def test_mpirun_under_emulation_takes_open_mpi_4_and_5_launcher_settings(tmp_path):
    # Open MPI 5's runtime (PRRTE) takes --prtemca; Open MPI 4.1 (Debian's) refuses it ("unknown option
    # --prtemca") and takes ORTE's --mca plm_rsh_agent instead. No namespaces are made to build the command.
    cluster = EmulatedCluster(2, "100mbit")
    cluster._head = True  # the switch's address is added by a real cluster; here only the command is built
    five = cluster.mpirun_command("mpirun", 1, ["python", "x.py"], str(tmp_path), version=(5, 0, 3))
    four = cluster.mpirun_command("mpirun", 1, ["python", "x.py"], str(tmp_path), version=(4, 1, 4),
                                  forward=["MPI4PY_LIBMPI"])
    assert "--prtemca" in five and "plm_ssh_agent" in five and "plm_rsh_agent" not in five
    assert "--prtemca" not in four and "plm_rsh_agent" in four and four[four.index("plm_rsh_no_tree_spawn") + 1] == "1"
    assert four[four.index("-x") + 1] == "MPI4PY_LIBMPI" and four[-2:] == ["python", "x.py"]


_SYSTEM_MPIRUN = "/usr/bin/mpirun"


@needs_cluster
def test_both_open_mpi_versions_run_one_rank_per_emulated_host_on_their_own_library(tmp_path):
    import subprocess
    import sys

    from ferro.backend.mpi.launch import LIBMPI_ENV, find_mpirun, mpirun_environment, open_mpi_version

    candidates = [m for m in (find_mpirun(), _SYSTEM_MPIRUN) if m and open_mpi_version(m)]
    if not candidates:
        pytest.skip("no Open MPI mpirun here")
    # One write per rank (print writes each field apart, and once mpirun's forwarding interleaved two ranks'
    # fields on one line in CI).
    script = ("from mpi4py import MPI; import socket, sys; sys.stdout.write(f'{MPI.COMM_WORLD.Get_rank()} "
              "{socket.gethostname()} {MPI.Get_library_version().split(\",\")[0]}\\n'); sys.stdout.flush()")
    for mpirun in dict.fromkeys(candidates):
        env = mpirun_environment(mpirun=mpirun)
        version = open_mpi_version(mpirun)
        with EmulatedCluster(2, "100mbit") as cluster:
            command = cluster.mpirun_command(mpirun, 1, [sys.executable, "-c", script], str(tmp_path),
                                             version=version, forward=[LIBMPI_ENV] if LIBMPI_ENV in env else [])
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, f"{mpirun}: {done.stderr[-3000:]}"
        lines = sorted(done.stdout.split("\n"))[-2:]
        ranks = {line.split()[0]: line.split()[1] for line in lines}
        assert set(ranks) == {"0", "1"} and ranks["0"] != ranks["1"], lines  # one rank on each host
        wanted = "v" + ".".join(map(str, version))
        assert all(wanted in line for line in lines), f"{mpirun} is Open MPI {wanted}, but the ranks ran {lines}"

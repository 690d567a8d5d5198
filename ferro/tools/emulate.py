"""An emulated cluster on one machine: hosts as network namespaces joined through a bridge, links shaped by ``tc``.

``EmulatedCluster(hosts=2, rate="1gbit")`` makes one namespace per host (its own
loopback and one interface, ``eth0``, with address ``10.<net>.<sub>.<host + 1>``),
one more namespace for the switch (a bridge), and a veth pair from each host to
the switch. Each host's link is shaped in both directions by a token-bucket
filter (``tbf``) at ``rate``: on the host's interface (what it sends) and on the
switch's end (what it receives), as a switch port would. Commands run inside a
host with :meth:`EmulatedCluster.command` (``ip netns exec``).

The switch forwards frames without running the machine's firewall hooks on them
(``br_netfilter``, where loaded, would; a switch does not, and the CPU they take
is the machine's, which the emulated hosts share).

What it does not emulate: propagation delay. ``netem``, the qdisc that adds
delay, is not available on the machines this was built on, so a link here has
its rate and the queueing delay its bucket adds, and no more (a 10 Gbit LAN's
propagation delay is a few microseconds, below what these VMs resolve anyway).

It needs root (namespaces, ``ip``, ``tc``); :func:`cluster_unavailable` says why
when it cannot run, for tests to skip with.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from types import TracebackType

from ferro import environment
from ferro.backend.base import SPIN_ENV, YIELD_ENV, default_spin_us, default_yield_us
from ferro.errors import ConfigurationError
from ferro.rendezvous.settings import free_port

__all__ = ["TCP_PAYLOAD_SHARE", "EmulatedCluster", "bucket_bytes", "cluster_unavailable", "parse_emulation",
           "payload_rate"]

_RATE = r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)"
_SPEC = re.compile(rf"^(\d+)x(\d+)@{_RATE}$")
_BITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
#: What a TCP stream carries of an emulated link's rate: 1448 bytes of payload in each 1514-byte frame the
#: token bucket counts (MTU 1500, TCP timestamps on).
TCP_PAYLOAD_SHARE = 1448 / 1514
#: The Linux release from which the bridge's netfilter settings belong to each network namespace.
PER_NAMESPACE_BRIDGE_SETTINGS = (5, 3)


def parse_emulation(spec: str) -> tuple[int, int, str]:
    """Parse ``HxR@RATE`` (``2x2@1gbit``, ``4x1@10gbit``) into ``(hosts, ranks per host, tc rate)``.

    Raises:
        ConfigurationError: Not of that form, or fewer than 1 host or rank.

    """
    found = _SPEC.match(spec.strip().lower())
    if not found:
        raise ConfigurationError(f"--emulate {spec!r}: give HOSTSxRANKS@RATE, for example 2x2@1gbit or 4x1@10gbit "
                                 f"(rates in kbit, mbit or gbit)")
    hosts, ranks = int(found.group(1)), int(found.group(2))
    if hosts < 1 or ranks < 1:
        raise ConfigurationError(f"--emulate {spec!r}: need at least 1 host and 1 rank per host")
    return hosts, ranks, f"{found.group(3)}{found.group(4)}"


def payload_rate(rate: str) -> float:
    """Return the bytes of TCP payload per second a link shaped to ``rate`` (``"100mbit"``) carries at the most.

    Raises:
        ConfigurationError: ``rate`` is not a number with kbit, mbit or gbit.

    """
    found = re.fullmatch(_RATE, rate.strip().lower())
    if not found:
        raise ConfigurationError(f"link rate {rate!r}: give a number with kbit, mbit or gbit (100mbit, 10gbit)")
    return float(found.group(1)) * _BITS[found.group(2)] / 8 * TCP_PAYLOAD_SHARE


def cluster_unavailable() -> str | None:
    """Return why an emulated cluster cannot be made here (None when it can)."""
    if os.geteuid() != 0:
        return "an emulated cluster needs root (it creates network namespaces); run as root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"an emulated cluster needs {' and '.join(missing)} (Debian: apt-get install iproute2)"
    return None


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise ConfigurationError(f"emulated cluster: `{' '.join(argv)}` failed: {done.stderr.strip()}")


class EmulatedCluster:
    """``hosts`` network namespaces behind one bridge, each link shaped to ``rate`` both ways.

    Args:
        hosts: How many hosts.
        rate: Each link's rate, as ``tc`` writes it (``"1gbit"``, ``"10gbit"``, ``"100mbit"``).
        burst: The token bucket's size (default: 1 ms of the rate, at least 64 KiB).

    Example::

        with EmulatedCluster(2, "1gbit") as cluster:
            server = subprocess.Popen(cluster.command(0, ["python", "serve.py"]))
            client = subprocess.run(cluster.command(1, ["python", "fetch.py", cluster.address(0)]))

    """

    def __init__(self, hosts: int, rate: str = "1gbit", burst: str | None = None) -> None:
        reason = cluster_unavailable()
        if reason is not None:
            raise ConfigurationError(reason)
        if hosts < 1:
            raise ConfigurationError(f"emulated cluster: need at least 1 host, got {hosts}")
        self.hosts = hosts
        self.rate = rate
        self.burst = burst or _burst(rate)
        tag = os.getpid() % 100000
        self.namespaces = [f"ferro{tag}h{i}" for i in range(hosts)]
        self.switch = f"ferro{tag}sw"
        self.subnet = f"10.{200 + tag % 50}.{tag % 250}"
        self._made: list[str] = []
        self._head = False  # whether the bridge has mpirun's address yet

    def address(self, host: int) -> str:
        """Return the address of ``host`` (its ``eth0``)."""
        return f"{self.subnet}.{host + 1}"

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """Return ``argv`` as run inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[host], *argv]

    def run_job(self, ranks_per_host: int, target: Sequence[str], env: dict[str, str] | None = None) -> int:
        """Run ``ferro run ... TARGET`` with ``ranks_per_host`` ranks on every host; return the first failure's code.

        One ``ferro run --nnodes`` per host, in its namespace. Hosts are told
        apart by ``FERRO_HOST_ID`` (they share this machine's name), every rank
        listens on its host's address, and gloo's ranks use the host's
        interface, not loopback. ``target`` is what ``ferro run`` takes after
        its options (``["-m", "module", ...]`` or ``["script.py", ...]``).
        """
        secret = environment.get("FERRO_SECRET") or secrets.token_hex(16)
        port = str(free_port())
        launchers = []
        for host in range(self.hosts):
            host_env = self.host_environment(host, ranks_per_host, os.environ if env is None else env, secret)
            command = self.command(host, [sys.executable, "-m", "ferro", "run", "--nnodes", str(self.hosts),
                                          "--node-rank", str(host), "--nproc-per-node", str(ranks_per_host),
                                          "--master-addr", self.address(0), "--master-port", port, "--no-prefix",
                                          *target])
            launchers.append(subprocess.Popen(command, env=host_env))
        codes = [launcher.wait() for launcher in launchers]
        return next((code for code in codes if code), 0)

    def host_environment(self, host: int, ranks_per_host: int, env: Mapping[str, str], secret: str) -> dict[str, str]:
        """Return ``env`` with what ``host``'s launcher needs: the job's secret, the host's name and address.

        The emulated hosts share this machine's cores, which each rank's launcher cannot see (it counts only its
        own host's ranks). So the ranks are told what the backends' defaults make of all of them on this
        machine's cores (``FERRO_SPIN_US`` and ``FERRO_YIELD_US``, unless they are set): sixteen ranks spinning
        on two cores starve the ones that have work, which no real host of one rank would do.
        """
        host_env = dict(env, FERRO_SECRET=secret, FERRO_HOST_ID=f"host{host}", FERRO_BIND_ADDR=self.address(host),
                        GLOO_SOCKET_IFNAME="eth0")
        here = self.hosts * ranks_per_host
        defaults = {SPIN_ENV: str(default_spin_us(None, here)), YIELD_ENV: str(default_yield_us(None, here))}
        return {**defaults, **host_env}  # what the caller set wins

    def mpirun_command(self, mpirun: str, ranks_per_host: int, argv: Sequence[str], workdir: str,
                       version: tuple[int, ...] | None = None, forward: Sequence[str] = ()) -> list[str]:
        """Return an Open MPI ``mpirun`` command that runs ``argv`` as ``ranks_per_host`` ranks on every host.

        ``version`` is the Open MPI's (``open_mpi_version``; default 5): Open MPI 5's runtime (PRRTE) takes its
        launcher settings as ``--prtemca plm_ssh_agent``, Open MPI 4's (ORTE) as ``--mca plm_rsh_agent``, with
        tree spawning off so that every daemon is started from the switch's namespace. ``forward`` names
        environment variables the remote ranks need (``-x``), such as ``MPI4PY_LIBMPI``.

        ``mpirun`` itself runs in the switch's namespace (its bridge gets the
        address ``.254``, so the hosts' daemons can call back) and starts one
        daemon per host through a launch agent written into ``workdir``, in
        place of ``ssh``: ``ip netns exec`` into the host's namespace, with a
        hostname of its own (``unshare --uts``), since Open MPI tells nodes
        apart by name and the namespaces share this machine's. MPI's TCP
        traffic stays on the cluster's subnet, so it crosses the shaped links.
        """
        if not self._head:
            _run("ip", "-n", self.switch, "addr", "add", f"{self.subnet}.254/24", "dev", "br0")
            self._head = True
        agent = os.path.join(workdir, "ferro-emulated-ssh")
        cases = "".join(f"  {self.address(host)}) ns={namespace} ;;\n"
                        for host, namespace in enumerate(self.namespaces))
        with open(agent, "w") as script:
            script.write(f'#!/bin/sh\nhost="$1"; shift\ncase "$host" in\n{cases}'
                         f'  *) echo "ferro-emulated-ssh: unknown host $host" >&2; exit 1 ;;\nesac\n'
                         f'exec ip netns exec "$ns" unshare --uts /bin/sh -c "hostname $host; $*"\n')
        os.chmod(agent, 0o755)
        hosts = ",".join(f"{self.address(host)}:{ranks_per_host}" for host in range(self.hosts))
        subnet = f"{self.subnet}.0/24"
        if version is not None and version[0] < 5:
            runtime = ["--mca", "plm_rsh_agent", agent, "--mca", "plm_rsh_no_tree_spawn", "1",
                       "--mca", "oob_tcp_if_include", subnet]
        else:
            runtime = ["--prtemca", "plm_ssh_agent", agent, "--prtemca", "oob_tcp_if_include", subnet]
        exported = [item for name in forward for item in ("-x", name)]
        return ["ip", "netns", "exec", self.switch, mpirun, "--oversubscribe", "-n", str(self.hosts * ranks_per_host),
                "--host", hosts, "--map-by", f"ppr:{ranks_per_host}:node", *runtime,
                "--mca", "btl_tcp_if_include", subnet, *exported, *argv]

    def __enter__(self) -> EmulatedCluster:
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def _make(self) -> None:
        _run("ip", "netns", "add", self.switch)
        self._made.append(self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        self._keep_bridge_out_of_netfilter()
        for host, namespace in enumerate(self.namespaces):
            _run("ip", "netns", "add", namespace)
            self._made.append(namespace)
            _run("ip", "-n", namespace, "link", "set", "lo", "up")
            port = f"port{host}"
            _run("ip", "link", "add", "eth0", "netns", namespace, "type", "veth", "peer", "name", port, "netns",
                 self.switch)
            _run("ip", "-n", namespace, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            _run("ip", "-n", namespace, "link", "set", "eth0", "up")
            _run("ip", "-n", self.switch, "link", "set", port, "master", "br0")
            _run("ip", "-n", self.switch, "link", "set", port, "up")
            # Both directions, as a switch port at that speed would pass them.
            for where, device in ((namespace, "eth0"), (self.switch, port)):
                _run("tc", "-n", where, "qdisc", "add", "dev", device, "root", "tbf", "rate", self.rate, "burst",
                     self.burst, "latency", "50ms")

    def _keep_bridge_out_of_netfilter(self) -> None:
        """Let the switch forward frames without passing them through iptables, as a switch does.

        Where ``br_netfilter`` is loaded (Docker loads it), every bridged frame
        runs the netfilter hooks (``bridge-nf-call-iptables=1``): 3-4 % of the
        samples (``perf``) of a 4 MiB ring allreduce among 8 hosts of 2 ranks at
        200 Mbit, where the machine's 2 cores had no idle time. Four alternating
        rounds with and without the hooks differed by less than their noise
        (336-416 ms against 352-410). The settings are per namespace from Linux
        5.3; on an older kernel they are the whole machine's, and are left alone.
        """
        release = re.match(r"(\d+)\.(\d+)", os.uname().release)
        if release is None or (int(release.group(1)), int(release.group(2))) < PER_NAMESPACE_BRIDGE_SETTINGS:
            return
        off = ("import pathlib\nfor setting in pathlib.Path('/proc/sys/net/bridge').glob('bridge-nf-call-*'):\n"
               "    setting.write_text('0')")
        _run("ip", "netns", "exec", self.switch, sys.executable, "-c", off)

    def close(self) -> None:
        """Delete every namespace made (their interfaces go with them)."""
        while self._made:
            subprocess.run(["ip", "netns", "del", self._made.pop()], capture_output=True)


def bucket_bytes(rate: str) -> int:
    """Return the token bucket an emulated link of ``rate`` gets by default: a millisecond of it, at least 64 KiB.

    What the link may pass faster than ``rate`` after an idle spell (``tbf``'s burst, wire bytes).
    """
    found = re.fullmatch(_RATE, rate)
    if not found:
        return 256 * 1024
    bits = float(found.group(1)) * _BITS[found.group(2)]
    return max(int(bits / 8 / 1000), 65536)


def _burst(rate: str) -> str:
    return f"{bucket_bytes(rate)}b"

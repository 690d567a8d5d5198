"""Separate hosts out of one Linux machine: network namespaces joined by a veth pair.

To the network, ranks in different namespaces are on different hosts (ferro's
host identity includes the namespace), so multi-host code paths, such as the
hierarchical process group, can be tested and measured on one machine. Needs
root and iproute2's ``ip``.

Example::

    with two_hosts() as (names, master_addr):
        # in each rank process, first: enter_namespace(names[host_of_this_rank])
        ...
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["can_create_namespaces", "enter_namespace", "many_hosts", "two_hosts"]

CLONE_NEWNET = 0x40000000


def can_create_namespaces() -> bool:
    """Whether this process may create network namespaces (root, with ``ip`` installed)."""
    return os.geteuid() == 0 and shutil.which("ip") is not None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@contextmanager
def two_hosts(subnet: str | None = None) -> Iterator[tuple[list[str], str]]:
    """Create two network namespaces joined by a veth pair; yield their names and the first one's address.

    Args:
        subnet: The first three octets of the pair's /24 (default: 10.231.x, x from the pid).
            The addresses exist only inside the two namespaces.

    Both namespaces (and with them the veth pair) are deleted on exit.

    """
    tag = str(os.getpid() % 100000)
    names = [f"ferro-h0-{tag}", f"ferro-h1-{tag}"]
    prefix = subnet or f"10.231.{os.getpid() % 250}"
    try:
        for name in names:
            _ip("netns", "add", name)
            _ip("-n", name, "link", "set", "lo", "up")
        _ip("link", "add", f"fv0-{tag}", "netns", names[0], "type", "veth", "peer", "name", f"fv1-{tag}",
            "netns", names[1])
        for index, name in enumerate(names):
            _ip("-n", name, "addr", "add", f"{prefix}.{index + 1}/24", "dev", f"fv{index}-{tag}")
            _ip("-n", name, "link", "set", f"fv{index}-{tag}", "up")
        yield names, f"{prefix}.1"
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


@contextmanager
def many_hosts(count: int, rate: str | None = "100mbit") -> Iterator[tuple[list[str], list[str]]]:
    """Create ``count`` network namespaces on one switch; yield their names and addresses.

    The switch is a bridge in a namespace of its own (the machine's own network
    is left alone); each host joins it through a veth pair whose host end sends
    at ``rate`` (``tc`` ``tbf``; None: unshaped), so that the wire, not this
    machine's cores, is what a cluster of hosts waits on.

    Args:
        count: Hosts, at most 250.
        rate: Each host's sending rate, in ``tc``'s units (default ``"100mbit"``).

    """
    tag = str(os.getpid() % 100000)
    switch = f"ferro-sw-{tag}"
    names = [f"ferro-n{i}-{tag}" for i in range(count)]
    prefix = f"10.232.{os.getpid() % 250}"
    created = []
    try:
        _ip("netns", "add", switch)
        created.append(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for index, name in enumerate(names):
            _ip("netns", "add", name)
            created.append(name)
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("link", "add", f"fh{index}-{tag}", "netns", name, "type", "veth", "peer", "name", f"fs{index}-{tag}",
                "netns", switch)
            _ip("-n", name, "addr", "add", f"{prefix}.{index + 1}/24", "dev", f"fh{index}-{tag}")
            _ip("-n", name, "link", "set", f"fh{index}-{tag}", "up")
            _ip("-n", switch, "link", "set", f"fs{index}-{tag}", "master", "br0")
            _ip("-n", switch, "link", "set", f"fs{index}-{tag}", "up")
            if rate is not None:
                subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", f"fh{index}-{tag}", "root",
                                "tbf", "rate", rate, "burst", "256kb", "latency", "50ms"], check=True,
                               capture_output=True, timeout=30)
        yield names, [f"{prefix}.{i + 1}" for i in range(count)]
    finally:
        for name in reversed(created):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def enter_namespace(name: str) -> None:
    """Move the calling thread (and the threads it starts later) into network namespace ``name``.

    Call it first thing in a rank process, before any socket exists.

    Raises:
        OSError: The namespace does not exist, or the process may not enter it.

    """
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into network namespace {name}")
    finally:
        os.close(fd)

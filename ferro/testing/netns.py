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

__all__ = ["can_create_namespaces", "enter_namespace", "two_hosts"]

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

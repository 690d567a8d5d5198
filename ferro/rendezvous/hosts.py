"""Which ranks share a host (and its shared memory), and which share a machine's cores.

Ranks publish their identities through the store at rendezvous; ``backend="auto"``
and the hierarchical group decide from them what can go through shared memory.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from ferro import environment
from ferro.rendezvous.connect import time_left, wait_for_ranks

__all__ = ["HOST_ID_ENV", "HostIdentity", "crowded", "exchange_host_identities", "host_identity", "machine_identity",
           "usable_cpus"]

HOST_ID_ENV = "FERRO_HOST_ID"


def host_identity() -> str:
    """Return what ranks compare to know they share a host and its shared memory.

    The hostname and kernel boot id name the machine. The device and inode of
    ``/dev/shm`` tell containers that share a kernel but not shared memory
    apart, and the inode of the network namespace tells apart ranks that cannot
    reach each other over loopback (separate network namespaces are separate
    hosts to the network, so ferro treats them as such). ``$FERRO_HOST_ID``
    replaces all of it, to declare hosts explicitly.
    """
    explicit = environment.get(HOST_ID_ENV)
    if explicit:
        return f"explicit:{explicit}"
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    try:
        info = os.stat("/dev/shm")
        shm = f"{info.st_dev}:{info.st_ino}"
    except OSError:
        return f"no-shm:{os.getpid()}"  # no shared memory here: never counts as shared
    try:
        net = str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        net = "unknown-netns"
    return f"{socket.gethostname()}|{boot}|{shm}|{net}"


def machine_identity() -> str:
    """Return what ranks compare to know they share one machine's cores: the kernel's boot id.

    Unlike :func:`host_identity` it ignores namespaces and ``$FERRO_HOST_ID``:
    ranks in separate network namespaces of one machine compete for its cores.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return f"unknown-machine:{socket.gethostname()}"


def usable_cpus() -> int:
    """Return how many CPUs this process may run on.

    Its affinity mask where the OS keeps one (``taskset``, a container's or cgroup's
    cpuset, Slurm's or mpirun's binding), else every CPU of the machine: two ranks
    confined to one core must not be counted as having two.
    """
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no affinity masks on this OS
        return os.cpu_count() or 1


class HostIdentity(NamedTuple):
    """What one rank said of where it runs (:func:`exchange_host_identities`)."""

    host: str  #: :func:`host_identity`: ranks of one host share memory
    machine: str  #: :func:`machine_identity`: ranks of one machine share its cores
    cpus: int  #: the rank's :func:`usable_cpus` (0 where it did not say)


def exchange_host_identities(store: Any, rank: int, world_size: int, timeout: float) -> list[HostIdentity]:
    """Publish this rank's host and machine identities through ``store``; return every rank's, in rank order.

    Each is a :class:`HostIdentity`, ``(host, machine, cpus)``. Each rank counts its own exchanges in the store,
    so a job that does this more than once (a launcher's store, a re-created group) never reads stale answers.
    """
    deadline = time.monotonic() + timeout
    generation = store.add(f"ferro/host-joins/{rank}", 1, timeout=timeout)
    prefix = f"ferro/hosts/{generation}"
    store.set(f"{prefix}/{rank}", f"{host_identity()}\n{machine_identity()}\n{usable_cpus()}",
              timeout=time_left(deadline, rank, "publishing this rank's host"))
    keys = {r: f"{prefix}/{r}" for r in range(world_size)}
    wait_for_ranks(store, keys, deadline, rank, "say which host they run on")
    found = [store.get(key, timeout=time_left(deadline, rank, "reading the ranks' hosts")).decode().split("\n", 2)
             for key in keys.values()]
    return [HostIdentity(parts[0], parts[1] if len(parts) > 1 else parts[0],
                         int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else 0) for parts in found]


def crowded(identities: Sequence[tuple[str, str, int]]) -> bool:
    """Whether some machine runs more of these ranks than it has CPUs (as :func:`exchange_host_identities` says).

    Every rank decides alike from the same identities. A machine's CPUs are the most any of its ranks may use.
    """
    ranks: dict[str, int] = {}
    cpus: dict[str, int] = {}
    for _, machine, usable in identities:  # (host, machine, cpus), a HostIdentity or a plain tuple
        ranks[machine] = ranks.get(machine, 0) + 1
        cpus[machine] = max(cpus.get(machine, 0), usable)
    return any(cpus[machine] and count > cpus[machine] for machine, count in ranks.items())

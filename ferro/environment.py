"""Every ``FERRO_*`` environment variable ferro reads, in one registry.

Each read of a ``FERRO_*`` variable goes through :func:`get`, which refuses a
name that is not in :data:`VARIABLES`: so the table below is complete by
construction, and the documentation's "Environment variables" page, generated
from it, cannot go stale (``tests/test_environment.py`` also scans the source for
reads that bypass :func:`get`, and for ``FERRO_*`` names the table lacks).

What a variable means, its default and its checks stay with the code that reads
it; this module only names them, once. It imports nothing from ferro, so every
layer may use it.

Example:
    >>> from ferro import environment
    >>> environment.get("FERRO_TIMEOUT", environ={"FERRO_TIMEOUT": "30"})
    '30'

"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["AREAS", "VARIABLES", "Variable", "get"]


@dataclass(frozen=True)
class Variable:
    """One ``FERRO_*`` environment variable.

    Attributes:
        name: The variable, ``FERRO_...``.
        area: Which part of ferro reads it (one of :data:`AREAS`), for grouping on the page.
        default: What applies when it is unset, as a reader would write it.
        meaning: What it sets, in a sentence or two (Markdown).
        set_by_launcher: ``ferro run`` (or ``ferro bench``'s emulated hosts) sets it for the ranks it starts;
            a user sets it only to start ranks some other way.

    """

    name: str
    area: str
    default: str
    meaning: str
    set_by_launcher: bool = False


#: The areas, in the order the page lists them.
AREAS = ("Process groups", "Transports", "Launcher", "Diagnosis", "Elastic jobs", "GPUs and MPI", "Building")

_VARIABLES = (
    # Process groups
    Variable("FERRO_BACKEND", "Process groups", "unset (`backend=\"auto\"` chooses)",
             "The backend `backend=\"auto\"` takes, overriding its choice: `tcp`, `shm`, `hierarchical`, `mpi`, "
             "`nccl`, `hybrid` (`FERRO_BACKEND=mpi` under `mpirun`)."),
    Variable("FERRO_TIMEOUT", "Process groups", "60",
             "Default seconds every blocking operation of a group waits (rendezvous, collectives, receives) "
             "before it raises `DistributedTimeoutError`; a `timeout=` argument wins."),
    Variable("FERRO_SECRET", "Process groups", "none: a job without one is refused",
             "The job secret every rank and the store authenticate with. `ferro run` makes one per job; under "
             "`mpirun`, `srun` or `torchrun`, export the same value to every rank.", set_by_launcher=True),
    Variable("FERRO_BIND_ADDR", "Process groups", "the address that routes to `MASTER_ADDR` (`127.0.0.1` alone)",
             "The local address a rank listens on for its peers (and RPC workers for theirs)."),
    Variable("FERRO_LOG_LEVEL", "Process groups", "unset (Python's logging decides)",
             "The level of the `ferro` logger, set at `init_process_group`: `DEBUG`, `INFO`, `WARNING` ..."),
    Variable("FERRO_HOST_ID", "Process groups", "derived: boot id, `/dev/shm` and network namespace",
             "Declares which host a rank is on: ranks with the same value share memory and form one host of a "
             "hierarchical group (`ferro bench --emulate` sets it for each emulated host)."),
    Variable("FERRO_RPC_PORT", "Process groups", "`MASTER_PORT`",
             "The port rank 0 of `ferro.rpc.init_rpc` serves its store on."),
    # Transports
    Variable("FERRO_SPIN_US", "Transports", "50, or 0 when the host's ranks (`LOCAL_WORLD_SIZE`) outnumber its cores",
             "Microseconds a waiting rank spins before it naps or polls (shared memory and TCP)."),
    Variable("FERRO_YIELD_US", "Transports", "200 (TCP) or 1000 (shared memory), or 0 past four of the host's "
             "ranks a core",
             "Microseconds a rank that does not spin keeps trying between `sched_yield()` calls before it sleeps "
             "in `poll` (TCP) or naps (shared memory)."),
    Variable("FERRO_SOCKET_BUFFER_BYTES", "Transports", "4194304 (4 MiB)",
             "`SO_SNDBUF` and `SO_RCVBUF` of every TCP connection between ranks; 0 leaves the kernel's "
             "autotuning."),
    Variable("FERRO_TCP_CONGESTION", "Transports", "unset (the kernel's default)",
             "TCP congestion control of every connection between ranks (`TCP_CONGESTION`), e.g. `reno` or "
             "`cubic` where the kernel's default is BBR, which dropped thousands of packets in a 32-host "
             "all_to_all's incast; a name the kernel does not allow fails when the group starts."),
    Variable("FERRO_SHM_RING_BYTES", "Transports", "4194304 (4 MiB)",
             "Capacity of each rank-to-rank ring of a shared-memory group."),
    Variable("FERRO_SHM_BUFFER_BYTES", "Transports", "256 KiB, or 1 MiB when ranks outnumber the cores",
             "The chunk a shared-memory group's large collectives move through its arena."),
    Variable("FERRO_ALGORITHM_ALLREDUCE", "Transports", "unset (chosen by message size and world size)",
             "Forces the allreduce algorithm of every call without `algorithm=`: `ring`, `recursive_doubling` or "
             "`halving_doubling`. Every rank must set the same; ranks that differ fail with a mismatch."),
    Variable("FERRO_ALGORITHM_BROADCAST", "Transports", "unset (chosen by the cost forms)",
             "Forces a TCP group's broadcast plan: `binomial_tree`, `pipelined_chain` or `scatter_all_gather`. Read "
             "when the group is made; every rank must set the same (checked at rendezvous)."),
    Variable("FERRO_ALGORITHM_REDUCE", "Transports", "unset (chosen by the cost forms)",
             "Forces a TCP group's reduce plan: `binomial_tree`, `ring_gather` (the ring's reduce-scatter and a "
             "gather to the root) or `pipelined_chain`. Read when the group is made; every rank must set the same."),
    Variable("FERRO_ALGORITHM_ALL_GATHER", "Transports", "unset (chosen by the cost forms)",
             "Forces a TCP group's all_gather plan: `ring` or `bruck`. Read when the group is made; every rank must "
             "set the same."),
    Variable("FERRO_ALGORITHM_ALL_TO_ALL", "Transports", "unset (chosen by the cost forms)",
             "Forces a TCP group's all_to_all plan for equal blocks: `pairwise` or `bruck` (uneven blocks always "
             "take the pairwise exchange). Read when the group is made; every rank must set the same."),
    Variable("FERRO_HIERARCHY_FLAT_BYTES", "Transports",
             "where some machine runs more of the job's ranks than it has cores, 65536 (allreduce, broadcast, "
             "reduce) and 2097152 (all_gather, reduce_scatter); else 0",
             "Below this many bytes a hierarchical group runs allreduce, all_gather, reduce_scatter, broadcast and "
             "reduce on its TCP mesh over every rank instead of in two levels (0: never; one value for every op). "
             "Read when the group is made; every rank must set the same."),
    Variable("FERRO_COST_MODEL", "Transports", "unset (the rule measured on loopback)",
             "A cost model written by `ferro bench --fit`: allreduce algorithms are chosen by its predicted times, "
             "and the broadcast's, all_gather's and all_to_all's plans by its link figures. Every rank must read "
             "the same file (checked at rendezvous)."),
    # Launcher
    Variable("FERRO_RUN_ID", "Launcher", "torchrun's, Slurm's or Open MPI's job id, else the parent's pid",
             "Names the job in flight-recorder dumps and their folder."),
    Variable("FERRO_RESTART_COUNT", "Launcher", "0",
             "Which attempt (or which incarnation of a replaced member) this rank is.", set_by_launcher=True),
    Variable("FERRO_LAUNCHER_PID", "Launcher", "unset",
             "The launcher's process id: a rank's guardian has the kernel end the rank when it dies.",
             set_by_launcher=True),
    Variable("FERRO_GUARDIAN", "Launcher", "1",
             "`0` runs each rank without the guardian process that ends whatever the rank leaves behind."),
    Variable("FERRO_GRACE_SECONDS", "Launcher", "5",
             "Seconds a rank's guardian gives its leftover processes between `SIGTERM` and `SIGKILL`.",
             set_by_launcher=True),
    Variable("FERRO_ERROR_FILE", "Launcher", "unset (no record)",
             "Where a rank writes the record of the exception that ended it, for the launcher's failure report.",
             set_by_launcher=True),
    Variable("FERRO_HEARTBEAT_FILE", "Launcher", "unset (no heartbeat)",
             "A file the rank touches every 0.25 s, so `ferro run` tells a frozen rank from a busy one.",
             set_by_launcher=True),
    # Diagnosis
    Variable("FERRO_FLIGHT_RECORDER_SIZE", "Diagnosis", "2048",
             "How many of its latest calls each rank's flight recorder keeps; 0 turns it off."),
    Variable("FERRO_DUMP_DIR", "Diagnosis", "`<tmp>/ferro-dumps/<job>`",
             "Where ranks write flight-recorder dumps (a shared file system lets one host read them all).",
             set_by_launcher=True),
    Variable("FERRO_DUMP_ON_FAILURE", "Diagnosis", "1",
             "`0`: a failed collective does not write its rank's dump."),
    Variable("FERRO_HANG_TIMEOUT", "Diagnosis", "unset (off)",
             "Seconds without any call made or ended before a rank takes the job for stuck and dumps every "
             "rank's record.", set_by_launcher=True),
    Variable("FERRO_HANG_COLLECTOR", "Diagnosis", "unset",
             "`launcher`: ranks report a stall to `ferro run` instead of collecting the dumps themselves.",
             set_by_launcher=True),
    # Elastic jobs
    Variable("FERRO_ELASTIC", "Elastic jobs", "unset",
             "`1` under `ferro run --restart-policy rank`: the agent serves the job's store and replaces lost "
             "ranks, and `init_process_group` joins the elastic membership.", set_by_launcher=True),
    Variable("FERRO_MIN_SIZE", "Elastic jobs", "1",
             "An elastic job stops when fewer ranks than this remain.", set_by_launcher=True),
    Variable("FERRO_MIN_NODES", "Elastic jobs", "1",
             "An elastic job stops when the ranks left are on fewer nodes than this.", set_by_launcher=True),
    # GPUs and MPI
    Variable("FERRO_NCCL_LIBRARY", "GPUs and MPI", "searched: a loaded libnccl, then the nvidia-nccl wheels",
             "Path of the `libnccl.so` the NCCL backend loads."),
    Variable("FERRO_CUDA_DRIVER_LIBRARY", "GPUs and MPI", "`libcuda.so.1`",
             "Path of the CUDA driver library the NCCL backend loads."),
    Variable("FERRO_NCCL_HEARTBEAT_S", "GPUs and MPI", "1",
             "Seconds between the NCCL watchdog's looks at pending GPU work."),
    Variable("FERRO_ENABLE_GPU_FALLBACK", "GPUs and MPI", "unset (off)",
             "`1`: a GPU tensor given to a CPU group is copied to the host, reduced there and copied back, "
             "instead of refused."),
    Variable("FERRO_MPI_CHECK_CALLS", "GPUs and MPI", "0",
             "`1`: every MPI collective first checks that all ranks made the same call (one small allgather)."),
    Variable("FERRO_MPI_MAX_COUNT", "GPUs and MPI", "2147483647",
             "The largest count passed to one MPI call; larger messages are split. Lowered only by tests."),
    # Building (read by setup.py, before ferro exists)
    Variable("FERRO_DEBUG_BUILD", "Building", "unset",
             "`1` when building from source: compiled without optimisation, with assertions and debug symbols "
             "(for gdb and valgrind)."),
)

#: Every variable by name. :func:`get` reads only these.
VARIABLES: Mapping[str, Variable] = MappingProxyType({v.name: v for v in _VARIABLES})


def get(name: str, default: str | None = None, environ: Mapping[str, str] | None = None) -> str | None:
    """Return the value of the registered variable ``name``, or ``default`` when it is unset.

    Args:
        name: A name in :data:`VARIABLES`.
        default: What to return when the variable is unset.
        environ: Where to read (default: this process's environment).

    Raises:
        KeyError: ``name`` is not registered: add it to :data:`VARIABLES` first, so it is documented.

    """
    if name not in VARIABLES:
        raise KeyError(f"{name} is not in ferro.environment.VARIABLES: register it there, so its page lists it")
    return (os.environ if environ is None else environ).get(name, default)

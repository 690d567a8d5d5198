"""Where a rank learns its place in the job: the variables its launcher set.

Recognised, in order: torchrun and ``ferro run`` (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``), Open MPI's ``mpirun`` (``OMPI_COMM_WORLD_RANK``/``SIZE``/``LOCAL_RANK``),
MPICH and other PMI launchers (``PMI_RANK``, ``PMI_SIZE``) and SLURM's ``srun``
(``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``; the master is the first
host of ``SLURM_JOB_NODELIST``). ``MASTER_ADDR`` and ``MASTER_PORT`` override the
master wherever they are set.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ferro.errors import ConfigurationError, InvalidRankError, InvalidWorldSizeError
from ferro.rendezvous.settings import DEFAULT_MASTER_PORT, parse_port, validate_rank_and_size

__all__ = ["ELASTIC_ENV", "JobEnvironment", "detect", "first_slurm_host", "job_rank_and_size", "master_address"]

ELASTIC_ENV = "FERRO_ELASTIC"
"""Set to ``"1"`` by ``ferro run --restart-policy rank``: its agent serves the job's store and replaces lost ranks."""

# (name, rank variable, size variable, local-rank variable or None)
_STYLES = [
    ("torchrun/ferro run (RANK, WORLD_SIZE)", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("Open MPI (OMPI_COMM_WORLD_*)", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("MPICH/PMI (PMI_RANK, PMI_SIZE)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("SLURM (SLURM_PROCID, SLURM_NTASKS)", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
]


@dataclass(frozen=True)
class JobEnvironment:
    """A rank's place in the job as its launcher described it.

    Attributes:
        rank: Global rank.
        world_size: Number of ranks.
        local_rank: Rank among the ranks on this host (0 when the launcher does not say).
        master_addr: The rendezvous host, or None when nothing names one.
        master_port: The rendezvous port (the default when nothing names one).
        source: Which launcher's variables were used, for logs and errors.

    """

    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None
    master_port: int
    source: str


def _int(env: Mapping[str, str], name: str) -> int:
    raw = env[name]
    try:
        return int(raw)
    except ValueError:
        raise ConfigurationError(f"{name}={raw!r} is not an integer") from None


def detect(env: Mapping[str, str]) -> JobEnvironment | None:
    """Read the first launcher style present in ``env``; None when no launcher set anything.

    Raises:
        ConfigurationError: A style is half present (its rank without its size, or
            the other way round), naming the variable to set; or a malformed value.

    """
    for source, rank_var, size_var, local_var in _STYLES:
        has_rank, has_size = rank_var in env, size_var in env
        if not (has_rank or has_size):
            continue
        if has_rank != has_size:
            missing = size_var if has_rank else rank_var
            present = rank_var if has_rank else size_var
            raise ConfigurationError(f"{present} is set but {missing} is not: set both (launcher: {source})")
        local = _int(env, local_var) if local_var and local_var in env else 0
        return JobEnvironment(_int(env, rank_var), _int(env, size_var), local, _master_addr(env, source),
                              _master_port(env), source)
    return None


def _master_addr(env: Mapping[str, str], source: str) -> str | None:
    if env.get("MASTER_ADDR"):
        return env["MASTER_ADDR"]
    if source.startswith("SLURM"):
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if nodelist:
            return first_slurm_host(nodelist)
    if source.startswith("Open MPI") and env.get("OMPI_COMM_WORLD_LOCAL_SIZE") == env.get("OMPI_COMM_WORLD_SIZE"):
        return "127.0.0.1"  # every rank on this host
    return None


def _master_port(env: Mapping[str, str]) -> int:
    raw = env.get("MASTER_PORT")
    return parse_port(raw) if raw else DEFAULT_MASTER_PORT


def first_slurm_host(nodelist: str) -> str:
    """Return the first host of a SLURM node list such as ``node[01-04,07],gpu5`` (here ``node01``).

    Raises:
        ConfigurationError: The list cannot be parsed.

    """
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):  # the first item ends at the first comma outside brackets
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            end = i
            break
    item = nodelist[:end].strip()
    while "[" in item:
        prefix, _, rest = item.partition("[")
        inside, closed, suffix = rest.partition("]")
        if not closed or not inside:
            raise ConfigurationError(f"cannot read SLURM_JOB_NODELIST={nodelist!r}; set MASTER_ADDR")
        first = inside.split(",")[0].split("-")[0]
        item = prefix + first + suffix
    if not item:
        raise ConfigurationError(f"cannot read SLURM_JOB_NODELIST={nodelist!r}; set MASTER_ADDR")
    return item


def job_rank_and_size(rank: int | None, world_size: int | None, caller: str, via: str = "arguments"
                      ) -> tuple[int, int, JobEnvironment | None]:
    """Return this process's rank and the world size, from the arguments or else the launcher's environment.

    Checked before any rendezvous, so a bad rank or size is named now, not after a store timeout.

    Args:
        rank: The caller's ``rank=``, or None.
        world_size: The caller's ``world_size=``, or None.
        caller: The public function, for messages.
        via: Where the caller's own values came from, for messages.

    Returns:
        ``(rank, world_size, what the launcher's environment said or None)``.

    Raises:
        ConfigurationError: Neither the arguments nor the environment give them.
        InvalidRankError, InvalidWorldSizeError: Out of range (the message says where they came from).

    """
    found = detect(os.environ)
    if rank is None or world_size is None:
        if found is None:
            raise ConfigurationError(
                f"{caller}: rank and world size are unknown; pass rank= and world_size=, launch with "
                "`ferro run` or torchrun (RANK, WORLD_SIZE), or under mpirun or srun")
        rank = found.rank if rank is None else rank
        world_size = found.world_size if world_size is None else world_size
        via = found.source if via == "arguments" else f"{via} and {found.source}"
    try:
        return (*validate_rank_and_size(rank, world_size), found)
    except (InvalidRankError, InvalidWorldSizeError) as exc:
        raise type(exc)(f"{caller}: {exc} (from {via})") from None


def master_address(found: JobEnvironment | None, caller: str) -> str:
    """Return rank 0's host: the launcher's, else ``$MASTER_ADDR``.

    Raises:
        ConfigurationError: Neither names one.

    """
    address = (found.master_addr if found else None) or os.environ.get("MASTER_ADDR")
    if not address:
        raise ConfigurationError(f"{caller}: no master address: set MASTER_ADDR (the host of rank 0), or pass "
                                 f"init_method='tcp://host:port'")
    return address


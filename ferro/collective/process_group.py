"""The default process group: ``init_process_group`` and the functions that read it.

The default group is the one piece of global state in ferro: collectives and
``new_group`` use it when called without ``group=``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlparse

from ferro import environment
from ferro.backend import JoinSpec, backend_entry, join_backend
from ferro.backend.base import Backend
from ferro.backend.sub import SubBackend, sub_group
from ferro.collective.hang_watch import start_hang_watch, stop_hang_watch
from ferro.errors import ConfigurationError
from ferro.rendezvous.env import ELASTIC_ENV, detect, job_rank_and_size, master_address
from ferro.rendezvous.file_store import FileStore
from ferro.rendezvous.hosts import exchange_host_identities
from ferro.rendezvous.settings import (
    DEFAULT_MASTER_PORT,
    default_timeout,
    job_secret,
    parse_port,
)
from ferro.rendezvous.store import Store
from ferro.rendezvous.torchrun import agent_store_in_use, store_through_agent

__all__ = [
    "destroy_process_group",
    "get_default_group",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "is_initialized",
    "new_group",
]

log = logging.getLogger("ferro.collective.process_group")

LOG_LEVEL_ENV = "FERRO_LOG_LEVEL"
#: Names the backend ``backend="auto"`` takes, overriding its choice (``FERRO_BACKEND=mpi`` under mpirun).
BACKEND_ENV = "FERRO_BACKEND"

_default_group: Backend | None = None  # the documented default group; see the module docstring


def _configure_logging() -> None:
    level = environment.get(LOG_LEVEL_ENV)
    if not level:
        return
    logger = logging.getLogger("ferro")
    try:
        logger.setLevel(level.upper())
    except ValueError:
        raise ConfigurationError(f"{LOG_LEVEL_ENV}={level!r} is not a logging level (DEBUG, INFO, WARNING, ...)"
                                 ) from None
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s ferro %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)


def init_process_group(backend: str = "auto", init_method: str | None = None, rank: int | None = None,
                       world_size: int | None = None, timeout: float | None = None, *,
                       secret: bytes | str | None = None, device_id: int | None = None) -> Backend:
    """Join the job's process group and make it the default for every collective.

    Where rank and world size come from, first found wins: the arguments;
    ``init_method``; the torchrun / ``ferro run`` environment (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``); Open MPI
    (``OMPI_COMM_WORLD_*``); MPICH/PMI (``PMI_RANK``, ``PMI_SIZE``); SLURM
    (``SLURM_PROCID``, ``SLURM_NTASKS``, master = first host of
    ``SLURM_JOB_NODELIST``). The source used is logged at debug level
    (``FERRO_LOG_LEVEL=DEBUG``). Every rank needs the job secret
    (``FERRO_SECRET``, set by ``ferro run``; with mpirun or srun, export it yourself).

    Args:
        backend: ``"auto"`` compares the ranks' hosts (:func:`ferro.rendezvous.hosts.host_identity`)
            and picks shared memory when all share one, TCP when no two do, and
            ``"hierarchical"`` otherwise (shared memory inside each host, TCP between
            one leader per host); or name one of :data:`ferro.backend.BACKENDS`:
            ``"tcp"``, ``"shm"``, ``"hierarchical"``; on GPUs ``"nccl"`` (GPU memory only)
            or ``"hybrid"`` (TCP for host memory, NCCL for GPU memory); under mpirun or srun,
            ``"mpi"`` (the cluster's MPI through mpi4py: rank and size are MPI's, and no
            master address or secret is needed). ``$FERRO_BACKEND`` overrides ``"auto"``.
        init_method: ``"env://"``, ``"tcp://host:port"`` (the master), or
            ``"file:///path"`` (rendezvous through a file every rank can open).
        rank: This rank.
        world_size: Number of ranks.
        timeout: Default seconds for every blocking operation (default ``$FERRO_TIMEOUT`` or 60).
        secret: The job secret (default ``$FERRO_SECRET``).
        device_id: The GPU of this rank for ``"nccl"`` and ``"hybrid"`` (default: the
            current device, else ``LOCAL_RANK`` modulo the number of GPUs).

    Returns:
        The new default group.

    Raises:
        ConfigurationError: Already initialised; missing or contradictory
            settings (the message names the variable to set); or a rank of
            ``ferro run --restart-policy rank``, which takes :class:`ferro.elastic.Manager`.
        BackendUnavailableError: A backend that is not available yet.

    Example::

        # under `ferro run --nproc-per-node 2 train.py`
        group = ferro.init_process_group()
        ferro.allreduce(grads)                # uses the default group
        ferro.destroy_process_group()

    """
    global _default_group
    _configure_logging()
    if _default_group is not None:
        raise ConfigurationError("init_process_group: already initialised; call destroy_process_group() first")
    if environment.get(ELASTIC_ENV) == "1" and init_method in (None, "env://"):
        # The launcher serves the job's store on MASTER_PORT, so rank 0 could not serve its own ("address in
        # use"), and a replacement rank could not join a fixed group anyway.
        raise ConfigurationError(
            "init_process_group: this rank was started by `ferro run --restart-policy rank`, whose launcher replaces "
            "a lost rank inside a running job; that takes ferro.elastic.Manager (its groups follow each change of "
            "membership), not a fixed group from init_process_group. Train through ferro.elastic.Manager (see the "
            "fault tolerance guide), or start the job without --restart-policy rank (--max-restarts then restarts "
            "the whole group)")
    launcher_choice = environment.get(BACKEND_ENV)
    if backend == "auto" and launcher_choice:
        backend = launcher_choice  # the job's launcher chose (FERRO_BACKEND=mpi under mpirun)
    if backend != "auto":
        backend_entry(backend)  # an unknown or unavailable backend is refused before any rendezvous
    if backend == "mpi":  # MPI's launcher already started and connected the ranks: no store, no address
        from ferro.backend.mpi import MpiBackend

        # Checked against what the launcher said: ranks started by ferro run or torchrun would each be an
        # MPI world of one, and train alone without a word.
        launched = detect(os.environ)
        if launched is not None:
            rank = launched.rank if rank is None else rank
            world_size = launched.world_size if world_size is None else world_size
        _default_group = MpiBackend.join_world(rank, world_size, timeout)
        log.debug("init_process_group: MPI rank %s of %s", _default_group.rank, _default_group.world_size)
        start_hang_watch(rank=_default_group.rank)
        return _default_group
    master_addr: str | None = None
    master_port: int | None = None
    store: Any = None
    via = "arguments"
    if init_method:
        parsed = urlparse(init_method)
        if parsed.scheme == "tcp":
            if not parsed.hostname or not parsed.port:
                raise ConfigurationError(f"init_method {init_method!r}: give both host and port, tcp://host:port")
            master_addr, master_port, via = parsed.hostname, parsed.port, f"init_method {init_method}"
        elif parsed.scheme == "file":
            if not parsed.path:
                raise ConfigurationError(f"init_method {init_method!r}: give a path, file:///path/to/file")
            store, via = FileStore(parsed.path), f"init_method {init_method}"
        elif parsed.scheme != "env":
            raise ConfigurationError(f"init_method {init_method!r}: use env://, tcp://host:port or file:///path")
    rank, world_size, found = job_rank_and_size(rank, world_size, "init_process_group", via)
    default_timeout(timeout)  # checked before any rendezvous, like the rank and size
    if store is None:
        master_addr = master_addr or master_address(found, "init_process_group")
        if not master_port:
            env_port = os.environ.get("MASTER_PORT")
            master_port = found.master_port if found else parse_port(env_port) if env_port else DEFAULT_MASTER_PORT
    log.debug("init_process_group: rank %s of %s from %s; master %s", rank, world_size, via,
              f"{master_addr}:{master_port}" if store is None else init_method)
    close_store = False  # a store made here is handed over to the group
    if store is None and init_method in (None, "env://") and agent_store_in_use(os.environ):
        # torchrun's agent serves its own store on MASTER_PORT: rank 0 serves ferro's elsewhere (see the module).
        store = store_through_agent(rank, master_addr or "127.0.0.1", master_port or DEFAULT_MASTER_PORT,
                                    job_secret(secret), default_timeout(timeout), os.environ)
        close_store = True
    if backend == "auto":
        if store is None:
            store = Store(master_addr or "127.0.0.1", master_port or DEFAULT_MASTER_PORT,
                          secret=job_secret(secret), timeout=default_timeout(timeout), serve=(rank == 0))
            close_store = True
        backend = backend_by_hosts(store, rank, world_size, default_timeout(timeout))
        log.debug("init_process_group: backend auto -> %s", backend)
    # Listen where the peers can reach us: the route towards the master, unless only a file names the job.
    bind_addr = None if master_addr else environment.get("FERRO_BIND_ADDR", "127.0.0.1")
    spec = JoinSpec(rank, world_size, master_addr or "127.0.0.1", master_port or DEFAULT_MASTER_PORT, timeout=timeout,
                    secret=secret, store=store, bind_addr=bind_addr, close_store=close_store, device_id=device_id)
    group = join_backend(backend, spec)
    _default_group = group
    start_hang_watch(rank=group.rank)
    return group


def backend_by_hosts(store: Any, rank: int, world_size: int, timeout: float) -> str:
    """Exchange the ranks' host identities through ``store`` and return what ``backend="auto"`` picks."""
    identities = exchange_host_identities(store, rank, world_size, timeout)
    return choose_backend([identity.host for identity in identities])


def choose_backend(hosts: list[str]) -> str:
    """Return the backend ``"auto"`` picks for ranks with these host identities (rank order).

    Shared memory when all share one host; TCP when no two do (nothing to share);
    otherwise hierarchical: shared memory inside each host, TCP between them.
    """
    distinct = len(set(hosts))
    if distinct == 1:
        return "shm"
    return "tcp" if distinct == len(hosts) else "hierarchical"


def destroy_process_group() -> None:
    """Close the default group and forget it. Does nothing if there is none."""
    global _default_group
    group, _default_group = _default_group, None
    if group is not None:
        stop_hang_watch()
        group.close()


def is_initialized() -> bool:
    """Whether a default group exists."""
    return _default_group is not None


def get_default_group() -> Backend:
    """Return the default group.

    Raises:
        ConfigurationError: ``init_process_group`` was not called.

    """
    if _default_group is None:
        raise ConfigurationError("no default process group: call ferro.init_process_group() first, or pass group=")
    return _default_group


def new_group(ranks: Iterable[int], group: Backend | None = None, *, timeout: float | None = None
              ) -> SubBackend | None:
    """Create a sub-group of ``group`` (default: the default group) made of ``ranks``.

    Every member must call it, with the same ranks, in the same order as its
    other ``new_group`` calls on that group. Non-members may call it too and get
    ``None`` without communicating; on NCCL groups (``nccl``, ``hybrid``) every
    rank of the parent must call it (NCCL splits collectively), as in ``torch.distributed``.
    Local ranks follow the sorted order of ``ranks``.
    The sub-group's traffic travels on channels of its own.

    Args:
        ranks: Ranks of ``group`` that form the sub-group.
        group: The parent group (default: the default group of ``init_process_group``).
        timeout: Seconds for connecting the sub-group (default: the parent's).

    Returns:
        The sub-group, or ``None`` on a rank that is not a member.

    Raises:
        InvalidRankError: Empty, duplicate or out-of-range ranks.
        ConfigurationError: No parent group given and no default group exists.

    Example::

        # world of 4 ranks
        evens = ferro.new_group([0, 2], group=world)
        # rank 0: evens.rank == 0; rank 2: evens.rank == 1; ranks 1 and 3: evens is None

    """
    return sub_group(group if group is not None else get_default_group(), ranks, timeout=timeout)


def get_rank(group: Backend | None = None) -> int:
    """Return this process's rank in ``group`` (default: the default group)."""
    return (group or get_default_group()).rank


def get_world_size(group: Backend | None = None) -> int:
    """Return the number of ranks in ``group`` (default: the default group)."""
    return (group or get_default_group()).world_size

"""The module-level RPC API, as torch users know it, over this process's one agent.

One agent per process is the RPC analogue of the default process group: the
API torch users know (``rpc_sync(to, fn)``) has no agent argument, and an RRef
unpickled on a worker must find that worker's agent. It is the only state here;
:func:`init_rpc` returns the agent for code that prefers to hold it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from ferro import environment
from ferro.errors import BackendClosedError, ConfigurationError
from ferro.rendezvous.connect import (
    build_mesh,
    claim_rank,
    local_address_towards,
    release_rank,
    wait_before_closing,
    wait_for_ranks,
)
from ferro.rendezvous.env import job_rank_and_size, master_address
from ferro.rendezvous.settings import (
    DEFAULT_MASTER_PORT,
    default_timeout,
    job_secret,
    parse_port,
)
from ferro.rendezvous.store import Store
from ferro.rpc.agent import Future, RpcAgent, WorkerInfo

__all__ = ["RPC_PORT_ENV", "get_worker_info", "init_rpc", "rpc_async", "rpc_sync", "shutdown"]

# The store's port for RPC rendezvous; default MASTER_PORT (shared with a process group's store of the same job).
RPC_PORT_ENV = "FERRO_RPC_PORT"

_agent: RpcAgent | None = None

_NAMESPACE = "rpc"  # RPC's keys in the store (beside a process group's, when the two share one)

#: How long a rank serving the store waits, at shutdown, for workers still finishing ``init_rpc``.
JOINED_GRACE_SECONDS = 10.0


def init_rpc(name: str, rank: int | None = None, world_size: int | None = None, *, timeout: float = 60,
             num_worker_threads: int = 16, secret: bytes | str | None = None,
             init_method: str | None = None) -> RpcAgent:
    """Join this process to the RPC job as worker ``name``: connect to every other worker, authenticated.

    Collective over the job's processes. Rank and world size come from the
    arguments or the environment, as :func:`ferro.init_process_group` reads them
    (``ferro run``, torchrun, mpirun, srun). The connections are RPC's own (never a
    process group's), authenticated with the job secret: **RPC runs code on
    request**, and is exactly as safe as that secret.

    Args:
        name: This worker's name, unique in the job.
        rank: This worker's rank (default: from the environment).
        world_size: The number of workers (default: from the environment).
        timeout: Seconds for joining, and the default for every call.
        num_worker_threads: Threads that run the calls other workers make here.
        secret: The job secret (default ``$FERRO_SECRET``).
        init_method: ``"tcp://host:port"`` of the rendezvous store (default:
            ``MASTER_ADDR`` and ``$FERRO_RPC_PORT`` or ``MASTER_PORT``; rank 0
            serves it, or joins the store this job's process group already serves there).

    Returns:
        The agent (also what the module functions use).

    Raises:
        ConfigurationError: Already initialised, no secret, no rank or master address, or names that repeat.
        DistributedTimeoutError: Some workers did not join in time (named).
        AuthenticationError: A worker without the job secret.

    Example::

        # 3 processes under `ferro run --nproc-per-node 3 job.py`
        ferro.rpc.init_rpc(f"worker{rank}")
        ferro.rpc.rpc_sync("worker0", operator.add, (1, 2))   # 3, computed on worker0
        ferro.rpc.shutdown()

    """
    global _agent
    if _agent is not None:
        raise ConfigurationError(f"init_rpc: this process is already RPC worker {_agent.name!r}; call "
                                 f"ferro.rpc.shutdown() first")
    if not isinstance(name, str) or not name:
        raise ConfigurationError(f"init_rpc: the worker name must be a non-empty string, got {name!r}")
    rank, world_size, found = job_rank_and_size(rank, world_size, "init_rpc")
    seconds = default_timeout(timeout)
    key = job_secret(secret)
    host, port = _store_address(init_method, found)
    store = _open_store(host, port, key, seconds, rank == 0)
    try:
        namespace = _NAMESPACE
        claim = claim_rank(store, namespace, rank, seconds)
        store.set(f"{namespace}/name/{rank}", name.encode(), timeout=seconds)
        names_keys = {r: f"{namespace}/name/{r}" for r in range(world_size)}
        deadline = time.monotonic() + seconds
        wait_for_ranks(store, names_keys, deadline, rank, "join RPC")
        names = [store.get(k, timeout=seconds).decode() for k in names_keys.values()]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ConfigurationError(f"init_rpc: worker names must be unique; {repeated} repeat (names by rank: "
                                     f"{names})")
        bind = environment.get("FERRO_BIND_ADDR") or local_address_towards(host)
        sockets = build_mesh(store, rank, world_size, prefix=f"{namespace}/mesh", secret=key, bind_addr=bind,
                             timeout=max(deadline - time.monotonic(), 1.0))
        agent = RpcAgent(name, rank, names, sockets, seconds, num_worker_threads)
        agent._store = store  # kept open until shutdown: rank 0 serves it
        _agent = agent
        # No worker calls before every worker's agent serves: the calls it runs may use the module API.
        store.set(f"{namespace}/serving/{rank}", b"1", timeout=seconds)
        wait_for_ranks(store, {r: f"{namespace}/serving/{r}" for r in range(world_size)}, deadline, rank,
                       "start serving RPC")
        release_rank(store, claim)
        # The last store request: the rank serving the store waits for these marks before closing it, or a
        # worker still in this function when rank 0 shuts down at once would lose the store mid-request.
        store.set(f"{namespace}/joined/{rank}", b"1", timeout=max(deadline - time.monotonic(), 1.0))
    except BaseException:
        if _agent is not None:
            _agent.shutdown(graceful=False)
            _agent = None
        store.close()
        raise
    return agent


def _store_address(init_method: str | None, found: Any) -> tuple[str, int]:
    if init_method:
        from urllib.parse import urlparse

        parsed = urlparse(init_method)
        if parsed.scheme != "tcp" or not parsed.hostname or not parsed.port:
            raise ConfigurationError(f"init_rpc: init_method {init_method!r}: use tcp://host:port")
        return parsed.hostname, parsed.port
    host = master_address(found, "init_rpc")
    own = environment.get(RPC_PORT_ENV)
    raw = own or os.environ.get("MASTER_PORT")
    return host, parse_port(raw, RPC_PORT_ENV if own else "MASTER_PORT") if raw else (
        found.master_port if found else DEFAULT_MASTER_PORT)


def _open_store(host: str, port: int, secret: bytes, timeout: float, serve: bool) -> Store:
    """Serve the store on rank 0, or join the one this job's process group already serves on that port."""
    if serve:
        try:
            return Store(host, port, secret=secret, timeout=timeout, serve=True)
        except ConfigurationError:
            pass  # the port is taken: by this job's process-group store, if the secret opens it
    return Store(host, port, secret=secret, timeout=timeout)


def _current(what: str) -> RpcAgent:
    if _agent is None:
        raise BackendClosedError(f"{what}: RPC is not initialised in this process; call ferro.rpc.init_rpc first")
    return _agent


def get_worker_info(worker_name: str | int | None = None) -> WorkerInfo:
    """Return the :class:`WorkerInfo` of a worker by name or rank (this worker by default)."""
    return _current("get_worker_info").worker_info(worker_name)


def rpc_sync(to: str | int | WorkerInfo, func: Callable[..., Any], args: tuple[Any, ...] = (),
             kwargs: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
    """Run ``func(*args, **kwargs)`` on worker ``to`` and return its result.

    ``func`` travels by reference (module and qualified name: it must be
    importable on the worker); arguments and results are pickled, arrays and
    CPU tensors as raw buffers. An exception raised there re-raises here, with
    the remote traceback as its cause and the worker's name in a note.

    Raises:
        DistributedTimeoutError: No answer within ``timeout`` (default: ``init_rpc``'s);
            the agent stays usable.
        PeerLostError: The worker is gone (named).

    Example::

        # on any worker
        total = ferro.rpc.rpc_sync("ps", np.add, (np.ones(3), np.ones(3)))   # array([2., 2., 2.])

    """
    return _current("rpc_sync").rpc_sync(to, func, args, kwargs, timeout)


def rpc_async(to: str | int | WorkerInfo, func: Callable[..., Any], args: tuple[Any, ...] = (),
              kwargs: dict[str, Any] | None = None, timeout: float | None = None) -> Future:
    """Start ``func(*args, **kwargs)`` on worker ``to``; return a :class:`Future` (``wait()``, ``then()``)."""
    return _current("rpc_async").rpc_async(to, func, args, kwargs, timeout)


def shutdown(graceful: bool = True, timeout: float | None = None) -> None:
    """Shut this worker's RPC agent down (graceful: collective, after every worker's calls finished).

    Raises:
        DistributedTimeoutError: Graceful, and some workers did not finish in time (named); closed anyway.

    """
    global _agent
    agent = _current("shutdown")
    gone = agent.lost_ranks()  # before shutting down, which loses every peer
    try:
        agent.shutdown(graceful, timeout)  # serves other workers' calls until they are done: keep it current
    finally:
        _agent = None
        if agent._store is not None:
            _close_store(agent, agent._store, gone)


def _close_store(agent: RpcAgent, store: Store, gone: set[int]) -> None:
    """Close the rendezvous store; the rank serving it first lets the live workers finish ``init_rpc`` with it."""
    keys = [f"{_NAMESPACE}/joined/{r}" for r in range(agent.world_size) if r != agent.rank and r not in gone]
    wait_before_closing(store, keys, min(agent.timeout, JOINED_GRACE_SECONDS))
    store.close()

"""Joining a job that torchrun started: its agent already serves a store on ``MASTER_PORT``.

torchrun's agent (torch >= 2.4, ``TORCHELASTIC_USE_AGENT_STORE=True``) serves a
``TCPStore`` on ``MASTER_ADDR:MASTER_PORT`` for its workers, whatever the
rendezvous (``--standalone``, ``--rdzv-backend c10d``, static). A rank 0 that
served ferro's own store there would find the port taken. So under torchrun
rank 0 serves ferro's authenticated store on a port of its own and leaves its
address in the agent's store, where the other ranks read it; from then on
nothing more goes through torch's store, and nothing secret ever does (the job
secret stays in ``FERRO_SECRET``).

The key is scoped by the agent's restart count (a restarted group never reads
the address of the previous attempt's store) and by how many times this rank
joined in this attempt (``init_process_group`` after ``destroy_process_group``).
torch is imported only here, only under torchrun, where it is installed.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping

from ferro.errors import ConfigurationError, DistributedTimeoutError
from ferro.rendezvous.connect import local_address_towards
from ferro.rendezvous.store import Store

__all__ = ["AGENT_STORE_ENV", "agent_store_in_use", "store_through_agent"]

#: Set to ``"True"`` by torchrun's agent when it serves its own store on ``MASTER_PORT``.
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
_RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"


def agent_store_in_use(environ: Mapping[str, str]) -> bool:
    """Whether ``MASTER_ADDR:MASTER_PORT`` is torchrun's agent store rather than a port for rank 0 to serve."""
    return environ.get(AGENT_STORE_ENV, "").lower() in ("true", "1")


def store_through_agent(rank: int, master_addr: str, master_port: int, secret: bytes, timeout: float,
                        environ: Mapping[str, str]) -> Store:
    """Return this rank's client of ferro's store for a torchrun job, rank 0 serving it.

    Args:
        rank: This rank.
        master_addr: torchrun's ``MASTER_ADDR`` (its agent store's host).
        master_port: torchrun's ``MASTER_PORT``.
        secret: The job secret.
        timeout: Seconds to wait for rank 0's address, and for every store operation after.
        environ: The launcher's variables (the restart count).

    Raises:
        ConfigurationError: torch is not importable (torchrun's environment without torch).
        DistributedTimeoutError: Rank 0 left no address within ``timeout`` seconds.

    """
    try:
        from torch.distributed import TCPStore
    except ImportError as exc:
        raise ConfigurationError(
            f"init_process_group: {AGENT_STORE_ENV}=True says torchrun's agent serves the job's store on "
            f"{master_addr}:{master_port}, but torch cannot be imported here to read it ({exc}); install torch in "
            f"this environment or start the job with `ferro run`") from None
    agent = TCPStore(master_addr, master_port, is_master=False, timeout=datetime.timedelta(seconds=timeout),
                     wait_for_workers=False)
    scope = f"/ferro/attempt_{environ.get(_RESTART_ENV, '0')}"
    joins = int(agent.add(f"{scope}/joins/{rank}", 1))  # this rank's n-th group in this attempt
    key = f"{scope}/store/{joins}"
    if rank == 0:
        host = local_address_towards(master_addr)  # where the other hosts reach this one
        store = Store(host, 0, secret=secret, timeout=timeout, serve=True)
        agent.set(key, f"{host}:{store.port}")
        return store
    try:
        address = bytes(agent.get(key)).decode()
    except RuntimeError as exc:  # torch's store says "wait timeout" (a DistStoreError, a RuntimeError)
        raise DistributedTimeoutError(
            f"rank {rank}: rank 0 left no address for ferro's store in torchrun's agent store at "
            f"{master_addr}:{master_port} within {timeout:g} s; did rank 0 call init_process_group? ({exc})"
        ) from None
    host, _, port = address.rpartition(":")
    return Store(host, int(port), secret=secret, timeout=timeout)

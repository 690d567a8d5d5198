"""Many store clients at once, doing a rank's rendezvous: for the store's tests and ``bench/bench_scale.py``.

A few client processes each hold many connections and take every one through
the rendezvous pattern, phase by phase, in step with the other processes:

1. ``connect``: open (and authenticate) every connection;
2. ``set``: each client publishes one key (``addr/<i>``);
3. ``get``: each client reads its two ring neighbours' keys;
4. ``barrier``: each client adds one to a counter; the one that reaches the total
   sets ``barrier/done``; then every client waits on it (torch's store-based barrier).

Each process runs its clients one after another, so the phases measure how fast
the server answers a crowd, as torch's rendezvous uses it. ``flavour`` picks the
client: ``"ferro"`` (:class:`ferro.Store`) or ``"torch"`` (``torch.distributed.TCPStore``).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from datetime import timedelta
from typing import Any

__all__ = ["PHASES", "run_store_load"]

PHASES = ("connect", "set", "get", "barrier")


def _client(flavour: str, host: str, port: int, secret: str, timeout: float) -> Any:
    if flavour == "ferro":
        from ferro.rendezvous.store import Store

        return Store(host, port, secret=secret, timeout=timeout)
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout), use_libuv=True,
                         wait_for_workers=False)


def _worker(flavour: str, host: str, port: int, secret: str, first: int, count: int, total: int, timeout: float,
            barrier: Any, out: Any) -> None:
    from ferro.rendezvous.limits import raise_descriptor_limit

    raise_descriptor_limit()
    times: dict[str, float] = {}
    wrong = 0
    clients: list[Any] = []
    try:
        barrier.wait()
        start = time.perf_counter()
        clients = [_client(flavour, host, port, secret, timeout) for _ in range(count)]
        times["connect"] = time.perf_counter() - start
        barrier.wait()
        start = time.perf_counter()
        for i, client in enumerate(clients, first):
            client.set(f"addr/{i}", f"10.0.{i // 250}.{i % 250}:{20000 + i}")
        times["set"] = time.perf_counter() - start
        barrier.wait()
        start = time.perf_counter()
        for i, client in enumerate(clients, first):
            for peer in ((i - 1) % total, (i + 1) % total):
                value = client.get(f"addr/{peer}")
                wrong += value != f"10.0.{peer // 250}.{peer % 250}:{20000 + peer}".encode()
        times["get"] = time.perf_counter() - start
        barrier.wait()
        start = time.perf_counter()
        for client in clients:
            if client.add("barrier/count", 1) == total:
                client.set("barrier/done", "1")
        for client in clients:
            client.wait(["barrier/done"])
        times["barrier"] = time.perf_counter() - start
        out.put((times, wrong, None))
    except BaseException as exc:  # reported to the parent, which raises it
        out.put((times, wrong, f"{type(exc).__name__}: {exc}"))
        barrier.abort()
    finally:
        for client in clients:
            if flavour == "ferro":
                client.close()


def run_store_load(flavour: str, host: str, port: int, clients: int, processes: int, *, secret: str = "",
                   timeout: float = 300.0) -> dict[str, float]:
    """Take ``clients`` connections through the rendezvous pattern from ``processes`` processes.

    The server must already listen on ``host:port``. Returns each phase's time
    in seconds: the slowest process's, phase by phase.

    Raises:
        AssertionError: A client read a neighbour's key wrong.
        RuntimeError: A client process failed (its error is named).

    """
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(processes)
    out = ctx.Queue()
    share, extra = divmod(clients, processes)
    workers, first = [], 0
    for p in range(processes):
        count = share + (p < extra)
        workers.append(ctx.Process(target=_worker, args=(flavour, host, port, secret, first, count, clients, timeout,
                                                         barrier, out), daemon=True))
        first += count
    for worker in workers:
        worker.start()
    results = [out.get(timeout=timeout * 4) for _ in workers]
    for worker in workers:
        worker.join(30)
    errors = [error for _, _, error in results if error]
    if errors:
        raise RuntimeError(f"{flavour} store clients failed: {errors[0]}")
    wrong = sum(w for _, w, _ in results)
    assert wrong == 0, f"{wrong} neighbour reads returned the wrong value"
    return {phase: max(times[phase] for times, _, _ in results) for phase in PHASES}

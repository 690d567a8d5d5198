"""Shared fixtures: the same rank functions run as TCP processes and as simulated threads."""

import pytest

from ferro.testing import run_processes, run_threads


def harness_tcp(fn, world_size, args=(), **kwargs):
    """Ranks as processes over real sockets."""
    return run_processes(fn, world_size, args=args, **kwargs)


def harness_shm(fn, world_size, args=(), **kwargs):
    """Ranks as processes over shared memory."""
    return run_processes(fn, world_size, args=args, backend="shm", **kwargs)


def harness_simulated(fn, world_size, args=(), **kwargs):
    """Ranks as threads over SimulatedBackend (a thread cannot be killed, so allow_exit does not apply)."""
    kwargs.pop("allow_exit", None)
    return run_threads(fn, world_size, args=args, **kwargs)


@pytest.fixture(params=["tcp", "shm", "simulated"])
def run(request):
    """Run a rank function on every backend: ``run(fn, world_size, args=(), **harness_kwargs)``."""
    return {"tcp": harness_tcp, "shm": harness_shm, "simulated": harness_simulated}[request.param]


# The client tests start whole frameworks (Ray, Lightning, accelerate) and take 20-60 s each: run first, a
# worker that draws one late holds the suite's end while the other worker idles.
FIRST = ("test_clients.py",)


def pytest_collection_modifyitems(config, items):
    """Put the longest tests first, so the two workers finish together."""
    items.sort(key=lambda item: item.path.name not in FIRST)  # stable: the rest keep their order

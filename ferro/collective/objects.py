"""Collectives of small Python objects: :func:`broadcast_object` and :func:`all_gather_object`.

Objects are pickled, so they travel only between authenticated peers of the job,
over the generic algorithms (they are small: a configuration, a few numbers).
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from ferro.backend.base import Backend
from ferro.collective import algorithms as algo
from ferro.collective.execute import execute, make_link
from ferro.collective.resolve import resolve_group, resolve_root, resolve_timeout

__all__ = ["all_gather_object", "broadcast_object"]


def broadcast_object(obj: Any, root: int = 0, *, group: Backend | None = None, timeout: float | None = None) -> Any:
    """Send a picklable object from ``root`` to every rank.

    Objects are pickled and unpickled only between authenticated peers of the
    job (every connection proved it holds the job secret); keep them small.

    Returns:
        The root's object (a copy on the other ranks).

    Example::

        config = ferro.broadcast_object({"lr": 0.1} if g.rank == 0 else None, group=g)

    """
    g = resolve_group(group, "broadcast_object")
    root_rank = resolve_root(root, g, "broadcast_object")
    link = make_link(g, "broadcast_object", resolve_timeout(g, timeout), None, 0, root_rank)

    def body() -> Any:
        if g.world_size == 1:
            return obj
        payload = np.frombuffer(pickle.dumps(obj), np.uint8) if g.rank == root_rank else None
        length = np.array([payload.size if payload is not None else 0], np.int64)
        algo.broadcast_tree(link, length, root_rank)
        data = payload if payload is not None else np.empty(int(length[0]), np.uint8)
        if data.size:
            algo.broadcast_tree(link, data, root_rank)
        return obj if g.rank == root_rank else pickle.loads(data.tobytes())

    return execute(g, "broadcast_object", body, False, (), link)


def all_gather_object(obj: Any, *, group: Backend | None = None, timeout: float | None = None) -> list[Any]:
    """Gather a picklable object from every rank onto every rank, as a list in rank order.

    Pickled only between authenticated peers of the job (see :func:`broadcast_object`).

    Example::

        # rank 0: obj = "a"   rank 1: obj = {"b": 2}
        everything = ferro.all_gather_object(obj, group=g)   # ["a", {"b": 2}] on both
    """
    g = resolve_group(group, "all_gather_object")
    link = make_link(g, "all_gather_object", resolve_timeout(g, timeout))

    def body() -> list[Any]:
        mine = np.frombuffer(pickle.dumps(obj), np.uint8)
        n = g.world_size
        lengths = np.zeros(n, np.int64)
        lengths[g.rank] = mine.size
        if n > 1:
            algo.all_gather_ring(link, lengths.view(np.uint8), [i * 8 for i in range(n + 1)])
        width = int(lengths.max())
        padded = np.zeros(n * width, np.uint8)
        padded[g.rank * width: g.rank * width + mine.size] = mine
        if n > 1 and width:
            algo.all_gather_ring(link, padded, [i * width for i in range(n + 1)])
        return [pickle.loads(padded[i * width: i * width + int(lengths[i])].tobytes()) for i in range(n)]

    return execute(g, "all_gather_object", body, False, (), link)

"""Collective operations over a process group: the collectives layer.

The public calls live in :mod:`~ferro.collective.reductions`,
:mod:`~ferro.collective.movement`, :mod:`~ferro.collective.objects`,
:mod:`~ferro.collective.p2p` and :mod:`~ferro.collective.gpu`; each reads top to
bottom as the rooms a call walks through once, in order:

1. :mod:`~ferro.collective.resolve`: the group (or the default one, from
   :mod:`~ferro.collective.process_group`), root, op, tag and timeout, checked once;
2. the route: a GPU buffer to :mod:`ferro.backend.nccl.routing`; else the compiled
   direct path (:mod:`~ferro.collective.direct`); else the backend's native
   algorithm or the generic one (:mod:`~ferro.collective.algorithms`, which also
   chooses by size);
3. :mod:`~ferro.collective.execute`: the call's link and fingerprint, its place in
   the group's order (:mod:`~ferro.collective.work`) and the guard that fails all
   ranks together.

Every backend supports every collective: the generic algorithms need only its
tagged send/recv. Every frame of a call
carries the call's fingerprint: ranks that call different collectives (or the
same one with different sizes, dtypes, ops or roots) raise
:class:`~ferro.CollectiveMismatchError` naming both calls.

Semantics, the same on every backend:

* Results are identical on every rank, bit for bit.
* ``ReduceOp.MEAN`` (alias ``AVG``) is SUM divided by the world size, for
  floating-point dtypes; float16 and bfloat16 are combined in float32 at each step.
* World size 1 and empty arrays need no communication; results documented as
  new arrays never alias the input.
* When a collective fails part-way (a lost peer, a mismatch, a timeout), this
  rank tells the others so they fail at once too, and the group is marked
  failed: frames of the abandoned call may still be in flight, so later
  collectives on it raise :class:`~ferro.ConnectionBrokenError`. Create a new group.
* ``async_op=True`` returns a :class:`~ferro.PendingCollective`. A group runs its
  collectives one at a time, in call order, on every rank.
"""

from ferro.collective.movement import (
    all_gather,
    all_to_all,
    all_to_all_single_uneven,
    async_all_gather,
    barrier,
    broadcast,
    gather,
    scatter,
)
from ferro.collective.objects import all_gather_object, broadcast_object
from ferro.collective.reductions import allreduce, async_reduce_scatter, reduce, reduce_scatter
from ferro.types import ReduceOp

__all__ = [
    "ReduceOp",
    "all_gather",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single_uneven",
    "allreduce",
    "async_all_gather",
    "async_reduce_scatter",
    "barrier",
    "broadcast",
    "broadcast_object",
    "gather",
    "reduce",
    "reduce_scatter",
    "scatter",
]

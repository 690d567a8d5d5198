"""The hierarchy's two-level plans replayed: shared memory inside each host, a TCP group's plan among the leaders.

:class:`ferro.HierarchicalBackend` runs a collective in three steps: the ranks of each host meet in shared memory
(a reduce, a gather), the hosts' leaders run a TCP group's plan among themselves, and each host hands the result
out (a broadcast). From 2 MiB the allreduce, reduce_scatter and all_gather go in pieces
(:func:`~ferro.backend.hierarchy_plan.pipeline_pieces`), the leaders' exchange of one piece overlapping the host's
steps on its neighbours. :func:`predict_two_level` replays the leaders' plan with :func:`simulate.predict` on the
hosts' links (one rank a host: the leader) and adds the host's steps, each at the network's ``local_latency``,
``local_rate`` and ``reduce_rate``. ``ferro bench`` names these plans ``"two-level X"``, X the leaders' plan
(:meth:`ferro.HierarchicalBackend.plan_name`).
"""

from __future__ import annotations

import dataclasses

from ferro._core import collectives as native
from ferro.backend.hierarchy_plan import pipeline_pieces
from ferro.tools.bench import simulate

__all__ = ["TWO_LEVEL", "leaders_plan", "predict_two_level"]

#: How a row's plan name starts when the hierarchy ran it; the leaders' plan follows.
TWO_LEVEL = "two-level "


def leaders_plan(name: str) -> str | None:
    """Return the leaders' plan of a two-level plan's name (``"two-level ring"``: ``"ring"``), else None."""
    return name[len(TWO_LEVEL):] if name.startswith(TWO_LEVEL) else None


def predict_two_level(network: simulate.Network, leaders_algorithm: str, nbytes: int, itemsize: int = 4,
                      segment: int = native.DEFAULT_SEGMENT_BYTES, op: str = "allreduce", root: int = 0,
                      latency_bytes: float = native.DEFAULT_LATENCY_BYTES, calls: int = 1, piece: int = 0) -> float:
    """Return the predicted seconds of one call of ``op`` as the hierarchy runs it on ``network``.

    Arguments as :func:`simulate.predict`'s; ``leaders_algorithm`` is the plan the leaders run among the
    ``network.hosts`` hosts, ``root`` a rank (its host's leader is the leaders' root). ``calls`` counts the
    broadcast's and reduce's calls back to back (a pipelined chain among the leaders overlaps them); the
    pipelined ops count their pieces so.

    Raises:
        ValueError: Fewer than two hosts, or an op or plan the simulator does not replay.

    """
    hosts, per_host = network.hosts, network.ranks_per_host
    if hosts < 2:
        raise ValueError("a two-level plan needs at least two hosts")
    leaders = dataclasses.replace(network, ranks_per_host=1)

    def exchange(leaders_op: str, leaders_bytes: float, times: int = 1, leaders_root: int = 0) -> float:
        return simulate.predict(leaders, leaders_algorithm, max(int(leaders_bytes), itemsize), itemsize,
                                segment=segment, op=leaders_op, root=leaders_root, latency_bytes=latency_bytes,
                                calls=times, piece=piece)

    def local(step_bytes: float, reduces: bool = False) -> float:
        """One shared-memory step of a host's ranks: a wake-up, the bytes through memory, a reduce's sums.

        The arena shares a reduce out: each rank sums its ``1/R`` of the buffer from the other ``R - 1``.
        """
        if per_host < 2:
            return 0.0
        seconds = network.local_latency + step_bytes / network.local_rate
        return seconds + ((per_host - 1) / per_host * step_bytes / network.reduce_rate if reduces else 0.0)

    if op in ("allreduce", "reduce_scatter", "all_gather"):
        pieces = pipeline_pieces(max(nbytes // itemsize, 1), nbytes) if per_host > 1 else 1
        cut = nbytes / pieces
        before, after = {"allreduce": (local(cut, True), local(cut)),
                         "reduce_scatter": (local(cut, True), local(cut / hosts)),
                         "all_gather": (local(cut / hosts), local(cut * (hosts - 1) / hosts))}[op]
        each = exchange(op, cut, pieces)  # the leaders' thread runs the pieces back to back
        # The host's steps on pieces k + 1 and k - 1 run while the leaders exchange piece k: the slower sets the pace.
        return before + each + after + (pieces - 1) * max(each, before + after)
    if op == "broadcast":
        return local(nbytes) + exchange(op, nbytes, calls, root // per_host) + local(nbytes)
    if op == "reduce":
        handed_over = local(nbytes) if root % per_host else 0.0  # the root is not its host's leader
        return local(nbytes, True) + exchange(op, nbytes, calls, root // per_host) + handed_over
    if op == "all_to_all":
        # Every rank's sends meet in shared memory, the leaders swap R x R blocks per pair of hosts, the host
        # hands the arrivals out: R times a rank's bytes through each step.
        return local(per_host * nbytes) + exchange(op, per_host * nbytes) + local(per_host * nbytes)
    raise ValueError(f"no two-level plan of {op!r} to replay")

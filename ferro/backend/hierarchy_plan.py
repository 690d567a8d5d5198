"""How a hierarchical group runs a collective: which level runs it, and how large calls go in pieces.

:class:`~ferro.backend.hierarchical.HierarchicalBackend` decides with these rules, and the simulator's two-level
replay (:mod:`ferro.tools.bench.two_level`) and ``ferro bench --simulate`` with the same ones, so the plan predicted
is the plan run. The pipeline's thread hand-off (:class:`Relay`, :func:`exchange_all`) lives here too.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

from ferro import environment
from ferro.errors import ConfigurationError

__all__ = ["CROWDED_FLAT_BYTES", "FLAT_BELOW_OPS", "FLAT_BYTES_ENV", "PIPELINE_MAX_PIECES", "PIPELINE_MIN_BYTES",
           "PIPELINE_PIECE_BYTES", "TWO_LEVEL_ALL_TO_ALL_BYTES", "Relay", "exchange_all", "flat_below_bytes",
           "leaders_call", "pipeline_pieces", "runs_flat", "two_level_all_to_all"]

#: Collectives of at least this many bytes are pipelined (see ``HierarchicalBackend._pipeline``).
PIPELINE_MIN_BYTES = 2 << 20
#: The most bytes a leader sends another host in the two-level all_to_all (R x R blocks); above, the TCP mesh.
TWO_LEVEL_ALL_TO_ALL_BYTES = 64 * 1024
#: The smallest piece a pipelined collective cuts, and the most pieces it cuts: the leaders' exchange of
#: one piece must outlast a compiled call's fixed cost, and each piece costs a few of them. At 1 Gbit
#: (2 hosts x 2 ranks, 2-core VM) 512 KiB pieces brought 4 MiB calls from 0.81-0.94 of the line to
#: 0.87-0.99 over 1 MiB ones; at 10 Gbit, where that VM is CPU-bound, they cost 4 MiB calls a third.
PIPELINE_PIECE_BYTES = 1 << 19
PIPELINE_MAX_PIECES = 16
#: Below these many bytes, by op, a hierarchy on machines whose cores its ranks outnumber runs the op flat
#: (:func:`runs_flat`). Among 8 emulated hosts of 2 ranks on 2 cores: the two-level allreduce caught up with the
#: flat one at 64 KiB (4.9 ms against 5.2; 16 KiB 3.0 against 2.3) and tied it to 1 MiB; the broadcast's two-level
#: chain beat the flat plan at 64 KiB (3.0-3.3 ms against 4.7). The all_gather and reduce_scatter run their
#: three steps in turn below the pipeline's 2 MiB, and flat was faster up to 1 MiB (the same sitting, two rounds:
#: reduce_scatter 64 KiB 3.6-5.5 ms against 9.6-12.4, 1 MiB 41.2 against 46.3-48.6; all_gather 64 KiB 2.6-2.7
#: against 5.4-5.6, 1 MiB 41.2-41.3 against 42.3-42.9).
CROWDED_FLAT_BYTES = {"allreduce": 64 * 1024, "broadcast": 64 * 1024, "reduce": 64 * 1024,
                      "all_gather": PIPELINE_MIN_BYTES, "reduce_scatter": PIPELINE_MIN_BYTES}
#: The ops whose calls go flat below a size: those with shared-memory steps (the all_to_all has its own rule).
FLAT_BELOW_OPS = tuple(CROWDED_FLAT_BYTES)
#: Overrides :func:`flat_below_bytes` (read when a hierarchical group is made; every rank must set the same).
FLAT_BYTES_ENV = "FERRO_HIERARCHY_FLAT_BYTES"


def flat_below_bytes(crowded: bool) -> dict[str, int]:
    """Return, by op of :data:`FLAT_BELOW_OPS`, the size below which a hierarchical group runs it flat.

    ``$FERRO_HIERARCHY_FLAT_BYTES`` for every op where set, else :data:`CROWDED_FLAT_BYTES` where ``crowded``
    (some machine of the job runs more of its ranks than it has cores), else 0.

    Raises:
        ConfigurationError: The variable is not a whole number of bytes.

    """
    given = environment.get(FLAT_BYTES_ENV)
    if given is None or given == "":
        return {op: CROWDED_FLAT_BYTES[op] if crowded else 0 for op in FLAT_BELOW_OPS}
    if not given.strip().isdigit():
        raise ConfigurationError(f"{FLAT_BYTES_ENV}={given!r}: expected a whole number of bytes (0: never flat)")
    return dict.fromkeys(FLAT_BELOW_OPS, int(given))


def pipeline_pieces(count: int, nbytes: int) -> int:
    """How many pieces a pipelined collective of ``nbytes`` bytes cuts its ``count`` elements (or slices) into.

    One below :data:`PIPELINE_MIN_BYTES`; otherwise pieces of at least :data:`PIPELINE_PIECE_BYTES`, at most
    :data:`PIPELINE_MAX_PIECES` of them and never more than ``count``. The simulator cuts its two-level replays
    by the same rule (:mod:`ferro.tools.bench.two_level`).
    """
    if nbytes < PIPELINE_MIN_BYTES:
        return 1
    return max(1, min(PIPELINE_MAX_PIECES, nbytes // PIPELINE_PIECE_BYTES, count))


def leaders_call(op: str, nbytes: int, per_host: int, pipelined: bool = True) -> tuple[int, bool]:
    """Return what the leaders run of a two-level ``op`` on ``nbytes``: their call's bytes, and whether it is a ring.

    The allreduce's leaders reduce one pipelined piece at a time (:func:`pipeline_pieces`, where ``pipelined``:
    some host has several ranks); the all_to_all's send ``per_host`` x ``per_host`` blocks to each host, as many
    bytes a leader as its host sends; the reduce_scatter's, and a pipelined all_gather's, run their ring over a
    slice of every host's block (``True``); every other call is the whole message, under the leaders' mesh's
    choice of plan. ``nbytes`` as :func:`runs_flat` takes it. The group, ``ferro bench --simulate`` and the
    scale bench's predictions name and replay the leaders' plan from this.
    """
    pieces = pipeline_pieces(nbytes, nbytes) if pipelined else 1
    if op == "allreduce":
        return nbytes // pieces, False
    if op == "all_to_all":
        return nbytes * per_host, False
    return nbytes, op == "reduce_scatter" or (op == "all_gather" and pieces > 1)


def two_level_all_to_all(per_host: int, block: int) -> bool:
    """Whether hosts of ``per_host`` ranks each run an all_to_all of equal ``block``-byte blocks in two levels.

    From 4 ranks a host, while a leader's message to another host (``per_host`` x ``per_host`` blocks) is at most
    :data:`TWO_LEVEL_ALL_TO_ALL_BYTES` (see :meth:`~ferro.backend.hierarchical.HierarchicalBackend.native_all_to_all`).
    The copies inside a host cost memory bandwidth: at 2 ranks a host (8x2@200mbit) the two levels were no faster
    than the TCP mesh's Bruck rounds from 64 B to 16 KiB and 1.7x slower at 256 KiB.
    """
    return per_host >= 4 and per_host * per_host * block <= TWO_LEVEL_ALL_TO_ALL_BYTES


def runs_flat(op: str, flat_plan: str, per_host: int, nbytes: int, world_size: int,
              flat_below: Mapping[str, int] | None = None) -> bool:
    """Whether hosts of ``per_host`` consecutive ranks run ``op`` on the TCP mesh over every rank, not in two levels.

    ``flat_plan`` is the mesh's choice for the call, ``nbytes`` what ``ferro bench`` sizes.

    * Calls of :data:`FLAT_BELOW_OPS` below their op's ``flat_below`` bytes (:func:`flat_below_bytes`: where some
      machine runs more of the job's ranks than it has cores). Ranks that cannot spin wait in shared memory by napping,
      so each of a two-level call's two shared-memory steps waits for the scheduler to find its ranks a core,
      where the mesh's ranks sleep in the kernel until their bytes land (8 emulated hosts of 2 ranks on 2 cores,
      4 B: allreduce 1.75 ms in two levels, 0.55 flat; broadcast 0.55 and 0.13; all_gather 2.1 and 0.68).
    * broadcast and reduce where the mesh chooses its pipelined chain: through consecutive ranks it crosses each
      host's link once each way, as the two levels do, but pipelined from end to end where the two levels run in
      turn (a 16 MiB broadcast among 8 hosts of 2 ranks at 200 Mbit: 0.77 of the stream in two levels, 1.03 flat).
    * The all_to_all except where :func:`two_level_all_to_all` holds.

    Every other call runs in two levels.
    """
    if flat_below and nbytes < flat_below.get(op, 0):
        return True
    if op in ("broadcast", "reduce"):
        return flat_plan == "pipelined chain"
    if op == "all_to_all":
        return not two_level_all_to_all(per_host, nbytes // max(world_size, 1))
    return False


def exchange_all(relay: Relay, pieces: int, exchange: Callable[[int], None]) -> None:
    """Run a leader's exchanges of one call on its thread, each piece as soon as its caller marks it ready.

    One job per call, not per piece: a job per piece cost a wakeup through the
    executor's queue each (up to 2 ms on a busy machine).
    """
    try:
        for k in range(pieces):
            if not relay.wait_ready(k):
                return  # the caller's side failed: no more exchanges
            exchange(k)
            relay.exchanged(k)
    finally:
        relay.finish()


class Relay:
    """Tells a leader's exchange thread which pieces are ready and its caller which are exchanged."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._ready = 0  # pieces whose shared-memory step before the exchange is done
        self._exchanged = 0
        self._abandoned = False  # the caller stopped: the thread exchanges nothing more
        self._finished = False  # the thread stopped: the caller waits for nothing more

    def _publish(self, name: str, value: int | bool) -> None:
        with self._condition:
            setattr(self, name, value)
            self._condition.notify_all()

    def ready(self, k: int) -> None:
        """Mark piece ``k`` ready for the leaders' exchange (the caller's side)."""
        self._publish("_ready", k + 1)

    def exchanged(self, k: int) -> None:
        """Mark piece ``k`` exchanged among the leaders (the thread's side)."""
        self._publish("_exchanged", k + 1)

    def abandon(self) -> None:
        """Tell the thread the caller stopped: it exchanges nothing more."""
        self._publish("_abandoned", True)

    def finish(self) -> None:
        """Tell the caller the thread stopped: it waits for nothing more."""
        self._publish("_finished", True)

    def wait_ready(self, k: int) -> bool:
        """Wait until piece ``k`` is ready (True) or the caller stopped (False)."""
        with self._condition:
            self._condition.wait_for(lambda: self._ready > k or self._abandoned)
            return self._ready > k and not self._abandoned

    def wait_exchanged(self, k: int) -> bool:
        """Wait until piece ``k`` is exchanged (True) or the thread stopped short of it (False)."""
        with self._condition:
            self._condition.wait_for(lambda: self._exchanged > k or self._finished)
            return self._exchanged > k

"""The native-collectives interface: how a backend runs a whole collective in its own engine.

:mod:`ferro.collective` validates a call once, then asks the group's
:attr:`~ferro.backend.base.Backend.native` object to run it. A backend that has
its own engine for a collective (TCP's compiled rings and trees, shared memory's
arena, a hierarchy of both, MPI's own calls) implements the method and returns
True; every method it does not implement returns False, and the collective runs
a generic algorithm over the backend's tagged send/recv instead. So a backend
offers exactly the collectives it does better, and nothing is found by probing
for attributes.

Every method receives arguments already validated by the collective layer:

* ``flat`` buffers are C-contiguous, writable NumPy arrays (1-D views of the
  caller's array, never copies unless the collective's semantics need one);
* ``dtype`` is the :class:`~ferro.types.DType` the kernels reduce, and ``op`` a
  :class:`~ferro.types.ReduceOp` valid for it. ``ReduceOp.MEAN`` is the backend's
  to finish: the result must be the SUM divided by the world size, identical on
  every rank;
* ``fingerprint`` is the call's 64-bit fingerprint (:func:`ferro.types.fingerprint`);
  every frame of the call must carry it, so ranks that called different things
  refuse each other's data;
* ``timeout`` is in seconds, for the whole collective;
* the world size is above 1 and the buffer is not empty.

After a failure the method raises the transport's error; the collective layer
then tells the peers and marks the group failed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ferro.types import DType, ReduceOp

__all__ = ["NativeCollectives"]


class NativeCollectives:
    """Collectives a backend runs in its own engine; each returns True when it ran the call.

    Mix this class into a :class:`~ferro.backend.base.Backend` and override the
    methods the backend does natively; its ``native`` property then returns the
    group itself. The defaults return False (run the generic algorithm).
    """

    @property
    def direct_arena(self) -> Any:
        """A compiled arena (:class:`ferro._core.arena.Arena`) that ``ferro.allreduce`` calls directly, or None.

        A backend whose allreduce can run as one compiled call from a NumPy array
        (shared memory) offers it here; the call skips every Python-level step.
        """
        return None

    @property
    def direct_mesh(self) -> Any:
        """A compiled mesh (:class:`ferro._core.collectives.Mesh`) the collectives call directly, or None.

        A TCP group offers it: then ``ferro.allreduce``, ``broadcast``, ``all_gather``,
        ``reduce_scatter`` and ``barrier`` run their common cases as one compiled call each.
        """
        return None

    def direct_takes(self, op: str, nbytes: int) -> bool:
        """Whether the direct paths may run a call of ``op`` on ``nbytes`` (each path's plan asks, once a signature).

        ``nbytes``: the buffer (allreduce, broadcast, reduce), the gathered output (all_gather), the input
        (reduce_scatter, all_to_all); 0 for the barrier. A group whose own plan for some calls is not the
        :attr:`direct_mesh`'s (the hierarchy's two levels) declines those, so every rank runs them one way.
        """
        return True

    def make_direct_allreduce(self, on_failure: Callable[[BaseException], BaseException]) -> Any:
        """Return a direct allreduce call for ``ferro.allreduce`` (``call(x, op, timeout) -> bool``), or None.

        A backend whose allreduce is one foreign call (MPI's) builds
        :class:`ferro._core.foreign.DirectForeignAllreduce` here; ``on_failure(exc)``
        tells the group and returns the exception to raise.
        """
        return None

    def exchange_shape(self, nbytes: int, world_size: int) -> tuple[int, int]:
        """Return the message and the ranks the allreduce algorithm of an ``nbytes`` call runs among.

        The collective layer chooses the algorithm (``ring``, ``recursive_doubling``, ``halving_doubling``) for
        this shape, by the cost model or the rule: a flat group runs it on the whole buffer among all
        ``world_size`` ranks (the default); the hierarchy runs it among its hosts' leaders, a pipelined piece at
        a time. The shape depends on sizes and the group's layout only, so every rank chooses alike.
        """
        return nbytes, world_size

    def native_allreduce(self, flat: Any, dtype: DType, op: ReduceOp, fingerprint: int, timeout: float,
                         algorithm: str) -> bool:
        """Reduce ``flat`` in place on every rank.

        Args:
            flat: The data (1-D), reduced in place.
            dtype: How elements reduce.
            op: The reduction (MEAN divides the sum by the world size).
            fingerprint: The call's fingerprint.
            timeout: Seconds for the whole collective.
            algorithm: ``"ring"``, ``"recursive_doubling"`` or ``"halving_doubling"``: the caller's choice for the
                shape :meth:`exchange_shape` gave (or the user's), a hint a backend with another engine may
                ignore.

        """
        return False

    def native_reduce(self, flat: Any, root: int, dtype: DType, op: ReduceOp, fingerprint: int,
                      timeout: float) -> bool:
        """Reduce every rank's ``flat`` into ``flat`` on ``root``; other ranks' ``flat`` may be scratch.

        The collective layer passes a copy on non-root ranks, so a backend may
        overwrite it.
        """
        return False

    def native_reduce_scatter(self, flat: Any, bounds: list[int], dtype: DType, op: ReduceOp, fingerprint: int,
                              timeout: float) -> bool:
        """Reduce so that part ``rank`` of ``flat`` (elements ``bounds[rank]:bounds[rank + 1]``) ends reduced here.

        ``flat`` is this rank's scratch copy of its input; parts other than this
        rank's are left unspecified.
        """
        return False

    def native_reduce_scatter_from(self, source: Any, flat: Any, bounds: list[int], dtype: DType, op: ReduceOp,
                                   fingerprint: int, timeout: float) -> bool:
        """:meth:`native_reduce_scatter` of the read-only input ``source`` into ``flat``, scratch of its size.

        The collective layer calls this one. The default copies ``source`` into
        ``flat`` and runs :meth:`native_reduce_scatter`; a backend that can copy
        piece by piece behind its communication (the hierarchy, whose links are
        slower than a copy) overrides it. Whatever it returns, ``flat`` holds
        the input afterwards where the call did not run (False), so the generic
        algorithm can take over.
        """
        np.copyto(flat, source)
        return self.native_reduce_scatter(flat, bounds, dtype, op, fingerprint, timeout)

    def native_all_gather(self, flat: Any, bounds: list[int], fingerprint: int, timeout: float) -> bool:
        """Fill every part of the byte buffer ``flat`` (``bounds`` in bytes) from the rank that owns it.

        On entry part ``rank`` holds this rank's data; on return every part holds its owner's.
        The parts are equal (``bounds[i] == i * bounds[1]``): every rank gathers the same shape.
        """
        return False

    def native_broadcast(self, flat: Any, root: int, fingerprint: int, timeout: float) -> bool:
        """Copy the byte buffer ``flat`` from ``root`` into ``flat`` on every other rank."""
        return False

    def native_all_to_all(self, send: Any, send_offsets: list[int], recv: Any, recv_offsets: list[int],
                          fingerprint: int, timeout: float, even: bool = False) -> bool:
        """Exchange byte blocks: ``send[send_offsets[j]:send_offsets[j+1]]`` goes to rank ``j``.

        Block ``i`` of ``recv`` (``recv_offsets``) receives rank ``i``'s block for
        this rank; the caller checked that this rank's block to itself fits. ``even``: every rank's blocks are
        equal (``ferro.all_to_all``), so a plan for equal blocks may run.
        """
        return False

    def native_gather(self, flat: Any, out: Any, root: int, fingerprint: int, timeout: float) -> bool:
        """Concatenate every rank's byte buffer ``flat`` (equal sizes), in rank order, into ``out`` on ``root``.

        ``out`` is None on the other ranks.
        """
        return False

    def native_scatter(self, blocks: list[Any] | None, out: Any, root: int, fingerprint: int, timeout: float) -> bool:
        """Copy byte block ``i`` of the root's ``blocks`` into ``out`` on rank ``i``.

        ``blocks`` is None except on ``root``; every rank's ``out`` has its block's
        size (the root sent each rank its block's description first).
        """
        return False

    def when_complete(self, result: Callable[[], Any]) -> Any:
        """Return ``result()``, computed once the data of the collective just run is final.

        Collectives call it for a step that reads the data after the native call
        (a part copied out). The default runs it now; a backend that starts async
        collectives as its own nonblocking calls (MPI) runs it when they complete.
        """
        return result()

"""Gradients averaged as 8-bit integers: a quarter of float32's traffic, with error feedback.

int8 values cannot be summed on the wire (four ranks' 127s overflow), so the
average is taken in two exchanges, as a parameter server would, without one:

1. Each rank splits its bucket into ``world_size`` chunks, quantises each chunk
   with its own scale (``max|x| / 127``) and sends chunk ``j`` to rank ``j``
   (one ``all_to_all`` of int8 payloads, each led by its float32 scale).
2. Rank ``j`` dequantises the chunks it received, averages them in the
   bucket's float type, quantises the average again, and every rank gathers
   every owner's chunk (one ``all_gather``).

Each rank sends ``2 (n-1)/n`` of the bucket's elements at one byte each, where
a float32 ring allreduce sends as many at four. On a hierarchical group
(several hosts) the ranks of a host first sum exactly over shared memory, and
only the hosts' leaders exchange int8. Both quantisations lose what
rounding drops; with error feedback that loss is kept (the *worker* residual
for step 1 on every rank, the *server* residual for step 2 on the chunk's owner)
and added to the next step's values, so nothing is lost, only delayed.
"""

from __future__ import annotations

import numpy as np

from ferro._core.reduce import dequantize_mean, dequantize_rows, quantize_rows
from ferro.backend.base import Backend
from ferro.backend.hierarchical import HierarchicalBackend
from ferro.collective import ReduceOp, all_gather, all_to_all, allreduce, broadcast, reduce
from ferro.parallel.comm_hooks.bucket import Bucket, float_view

__all__ = ["Int8CompressHook", "dequantize_int8", "quantize_int8"]

SCALE_BYTES = 4  # each payload row starts with its float32 scale


def quantize_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantise each row of ``x`` to int8 with its own scale.

    ``scale = max|row| / 127`` (float32); ``q = rint(row / scale)``. A row of
    zeros has scale 0 and quantises to zeros; a row holding a NaN or an
    infinity gets a NaN scale, so its dequantised values are NaN and a diverged
    gradient stays visible instead of turning into zeros. One compiled pass per
    row finds the scale and one quantises (float16 rows are quantised as float32).

    Args:
        x: A 2-D float array: one row per scale.

    Returns:
        ``(q, scales)``: int8 of ``x``'s shape, and float32 of shape ``(rows,)``.

    Example::

        q, scales = quantize_int8(np.array([[0.5, -1.0, 0.25]]))
        # q = [[64, -127, 32]], scales = [1/127]

    """
    values = np.ascontiguousarray(x if x.dtype in (np.float32, np.float64) else x.astype(np.float32))
    packed = np.empty((values.shape[0], SCALE_BYTES + values.shape[1]), np.uint8)
    quantize_rows(values, packed)
    return packed[:, SCALE_BYTES:].view(np.int8), _scales(packed)


def dequantize_int8(q: np.ndarray, scales: np.ndarray, dtype: np.dtype | type = np.float32) -> np.ndarray:
    """Return ``q * scale`` row by row, in ``dtype`` (the inverse of :func:`quantize_int8` up to rounding)."""
    return q.astype(dtype) * scales.astype(dtype)[:, None]


def _scales(packed: np.ndarray) -> np.ndarray:
    """Return the float32 scales that lead the packed rows."""
    return np.ascontiguousarray(packed[:, :SCALE_BYTES]).view(np.float32).reshape(-1)


class Int8CompressHook:
    """A DDP communication hook that averages gradients as int8, with a scale per chunk and error feedback.

    One object per model: it keeps each bucket's residuals between steps.

    Args:
        error_feedback: Add what quantisation dropped last step to this step's
            values (on by default; without it the rounding loss is lost).

    Example::

        model = ferro.DDP(net, comm_hook=ferro.parallel.Int8CompressHook())
        # with torch DDP over "ferro":
        ddp.register_comm_hook(None, ferro.interop.torch.comm_hook(ferro.parallel.Int8CompressHook()))

    """

    def __init__(self, error_feedback: bool = True) -> None:
        self.error_feedback = error_feedback
        self.worker_residuals: dict[int, np.ndarray] = {}
        self.server_residuals: dict[int, np.ndarray] = {}

    def __call__(self, group: Backend, bucket: Bucket) -> None:
        """Leave the bucket's (int8-carried) average over ``group`` in its buffer."""
        data = float_view(bucket)
        if data is None or group.world_size == 1:
            allreduce(bucket.buffer, ReduceOp.MEAN, group=group)
            return
        flat = data.reshape(-1)
        if isinstance(group, HierarchicalBackend):
            # Only the hosts' links are slow: sum exactly inside each host (shared memory), send int8 between
            # the leaders, and hand the result back inside the host. A quarter of the bytes cross hosts.
            local, leaders = group.local_group, group.leader_group
            if local is not None:
                reduce(flat, dst=0, group=local)
            if leaders is not None:
                self._exchange(leaders, bucket.index, flat, group.world_size)
            elif local is None or local.rank == 0:
                flat /= flat.dtype.type(group.world_size)  # one host: nothing crosses a link
            if local is not None:
                broadcast(flat, root=0, group=local)
            return
        self._exchange(group, bucket.index, flat, group.world_size)

    def _exchange(self, group: Backend, index: int, flat: np.ndarray, divisor: int) -> None:
        """Leave ``sum over group / divisor`` of ``flat`` in ``flat``, the values crossing as int8.

        Rows travel packed: each chunk's float32 scale, then its int8 values.
        The compiled kernels quantise, dequantise and keep the residuals in
        place, one or two passes over the bucket each, without temporaries.
        """
        n = group.world_size
        size, chunk = flat.size, -(-flat.size // n)
        values = np.empty((n, chunk), flat.dtype)
        values.reshape(-1)[:size] = flat
        values.reshape(-1)[size:] = 0  # the last chunk's padding only: one pass over the bucket, not two
        packed = np.empty((n, SCALE_BYTES + chunk), np.uint8)
        quantize_rows(values, packed, self._residual(self.worker_residuals, index, values))

        received = all_to_all(packed, group=group)  # row j: rank j's version of my chunk
        mine = np.empty((1, chunk), flat.dtype)
        dequantize_mean(received, mine[0], flat.dtype.type(divisor))
        packed_mine = np.empty((1, SCALE_BYTES + chunk), np.uint8)
        quantize_rows(mine, packed_mine, self._residual(self.server_residuals, index, mine))

        gathered = all_gather(packed_mine, group=group)  # row j: owner j's averaged chunk
        dequantize_rows(gathered, flat)

    def _residual(self, residuals: dict[int, np.ndarray], index: int, values: np.ndarray) -> np.ndarray | None:
        """Add last step's residual to ``values`` in place; return the array this step's residual goes into.

        None without error feedback. A first step, or a bucket that changed
        size (torch rebuilds its buckets once), starts from no residual.
        """
        if not self.error_feedback:
            return None
        kept = residuals.get(index)
        if kept is None or kept.shape != values.shape or kept.dtype != values.dtype:
            kept = residuals[index] = np.empty_like(values)
        else:
            values += kept
        return kept

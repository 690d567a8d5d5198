"""PowerSGD: each gradient matrix sent as a rank-r product, with warm start and error feedback.

Vogels et al., "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization" (NeurIPS 2019), as torch's ``powerSGD_hook`` runs it:
a gradient ``M`` (n x m, the parameter reshaped to its first axis by the rest)
becomes ``P = M Q`` (summed over ranks, then orthonormalised) and
``Q = M^T P`` (summed), and every rank takes ``P Q^T / world_size``. Two
allreduces of ``(n + m) r`` values replace one of ``n m``. Vectors (biases,
norms) and matrices that would not shrink by ``min_compression_rate`` are
averaged exactly, in one allreduce per bucket.
"""

from __future__ import annotations

import math

import numpy as np

from ferro.backend.base import Backend
from ferro.collective import ReduceOp, allreduce
from ferro.parallel.comm_hooks.bucket import Bucket, float_view

__all__ = ["PowerSGDHook", "orthogonalize"]


def orthogonalize(matrix: np.ndarray, epsilon: float = 0.0) -> None:
    """Make the columns of ``matrix`` orthonormal in place (modified Gram-Schmidt, as torch's PowerSGD).

    Args:
        matrix: A 2-D float array, one column per rank of the approximation.
        epsilon: Added to each column's norm before dividing (0: none; a small
            value keeps an all-zero column from becoming NaN).

    """
    columns = matrix.shape[1]
    for i in range(columns):
        column = matrix[:, i]
        norm = np.sqrt(column @ column) + epsilon
        if norm > 0:
            column /= norm
        if i + 1 < columns:
            rest = matrix[:, i + 1:]
            rest -= np.outer(column, column @ rest)


class PowerSGDHook:
    """A DDP communication hook that sends each gradient matrix as a rank-r approximation.

    The options carry the names of torch's ``PowerSGDState``. One object per
    model: it keeps each bucket's ``Q`` (warm start) and error between steps.

    Args:
        matrix_approximation_rank: ``r``, the rank of each approximation.
        start_powerSGD_iter: Average exactly for this many steps first (torch's
            default is 1000: the first steps' gradients change too fast for a
            low-rank approximation to track).
        min_compression_rate: Compress a matrix only if ``n m`` is at least
            this many times ``(n + m) r``.
        use_error_feedback: Add what the approximation missed last step to this
            step's gradient.
        warm_start: Start each step's power iteration from the last step's ``Q``
            (else from a fresh random one).
        orthogonalization_epsilon: See :func:`orthogonalize`.
        random_seed: Seeds the first ``Q``; the same on every rank, so every rank
            starts from the same ``Q``.

    Example::

        model = ferro.DDP(net, comm_hook=ferro.parallel.PowerSGDHook(matrix_approximation_rank=4,
                                                                     start_powerSGD_iter=10))

    Raises:
        ValueError: A rank below 1 or a negative start.

    """

    def __init__(self, matrix_approximation_rank: int = 1, start_powerSGD_iter: int = 1_000,  # noqa: N803
                 min_compression_rate: float = 2.0, use_error_feedback: bool = True, warm_start: bool = True,
                 orthogonalization_epsilon: float = 0.0, random_seed: int = 0) -> None:
        if matrix_approximation_rank < 1:
            raise ValueError(f"PowerSGDHook: matrix_approximation_rank must be at least 1, "
                             f"got {matrix_approximation_rank}")
        if start_powerSGD_iter < 0:
            raise ValueError(f"PowerSGDHook: start_powerSGD_iter must be >= 0, got {start_powerSGD_iter}")
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.rng = np.random.default_rng(random_seed)
        self.iter = 0
        self.error_dict: dict[int, np.ndarray] = {}
        self.q_memory_dict: dict[int, list[np.ndarray]] = {}
        self._seen: set[int] = set()

    def __call__(self, group: Backend, bucket: Bucket) -> None:
        """Leave the bucket's (low-rank) average over ``group`` in its buffer."""
        self._count_step(bucket.index)
        data = float_view(bucket)
        if data is None or self.iter <= self.start_powerSGD_iter:
            allreduce(bucket.buffer, ReduceOp.MEAN, group=group)
            return
        flat = data.reshape(-1)
        error = self.error_dict.get(bucket.index)
        if self.use_error_feedback and error is not None and error.shape == flat.shape:
            flat += error
        local = flat.copy() if self.use_error_feedback else None
        matrices, exact = self._split(bucket, flat)
        if exact:
            rest = np.concatenate([flat[start:stop] for start, stop in exact])
            allreduce(rest, ReduceOp.MEAN, group=group)
            at = 0
            for start, stop in exact:
                flat[start:stop] = rest[at:at + stop - start]
                at += stop - start
        if matrices:
            self._approximate(group, bucket.index, matrices)
        if local is not None:
            self.error_dict[bucket.index] = local - flat

    def _count_step(self, index: int) -> None:
        # A step is counted when a bucket is seen again: DDP reduces every bucket once per step.
        if index in self._seen or not self._seen:
            self._seen = set()
            self.iter += 1
        self._seen.add(index)

    def _split(self, bucket: Bucket, flat: np.ndarray) -> tuple[list[np.ndarray], list[tuple[int, int]]]:
        """Return the matrices worth compressing (views into ``flat``) and the ranges averaged exactly."""
        matrices, exact = [], []
        r = self.matrix_approximation_rank
        for offset, shape in zip(bucket.offsets, bucket.shapes(), strict=True):
            size = math.prod(shape)
            rows = shape[0] if len(shape) > 1 else 0
            cols = size // rows if rows else 0
            if rows and rows * cols >= self.min_compression_rate * (rows + cols) * min(r, rows, cols):
                matrices.append(flat[offset:offset + size].reshape(rows, cols))
            else:
                exact.append((offset, offset + size))
        return matrices, exact

    def _approximate(self, group: Backend, index: int, matrices: list[np.ndarray]) -> None:
        dtype = matrices[0].dtype
        ranks = [min(self.matrix_approximation_rank, *m.shape) for m in matrices]
        qs = self.q_memory_dict.get(index)
        if not self.warm_start or qs is None or [q.shape for q in qs] != [(m.shape[1], r)
                                                                        for m, r in zip(matrices, ranks, strict=True)]:
            qs = [self.rng.standard_normal((m.shape[1], r)).astype(dtype) for m, r in zip(matrices, ranks, strict=True)]
            for q in qs:
                orthogonalize(q, self.orthogonalization_epsilon)
        ps = np.concatenate([(m @ q).reshape(-1) for m, q in zip(matrices, qs, strict=True)])
        allreduce(ps, ReduceOp.SUM, group=group)
        p_views, at = [], 0
        for m, r in zip(matrices, ranks, strict=True):
            p_views.append(ps[at:at + m.shape[0] * r].reshape(m.shape[0], r))
            at += m.shape[0] * r
        for p in p_views:
            orthogonalize(p, self.orthogonalization_epsilon)
        new_q = np.concatenate([(m.T @ p).reshape(-1) for m, p in zip(matrices, p_views, strict=True)])
        allreduce(new_q, ReduceOp.SUM, group=group)
        qs, at = [], 0
        for m, r in zip(matrices, ranks, strict=True):
            qs.append(new_q[at:at + m.shape[1] * r].reshape(m.shape[1], r))
            at += m.shape[1] * r
        scale = dtype.type(1 / group.world_size)
        for m, p, q in zip(matrices, p_views, qs, strict=True):
            np.matmul(p, q.T, out=m)
            m *= scale
        self.q_memory_dict[index] = qs

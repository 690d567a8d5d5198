"""Which part of the global tensor each rank holds: ``torch.chunk``'s rule, nested over the mesh dimensions.

Pure arithmetic, no communication. Mesh dimensions apply in order: a tensor
dimension sharded by mesh dimensions 0 and 1 is chunked over dimension 0 first,
and each chunk again over dimension 1 (torch's nesting).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ferro.dtensor.placements import Placement, Shard

__all__ = ["Box", "chunk_bounds", "chunk_size", "flat_ranges", "local_box"]

# Per tensor dimension, the (offset, length) this rank holds.
Box = list[tuple[int, int]]


def chunk_size(n: int, parts: int) -> int:
    """Return torch.chunk's chunk length for ``n`` elements in ``parts`` parts (``ceil(n / parts)``)."""
    return -(-n // parts)


def chunk_bounds(n: int, parts: int, index: int) -> tuple[int, int]:
    """Return ``(start, stop)`` of chunk ``index`` of ``n`` elements split as ``torch.chunk`` splits them."""
    size = chunk_size(n, parts)
    return min(index * size, n), min((index + 1) * size, n)


def local_box(shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int],
              coordinate: Sequence[int]) -> Box:
    """Return, per tensor dimension, the ``(offset, length)`` held at ``coordinate`` of the mesh."""
    box = [(0, int(n)) for n in shape]
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            offset, length = box[placement.dim]
            start, stop = chunk_bounds(length, int(mesh_shape[mesh_dim]), int(coordinate[mesh_dim]))
            box[placement.dim] = (offset + start, stop - start)
    return box


def parent_length(shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int],
                  coordinate: Sequence[int], mesh_dim: int, dim: int) -> int:
    """Return the length along ``dim`` that ``mesh_dim`` chunks: what the mesh dimensions before it leave."""
    return local_box(shape, placements[:mesh_dim], mesh_shape, coordinate)[dim][1]


def flat_ranges(shape: Sequence[int], box: Box) -> np.ndarray:
    """Return the ``[start, stop)`` ranges of the row-major flattened tensor that ``box`` covers.

    One row per contiguous run, in the order the box's own row-major
    flattening visits them: a row block is one range, a column block one range
    per row. Empty when the box holds nothing.
    """
    lengths = [length for _, length in box]
    if any(length == 0 for length in lengths):
        return np.empty((0, 2), np.int64)
    # The runs span every dimension after the last one the box does not cover whole.
    split = 0
    for dim in range(len(shape) - 1, -1, -1):
        if box[dim] != (0, shape[dim]):
            split = dim
            break
    strides = [math.prod(shape[dim + 1:]) for dim in range(len(shape))]
    run = lengths[split] * strides[split] if shape else 1
    starts = np.zeros([*lengths[:split]] or [1], np.int64)
    for dim in range(split):
        index = np.arange(box[dim][0], box[dim][0] + lengths[dim], dtype=np.int64) * strides[dim]
        starts = starts + index.reshape([-1 if d == dim else 1 for d in range(split)])
    starts = starts.reshape(-1) + (box[split][0] * strides[split] if shape else 0)
    return np.stack([starts, starts + run], axis=1)

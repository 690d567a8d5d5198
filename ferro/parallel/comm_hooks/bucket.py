"""What a communication hook is given: a bucket of gradients, and the hook's signature."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ferro.backend.base import Backend
from ferro.collective.work import PendingCollective

__all__ = ["Bucket", "CommHook", "float_view"]


@dataclass
class Bucket:
    """Gradients reduced together.

    Attributes:
        index: Position in reduction order (0 holds the last parameters, reduced first).
        buffer: The flat gradient buffer: a NumPy array, or a PyTorch tensor for torch modules.
        parameters: The parameters whose gradients are views into ``buffer``.
        offsets: Element offset of each parameter's gradient in ``buffer``.

    """

    index: int
    buffer: Any
    parameters: list[Any]
    offsets: list[int]
    ready: set[int] = field(default_factory=set)
    pending: PendingCollective | None = None

    def array(self) -> np.ndarray:
        """Return the buffer as a NumPy array (zero-copy; a same-width integer view for bfloat16 tensors)."""
        if isinstance(self.buffer, np.ndarray):
            return self.buffer
        from ferro._buffers import operand

        return operand(self.buffer, "bucket", writable=True).array

    def shapes(self) -> list[tuple[int, ...]]:
        """Return each parameter's shape, in :attr:`offsets` order."""
        return [tuple(param.shape) for param in self.parameters]


CommHook = Callable[[Backend, Bucket], None]
"""A communication hook: ``hook(group, bucket)`` leaves the bucket's average over the group in its buffer."""


def float_view(bucket: Bucket) -> np.ndarray | None:
    """Return the bucket as a NumPy float32/float64 array, or None when it holds another dtype.

    A torch bfloat16 bucket arrives as a 16-bit integer view, and a float16 one
    is already as narrow as the compressors' payloads: hooks reduce those
    uncompressed.
    """
    data = bucket.array()
    return data if data.dtype.kind == "f" and data.dtype.itemsize >= 4 else None

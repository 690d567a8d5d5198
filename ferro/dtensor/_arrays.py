"""The few array operations redistribution needs, for NumPy arrays and torch tensors alike.

A DTensor's local piece stays the caller's kind: NumPy in, NumPy out; a torch
tensor in, a torch tensor out (ferro's collectives take and return both).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ferro._buffers import is_torch_tensor

__all__ = ["contiguous", "copy", "copy_into", "empty", "is_torch", "narrow", "zeros", "zeros_like"]


def is_torch(x: Any) -> bool:
    """Whether ``x`` is a torch tensor (never imports torch)."""
    return is_torch_tensor(x)


def contiguous(x: Any) -> Any:
    """Return ``x`` when it is C-contiguous, else a contiguous copy."""
    return x.contiguous() if is_torch(x) else np.ascontiguousarray(x)


def copy(x: Any) -> Any:
    """Return a C-contiguous copy."""
    if is_torch(x):
        import torch

        return x.clone(memory_format=torch.contiguous_format)
    return np.array(x, order="C", copy=True)


def copy_into(destination: Any, source: Any) -> None:
    """Copy ``source`` into the view ``destination`` (same shape)."""
    if is_torch(destination):
        destination.copy_(source)
    else:
        destination[...] = source


def narrow(x: Any, dim: int, start: int, length: int) -> Any:
    """Return elements ``[start, start + length)`` along ``dim`` (a view)."""
    index = (slice(None),) * dim + (slice(start, start + length),)
    return x[index]


def empty(shape: tuple[int, ...], like: Any) -> Any:
    """Return an uninitialised array of ``like``'s kind and dtype."""
    if is_torch(like):
        import torch

        return torch.empty(shape, dtype=like.dtype)
    return np.empty(shape, like.dtype)


def zeros(shape: tuple[int, ...], like: Any) -> Any:
    """Return zeros of ``like``'s kind and dtype."""
    if is_torch(like):
        import torch

        return torch.zeros(shape, dtype=like.dtype)
    return np.zeros(shape, like.dtype)


def zeros_like(x: Any) -> Any:
    """Return zeros shaped like ``x``."""
    if is_torch(x):
        import torch

        return torch.zeros_like(x)
    return np.zeros_like(x)

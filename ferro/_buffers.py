"""Turn what users pass (NumPy arrays, bytes, PyTorch CPU tensors) into buffers the core takes.

The compiled core accepts any C-contiguous buffer-protocol object and diagnoses
the rest itself. PyTorch tensors do not export the buffer protocol, so they are
viewed through NumPy here, zero-copy; tensors of dtypes NumPy lacks (bfloat16)
are viewed as same-width integers, since the wire carries bytes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ferro.errors import InvalidBufferError

_PASS_THROUGH = (np.ndarray, bytes, bytearray, memoryview)


def as_buffer(obj: Any, op: str) -> Any:
    """Return ``obj``, or a zero-copy NumPy view of it when it is a PyTorch tensor.

    Args:
        obj: The user's buffer.
        op: Operation name for error messages.

    Raises:
        InvalidBufferError: A tensor that lives off the CPU.

    """
    if isinstance(obj, _PASS_THROUGH):
        return obj
    if type(obj).__module__.startswith("torch") and hasattr(obj, "numpy"):
        return _torch_view(obj, op)
    return obj


def _torch_view(tensor: Any, op: str) -> np.ndarray:
    if tensor.device.type != "cpu":
        raise InvalidBufferError(
            f"{op}: the tensor lives on {tensor.device}; this backend moves host memory only "
            f"(use a GPU backend, or .cpu() first)")
    tensor = tensor.detach()
    try:
        return tensor.numpy()
    except TypeError:
        # NumPy has no bfloat16 (or float8): carry the same bytes as integers.
        width = tensor.element_size()
        import torch

        as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]
        return tensor.view(as_int).numpy()


def byte_view(obj: Any, op: str, writable: bool) -> memoryview:
    """Return a flat byte view of a C-contiguous buffer, checked as the compiled core checks it.

    Raises:
        InvalidBufferError: Not a buffer, not C-contiguous, or read-only when ``writable``.

    """
    from ferro._core.transport import describe_buffer_problem

    data = as_buffer(obj, op)
    try:
        view = memoryview(data)
    except TypeError:
        raise InvalidBufferError(f"{op}: {describe_buffer_problem(data, writable)}") from None
    if not view.c_contiguous or (writable and view.readonly):
        raise InvalidBufferError(f"{op}: {describe_buffer_problem(data, writable)}")
    return view.cast("B") if view.ndim != 1 or view.format != "B" else view

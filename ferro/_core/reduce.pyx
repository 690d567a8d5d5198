# cython: language_level=3, boundscheck=False, wraparound=False
"""Element-wise reduction of one buffer into another, per dtype and op, without the GIL.

Dtype and op codes are the ``FERRO_*`` enums of ``reduce_kernels.h``, mirrored
in :mod:`ferro.types` and :class:`ferro.ReduceOp`.
"""

from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer

from ferro._core.reduce cimport FERRO_DTYPE_COUNT, FERRO_OP_COUNT, ferro_divide, ferro_reduce_fn, ferro_reduce_kernel

from ferro.errors import InvalidBufferError

DTYPE_COUNT = FERRO_DTYPE_COUNT
OP_COUNT = FERRO_OP_COUNT


def has_kernel(int dtype, int op) -> bool:
    """Whether a kernel exists for this dtype code and op code."""
    return ferro_reduce_kernel(dtype, op) != NULL


def reduce_into(dst, src, int dtype, int op, Py_ssize_t itemsize) -> None:
    """``dst[i] = dst[i] OP src[i]`` over two C-contiguous buffers of equal size.

    Raises:
        InvalidBufferError: Sizes differ, or a buffer is unusable.
        ValueError: No kernel for this dtype and op.
    """
    cdef Py_buffer d, s
    cdef ferro_reduce_fn kernel = ferro_reduce_kernel(dtype, op)
    if kernel == NULL:
        raise ValueError(f"no reduction kernel for dtype code {dtype} and op code {op}")
    PyObject_GetBuffer(dst, &d, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE)
    try:
        PyObject_GetBuffer(src, &s, PyBUF_C_CONTIGUOUS)
        try:
            if d.len != s.len or d.len % itemsize:
                raise InvalidBufferError(f"reduce: buffers of {d.len} and {s.len} bytes do not match")
            with nogil:
                kernel(d.buf, s.buf, <size_t>(d.len // itemsize))
        finally:
            PyBuffer_Release(&s)
    finally:
        PyBuffer_Release(&d)


def divide(buf, int dtype, double divisor, Py_ssize_t itemsize) -> None:
    """Divide every element of a floating-point buffer by ``divisor`` in place.

    Raises:
        ValueError: ``dtype`` is not a floating-point code.
    """
    cdef Py_buffer b
    cdef int rc
    PyObject_GetBuffer(buf, &b, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE)
    try:
        with nogil:
            rc = ferro_divide(b.buf, <size_t>(b.len // itemsize), dtype, divisor)
    finally:
        PyBuffer_Release(&b)
    if rc != 0:
        raise ValueError(f"divide: dtype code {dtype} is not a floating-point type")

# cython: language_level=3, boundscheck=False, wraparound=False
"""Element-wise reduction of one buffer into another, per dtype and op, without the GIL.

Dtype and op codes are the ``FERRO_*`` enums of ``reduce_kernels.h``, mirrored
in :mod:`ferro.types` and :class:`ferro.ReduceOp`.
"""

cimport cython
from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer

from libc.string cimport memcpy, memset

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


# --- int8 quantisation with a float32 scale per row (ferro.parallel.Int8CompressHook) ------------------
#
# A packed row is the row's float32 scale (4 bytes, native order) and then its int8 values. Each kernel makes
# one or two passes without allocating; ``ferro.parallel.comm_hooks.int8`` documents the arithmetic, which
# these loops follow operation for operation, so they agree with its NumPy formulation bit for bit.

ctypedef fused real:
    float
    double

cdef extern from "math.h" nogil:
    bint isfinite(double x)
    double fabs(double x)
    float fabsf(float x)
    float NAN

cdef extern from "float.h":
    float FLT_MAX
    double DBL_MAX

cdef enum:
    INT8_LEVELS = 127
    SCALE_BYTES = 4


@cython.cdivision(True)
cdef inline real _round_half_even(real y) noexcept nogil:
    # numpy.rint without a libm call, so the loop vectorises: adding and taking away 1.5 * 2^(mantissa bits)
    # rounds y in the FPU's default mode (to nearest, ties to even). Exact while |y| < 2^22 (float32) or 2^51
    # (float64); quantised values are at most about 127.
    cdef real magic
    if real is float:
        magic = 12582912.0
    else:
        magic = 6755399441055744.0
    return (y + magic) - magic


cdef inline real _magnitude(real x) noexcept nogil:
    if real is float:
        return fabsf(x)
    else:
        return fabs(x)


@cython.cdivision(True)
def quantize_rows(real[:, ::1] values, unsigned char[:, ::1] packed, real[:, ::1] residual=None) -> None:
    """Quantise each row of ``values`` to int8 with its own scale, into ``packed``; optionally keep what rounding lost.

    ``scale = float32(max|row| / 127)``, ``q = clip(rint(row / scale), -127, 127)``.
    A row of zeros (or one whose scale underflows float32) gets scale 0 and
    zeros; a row holding a NaN or an infinity gets a NaN scale and zeros.

    Args:
        values: ``(rows, cols)`` float32 or float64.
        packed: ``(rows, 4 + cols)`` bytes: each row's float32 scale, then its int8 values.
        residual: ``values``'s shape and dtype, or None: receives ``row - q * scale``
            (0 for a row with a NaN scale, so a diverged step is not carried on).

    Raises:
        ValueError: The shapes do not fit together.
    """
    cdef Py_ssize_t rows = values.shape[0], cols = values.shape[1], i, j
    cdef real peak, magnitude, step, r, largest
    cdef real* row
    cdef real* kept
    cdef signed char* codes
    cdef float scale
    cdef bint finite
    if packed.shape[0] != rows or packed.shape[1] != SCALE_BYTES + cols:
        raise ValueError(f"quantize_rows: packed rows must be ({rows}, {SCALE_BYTES + cols}), "
                         f"got ({packed.shape[0]}, {packed.shape[1]})")
    if residual is not None and (residual.shape[0] != rows or residual.shape[1] != cols):
        raise ValueError(f"quantize_rows: the residual must be ({rows}, {cols}), "
                         f"got ({residual.shape[0]}, {residual.shape[1]})")
    largest = FLT_MAX if real is float else DBL_MAX
    with nogil:
        for i in range(rows):
            row = &values[i, 0]
            codes = <signed char*>&packed[i, SCALE_BYTES]
            kept = &residual[i, 0] if residual is not None else NULL
            peak = 0
            finite = True
            for j in range(cols):
                magnitude = _magnitude(row[j])
                finite = finite & (magnitude <= largest)  # false for an infinity and for a NaN
                peak = magnitude if magnitude > peak else peak
            scale = <float>(peak / INT8_LEVELS) if finite else <float>NAN
            if not isfinite(scale):  # a float64 peak beyond float32's range
                scale = <float>NAN
            memcpy(&packed[i, 0], &scale, SCALE_BYTES)
            if isfinite(scale) and scale > 0:
                step = <real>scale
                for j in range(cols):
                    r = _round_half_even(row[j] / step)
                    codes[j] = <signed char>(INT8_LEVELS if r > INT8_LEVELS else (-INT8_LEVELS if r < -INT8_LEVELS else r))
                if kept != NULL:
                    for j in range(cols):
                        kept[j] = row[j] - (<real>codes[j]) * step
            else:
                memset(codes, 0, cols)
                if kept != NULL:
                    for j in range(cols):  # scale 0: nothing was sent, keep it all; NaN: drop the diverged step
                        kept[j] = row[j] if scale == 0 else 0


cdef inline float _scale_of(const unsigned char[:, ::1] packed, Py_ssize_t row) noexcept nogil:
    cdef float scale
    memcpy(&scale, &packed[row, 0], SCALE_BYTES)
    return scale


@cython.cdivision(True)
def dequantize_mean(const unsigned char[:, ::1] packed, real[::1] out, real divisor) -> None:
    """``out = (row_0 + row_1 + ...) / divisor`` over the dequantised rows of ``packed``, summed in row order.

    Each row dequantises as ``real(q) * real(scale)``; the sum runs row by row,
    as NumPy's ``sum(axis=0)`` does, in ``out``'s dtype.

    Raises:
        ValueError: ``out`` is not one packed row long, or there are no rows.
    """
    cdef Py_ssize_t rows = packed.shape[0], cols = packed.shape[1] - SCALE_BYTES, i, j
    cdef real step
    cdef const signed char* codes
    if rows < 1 or cols != out.shape[0]:
        raise ValueError(f"dequantize_mean: {rows} packed rows of {cols} values do not fill {out.shape[0]}")
    with nogil:
        for i in range(rows):
            step = <real>_scale_of(packed, i)
            codes = <const signed char*>&packed[i, SCALE_BYTES]
            if i == 0:
                for j in range(cols):
                    out[j] = (<real>codes[j]) * step
            else:
                for j in range(cols):
                    out[j] = out[j] + (<real>codes[j]) * step
        for j in range(cols):
            out[j] = out[j] / divisor


def dequantize_rows(const unsigned char[:, ::1] packed, real[::1] out) -> None:
    """Write the dequantised rows of ``packed`` one after another into ``out``, as far as ``out`` reaches.

    Raises:
        ValueError: ``out`` is longer than the rows hold.
    """
    cdef Py_ssize_t rows = packed.shape[0], cols = packed.shape[1] - SCALE_BYTES, i, j, k = 0
    cdef Py_ssize_t size = out.shape[0]
    cdef real step
    if size > rows * cols:
        raise ValueError(f"dequantize_rows: {rows} packed rows of {cols} values cannot fill {size}")
    with nogil:
        for i in range(rows):
            step = <real>_scale_of(packed, i)
            for j in range(cols):
                if k == size:
                    break
                out[k] = (<real>(<signed char>packed[i, SCALE_BYTES + j])) * step
                k += 1

# Reduction kernels, usable without the GIL by the compiled algorithms.

cdef extern from "reduce_kernels.h" nogil:
    ctypedef void (*ferro_reduce_fn)(void* dst, const void* src, size_t n)
    ferro_reduce_fn ferro_reduce_kernel(int dtype, int op)
    int ferro_divide(void* buf, size_t n, int dtype, double divisor)
    enum:
        FERRO_DTYPE_COUNT
        FERRO_OP_COUNT

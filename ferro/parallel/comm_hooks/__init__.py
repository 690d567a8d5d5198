"""Communication hooks for :class:`ferro.DDP`: how a bucket of gradients is averaged over the group.

A hook is ``hook(group, bucket)``: it runs on the group's worker thread while
backward goes on, and leaves the bucket's average in its buffer. The plain ones
are functions; those that keep state between steps (residuals, warm-start
matrices) are objects, one per model. :func:`ferro.interop.torch.comm_hook`
turns any of them into a hook for torch's own DDP over the "ferro" backend.

=========================  =====================  ==============================================
hook                       bytes sent vs float32  what it loses
=========================  =====================  ==============================================
``allreduce_hook``         1                      nothing (the default)
``fp16_compress_hook``     1/2                    float16 rounding and range
``bf16_compress_hook``     1/2                    bfloat16 rounding (8 bits of mantissa)
``Int8CompressHook``       about 1/4              int8 rounding, fed back into the next step
``PowerSGDHook``           ``(n+m) r / (n m)``    all but a rank-r part, fed back into the next step
=========================  =====================  ==============================================
"""

from ferro.parallel.comm_hooks.basic import allreduce_hook, bf16_compress_hook, fp16_compress_hook
from ferro.parallel.comm_hooks.bucket import Bucket, CommHook
from ferro.parallel.comm_hooks.int8 import Int8CompressHook, dequantize_int8, quantize_int8
from ferro.parallel.comm_hooks.powersgd import PowerSGDHook, orthogonalize

__all__ = ["Bucket", "CommHook", "Int8CompressHook", "PowerSGDHook", "allreduce_hook", "bf16_compress_hook",
           "dequantize_int8", "fp16_compress_hook", "orthogonalize", "quantize_int8"]

"""Parallel training: DDP, FSDP, local SGD and DiLoCo, and synchronised batch normalisation.

:class:`DDP` replicates (its compressing communication hooks are in :mod:`ferro.parallel.comm_hooks`),
:class:`FSDP` shards, :class:`DiLoCo` and :class:`LocalSGD` communicate every ``H`` steps instead of every step,
:class:`SyncBatchNorm` normalises over every rank's batch.
"""

from ferro.parallel.comm_hooks import Int8CompressHook, PowerSGDHook
from ferro.parallel.ddp import DDP, Bucket, allreduce_hook, bf16_compress_hook, fp16_compress_hook
from ferro.parallel.fsdp import FSDP, MixedPrecision, ShardedEntry, ShardingStrategy, size_based_policy
from ferro.parallel.local_sgd import DiLoCo, LocalSGD, nesterov_outer_optimizer
from ferro.parallel.sync_batch_norm import SyncBatchNorm, convert_sync_batchnorm

__all__ = ["DDP", "FSDP", "Bucket", "DiLoCo", "Int8CompressHook", "LocalSGD", "MixedPrecision", "PowerSGDHook",
           "ShardedEntry", "ShardingStrategy", "SyncBatchNorm", "allreduce_hook", "bf16_compress_hook",
           "convert_sync_batchnorm", "fp16_compress_hook", "nesterov_outer_optimizer", "size_based_policy"]

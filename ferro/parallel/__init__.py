"""Parallel training: DDP, FSDP and synchronised batch normalisation.

:class:`DDP` replicates, :class:`FSDP` shards, :class:`SyncBatchNorm` normalises over every rank's batch.
"""

from ferro.parallel.ddp import DDP, Bucket, allreduce_hook, bf16_compress_hook, fp16_compress_hook
from ferro.parallel.fsdp import FSDP, MixedPrecision, ShardedEntry, ShardingStrategy, size_based_policy
from ferro.parallel.sync_batch_norm import SyncBatchNorm, convert_sync_batchnorm

__all__ = ["DDP", "FSDP", "Bucket", "MixedPrecision", "ShardedEntry", "ShardingStrategy", "SyncBatchNorm",
           "allreduce_hook", "bf16_compress_hook", "convert_sync_batchnorm", "fp16_compress_hook", "size_based_policy"]

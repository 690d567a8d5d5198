"""Fully sharded data parallelism (:class:`FSDP`) with its options."""

from ferro.parallel.fsdp.api import FSDP
from ferro.parallel.fsdp.flat import ShardedEntry
from ferro.parallel.fsdp.options import MixedPrecision, ShardingStrategy, size_based_policy

__all__ = ["FSDP", "MixedPrecision", "ShardedEntry", "ShardingStrategy", "size_based_policy"]

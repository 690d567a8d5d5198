"""FSDP's options: how to shard, in which precision to compute, and which submodules become units."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["MixedPrecision", "ShardingStrategy", "size_based_policy"]


class ShardingStrategy(enum.Enum):
    """What FSDP shards across ranks.

    * ``FULL_SHARD``: parameters, gradients and optimizer state are sharded; a unit's
      parameters are gathered for its forward and again for its backward.
    * ``SHARD_GRAD_OP``: gradients and optimizer state are sharded; parameters are
      gathered once per step and stay gathered from forward until the end of backward.
    * ``NO_SHARD``: nothing is sharded; gradients are averaged with one allreduce per
      unit (what DDP does).
    * ``HYBRID_SHARD``: ``FULL_SHARD`` within one dimension of a 2-d device mesh,
      replicated (gradients averaged) across the other.
    """

    FULL_SHARD = "full_shard"
    SHARD_GRAD_OP = "shard_grad_op"
    NO_SHARD = "no_shard"
    HYBRID_SHARD = "hybrid_shard"

    @classmethod
    def of(cls, value: Any) -> ShardingStrategy:
        """Return the strategy ``value`` names: a member, or its name or value in any case (``"full_shard"``).

        Raises:
            ValueError: No strategy has that name.

        """
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            for member in cls:
                if value.lower() in (member.value, member.name.lower()):
                    return member
        raise ValueError(f"FSDP: unknown sharding_strategy {value!r}; choose one of "
                         f"{', '.join(repr(m.value) for m in cls)}")


@dataclass(frozen=True)
class MixedPrecision:
    """Compute and communicate in a narrower dtype while the shards and the optimizer keep theirs.

    Attributes:
        param_dtype: The dtype of gathered parameters (and of floating-point inputs
            of each unit): what forward and backward compute in. None keeps the
            parameters' own dtype.
        reduce_dtype: The dtype gradients are averaged in. None uses ``param_dtype``
            (or the parameters' dtype).

    Use NumPy dtypes (or their names) for ``ferro.nn`` models and ``torch.dtype`` for
    torch models; ``"bfloat16"`` with NumPy needs ``ml_dtypes``.

    Example::

        ferro.FSDP(model, mixed_precision=ferro.MixedPrecision(param_dtype=torch.bfloat16,
                                                                reduce_dtype=torch.float32))

    """

    param_dtype: Any = None
    reduce_dtype: Any = None


def size_based_policy(min_num_params: int) -> Callable[[Any], bool]:
    """Return an ``auto_wrap_policy`` that makes a unit of each smallest submodule with enough parameters.

    A submodule is selected when it (with its descendants) holds at least
    ``min_num_params`` parameter elements and none of its children does: units
    form bottom-up, and what no unit takes stays with the root.

    Example::

        fsdp = ferro.FSDP(model, auto_wrap_policy=ferro.size_based_policy(100_000))

    """
    if isinstance(min_num_params, bool) or not isinstance(min_num_params, int) or min_num_params < 1:
        raise ValueError(f"size_based_policy: min_num_params must be a positive int, got {min_num_params!r}")

    def count(module: Any) -> int:
        return sum(_numel(p) for p in module.parameters())

    def policy(module: Any) -> bool:
        if count(module) < min_num_params:
            return False
        return not any(count(child) >= min_num_params for child in module.children())

    policy.min_num_params = min_num_params  # type: ignore[attr-defined]
    return policy


def _numel(param: Any) -> int:
    numel = getattr(param, "numel", None)
    return int(numel()) if callable(numel) else int(param.data.size)

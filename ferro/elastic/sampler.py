"""The samples of each step, split among whoever is training it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["ElasticSampler", "Shard"]


@dataclass(frozen=True)
class Shard:
    """One rank's part of one step's global batch.

    Attributes:
        indices: The dataset indices this rank trains on (a contiguous slice of the global batch).
        loss_weight: Multiply this rank's *mean* loss by it (``len(indices) * world_size / batch_size``):
            with DDP's averaging the step's gradient is then the mean over the whole global batch,
            whatever the world size and however unevenly the batch splits.

    """

    indices: np.ndarray
    loss_weight: float


class ElasticSampler:
    """A global batch per step, the same on every rank, split among the ranks training that step.

    Step ``s`` always trains the same ``batch_size`` samples (positions
    ``s * batch_size`` onwards of a stream of shuffled passes over the dataset),
    so a step redone after a rank is lost trains exactly the samples it would
    have: no sample is dropped or counted twice, and with :attr:`Shard.loss_weight`
    the gradient is the same as one process training the whole batch.

    Args:
        dataset_size: Number of samples.
        batch_size: Samples per step, over all ranks (at least the largest world size).
        seed: Seed of the shuffles (the same on every rank).
        shuffle: Shuffle each pass over the dataset; else take samples in order.

    Example::

        sampler = ElasticSampler(len(dataset), batch_size=64)
        shard = sampler.shard(step=10, rank=1, world_size=3)   # 21 or 22 of the step's 64 samples
        loss = loss_fn(model(x[shard.indices]), y[shard.indices]) * shard.loss_weight

    """

    def __init__(self, dataset_size: int, batch_size: int, *, seed: int = 0, shuffle: bool = True) -> None:
        if dataset_size < 1 or batch_size < 1:
            raise ValueError(f"ElasticSampler: need dataset_size >= 1 and batch_size >= 1 "
                             f"(got {dataset_size}, {batch_size})")
        self.dataset_size, self.batch_size, self.seed, self.shuffle = dataset_size, batch_size, seed, shuffle
        self._order: tuple[int, np.ndarray] | None = None

    def _pass(self, number: int) -> np.ndarray:
        if self._order is None or self._order[0] != number:
            order = (np.random.default_rng([self.seed, number]).permutation(self.dataset_size) if self.shuffle
                     else np.arange(self.dataset_size))
            self._order = (number, order)
        return self._order[1]

    def global_batch(self, step: int) -> np.ndarray:
        """Return the dataset indices of step ``step``'s whole batch."""
        start = step * self.batch_size
        parts, position = [], start
        while position < start + self.batch_size:
            number, offset = divmod(position, self.dataset_size)
            take = min(self.dataset_size - offset, start + self.batch_size - position)
            parts.append(self._pass(number)[offset:offset + take])
            position += take
        return np.concatenate(parts)

    def shard(self, step: int, rank: int, world_size: int) -> Shard:
        """Return rank ``rank``'s part of step ``step`` among ``world_size`` ranks.

        Raises:
            ValueError: A rank outside the world, or more ranks than samples in a step.

        """
        if not 0 <= rank < world_size:
            raise ValueError(f"ElasticSampler: rank {rank} is outside a world of {world_size}")
        if world_size > self.batch_size:
            raise ValueError(f"ElasticSampler: {world_size} ranks cannot split a batch of {self.batch_size}")
        batch = self.global_batch(step)
        base, extra = divmod(self.batch_size, world_size)
        start = rank * base + min(rank, extra)
        count = base + (1 if rank < extra else 0)
        return Shard(batch[start:start + count], count * world_size / self.batch_size)

"""Which examples a process reads at a global step: a pure function of (seed, step, process).

Global sample ``i`` of a run is item ``permutation(seed, epoch)[i % num_items]`` with
``epoch = i // num_items`` (in order when not shuffled); step ``s`` holds samples
``s * global_batch_size ...``, of which process ``p`` takes its contiguous share. This is
the rule of :class:`kdist.data.LMBatches`, shared by the BERT datasets. Unshuffled, with
``spread=N`` (fewer samples than items), sample ``i < N`` is item ``i * num_items // N``:
a fixed sample evenly strided over all the items (validation), not the first ``N``.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np


class StepSampler:
    """Item indices of this process's rows at any global step.

    Example:
        >>> s = StepSampler(num_items=10, global_batch_size=4, seed=0)
        >>> sorted(np.concatenate([s.rows(0), s.rows(1), s.rows(2)])[:10]) == list(range(10))
        True
    """

    def __init__(self, num_items: int, global_batch_size: int, seed: int = 0,
                 shuffle: bool = True, process_index: int = 0, process_count: int = 1,
                 spread: int | None = None):
        if global_batch_size % process_count:
            raise ValueError(
                f"global_batch_size={global_batch_size} does not divide by the "
                f"{process_count} processes. Use a multiple of {process_count}."
            )
        if num_items < 1:
            raise ValueError("There are no examples to sample from; provide more data.")
        self.num_items = num_items
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.process_index = process_index
        self.process_count = process_count
        self.spread = spread if spread is not None and 0 < spread < num_items else None

    @lru_cache(maxsize=2)  # noqa: B019 (one sampler per dataset; two epochs in flight)
    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_items)

    def samples(self, step: int) -> np.ndarray:
        """Global sample numbers of this process's rows at ``step``."""
        local = self.global_batch_size // self.process_count
        first = step * self.global_batch_size + self.process_index * local
        return np.arange(first, first + local)

    def rows(self, step: int) -> np.ndarray:
        """Item indices of this process's rows at ``step``."""
        if not self.shuffle and self.spread is not None:
            return self.samples(step) * self.num_items // self.spread
        epochs, positions = np.divmod(self.samples(step), self.num_items)
        if not self.shuffle:
            return positions
        return np.concatenate(
            [self._permutation(int(e))[positions[epochs == e]] for e in np.unique(epochs)]
        )

"""A sampler whose optimizer steps see the same samples whatever the data-parallel layout.

Lightning's own `DistributedSampler` gives each replica a strided slice of one permutation, so the
samples of an optimizer step change with the number of replicas. Here the permutation is fixed
first, cut into global batches (one per optimizer step) and then into micro-batches; micro-batch
`j` of a step goes to rank `j % num_replicas`. A run on 1 process with gradient accumulation and a
run on 4 data-parallel processes therefore average their gradients over the same samples.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_moe.layout import DEFAULT_MICRO_BATCH_SIZE, default_micro_batch_size, resolve_batch_layout

__all__ = [
    "DEFAULT_MICRO_BATCH_SIZE",
    "LayoutInvariantSampler",
    "ResumableDataLoader",
    "default_micro_batch_size",
    "resolve_batch_layout",
]


class LayoutInvariantSampler(DistributedSampler):
    """Per-rank sample indices such that every optimizer step uses the same samples on any layout.

    One permutation per epoch (seeded by `seed + epoch`, independent of `num_replicas`) is
    truncated to whole global batches. Global batch `s` is cut into `global_batch_size //
    micro_batch_size` micro-batches and micro-batch `j` goes to rank `j % num_replicas`, so each
    rank accumulates `global_batch_size // (micro_batch_size * num_replicas)` micro-batches per
    step. Use it with `DataLoader(batch_size=micro_batch_size, drop_last=True)`. It subclasses
    `DistributedSampler` so that Lightning keeps it instead of injecting its own.

    Example:
        >>> sampler = LayoutInvariantSampler(range(64), global_batch_size=16, micro_batch_size=4,
        ...                                  num_replicas=2, rank=1)
        >>> loader = torch.utils.data.DataLoader(range(64), batch_size=4, sampler=sampler,
        ...                                      drop_last=True)
        >>> len(loader)  # 4 steps x 2 micro-batches of this rank
        8
    """

    def __init__(
        self,
        dataset: Sized,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        resolve_batch_layout(global_batch_size, micro_batch_size, num_replicas)
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.num_steps = len(dataset) // global_batch_size
        # The parent's bookkeeping (`__len__` reads num_samples) with our truncation.
        self.total_size = self.num_steps * global_batch_size
        self.num_samples = self.total_size // num_replicas
        self._resume_at: tuple[int, int] | None = None

    def resume_at(self, epoch: int, micro_batches_done: int) -> None:
        """Skip this rank's first ``micro_batches_done`` micro-batches the next time ``epoch`` is iterated."""
        self._resume_at = (epoch, micro_batches_done)

    def global_order(self) -> torch.Tensor:
        """The epoch's sample order shared by all ranks: `num_steps * global_batch_size` indices."""
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self.dataset), generator=generator)  # type: ignore[arg-type]
        else:
            order = torch.arange(len(self.dataset))  # type: ignore[arg-type]
        return order[: self.total_size]

    def __iter__(self) -> Iterator[int]:
        micro_batches = self.global_order().view(
            self.num_steps, self.global_batch_size // self.micro_batch_size, self.micro_batch_size
        )
        mine = micro_batches[:, self.rank :: self.num_replicas]  # micro-batch j -> rank j % n
        indices = mine.reshape(-1)
        if self._resume_at is not None and self._resume_at[0] == self.epoch:
            indices = indices[self._resume_at[1] * self.micro_batch_size :]
            self._resume_at = None
        # Python ints a chunk at a time: a list of every index of the epoch costs ~40 bytes per sample.
        return (index for chunk in indices.split(1 << 16) for index in chunk.tolist())


class ResumableDataLoader(DataLoader):
    """A DataLoader that Lightning can resume mid-epoch, on any layout (it implements ``state_dict``).

    ``progress()`` returns ``(epoch, training batches this rank has finished in that epoch)``; the
    data module reads it from the trainer's loop progress, which, unlike a count of yielded
    batches, does not include the batch Lightning prefetched. Each training batch holds
    ``microbatches_per_step`` loader batches (``pp_microbatches`` under pipeline parallelism).

    The state is layout-free: ``{"epoch", "samples_consumed"}``, the samples of the epoch that all
    data-parallel ranks together have consumed. On load, each rank skips its share of them under
    the new layout (its micro-batch size and number of replicas); a count that does not fall on a
    micro-batch boundary of the new layout is an error.
    """

    def __init__(
        self, *args: Any, progress: Callable[[], tuple[int, int]], microbatches_per_step: int = 1, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.sampler, LayoutInvariantSampler):
            raise TypeError("ResumableDataLoader needs a LayoutInvariantSampler")
        self._progress = progress
        self.microbatches_per_step = microbatches_per_step

    def state_dict(self) -> dict[str, int]:
        epoch, done = self._progress()
        sampler = self.sampler
        samples = done * self.microbatches_per_step * sampler.micro_batch_size * sampler.num_replicas
        return {"epoch": epoch, "samples_consumed": samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        sampler = self.sampler
        per_micro_batch = sampler.micro_batch_size * sampler.num_replicas
        samples = state["samples_consumed"]
        if samples % per_micro_batch:
            raise ValueError(
                f"cannot resume: {samples} samples were consumed, not a multiple of micro_batch_size*dp_ep ="
                f" {sampler.micro_batch_size}*{sampler.num_replicas} = {per_micro_batch} of this layout; resume from a"
                " checkpoint saved at an optimizer step, or choose micro_batch_size dividing it"
            )
        sampler.resume_at(state["epoch"], samples // per_micro_batch)

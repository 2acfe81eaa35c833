"""The loaders every data module here shares: the same samples per optimizer step on any layout,
resumable mid-epoch (on another layout too)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_moe.data.sampler import LayoutInvariantSampler, ResumableDataLoader, resolve_batch_layout
from lightning_moe.parallel.engines import step_engine_of

__all__ = ["LayoutInvariantDataModule", "next_token_sample"]


def next_token_sample(window: torch.Tensor, sample_index: int) -> dict[str, torch.Tensor]:
    """The training sample of a window of ``seq_len + 1`` tokens: inputs, next-token labels and the
    sample's index in the epoch order (what routing replay and resume checks key on)."""
    return {
        "input_ids": window[:-1],
        "labels": window[1:],
        "sample_index": torch.tensor(sample_index, dtype=torch.int64),
    }


class LayoutInvariantDataModule(pl.LightningDataModule):
    """A data module whose loaders give each optimizer step the same samples on every layout.

    Subclasses build ``self.train_dataset`` and ``self.val_dataset`` (map-style, any ``Dataset``
    with ``len``) in :meth:`build_datasets`; this class plans the batches with the strategy's step
    engine and wraps the datasets in :class:`LayoutInvariantSampler` loaders (the training one a
    :class:`ResumableDataLoader`, so a checkpoint resumes mid-epoch on any layout).

    ``num_replicas``/``rank`` come from ``trainer.strategy.distributed_sampler_kwargs`` (the
    strategy's ``dp_ep`` group) and are 1/0 without a distributed strategy. ``setup()`` asks the
    strategy's step engine (plain gradient accumulation for another strategy) for the batch plan,
    and the engine has the trainer accumulate ``global_batch_size // (micro_batch_size * num_replicas)``
    micro-batches.
    """

    def __init__(self, global_batch_size: int, micro_batch_size: int | None, seed: int, num_workers: int) -> None:
        super().__init__()
        resolve_batch_layout(global_batch_size, micro_batch_size, 1)
        self.global_batch_size = global_batch_size
        self.requested_micro_batch_size = micro_batch_size
        self.seed = seed
        self.num_workers = num_workers
        # Resolved by setup() from the attached strategy's data-parallel layout.
        self.micro_batch_size: int | None = micro_batch_size
        self.num_replicas = 1
        self.rank = 0
        self.accumulate_grad_batches = 1
        self.microbatches_per_step = 1
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None

    def build_datasets(self) -> None:
        """Set ``self.train_dataset`` and ``self.val_dataset`` (the subclass's part of ``setup``)."""
        raise NotImplementedError

    def _replica_layout(self) -> tuple[int, int]:
        """(data-parallel replicas, this rank among them)."""
        # Single-device strategies have no distributed_sampler_kwargs at all.
        kwargs = getattr(getattr(self.trainer, "strategy", None), "distributed_sampler_kwargs", None)
        if not kwargs:
            return 1, 0
        return int(kwargs["num_replicas"]), int(kwargs["rank"])

    def setup(self, stage: str | None = None) -> None:
        self.num_replicas, self.rank = self._replica_layout()
        # The step engine plans the batches and has the trainer accumulate them (one owner).
        engine = step_engine_of(self.trainer)
        self.microbatches_per_step = engine.loader_batches_per_step
        self.micro_batch_size, self.accumulate_grad_batches = engine.plan_batches(
            self.trainer, self.global_batch_size, self.requested_micro_batch_size, self.num_replicas
        )
        self.build_datasets()

    def _loader(self, dataset: Dataset | None, shuffle: bool) -> DataLoader:
        if dataset is None or self.micro_batch_size is None:
            raise RuntimeError(f"call {type(self).__name__}.setup() before asking for a dataloader")
        sampler = LayoutInvariantSampler(
            dataset,  # type: ignore[arg-type]
            global_batch_size=self.global_batch_size,
            micro_batch_size=self.micro_batch_size,
            num_replicas=self.num_replicas,
            rank=self.rank,
            shuffle=shuffle,
            seed=self.seed,
        )
        kwargs: dict[str, Any] = dict(
            batch_size=self.micro_batch_size,
            sampler=sampler,
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )
        if shuffle:  # the training loader: resumable mid-epoch from a checkpoint
            return ResumableDataLoader(
                dataset, progress=self._train_progress, microbatches_per_step=self.microbatches_per_step, **kwargs
            )
        return DataLoader(dataset, **kwargs)

    def _train_progress(self) -> tuple[int, int]:
        """(epoch, micro-batches this rank finished in it), read from the trainer's fit loop."""
        if self.trainer is None:
            return 0, 0
        # `processed` counts the batch whose on_train_batch_end is running (where checkpoints are saved).
        return self.trainer.current_epoch, self.trainer.fit_loop.epoch_loop.batch_progress.current.processed

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_dataset, shuffle=True)

    def val_dataloader(self) -> DataLoader | list:
        if self.val_dataset is not None and len(self.val_dataset) == 0:  # type: ignore[arg-type]
            return []  # no validation split: Lightning skips validation for an empty list
        return self._loader(self.val_dataset, shuffle=False)

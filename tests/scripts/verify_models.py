"""Modules for tests/test_verify.py (built by `python -m lightning_moe.verify` through `model._target_`
and `data._target_`; the user module is tests/scripts/user_moe_module.py's).

- `DropoutGPT`: MoEGPT with dropout after the embeddings (verification must turn it off).
- `UnseededGPT`: MoEGPT whose configure_model draws from an unseeded generator.
- `LayoutBatchDataModule`: a data module whose default micro-batch follows the layout (verification
  must give the reference the layout's), and `UnsizedLayoutBatchDataModule`, the same without a
  `micro_batch_size` argument (verification must say that micro-batching explains the FAIL).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from lightning_moe.data import ByteTextDataModule
from lightning_moe.models import MoEGPT


class DropoutGPT(MoEGPT):
    """MoEGPT with dropout on the embeddings, as a user might leave it on."""

    def __init__(self, *args, dropout: float = 0.1, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.embed_dropout = nn.Dropout(dropout)
        self.tok_embeddings.register_forward_hook(lambda module, args, out: self.embed_dropout(out))


class UnseededGPT(MoEGPT):
    """MoEGPT whose configure_model initialises a parameter from an unseeded generator."""

    def configure_model(self) -> None:
        generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
        with torch.no_grad():
            self.output.weight.normal_(0.0, 0.02, generator=generator)


class LayoutBatchDataModule(ByteTextDataModule):
    """ByteTextDataModule whose ``micro_batch_size=None`` is one micro-batch per rank and step
    (``global_batch_size // (dp*ep*pp_microbatches)``, the library's default before it became
    layout-independent): each layout cuts the steps into other micro-batches."""

    def setup(self, stage: str | None = None) -> None:
        if self.requested_micro_batch_size is None:
            strategy = self.trainer.strategy
            replicas = int(
                (getattr(strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1})["num_replicas"]
            )
            per_step = int(getattr(strategy, "microbatches_per_step", 1))
            self.requested_micro_batch_size = self.global_batch_size // (replicas * per_step)
        super().setup(stage)


class UnsizedLayoutBatchDataModule(LayoutBatchDataModule):
    """The same without a ``micro_batch_size`` argument: verification cannot give the one-process
    reference the layout's micro-batches."""

    def __init__(
        self,
        path: str | None = None,
        seq_len: int = 128,
        global_batch_size: int = 16,
        max_corpus_bytes: int = 4_000_000,
        val_fraction: float = 0.05,
        cache_dir: str | None = None,
        seed: int = 1234,
        num_workers: int = 0,
    ) -> None:
        super().__init__(
            path=path,
            seq_len=seq_len,
            global_batch_size=global_batch_size,
            micro_batch_size=None,
            max_corpus_bytes=max_corpus_bytes,
            val_fraction=val_fraction,
            cache_dir=cache_dir,
            seed=seed,
            num_workers=num_workers,
        )

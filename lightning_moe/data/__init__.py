"""Data for the reference model: a byte-level corpus and a layout-invariant sampler."""

from lightning_moe.data.byte_text import (
    ByteTextDataModule,
    ByteWindowDataset,
    build_corpus,
    default_cache_dir,
    stdlib_source_files,
)
from lightning_moe.data.sampler import LayoutInvariantSampler, ResumableDataLoader, resolve_batch_layout
from lightning_moe.data.text import TextDataModule, TokenWindowDataset

__all__ = [
    "ByteTextDataModule",
    "ByteWindowDataset",
    "LayoutInvariantSampler",
    "ResumableDataLoader",
    "TextDataModule",
    "TokenWindowDataset",
    "build_corpus",
    "default_cache_dir",
    "resolve_batch_layout",
    "stdlib_source_files",
]

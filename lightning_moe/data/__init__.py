"""Data: prepared token corpora (Megatron indexed, litdata) blended, a byte-level corpus, text through
a tokenizer, and the layout-invariant sampler they share."""

from lightning_moe.data.blend import blend_schedule, parse_blend
from lightning_moe.data.byte_text import (
    ByteTextDataModule,
    ByteWindowDataset,
    build_corpus,
    default_cache_dir,
    stdlib_source_files,
)
from lightning_moe.data.indexed import IndexedCorpusWriter, IndexedTokens
from lightning_moe.data.module import LayoutInvariantDataModule
from lightning_moe.data.sampler import LayoutInvariantSampler, ResumableDataLoader, resolve_batch_layout
from lightning_moe.data.text import TextDataModule, TokenWindowDataset
from lightning_moe.data.tokens import BlendedWindows, DocumentWindows, TokenDataModule, open_token_source

__all__ = [
    "BlendedWindows",
    "ByteTextDataModule",
    "DocumentWindows",
    "IndexedCorpusWriter",
    "IndexedTokens",
    "LayoutInvariantDataModule",
    "TokenDataModule",
    "blend_schedule",
    "open_token_source",
    "parse_blend",
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

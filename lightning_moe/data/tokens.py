"""``data=tokens``: prepared token corpora, blended, split by documents, read by memory map.

A source is a Megatron indexed corpus (``<prefix>.bin`` + ``<prefix>.idx``, what
``python -m lightning_moe.data.prepare`` writes) or a litdata directory optimized with
``TokensLoader``. Each source's documents are split into train/validation/test by a seeded
permutation (Megatron's ``"969,30,1"`` weights); a split's documents, in that shuffled order, are
concatenated and cut into samples of ``seq_len + 1`` tokens with a stride of ``seq_len`` (the last
token of a sample is the first of the next, as in Megatron's GPT dataset), so a sample may span
documents. The blend picks each sample's source from its index (:mod:`lightning_moe.data.blend`),
and the layout-invariant sampler orders the samples: every layout sees the same samples per step.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from omegaconf import OmegaConf
from torch.utils.data import Dataset

from lightning_moe.data.blend import blend_schedule, parse_blend
from lightning_moe.data.indexed import IndexedTokens
from lightning_moe.data.module import LayoutInvariantDataModule, next_token_sample

__all__ = ["BlendedWindows", "DocumentWindows", "TokenDataModule", "TokenSource", "open_token_source", "parse_split"]


class TokenSource(Protocol):
    """What a corpus format gives the windows: documents as offsets into one flat token stream."""

    prefix: str
    num_documents: int
    num_tokens: int
    document_offsets: np.ndarray  # int64 [num_documents + 1]
    metadata: dict

    def read(self, start: int, stop: int) -> np.ndarray: ...

    def max_token_id(self) -> int: ...


def open_token_source(path: str | os.PathLike) -> TokenSource:
    """The source at ``path``: a Megatron indexed prefix (``<path>.idx``/``.bin``, or either file) or a
    litdata ``TokensLoader`` directory; anything else is refused naming the path and the fix."""
    text = os.fspath(path)
    folder = Path(text).expanduser()
    if folder.is_dir():
        from lightning_moe.data.litdata_tokens import LitdataTokens, is_litdata_directory

        if is_litdata_directory(folder):
            return LitdataTokens(folder)
        raise ValueError(
            f"source {text!r} is a directory but not a litdata one (no index.json): give a Megatron prefix"
            " (<prefix>.bin + <prefix>.idx, e.g. written by `python -m lightning_moe.data.prepare`) or a directory"
            " written by litdata.optimize(..., item_loader=TokensLoader())"
        )
    prefix = text[: -len(".bin")] if text.endswith((".bin", ".idx")) else text
    if Path(prefix + ".idx").expanduser().exists() or Path(prefix + ".bin").expanduser().exists():
        return IndexedTokens(Path(prefix).expanduser())
    if folder.exists():
        raise ValueError(
            f"source {text!r} is a file of an unknown kind: a source is a Megatron prefix (<prefix>.bin +"
            " <prefix>.idx) or a litdata TokensLoader directory; prepare raw text with"
            " `python -m lightning_moe.data.prepare input=<files> tokenizer=<folder> output=<prefix>`"
        )
    raise FileNotFoundError(
        f"source {text!r}: neither {prefix}.idx/.bin (a Megatron indexed corpus) nor a litdata directory exists;"
        " check the path (relative paths are from the working directory) or prepare it with"
        " `python -m lightning_moe.data.prepare input=<files> tokenizer=<folder> output=<prefix>`"
    )


def parse_split(split: str | Sequence[float]) -> tuple[float, float, float]:
    """Train/validation/test shares from ``"969,30,1"`` (or ``[969, 30, 1]``; missing parts are 0)."""
    parts = [p for p in str(split).replace("/", ",").split(",")] if isinstance(split, str) else list(split)
    try:
        values = [float(p) for p in parts]
    except (TypeError, ValueError):
        raise ValueError(f"split={split!r}: write train,validation,test weights, e.g. '969,30,1'") from None
    if not 1 <= len(values) <= 3 or any(v < 0 for v in values) or sum(values) <= 0 or values[0] <= 0:
        raise ValueError(
            f"split={split!r}: give 1 to 3 non-negative weights with a positive train share, e.g. '969,30,1'"
        )
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return values[0] / total, values[1] / total, values[2] / total


def split_documents(num_documents: int, shares: tuple[float, float, float], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) document ids: one seeded permutation cut by the shares (layout-independent)."""
    order = np.random.default_rng(seed).permutation(num_documents).astype(np.int64)
    bounds = np.round(np.cumsum(shares) * num_documents).astype(np.int64)
    return order[: bounds[0]], order[bounds[0] : bounds[1]]


class DocumentWindows:
    """Samples of ``seq_len + 1`` tokens, stride ``seq_len``, over ``documents`` of ``source`` concatenated.

    ``window(i)`` returns the sample's tokens and, per token, the index of its document among
    those the sample touches (0, 1, ...). Memory: two int64 per document; tokens stay mapped.
    """

    def __init__(self, source: TokenSource, documents: np.ndarray, seq_len: int) -> None:
        self.source = source
        self.documents = documents
        self.seq_len = seq_len
        lengths = source.document_offsets[documents + 1] - source.document_offsets[documents]
        self.cumulative = np.zeros(len(documents) + 1, dtype=np.int64)
        np.cumsum(lengths, out=self.cumulative[1:])
        self.num_samples = max(0, int(self.cumulative[-1] - 1) // seq_len)

    def __len__(self) -> int:
        return self.num_samples

    def window(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        start = index * self.seq_len
        stop = start + self.seq_len + 1
        k = int(np.searchsorted(self.cumulative, start, side="right")) - 1
        pieces, lengths, position = [], [], start
        while position < stop:
            begin, end = int(self.cumulative[k]), int(self.cumulative[k + 1])
            take = min(stop, end) - position
            if take > 0:  # empty documents hold no token
                offset = int(self.source.document_offsets[self.documents[k]]) + position - begin
                pieces.append(self.source.read(offset, offset + take))
                lengths.append(take)
                position += take
            k += 1
        tokens = np.concatenate(pieces).astype(np.int64)
        return tokens, np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)


class BlendedWindows(Dataset):
    """The blend of several sources' windows as one map-style dataset of ``num_samples`` samples.

    Item ``i`` comes from source ``blend_schedule(weights)[i]``; a source whose share exceeds its
    own samples is repeated (in the same order). Items are dicts of int64 tensors: ``input_ids``,
    ``labels`` ``[seq_len]``, ``sample_index`` (``i``); with ``document_mask``, ``position_ids``
    restarting at 0 at each document start within the sample (the first one at the sample's start,
    as Megatron's ``reset_position_ids``) and ``document_ids`` (equal ids: same document); with
    ``eod_mask_loss``, ``loss_mask`` (float) that drops the label that starts a new document
    (the one after an EOS when documents end with EOS; Megatron's ``eod_mask_loss``).
    """

    def __init__(
        self,
        windows: Sequence[DocumentWindows],
        weights: Sequence[float],
        *,
        document_mask: bool = False,
        eod_mask_loss: bool = False,
    ) -> None:
        self.windows = list(windows)
        self.num_samples = sum(len(w) for w in self.windows)
        # One source needs no schedule (nothing per sample held in memory).
        self.schedule = blend_schedule(weights, self.num_samples) if len(self.windows) > 1 else None
        self.document_mask = document_mask
        self.eod_mask_loss = eod_mask_loss

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range [0, {self.num_samples})")
        if self.schedule is None:
            tokens, documents = self.windows[0].window(index)
        else:
            windows = self.windows[int(self.schedule[0][index])]
            tokens, documents = windows.window(int(self.schedule[1][index]) % len(windows))
        sample = next_token_sample(torch.from_numpy(tokens), index)
        if self.document_mask:
            starts = np.flatnonzero(np.diff(documents, prepend=-1))
            positions = np.arange(len(documents), dtype=np.int64) - starts[documents]
            sample["position_ids"] = torch.from_numpy(positions[:-1])
            sample["document_ids"] = torch.from_numpy(documents[:-1])
        if self.eod_mask_loss:
            sample["loss_mask"] = torch.from_numpy((documents[1:] == documents[:-1]).astype(np.float32))
        return sample


def _model_vocab_size(module: Any) -> int | None:
    """The model's vocabulary: its ``vocab_size`` (attribute or hyperparameter), None when it has neither."""
    for value in (getattr(module, "vocab_size", None), getattr(module, "hparams", {}).get("vocab_size")):
        if isinstance(value, int):
            return value
    return None


class TokenDataModule(LayoutInvariantDataModule):
    """Prepared token corpora, blended, on every layout (``data=tokens``).

    Args:
        blend: one source (a Megatron prefix ``<prefix>`` of ``.bin``/``.idx``, or a litdata
            ``TokensLoader`` directory), weights and sources ``[0.7, "data/wiki", 0.3, "data/code"]``,
            or a mapping ``{source: weight}``. Weights are normalised.
        seq_len: tokens per sample (a sample is ``seq_len + 1`` tokens, stride ``seq_len``).
        global_batch_size: samples per optimizer step, whatever the layout.
        micro_batch_size: samples per rank and forward; None: 2 (1 for an odd global batch) on every layout.
        split: train/validation/test shares of each source's documents, e.g. ``"969,30,1"``.
        document_mask: add ``position_ids`` restarting at each document and ``document_ids``.
        eod_mask_loss: add a ``loss_mask`` dropping the label that starts a new document.
        seed: seed of the document split and order (and of the per-epoch sample order, ``seed + epoch``).
        num_workers: DataLoader workers.

    Every source is opened (memory-mapped, nothing read) and every sample count checked when the
    module is built; the token ids are checked against the model's vocabulary in ``setup()``, before
    training. ``vocab_size`` is the tokenizer's vocabulary recorded by ``prepare`` (else the largest
    id + 1); a Hugging Face model with fewer embeddings refuses it.

    Example:
        >>> dm = TokenDataModule(blend=[0.7, "data/wiki", 0.3, "data/code"], seq_len=1024)  # doctest: +SKIP
        >>> lightning.Trainer(strategy=MoE5DStrategy(ep=2), devices=2).fit(MoEGPT(vocab_size=32000), datamodule=dm)  # doctest: +SKIP
    """

    def __init__(
        self,
        blend: Any,
        seq_len: int = 128,
        global_batch_size: int = 16,
        micro_batch_size: int | None = None,
        split: str | Sequence[float] = "969,30,1",
        document_mask: bool = False,
        eod_mask_loss: bool = False,
        seed: int = 1234,
        num_workers: int = 0,
    ) -> None:
        super().__init__(global_batch_size, micro_batch_size, seed, num_workers)
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        # Hydra passes lists as ListConfig: checkpoints keep plain Python (they load with weights_only).
        blend = OmegaConf.to_container(blend) if OmegaConf.is_config(blend) else blend
        split = OmegaConf.to_container(split) if OmegaConf.is_config(split) else split
        self.save_hyperparameters()
        self.seq_len = seq_len
        self.blend = parse_blend(blend)
        self.sources = [open_token_source(source) for _, source in self.blend]
        shares = parse_split(split)
        weights = [weight for weight, _ in self.blend]
        train, val = [], []
        for source in self.sources:
            train_docs, val_docs = split_documents(source.num_documents, shares, seed)
            train.append(DocumentWindows(source, train_docs, seq_len))
            val.append(DocumentWindows(source, val_docs, seq_len))
        for source, windows in zip(self.sources, train):
            if len(windows) == 0:
                raise ValueError(
                    f"source {source.prefix}: its train split ({len(windows.documents)} documents,"
                    f" {int(windows.cumulative[-1])} tokens) holds no sample of seq_len+1 = {seq_len + 1} tokens:"
                    " lower seq_len, raise its train share in split, or drop it from the blend"
                )
        self.train_dataset = BlendedWindows(train, weights, document_mask=document_mask, eod_mask_loss=eod_mask_loss)
        if len(self.train_dataset) < global_batch_size:
            raise ValueError(
                f"too few samples for one global batch: the blend's train split gives {len(self.train_dataset)} samples of"
                f" seq_len+1 = {seq_len + 1} tokens but global_batch_size is {global_batch_size}: lower seq_len or"
                " global_batch_size, or add data"
            )
        # Validation blends the sources whose validation split holds a sample, with their weights.
        kept = [(weight, windows) for weight, windows in zip(weights, val) if len(windows)]
        total = sum(weight for weight, _ in kept)
        self.val_dataset = (
            BlendedWindows(
                [w for _, w in kept],
                [weight / total for weight, _ in kept],
                document_mask=document_mask,
                eod_mask_loss=eod_mask_loss,
            )
            if kept
            else None
        )
        if self.val_dataset is not None and len(self.val_dataset) < global_batch_size:
            warnings.warn(
                f"validation skipped: the blend's validation split gives {len(self.val_dataset)} samples, fewer than"
                f" global_batch_size {global_batch_size}; raise the validation share of split={split!r} to validate"
            )
            self.val_dataset = None
        recorded = [source.metadata.get("vocab_size") for source in self.sources]
        self.vocab_size: int | None = max(recorded) if all(isinstance(v, int) for v in recorded) else None

    def build_datasets(self) -> None:
        """The datasets were built (and checked) with the module; here the token ids meet the model's vocabulary."""
        model = getattr(self.trainer, "lightning_module", None)
        model_vocab = _model_vocab_size(model) if model is not None else None
        largest_ids = [source.max_token_id() for source in self.sources]
        for source, largest in zip(self.sources, largest_ids):
            if model_vocab is not None and largest >= model_vocab:
                raise ValueError(
                    f"source {source.prefix}: token id {largest} is >= the model's vocab_size {model_vocab}: train a"
                    f" model with vocab_size >= {largest + 1} (e.g. model.vocab_size={largest + 1}) or prepare the"
                    " corpus with the model's tokenizer"
                )
        if self.vocab_size is None:
            self.vocab_size = max(largest_ids) + 1

    def val_dataloader(self):
        if self.val_dataset is None:
            return []
        return super().val_dataloader()

"""Text data through a tokenizer (``data=text``): the byte corpus, tokenized and cached once.

Needs the ``tokenizers`` package (the ``[hf]`` extra); it is imported only when a data module is
built. The tokenizer is a local folder holding ``tokenizer.json`` (what ``save_pretrained`` or
``tokenizers.Tokenizer.save`` writes); nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from lightning_moe.data.byte_text import ByteTextDataModule, ByteWindowDataset

__all__ = ["TextDataModule", "TokenWindowDataset", "load_tokenizer", "tokenize_corpus"]


def load_tokenizer(path: str | os.PathLike) -> Any:
    """A ``tokenizers.Tokenizer`` from a local folder (its ``tokenizer.json``) or a ``tokenizer.json`` file."""
    try:
        from tokenizers import Tokenizer
    except ImportError as err:  # pragma: no cover - the [hf] extra is installed by make install
        raise ImportError("data=text needs the tokenizers package: pip install -e '.[hf]'") from err
    source = Path(path).expanduser()
    file = source / "tokenizer.json" if source.is_dir() else source
    if not file.is_file():
        raise FileNotFoundError(
            f"tokenizer={str(path)!r}: no tokenizer.json there; pass a local tokenizer folder (e.g. written by"
            " tokenizer.save_pretrained(folder)) or a tokenizer.json file; nothing is downloaded"
        )
    return Tokenizer.from_file(str(file))


def tokenize_corpus(corpus: Path, tokenizer_path: str | os.PathLike, cache_dir: Path) -> Path:
    """Token ids of the byte corpus ``corpus`` as a ``.npy`` (uint16 below 65536 tokens, else int32).

    The text is decoded as UTF-8 (invalid bytes replaced) and tokenized line by line; the cache name
    holds digests of the corpus name and of ``tokenizer.json``, and the file is written atomically.
    """
    source = Path(tokenizer_path).expanduser()
    file = source / "tokenizer.json" if source.is_dir() else source
    digest = hashlib.sha256(file.read_bytes()).hexdigest()[:16]
    out = cache_dir / f"{corpus.stem}-tok-{digest}.npy"
    if out.exists():
        return out
    tokenizer = load_tokenizer(tokenizer_path)
    lines = corpus.read_bytes().decode("utf-8", errors="replace").splitlines(keepends=True)
    ids: list[int] = []
    for i in range(0, len(lines), 4096):
        for encoding in tokenizer.encode_batch(lines[i : i + 4096], add_special_tokens=False):
            ids.extend(encoding.ids)
    dtype = np.uint16 if tokenizer.get_vocab_size() <= np.iinfo(np.uint16).max + 1 else np.int32
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex}.tmp.npy")
    np.save(tmp, np.asarray(ids, dtype=dtype))
    os.replace(tmp, out)
    return out


class TokenWindowDataset(ByteWindowDataset):
    """Windows ``[first, first + count)`` of ``seq_len + 1`` tokens of a token ``.npy`` (``corpus``).

    Item ``i`` is ``{"input_ids": window[:-1], "labels": window[1:]}`` (int64, shape ``[seq_len]``),
    as :class:`~lightning_moe.data.ByteWindowDataset` gives for bytes.
    """

    def _num_tokens(self) -> int:
        return len(np.load(self.corpus, mmap_mode="r"))

    def _open_tokens(self) -> np.ndarray:
        return np.load(self.corpus, mmap_mode="r")


class TextDataModule(ByteTextDataModule):
    """:class:`~lightning_moe.data.ByteTextDataModule` with a tokenizer: same corpus sources, same
    layout-invariant sampler and resumable position, windows of ``seq_len + 1`` *tokens*.

    Args:
        tokenizer: a local tokenizer folder (``tokenizer.json``) or file.
        The others: as :class:`~lightning_moe.data.ByteTextDataModule` (``max_corpus_bytes`` caps
        the text before tokenization).

    ``vocab_size`` is the tokenizer's: a model whose embeddings are smaller refuses it before
    training (``HFMoEModule`` checks).

    Example::

        dm = TextDataModule(tokenizer="my_tokenizer/", path="my_texts/", seq_len=256, global_batch_size=32)
    """

    def __init__(self, tokenizer: str | os.PathLike, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tokenizer_path = tokenizer
        self.vocab_size: int = load_tokenizer(tokenizer).get_vocab_size()
        self.tokens: Path | None = None

    def build_datasets(self) -> None:
        # The byte module builds the byte corpus (and checks it in bytes).
        super().build_datasets()
        assert self.corpus is not None
        cache = Path(self.cache_dir).expanduser() if self.cache_dir is not None else self.corpus.parent
        self.tokens = tokenize_corpus(self.corpus, self.tokenizer_path, cache)
        num_tokens = len(np.load(self.tokens, mmap_mode="r"))
        num_train, num_val = self._split_windows(num_tokens, f"the tokenized corpus ({num_tokens} tokens)", "tokens")
        self.train_dataset = TokenWindowDataset(self.tokens, self.seq_len, 0, num_train)
        self.val_dataset = TokenWindowDataset(self.tokens, self.seq_len, num_train, num_val)

"""Megatron's indexed token format (``<prefix>.bin`` + ``<prefix>.idx``), written and read here.

Corpora prepared by Megatron-LM/NeMo load here and ours load there; nothing of Megatron is imported.

``<prefix>.bin`` is every token of every document back to back, one fixed-width integer each.
``<prefix>.idx`` is, little-endian: the magic ``MMIDIDX\\0\\0``, the version (u64, 1), the token
dtype's code (u8), the sequence count S (u64), the document-index count D (u64), then the
sequence lengths (int32 [S], tokens), the sequence pointers (int64 [S], byte offsets into the
``.bin``) and the document index (int64 [D]: document k is sequences ``[index[k], index[k+1])``,
``index[0] = 0``, ``index[-1] = S``). A corpus written here has one sequence per document, and a
``<prefix>.json`` beside the pair (not part of Megatron's format, optional when reading) records
how it was made: tokenizer, vocab size, EOS id, counts and the largest token id.

The reader maps both files (never reads the tokens into memory) and refuses, naming the file and
the fix, a missing file, a wrong magic or version, an unknown dtype and a ``.bin`` whose size
disagrees with its index. The writer makes the pair appear only when both are complete.
"""

from __future__ import annotations

import json
import os
import struct
import uuid
from array import array as _array
from pathlib import Path

import numpy as np

__all__ = ["INDEX_MAGIC", "IndexedCorpusWriter", "IndexedTokens", "token_dtype"]

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
# Megatron's dtype codes.
_DTYPE_CODES: dict[int, type[np.number]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(dtype): code for code, dtype in _DTYPE_CODES.items()}
_HEADER = struct.Struct("<9sQBQQ")
_PREPARE_HINT = "write it with `python -m lightning_moe.data.prepare input=... tokenizer=... output=<prefix>`"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id of a ``vocab_size`` vocabulary fits, else int32 (as Megatron picks)."""
    return np.dtype(np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32)


def _paths(prefix: str | os.PathLike) -> tuple[Path, Path]:
    prefix = str(prefix)
    for suffix in (".bin", ".idx"):
        if prefix.endswith(suffix):  # a user may name either file of the pair
            prefix = prefix[: -len(suffix)]
    return Path(prefix + ".bin"), Path(prefix + ".idx")


class IndexedTokens:
    """A read-only, memory-mapped Megatron indexed corpus: documents of token ids.

    Attributes:
        prefix: the path without ``.bin``/``.idx``.
        dtype: the token dtype.
        tokens: every token, a ``np.memmap`` of the ``.bin`` (flat; nothing read until sliced).
        document_offsets: int64 ``[num_documents + 1]``, token offsets of the documents in ``tokens``.

    Example:
        >>> corpus = IndexedTokens("data/wiki_text_document")  # doctest: +SKIP
        >>> corpus.num_documents, corpus.num_tokens, corpus.document(0)[:5]  # doctest: +SKIP
    """

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.bin_path, self.idx_path = _paths(prefix)
        self.prefix = str(self.bin_path)[: -len(".bin")]
        for path in (self.idx_path, self.bin_path):
            if not path.is_file():
                raise FileNotFoundError(
                    f"{path}: no such file; an indexed corpus is the pair <prefix>.bin + <prefix>.idx: {_PREPARE_HINT}"
                )
        idx_size = self.idx_path.stat().st_size
        with open(self.idx_path, "rb") as fh:
            header = fh.read(_HEADER.size)
        if len(header) < _HEADER.size or header[: len(INDEX_MAGIC)] != INDEX_MAGIC:
            raise ValueError(
                f"{self.idx_path}: not a Megatron index (magic {header[:9]!r}, expected {INDEX_MAGIC!r}); {_PREPARE_HINT}"
            )
        _, version, code, num_sequences, num_document_indices = _HEADER.unpack(header)
        if version != INDEX_VERSION:
            raise ValueError(
                f"{self.idx_path}: index version {version}, only version {INDEX_VERSION} is read; {_PREPARE_HINT}"
            )
        if code not in _DTYPE_CODES:
            raise ValueError(
                f"{self.idx_path}: unknown token dtype code {code} (known: {sorted(_DTYPE_CODES)}); {_PREPARE_HINT}"
            )
        self.dtype = np.dtype(_DTYPE_CODES[code])
        needed = _HEADER.size + num_sequences * (4 + 8) + num_document_indices * 8
        if num_document_indices < 1 or idx_size < needed:
            raise ValueError(
                f"{self.idx_path}: truncated index ({idx_size} bytes, its header needs {needed}); {_PREPARE_HINT}"
            )
        index = np.memmap(self.idx_path, dtype=np.uint8, mode="r")
        offset = _HEADER.size
        self.sequence_lengths = index[offset : offset + 4 * num_sequences].view(np.int32)
        offset += 4 * num_sequences
        self.sequence_pointers = index[offset : offset + 8 * num_sequences].view(np.int64)
        offset += 8 * num_sequences
        document_index = index[offset : offset + 8 * num_document_indices].view(np.int64)
        if document_index[0] != 0 or document_index[-1] != num_sequences or np.any(np.diff(document_index) < 0):
            raise ValueError(
                f"{self.idx_path}: inconsistent document index (not 0 ... {num_sequences}); {_PREPARE_HINT}"
            )
        num_tokens = int(self.sequence_lengths.sum(dtype=np.int64))
        expected = num_tokens * self.dtype.itemsize
        bin_size = self.bin_path.stat().st_size
        if bin_size != expected:
            raise ValueError(
                f"{self.bin_path}: {bin_size} bytes, but {self.idx_path.name} indexes {num_tokens} tokens of"
                f" {self.dtype.itemsize} bytes = {expected}: the pair is truncated or from two different prepares;"
                f" {_PREPARE_HINT}"
            )
        starts = np.zeros(num_sequences + 1, dtype=np.int64)
        np.cumsum(self.sequence_lengths, out=starts[1:])
        if num_sequences and not np.array_equal(self.sequence_pointers, starts[:-1] * self.dtype.itemsize):
            raise ValueError(f"{self.idx_path}: the sequences are not stored back to back in the .bin; {_PREPARE_HINT}")
        self.document_offsets = starts[document_index]
        metadata_path = Path(self.prefix + ".json")
        self.metadata: dict = json.loads(metadata_path.read_text()) if metadata_path.is_file() else {}
        self.num_documents = num_document_indices - 1
        self.num_tokens = num_tokens
        self.tokens = np.memmap(self.bin_path, dtype=self.dtype, mode="r") if num_tokens else np.zeros(0, self.dtype)

    def max_token_id(self) -> int:
        """The largest token id: from ``<prefix>.json`` when prepare wrote it, else one pass over the map in chunks."""
        if "max_token_id" in self.metadata:
            return int(self.metadata["max_token_id"])
        chunk = 1 << 24
        return max((int(self.tokens[i : i + chunk].max()) for i in range(0, self.num_tokens, chunk)), default=-1)

    def document(self, index: int) -> np.ndarray:
        """The tokens of document ``index`` (a view of the map)."""
        return self.tokens[self.document_offsets[index] : self.document_offsets[index + 1]]

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the flat stream (a view of the map)."""
        return self.tokens[start:stop]

    def __len__(self) -> int:
        return self.num_documents

    def __getstate__(self) -> dict:
        # Maps do not pickle into DataLoader workers: reopen there.
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["prefix"])  # type: ignore[misc]


class IndexedCorpusWriter:
    """Writes documents into ``<prefix>.bin`` + ``<prefix>.idx``, atomically.

    Tokens go to a private temporary file as they come (memory does not grow with the corpus; the
    index keeps one length per document). ``close()`` writes the index, then renames: any old
    ``<prefix>.idx`` is removed first and the new one appears last, so an interrupted prepare never
    leaves a pair that reads as complete. Leaving the ``with`` block on an exception removes the
    temporary files and writes nothing.

    Example:
        >>> with IndexedCorpusWriter("out/corpus", vocab_size=32000) as writer:  # doctest: +SKIP
        ...     writer.add_document([17, 4, 2])
    """

    def __init__(
        self, prefix: str | os.PathLike, *, vocab_size: int | None = None, dtype: np.dtype | type | None = None
    ) -> None:
        if (vocab_size is None) == (dtype is None):
            raise ValueError("IndexedCorpusWriter needs exactly one of vocab_size (to choose the dtype) or dtype")
        self.vocab_size = vocab_size
        self.dtype = token_dtype(vocab_size) if dtype is None else np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise ValueError(
                f"dtype {self.dtype} has no Megatron code; use one of {sorted(str(np.dtype(d)) for d in _CODE_OF)}"
            )
        self.bin_path, self.idx_path = _paths(prefix)
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        tag = f".{os.getpid()}.{uuid.uuid4().hex}.tmp"
        self._bin_tmp = self.bin_path.with_name(self.bin_path.name + tag)
        self._idx_tmp = self.idx_path.with_name(self.idx_path.name + tag)
        self._json_tmp = self._idx_tmp.with_name(self._idx_tmp.name + ".json")
        self._bin = open(self._bin_tmp, "wb")
        # Set once close() or abort() has run: the `with` block must not finish the writer a second time.
        self._finished = False
        # A C array, 4 bytes a document (a list of ints costs ~36): a corpus of 1e8 documents holds 0.4 GB, not 3.6.
        self._lengths = _array("i")
        self.num_tokens = 0
        self.max_token_id = -1

    @property
    def num_documents(self) -> int:
        return len(self._lengths)

    def add_document(self, ids: np.ndarray | list[int]) -> None:
        """Append one document's token ids (values must fit the dtype)."""
        array = np.asarray(ids)
        if array.size and (array.min() < np.iinfo(self.dtype).min or array.max() > np.iinfo(self.dtype).max):
            raise ValueError(
                f"token ids {array.min()}..{array.max()} do not fit {self.dtype}; pass the tokenizer's vocab_size"
            )
        self._bin.write(array.astype(self.dtype, copy=False).tobytes(order="C"))
        self._lengths.append(int(array.size))
        self.num_tokens += int(array.size)
        if array.size:
            self.max_token_id = max(self.max_token_id, int(array.max()))

    def close(self, metadata: dict | None = None) -> None:
        """Write the index (and ``metadata`` with the counts as ``<prefix>.json``) and make the pair appear, complete.

        Call it inside the ``with`` block to pass ``metadata``; the block's end then leaves the pair as
        it is. A second call does nothing. If writing fails, the temporary files are removed (the pair
        is left as it was, or without its index) and the error propagates.
        """
        if self._finished:
            return
        try:
            self._publish(metadata)
        except BaseException:
            self.abort()
            raise
        self._finished = True

    def _publish(self, metadata: dict | None) -> None:
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        lengths = np.frombuffer(self._lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths):
            np.cumsum(lengths[:-1], out=pointers[1:])
        pointers *= self.dtype.itemsize
        with open(self._idx_tmp, "wb") as fh:
            fh.write(_HEADER.pack(INDEX_MAGIC, INDEX_VERSION, _CODE_OF[self.dtype], len(lengths), len(lengths) + 1))
            fh.write(lengths.tobytes())
            fh.write(pointers.tobytes())
            fh.write(np.arange(len(lengths) + 1, dtype=np.int64).tobytes())
            fh.flush()
            os.fsync(fh.fileno())
        record = {
            "vocab_size": self.vocab_size,
            **(metadata or {}),
            "documents": self.num_documents,
            "tokens": self.num_tokens,
            "max_token_id": self.max_token_id,
            "dtype": str(self.dtype),
        }
        self._json_tmp.write_text(json.dumps(record, indent=2) + "\n")
        self.idx_path.unlink(missing_ok=True)
        os.replace(self._bin_tmp, self.bin_path)
        os.replace(self._json_tmp, self.bin_path.with_suffix(".json"))
        os.replace(self._idx_tmp, self.idx_path)

    def abort(self) -> None:
        """Drop everything written (the prefix is left as it was, or without its index); nothing after close()."""
        if self._finished:
            return
        self._finished = True
        self._bin.close()
        for tmp in (self._bin_tmp, self._idx_tmp, self._json_tmp):
            tmp.unlink(missing_ok=True)

    def __enter__(self) -> "IndexedCorpusWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

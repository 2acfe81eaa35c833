"""Lightning's litdata token directories (``optimize(..., item_loader=TokensLoader())``), read here.

Corpora optimized for litdata's ``StreamingDataset`` load here, memory-mapped; litdata is not
imported (it is only needed to write such a directory, and by the tests as the reference reader).

The layout, as litdata's ``BinaryWriter`` writes it for ``TokensLoader``:

``index.json`` is ``{"chunks": [...], "config": {...}, "updated_at": ...}``. Each chunk entry
names its file (``filename``, e.g. ``chunk-0-3.bin``) and gives ``chunk_size`` (items in the
chunk), ``dim`` (tokens in the chunk) and ``chunk_bytes`` (the file's size). ``config`` records
``item_loader`` (the class name, ``"TokensLoader"``), ``data_format`` (one entry,
``no_header_tensor:<torch dtype code>`` for a 1-D torch tensor or ``no_header_numpy:<numpy dtype
code>`` for a 1-D array), ``compression`` and ``encryption``.

A chunk file is, in native byte order: the item count N (uint32), N + 1 byte offsets (uint32,
from the start of the file: item k is bytes ``[offsets[k], offsets[k+1])``, ``offsets[0]`` is the
header size ``4 * (N + 2)``), then the items' tokens back to back, no per-item header.

So item boundaries are exact: each optimized item is one document here, and the documents of all
chunks, in index order, make one flat token stream (what ``StreamingDataset`` walks too). Only
the chunk headers are read when a directory is opened; each chunk's tokens are mapped on first use.

Note that litdata's ``TokensLoader(block_size=B)`` cuts blocks inside each chunk (chunk ``c``
gives ``dim_c // B`` blocks starting at its first token; the tail of each chunk is never
served), while here the stream is continuous across chunks: ``chunk_offsets`` gives where each
chunk starts, for whoever needs litdata's exact blocks.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from pathlib import Path

import numpy as np

__all__ = ["LitdataTokens", "is_litdata_directory"]

INDEX_FILENAME = "index.json"
_OPTIMIZE_HINT = (
    "write one with litdata.optimize(fn=..., inputs=..., output_dir=<directory>, chunk_size=...,"
    " item_loader=TokensLoader()) (one 1-D integer tensor of token ids per item)"
)
_TOKENS_HINT = "re-optimize with item_loader=TokensLoader(), each item one 1-D integer tensor (or array) of token ids"
_INCOMPLETE_HINT = (
    "the directory is incomplete (an interrupted optimize or a partial copy): copy it again or re-optimize"
)
_HEADER_DTYPE = np.dtype(np.uint32)  # litdata writes the chunk header with numpy, native byte order

# litdata's torch dtype codes (``_TORCH_DTYPES_MAPPING``), as numpy dtypes; the others are named for messages.
_TORCH_INTEGER_CODES: dict[int, type[np.integer]] = {
    11: np.uint8,
    12: np.int8,
    13: np.int16,
    14: np.int16,
    15: np.int32,
    16: np.int32,
    17: np.int64,
    18: np.int64,
    20: np.uint16,
}
_TORCH_OTHER_CODES = {
    0: "float32",
    1: "float32",
    2: "float64",
    3: "float64",
    4: "complex64",
    5: "complex64",
    6: "complex128",
    7: "complex128",
    8: "float16",
    9: "float16",
    10: "bfloat16",
    19: "bool",
}
# litdata's numpy dtype codes (``_NUMPY_DTYPES_MAPPING``: the position in its list of scalar types).
_NUMPY_CODES = [
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    "bool",
    "object",
    "bytes",
    "str",
    "void",
]


def _directory(path: str | os.PathLike) -> Path:
    directory = Path(path).expanduser()
    if directory.name == INDEX_FILENAME and directory.is_file():  # a user may name the index itself
        directory = directory.parent
    return directory


def _load_index(index_path: Path) -> dict | None:
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        return None
    return index if isinstance(index, dict) else None


def _looks_like_litdata(index: dict | None) -> bool:
    return (
        index is not None
        and isinstance(index.get("chunks"), list)
        and isinstance(index.get("config"), dict)
        and ("item_loader" in index["config"] or "data_format" in index["config"])
    )


def is_litdata_directory(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder (or its ``index.json``) that litdata's ``optimize`` wrote, of any item loader.

    Only ``index.json`` is looked at (chunks and config present); :class:`LitdataTokens` says what is wrong with one
    it cannot read.
    """
    directory = _directory(path)
    index_path = directory / INDEX_FILENAME
    return directory.is_dir() and index_path.is_file() and _looks_like_litdata(_load_index(index_path))


def _token_dtype(data_format: str) -> np.dtype | str:
    """The numpy dtype of a ``data_format`` entry, or why it is not one of token ids."""
    name, _, code = data_format.partition(":")
    if name not in ("no_header_tensor", "no_header_numpy") or not code.isdigit():
        return f"its items are {data_format!r}, not a 1-D tensor of token ids"
    code_number = int(code)
    if name == "no_header_tensor":
        if code_number in _TORCH_INTEGER_CODES:
            return np.dtype(_TORCH_INTEGER_CODES[code_number])
        what = _TORCH_OTHER_CODES.get(code_number, f"unknown dtype code {code_number}")
        return f"its items are 1-D torch tensors of {what}, not of integer token ids"
    what = _NUMPY_CODES[code_number] if code_number < len(_NUMPY_CODES) else f"unknown dtype code {code_number}"
    if what not in _NUMPY_CODES[:8]:
        return f"its items are 1-D numpy arrays of {what}, not of integer token ids"
    return np.dtype(what)


class LitdataTokens:
    """A read-only, memory-mapped litdata token directory: documents of token ids, one per optimized item.

    Attributes:
        prefix: the directory (used in messages, and to reopen after pickling).
        dtype: the token dtype (what the optimized tensors held: int32 for ``torch.int32``, etc.).
        document_offsets: int64 ``[num_documents + 1]``, token offsets of the documents in the flat stream
            (every chunk's items, chunks in ``index.json`` order).
        chunk_offsets: int64 ``[num_chunks + 1]``, token offsets of the chunks in the same stream.
        chunk_paths: the chunk files, in index order.
        metadata: what ``index.json`` says about the directory (format, chunking, counts).

    At most ``MAX_OPEN_CHUNKS`` chunk maps are held at once (each holds a file descriptor); the least recently
    used is dropped first, and arrays already returned keep their map alive.

    Example:
        >>> corpus = LitdataTokens("data/optimized")  # doctest: +SKIP
        >>> corpus.num_documents, corpus.num_tokens, corpus.document(0)[:5]  # doctest: +SKIP
    """

    MAX_OPEN_CHUNKS = 64

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = _directory(directory)
        self.prefix = str(self.directory)
        self._maps: OrderedDict[int, np.ndarray] = OrderedDict()
        self._max_token_id: int | None = None
        if not self.directory.is_dir():
            remote = "://" in str(directory)
            raise FileNotFoundError(
                f"{self.prefix}: no such directory"
                + ("; only a local directory is read (download the optimized dataset first)" if remote else "")
                + f"; a litdata token directory holds index.json and chunk-*.bin: {_OPTIMIZE_HINT}"
            )
        self.index_path = self.directory / INDEX_FILENAME
        if not self.index_path.is_file():
            raise FileNotFoundError(
                f"{self.index_path}: no such file; {self.prefix} is not a litdata optimized directory (or its"
                f" optimize did not finish: index.json is written last): {_OPTIMIZE_HINT}"
            )
        index = _load_index(self.index_path)
        if not _looks_like_litdata(index):
            raise ValueError(
                f"{self.index_path}: not a litdata index (expected JSON with 'chunks' and a 'config' naming the"
                f" item_loader); {_OPTIMIZE_HINT}"
            )
        assert index is not None
        config, chunks = index["config"], index["chunks"]
        loader = config.get("item_loader")
        if loader != "TokensLoader":
            raise ValueError(
                f"{self.index_path}: optimized with item_loader={loader or 'unknown'}, not TokensLoader, so its items"
                f" are not flat token ids; {_TOKENS_HINT}"
            )
        data_format = config.get("data_format")
        if not isinstance(data_format, list) or len(data_format) != 1 or not isinstance(data_format[0], str):
            raise ValueError(
                f"{self.index_path}: data_format {data_format!r} is not a single 1-D integer tensor per item;"
                f" {_TOKENS_HINT}"
            )
        dtype = _token_dtype(data_format[0])
        if isinstance(dtype, str):
            raise ValueError(f"{self.index_path}: {dtype}; {_TOKENS_HINT}")
        self.dtype = dtype
        compression = config.get("compression") or config.get("compression_level")
        # A chunk compressed as a whole is named chunk-<rank>-<index>.<codec>.bin.
        names = [str(chunk.get("filename", "")) for chunk in chunks if isinstance(chunk, dict)]
        compressed = [name for name in names if name.count(".") > 1]
        if compression or compressed:
            raise ValueError(
                f"{self.index_path}: its chunks are compressed (compression={compression!r}"
                + (f", e.g. {compressed[0]}" if compressed else "")
                + "); compressed chunks cannot be memory-mapped and are not read here: re-optimize without compression="
            )
        if config.get("encryption"):
            raise ValueError(
                f"{self.index_path}: its chunks are encrypted ({config['encryption']}); encrypted chunks are not"
                " read here: re-optimize without encryption="
            )
        self.chunk_paths: list[Path] = []
        chunk_tokens = np.zeros(len(chunks), dtype=np.int64)
        document_lengths: list[np.ndarray] = []
        for position, chunk in enumerate(chunks):
            path, lengths = self._read_chunk_header(position, chunk)
            self.chunk_paths.append(path)
            chunk_tokens[position] = int(lengths.sum(dtype=np.int64))
            document_lengths.append(lengths)
        self.chunk_offsets = np.zeros(len(chunks) + 1, dtype=np.int64)
        np.cumsum(chunk_tokens, out=self.chunk_offsets[1:])
        lengths_all = np.concatenate(document_lengths) if document_lengths else np.zeros(0, dtype=np.int64)
        self.document_offsets = np.zeros(len(lengths_all) + 1, dtype=np.int64)
        np.cumsum(lengths_all, out=self.document_offsets[1:])
        self._chunk_header_bytes = [4 * (len(lengths) + 2) for lengths in document_lengths]
        self.num_documents = len(lengths_all)
        self.num_tokens = int(self.chunk_offsets[-1])
        self.metadata: dict = {
            "format": "litdata",
            "item_loader": loader,
            "data_format": data_format[0],
            "dtype": str(self.dtype),
            "chunk_size": config.get("chunk_size"),
            "chunk_bytes": config.get("chunk_bytes"),
            "chunks": len(chunks),
            "documents": self.num_documents,
            "tokens": self.num_tokens,
            **({"updated_at": index["updated_at"]} if "updated_at" in index else {}),
        }

    def _read_chunk_header(self, position: int, chunk: object) -> tuple[Path, np.ndarray]:
        """Check chunk ``position`` against the index and return its path and its items' token counts."""
        filename = chunk.get("filename") if isinstance(chunk, dict) else None
        if not isinstance(filename, str) or not filename or Path(filename).name != filename:
            raise ValueError(
                f"{self.index_path}: chunk {position} has no plain file name ({chunk!r}); {_INCOMPLETE_HINT}"
            )
        assert isinstance(chunk, dict)
        path = self.directory / filename
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such file, but {self.index_path.name} lists it; {_INCOMPLETE_HINT}")
        size = path.stat().st_size
        num_items = chunk.get("chunk_size")
        if not isinstance(num_items, int) or num_items < 0:
            raise ValueError(
                f"{self.index_path}: chunk {filename} has no item count (chunk_size={num_items!r}); {_INCOMPLETE_HINT}"
            )
        expected_bytes = chunk.get("chunk_bytes")
        header_bytes = 4 * (num_items + 2)
        if isinstance(expected_bytes, int) and size < expected_bytes:
            raise ValueError(
                f"{path}: {size} bytes, shorter than the {expected_bytes} that {self.index_path.name} says: the file is"
                f" truncated; {_INCOMPLETE_HINT}"
            )
        if size < header_bytes:
            raise ValueError(
                f"{path}: {size} bytes, shorter than the header of its {num_items} items ({header_bytes} bytes) that"
                f" {self.index_path.name} implies: the file is truncated; {_INCOMPLETE_HINT}"
            )
        with open(path, "rb") as fh:
            header = np.frombuffer(fh.read(header_bytes), dtype=_HEADER_DTYPE).astype(np.int64)
        offsets = header[1:]
        if header[0] != num_items or offsets[0] != header_bytes or np.any(np.diff(offsets) < 0):
            raise ValueError(
                f"{path}: its header (item count {int(header[0])}, first offset {int(offsets[0])}) disagrees with"
                f" {self.index_path.name} ({num_items} items, first offset {header_bytes}), or its offsets decrease:"
                f" not this directory's chunk or a corrupt one; {_INCOMPLETE_HINT}"
            )
        if size < offsets[-1]:
            raise ValueError(
                f"{path}: {size} bytes, shorter than the {int(offsets[-1])} its header indexes: the file is truncated;"
                f" {_INCOMPLETE_HINT}"
            )
        item_bytes = np.diff(offsets)
        if np.any(item_bytes % self.dtype.itemsize):
            raise ValueError(
                f"{path}: an item's byte size is not a multiple of {self.dtype.itemsize} ({self.dtype}): the chunk does"
                f" not hold {self.dtype} tokens; {_TOKENS_HINT}"
            )
        lengths = item_bytes // self.dtype.itemsize
        dim = chunk.get("dim")
        # litdata leaves "dim" None when a chunk's first item is empty; the header still counts every item.
        if dim is not None and dim != int(lengths.sum()):
            raise ValueError(
                f"{path}: holds {int(lengths.sum())} tokens, but {self.index_path.name} says {dim}; {_INCOMPLETE_HINT}"
            )
        return path, lengths

    def _chunk(self, position: int) -> np.ndarray:
        """The tokens of chunk ``position``, a ``np.memmap`` opened on first use (LRU of ``MAX_OPEN_CHUNKS``)."""
        tokens = self._maps.get(position)
        if tokens is not None:
            self._maps.move_to_end(position)
            return tokens
        count = int(self.chunk_offsets[position + 1] - self.chunk_offsets[position])
        if count == 0:
            tokens = np.zeros(0, dtype=self.dtype)
        else:
            tokens = np.memmap(
                self.chunk_paths[position],
                dtype=self.dtype,
                mode="r",
                offset=self._chunk_header_bytes[position],
                shape=(count,),
            )
        self._maps[position] = tokens
        while len(self._maps) > max(1, self.MAX_OPEN_CHUNKS):
            self._maps.popitem(last=False)  # arrays handed out keep their own reference to the map
        return tokens

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the flat stream (slice semantics): a view of the map within one chunk, a copy
        when the range crosses chunks."""
        start, stop, _ = slice(start, stop).indices(self.num_tokens)
        if stop <= start:
            return np.zeros(0, dtype=self.dtype)
        first = int(np.searchsorted(self.chunk_offsets, start, side="right")) - 1
        last = int(np.searchsorted(self.chunk_offsets, stop, side="left")) - 1
        pieces = []
        for position in range(first, last + 1):
            base = int(self.chunk_offsets[position])
            pieces.append(self._chunk(position)[max(start - base, 0) : stop - base])
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def document(self, index: int) -> np.ndarray:
        """The tokens of document ``index`` (an optimized item; a view of its chunk's map)."""
        if not -self.num_documents <= index < self.num_documents:
            raise IndexError(f"{self.prefix}: document {index} out of range ({self.num_documents} documents)")
        index %= self.num_documents
        return self.read(int(self.document_offsets[index]), int(self.document_offsets[index + 1]))

    def max_token_id(self) -> int:
        """The largest token id (-1 when empty): one pass over the chunks in slices, cached."""
        if self._max_token_id is None:
            slice_tokens = 1 << 24
            largest = -1
            for position in range(len(self.chunk_paths)):
                tokens = self._chunk(position)
                for i in range(0, len(tokens), slice_tokens):
                    largest = max(largest, int(tokens[i : i + slice_tokens].max()))
            self._max_token_id = largest
        return self._max_token_id

    def __len__(self) -> int:
        return self.num_documents

    def __getstate__(self) -> dict:
        # Maps do not pickle into DataLoader workers: reopen there (lazily, as here).
        return {"prefix": self.prefix, "max_token_id": self._max_token_id}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["prefix"])  # type: ignore[misc]
        self._max_token_id = state.get("max_token_id")

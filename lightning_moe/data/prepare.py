"""Tokenize local text corpora into Megatron's indexed format: ``<output>.bin`` + ``<output>.idx``.

Usage::

    python -m lightning_moe.data.prepare input=<files|globs|folders> tokenizer=<folder|bytes> output=<prefix> \\
        [workers=1] [text_key=text] [lines=false] [append_eos=true] [eos_token=null] [batch_size=1000] [progress=true]

    # e.g. eight tokenizer processes over gzipped JSON lines and a folder of Parquet files:
    python -m lightning_moe.data.prepare input='[web/*.jsonl.gz,books/]' tokenizer=my_tokenizer/ \\
        output=prepared/web_books workers=8

Options are ``key=value`` (as Hydra overrides; ``--help`` lists them). From Python,
:func:`prepare` takes the same options and returns the summary.

Inputs are read from disk only (nothing is downloaded):

* ``.jsonl`` / ``.jsonl.gz``: one JSON object per line, the text under ``text_key``;
* ``.parquet``: the column ``text_key``, read one record batch at a time;
* ``.txt`` / ``.md``: one document per file, or one per non-blank line with ``lines=true``;
* a folder written by Hugging Face ``datasets``' ``save_to_disk``: its Arrow files, in the order its
  ``state.json`` lists them, column ``text_key`` (read with pyarrow; ``datasets`` is not needed);
* any other folder: every supported file (and saved dataset) under it, recursively, in order of
  relative path; hidden names and other file types are skipped.

Globs are expanded and sorted. A named file of another type, a path that does not exist and a
folder with nothing to read are refused before any work, as are a bad tokenizer or EOS token.

``tokenizer`` is a local folder holding ``tokenizer.json`` (or that file), or ``bytes``: the UTF-8
bytes as ids 0..255 (vocab 256, no EOS token). Each record becomes one document: its tokens
(``add_special_tokens=False``) followed, with ``append_eos=true``, by the EOS id (``eos_token``, or
the ``eos_token`` of the folder's ``tokenizer_config.json``). Records without tokens are skipped and
counted. ``workers=N`` tokenizes in N processes with a bounded number of batches in flight; the
output is byte-identical for any N and memory does not grow with the corpus.

The pair is written by :class:`~lightning_moe.data.indexed.IndexedCorpusWriter` (uint16 tokens when
the vocab fits, else int32) with ``<output>.json`` beside it recording the tokenizer, vocab size,
EOS id, inputs and counts. It appears only when complete: an error or Ctrl-C leaves an older output
as it was (or without its ``.idx``) and never a pair that reads as complete.
"""

from __future__ import annotations

import glob
import gzip
import json
import multiprocessing
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import ExitStack, closing, contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

import numpy as np
from omegaconf import MISSING

from lightning_moe.data.indexed import IndexedCorpusWriter, token_dtype

__all__ = [
    "BYTES_TOKENIZER",
    "PrepareConfig",
    "Source",
    "format_summary",
    "main",
    "parse_args",
    "prepare",
    "read_texts",
    "resolve_inputs",
    "usage",
]

BYTES_TOKENIZER = "bytes"
# File name endings read, and the reader each goes to (".jsonl.gz" before ".jsonl": longest match first).
_FILE_KINDS = {".jsonl.gz": "jsonl", ".jsonl": "jsonl", ".parquet": "parquet", ".txt": "text", ".md": "text"}
_SUPPORTED = "files ending " + ", ".join(_FILE_KINDS) + " and folders written by datasets' save_to_disk"
# A batch also ends at this many characters, so a few huge documents cannot hold many batches' worth of memory.
_BATCH_CHARS = 1 << 23
_EOS_FIX = "pass eos_token=<token in the vocab> or append_eos=false"
_GLOB_CHARS = frozenset("*?[")


# --- options ---------------------------------------------------------------------------------------


@dataclass
class PrepareConfig:
    """The options of ``python -m lightning_moe.data.prepare`` (and of :func:`prepare`)."""

    input: Any = field(
        default=MISSING,
        metadata={
            "help": (
                "(required) files, globs or folders to read: .jsonl, .jsonl.gz, .parquet, .txt, .md, datasets"
                " save_to_disk folders; several as a list: input='[a.jsonl,b/*.parquet]'"
            )
        },
    )
    tokenizer: str = field(
        default=MISSING,
        metadata={
            "help": (
                "(required) a local tokenizer folder (tokenizer.json), a tokenizer.json file, or 'bytes' (UTF-8 bytes, vocab 256)"
            )
        },
    )
    output: str = field(
        default=MISSING,
        metadata={
            "help": (
                "(required) the output prefix: writes <output>.bin, <output>.idx and <output>.json (folders created)"
            )
        },
    )
    workers: int = field(default=1, metadata={"help": "tokenizer processes; the output is the same for any number"})
    text_key: str = field(default="text", metadata={"help": "the JSON key / Parquet or Arrow column holding the text"})
    lines: bool = field(
        default=False, metadata={"help": ".txt/.md: one document per non-blank line instead of per file"}
    )
    append_eos: bool = field(default=True, metadata={"help": "end every document with the EOS id"})
    # Optional[...] rather than `str | None`: OmegaConf 2.3 reads typing's Optional.
    eos_token: Optional[str] = field(
        default=None,
        metadata={
            "help": ("the EOS token to append; null: the eos_token of the tokenizer folder's tokenizer_config.json")
        },
    )
    batch_size: int = field(default=1000, metadata={"help": "documents per batch sent to a tokenizer process"})
    progress: bool = field(default=True, metadata={"help": "a progress line on stderr (only when it is a terminal)"})


_OPTIONS = [f.name for f in fields(PrepareConfig)]
# Options that are text: YAML would misread some values (`*.jsonl` as an alias, `007` as 7, `yes` as true).
_VERBATIM = {"input", "tokenizer", "output", "text_key", "eos_token"}
_EXAMPLE = "python -m lightning_moe.data.prepare input='data/*.jsonl.gz' tokenizer=my_tokenizer/ output=prepared/corpus workers=8"


def usage() -> str:
    """The ``--help`` text: the syntax, one line per option and an example."""
    width = max(map(len, _OPTIONS))
    lines = [
        "usage: python -m lightning_moe.data.prepare input=... tokenizer=... output=... [key=value ...]",
        "",
        "Tokenize local text corpora into Megatron's indexed format (<output>.bin + <output>.idx + <output>.json).",
        "",
        "options:",
    ]
    for option in fields(PrepareConfig):
        default = "" if option.default == MISSING else f" (default: {_yaml_value(option.default)})"
        lines.append(f"  {option.name:<{width}}  {option.metadata['help']}{default}")
    return "\n".join([*lines, "", "example:", f"  {_EXAMPLE}"])


def _yaml_value(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def parse_args(argv: Sequence[str]) -> PrepareConfig:
    """``key=value`` arguments, validated against :class:`PrepareConfig` (``ValueError`` names what is wrong).

    Values are parsed by ``OmegaConf.from_cli`` except those of text options that are not a list or
    ``null``: those are kept verbatim, so ``input=*.jsonl`` is a glob and ``output=007`` a name.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    parts = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep:
            raise ValueError(f"{arg!r}: expected key=value; the options are {', '.join(_OPTIONS)}")
        if key not in _OPTIONS:
            raise ValueError(f"unknown option {key!r} (in {arg!r}); the options are {', '.join(_OPTIONS)}")
        try:
            if key in _VERBATIM and not value.startswith("[") and value != "null":
                parts.append(OmegaConf.create({key: value}))
            else:
                parts.append(OmegaConf.from_cli([arg]))
        except Exception as err:  # YAML's scanner errors have no common base worth naming
            raise ValueError(
                f"{arg!r}: cannot parse the value ({str(err).splitlines()[0]}); quote list items:"
                f" {key}='[\"a/*.jsonl\",b.parquet]'"
            ) from None
    try:
        config = OmegaConf.merge(OmegaConf.structured(PrepareConfig), *parts)
    except OmegaConfBaseException as err:  # e.g. workers=many: name the option, not only the value
        raise ValueError(f"{getattr(err, 'full_key', None) or 'options'}: {str(err).splitlines()[0]}") from None
    missing = [key for key in _OPTIONS if OmegaConf.is_missing(config, key)]
    if missing:
        raise ValueError(f"missing {', '.join(key + '=...' for key in missing)}; e.g. {_EXAMPLE}")
    parsed: PrepareConfig = OmegaConf.to_object(config)  # type: ignore[assignment]
    if isinstance(parsed.input, list):
        parsed.input = [str(item) for item in parsed.input]
    return parsed


# --- inputs ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """One input to read: a file, or a folder written by ``datasets``' ``save_to_disk`` (kind ``arrow``)."""

    path: Path
    kind: str  # "jsonl", "parquet", "text" or "arrow"


def resolve_inputs(input: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Source]:
    """The sources named by ``input`` (paths, globs, folders, or a list of them), in reading order.

    Raises ``FileNotFoundError`` for a path or glob that names nothing and ``ValueError`` for a file
    of another type or a folder with nothing to read, each naming the path and the fix.
    """
    entries = [input] if isinstance(input, (str, os.PathLike)) else list(input)
    if not entries:
        raise ValueError(
            "input=[] names nothing; pass input=<file, glob or folder> or a list: input='[a.jsonl,b/*.parquet]'"
        )
    sources: list[Source] = []
    for entry in entries:
        for path in _expand(str(entry)):
            sources.extend(_sources_at(path))
    return sources


def _expand(entry: str) -> list[Path]:
    """The paths an input entry names: itself if it exists, else its glob matches, sorted."""
    pattern = os.path.expanduser(entry)
    if os.path.exists(pattern):  # a real name wins over reading its brackets as a glob
        return [Path(pattern)]
    if _GLOB_CHARS.intersection(pattern):
        matches = sorted(glob.glob(pattern, recursive=True))
        if not matches:
            raise FileNotFoundError(
                f"input={entry!r}: the glob matches nothing; check the pattern and the current directory"
            )
        return [Path(match) for match in matches]
    raise FileNotFoundError(f"input={entry!r}: no such file or folder; pass existing {_SUPPORTED}, or globs of them")


def _sources_at(path: Path) -> list[Source]:
    if not path.is_dir():
        kind = _file_kind(path.name)
        if kind is None:
            raise ValueError(
                f"input {path}: not a file type prepare reads ({_SUPPORTED}); convert it or leave it out of input="
            )
        return [Source(path, kind)]
    splits = _dataset_dict_splits(path)
    if splits is not None:
        raise ValueError(
            f"input {path}: a datasets DatasetDict (splits {splits}); name one split, e.g. input={path / splits[0]}"
        )
    if _is_saved_dataset(path):
        return [Source(path, "arrow")]
    return _folder_sources(path)


def _file_kind(name: str) -> str | None:
    return next((kind for suffix, kind in _FILE_KINDS.items() if name.endswith(suffix)), None)


def _is_saved_dataset(folder: Path) -> bool:
    """Whether ``folder`` is what ``datasets.Dataset.save_to_disk`` writes (its metadata and Arrow files)."""
    has_metadata = (folder / "state.json").is_file() or (folder / "dataset_info.json").is_file()
    return has_metadata and any(folder.glob("*.arrow"))


def _dataset_dict_splits(folder: Path) -> list[str] | None:
    """The splits of a ``DatasetDict.save_to_disk`` folder, or None for any other folder."""
    marker = folder / "dataset_dict.json"
    if not marker.is_file():
        return None
    return list(json.loads(marker.read_text()).get("splits", [])) or sorted(
        p.name for p in folder.iterdir() if p.is_dir()
    )


def _folder_sources(folder: Path) -> list[Source]:
    """Every supported file and saved dataset under ``folder``, sorted by relative path."""
    found: list[Source] = []
    for root, dirs, files in os.walk(folder):
        here = Path(root)
        descend = []
        for name in dirs:
            if name.startswith("."):
                continue
            if _is_saved_dataset(here / name):
                found.append(Source(here / name, "arrow"))  # read as one dataset, not walked into
            else:
                descend.append(name)
        dirs[:] = descend
        for name in files:
            kind = None if name.startswith(".") else _file_kind(name)
            if kind is not None:
                found.append(Source(here / name, kind))
    if not found:
        raise ValueError(
            f"input {folder}: a folder with nothing prepare reads under it ({_SUPPORTED}); name the files instead"
        )
    return sorted(found, key=lambda source: source.path.relative_to(folder).as_posix())


def _arrow_files(folder: Path) -> list[Path]:
    """A saved dataset's Arrow files, in the order its ``state.json`` lists them (else by name)."""
    state = folder / "state.json"
    if state.is_file():
        names = [entry["filename"] for entry in json.loads(state.read_text()).get("_data_files", [])]
        if names:
            missing = [name for name in names if not (folder / name).is_file()]
            if missing:
                raise FileNotFoundError(
                    f"input {folder}: state.json lists {missing}, which are not there; save the dataset again"
                )
            return [folder / name for name in names]
    return sorted(folder.glob("*.arrow"))


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet  # noqa: F401
    except ImportError as err:  # pragma: no cover - installed with the project's dependencies
        raise ImportError("reading .parquet files and saved datasets needs pyarrow: pip install pyarrow") from err
    return pyarrow


def _check_columns(sources: Iterable[Source], text_key: str) -> None:
    """Refuse, before any work, a Parquet file or saved dataset without a text column ``text_key``."""
    for source in sources:
        if source.kind == "parquet":
            _check_schema(source.path, _pyarrow().parquet.read_schema(source.path), text_key)
        elif source.kind == "arrow":
            pa = _pyarrow()
            for file in _arrow_files(source.path):
                with pa.memory_map(str(file)) as mapped:
                    _check_schema(file, pa.ipc.open_stream(mapped).schema, text_key)


def _check_schema(path: Path, schema: Any, text_key: str) -> None:
    types = _pyarrow().types
    if text_key not in schema.names:
        raise ValueError(
            f"{path}: no column {text_key!r} (columns: {schema.names}); pass text_key=<the column that holds the text>"
        )
    column_type = schema.field(text_key).type
    if not (types.is_string(column_type) or types.is_large_string(column_type) or types.is_string_view(column_type)):
        raise ValueError(f"{path}: column {text_key!r} holds {column_type}, not text; pass text_key=<a string column>")


# --- readers: each yields the documents' texts (a null text as "") --------------------------------


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` of a UTF-8 text file, gzipped if named ``.gz``; line ends kept as written."""
    opener: Callable[..., Any] = gzip.open if path.name.endswith(".gz") else open
    number = 0
    try:
        # utf-8-sig: a byte-order mark is not part of the first record. newline="": "\r\n" is kept as it is.
        with opener(path, "rt", encoding="utf-8-sig", newline="") as handle:
            for number, line in enumerate(handle, 1):
                yield number, line
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 after line {number} ({err.reason}); re-encode the file as UTF-8") from None
    except (gzip.BadGzipFile, EOFError) as err:
        raise ValueError(f"{path}: a damaged gzip file after line {number} ({err}); compress it again") from None


def _read_jsonl(source: Source, text_key: str, **_: Any) -> Iterator[str]:
    for number, line in _lines(source.path):
        if not line.strip():
            continue  # a blank line (often the last) is no record
        where = f"{source.path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not JSON ({err.msg}); a .jsonl file holds one JSON object per line") from None
        if not isinstance(record, dict):
            raise ValueError(
                f"{where}: a JSON {type(record).__name__}, not an object; a .jsonl file holds one JSON object per line"
            )
        if text_key not in record:
            raise ValueError(
                f"{where}: the record has no {text_key!r} key (keys: {sorted(record)}); "
                "pass text_key=<the key that holds the text>"
            )
        text = record[text_key]
        if text is not None and not isinstance(text, str):
            raise ValueError(
                f"{where}: {text_key!r} holds a {type(text).__name__}, not text; pass text_key=<a text key>"
            )
        yield text or ""


def _read_text(source: Source, lines: bool, **_: Any) -> Iterator[str]:
    if lines:
        for _number, line in _lines(source.path):
            text = line.rstrip("\r\n")
            if text.strip():  # blank lines separate documents; they are not documents
                yield text
        return
    data = source.path.read_bytes()
    try:
        yield data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{source.path}: not UTF-8 at byte {err.start} ({err.reason}); re-encode the file as UTF-8"
        ) from None


def _read_parquet(source: Source, text_key: str, rows: int, **_: Any) -> Iterator[str]:
    pa = _pyarrow()
    try:
        with pa.parquet.ParquetFile(source.path) as parquet:
            for batch in parquet.iter_batches(batch_size=rows, columns=[text_key]):
                yield from _texts(batch.column(0))
    except pa.ArrowException as err:
        raise ValueError(f"{source.path}: cannot read it as Parquet ({err})") from err


def _read_saved_dataset(source: Source, text_key: str, **_: Any) -> Iterator[str]:
    pa = _pyarrow()
    for file in _arrow_files(source.path):
        try:
            # save_to_disk writes Arrow IPC streams; mapped, a batch is read where it lies, not copied in.
            with pa.memory_map(str(file)) as mapped:
                reader = pa.ipc.open_stream(mapped)
                column = reader.schema.get_field_index(text_key)
                for batch in reader:
                    yield from _texts(batch.column(column))
        except pa.ArrowException as err:
            raise ValueError(f"{file}: cannot read it as an Arrow stream ({err}); save the dataset again") from err


def _texts(column: Any) -> Iterator[str]:
    return (text or "" for text in column.to_pylist())


_READERS: dict[str, Callable[..., Iterator[str]]] = {
    "jsonl": _read_jsonl,
    "text": _read_text,
    "parquet": _read_parquet,
    "arrow": _read_saved_dataset,
}


def read_texts(
    sources: Iterable[Source], *, text_key: str = "text", lines: bool = False, rows: int = 1000
) -> Iterator[str]:
    """The text of every record of ``sources``, in order, read lazily (``rows``: Parquet rows per read)."""
    for source in sources:
        yield from _READERS[source.kind](source, text_key=text_key, lines=lines, rows=rows)


def _batches(texts: Iterable[str], batch_size: int, max_chars: int = _BATCH_CHARS) -> Iterator[list[str]]:
    """``texts`` in lists of ``batch_size`` (fewer once they hold ``max_chars`` characters)."""
    batch: list[str] = []
    chars = 0
    for text in texts:
        batch.append(text)
        chars += len(text)
        if len(batch) >= batch_size or chars >= max_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


# --- tokenizer -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _EncoderSpec:
    """What a worker needs to build the encoder: a path and ids, never the tokenizer object (spawn-safe)."""

    tokenizer: str  # BYTES_TOKENIZER or the absolute path of a tokenizer folder or file
    eos_id: int | None  # appended to every document with tokens; None: nothing appended
    dtype: str  # the output's token dtype: ids are sent back in it


class _Encoder:
    """Texts to ``(ids, lengths)``: every document's ids back to back (EOS included) and each one's count."""

    def __init__(self, spec: _EncoderSpec, tokenizer: Any = None) -> None:
        from lightning_moe.data.text import load_tokenizer

        self.eos_id = spec.eos_id
        self.dtype = np.dtype(spec.dtype)
        self.tokenizer = None
        if spec.tokenizer != BYTES_TOKENIZER:
            self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(spec.tokenizer)

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        if self.tokenizer is None:
            pieces = [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts]
        else:
            encodings = self.tokenizer.encode_batch(texts, add_special_tokens=False)
            pieces = [np.asarray(encoding.ids, dtype=self.dtype) for encoding in encodings]
        lengths = np.fromiter((len(piece) for piece in pieces), dtype=np.int64, count=len(pieces))
        ids = np.concatenate(pieces).astype(self.dtype, copy=False) if pieces else np.zeros(0, self.dtype)
        if self.eos_id is not None:
            # One EOS after the last token of each document with tokens (a document without any stays empty).
            has_tokens = lengths > 0
            ids = np.insert(ids, np.cumsum(lengths)[has_tokens], self.eos_id)
            lengths = lengths + has_tokens
        return ids, lengths


def _configured_eos(tokenizer_path: Path) -> str | None:
    """``eos_token`` of the ``tokenizer_config.json`` beside the tokenizer (a string or ``{"content": ...}``)."""
    folder = tokenizer_path if tokenizer_path.is_dir() else tokenizer_path.parent
    config_file = folder / "tokenizer_config.json"
    if not config_file.is_file():
        return None
    eos = json.loads(config_file.read_text()).get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


def _resolve_tokenizer(
    tokenizer: str | os.PathLike, *, append_eos: bool, eos_token: str | None
) -> tuple[_EncoderSpec, int, Any]:
    """The encoder spec, the vocab size and the loaded tokenizer (None for bytes); refuses a missing or bad EOS."""
    if str(tokenizer) == BYTES_TOKENIZER:
        if eos_token is not None:
            raise ValueError(
                f"tokenizer=bytes has no special tokens, so eos_token={eos_token!r} names none; leave it"
                " unset and pass append_eos=false"
            )
        if append_eos:
            raise ValueError(
                "tokenizer=bytes has no EOS token (its 256 ids are the byte values): pass append_eos=false"
            )
        return _EncoderSpec(BYTES_TOKENIZER, None, str(token_dtype(256))), 256, None
    from lightning_moe.data.text import load_tokenizer

    path = Path(tokenizer).expanduser().absolute()
    loaded = load_tokenizer(path)
    vocab_size = int(loaded.get_vocab_size(with_added_tokens=True))
    # An eos_token given is always checked; the configured one only matters when it is appended.
    name = eos_token if eos_token is not None or not append_eos else _configured_eos(path)
    eos_id = None
    if name is not None:
        eos_id = loaded.token_to_id(name)
        if eos_id is None:
            origin = "" if eos_token is not None else f" (from {path}'s tokenizer_config.json)"
            raise ValueError(f"eos_token={name!r}{origin} is not in the vocab of tokenizer={tokenizer}; {_EOS_FIX}")
    if append_eos and eos_id is None:
        raise ValueError(
            f"tokenizer={tokenizer} names no EOS token (no eos_token in a tokenizer_config.json beside it); {_EOS_FIX}"
        )
    spec = _EncoderSpec(
        str(path), int(eos_id) if append_eos and eos_id is not None else None, str(token_dtype(vocab_size))
    )
    return spec, vocab_size, loaded


# --- tokenizing in order: in this process, or in worker processes ----------------------------------


class _InProcess:
    """Tokenizes each batch here (``workers=1``; the tokenizer's own threads still use the cores)."""

    def __init__(self, encoder: _Encoder) -> None:
        self.encoder = encoder

    def map(self, batches: Iterable[list[str]]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for batch in batches:
            yield self.encoder(batch)

    def close(self) -> None:
        pass


_WORKER_ENCODER: _Encoder | None = None


def _init_worker(spec: _EncoderSpec) -> None:
    """Worker start: load the tokenizer once (from its path, so any start method works)."""
    global _WORKER_ENCODER
    # N workers already keep N cores busy: the tokenizer's own thread pool would oversubscribe them.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # Ctrl-C is the parent's to handle: it stops feeding, aborts the output and shuts the pool down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A forked worker inherits the command's SIGTERM handler; a worker has nothing to clean up, so it just ends.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _WORKER_ENCODER = _Encoder(spec)


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    assert _WORKER_ENCODER is not None, "the pool's initializer did not run"
    return _WORKER_ENCODER(texts)


class _WorkerPool:
    """Tokenizes batches in ``workers`` processes; results come back in input order.

    At most ``2 * workers`` batches are in flight: the input is read only as fast as it is
    tokenized and written (``Pool.imap`` would drain the whole input into its queue).
    """

    def __init__(self, spec: _EncoderSpec, workers: int) -> None:
        self.window = 2 * workers
        self._executor = ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context(), initializer=_init_worker, initargs=(spec,)
        )
        # Start the workers now: before the progress bar's thread exists (forking a threaded process
        # is unsafe) and before the output is opened (they should not inherit its file).
        try:
            self._executor.submit(int).result()
        except BaseException:
            self.close()
            raise

    def map(self, batches: Iterable[list[str]]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        pending: deque[Future] = deque()
        try:
            for batch in batches:
                pending.append(self._executor.submit(_encode_in_worker, batch))
                if len(pending) >= self.window:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:  # on an error, drop the work not started yet
                future.cancel()

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


@contextmanager
def _tokenizing(spec: _EncoderSpec, workers: int, tokenizer: Any) -> Iterator[_InProcess | _WorkerPool]:
    runner = _InProcess(_Encoder(spec, tokenizer)) if workers == 1 else _WorkerPool(spec, workers)
    try:
        yield runner
    finally:
        runner.close()


# --- progress and writing --------------------------------------------------------------------------


@contextmanager
def _progress(enabled: bool) -> Iterator[Callable[[int, int], None]]:
    """An ``update(documents, tokens)`` that shows both and tokens/s on stderr (rich), if it is a terminal."""
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    columns = (
        SpinnerColumn(),
        TextColumn("{task.fields[documents]:,} documents"),
        TextColumn("{task.fields[tokens]:,} tokens"),
        TextColumn("{task.fields[rate]:,.0f} tokens/s"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, disable=not (enabled and console.is_terminal)) as bar:
        task = bar.add_task("prepare", documents=0, tokens=0, rate=0.0)
        started = time.perf_counter()

        def update(documents: int, tokens: int) -> None:
            rate = tokens / max(time.perf_counter() - started, 1e-9)
            bar.update(task, documents=documents, tokens=tokens, rate=rate)

        yield update


def _write_documents(
    writer: IndexedCorpusWriter, encoded: Iterable[tuple[np.ndarray, np.ndarray]], update: Callable[[int, int], None]
) -> int:
    """Adds every document with tokens to ``writer``; returns how many had none (skipped)."""
    skipped = 0
    for ids, lengths in encoded:
        ends = np.cumsum(lengths)
        for end, length in zip(ends.tolist(), lengths.tolist()):
            if length:
                writer.add_document(ids[end - length : end])
            else:
                skipped += 1
        update(writer.num_documents, writer.num_tokens)
    return skipped


def _check_run_options(output: str | os.PathLike, workers: int, batch_size: int) -> None:
    for name, value in (("workers", workers), ("batch_size", batch_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r}: must be a whole number >= 1")
    if not str(output) or Path(output).expanduser().is_dir():
        raise ValueError(
            f"output={str(output)!r} is a folder or empty: it is a prefix, the files are <prefix>.bin and"
            " <prefix>.idx; pass output=<folder>/<name>"
        )


def prepare(
    input: str | os.PathLike | Sequence[str | os.PathLike],
    tokenizer: str | os.PathLike,
    output: str | os.PathLike,
    *,
    workers: int = 1,
    text_key: str = "text",
    lines: bool = False,
    append_eos: bool = True,
    eos_token: str | None = None,
    batch_size: int = 1000,
    progress: bool = True,
) -> dict[str, Any]:
    """Tokenize ``input`` with ``tokenizer`` into ``<output>.bin`` + ``<output>.idx`` (+ ``<output>.json``).

    The options are those of the command line (see the module docstring and :class:`PrepareConfig`).
    Inputs, tokenizer and EOS are checked before anything is written; an error or interrupt later
    leaves no new pair (an older one stays as it was, or without its ``.idx``).

    Returns:
        The summary: ``documents`` and ``tokens`` written, ``skipped_empty`` (records without
        tokens), ``files`` (inputs read), ``seconds``, ``dtype`` and ``paths`` (.bin, .idx, .json).

    Example:
        >>> prepare("data/*.jsonl", "my_tokenizer/", "prepared/corpus", workers=4)  # doctest: +SKIP
        {'documents': 1000, 'tokens': 251234, 'skipped_empty': 2, 'files': 3, 'seconds': 1.8, ...}
    """
    started = time.perf_counter()
    _check_run_options(output, workers, batch_size)
    sources = resolve_inputs(input)
    _check_columns(sources, text_key)
    spec, vocab_size, loaded = _resolve_tokenizer(tokenizer, append_eos=append_eos, eos_token=eos_token)
    prefix = Path(output).expanduser()
    with ExitStack() as stack:
        # Order matters: workers start before the output file is opened and before the progress thread.
        runner = stack.enter_context(_tokenizing(spec, workers, loaded))
        writer = stack.enter_context(IndexedCorpusWriter(prefix, vocab_size=vocab_size))
        update = stack.enter_context(_progress(progress))
        texts = read_texts(sources, text_key=text_key, lines=lines, rows=batch_size)
        encoded = stack.enter_context(closing(runner.map(_batches(texts, batch_size))))
        skipped = _write_documents(writer, encoded, update)
        if writer.num_documents == 0:
            raise ValueError(
                f"no record of the {len(sources)} input(s) has any tokens ({skipped} empty); nothing written"
            )
        writer.close(
            metadata={
                "tokenizer": spec.tokenizer,
                "vocab_size": vocab_size,
                "eos_id": spec.eos_id,
                "skipped_empty": skipped,
                "text_key": text_key,
                "lines": lines,
                "inputs": [str(source.path.absolute()) for source in sources],
            }
        )
    return {
        "documents": writer.num_documents,
        "tokens": writer.num_tokens,
        "skipped_empty": skipped,
        "files": len(sources),
        "seconds": round(time.perf_counter() - started, 3),
        "dtype": str(writer.dtype),
        "paths": [str(writer.bin_path), str(writer.idx_path), str(writer.bin_path.with_suffix(".json"))],
    }


def format_summary(summary: dict[str, Any]) -> str:
    """The one line the command prints when done."""
    return (
        f"prepared {summary['documents']:,} documents, {summary['tokens']:,} tokens ({summary['dtype']}),"
        f" {summary['skipped_empty']:,} empty skipped, from {summary['files']} input(s) in {summary['seconds']:.1f} s"
        f" -> {', '.join(summary['paths'])}"
    )


# --- command line ----------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: returns the exit status (0 done, 1 refused input, 2 bad options, 130 interrupted)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(arg in ("-h", "--help") for arg in argv):
        print(usage())
        return 0
    try:
        config = parse_args(argv)
    except ValueError as err:
        print(f"prepare: {err}\n(python -m lightning_moe.data.prepare --help lists the options)", file=sys.stderr)
        return 2
    try:
        summary = prepare(**{name: getattr(config, name) for name in _OPTIONS})
    except (FileNotFoundError, ValueError) as err:
        print(f"prepare: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            "prepare: interrupted; nothing was written (an older output is as it was, or without its .idx)",
            file=sys.stderr,
        )
        return 130
    print(format_summary(summary))
    return 0


def _terminate(signum: int, frame: Any) -> None:
    # SIGTERM (a scheduler's kill) unwinds like Ctrl-C, so the writer aborts and removes its temporary files.
    raise KeyboardInterrupt


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _terminate)
    sys.exit(main())

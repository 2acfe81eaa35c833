"""Byte-level text data built from files already on the machine (no download).

The corpus is a flat uint8 file (`.bin`): by default the Python standard library's sources, or
any folder of text files, concatenated in sorted path order and cached under a name that
encodes what built it. Samples are non-overlapping windows of `seq_len + 1` bytes; the last
`val_fraction` of the windows is the validation split.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import sysconfig
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_moe.data.module import LayoutInvariantDataModule, next_token_sample

__all__ = [
    "ByteTextDataModule",
    "ByteWindowDataset",
    "build_corpus",
    "default_cache_dir",
    "stdlib_source_files",
]

CACHE_ENV = "LIGHTNING_MOE_CACHE"
# Directories of the stdlib tree that are not the library itself (third-party packages, the test
# suite) or whose contents depend on how this particular interpreter was built.
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def default_cache_dir() -> Path:
    """`$LIGHTNING_MOE_CACHE` if set, else `~/.cache/lightning_moe`."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lightning_moe"


def stdlib_source_files() -> list[Path]:
    """The standard library's `*.py` files in sorted relative-path order (the default corpus).

    Third-party packages, the test suite and build-specific files (`_sysconfigdata*`,
    `config-*`) are left out so that the same Python version gives the same bytes everywhere.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS and not d.startswith(("config-", "."))]
        files += [Path(dirpath, f) for f in filenames if f.endswith(".py") and not f.startswith("_sysconfigdata")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _folder_files(folder: Path) -> list[Path]:
    """Every regular file under `folder` except hidden ones (`.git`...), sorted by relative path."""
    files = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        files += [Path(dirpath, f) for f in filenames if not f.startswith(".")]
    files = [f for f in files if f.is_file()]
    return sorted(files, key=lambda p: p.relative_to(folder).as_posix())


def _take_up_to(files: list[Path], max_bytes: int) -> list[tuple[Path, int]]:
    """The leading files (with sizes) whose bytes reach `max_bytes`; only these enter the corpus."""
    taken, total = [], 0
    for f in files:
        if total >= max_bytes:
            break
        size = f.stat().st_size
        taken.append((f, size))
        total += size
    return taken


def _write_atomically(out: Path, files: list[tuple[Path, int]], max_bytes: int) -> None:
    """Concatenate `files` (capped at `max_bytes`) into `out` through a private temporary file.

    Several ranks may build the same corpus at once: each writes its own temporary file and
    `os.replace` makes the final name appear complete, whichever rank finishes last.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as fh:
            remaining = max_bytes
            for f, _ in files:
                chunk = f.read_bytes()[:remaining]
                fh.write(chunk)
                remaining -= len(chunk)
                if remaining <= 0:
                    break
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def build_corpus(
    path: str | os.PathLike | None = None,
    *,
    max_bytes: int = 4_000_000,
    cache_dir: str | os.PathLike | None = None,
) -> Path:
    """Return a uint8 `.bin` corpus file, building and caching it when needed.

    - `path=None`: the standard library's sources (`stdlib_source_files()`), capped at `max_bytes`.
    - `path=` a folder: its files (recursive, sorted by relative path), capped at `max_bytes`.
    - `path=` a `.bin` file: used as is (one token per byte).

    The cache name encodes the source, the cap and a digest of the files used (relative paths and
    sizes, plus modification times for a user folder), so a changed folder gets a new file.

    >>> corpus = build_corpus(max_bytes=100_000)  # doctest: +SKIP
    >>> corpus.stat().st_size
    100000
    """
    if max_bytes < 1:
        raise ValueError(f"max_corpus_bytes must be >= 1, got {max_bytes}")
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if path is None:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        files = _take_up_to(stdlib_source_files(), max_bytes)
        version = ".".join(map(str, sys.version_info[:3]))
        label = f"stdlib-py{version}"
        key = [(f.relative_to(stdlib).as_posix(), size) for f, size in files]
    else:
        source = Path(path).expanduser()
        if not source.exists():
            raise ValueError(
                f"path={str(path)!r} does not exist: pass a folder of text files, a .bin file "
                "of uint8 tokens, or path=None for the default standard-library corpus"
            )
        if source.is_file():
            if source.suffix != ".bin":
                raise ValueError(
                    f"path={str(path)!r} is a file but not a .bin token file: pass a .bin file "
                    "of uint8 tokens, or the folder that holds your text files"
                )
            return source
        files = _take_up_to(_folder_files(source), max_bytes)
        if sum(size for _, size in files) == 0:
            raise ValueError(
                f"path={str(path)!r} is an empty data folder (no non-empty files): put text "
                "files in it, or pass path=None for the default standard-library corpus"
            )
        label = "dir-" + (re.sub(r"[^A-Za-z0-9_.-]", "_", source.resolve().name) or "root")
        key = [str(source.resolve())] + [
            (f.relative_to(source).as_posix(), size, f.stat().st_mtime_ns) for f, size in files
        ]
    digest = hashlib.sha256(repr(key).encode()).hexdigest()[:16]
    out = cache / f"{label}-{max_bytes}-{digest}.bin"
    if not out.exists():
        _write_atomically(out, files, max_bytes)
    return out


class ByteWindowDataset(Dataset):
    """Windows `[first_window, first_window + num_windows)` of `seq_len + 1` bytes of a `.bin`.

    Item `i` is `{"input_ids": window[:-1], "labels": window[1:]}` (int64, shape `[seq_len]`) and
    `"sample_index"`: the window's index in the corpus, `first_window + i` (int64 scalar; batches
    carry it as `[B]`): a key of the sample on every layout (routing record/replay).
    The memmap is opened lazily so that the dataset pickles cheaply into worker processes.

    Example:
        >>> ds = ByteWindowDataset(build_corpus(), seq_len=128)  # doctest: +SKIP
        >>> ds[0]["input_ids"].shape
        torch.Size([128])
    """

    def __init__(
        self,
        corpus: str | os.PathLike,
        seq_len: int,
        first_window: int = 0,
        num_windows: int | None = None,
    ) -> None:
        self.corpus = Path(corpus)
        self.seq_len = seq_len
        total = self._num_tokens() // (seq_len + 1)
        self.first_window = first_window
        self.num_windows = total - first_window if num_windows is None else num_windows
        if first_window < 0 or self.num_windows < 0 or first_window + self.num_windows > total:
            raise ValueError(
                f"windows [{first_window}, {first_window + self.num_windows}) out of range: "
                f"{self.corpus} holds {total} windows of seq_len+1 = {seq_len + 1} bytes"
            )
        self._tokens: np.ndarray | None = None

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_windows:
            raise IndexError(f"window {index} out of range [0, {self.num_windows})")
        if self._tokens is None:
            self._tokens = self._open_tokens()
        start = (self.first_window + index) * (self.seq_len + 1)
        window = torch.from_numpy(self._tokens[start : start + self.seq_len + 1].astype(np.int64))
        return next_token_sample(window, self.first_window + index)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tokens": None}

    def _num_tokens(self) -> int:
        return self.corpus.stat().st_size  # one byte per token

    def _open_tokens(self) -> np.ndarray:
        return np.memmap(self.corpus, dtype=np.uint8, mode="r")


class ByteTextDataModule(LayoutInvariantDataModule):
    """Byte-level language-modelling data whose optimizer steps do not depend on the layout.

    Args:
        path: None (the standard library's sources), a folder of text files, or a uint8 `.bin`.
        seq_len: tokens per sample; a sample is a window of `seq_len + 1` bytes.
        global_batch_size: samples per optimizer step, summed over data-parallel ranks and
            micro-batches.
        micro_batch_size: samples per forward/backward on one rank; None means 2 (1 for an odd
            `global_batch_size`) on every layout, so that the losses do not depend on the layout
            (see `default_micro_batch_size`).
        max_corpus_bytes: cap on the bytes read from the default corpus or a folder.
        val_fraction: fraction of the windows (the corpus tail) used for validation.
        cache_dir: where built corpora are cached (default `$LIGHTNING_MOE_CACHE` or
            `~/.cache/lightning_moe`).
        seed: seed of the per-epoch permutation (`seed + epoch`).
        num_workers: DataLoader workers.

    The loaders are :class:`~lightning_moe.data.module.LayoutInvariantDataModule`'s: the same samples
    per optimizer step on every layout, resumable mid-epoch.

    Example:
        >>> dm = ByteTextDataModule(seq_len=128, global_batch_size=16, micro_batch_size=4)
        >>> trainer = lightning.Trainer(max_steps=60)  # doctest: +SKIP
        >>> trainer.fit(MoEGPT(), datamodule=dm)  # 4 micro-batches accumulated per step # doctest: +SKIP
    """

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        seq_len: int = 128,
        global_batch_size: int = 16,
        micro_batch_size: int | None = None,
        max_corpus_bytes: int = 4_000_000,
        val_fraction: float = 0.05,
        cache_dir: str | os.PathLike | None = None,
        seed: int = 1234,
        num_workers: int = 0,
    ) -> None:
        super().__init__(global_batch_size, micro_batch_size, seed, num_workers)
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        self.save_hyperparameters()
        self.path = path
        self.seq_len = seq_len
        self.max_corpus_bytes = max_corpus_bytes
        self.val_fraction = val_fraction
        self.cache_dir = cache_dir
        self.corpus: Path | None = None

    def prepare_data(self) -> None:
        build_corpus(self.path, max_bytes=self.max_corpus_bytes, cache_dir=self.cache_dir)

    def build_datasets(self) -> None:
        # Every rank builds (or finds) the corpus: the build is atomic, so racing is harmless.
        self.corpus = build_corpus(self.path, max_bytes=self.max_corpus_bytes, cache_dir=self.cache_dir)
        corpus_bytes = self.corpus.stat().st_size
        if corpus_bytes < self.seq_len + 1:
            raise ValueError(
                f"seq_len {self.seq_len} is longer than the corpus ({corpus_bytes} bytes at "
                f"{self.corpus}): lower seq_len, raise max_corpus_bytes or use a larger path"
            )
        num_train, num_val = self._split_windows(corpus_bytes, f"the corpus ({corpus_bytes} bytes)", "bytes")
        self.train_dataset = ByteWindowDataset(self.corpus, self.seq_len, 0, num_train)
        self.val_dataset = ByteWindowDataset(self.corpus, self.seq_len, num_train, num_val)

    def _split_windows(self, units: int, corpus: str, unit: str) -> tuple[int, int]:
        """``(train, validation)`` windows of ``seq_len + 1`` of the corpus's ``units`` (bytes or tokens),
        the validation windows last; ``ValueError`` naming the fix when either cannot fill a global batch."""
        windows = units // (self.seq_len + 1)
        num_val = round(windows * self.val_fraction)
        num_train = windows - num_val
        if num_train < self.global_batch_size or 0 < num_val < self.global_batch_size:
            raise ValueError(
                f"too few windows for one global batch: {corpus} gives {num_train} train and {num_val} validation"
                f" windows of seq_len+1 = {self.seq_len + 1} {unit}, but global_batch_size is {self.global_batch_size}:"
                " lower seq_len or global_batch_size, raise max_corpus_bytes or use a larger path"
            )
        return num_train, num_val

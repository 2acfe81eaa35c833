"""LitdataTokens against directories written by litdata's own optimize, read back by litdata's own StreamingDataset."""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import os
import pickle
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")  # no PyPI query from optimize
litdata = pytest.importorskip("litdata")
from litdata.streaming.item_loader import TokensLoader  # noqa: E402

from lightning_moe.data.litdata_tokens import LitdataTokens, is_litdata_directory  # noqa: E402

CHUNK_TOKENS = 150  # TokensLoader counts chunk_size in tokens: 60 documents of 1..59 tokens make about a dozen chunks
BLOCK = 16
FIX = re.escape("re-optimize with item_loader=TokensLoader()")


def _path(path) -> str:
    """A path as a regular expression (pytest's tmp paths hold test names)."""
    return re.escape(str(path))


def _identity(item):
    """optimize's fn: the inputs are already the items (module level, as its workers need)."""
    return item


def _optimize(output_dir: Path, items: list, **kwargs) -> Path:
    """litdata.optimize in one forked worker, items kept in order, quietly. Its scratch folders (which it
    empties, by default /tmp/chunks and /tmp/data) are private to the call; the start method it sets and
    the environment are restored after."""
    previous, environment = multiprocessing.get_start_method(allow_none=True), dict(os.environ)
    kwargs = {"item_loader": TokensLoader(), "chunk_size": CHUNK_TOKENS, **kwargs}
    scratch = output_dir.with_name(output_dir.name + "-scratch")
    os.environ["DATA_OPTIMIZER_CACHE_FOLDER"] = str(scratch / "chunks")
    os.environ["DATA_OPTIMIZER_DATA_CACHE_FOLDER"] = str(scratch / "data")
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            litdata.optimize(
                fn=_identity,
                inputs=items,
                output_dir=str(output_dir),
                num_workers=1,
                start_method="fork",
                keep_data_ordered=True,
                verbose=False,
                **kwargs,
            )
    finally:
        multiprocessing.set_start_method(previous, force=True)
        os.environ.clear()
        os.environ.update(environment)
    return output_dir


def _documents(seed: int, high: int, count: int = 60) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, high, size=int(rng.integers(1, 60))) for _ in range(count)]


# (id, how an item is made from int64 ids, the dtype expected back, the id range)
FORMATS = [
    ("torch.int16", lambda ids: torch.from_numpy(ids.astype(np.int16)), np.int16, 32768),
    ("torch.int32", lambda ids: torch.from_numpy(ids.astype(np.int32)), np.int32, 200_000),
    ("torch.int64", lambda ids: torch.from_numpy(ids), np.int64, 2**40),
    ("torch.uint16", lambda ids: torch.from_numpy(ids.astype(np.uint16)), np.uint16, 65536),
    ("numpy.uint16", lambda ids: ids.astype(np.uint16), np.uint16, 65536),
    ("numpy.int32", lambda ids: ids.astype(np.int32), np.int32, 200_000),
]


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, tuple[Path, list[np.ndarray], np.dtype]]:
    root = tmp_path_factory.mktemp("litdata")
    out = {}
    for seed, (name, make, dtype, high) in enumerate(FORMATS):
        documents = [ids.astype(dtype) for ids in _documents(seed, high)]
        if high == 65536:
            documents[3][0] = 65535  # the top of the uint16 range survives
        out[name] = (_optimize(root / name, [make(ids) for ids in documents]), documents, np.dtype(dtype))
    return out


@pytest.fixture()
def good_copy(written, tmp_path) -> Path:
    """A private copy of one good directory, for breaking."""
    return Path(shutil.copytree(written["torch.int32"][0], tmp_path / "copy"))


@pytest.mark.parametrize("name", [f[0] for f in FORMATS])
def test_documents_and_stream_match_what_was_optimized(written, name):
    directory, documents, dtype = written[name]
    corpus = LitdataTokens(directory)
    flat = np.concatenate(documents)
    assert len(corpus.chunk_paths) >= 3, "the test needs several chunks"
    assert corpus.dtype == dtype and corpus.prefix == str(directory)
    assert len(corpus) == corpus.num_documents == len(documents)
    assert corpus.num_tokens == len(flat)
    assert corpus.document_offsets.dtype == np.int64 and corpus.document_offsets[0] == 0
    assert np.array_equal(np.diff(corpus.document_offsets), [len(d) for d in documents])
    assert not corpus._maps, "nothing is mapped before the first read"
    for i, expected in enumerate(documents):
        got = corpus.document(i)
        assert got.dtype == dtype and np.array_equal(got, expected), i
    assert isinstance(corpus.document(0), np.memmap), "a document is a view of its chunk's map"
    assert np.array_equal(corpus.document(-1), documents[-1])
    with pytest.raises(IndexError, match=_path(directory)):
        corpus.document(len(documents))
    # every chunk boundary, crossed from a few tokens before to a few after, and whole-stream reads
    for boundary in corpus.chunk_offsets[1:-1]:
        for before, after in [(1, 1), (7, 40), (0, 3), (3, 0)]:
            start, stop = int(boundary) - before, int(boundary) + after
            assert np.array_equal(corpus.read(start, stop), flat[start:stop]), (start, stop)
    assert np.array_equal(
        corpus.read(corpus.chunk_offsets[1] - 5, corpus.chunk_offsets[3] + 5),
        flat[corpus.chunk_offsets[1] - 5 : corpus.chunk_offsets[3] + 5],
    )
    assert np.array_equal(corpus.read(0, corpus.num_tokens), flat)
    assert corpus.read(5, 5).size == 0 and corpus.read(0, 10**9).size == len(flat)
    assert corpus.max_token_id() == int(flat.max()) and corpus._max_token_id == int(flat.max())
    assert corpus.metadata["documents"] == len(documents) and corpus.metadata["item_loader"] == "TokensLoader"


@pytest.mark.filterwarnings("ignore:The given buffer is not writable")  # inside litdata's TokensLoader
@pytest.mark.parametrize("name", [f[0] for f in FORMATS])
def test_blocks_equal_litdata_streaming_dataset(written, name):
    """litdata itself is the reference: StreamingDataset(TokensLoader(block_size=B)) serves, chunk by chunk,
    the blocks of B tokens from each chunk's first token (a chunk's tail shorter than B is skipped), which must
    be the same slices of our flat stream."""
    directory, _, _ = written[name]
    corpus = LitdataTokens(directory)
    expected = [
        corpus.read(start, start + BLOCK)
        for first, last in zip(corpus.chunk_offsets[:-1], corpus.chunk_offsets[1:])
        for start in range(int(first), int(last) - BLOCK + 1, BLOCK)
    ]
    dataset = litdata.StreamingDataset(str(directory), item_loader=TokensLoader(block_size=BLOCK), shuffle=False)
    blocks = [np.asarray(block) for block in dataset]
    assert len(blocks) == len(dataset) == len(expected)
    for i, (ours, theirs) in enumerate(zip(expected, blocks)):
        assert theirs.dtype == corpus.dtype and np.array_equal(ours, theirs), i


def test_empty_documents_keep_their_place(tmp_path):
    """Empty items are documents too; litdata leaves a chunk's "dim" None when its first item is empty."""
    documents = [ids.astype(np.int32) for ids in _documents(7, 1000, 30)]
    for i in (0, 5, 6, 29):
        documents[i] = documents[i][:0]
    directory = _optimize(tmp_path / "empty", [torch.from_numpy(ids) for ids in documents], chunk_size=60)
    assert any(chunk["dim"] is None for chunk in json.loads((directory / "index.json").read_text())["chunks"])
    corpus = LitdataTokens(directory)
    assert corpus.num_documents == len(documents) and corpus.num_tokens == sum(map(len, documents))
    assert all(np.array_equal(corpus.document(i), ids) for i, ids in enumerate(documents))
    assert np.array_equal(corpus.read(0, corpus.num_tokens), np.concatenate(documents))


def test_pickles_cheaply_and_reopens_lazily(written):
    directory, documents, _ = written["torch.int32"]
    corpus = LitdataTokens(directory)
    corpus.max_token_id()
    assert corpus._maps
    payload = pickle.dumps(corpus)
    assert len(payload) < 500, "only the path (and the cached max id) travel"
    clone = pickle.loads(payload)
    assert not clone._maps and clone._max_token_id == corpus._max_token_id
    assert clone.num_documents == corpus.num_documents
    assert np.array_equal(clone.document_offsets, corpus.document_offsets)
    assert np.array_equal(clone.document(7), documents[7])


def test_open_maps_are_bounded(written):
    directory, documents, _ = written["torch.int16"]
    corpus = LitdataTokens(directory)
    corpus.MAX_OPEN_CHUNKS = 2
    held = [corpus.document(i) for i in range(len(documents))]
    assert len(corpus._maps) <= 2
    assert all(np.array_equal(a, b) for a, b in zip(held, documents)), "dropped maps stay valid for their views"


def test_index_json_path_and_detection(written, tmp_path):
    directory = written["torch.int32"][0]
    assert LitdataTokens(directory / "index.json").num_documents == LitdataTokens(directory).num_documents
    assert is_litdata_directory(directory) and is_litdata_directory(str(directory))
    assert not is_litdata_directory(tmp_path / "missing")
    assert not is_litdata_directory(tmp_path)
    (tmp_path / "index.json").write_text("not json")
    assert not is_litdata_directory(tmp_path)
    (tmp_path / "index.json").write_text(json.dumps({"shards": [], "version": 2}))  # MosaicML's MDS, not litdata's
    assert not is_litdata_directory(tmp_path)


# --- refused inputs: each names the path and the fix ---


def test_missing_directory_and_index(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=_path(missing) + r": no such directory.*TokensLoader\(\)"):
        LitdataTokens(missing)
    with pytest.raises(FileNotFoundError, match=_path(tmp_path / "index.json") + r": no such file.*litdata\.optimize"):
        LitdataTokens(tmp_path)
    (tmp_path / "index.json").write_text("{broken")
    with pytest.raises(ValueError, match=_path(tmp_path / "index.json") + ": not a litdata index"):
        LitdataTokens(tmp_path)


def test_other_item_loader_is_refused(tmp_path):
    directory = _optimize(tmp_path / "pytree", [torch.arange(5, dtype=torch.int32)] * 4, item_loader=None, chunk_size=2)
    assert is_litdata_directory(directory)
    with pytest.raises(ValueError, match=_path(directory / "index.json") + r": .*PyTreeLoader.*" + FIX):
        LitdataTokens(directory)


@pytest.mark.parametrize(
    ("items", "what"),
    [
        ([torch.rand(5) for _ in range(4)], "float32"),  # 1-D, but not integer ids
        ([np.ones(5, dtype=np.float64) for _ in range(4)], "float64"),
        ([torch.ones(2, 3, dtype=torch.int32) for _ in range(4)], "not a 1-D tensor"),
    ],
    ids=["torch-float", "numpy-float", "2-d"],
)
def test_items_that_are_not_token_ids_are_refused(tmp_path, items, what):
    directory = _optimize(tmp_path / "bad", items)
    with pytest.raises(ValueError, match=_path(directory / "index.json") + f": .*{what}.*" + FIX):
        LitdataTokens(directory)


def _edit_index(directory: Path, edit) -> Path:
    index_path = directory / "index.json"
    index = json.loads(index_path.read_text())
    edit(index)
    index_path.write_text(json.dumps(index))
    return index_path


def test_several_items_per_sample_are_refused(good_copy):
    index_path = _edit_index(good_copy, lambda index: index["config"].update(data_format=["no_header_tensor:16"] * 2))
    pattern = _path(index_path) + r": data_format .* not a single 1-D integer tensor.*" + FIX
    with pytest.raises(ValueError, match=pattern):
        LitdataTokens(good_copy)


def test_compressed_chunks_are_refused(good_copy):
    # What optimize(compression="zstd") writes (litdata here has no zstd installed to write it for real).
    def compress(index):
        index["config"]["compression"] = "zstd"
        for chunk in index["chunks"]:
            name = chunk["filename"].replace(".bin", ".zstd.bin")
            os.replace(good_copy / chunk["filename"], good_copy / name)
            chunk["filename"] = name

    index_path = _edit_index(good_copy, compress)
    pattern = _path(index_path) + ": its chunks are compressed.*re-optimize without compression="
    with pytest.raises(ValueError, match=pattern):
        LitdataTokens(good_copy)


def test_encrypted_chunks_are_refused(good_copy):
    encryption = {"algorithm": "fernet", "level": "chunk"}  # what optimize(encryption=FernetEncryption(...)) records
    index_path = _edit_index(good_copy, lambda index: index["config"].update(encryption=encryption))
    pattern = _path(index_path) + ": its chunks are encrypted.*re-optimize without encryption="
    with pytest.raises(ValueError, match=pattern):
        LitdataTokens(good_copy)


def test_missing_chunk_is_refused(good_copy):
    chunk = sorted(good_copy.glob("chunk-*.bin"))[1]
    chunk.unlink()
    with pytest.raises(FileNotFoundError, match=_path(chunk) + r": no such file.*index\.json lists it.*re-optimize"):
        LitdataTokens(good_copy)


@pytest.mark.parametrize("keep", ["most", "part_of_header"])
def test_truncated_chunk_is_refused(good_copy, keep):
    chunk = sorted(good_copy.glob("chunk-*.bin"))[2]
    data = chunk.read_bytes()
    chunk.write_bytes(data[: len(data) - 3] if keep == "most" else data[:6])
    size = len(data) - 3 if keep == "most" else 6
    with pytest.raises(ValueError, match=_path(chunk) + f": {size} bytes, shorter than .*truncated"):
        LitdataTokens(good_copy)

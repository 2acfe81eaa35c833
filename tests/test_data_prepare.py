"""python -m lightning_moe.data.prepare: local corpora (JSON lines, gzip, Parquet, text, saved datasets,
folders, globs) tokenized into Megatron's indexed format, read back token for token (here and by
megatron-core), the same for any number of workers, bad input refused before the output exists, and
an interrupted prepare leaving no pair that reads as complete."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")

from lightning_moe.data import prepare as prepare_module  # noqa: E402
from lightning_moe.data.indexed import IndexedCorpusWriter, IndexedTokens  # noqa: E402
from lightning_moe.data.prepare import main, parse_args, prepare  # noqa: E402

EOS = "<|endoftext|>"
TRAIN_TEXT = "\n".join(
    f"def step_{i}(x):\n    return x * {i}  # the quick brown fox, naïve café {i}\n" for i in range(200)
)
DOCS = [
    "The quick brown fox jumps over the lazy dog.",
    "",
    "def f(x):\n    return x * 2\r\n",
    "naïve café — ünïcödé ✓",
    "  spaced  out  ",
]
MORE_DOCS = ["second file, first record", "second file, second record"]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    """A byte-level BPE (vocab 300) with EOS as a special token, and a tokenizer_config.json naming it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[EOS], show_progress=False
    )
    tok.train_from_iterator(TRAIN_TEXT.splitlines(keepends=True), trainer=trainer)
    folder = tmp_path_factory.mktemp("tok")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": EOS, "special": True}}))
    return folder


@pytest.fixture(scope="module")
def tok(tok_dir):
    return tokenizers.Tokenizer.from_file(str(tok_dir / "tokenizer.json"))


def expected(tok, texts: list[str]) -> list[list[int]]:
    """The tokenizer's own encoding of each text with tokens, then EOS."""
    eos = tok.token_to_id(EOS)
    return [tok.encode(text, add_special_tokens=False).ids + [eos] for text in texts if text]


def read_back(prefix: Path) -> list[list[int]]:
    corpus = IndexedTokens(prefix)
    return [corpus.document(i).tolist() for i in range(len(corpus))]


def write_jsonl(path: Path, texts: list[str | None], key: str = "text") -> Path:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as handle:
        for i, text in enumerate(texts):
            handle.write(json.dumps({"id": i, key: text}) + "\n")
        handle.write("\n")  # a trailing blank line is no record
    return path


def test_jsonl_and_gz_metadata_and_summary(tmp_path, tok_dir, tok):
    a = write_jsonl(tmp_path / "a.jsonl", DOCS)
    b = write_jsonl(tmp_path / "b.jsonl.gz", [*MORE_DOCS, None])  # a null text is an empty document
    summary = prepare([a, b], tok_dir, tmp_path / "out" / "corpus", progress=False)
    assert read_back(tmp_path / "out" / "corpus") == expected(tok, DOCS + MORE_DOCS)
    assert (summary["documents"], summary["skipped_empty"], summary["files"], summary["dtype"]) == (6, 2, 2, "uint16")
    assert summary["tokens"] == sum(map(len, expected(tok, DOCS + MORE_DOCS)))
    metadata = IndexedTokens(tmp_path / "out" / "corpus").metadata
    assert metadata["tokenizer"] == str(tok_dir.absolute()) and metadata["vocab_size"] == tok.get_vocab_size()
    assert metadata["eos_id"] == tok.token_to_id(EOS) and metadata["skipped_empty"] == 2
    assert metadata["inputs"] == [str(a.absolute()), str(b.absolute())]
    line = prepare_module.format_summary(summary)
    assert "6 documents" in line and "2 empty skipped" in line and str(tmp_path / "out" / "corpus.idx") in line


def test_parquet_in_record_batches(tmp_path, tok_dir, tok):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    texts = DOCS + MORE_DOCS
    table = pa.table({"id": list(range(len(texts))), "content": texts})
    pq.write_table(table, tmp_path / "c.parquet", row_group_size=3)
    # batch_size=2: several record batches per row group, several batches per file.
    prepare(tmp_path / "c.parquet", tok_dir, tmp_path / "pq", text_key="content", batch_size=2, progress=False)
    assert read_back(tmp_path / "pq") == expected(tok, texts)


def test_text_files_per_file_and_per_line(tmp_path, tok_dir, tok):
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text("second file\n\nits second paragraph\n")
    (folder / "sub" / "a.md").write_text("# heading\r\n   \r\nbody line\r\n")
    (folder / "notes.csv").write_text("not,read\n")  # other types and hidden files are skipped in a folder
    (folder / ".hidden.txt").write_text("not read either\n")
    prepare(folder, tok_dir, tmp_path / "per_file", progress=False)
    files = [folder / "b.txt", folder / "sub" / "a.md"]  # by relative path: "b.txt" < "sub/a.md"
    assert read_back(tmp_path / "per_file") == expected(tok, [f.read_bytes().decode() for f in files])
    summary = prepare(folder, tok_dir, tmp_path / "per_line", lines=True, progress=False)
    lines = ["second file", "its second paragraph", "# heading", "body line"]  # blank lines are separators
    assert read_back(tmp_path / "per_line") == expected(tok, lines) and summary["skipped_empty"] == 0


def test_saved_dataset_folder(tmp_path, tok_dir, tok, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    datasets = pytest.importorskip("datasets")
    texts = [f"record {i}: " + DOCS[i % len(DOCS)] for i in range(40)] + [""]
    # Two shards: read in the order state.json lists them.
    datasets.Dataset.from_dict({"text": texts, "n": list(range(len(texts)))}).save_to_disk(
        tmp_path / "ds", num_shards=2
    )
    assert len(list((tmp_path / "ds").glob("*.arrow"))) == 2
    summary = prepare(tmp_path / "ds", tok_dir, tmp_path / "ds_out", progress=False)
    assert read_back(tmp_path / "ds_out") == expected(tok, texts) and summary["skipped_empty"] == 1
    assert "datasets" not in prepare_module.__dict__  # read with pyarrow alone


def test_glob_and_mixed_folder(tmp_path, tok_dir, tok):
    data = tmp_path / "data"
    (data / "z").mkdir(parents=True)
    write_jsonl(data / "2.jsonl", MORE_DOCS)
    write_jsonl(data / "1.jsonl", DOCS)
    (data / "z" / "0.txt").write_text("a text file, deepest but last")
    prepare(str(data / "*.jsonl"), tok_dir, tmp_path / "globbed", progress=False)
    assert read_back(tmp_path / "globbed") == expected(tok, DOCS + MORE_DOCS)  # glob matches sorted
    prepare(data, tok_dir, tmp_path / "folder", progress=False)
    assert read_back(tmp_path / "folder") == expected(tok, DOCS + MORE_DOCS + ["a text file, deepest but last"])


def test_workers_give_identical_output(tmp_path, tok_dir):
    texts = [DOCS[i % len(DOCS)] * (i % 4) for i in range(300)]  # every fourth one empty
    source = write_jsonl(tmp_path / "many.jsonl", texts)
    one = prepare(source, tok_dir, tmp_path / "w1", workers=1, batch_size=7, progress=False)
    two = prepare(source, tok_dir, tmp_path / "w2", workers=2, batch_size=7, progress=False)
    for suffix in (".bin", ".idx", ".json"):
        assert (tmp_path / f"w1{suffix}").read_bytes() == (tmp_path / f"w2{suffix}").read_bytes()
    assert one["documents"] == two["documents"] > 150 and one["skipped_empty"] == two["skipped_empty"] > 0


def test_reading_keeps_pace_with_writing(tmp_path, tok_dir, monkeypatch):
    """workers=2: at most 2 * workers batches in flight, so the reader never runs ahead of the writer by more."""
    state = {"read": 0, "lead": 0}

    def counted(source, **_):
        for i in range(400):
            state["read"] += 1
            yield f"record {i}"

    @contextmanager
    def watching(enabled):
        def update(documents, tokens):
            state["lead"] = max(state["lead"], state["read"] - documents)

        yield update

    monkeypatch.setitem(prepare_module._READERS, "jsonl", counted)
    monkeypatch.setattr(prepare_module, "_progress", watching)
    summary = prepare(write_jsonl(tmp_path / "a.jsonl", ["x"]), tok_dir, tmp_path / "pace", workers=2, batch_size=5)
    assert summary["documents"] == state["read"] == 400
    assert 0 < state["lead"] <= 2 * 2 * 5


def test_bytes_tokenizer(tmp_path):
    source = write_jsonl(tmp_path / "a.jsonl", DOCS)
    with pytest.raises(ValueError, match="append_eos=false"):
        prepare(source, "bytes", tmp_path / "out" / "bytes", progress=False)
    assert not (tmp_path / "out").exists()
    summary = prepare(source, "bytes", tmp_path / "bytes", append_eos=False, progress=False)
    assert read_back(tmp_path / "bytes") == [list(text.encode("utf-8")) for text in DOCS if text]
    assert summary["dtype"] == "uint16" and IndexedTokens(tmp_path / "bytes").metadata["eos_id"] is None


def test_large_vocab_is_int32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    source = write_jsonl(tmp_path / "a.jsonl", ["w1 w69998 w65536", "w7"])
    summary = prepare(source, tmp_path / "tokenizer.json", tmp_path / "big", eos_token="w69999", progress=False)
    assert summary["dtype"] == "int32" and IndexedTokens(tmp_path / "big").dtype == np.int32
    assert read_back(tmp_path / "big") == [[1, 69998, 65536, 69999], [7, 69999]]


def _assert_no_new_pair(folder: Path, name: str) -> None:
    assert not (folder / f"{name}.idx").exists() and not (folder / f"{name}.bin").exists()
    assert not list(folder.glob(f"{name}.*tmp*")), "temporary files left behind"


@pytest.mark.parametrize("workers", [1, 2])
def test_error_mid_stream_writes_nothing(tmp_path, tok_dir, workers):
    good = write_jsonl(tmp_path / "a.jsonl", [f"record {i}" for i in range(50)])
    bad = tmp_path / "b.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "no text key"}) + "\n")
    with pytest.raises(ValueError, match=r"b\.jsonl:2: .*'text'.*text_key="):
        prepare([good, bad], tok_dir, tmp_path / "fresh", workers=workers, batch_size=4, progress=False)
    _assert_no_new_pair(tmp_path, "fresh")
    # An older complete output under the same prefix is left as it was.
    prepare(good, tok_dir, tmp_path / "old", progress=False)
    before = {s: (tmp_path / f"old{s}").read_bytes() for s in (".bin", ".idx", ".json")}
    with pytest.raises(ValueError, match="text_key="):
        prepare([good, bad], tok_dir, tmp_path / "old", workers=workers, batch_size=4, progress=False)
    assert {s: (tmp_path / f"old{s}").read_bytes() for s in (".bin", ".idx", ".json")} == before
    assert not list(tmp_path.glob("old.*tmp*"))


def test_interrupt_mid_stream_writes_nothing(tmp_path, tok_dir, monkeypatch):
    def interrupted(source, **_):
        yield "a first record"
        raise KeyboardInterrupt

    monkeypatch.setitem(prepare_module._READERS, "jsonl", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare(write_jsonl(tmp_path / "a.jsonl", ["x"]), tok_dir, tmp_path / "cut", progress=False)
    _assert_no_new_pair(tmp_path, "cut")


def test_bad_inputs_refused_before_the_output_exists(tmp_path, tok_dir):
    good = write_jsonl(tmp_path / "a.jsonl", DOCS)
    (tmp_path / "c.csv").write_text("a,b\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "no_eos").mkdir()
    (tmp_path / "no_eos" / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    out = tmp_path / "out" / "corpus"
    cases = [
        (dict(input=tmp_path / "missing.jsonl"), FileNotFoundError, "missing.jsonl': no such file"),
        (dict(input=str(tmp_path / "*.nothing")), FileNotFoundError, "matches nothing"),
        (dict(input=[good, tmp_path / "c.csv"]), ValueError, "c.csv: not a file type"),
        (dict(input=tmp_path / "empty"), ValueError, "nothing prepare reads"),
        (dict(input=good, eos_token="<nope>"), ValueError, "'<nope>' is not in the vocab.*append_eos=false"),
        (
            dict(input=good, tokenizer=tmp_path / "no_eos"),
            ValueError,
            "eos_token=<token in the vocab> or append_eos=false",
        ),
        (dict(input=good, tokenizer=tmp_path / "nowhere"), FileNotFoundError, "no tokenizer.json"),
        (dict(input=good, workers=0), ValueError, "workers=0"),
    ]
    for options, error, message in cases:
        with pytest.raises(error, match=message):
            prepare(**{"tokenizer": tok_dir, "output": out, "progress": False, **options})
        assert not out.parent.exists(), options
    # The tokenizer folder without tokenizer_config.json works with an explicit eos_token.
    prepare(good, tmp_path / "no_eos", tmp_path / "explicit", eos_token=EOS, progress=False)


def test_parquet_without_the_column_refused_up_front(tmp_path, tok_dir):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "c.parquet")
    with pytest.raises(ValueError, match=r"no column 'text'.*'body'.*text_key="):
        prepare(tmp_path / "c.parquet", tok_dir, tmp_path / "out" / "c", progress=False)
    assert not (tmp_path / "out").exists()


def test_megatron_core_reads_the_output(tmp_path, tok_dir, tok):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its optional-dependency notices (Transformer Engine, Apex, ...)
        indexed_dataset = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    write_jsonl(tmp_path / "a.jsonl", DOCS + MORE_DOCS)
    prepare(tmp_path / "a.jsonl", tok_dir, tmp_path / "mc", progress=False)
    dataset = indexed_dataset.IndexedDataset(str(tmp_path / "mc"))
    assert [dataset[i].tolist() for i in range(len(dataset))] == expected(tok, DOCS + MORE_DOCS)
    assert dataset.get_document_indices().tolist() == list(range(len(dataset) + 1))


def test_cli_as_typed(tmp_path, tok_dir):
    write_jsonl(tmp_path / "a.jsonl", DOCS)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_moe.data.prepare",
            f"input={tmp_path}/*.jsonl",
            f"tokenizer={tok_dir}",
            f"output={tmp_path}/cli/corpus",
            "workers=2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert result.returncode == 0, result.stderr
    assert "prepared 4 documents" in result.stdout and "1 empty skipped" in result.stdout
    assert IndexedTokens(tmp_path / "cli" / "corpus").num_documents == 4


def test_cli_options(capsys):
    assert main(["input=a.jsonl", "tokenizer=t", "output=o", "bogus=1"]) == 2
    err = capsys.readouterr().err
    assert "'bogus'" in err and "text_key" in err
    assert main(["input=a.jsonl", "output=o"]) == 2 and "tokenizer=..." in capsys.readouterr().err
    assert (
        main(["input=a.jsonl", "tokenizer=t", "output=o", "workers=many"]) == 2
        and "workers: " in capsys.readouterr().err
    )
    assert main(["--help"]) == 0 and "append_eos" in capsys.readouterr().out
    # Text options keep their text; lists, booleans and null are parsed.
    config = parse_args(["input=*.jsonl", "tokenizer=bytes", "output=007", "lines=true", "eos_token=null"])
    assert (config.input, config.output, config.lines, config.eos_token) == ("*.jsonl", "007", True, None)
    assert parse_args(["input=[a.jsonl,b/*.parquet]", "tokenizer=t", "output=o"]).input == ["a.jsonl", "b/*.parquet"]
    assert parse_args(["input=a", "tokenizer=t", "output=o", "eos_token=<|endoftext|>"]).eos_token == EOS


def test_writer_close_with_metadata_inside_with(tmp_path):
    """close(metadata) inside the block, as prepare does: the block's end leaves the pair as it is."""
    with IndexedCorpusWriter(tmp_path / "w", vocab_size=10) as writer:
        writer.add_document([1, 2])
        writer.close(metadata={"note": "kept"})
    corpus = IndexedTokens(tmp_path / "w")
    assert corpus.document(0).tolist() == [1, 2] and corpus.metadata["note"] == "kept"

"""``experiments/bench/data_loading.py`` (part of ``make bench``) in its smoke sizes: every section runs,
its figures are filled in and it leaves nothing in the temporary folder. No timing is asserted."""

from __future__ import annotations

import tempfile

import pytest

pytest.importorskip("tokenizers")

from experiments.bench import data_loading  # noqa: E402


@pytest.mark.slow
def test_data_loading_bench_smoke_measures_every_section_and_cleans_up(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the bench's folder goes
    result = data_loading.run(smoke=True)
    assert list(tmp_path.glob("lmoe_bench_data_*")) == []  # corpora, tokenizer and prepared outputs removed
    sizes = data_loading.SMOKE
    assert result["corpora"]["big"]["bytes"] == sizes["big_bytes"]
    assert result["corpora"]["small"]["bytes"] == sizes["small_bytes"]
    for seq_len in sizes["rss_seq_lens"]:
        for name in ("big", "small"):
            memory = result["memory"][f"{name}/{seq_len}"]
            assert memory["samples_read"] >= sizes["rss_samples"] and memory["train_samples"] > 0
            assert memory["first_batch_seconds"] >= memory["index_seconds"] > 0
            assert set(memory["growth"]) >= {"VmRSS", "RssAnon", "RssFile", "VmHWM"}
    assert result["training"]["default"]["vocab_size"] == 256 and result["training"]["default"]["samples_per_s"] > 0
    assert result["training"]["vocab32000"]["vocab_size"] == data_loading.VOCAB
    assert len(result["loading"]) == 4 and all(row["loaded samples/s"] > 0 for row in result["loading"])
    runs = [row["run"] for row in result["tokenization"]]
    assert runs[-2:] == ["prepare workers=1", "prepare workers=2"]
    # prepare and encode_batch tokenized the same texts into the same number of tokens.
    assert len({row["tokens"] for row in result["tokenization"]}) == 1
    out = capsys.readouterr().out
    assert "keeps up" in out and "encode_batch" in out

"""data=tokens: prepared corpora blended, split by documents, with document positions and masks; the
same losses on every layout, a resume on another layout continuing the sample order, bad input refused."""

from __future__ import annotations

import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from lightning_moe.data import IndexedCorpusWriter, TokenDataModule, blend_schedule, parse_blend, stdlib_source_files
from tests.cli import TINY_MODEL, compose_train_config, train_in_pool
from tests.test_strategy_invariance import CP_HORIZONS, cp_overrides

REL = 1e-5


def write_corpus(prefix: Path, documents: list[np.ndarray], vocab_size: int = 256) -> Path:
    with IndexedCorpusWriter(prefix, vocab_size=vocab_size) as writer:
        for document in documents:
            writer.add_document(document)
    return prefix


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> tuple[Path, Path]:
    """Two byte-token sources: standard-library files, one document each."""
    root = tmp_path_factory.mktemp("corpora")
    files = stdlib_source_files()[:160]
    documents = [np.frombuffer(f.read_bytes()[:6000], dtype=np.uint8) for f in files]
    return write_corpus(root / "py_a", documents[:80]), write_corpus(root / "py_b", documents[80:])


# --- the blend rule -------------------------------------------------------------------------------


# The largest shortfall measured over these 5000 samples: no source is ever a full sample ahead of
# its share (it is taken only while at or below it), but one can fall up to 1.2 behind.
@pytest.mark.parametrize(
    ("weights", "behind"),
    [([0.7, 0.3], 0.7), ([0.5, 0.25, 0.25], 0.5), ([0.05, 0.9, 0.05], 1.2), ([1 / 3, 1 / 3, 1 / 3], 2 / 3)],
)
def test_blend_keeps_every_prefix_near_the_weights(weights, behind):
    total = sum(weights)
    weights = [w / total for w in weights]
    source, index = blend_schedule(weights, 5000)
    counts = np.stack([np.cumsum(source == d) for d in range(len(weights))], axis=1)  # [n, D]: after n+1 samples
    expected = np.arange(1, 5001)[:, None] * np.asarray(weights)[None, :]
    assert (counts - expected).max() < 1.0
    assert (expected - counts).max() == pytest.approx(behind, abs=1e-9)
    for d in range(len(weights)):  # each source's samples are taken in order 0, 1, 2, ...
        np.testing.assert_array_equal(index[source == d], np.arange((source == d).sum()))


@pytest.mark.parametrize(
    "weights",
    [
        [0.7, 0.3],
        [0.5, 0.3, 0.2],
        [5, 1, 3, 0.5, 2.25],
        [0.61803398875, 0.2, 0.18196601125],
        [1234567, 2345678, 987654, 33333],  # no earlier stretch predicts the next: one by one
        list(range(1, 13)),  # many sources: one numpy pass per sample
    ],
)
def test_blend_is_megatron_cores_sample_for_sample(weights):
    """megatron-core's ``build_blending_indices`` (its compiled helper) gives the same schedule."""
    helpers = pytest.importorskip("megatron.core.datasets.helpers")
    weights = [w / sum(weights) for w in weights]
    theirs_source = np.zeros(20_000, dtype=np.int16)
    theirs_index = np.zeros(20_000, dtype=np.int64)
    helpers.build_blending_indices(theirs_source, theirs_index, np.asarray(weights), len(weights), 20_000, False)
    source, index = blend_schedule(weights, 20_000)
    assert (source.dtype, index.dtype) == (np.dtype(np.int16), np.dtype(np.int64))
    np.testing.assert_array_equal(source, theirs_source)
    np.testing.assert_array_equal(index, theirs_index)


def test_blend_syntax():
    assert parse_blend("data/a") == [(1.0, "data/a")]
    assert parse_blend([0.7, "a", 0.3, "b"]) == [(0.7, "a"), (0.3, "b")]
    assert parse_blend({"a": 3, "b": 1}) == [(0.75, "a"), (0.25, "b")]
    assert parse_blend(["a", "b"]) == [(0.5, "a"), (0.5, "b")]
    with pytest.raises(ValueError, match=r"blend weight 0 of b must be > 0"):
        parse_blend([1, "a", 0, "b"])
    with pytest.raises(ValueError, match=r"blend weight -1 of a must be > 0"):
        parse_blend({"a": -1})
    with pytest.raises(ValueError, match=r"weights and sources alternating"):
        parse_blend([0.5, "a", "b"])


# --- samples ----------------------------------------------------------------------------------------


def test_samples_are_windows_over_the_shuffled_documents(tmp_path):
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 250, size=n).astype(np.uint8) for n in rng.integers(1, 40, size=60)]
    prefix = write_corpus(tmp_path / "c", documents)
    dm = TokenDataModule(prefix, seq_len=8, global_batch_size=2, split="1", document_mask=True, eod_mask_loss=True)
    order = dm.train_dataset.windows[0].documents
    assert sorted(order.tolist()) == list(range(60)), "split=1: every document is in train, shuffled"
    stream = np.concatenate([documents[d] for d in order]).astype(np.int64)
    owner = np.concatenate([np.full(len(documents[d]), k) for k, d in enumerate(order)])
    assert len(dm.train_dataset) == (len(stream) - 1) // 8
    for i in range(len(dm.train_dataset)):
        sample = dm.train_dataset[i]
        window = stream[i * 8 : i * 8 + 9]
        np.testing.assert_array_equal(sample["input_ids"].numpy(), window[:-1])
        np.testing.assert_array_equal(sample["labels"].numpy(), window[1:])
        docs = owner[i * 8 : i * 8 + 9]
        same = (docs[:, None] == docs[None, :])[:-1, :-1]
        assert torch.equal(sample["document_ids"][:, None] == sample["document_ids"][None, :], torch.from_numpy(same))
        # Positions restart at 0 at every document start inside the sample (and at the sample's start).
        for t in range(8):
            expected = 0 if t == 0 or docs[t] != docs[t - 1] else int(sample["position_ids"][t - 1]) + 1
            assert int(sample["position_ids"][t]) == expected
        np.testing.assert_array_equal(sample["loss_mask"].numpy(), (docs[1:] == docs[:-1]).astype(np.float32))
        assert int(sample["sample_index"]) == i


def test_split_is_by_documents_seeded_and_disjoint(corpora):
    a = TokenDataModule(corpora[0], seq_len=16, global_batch_size=4, split="80,20", seed=3)
    b = TokenDataModule(corpora[0], seq_len=16, global_batch_size=4, split="80,20", seed=3)
    c = TokenDataModule(corpora[0], seq_len=16, global_batch_size=4, split="80,20", seed=4)
    train, val = a.train_dataset.windows[0].documents, a.val_dataset.windows[0].documents
    assert (len(train), len(val)) == (64, 16) and not set(train) & set(val)
    np.testing.assert_array_equal(train, b.train_dataset.windows[0].documents)
    assert not np.array_equal(train, c.train_dataset.windows[0].documents)


def test_blend_mixes_the_sources_by_weight(corpora):
    dm = TokenDataModule([0.75, corpora[0], 0.25, corpora[1]], seq_len=16, global_batch_size=4)
    source = dm.train_dataset.schedule[0]
    assert abs((source[:400] == 0).sum() - 300) < 1
    first_b = dm.train_dataset[int(np.flatnonzero(source == 1)[0])]
    np.testing.assert_array_equal(first_b["input_ids"].numpy(), dm.train_dataset.windows[1].window(0)[0][:-1])
    assert dm.vocab_size == 256


# --- outside references: corpora written by megatron-core and litdata ------------------------------


def test_a_corpus_written_by_megatron_core_reads_back_token_for_token(tmp_path):
    """megatron-core's own builder (int32 ids, empty documents too) read here by memory map."""
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    from lightning_moe.data import IndexedTokens

    rng = np.random.default_rng(1)
    documents = [rng.integers(0, 200_000, size=n).astype(np.int32) for n in [7, 0, 31, 1, 12]]
    builder = indexed.IndexedDatasetBuilder(str(tmp_path / "meg.bin"), dtype=np.int32)
    for document in documents:
        builder.add_document(document, [len(document)])
    builder.finalize(str(tmp_path / "meg.idx"))
    corpus = IndexedTokens(tmp_path / "meg")
    assert (corpus.num_documents, corpus.dtype) == (5, np.dtype(np.int32))
    for k, document in enumerate(documents):
        np.testing.assert_array_equal(corpus.document(k), document)
    # And megatron-core reads what the writer here writes.
    write_corpus(tmp_path / "ours", documents, vocab_size=200_000)
    theirs = indexed.IndexedDataset(str(tmp_path / "ours"))
    assert len(theirs) == 5 and all(np.array_equal(theirs[k], d) for k, d in enumerate(documents))
    assert TokenDataModule(str(tmp_path / "meg"), seq_len=4, global_batch_size=2, split="1").vocab_size is None


def _token_items(documents):
    yield from documents


def test_a_litdata_directory_is_a_source(tmp_path, corpora):
    """A litdata TokensLoader directory blended with a Megatron prefix: its samples are its documents' tokens."""
    pytest.importorskip("litdata")
    from tests.test_data_litdata import _optimize

    rng = np.random.default_rng(2)
    documents = [torch.from_numpy(rng.integers(0, 256, size=n).astype(np.int32)) for n in rng.integers(5, 60, size=40)]
    folder = _optimize(tmp_path / "lit", documents)
    dm = TokenDataModule([0.5, str(folder), 0.5, str(corpora[0])], seq_len=8, global_batch_size=4, split="1")
    windows = dm.train_dataset.windows[0]
    stream = np.concatenate([documents[d].numpy() for d in windows.documents])
    first = int(np.flatnonzero(dm.train_dataset.schedule[0] == 0)[3])
    np.testing.assert_array_equal(dm.train_dataset[first]["input_ids"].numpy(), stream[3 * 8 : 3 * 8 + 8])


# --- bad input ------------------------------------------------------------------------------------


def test_bad_sources_are_refused_naming_the_file_and_fix(tmp_path, corpora):
    with pytest.raises(FileNotFoundError, match=r"missing.*prepare"):
        TokenDataModule(str(tmp_path / "missing"))
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match=r"notes.txt.*unknown kind"):
        TokenDataModule(str(tmp_path / "notes.txt"))
    (tmp_path / "plain_dir").mkdir()
    with pytest.raises(ValueError, match=r"plain_dir.*not a litdata"):
        TokenDataModule(str(tmp_path / "plain_dir"))
    with pytest.raises(ValueError, match=r"must be > 0"):
        TokenDataModule([1.0, str(corpora[0]), 0.0, str(corpora[1])])
    source = Path(str(corpora[0]))
    for name, damage, message in [
        ("magic", lambda idx, bin_: idx.write_bytes(b"NOTANIDX\x00" + idx.read_bytes()[9:]), r"not a Megatron index"),
        (
            "version",
            lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:9] + struct.pack("<Q", 2) + idx.read_bytes()[17:]),
            r"index version 2",
        ),
        ("bin_size", lambda idx, bin_: bin_.write_bytes(bin_.read_bytes()[:-3]), r"bytes, but .* indexes"),
        ("no_bin", lambda idx, bin_: bin_.unlink(), r"no such file"),
    ]:
        prefix = tmp_path / name
        for suffix in (".bin", ".idx"):
            prefix.with_suffix(suffix).write_bytes(source.with_suffix(suffix).read_bytes())
        damage(prefix.with_suffix(".idx"), prefix.with_suffix(".bin"))
        with pytest.raises((ValueError, FileNotFoundError), match=message) as error:
            TokenDataModule(str(prefix))
        assert str(prefix) in str(error.value)


def test_too_few_samples_for_a_global_batch(tmp_path):
    prefix = write_corpus(tmp_path / "small", [np.arange(50, dtype=np.uint8)])
    with pytest.raises(ValueError, match=r"gives 6 samples .* global_batch_size is 16"):
        TokenDataModule(str(prefix), seq_len=8, split="1")


def test_ids_beyond_the_models_vocab_are_refused_before_training(corpora):
    from lightning_moe.models import MoEGPT

    dm = TokenDataModule(corpora[0], seq_len=16, global_batch_size=4)
    dm.trainer = SimpleNamespace(lightning_module=MoEGPT(vocab_size=100, hidden_size=16, num_layers=1, num_heads=2))
    with pytest.raises(ValueError, match=r"py_a: token id \d+ is >= the model's vocab_size 100.*model.vocab_size="):
        dm.build_datasets()


def test_hf_model_refuses_a_tokenizer_larger_than_its_embeddings(tmp_path):
    from lightning_moe.hf import TINY_CONFIGS, HFMoEModule

    prefix = write_corpus(tmp_path / "big_vocab", [np.arange(300, dtype=np.uint16)], vocab_size=32000)
    module = HFMoEModule({"model_type": "qwen3_moe", **TINY_CONFIGS["qwen3_moe"]})
    dm = TokenDataModule(str(prefix), seq_len=8, global_batch_size=2, split="1")
    module._trainer = SimpleNamespace(datamodule=dm, strategy=None)
    with pytest.raises(ValueError, match="tokenizer has 32000 tokens but the model's embeddings hold 256"):
        module.setup("fit")
    dm.trainer = SimpleNamespace(lightning_module=module)
    with pytest.raises(ValueError, match=r"big_vocab: token id 299 is >= the model's vocab_size 256"):
        dm.build_datasets()


def test_hydra_group_composes(corpora, tmp_path):
    cfg = compose_train_config(tmp_path, ["data=tokens", f"data.blend={corpora[0]}", "parallel=ep2"])
    from hydra.utils import instantiate

    dm = instantiate(cfg.data)
    assert isinstance(dm, TokenDataModule) and dm.seq_len == 128 and dm.global_batch_size == 16


# --- every layout ---------------------------------------------------------------------------------


def token_run(corpora: tuple[Path, Path], model: str = "tiny") -> list[str]:
    """The tiny model (or the tiny config ``model`` as it is) on a 2-source blend with document positions and
    the EOD loss mask."""
    shrunk = [o for o in TINY_MODEL if not o.startswith("data.")] if model == "tiny" else [f"model={model}"]
    return [
        "logger=none",
        "trainer.max_steps=4",
        "++trainer.gradient_clip_val=0.05",
        "trainer.val_check_interval=null",
        "trainer.limit_val_batches=0",
        "~callbacks.progress_bar",
        "data=tokens",
        f"data.blend=[0.6,{corpora[0]},0.4,{corpora[1]}]",
        "data.seq_len=32",
        "data.global_batch_size=16",
        "data.document_mask=true",
        "data.eod_mask_loss=true",
        *shrunk,
    ]


def _presets() -> list:
    """The presets of at most 8 processes without context parallelism (the cp presets run below).

    Token data reaches tensor parallelism only as the sequence-parallel shards of the masked batch,
    which tp2 and tp2_ep2_folded compare on it; the presets that combine tp with other dimensions on
    more than 2 processes compare the default data in `make test` (test_strategy_invariance.py) and
    token data in `make test-long`."""
    from tests.presets import long_where, presets_this_torch_builds
    from tests.test_strategy_invariance import _preset_processes, presets_without_cp_up_to_8_processes

    return long_where(
        presets_this_torch_builds(presets_without_cp_up_to_8_processes()),
        lambda name: name.startswith(("tp2_", "dp2_tp2", "pp2_tp2")) and _preset_processes(name) > 2,
    )


def one_process_losses_on_first_use(tmp_path_factory, name: str, run_args) -> Any:
    """`losses(key)`: the one-process losses of `train_in_pool(*run_args(key))`, trained once per key;
    `run_args(key)` gives the overrides, the base run and the steps it trains."""
    cache: dict[Any, list[float]] = {}

    def losses(key: Any) -> list[float]:
        if key not in cache:
            overrides, base, steps = run_args(key)
            parts = key if isinstance(key, tuple) else (key,)
            run = tmp_path_factory.mktemp("_".join(map(str, (name, *parts)))) / "run"
            cache[key] = train_in_pool(run, "parallel=single", *overrides, base=base)["losses"]
            assert len(cache[key]) == steps
        return cache[key]

    return losses


@pytest.fixture(scope="module")
def single_token_losses(tmp_path_factory, corpora):
    return one_process_losses_on_first_use(
        tmp_path_factory,
        "single_tokens",
        lambda num_layers: ([f"model.num_layers={num_layers}"], token_run(corpora), 4),
    )


@pytest.mark.slow
@pytest.mark.parametrize("preset", _presets())
def test_preset_with_token_data_matches_single_process(tmp_path, corpora, single_token_losses, preset):
    from tests.test_strategy_invariance import PRESET_LAYERS

    num_layers = PRESET_LAYERS.get(preset, 2)
    summary = train_in_pool(
        tmp_path / preset, f"parallel={preset}", f"model.num_layers={num_layers}", base=token_run(corpora)
    )
    torch.testing.assert_close(
        torch.tensor(summary["losses"]), torch.tensor(single_token_losses(num_layers)), rtol=REL, atol=0.0
    )


# The cp presets at the horizons test_strategy_invariance.py runs them on the default data (6 steps in
# `make test`, 20 in `make test-long`; cp_overrides: a global batch of 8 in micro-batches of 4, the
# callbacks that do not change the losses off), and so does a Hugging Face family at cp2: Qwen3-MoE
# (grouped-query attention, RoPE at the documents' positions).
HF_MODEL = "hf_tiny_qwen3_moe"


@pytest.fixture(scope="module")
def single_cp_token_losses(tmp_path_factory, corpora):
    """One-process losses of cp_overrides(steps) per (model config, steps), run once each on first use."""
    return one_process_losses_on_first_use(
        tmp_path_factory,
        "single_cp_tokens",
        lambda key: (cp_overrides(key[1]), token_run(corpora, key[0]), key[1]),
    )


def _cp_cases() -> list:
    from tests.test_strategy_invariance import cp_presets_up_to_8_processes

    cases = []
    for preset in cp_presets_up_to_8_processes():  # by process count: the runs of one count share a pool
        # The document mask meets cp alone (cp2, cp4) and with tp (cp2_tp2); ep adds nothing to it, so the
        # presets that add ep to those run in `make test-long` (and on the default data in `make test`).
        marks = [pytest.mark.long] if "_ep" in preset else []
        cases += [pytest.param(preset, comm, "tiny", id=f"{preset}-{comm}", marks=marks) for comm in ("ring", "a2a")]
        if preset == "cp2":
            cases += [pytest.param(preset, comm, HF_MODEL, id=f"{preset}-{comm}-qwen3_moe") for comm in ("ring", "a2a")]
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("steps", CP_HORIZONS, ids=lambda steps: f"{steps}_steps")
@pytest.mark.parametrize("preset,cp_comm,model", _cp_cases())
def test_cp_preset_with_packed_documents_matches_single_process(
    tmp_path, corpora, single_cp_token_losses, preset, cp_comm, model, steps
):
    """Every cp preset, ring and all-to-all attention under the document mask (and one HF family at cp2):
    the one-process masked losses at every step."""
    if model == HF_MODEL:
        pytest.importorskip("transformers")
    summary = train_in_pool(
        tmp_path / preset,
        f"parallel={preset}",
        f"parallel.cp_comm={cp_comm}",
        *cp_overrides(steps),
        base=token_run(corpora, model),
    )
    single = single_cp_token_losses((model, steps))
    torch.testing.assert_close(torch.tensor(summary["losses"]), torch.tensor(single), rtol=REL, atol=0.0)
    assert single[-1] < single[0]  # it trains


@pytest.mark.slow
def test_resume_mid_epoch_on_another_layout_continues_the_sample_order(tmp_path, corpora, single_token_losses):
    """2 of 4 steps on ep2, resumed on tp2: steps 3-4 are the uninterrupted one-process steps."""
    first = tmp_path / "ep2"
    train_in_pool(
        first,
        "parallel=ep2",
        "trainer.max_steps=2",
        "model.max_steps=4",
        "callbacks=checkpoint",
        "callbacks.checkpoint.every_n_train_steps=2",
        base=token_run(corpora),
    )
    resumed = train_in_pool(
        tmp_path / "tp2", "parallel=tp2", f"ckpt_path={first / 'checkpoints' / 'last.ckpt'}", base=token_run(corpora)
    )
    assert len(resumed["losses"]) == 2, "the resumed run starts at step 3"
    torch.testing.assert_close(
        torch.tensor(resumed["losses"]), torch.tensor(single_token_losses(2)[2:]), rtol=REL, atol=0.0
    )


_SINGLE_RUNS: dict[str, dict] = {}


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["cp2_tp2", "pp2_ep2"])
def test_sequence_balance_loss_per_document_matches_single_process(tmp_path_factory, corpora, preset):
    """seq_aux_loss counts each packed document as a sequence: its statistics reduced over the cp x tp
    ranks holding shards of a row, and on pipeline stages fed each micro-batch's ids."""
    per_document = ["model.moe.load_balancing=seq_aux_loss"]
    if "seq_aux" not in _SINGLE_RUNS:
        _SINGLE_RUNS["seq_aux"] = train_in_pool(
            tmp_path_factory.mktemp("single_seq_aux") / "run", "parallel=single", *per_document, base=token_run(corpora)
        )
    single = _SINGLE_RUNS["seq_aux"]
    summary = train_in_pool(
        tmp_path_factory.mktemp(preset) / "run", f"parallel={preset}", *per_document, base=token_run(corpora)
    )
    torch.testing.assert_close(torch.tensor(summary["losses"]), torch.tensor(single["losses"]), rtol=REL, atol=0.0)

"""data=text: a tokenizer (a tiny BPE built here with `tokenizers`, nothing downloaded) over the byte
corpus, with the byte corpus's layout-invariant sampler and resumable position."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

tokenizers = pytest.importorskip("tokenizers")

from lightning_moe.data import LayoutInvariantSampler, ResumableDataLoader, TextDataModule  # noqa: E402

TEXT = "\n".join(
    f"def function_{i}(x, y):\n    return x * {i} + y - {i % 7}  # the quick brown fox {i}\n" for i in range(400)
)


def build_tokenizer(folder: Path, vocab_size: int) -> Path:
    """A byte-level BPE trained on TEXT, saved as folder/tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>"],
        show_progress=False,
    )
    tok.train_from_iterator(TEXT.splitlines(keepends=True), trainer=trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def corpus_and_tokenizer(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    (root / "texts").mkdir()
    (root / "texts" / "a.py").write_text(TEXT)
    return root / "texts", build_tokenizer(root / "tok", vocab_size=320), root / "cache"


def _fake_trainer(num_replicas: int, rank: int) -> SimpleNamespace:
    strategy = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": num_replicas, "rank": rank})
    return SimpleNamespace(strategy=strategy, accumulate_grad_batches=1)


def _module(corpus_and_tokenizer, num_replicas: int = 1, rank: int = 0) -> TextDataModule:
    texts, tok, cache = corpus_and_tokenizer
    dm = TextDataModule(
        tokenizer=tok,
        path=texts,
        seq_len=16,
        global_batch_size=8,
        micro_batch_size=1,
        val_fraction=0.1,
        cache_dir=cache,
        seed=3,
    )
    dm.trainer = _fake_trainer(num_replicas, rank)
    dm.setup("fit")
    return dm


def test_windows_are_tokenizer_tokens(corpus_and_tokenizer):
    dm = _module(corpus_and_tokenizer)
    assert dm.vocab_size == 320
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(corpus_and_tokenizer[1] / "tokenizer.json"))
    ids = tok.encode(TEXT).ids
    item = dm.train_dataset[3]
    start = 3 * 17
    assert item["input_ids"].dtype == torch.int64 and item["input_ids"].shape == (16,)
    assert item["input_ids"].tolist() == ids[start : start + 16]
    assert item["labels"].tolist() == ids[start + 1 : start + 17]
    # BPE really merges: fewer tokens than bytes, and merged tokens (ids past the byte alphabet) occur.
    tokens = np.load(dm.tokens)
    assert len(tokens) < len(TEXT.encode()) / 2 and tokens.max() >= 257
    # Cached: a second module reuses the file.
    assert _module(corpus_and_tokenizer).tokens == dm.tokens


def test_layout_invariant_steps(corpus_and_tokenizer):
    """Every optimizer step sees the same samples whatever the number of data-parallel replicas."""

    def step_samples(n: int) -> list[set[tuple[int, ...]]]:
        loaders = [_module(corpus_and_tokenizer, n, r).train_dataloader() for r in range(n)]
        per_rank = [[tuple(b["input_ids"][0].tolist()) for b in loader] for loader in loaders]
        accumulate = 8 // n
        steps = len(per_rank[0]) // accumulate
        return [{s for r in range(n) for s in per_rank[r][k * accumulate : (k + 1) * accumulate]} for k in range(steps)]

    reference = step_samples(1)
    assert len(reference) >= 3 and all(len(step) == 8 for step in reference)
    assert step_samples(2) == reference
    assert step_samples(4) == reference


def test_resumable_position(corpus_and_tokenizer):
    dm = _module(corpus_and_tokenizer, 2, 1)
    loader = dm.train_dataloader()
    assert isinstance(loader, ResumableDataLoader) and isinstance(loader.sampler, LayoutInvariantSampler)
    full = [b["input_ids"] for b in loader]
    dm.trainer.current_epoch = 0
    dm.trainer.fit_loop = SimpleNamespace(
        epoch_loop=SimpleNamespace(batch_progress=SimpleNamespace(current=SimpleNamespace(processed=5)))
    )
    state = dm.train_dataloader().state_dict()  # the byte module's (layout-free) position format
    resumed = _module(corpus_and_tokenizer, 2, 1).train_dataloader()
    resumed.load_state_dict(state)
    rest = [b["input_ids"] for b in resumed]
    assert len(rest) == len(full) - 5
    assert all(torch.equal(a, b) for a, b in zip(rest, full[5:]))


def test_missing_tokenizer_and_tokenizer_larger_than_embeddings(corpus_and_tokenizer, tmp_path):
    texts, tok, cache = corpus_and_tokenizer
    with pytest.raises(FileNotFoundError, match="no tokenizer.json there"):
        TextDataModule(tokenizer=tmp_path / "nope", path=texts)
    from lightning_moe.hf import TINY_CONFIGS, HFMoEModule

    module = HFMoEModule({"model_type": "qwen3_moe", **TINY_CONFIGS["qwen3_moe"]})
    module._trainer = SimpleNamespace(datamodule=TextDataModule(tokenizer=tok, path=texts), strategy=None)
    with pytest.raises(ValueError, match="tokenizer has 320 tokens but the model's embeddings hold 256"):
        module.setup("fit")


def test_hf_module_trains_on_tokenized_text(corpus_and_tokenizer):
    import lightning as L

    from lightning_moe.hf import TINY_CONFIGS, HFMoEModule

    texts, tok, cache = corpus_and_tokenizer
    dm = TextDataModule(tokenizer=tok, path=texts, seq_len=16, global_batch_size=4, val_fraction=0.0, cache_dir=cache)
    L.seed_everything(0)
    config = dict(TINY_CONFIGS["qwen3_moe"], vocab_size=320)
    module = HFMoEModule({"model_type": "qwen3_moe", **config}, learning_rate=3e-3, warmup_steps=1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(module, datamodule=dm)
    assert torch.isfinite(trainer.callback_metrics["train/loss"])

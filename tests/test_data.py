"""ByteTextDataModule, the corpus cache and the layout-invariant sampler."""

from __future__ import annotations

import sysconfig
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch

from lightning_moe.data import (
    ByteTextDataModule,
    ByteWindowDataset,
    LayoutInvariantSampler,
    build_corpus,
    byte_text,
    stdlib_source_files,
)


def _fake_trainer(num_replicas: int, rank: int, accumulate: int = 1) -> SimpleNamespace:
    """The two things the data module reads from a trainer: the strategy's data-parallel layout
    and the accumulation attribute it sets."""
    strategy = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": num_replicas, "rank": rank})
    return SimpleNamespace(strategy=strategy, accumulate_grad_batches=accumulate)


def _write_bin(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


# ---------------------------------------------------------------- corpus


def test_default_corpus_is_deterministic_and_cached(tmp_path, monkeypatch):
    first = build_corpus(max_bytes=200_000, cache_dir=tmp_path / "a")
    second = build_corpus(max_bytes=200_000, cache_dir=tmp_path / "b")
    assert first.name == second.name and "stdlib-py" in first.name
    assert first.read_bytes() == second.read_bytes()
    assert first.stat().st_size == 200_000
    # The corpus is the sorted stdlib sources, concatenated.
    files = stdlib_source_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    assert files == sorted(files, key=lambda p: p.relative_to(root).as_posix())
    relative_dirs = [p.relative_to(root).parts[:-1] for p in files]
    assert not any({"site-packages", "test", "tests"} & set(parts) for parts in relative_dirs)
    head = b"".join(f.read_bytes() for f in files[:3])[:200_000]
    assert first.read_bytes()[: len(head)] == head

    def no_rebuild(*args, **kwargs):
        raise AssertionError("cached corpus was rebuilt")

    monkeypatch.setattr(byte_text, "_write_atomically", no_rebuild)
    assert build_corpus(max_bytes=200_000, cache_dir=tmp_path / "a") == first
    assert not list((tmp_path / "a").glob("*.tmp")), "temporary file left behind"


def test_cache_dir_env_override(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_MOE_CACHE", str(tmp_path / "env-cache"))
    corpus = build_corpus(max_bytes=10_000)
    assert corpus.parent == tmp_path / "env-cache"


def test_folder_corpus_sorted_recursive_and_invalidated_on_change(tmp_path):
    folder = tmp_path / "texts"
    (folder / "b").mkdir(parents=True)
    (folder / "b" / "x.txt").write_bytes(b"second file\n")
    (folder / "a.txt").write_bytes(b"first file\n")
    (folder / ".hidden").write_bytes(b"ignored\n")
    corpus = build_corpus(folder, cache_dir=tmp_path / "cache")
    assert corpus.read_bytes() == b"first file\nsecond file\n"
    assert build_corpus(folder, max_bytes=5, cache_dir=tmp_path / "cache").read_bytes() == b"first"

    (folder / "a.txt").write_bytes(b"changed first file\n")
    changed = build_corpus(folder, cache_dir=tmp_path / "cache")
    assert changed != corpus
    assert changed.read_bytes() == b"changed first file\nsecond file\n"


def test_bin_file_is_used_as_is(tmp_path):
    data = bytes(range(256)) * 4
    path = _write_bin(tmp_path / "tokens.bin", data)
    assert build_corpus(path, cache_dir=tmp_path / "cache") == path
    dm = ByteTextDataModule(path=path, seq_len=7, global_batch_size=4, val_fraction=0.25)
    dm.setup("fit")
    sample = dm.train_dataset[3]
    assert sample["input_ids"].tolist() == list(data[24:31])


# ---------------------------------------------------------------- samples and split


def test_windows_and_labels_shifted_by_one(tmp_path):
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=1000, dtype=np.uint8).tobytes()
    ds = ByteWindowDataset(_write_bin(tmp_path / "c.bin", data), seq_len=9)
    assert len(ds) == 1000 // 10
    for i in (0, 1, 57, len(ds) - 1):
        item = ds[i]
        assert item["input_ids"].dtype == torch.int64 and item["labels"].dtype == torch.int64
        assert item["input_ids"].tolist() == list(data[i * 10 : i * 10 + 9])
        assert item["labels"].tolist() == list(data[i * 10 + 1 : i * 10 + 10])
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_train_val_split_is_disjoint_tail(tmp_path):
    # Window w holds the byte w in every position, so a sample names its window.
    seq_len, windows = 7, 200
    data = b"".join(bytes([w]) * (seq_len + 1) for w in range(windows))
    dm = ByteTextDataModule(
        path=_write_bin(tmp_path / "c.bin", data),
        seq_len=seq_len,
        global_batch_size=4,
        val_fraction=0.1,
    )
    dm.setup("fit")
    train = {dm.train_dataset[i]["input_ids"][0].item() for i in range(len(dm.train_dataset))}
    val = {dm.val_dataset[i]["input_ids"][0].item() for i in range(len(dm.val_dataset))}
    assert val == set(range(180, 200))
    assert train == set(range(180))
    assert not train & val
    batch = next(iter(dm.train_dataloader()))
    # The default micro-batch: 2 samples, whatever the global batch and the layout.
    assert batch["input_ids"].shape == (2, seq_len) and batch["labels"].shape == (2, seq_len)
    assert [b[0].item() for b in next(iter(dm.val_dataloader()))["input_ids"]] == [180, 181]


def test_val_fraction_zero_gives_no_val_loader(tmp_path):
    dm = ByteTextDataModule(
        path=_write_bin(tmp_path / "c.bin", bytes(1000)),
        seq_len=9,
        global_batch_size=4,
        val_fraction=0.0,
    )
    dm.setup("fit")
    assert len(dm.train_dataset) == 100 and dm.val_dataloader() == []


# ---------------------------------------------------------------- errors


def test_error_seq_len_longer_than_corpus(tmp_path):
    dm = ByteTextDataModule(path=_write_bin(tmp_path / "c.bin", bytes(100)), seq_len=128)
    with pytest.raises(ValueError, match=r"seq_len 128 is longer than the corpus \(100 bytes"):
        dm.setup("fit")


def test_error_too_few_windows_for_a_global_batch(tmp_path):
    dm = ByteTextDataModule(path=_write_bin(tmp_path / "c.bin", bytes(1000)), seq_len=99, global_batch_size=16)
    with pytest.raises(ValueError, match=r"too few windows for one global batch.*global_batch_size is 16"):
        dm.setup("fit")


def test_error_empty_data_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    dm = ByteTextDataModule(path=tmp_path / "empty", cache_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match=r"path=.*empty data folder"):
        dm.setup("fit")


def test_error_missing_path(tmp_path):
    dm = ByteTextDataModule(path=tmp_path / "nope")
    with pytest.raises(ValueError, match=r"path=.*nope.*does not exist"):
        dm.setup("fit")


def test_error_global_batch_not_divisible(tmp_path):
    path = _write_bin(tmp_path / "c.bin", bytes(10_000))
    dm = ByteTextDataModule(path=path, seq_len=9, global_batch_size=12, micro_batch_size=4)
    dm.trainer = _fake_trainer(num_replicas=2, rank=0)
    with pytest.raises(
        ValueError,
        match=r"global_batch_size 12 not divisible by micro_batch_size\*dp_ep = 4\*2 = 8",
    ):
        dm.setup("fit")
    dm = ByteTextDataModule(path=path, seq_len=9, global_batch_size=10)
    dm.trainer = _fake_trainer(num_replicas=4, rank=0)
    with pytest.raises(
        ValueError,
        match=r"global_batch_size 10 not divisible by micro_batch_size\*dp_ep = 2\*4 = 8 \(the default, 2 on every layout\)",
    ):
        dm.setup("fit")
    with pytest.raises(ValueError, match=r"global_batch_size 10 not divisible by micro_batch_size"):
        ByteTextDataModule(global_batch_size=10, micro_batch_size=4)


def test_error_conflicting_trainer_accumulation(tmp_path):
    dm = ByteTextDataModule(
        path=_write_bin(tmp_path / "c.bin", bytes(10_000)),
        seq_len=9,
        global_batch_size=16,
        micro_batch_size=4,
    )
    dm.trainer = _fake_trainer(num_replicas=1, rank=0, accumulate=3)
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=3"):
        dm.setup("fit")


# ---------------------------------------------------------------- sampler and layout


def test_setup_sets_layout_and_accumulation(tmp_path):
    dm = ByteTextDataModule(
        path=_write_bin(tmp_path / "c.bin", bytes(10_000)),
        seq_len=9,
        global_batch_size=16,
        micro_batch_size=2,
    )
    dm.trainer = _fake_trainer(num_replicas=2, rank=1)
    dm.setup("fit")
    assert (dm.num_replicas, dm.rank, dm.micro_batch_size) == (2, 1, 2)
    assert dm.trainer.accumulate_grad_batches == 4
    loader = dm.train_dataloader()
    assert isinstance(loader.sampler, LayoutInvariantSampler)
    assert loader.batch_size == 2 and loader.drop_last
    assert len(loader) == (len(dm.train_dataset) // 16) * 4

    dm = ByteTextDataModule(path=tmp_path / "c.bin", seq_len=9, global_batch_size=16)
    dm.trainer = _fake_trainer(num_replicas=4, rank=0)
    dm.setup("fit")
    # The default micro-batch does not follow the layout: 2 samples, accumulated over 16 / (2*4) = 2 steps.
    assert (dm.micro_batch_size, dm.trainer.accumulate_grad_batches) == (2, 2)


def _rank_micro_batches(n: int, shuffle: bool = True, epoch: int = 0) -> list[list[list[int]]]:
    """Micro-batches (lists of indices) of every rank for a 100-sample dataset."""
    out = []
    for rank in range(n):
        sampler = LayoutInvariantSampler(
            range(100),
            global_batch_size=16,
            micro_batch_size=2,
            num_replicas=n,
            rank=rank,
            shuffle=shuffle,
            seed=7,
        )
        sampler.set_epoch(epoch)
        indices = list(sampler)
        assert len(indices) == len(sampler)
        out.append([indices[i : i + 2] for i in range(0, len(indices), 2)])
    return out


@pytest.mark.parametrize("shuffle", [True, False])
def test_sampler_steps_see_the_same_samples_for_any_layout(shuffle):
    steps = 100 // 16  # truncated to whole global batches
    reference = LayoutInvariantSampler(
        range(100), global_batch_size=16, micro_batch_size=2, shuffle=shuffle, seed=7
    ).global_order()
    assert len(reference) == steps * 16
    if shuffle:
        assert reference.tolist() != list(range(steps * 16))
    else:
        assert reference.tolist() == list(range(steps * 16))
    # micro-batch j of step s, from the shared order
    expected = [[reference[s * 16 + 2 * j : s * 16 + 2 * j + 2].tolist() for j in range(8)] for s in range(steps)]
    for n in (1, 2, 4):
        per_rank = _rank_micro_batches(n, shuffle)
        accumulate = 8 // n
        for rank in range(n):
            assert len(per_rank[rank]) == steps * accumulate
        for s in range(steps):
            union = set()
            for rank in range(n):
                mine = per_rank[rank][s * accumulate : (s + 1) * accumulate]
                # rank r accumulates micro-batches r, r + n, r + 2n, ... of the step
                assert mine == [expected[s][j] for j in range(rank, 8, n)]
                union.update(i for mb in mine for i in mb)
            assert union == {i for mb in expected[s] for i in mb}


def test_sampler_epochs_reshuffle_identically_for_every_layout():
    epoch0, epoch1 = _rank_micro_batches(1, epoch=0), _rank_micro_batches(1, epoch=1)
    assert epoch0 != epoch1
    for n in (2, 4):
        per_rank = _rank_micro_batches(n, epoch=1)
        assert sorted(mb for r in per_rank for mb in r) == sorted(epoch1[0])


def test_lightning_keeps_the_sampler_and_accumulates(tmp_path):
    """Through a real Trainer: micro_batch_size=4 (4 accumulated micro-batches) reaches the same
    weights as micro_batch_size=16 after 3 optimizer steps."""
    from lightning_moe.models import MoEGPT

    rng = np.random.default_rng(0)
    path = _write_bin(tmp_path / "c.bin", rng.integers(0, 256, size=20_000, dtype=np.uint8).tobytes())
    weights = []
    for micro in (16, 4):
        torch.manual_seed(0)
        model = MoEGPT(hidden_size=32, num_layers=1, num_heads=2, moe_layer_freq=0, warmup_steps=1)
        dm = ByteTextDataModule(path=path, seq_len=16, global_batch_size=16, micro_batch_size=micro)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=3,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
        )
        trainer.fit(model, datamodule=dm)
        assert trainer.global_step == 3
        assert trainer.accumulate_grad_batches == 16 // micro
        assert isinstance(trainer.train_dataloader.sampler, LayoutInvariantSampler)
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch.testing.assert_close(weights[0], weights[1], rtol=1e-4, atol=1e-5)


def test_resumed_sampler_skips_the_finished_micro_batches():
    from lightning_moe.data import LayoutInvariantSampler, ResumableDataLoader

    sampler = LayoutInvariantSampler(range(64), global_batch_size=16, micro_batch_size=4, num_replicas=2, rank=1)
    full = list(sampler)
    loader = ResumableDataLoader(range(64), batch_size=4, sampler=sampler, drop_last=True, progress=lambda: (0, 3))
    state = loader.state_dict()
    assert state == {"epoch": 0, "samples_consumed": 3 * 4 * 2}  # 3 micro-batches of 4 on each of 2 ranks

    resumed_sampler = LayoutInvariantSampler(
        range(64), global_batch_size=16, micro_batch_size=4, num_replicas=2, rank=1
    )
    resumed = ResumableDataLoader(
        range(64), batch_size=4, sampler=resumed_sampler, drop_last=True, progress=lambda: (0, 0)
    )
    resumed.load_state_dict(state)
    assert [int(i) for batch in resumed for i in batch] == full[3 * 4 :]
    # The skip applies once: the next pass over the epoch is whole again.
    assert list(resumed_sampler) == full
    # A state from another epoch does not cut this one.
    resumed_sampler.resume_at(epoch=5, micro_batches_done=2)
    assert list(resumed_sampler) == full


def test_resume_state_is_layout_free():
    """The samples consumed on 2 ranks x micro-batch 4 resume on 1 rank x 2 and on 4 ranks x 2 (pp groups of 2)."""
    from lightning_moe.data import LayoutInvariantSampler, ResumableDataLoader

    def loader(replicas: int, rank: int, micro: int, done: int, group: int = 1) -> ResumableDataLoader:
        sampler = LayoutInvariantSampler(
            range(64), global_batch_size=16, micro_batch_size=micro, num_replicas=replicas, rank=rank
        )
        return ResumableDataLoader(
            range(64),
            batch_size=micro,
            sampler=sampler,
            drop_last=True,
            progress=lambda: (0, done),
            microbatches_per_step=group,
        )

    state = loader(2, 0, 4, done=4).state_dict()  # 2 optimizer steps of 16 samples
    assert state == {"epoch": 0, "samples_consumed": 32}
    assert loader(4, 3, 2, done=2, group=2).state_dict() == state  # pp: 2 loader batches per training batch
    order = LayoutInvariantSampler(range(64), global_batch_size=16, micro_batch_size=16).global_order().tolist()
    for replicas, micro in ((1, 2), (4, 2), (2, 8)):
        seen = []
        for rank in range(replicas):
            resumed = loader(replicas, rank, micro, done=0)
            resumed.load_state_dict(state)
            seen += [int(i) for batch in resumed for i in batch]
        assert sorted(seen) == sorted(order[32:])  # exactly the samples of steps 3 and 4
    with pytest.raises(
        ValueError, match=r"40 samples were consumed, not a multiple of micro_batch_size\*dp_ep = 8\*2 = 16"
    ):
        loader(2, 0, 8, done=0).load_state_dict({"epoch": 0, "samples_consumed": 40})

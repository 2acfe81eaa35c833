"""MoEMetricsCallback and SummaryCallback on hand-made router statistics (one process, in-process Trainer)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader

from lightning_moe import ParallelDims
from lightning_moe.callbacks import (
    MoEMetricsCallback,
    SummaryCallback,
    data_parallel_sum,
    parallel_layout,
    write_json_atomic,
)
from lightning_moe.moe import MoELayer

NUM_EXPERTS = 4
TOKENS_PER_MICRO_BATCH = 2 * 8  # batch_size 2 x 8 tokens
# Micro-batch i of layer l: counts, aux loss, z-loss, dropped fraction, router entropy, task loss.
COUNTS = [
    [[10.0, 2.0, 2.0, 2.0], [4.0, 4.0, 4.0, 4.0]],
    [[2.0, 2.0, 2.0, 10.0], [8.0, 0.0, 4.0, 4.0]],
    [[0.0, 0.0, 0.0, 16.0], [1.0, 2.0, 3.0, 10.0]],
    [[16.0, 0.0, 0.0, 0.0], [3.0, 3.0, 5.0, 5.0]],
]
AUX = [[0.1, 0.2], [0.3, 0.4], [0.5, 0.6], [0.7, 0.8]]
Z = [[0.01, 0.02], [0.03, 0.04], [0.05, 0.06], [0.07, 0.08]]
DROPPED = [[0.0, 0.5], [0.25, 0.5], [0.0, 0.0], [0.5, 0.0]]
ENTROPY = [[1.0, 1.1], [1.2, 1.3], [1.4, 1.5], [1.6, 1.7]]
LOSSES = [4.0, 3.0, 2.5, 1.5]


class FakeStatsModule(pl.LightningModule):
    """Two real ``MoELayer``s whose ``stats`` each training step overwrites with the tables above."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(MoELayer(8, 16, num_experts=NUM_EXPERTS, top_k=1) for _ in range(2))
        self.weight = torch.nn.Parameter(torch.zeros(()))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        for layer_idx, layer in enumerate(self.layers):
            layer.stats = {
                "tokens_per_expert": torch.tensor(COUNTS[batch_idx][layer_idx]),
                "aux_loss": torch.tensor(AUX[batch_idx][layer_idx]),
                "z_loss": torch.tensor(Z[batch_idx][layer_idx]),
                "dropped_fraction": torch.tensor(DROPPED[batch_idx][layer_idx]),
                "router_entropy": torch.tensor(ENTROPY[batch_idx][layer_idx]),
            }
        return self.weight * 0.0 + LOSSES[batch_idx]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self) -> DataLoader:
        samples = [{"input_ids": torch.zeros(8, dtype=torch.long)} for _ in range(2 * len(LOSSES))]
        return DataLoader(samples, batch_size=2)


class RecordingLogger(Logger):
    """Keeps every ``log_metrics`` call."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.records.append((step, dict(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def _moe_records(logger: RecordingLogger) -> list[tuple[int, dict[str, float]]]:
    return [(step, m) for step, m in logger.records if "moe/load_imbalance" in m]


def _expected_step(step: int) -> dict[str, Any]:
    """Per-layer values of optimizer step ``step`` (micro-batches 2*step and 2*step+1)."""
    micro = (2 * step, 2 * step + 1)
    counts = [torch.tensor(COUNTS[micro[0]][layer]) + torch.tensor(COUNTS[micro[1]][layer]) for layer in range(2)]

    def mean(table: list[list[float]], layer: int) -> float:
        return sum(table[i][layer] for i in micro) / 2

    return {
        "counts": counts,
        "imbalance": [float(c.max() / c.mean()) for c in counts],
        "aux_loss": [mean(AUX, layer) for layer in range(2)],
        "z_loss": [mean(Z, layer) for layer in range(2)],
        "dropped_fraction": [mean(DROPPED, layer) for layer in range(2)],
        "router_entropy": [mean(ENTROPY, layer) for layer in range(2)],
    }


@pytest.fixture
def fitted(tmp_path: Path) -> SimpleNamespace:
    """Two optimizer steps of two micro-batches each."""
    logger = RecordingLogger()
    metrics_cb, summary_cb = MoEMetricsCallback(), SummaryCallback(dirpath=tmp_path)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        accumulate_grad_batches=2,
        log_every_n_steps=1,
        logger=logger,
        callbacks=[metrics_cb, summary_cb],
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(FakeStatsModule())
    return SimpleNamespace(logger=logger, metrics_cb=metrics_cb, summary_cb=summary_cb, path=tmp_path / "summary.json")


def test_metrics_are_logged_once_per_optimizer_step(fitted):
    records = _moe_records(fitted.logger)
    # Lightning's step numbering (the step of the training loss): 0 and 1.
    assert [step for step, _ in records] == [0, 1]
    for step, metrics in records:
        expected = _expected_step(step)
        for layer in range(2):
            assert metrics[f"moe/layer{layer}/load_imbalance"] == pytest.approx(expected["imbalance"][layer])
            for name in MoEMetricsCallback.SCALARS:
                assert metrics[f"moe/layer{layer}/{name}"] == pytest.approx(expected[name][layer])
        assert metrics["moe/load_imbalance"] == pytest.approx(sum(expected["imbalance"]) / 2)
        for name in MoEMetricsCallback.SCALARS:
            assert metrics[f"moe/{name}"] == pytest.approx(sum(expected[name]) / 2)


def test_imbalance_is_max_over_mean_of_the_summed_counts(fitted):
    # Step 1, layer 0: [0,0,0,16] + [16,0,0,0] is unbalanced per micro-batch (4.0 each) but only
    # 2.0 over the optimizer step: the callback sums counts before taking max/mean.
    _, metrics = _moe_records(fitted.logger)[1]
    assert metrics["moe/layer0/load_imbalance"] == pytest.approx(2.0)


def test_per_layer_keys_can_be_switched_off(tmp_path):
    logger = RecordingLogger()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=1, log_every_n_steps=1, logger=logger,
        callbacks=[MoEMetricsCallback(per_layer=False)], enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False, default_root_dir=tmp_path,
    )
    trainer.fit(FakeStatsModule())
    (_, metrics), = _moe_records(logger)
    assert not any(key.startswith("moe/layer") for key in metrics)


def test_summary_json_contents(fitted):
    summary = json.loads(fitted.path.read_text())
    assert set(summary) == {"layout", "losses", "final_loss", "tokens_per_second", "expert_load"}
    assert summary["layout"] == {"tp": 1, "cp": 1, "ep": 1, "dp": 1, "pp": 1, "etp": 1}
    # The mean of each step's micro-batch losses, although Lightning hands callbacks loss / 2.
    assert summary["losses"] == pytest.approx([(LOSSES[0] + LOSSES[1]) / 2, (LOSSES[2] + LOSSES[3]) / 2])
    assert summary["final_loss"] == pytest.approx(summary["losses"][-1])
    assert summary["tokens_per_second"] > 0
    last = _expected_step(1)["counts"]
    assert summary["expert_load"] == {f"layer{i}": last[i].tolist() for i in range(2)}
    assert fitted.summary_cb.path == fitted.path
    assert [p.name for p in fitted.path.parent.iterdir() if p.name.endswith(".tmp")] == []


def test_data_parallel_sum_counts_each_sample_once():
    # 4 ranks, 2 of them data-parallel (e.g. tp=2): every value is held by 2 ranks, so the raw
    # sum over all ranks is twice the sum over the data-parallel ranks.
    strategy = SimpleNamespace(
        reduce=lambda tensor, reduce_op: tensor * 4,  # 4 ranks holding equal values
        distributed_sampler_kwargs={"num_replicas": 2, "rank": 0},
    )
    trainer = SimpleNamespace(world_size=4, strategy=strategy)
    value = torch.tensor([3.0, 1.0])
    assert torch.equal(data_parallel_sum(trainer, value), value * 2)


def test_layout_comes_from_the_strategy_parallel_dims():
    dims = ParallelDims(ep=2, dp=2)
    trainer = SimpleNamespace(strategy=SimpleNamespace(parallel_dims=dims), world_size=4)
    assert parallel_layout(trainer) == {"tp": 1, "cp": 1, "ep": 2, "dp": 2, "pp": 1, "etp": 1}
    plain_ddp = SimpleNamespace(strategy=SimpleNamespace(), world_size=3)
    assert parallel_layout(plain_ddp) == {"tp": 1, "cp": 1, "ep": 1, "dp": 3, "pp": 1, "etp": 1}


def test_write_json_atomic_keeps_the_old_file_on_failure(tmp_path):
    path = tmp_path / "summary.json"
    write_json_atomic(path, {"final_loss": 1.0})
    with pytest.raises(TypeError):
        write_json_atomic(path, {"final_loss": object()})  # not JSON-serialisable, fails mid-write
    assert json.loads(path.read_text()) == {"final_loss": 1.0}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]

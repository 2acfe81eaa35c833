"""The observability callbacks on hand-made router statistics (one process, in-process Trainer)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import matplotlib.image
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader

from lightning_moe import ParallelDims
from lightning_moe.callbacks import (
    CommAccountingCallback,
    ExpertLoadPlotCallback,
    MoEMetricsCallback,
    OptimizerStepCallback,
    SummaryCallback,
    ThroughputCallback,
    active_parameters,
    data_parallel_sum,
    load_metrics,
    model_flops_per_token,
    parallel_layout,
    plot_expert_load,
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
    """Two real ``MoELayer``s whose ``stats`` each training step overwrites with the tables above.

    With ``expert_bias``, layer ``l``'s bias is ``[l + 1, 0, 0, 0] * (global_step + 1)`` during a step
    (its norm is ``(l + 1) * (step + 1)``), changed after each optimizer step as the real update does.
    """

    def __init__(self, expert_bias: bool = False, fail_at_batch: int | None = None) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            MoELayer(8, 16, num_experts=NUM_EXPERTS, top_k=1, expert_bias=expert_bias) for _ in range(2)
        )
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.fail_at_batch = fail_at_batch
        self._set_biases(step=0)

    def _set_biases(self, step: int) -> None:
        for layer_idx, layer in enumerate(self.layers):
            if layer.router.use_expert_bias:
                layer.router.expert_bias.copy_(torch.tensor([layer_idx + 1.0, 0.0, 0.0, 0.0]) * (step + 1))

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        self._set_biases(step=self.trainer.global_step + 1)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if batch_idx == self.fail_at_batch:
            raise RuntimeError("boom")
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
        "load_cv": [float(c.std(correction=0) / c.mean()) for c in counts],
        "no_token_fraction": [float((c == 0).float().mean()) for c in counts],
        "aux_loss": [mean(AUX, layer) for layer in range(2)],
        "z_loss": [mean(Z, layer) for layer in range(2)],
        "dropped_fraction": [mean(DROPPED, layer) for layer in range(2)],
        "router_entropy": [mean(ENTROPY, layer) for layer in range(2)],
    }


def _fit(
    tmp_path: Path, callbacks: list[Any], module: pl.LightningModule | None = None, **trainer_kwargs: Any
) -> RecordingLogger:
    logger = RecordingLogger()
    kwargs: dict[str, Any] = dict(
        accelerator="cpu", devices=1, max_steps=2, accumulate_grad_batches=2, log_every_n_steps=1, logger=logger,
        callbacks=callbacks, enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    trainer = pl.Trainer(**{**kwargs, **trainer_kwargs})
    trainer.fit(module or FakeStatsModule())
    return logger


@pytest.fixture
def fitted(tmp_path: Path) -> SimpleNamespace:
    """Two optimizer steps of two micro-batches each, with every observability callback."""
    metrics_cb, summary_cb = MoEMetricsCallback(), SummaryCallback(dirpath=tmp_path)
    plots_cb, comm_cb, throughput_cb = (
        ExpertLoadPlotCallback(every_n_steps=1),
        CommAccountingCallback(),
        ThroughputCallback(),
    )
    logger = _fit(tmp_path, [plots_cb, metrics_cb, comm_cb, throughput_cb, summary_cb])
    return SimpleNamespace(
        logger=logger, metrics_cb=metrics_cb, summary_cb=summary_cb, plots_cb=plots_cb, path=tmp_path / "summary.json"
    )


def test_metrics_are_logged_once_per_optimizer_step(fitted):
    records = _moe_records(fitted.logger)
    # Lightning's step numbering (the step of the training loss): 0 and 1.
    assert [step for step, _ in records] == [0, 1]
    for step, metrics in records:
        expected = _expected_step(step)
        expected["load_imbalance"] = expected.pop("imbalance")
        for name in (*MoEMetricsCallback.SCALARS, "load_imbalance", "load_cv", "no_token_fraction"):
            per_layer = expected[name]
            for layer in range(2):
                assert metrics[f"moe/layer{layer}/{name}"] == pytest.approx(per_layer[layer]), name
            # Summaries over the 2 layers: mean, linear-interpolated percentiles, max.
            low, high = sorted(per_layer)
            assert metrics[f"moe/{name}"] == pytest.approx((low + high) / 2), name
            assert metrics[f"moe/{name}_p50"] == pytest.approx(low + 0.5 * (high - low)), name
            assert metrics[f"moe/{name}_p90"] == pytest.approx(low + 0.9 * (high - low)), name
            assert metrics[f"moe/{name}_max"] == pytest.approx(high), name
        # No layer has an expert bias: no bias keys.
        assert not any("expert_bias_norm" in key for key in metrics)


def test_imbalance_is_max_over_mean_of_the_summed_counts(fitted):
    # Step 1, layer 0: [0,0,0,16] + [16,0,0,0] is unbalanced per micro-batch (4.0 each) but only
    # 2.0 over the optimizer step: the callback sums counts before taking max/mean.
    _, metrics = _moe_records(fitted.logger)[1]
    assert metrics["moe/layer0/load_imbalance"] == pytest.approx(2.0)


def test_per_layer_keys_can_be_switched_off(tmp_path):
    logger = _fit(
        tmp_path, [MoEMetricsCallback(per_layer=False, percentiles=[25])], max_steps=1, accumulate_grad_batches=1
    )
    ((_, metrics),) = _moe_records(logger)
    assert not any(key.startswith("moe/layer") for key in metrics)
    assert "moe/aux_loss_p25" in metrics and "moe/aux_loss_p50" not in metrics


def test_expert_bias_norm_is_the_bias_that_routed_the_step(tmp_path):
    logger = _fit(tmp_path, [MoEMetricsCallback()], module=FakeStatsModule(expert_bias=True))
    for step, metrics in _moe_records(logger):
        # Read before the step's forward, not after its optimizer step changed it.
        assert metrics["moe/layer0/expert_bias_norm"] == pytest.approx(1.0 * (step + 1))
        assert metrics["moe/layer1/expert_bias_norm"] == pytest.approx(2.0 * (step + 1))
        assert metrics["moe/expert_bias_norm_max"] == pytest.approx(2.0 * (step + 1))


def test_load_metrics_by_hand():
    metrics = load_metrics(torch.tensor([4.0, 0.0, 2.0, 2.0]))
    assert metrics["load_imbalance"] == pytest.approx(2.0)
    assert metrics["load_cv"] == pytest.approx(2**0.5 / 2)  # std sqrt(2), mean 2
    assert metrics["no_token_fraction"] == pytest.approx(0.25)


def test_progress_bar_shows_loss_rate_aux_loss_and_imbalance(tmp_path):
    metrics_cb, throughput_cb = MoEMetricsCallback(), ThroughputCallback(peak_flops_per_device=1e9)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False, callbacks=[metrics_cb, throughput_cb],
        enable_checkpointing=False, enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(FakeStatsModule())
    bar = trainer.progress_bar_callback.get_metrics(trainer, trainer.lightning_module)
    assert {"aux_loss", "imbalance", "tokens/s"} <= set(bar)
    assert bar["imbalance"] == pytest.approx(metrics_cb.metrics["moe/load_imbalance"])


def test_summary_json_contents(fitted):
    summary = json.loads(fitted.path.read_text())
    assert set(summary) == {
        "layout", "losses", "final_loss", "tokens_per_second", "expert_load", "moe_metrics", "moe_history",
        "load_imbalance_per_layer", "comm", "model_flops_per_token", "peak_flops_per_device", "mfu",
    }  # fmt: skip
    assert summary["layout"] == {"tp": 1, "cp": 1, "ep": 1, "dp": 1, "pp": 1, "etp": 1}
    # The mean of each step's micro-batch losses, although Lightning hands callbacks loss / 2.
    assert summary["losses"] == pytest.approx([(LOSSES[0] + LOSSES[1]) / 2, (LOSSES[2] + LOSSES[3]) / 2])
    assert summary["final_loss"] == pytest.approx(summary["losses"][-1])
    assert summary["tokens_per_second"] > 0
    last = _expected_step(1)["counts"]
    assert summary["expert_load"] == {f"layer{i}": last[i].tolist() for i in range(2)}
    assert fitted.summary_cb.path == fitted.path
    assert [p.name for p in fitted.path.parent.iterdir() if p.name.endswith(".tmp")] == []
    # Per-step history for reports: the mean over layers of every metric, and each layer's imbalance.
    steps = [_expected_step(step) for step in range(2)]
    assert summary["moe_history"]["load_imbalance"] == pytest.approx([sum(e["imbalance"]) / 2 for e in steps])
    assert summary["moe_history"]["aux_loss"] == pytest.approx([sum(e["aux_loss"]) / 2 for e in steps])
    assert summary["load_imbalance_per_layer"] == {
        f"layer{i}": pytest.approx([e["imbalance"][i] for e in steps]) for i in range(2)
    }
    assert summary["moe_metrics"] == fitted.metrics_cb.metrics
    # One process: no communication, but every dim reported.
    assert summary["comm"] == {dim: {"bytes": 0.0, "calls": 0.0} for dim in ("tp", "cp", "ep", "dp", "pp")}
    assert summary["model_flops_per_token"] > 0 and 0 < summary["mfu"]


def test_every_logged_key_group_is_there(fitted):
    keys = set().union(*(metrics for _, metrics in fitted.logger.records))
    for dim in ("tp", "cp", "ep", "dp", "pp"):
        assert {f"comm/{dim}_bytes", f"comm/{dim}_calls"} <= keys
    assert {"comm/total_bytes", "perf/tokens_per_second", "perf/mfu", "perf/model_flops_per_second"} <= keys
    assert "moe/load_cv_p90" in keys and "moe/no_token_fraction_max" in keys


def test_heatmaps_every_n_steps_and_imbalance_plot_at_the_end(fitted, tmp_path):
    plots = tmp_path / "plots"
    assert sorted(p.name for p in plots.iterdir()) == [
        "expert_load_step000001.png", "expert_load_step000002.png", "load_imbalance.png",
    ]  # fmt: skip
    assert all(p.stat().st_size > 0 for p in plots.iterdir())
    assert fitted.plots_cb.paths == [
        plots / "expert_load_step000001.png",
        plots / "expert_load_step000002.png",
        plots / "load_imbalance.png",
    ]


def test_heatmap_matrix_is_layers_by_experts(tmp_path):
    counts = [[10.0, 2.0, 2.0, 2.0], [4.0, 4.0, 4.0, 4.0], [0.0, 0.0, 8.0, 0.0]]
    path = tmp_path / "heatmap.png"
    shares = plot_expert_load(counts, path, title="test")
    assert shares.shape == (3, 4)
    np.testing.assert_allclose(shares.sum(1), 1.0)
    np.testing.assert_allclose(shares[0], [10 / 16, 2 / 16, 2 / 16, 2 / 16])
    assert path.stat().st_size > 0
    assert matplotlib.image.imread(path).shape[-1] in (3, 4)  # a readable RGB(A) PNG
    # Layers with fewer experts are padded, not stretched.
    assert np.isnan(plot_expert_load([[1.0, 1.0], [1.0, 1.0, 2.0]], tmp_path / "uneven.png")[0, 2])


def test_plot_callback_needs_the_metrics_callback(tmp_path):
    with pytest.raises(ValueError, match="add MoEMetricsCallback"):
        _fit(tmp_path, [ExpertLoadPlotCallback()])


def test_optimizer_step_hooks_follow_gradient_accumulation(tmp_path):
    events: list[tuple[str, int]] = []

    class Recorder(OptimizerStepCallback):
        def on_step_start(self, trainer, pl_module, batch):
            events.append(("start", trainer.global_step))

        def on_micro_batch_end(self, trainer, pl_module, outputs, batch):
            events.append(("micro", trainer.global_step))

        def on_step_end(self, trainer, pl_module):
            events.append(("end", trainer.global_step))

    _fit(tmp_path, [Recorder()])
    assert events == [
        ("start", 0),
        ("micro", 0),
        ("micro", 1),
        ("end", 1),
        ("start", 1),
        ("micro", 1),
        ("micro", 2),
        ("end", 2),
    ]


def test_model_flops_per_token_counts_active_parameters_and_attention():
    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.num_heads, self.head_dim = 2, 4
            self.proj = torch.nn.Linear(8, 8, bias=False)  # 64 parameters

    model = torch.nn.ModuleDict({
        "embed": torch.nn.Embedding(10, 8),  # a lookup: no FLOPs
        "attention": Attention(),
        "moe": MoELayer(8, 16, num_experts=4, top_k=1),  # router 32, experts 3 * 4 * 8 * 16 = 1536
    })  # fmt: skip
    assert active_parameters(model) == 64 + 32 + 1536 / 4
    assert model_flops_per_token(model, seq_len=5) == 6 * (64 + 32 + 384) + 12 * (2 * 4) * 5


def test_failed_run_writes_error_txt_and_no_summary(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        _fit(
            tmp_path,
            [MoEMetricsCallback(), CommAccountingCallback(), SummaryCallback()],
            module=FakeStatsModule(fail_at_batch=1),
        )
    assert not (tmp_path / "summary.json").exists()
    assert (tmp_path / "error.txt").read_text() == "RuntimeError: boom\n"


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

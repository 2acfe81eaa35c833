"""The health checks (docs/health.md): faults injected on one rank are found, attributed and handled,
and a run with a transient fault gives the one-process losses."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import lightning as L
import pytest
import torch

from lightning_moe.health import (
    EXIT_PERSISTENT,
    FAULT_MARKER,
    ExpertStarvation,
    FaultInjection,
    HealthCallback,
    SpikeDetection,
    StragglerDetection,
)
from lightning_moe.health.callback import _ranges
from lightning_moe.health.stragglers import straggler_ratio
from lightning_moe.moe import MoELayer
from tests.cli import NO_PLOTS, TINY_RUN, train_in_pool

REL = 1e-5  # the layouts' tolerance against one process (tests/test_strategy_invariance.py)
INJECT_AT_5_ON_RANK_1 = ["health.inject.step=5", "health.inject.rank=1"]


def _same_curve(losses: list[float], reference: list[float]) -> None:
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=REL, atol=0.0)


@pytest.fixture
def single_losses(one_process_losses) -> list[float]:
    return one_process_losses()


# -- settings ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("build", "named"),
    [
        (lambda: HealthCallback(nonfinite="retry"), "health.nonfinite='retry'"),
        (lambda: HealthCallback(max_transient_faults=-1), "health.max_transient_faults=-1"),
        (lambda: SpikeDetection(action="rollback_now"), "health.spike.action='rollback_now'"),
        (lambda: SpikeDetection(window=2), "health.spike.window=2"),
        (lambda: StragglerDetection(threshold=0.9), "health.straggler.threshold=0.9"),
        (lambda: ExpertStarvation(min_load_fraction=1.5), "health.expert.min_load_fraction=1.5"),
        (lambda: FaultInjection(kind="nan"), "health.inject.kind='nan'"),
        (lambda: FaultInjection(kind="nan_grad", times=0), "health.inject.times=0"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(build, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(".", r"\.")):
        build()


def test_a_spike_is_a_robust_outlier_and_stays_out_of_the_window():
    spikes = SpikeDetection(window=5, zscore=4.0, action="skip")
    for loss in (3.0, 3.1, 2.9, 3.05, 2.95):
        assert spikes.observe(loss) is None  # the window fills first
    z = spikes.observe(9.0)
    assert spikes.is_spike(z) and z > 50
    assert not spikes.is_spike(spikes.observe(3.02))  # the spike did not widen the spread
    assert spikes.is_spike(spikes.observe(4.5))


def test_a_starving_expert_and_a_lopsided_layer_are_named_once_after_patience():
    watch = ExpertStarvation(min_load_fraction=0.1, patience=3, max_load_ratio=3.0)
    loads = [[100.0, 100.0, 100.0, 1.0], [385.0, 5.0, 5.0, 5.0]]
    found = [watch.observe(step, loads) for step in range(1, 6)]
    assert found[0] == found[1] == found[3] == found[4] == []
    assert [(f["kind"], f["layer"], f.get("expert")) for f in found[2]] == [
        ("starving_expert", 0, 3),
        ("starving_expert", 1, 1),
        ("starving_expert", 1, 2),
        ("starving_expert", 1, 3),
        ("lopsided_layer", 1, None),
    ]


def test_straggler_ratio_and_sample_ranges():
    assert straggler_ratio([1.0, 1.1, 0.9, 3.0]) == (3.0 / 1.05, 3)
    assert _ranges([9, 3, 4, 5, 12, 11]) == "3-5, 9, 11-12"


# -- runs -------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(
    ("preset", "kind"),
    [("ep2", "nan_grad"), ("tp2_ep2_folded", "nan_grad"), ("pp2_ep2", "nan_loss"), ("cp2", "nan_loss")],
)
def test_a_transient_fault_is_rerun_and_gives_the_one_process_losses(tmp_path, single_losses, preset, kind):
    """A NaN in rank 1's gradients (or loss) at step 5, on the first execution of that step only: the
    step runs again on the same data, finite, and its update is used; the run's losses are the
    one-process ones (rel 1e-5, 10 steps) and one transient fault is recorded at step 5, seen on rank 1."""
    summary = train_in_pool(
        tmp_path / "run", f"parallel={preset}", f"health.inject.kind={kind}", *INJECT_AT_5_ON_RANK_1
    )
    _same_curve(summary["losses"], single_losses)
    faults = summary["health"]["transient_faults"]
    assert len(faults) == 1 and faults[0]["step"] == 5 and 1 in faults[0]["ranks"], faults


@pytest.mark.slow
def test_a_persistent_fault_stops_names_step_rank_module_and_samples_and_resumes_from_a_good_checkpoint(
    tmp_path, single_losses
):
    """A NaN gradient at step 5 on rank 1 on every execution: the run stops (no update of step 5), the
    error names step 5, rank 1, the MoE layer and the samples; the marker keeps a restart from looping;
    without the fault (marker removed), ckpt_path=auto resumes from step 4's checkpoint and gives the
    one-process losses, so no checkpoint held a non-finite tensor."""
    run_dir = tmp_path / "run"
    checkpoints = ["callbacks=checkpoint", "callbacks.checkpoint.every_n_train_steps=2"]
    persistent = ["parallel=ep2", "health.inject.kind=nan_grad", "health.inject.times=-1", *INJECT_AT_5_ON_RANK_1]
    with pytest.raises(AssertionError) as failed:
        train_in_pool(run_dir, *persistent, *checkpoints)
    message = str(failed.value)
    assert "PersistentFaultError: persistent fault at step 5" in message
    assert "started on rank 1, the gradient of layers.1.feed_forward" in message
    marker = json.loads((run_dir / FAULT_MARKER).read_text())
    assert (marker["step"], marker["rank"], marker["module"]) == (5, 1, "layers.1.feed_forward")
    assert marker["sample_index"] and "samples of rank 1's batches: " + _ranges(marker["sample_index"]) in message
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_000002.ckpt", "step_000004.ckpt"]

    with pytest.raises(AssertionError, match="an earlier attempt of this run stopped on a persistent fault at step 5"):
        train_in_pool(run_dir, "parallel=ep2", "ckpt_path=auto", *checkpoints)
    (run_dir / FAULT_MARKER).unlink()
    resumed = train_in_pool(run_dir, "parallel=ep2", "ckpt_path=auto", *checkpoints)
    _same_curve(resumed["losses"], single_losses[4:])


@pytest.mark.slow
def test_skip_drops_the_update_and_a_starving_expert_is_named(tmp_path):
    """health.nonfinite=skip with a NaN gradient at step 5 on every execution: the run goes on, and step 5
    changes neither parameters, optimizer state nor expert biases on any rank. An expert kept out by a
    router bias is named for every MoE layer after health.expert.patience steps."""
    run_dir = tmp_path / "run"
    summary = train_in_pool(
        run_dir,
        "parallel=ep2",
        "health.nonfinite=skip",
        "health.inject.kind=nan_grad",
        "health.inject.times=-1",
        *INJECT_AT_5_ON_RANK_1,
        "model.moe.expert_bias=true",
        "model.moe.load_balancing=none",
        "health.expert.patience=3",
        "health.expert.min_load_fraction=0.2",
        "+callbacks.starve._target_=tests.health_helpers.StarveExpert",
        "+callbacks.trace._target_=tests.health_helpers.StateTrace",
    )
    health = summary["health"]
    assert [(s["step"], s["reason"]) for s in health["skipped_steps"]] == [(5, "nonfinite")]
    assert len(summary["losses"]) == 10 and all(math.isfinite(x) for x in summary["losses"][6:])
    for rank in (0, 1):
        trace = json.loads((run_dir / f"state_rank{rank}.json").read_text())
        assert trace["6"] == trace["5"], (rank, trace)  # the skipped step
        assert trace["5"] != trace["4"] and trace["7"] != trace["6"]  # the steps around it did update
    starving = [(w["layer"], w["expert"], w["step"]) for w in health["experts"] if w["kind"] == "starving_expert"]
    assert starving == [(0, 3, 3), (1, 3, 3)], health["experts"]


@pytest.mark.slow
def test_a_flipped_gradient_bit_is_caught_by_the_silent_data_corruption_check(tmp_path):
    with pytest.raises(AssertionError) as failed:
        train_in_pool(
            tmp_path / "run",
            "parallel=tp2_ep2_folded",
            "health.inject.kind=bitflip_grad",
            "health.sdc_check_every_n_steps=2",
            "health.inject.step=5",
            "health.inject.rank=1",
        )
    message = str(failed.value)
    assert "RestartRequestedError: silent data corruption at step 5" in message
    assert (
        "first on rank 1" in message and "parameter layers.0.attention.wq.weight" in message
    )  # the first with a gradient


@pytest.mark.slow
def test_a_slow_rank_is_named_as_the_straggler(tmp_path):
    summary = train_in_pool(
        tmp_path / "run",
        "parallel=ep2",
        "health.straggler.every_n_steps=2",
        "health.inject.kind=sleep",
        "health.inject.sleep_s=1.0",
        "health.inject.step=4",
        "health.inject.rank=1",
    )
    stragglers = summary["health"]["stragglers"]
    assert [(s["step"], s["rank"]) for s in stragglers] == [(4, 1)], stragglers
    assert stragglers[0]["ratio"] > 1.5


@pytest.mark.slow
def test_a_loss_spike_is_skipped(tmp_path):
    summary = train_in_pool(
        tmp_path / "run",
        "parallel=single",
        "health.spike.window=4",
        "health.spike.zscore=6",
        "health.spike.action=skip",
        "health.inject.kind=loss_spike",
        "health.inject.step=6",
    )
    health = summary["health"]
    assert [s["step"] for s in health["spikes"]] == [6] and health["spikes"][0]["zscore"] > 6
    assert [(s["step"], s["reason"]) for s in health["skipped_steps"]] == [(6, "loss spike")]


@pytest.mark.slow
def test_the_cli_exits_with_the_persistent_fault_code(tmp_path):
    """What a launcher sees: exit code 17 and the error on stderr (one process, a NaN loss at step 3 on
    every execution)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable, "-m", "lightning_moe.train", *TINY_RUN, NO_PLOTS, f"hydra.run.dir={tmp_path / 'run'}",
        "health.inject.kind=nan_loss", "health.inject.step=3", "health.inject.times=-1",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == EXIT_PERSISTENT, proc.stderr[-3000:]
    assert "PersistentFaultError: persistent fault at step 3" in proc.stderr
    assert "the output of output" in proc.stderr  # the model's last module, where the injection put the NaN


@pytest.mark.slow
def test_a_rollback_resumes_before_the_spike_and_drops_the_window(tmp_path):
    """health.spike.action=rollback: a spike at step 7 stops the run (a restart asked); restarted with
    ckpt_path=auto it resumes from step 6's checkpoint, drops the updates of steps 6 and 7 (their
    samples logged) and trains on. Without periodic checkpoints rollback is refused before training."""
    run_dir = tmp_path / "run"
    rollback = ["parallel=single", "health.spike.window=4", "health.spike.action=rollback"]
    with pytest.raises(AssertionError, match="MisconfigurationException: health.spike.action=rollback resumes"):
        train_in_pool(tmp_path / "no_checkpoints", *rollback)
    checkpoints = ["callbacks=checkpoint", "callbacks.checkpoint.every_n_train_steps=2"]
    spike = ["health.inject.kind=loss_spike", "health.inject.step=7"]
    with pytest.raises(AssertionError, match="RestartRequestedError: loss spike at step 7"):
        train_in_pool(run_dir, *rollback, *checkpoints, *spike)
    assert json.loads((run_dir / "health" / "rollback.json").read_text())["to_step"] == 7
    resumed = train_in_pool(run_dir, *rollback, *checkpoints, "ckpt_path=auto")
    skipped = resumed["health"]["skipped_steps"]
    assert [(s["step"], s["reason"]) for s in skipped] == [(6, "rollback"), (7, "rollback")]
    assert all(s["sample_index"][0].isdigit() for s in skipped)
    assert len(resumed["losses"]) == 4 and (run_dir / "health" / "rollback_done_step7.json").exists()


@pytest.mark.slow
def test_more_transient_faults_than_allowed_ask_for_a_restart(tmp_path):
    with pytest.raises(AssertionError, match=r"RestartRequestedError: 1 transient faults \(more than health\.max"):
        train_in_pool(
            tmp_path / "run", "parallel=single", "health.max_transient_faults=0", "health.inject.kind=nan_grad",
            "health.inject.step=2",
        )  # fmt: skip


class _TinyMoELM(L.LightningModule):
    """A user's own module (README's example): embedding, one MoE layer, head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)
        self.moe = MoELayer(16, 32, num_experts=4, top_k=2)
        self.head = torch.nn.Linear(16, 64)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.head(self.moe(self.embed(batch[:, :-1])))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit_tiny(tmp_path, *callbacks) -> _TinyMoELM:
    torch.manual_seed(0)
    module = _TinyMoELM()
    data = torch.utils.data.DataLoader(torch.randint(0, 64, (32, 9)), batch_size=4)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=6, accumulate_grad_batches=2, callbacks=list(callbacks),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(module, data)
    return module


@pytest.mark.slow
def test_the_callback_in_a_plain_trainer_reruns_a_users_module(tmp_path):
    """HealthCallback() in a user's Trainer (no lightning-moe strategy, 2 micro-batches per step): a
    transient NaN gradient at step 3 is rerun, and the parameters end as without the fault."""
    health = HealthCallback(inject=FaultInjection(kind="nan_grad", step=3))
    faulted = _fit_tiny(tmp_path / "faulted", health)
    clean = _fit_tiny(tmp_path / "clean")
    assert [(f["step"], f["ranks"]) for f in health.transient_faults] == [(3, [0])]
    for a, b in zip(faulted.parameters(), clean.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_step_check_takes_empty_shards_and_finds_a_nan(tmp_path):
    """The per-step check on one rank: an empty local shard (FSDP's of a small parameter on many ranks)
    has no max-abs norm and is left out; a NaN anywhere else is found, and so is a non-finite loss."""
    trainer = type(
        "Trainer",
        (),
        {"world_size": 1, "global_rank": 0, "strategy": type("S", (), {"root_device": torch.device("cpu")})},
    )()
    health = HealthCallback()
    empty, finite = torch.nn.Parameter(torch.zeros(0)), torch.nn.Parameter(torch.ones(3))
    empty.grad, finite.grad = torch.zeros(0), torch.ones(3)
    assert health._check(trainer, [empty, finite], None) == ([], None, None)
    finite.grad[1] = math.nan
    assert health._check(trainer, [empty, finite], None)[0] == [0]
    finite.grad[1] = 0.0
    health.on_before_backward(trainer, None, torch.tensor(math.inf))
    assert health._check(trainer, [empty, finite], None)[0] == [0]

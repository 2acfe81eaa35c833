"""The Hydra config tree: every option composes and builds; the CLI writes summary.json and W&B runs.

CLI tests run ``python -m lightning_moe.train`` in a subprocess: Lightning's launcher re-executes
``sys.argv``, which under pytest would re-run pytest.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar
from lightning.pytorch.loggers import CSVLogger, WandbLogger
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from lightning_moe import MoE5DStrategy
from lightning_moe.callbacks import MoEMetricsCallback, SummaryCallback
from lightning_moe.conf import CONF_DIR
from lightning_moe.data import ByteTextDataModule
from lightning_moe.hf import HFMoEModule
from lightning_moe.models import MoEGPT
from lightning_moe.moe import MoELayer
from lightning_moe.train import build
from tests.dist_pool import trim_pools
from tests.presets import presets_this_torch_builds

GROUPS = ("model", "parallel", "data", "trainer", "logger", "callbacks", "experiment")
SUMMARY_KEYS = {"layout", "losses", "final_loss", "tokens_per_second", "expert_load"}
# A few steps of the tiny model, each CLI job in seconds.
QUICK = [
    "experiment=smoke",
    "data.seq_len=32",
    "data.global_batch_size=4",
    "model.hidden_size=32",
    "model.moe.ffn_hidden_size=32",
    "~callbacks.progress_bar",
]


def _options(group: str) -> list[str]:
    return sorted(path.stem for path in (CONF_DIR / group).glob("*.yaml"))


def _compose(tmp_path: Path, *overrides: str) -> DictConfig:
    """The config the CLI would build; the output dir is given since there is no Hydra run here."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=[f"trainer.default_root_dir={tmp_path}", *overrides])


def test_every_group_has_options():
    for group in GROUPS:
        assert _options(group), f"conf/{group}/ is empty"
    assert {"tiny", "mixtral_like", "deepseek_like"} <= set(_options("model"))
    assert {"single", "dp2", "ep2", "ep4", "dp2_ep2"} <= set(_options("parallel"))
    assert {"wandb", "csv", "none"} <= set(_options("logger"))


@pytest.mark.parametrize(
    "override", presets_this_torch_builds([f"{group}={option}" for group in GROUPS for option in _options(group)])
)
def test_every_option_composes_and_builds(tmp_path, override):
    cfg = _compose(tmp_path, override)
    assert {"seed", "parallel", "trainer", "model", "data", "logger", "callbacks"} <= set(cfg)
    mandatory = {
        "model=hf": "model.pretrained",
        "data=text": "data.tokenizer",
        "model=custom": "model._target_",
        "data=tokens": "data.blend",
    }
    if override in mandatory:
        # A local folder or a class is the user's to give: the option says so instead of guessing one.
        missing = mandatory[override]
        with pytest.raises(MissingMandatoryValue, match=missing):
            build(cfg)
        return
    built = build(cfg)
    assert isinstance(built.model, HFMoEModule if override.startswith("model=hf_") else MoEGPT)
    assert any(isinstance(m, MoELayer) for m in built.model.modules())
    assert isinstance(built.datamodule, ByteTextDataModule)
    strategy = built.trainer.strategy
    assert isinstance(strategy, MoE5DStrategy)
    assert built.trainer.num_devices == cfg.trainer.devices
    assert built.trainer.default_root_dir == str(tmp_path)
    callback_types = {type(c) for c in built.trainer.callbacks}
    assert {MoEMetricsCallback, SummaryCallback, RichProgressBar} <= callback_types
    checkpointing = any(isinstance(c, ModelCheckpoint) for c in built.trainer.callbacks)  # PeriodicCheckpoint is one
    assert checkpointing == (override == "callbacks=checkpoint")
    expected_loggers = {"logger=csv": [CSVLogger], "logger=none": []}.get(override, [WandbLogger])
    assert [type(logger) for logger in built.trainer.loggers] == expected_loggers


def test_model_presets_have_their_routing(tmp_path):
    deepseek = build(_compose(tmp_path, "model=deepseek_like", "logger=none")).model
    layer = next(m for m in deepseek.modules() if isinstance(m, MoELayer))
    router = layer.router
    assert router.score_func == "sigmoid" and router.use_expert_bias and router.num_groups is not None
    assert layer.shared_expert is not None
    mixtral = _compose(tmp_path, "model=mixtral_like").model
    assert (mixtral.moe.num_experts, mixtral.moe.top_k, mixtral.moe.score_func) == (8, 2, "softmax")
    assert mixtral.num_heads == 4 * mixtral.num_kv_heads


@pytest.mark.parametrize(
    "overrides,devices,sizes",
    [
        (["parallel=single"], 1, {"ep": 1, "dp": 1}),
        (["parallel=dp2"], 2, {"ep": 1, "dp": 2}),
        (["parallel=ep2"], 2, {"ep": 2, "dp": 1}),
        (["parallel=ep4"], 4, {"ep": 4, "dp": 1}),
        (["parallel=dp2_ep2"], 4, {"ep": 2, "dp": 2}),
        (["parallel.ep=2"], 2, {"ep": 2, "dp": 1}),
        (["parallel.ep=2", "trainer.devices=2"], 2, {"ep": 2, "dp": 1}),
        (["parallel=ep2", "trainer.devices=4"], 4, {"ep": 2, "dp": 2}),  # dp="auto" takes the rest
        (["parallel=dp2_ep2", "trainer.num_nodes=2"], 2, {"ep": 2, "dp": 2}),
    ],
)
def test_devices_follow_the_parallel_sizes(tmp_path, overrides, devices, sizes):
    cfg = _compose(tmp_path, *overrides)
    assert cfg.trainer.devices == devices
    # The strategy checks the sizes against the world size (and infers dp) when the Trainer is built.
    dims = build(cfg).trainer.strategy.parallel_dims
    assert {"ep": dims.ep, "dp": dims.dp} == sizes


def test_devices_that_do_not_split_over_nodes_are_an_error(tmp_path):
    cfg = _compose(tmp_path, "parallel=ep2", "trainer.num_nodes=4")
    with pytest.raises(Exception, match=r"2 processes, not divisible by trainer.num_nodes=4"):
        OmegaConf.to_container(cfg.trainer, resolve=True)


def test_wandb_is_offline_unless_the_user_sets_wandb_mode(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    cfg = _compose(tmp_path)
    assert cfg.logger.wandb.mode == "offline"
    assert cfg.logger.wandb.save_dir == str(tmp_path)  # beside summary.json
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))
    cfg = _compose(tmp_path)
    assert cfg.logger.wandb.mode == "online"
    assert cfg.logger.wandb.save_dir == str(tmp_path / "elsewhere")


def test_model_schedule_and_sequence_length_follow_trainer_and_data(tmp_path):
    cfg = _compose(tmp_path, "trainer.max_steps=7", "data.seq_len=48")
    assert cfg.model.max_steps == 7 and cfg.model.max_seq_len == 48


def _run_cli(cwd: Path, *args: str, env: dict[str, str] | None = None) -> str:
    """Run the CLI in ``cwd`` (not the checkout: it must work from anywhere); returns its stdout."""
    trim_pools()  # the launched processes get the cores but for a few idle pool ranks
    env = {**(os.environ if env is None else env), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "lightning_moe.train", *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc.stdout


def _check_summary(path: Path, steps: int) -> dict:
    summary = json.loads(path.read_text())
    assert SUMMARY_KEYS <= set(summary)
    assert len(summary["losses"]) == steps and summary["final_loss"] == summary["losses"][-1]
    assert all(math.isfinite(loss) for loss in summary["losses"])
    assert summary["tokens_per_second"] > 0
    return summary


@pytest.mark.slow
def test_multirun_writes_one_summary_per_job(tmp_path):
    sweep_dir = tmp_path / "sweep"
    _run_cli(tmp_path, "--multirun", "model.moe.top_k=1,2", "logger=csv", *QUICK, f"hydra.sweep.dir={sweep_dir}")
    for job, top_k in ((0, 1), (1, 2)):
        summary = _check_summary(sweep_dir / str(job) / "summary.json", steps=3)
        assert summary["layout"] == {"tp": 1, "cp": 1, "ep": 1, "dp": 1, "pp": 1, "etp": 1}
        # Dropless routing: every token reaches top_k experts (4 samples x 32 tokens per step).
        assert len(summary["expert_load"]) == 4  # the tiny model's MoE layers
        for load in summary["expert_load"].values():
            assert sum(load) == 4 * 32 * top_k
        header = (sweep_dir / str(job) / "csv" / "metrics.csv").read_text().splitlines()[0]
        assert "moe/load_imbalance" in header and "moe/layer1/aux_loss" in header


@pytest.fixture(scope="module")
def layouts_sweep(tmp_path_factory) -> tuple[Path, Path, str]:
    """One sweep over two layouts with the W&B logger, read by the two tests below: (sweep dir, W&B dir, stdout)."""
    tmp_path = tmp_path_factory.mktemp("layouts_sweep")
    sweep_dir, wandb_dir = tmp_path / "sweep", tmp_path / "wandb_home"
    env = {k: v for k, v in os.environ.items() if k != "WANDB_MODE"}  # the default must be offline
    env["WANDB_DIR"] = str(wandb_dir)
    stdout = _run_cli(
        tmp_path, "--multirun", "parallel=single,ep2", "logger=wandb", *QUICK, f"hydra.sweep.dir={sweep_dir}", env=env
    )
    return sweep_dir, wandb_dir, stdout


@pytest.mark.slow
def test_multirun_over_layouts_starts_processes_per_job(layouts_sweep):
    """Each job of a sweep launches its own processes (not the whole sweep again) with the same losses."""
    sweep_dir, _, _ = layouts_sweep
    single = _check_summary(sweep_dir / "0" / "summary.json", steps=3)
    ep2 = _check_summary(sweep_dir / "1" / "summary.json", steps=3)
    assert ep2["layout"]["ep"] == 2
    torch.testing.assert_close(torch.tensor(ep2["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=0.0)
    # Same global counts: the router may flip a near-tie token or two after 3 steps of float noise.
    for layer, load in single["expert_load"].items():
        assert sum(ep2["expert_load"][layer]) == sum(load)
        torch.testing.assert_close(
            torch.tensor(ep2["expert_load"][layer]), torch.tensor(load), rtol=0, atol=0.02 * sum(load)
        )
    assert sorted(p.name for p in sweep_dir.iterdir() if p.is_dir()) == ["0", "1"]


@pytest.mark.slow
def test_wandb_runs_offline_one_run_per_sweep_job(layouts_sweep):
    """One offline run per job, the multi-process job's included (its rank 0 logs)."""
    sweep_dir, wandb_dir, stdout = layouts_sweep
    offline_runs = sorted((wandb_dir / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 2  # the second job did not append to the first job's run
    for job, offline_run in enumerate(offline_runs):
        _check_summary(sweep_dir / str(job) / "summary.json", steps=3)
        assert list(offline_run.glob("run-*.wandb"))
        assert f"summary.json: {sweep_dir / str(job) / 'summary.json'}" in stdout
        assert f"W&B offline run: {offline_run}" in stdout


@pytest.mark.parametrize("preset", presets_this_torch_builds(_options("parallel")))
def test_every_preset_takes_every_strategy_argument(tmp_path, preset):
    """A user types ``parallel.<argument>=...``: every preset carries every MoE5DStrategy argument."""
    import inspect

    arguments = set(inspect.signature(MoE5DStrategy.__init__).parameters) - {"self"}
    cfg = _compose(tmp_path, f"parallel={preset}", "parallel.ranks_per_node=2", "parallel.timeout=60")
    assert arguments <= set(cfg.parallel), sorted(arguments - set(cfg.parallel))
    if preset in ("single", "auto"):
        return  # one process: ranks_per_node=2 is rightly refused there
    strategy = build(cfg).trainer.strategy
    assert strategy.parallel_dims.ranks_per_node == 2
    assert strategy._timeout.total_seconds() == 60

"""Any LightningModule, any preset: a user's own MoE module on every dimension, and every preset as typed.

The user module (tests/scripts/user_moe_module.py) is unlike MoEGPT: its own biased attention
projections, LayerNorms, learned positions, a ``blocks`` ModuleList, a tensor-parallel plan without
sequence-parallel styles (``tensor_parallel_plan(self)``), expert bias with gradient accumulation.
Each layout trains it 6 steps and must give the single-process losses (rel 1e-5) and expert biases.
Every run (the script's ``train``, the presets' ``lightning_moe.train.fit``) goes on the ranks of a test
pool (tests/dist_pool.py): the processes and their imports are paid once, not once per run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import InstantiationException
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_moe import MoE5DStrategy
from lightning_moe.conf import CONF_DIR
from lightning_moe.parallel.plans.tensor_parallel import call_plan
from lightning_moe.train import check_config
from tests.cli import TINY_RUN, compose_train_config, fit_on_this_rank
from tests.dist_pool import pool_of
from tests.presets import presets_this_torch_builds
from tests.scripts import user_moe_module

REL = 1e-5
STEPS = 6
FSDP_VIEW_WARNING = "returned a view tensor"


def _run_script(out_dir: Path, *args: str) -> dict:
    """Train the user module as ``python tests/scripts/user_moe_module.py OUT_DIR --steps 6 *args`` would,
    on the ranks of a test pool (processes started once, not once per run); the single process is a 1-rank pool."""
    options = user_moe_module.parse_args([str(out_dir), "--steps", str(STEPS), *args])
    world_size = options["tp"] * options["cp"] * options["ep"] * options["pp"]
    logs = pool_of(world_size).run(user_moe_module.train_on_this_rank, **options)
    biases: dict[str, list[float]] = {}
    for path in out_dir.glob("bias_rank*.json"):
        biases.update(json.loads(path.read_text()))  # pipeline ranks hold different blocks
    summary = json.loads((out_dir / "summary.json").read_text())
    # Every rank's warnings (all recorded, none shown once only), logs and prints.
    return {"losses": summary["losses"], "layout": summary["layout"], "biases": biases, "log": "".join(logs)}


@pytest.fixture(scope="module")
def single_run(tmp_path_factory) -> dict:
    return _run_script(tmp_path_factory.mktemp("user_single"))


LAYOUTS = [
    ("tp2_sp", ["--tp", "2"], {"tp": 2}),
    ("tp2_no_sp", ["--tp", "2", "--no-sp"], {"tp": 2}),
    ("ep2", ["--ep", "2"], {"ep": 2}),
    ("tp2_ep2", ["--tp", "2", "--ep", "2"], {"tp": 2, "ep": 2, "etp": 2}),
    ("tp2_etp1_ep2", ["--tp", "2", "--ep", "2", "--etp", "1"], {"tp": 2, "ep": 2, "etp": 1}),
    ("cp2_tp2", ["--cp", "2", "--tp", "2"], {"cp": 2, "tp": 2}),
    ("pp2", ["--pp", "2"], {"pp": 2}),
    # The second module: a sequence-parallel plan (a DTensor residual stream sharded on the sequence).
    ("sp_plan_tp2", ["--tp", "2", "--sp-plan"], {"tp": 2}),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,args,layout", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
def test_user_module_matches_single_process(tmp_path, single_run, name, args, layout):
    run = _run_script(tmp_path / name, *args)
    for key, value in layout.items():
        assert run["layout"][key] == value
    assert len(run["losses"]) == STEPS
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(single_run["losses"]), rtol=REL, atol=0.0)
    # The expert bias is updated by the strategy once per optimizer step (not per micro-batch),
    # from the loads of the whole global batch: the same values as on one process.
    assert run["biases"].keys() == single_run["biases"].keys() and run["biases"]
    for key, bias in run["biases"].items():
        torch.testing.assert_close(torch.tensor(bias), torch.tensor(single_run["biases"][key]), rtol=0.0, atol=1e-6)
    # No output is a view (FSDP would drop its backward hook on an in-place op), under tp too.
    assert FSDP_VIEW_WARNING not in run["log"]


def test_single_process_expert_bias_moves_once_per_optimizer_step(single_run):
    """4 micro-batches per step, 6 steps: each update moves a bias entry by rate * sign(...)."""
    from tests.scripts.user_moe_module import BIAS_UPDATE_RATE

    biases = torch.tensor(list(single_run["biases"].values()))
    assert biases.abs().max() > 0
    assert biases.abs().max() <= STEPS * BIAS_UPDATE_RATE + 1e-6
    steps_moved = biases / BIAS_UPDATE_RATE
    torch.testing.assert_close(steps_moved, steps_moved.round(), rtol=0.0, atol=1e-4)
    assert FSDP_VIEW_WARNING not in single_run["log"]


def test_both_plan_signatures_are_accepted():
    calls = []

    def without_keyword():
        calls.append(None)
        return {}

    def with_keyword(sequence_parallel: bool = True):
        calls.append(sequence_parallel)
        return {}

    def with_kwargs(**kwargs):
        calls.append(kwargs["sequence_parallel"])
        return {}

    for plan_fn in (without_keyword, with_keyword, with_kwargs):
        call_plan(plan_fn, sequence_parallel=False)
    assert calls == [None, False, False]


def test_data_parallel_none_with_replicas_is_refused_before_launch():
    import lightning as L

    for sizes, devices in (({"dp": 2}, 2), ({"ep": 2}, 2), ({"tp": 2}, 2)):
        with pytest.raises(
            MisconfigurationException,
            match=r"data_parallel='none' reduces no gradient.*use data_parallel='fsdp' or 'ddp'",
        ):
            L.Trainer(
                accelerator="cpu", devices=devices, strategy=MoE5DStrategy(data_parallel="none", **sizes), logger=False
            )
    # Pipeline stages hold different parameters: nothing to reduce between them.
    L.Trainer(accelerator="cpu", devices=2, strategy=MoE5DStrategy(pp=2, data_parallel="none"), logger=False)


# -- every preset, as a user types it --------------------------------------------------------------
PRESETS = sorted(path.stem for path in (CONF_DIR / "parallel").glob("*.yaml"))


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=["trainer.default_root_dir=/tmp/unused", *overrides])


@pytest.mark.parametrize("preset", presets_this_torch_builds(PRESETS))
def test_every_preset_passes_the_offline_check_with_default_configs(preset):
    cfg = _compose(f"parallel={preset}")
    check_config(cfg)  # raises what the run would raise: sizes, batch layout, seq_len, model split


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["parallel=pp2", "model.num_layers=3"], r"3 layers cannot be split evenly into pp\*pp_stages_per_rank = 2"),
        (
            ["parallel=pp2", "data.global_batch_size=7"],
            r"global_batch_size 7 not divisible by micro_batch_size\*dp_ep\*pp_microbatches = 1\*1\*2 = 2 \(the default, 1 on every layout\)",
        ),
        (
            ["parallel=pp2", "data.micro_batch_size=4", "data.global_batch_size=12"],
            r"not divisible by micro_batch_size\*dp_ep\*pp_microbatches = 4\*1\*2 = 8",
        ),
        (["parallel=ep4", "model.moe.num_experts=6"], r"num_experts 6 is not divisible by ep 4"),
        (["parallel=tp2", "model.num_kv_heads=1"], r"num_kv_heads=1 is not divisible by tp=2"),
        (["parallel=cp2", "data.seq_len=30"], r"seq_len 30 not divisible by 2\*cp = 4"),
        (["parallel=ep2", "trainer.devices=3"], r"world_size 3"),
        (["parallel=dp2", "parallel.data_parallel=none"], r"data_parallel='none' reduces no gradient"),
        (["parallel=cp2_tp2_ep4_folded", "parallel.ep=2"], r"ep=2 is not divisible by the folded cp\*tp = 2\*2 = 4"),
        (["parallel=tp2_ep2_folded", "parallel.fold_ep=dp"], r"fold_ep='dp': ep folds over the attention dims"),
        (
            ["parallel=tp2_ep2_folded", "trainer.devices=4", "parallel.dp=1"],
            r"world_size 4 != tp\*cp\*\(ep/tp\)\*dp\*pp = 2\*1\*1\*1\*1 = 2",
        ),
    ],
)
def test_offline_check_names_the_fix(overrides, message):
    # The strategy's own argument errors reach the user through Hydra's InstantiationException.
    with pytest.raises((ValueError, MisconfigurationException, InstantiationException), match=message):
        check_config(_compose(*overrides))


def test_tiny_run_overrides_still_pass_the_check():
    check_config(_compose(*[o for o in TINY_RUN if not o.startswith("++")], "parallel=pp2"))


PIPELINE_PRESETS = [p for p in PRESETS if p.startswith("pp2") and p != "pp2_cp2_tp2_ep2"]  # up to 8 processes


def fit_and_report(overrides: list[str], run_dir: str) -> str:
    """What ``python -m lightning_moe.train *overrides`` does on this rank of a test pool: the config
    composed and checked, :func:`lightning_moe.train.fit`, and the run report global rank 0 prints
    (returned; "" on the other ranks)."""
    from lightning_moe.callbacks import SummaryCallback
    from lightning_moe.train import run_report

    run, wandb_runs = fit_on_this_rank(overrides, run_dir)
    summary = next((c for c in run.callbacks if isinstance(c, SummaryCallback)), None)
    return run_report(summary, wandb_runs) if run.trainer.is_global_zero else ""


@pytest.mark.slow
@pytest.mark.parametrize("preset", PIPELINE_PRESETS)
def test_pipeline_preset_trains_with_nothing_else_on_the_command_line(tmp_path, preset):
    """The config that ``python -m lightning_moe.train parallel=<preset> trainer.max_steps=2 logger=none``
    composes (every other default as shipped) trains, on the ranks of a test pool, and gives the run
    report the CLI prints. The CLI's own process launch is covered by test_readme.py (README commands
    as typed) and test_strategy_invariance.py (run_cli: Lightning's launcher and torchrun)."""
    overrides = [f"parallel={preset}", "trainer.max_steps=2", "logger=none"]
    run_dir = tmp_path / "run"
    trainer = compose_train_config(run_dir, overrides).trainer
    pool = pool_of(trainer.devices * trainer.num_nodes)
    report = "".join(pool.run(fit_and_report, overrides=overrides, run_dir=str(run_dir)))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert len(summary["losses"]) == 2 and summary["layout"]["pp"] == 2
    assert "layout: tp=" in report and "communication per optimizer step and rank" in report

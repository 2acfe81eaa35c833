"""Trainer level: every layout trains MoEGPT with the single-process per-step losses (rel 1e-5, fp32)."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from lightning_moe.conf import devices_per_node
from tests.cli import TINY_RUN, compose_train_config, run_cli, run_cli_error, train_in_pool

REL = 1e-5


@pytest.fixture
def single_losses(one_process_losses) -> list[float]:
    losses = one_process_losses()
    assert len(losses) == 10
    return losses


def _assert_same_curve(losses: list[float], reference: list[float]) -> None:
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=REL, atol=0.0)


# Variants of the presets (each preset itself is covered by the default-data runs below), by process
# count: the runs of one count share a test pool, which starts once.
LAYOUTS = [
    (
        "ep2_ddp_allgather",
        ["parallel=ep2", "parallel.data_parallel=ddp", "model.moe.dispatcher=allgather"],
        {"dp": 1, "ep": 2},
    ),
    ("tp2_no_sp", ["parallel=tp2", "parallel.sequence_parallel=false"], {"tp": 2, "etp": 2}),
    # Pipeline: each Lightning batch runs pp_microbatches (default pp) loader micro-batches.
    ("pp2_gpipe", ["parallel=pp2", "parallel.pp_schedule=GPipe"], {"pp": 2}),
    ("pp2_1f1b_m4", ["parallel=pp2", "parallel.pp_microbatches=4"], {"pp": 2}),
    ("dp2_ep2_ddp", ["parallel=dp2_ep2", "parallel.data_parallel=ddp"], {"dp": 2, "ep": 2}),
    ("tp2_etp1_ep2_no_sp", ["parallel=tp2_etp1_ep2", "parallel.sequence_parallel=false"], {"tp": 2, "ep": 2, "etp": 1}),
    ("cp4_head_chunks2", ["parallel=cp4", "parallel.cp_head_chunks=2"], {"cp": 4}),
    # HSDP with tp: the 2-D meshes share tp's root (dp2x2_hsdp and dp2_ep2_hsdp are presets, run below).
    (
        "tp2_dp2_hsdp",
        ["parallel=tp2", "parallel.dp=2", "parallel.data_parallel=hsdp", "parallel.dp_shard=1"],
        {"tp": 2, "dp": 2, "etp": 2},
    ),
    ("pp2_dp2", ["parallel=pp2", "parallel.dp=2"], {"pp": 2, "dp": 2}),
    ("pp2_cp2", ["parallel=pp2", "parallel.cp=2"], {"pp": 2, "cp": 2}),
]

# What a user types: the default data layout (global_batch_size 16, micro_batch_size unset), only
# the model shrunk and the run cut to 6 steps so that the presets fit in the suite (a micro-batching
# difference shows from the first step: the aux loss is per micro-batch).
DEFAULT_DATA_RUN = [
    "logger=none",
    "trainer.max_steps=6",
    "data.seq_len=32",
    "data.max_corpus_bytes=200000",
    "model.hidden_size=32",
    "model.moe.ffn_hidden_size=32",
    "model.num_layers=2",
    "~callbacks.progress_bar",
    # Clipping is active at this size: a mis-scaled gradient would change the curve.
    "++trainer.gradient_clip_val=0.05",
]


def _preset_processes(preset: str) -> int:
    """Processes a preset starts (dp="auto" counts as 1, as trainer.devices does; folded ep counts
    only its unfolded part)."""
    import yaml
    from omegaconf import OmegaConf

    from lightning_moe.conf import CONF_DIR, devices_per_node

    return devices_per_node(OmegaConf.create(yaml.safe_load((CONF_DIR / "parallel" / f"{preset}.yaml").read_text())))


def _presets_up_to_8_processes() -> list[str]:
    """By process count: the runs of one count share a test pool, which starts once."""
    from lightning_moe.conf import CONF_DIR

    names = sorted(path.stem for path in (CONF_DIR / "parallel").glob("*.yaml"))
    names = [name for name in names if name not in ("single", "auto") and _preset_processes(name) <= 8]
    return sorted(names, key=_preset_processes)


def cp_presets_up_to_8_processes() -> list[str]:
    """The presets of :func:`_presets_up_to_8_processes` with context parallelism (cp > 1)."""
    import yaml

    from lightning_moe.conf import CONF_DIR

    return [
        name
        for name in _presets_up_to_8_processes()
        if (yaml.safe_load((CONF_DIR / "parallel" / f"{name}.yaml").read_text()) or {}).get("cp", 1) > 1
    ]


def presets_without_cp_up_to_8_processes() -> list[str]:
    """The other presets of :func:`_presets_up_to_8_processes` (the cp presets run 20 steps in tests of their own)."""
    with_cp = cp_presets_up_to_8_processes()
    return [name for name in _presets_up_to_8_processes() if name not in with_cp]


# The interleaved and V presets run 4 stages (2 per rank), so they need 4 layers; 2 keep the other runs quick.
PRESET_LAYERS = {"pp2_interleaved": 4, "pp2_ep2_dualpipev": 4}


@pytest.fixture
def single_default_losses(one_process_losses):
    """Single-process losses per layer count, with the data modules' defaults."""

    def losses(num_layers: int) -> list[float]:
        reference = one_process_losses(f"model.num_layers={num_layers}", base=DEFAULT_DATA_RUN)
        assert len(reference) == 6
        return reference

    return losses


@pytest.mark.slow
@pytest.mark.parametrize("preset", presets_without_cp_up_to_8_processes())
def test_preset_with_default_data_matches_single_process(tmp_path, single_default_losses, preset):
    """Nothing but ``parallel=<preset>``: the single-process per-step losses over 6 steps (rel 1e-5); the
    cp presets in test_cp_preset_matches_single_process."""
    num_layers = PRESET_LAYERS.get(preset, 2)
    summary = train_in_pool(
        tmp_path / preset, f"parallel={preset}", f"model.num_layers={num_layers}", base=DEFAULT_DATA_RUN
    )
    assert devices_per_node(OmegaConf.create(summary["layout"])) == _preset_processes(preset)
    _assert_same_curve(summary["losses"], single_default_losses(num_layers))


# Every cp preset with the ring and by all-to-all (sequence shards to head shards and back) on the default
# data: a global batch of 8 in micro-batches of 4 (every layout accumulates at most 2), the callbacks
# that do not change the losses off. `make test` compares 6 steps, the horizon of the other presets
# above; `make test-long` the 20 steps docs/context-parallel.md cites. (With packed documents:
# test_data_tokens.py, the same horizons.)
CP_HORIZONS = [6, pytest.param(20, marks=pytest.mark.long)]


def cp_overrides(steps: int) -> list[str]:
    return [
        f"trainer.max_steps={steps}",
        "data.global_batch_size=8",
        "data.micro_batch_size=4",
        "~callbacks.moe_metrics",
        "~callbacks.comm_accounting",
        "~callbacks.throughput",
        "~callbacks.model_summary",
    ]


@pytest.fixture(scope="module")
def single_cp_run_losses(tmp_path_factory):
    """`losses(steps)`: the one-process losses of the cp runs' settings, trained once per horizon."""
    cache: dict[int, list[float]] = {}

    def losses(steps: int) -> list[float]:
        if steps not in cache:
            run = tmp_path_factory.mktemp(f"single_cp_run_{steps}") / "run"
            summary = train_in_pool(run, "parallel=single", base=[*DEFAULT_DATA_RUN, *cp_overrides(steps)])
            assert len(summary["losses"]) == steps and summary["losses"][-1] < summary["losses"][0]
            cache[steps] = summary["losses"]
        return cache[steps]

    return losses


@pytest.mark.slow
@pytest.mark.parametrize("steps", CP_HORIZONS, ids=lambda steps: f"{steps}_steps")
@pytest.mark.parametrize(
    "preset,cp_comm", [(preset, comm) for preset in cp_presets_up_to_8_processes() for comm in ("ring", "a2a")]
)
def test_cp_preset_matches_single_process(tmp_path, single_cp_run_losses, preset, cp_comm, steps):
    summary = train_in_pool(
        tmp_path / preset,
        f"parallel={preset}",
        f"parallel.cp_comm={cp_comm}",
        base=[*DEFAULT_DATA_RUN, *cp_overrides(steps)],
    )
    assert (
        devices_per_node(OmegaConf.create(summary["layout"])) == _preset_processes(preset)
        and summary["layout"]["cp"] > 1
    )
    _assert_same_curve(summary["losses"], single_cp_run_losses(steps))


# DeepSeek-V3 routing: sigmoid scores, aux-loss-free expert bias (loads reduced over every rank).
BIAS_ROUTING = [
    "model.moe.score_func=sigmoid",
    "model.moe.load_balancing=none",
    "model.moe.expert_bias=true",
    "model.moe.bias_update_rate=0.05",
]


@pytest.fixture(scope="module")
def single_bias_losses(tmp_path_factory) -> list[float]:
    return train_in_pool(tmp_path_factory.mktemp("single_bias") / "run", "parallel=single", *BIAS_ROUTING)["losses"]


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["dp2_ep2", "tp2_etp1_ep2"])
def test_expert_bias_routing_is_layout_invariant(tmp_path, single_bias_losses, preset):
    summary = train_in_pool(tmp_path / preset, f"parallel={preset}", *BIAS_ROUTING)
    _assert_same_curve(summary["losses"], single_bias_losses)


@pytest.mark.slow
def test_sinkhorn_routing_balances_the_whole_micro_batch_under_cp_and_tp(tmp_path_factory):
    """cp2 x tp2 shard each sequence over 4 ranks; Sinkhorn still balances the micro-batch's tokens."""
    sinkhorn = ["model.moe.load_balancing=sinkhorn"]
    single = train_in_pool(tmp_path_factory.mktemp("single_sinkhorn") / "run", "parallel=single", *sinkhorn)
    sharded = train_in_pool(tmp_path_factory.mktemp("cp2_tp2_sinkhorn") / "run", "parallel=cp2_tp2", *sinkhorn)
    _assert_same_curve(sharded["losses"], single["losses"])


@pytest.mark.slow
@pytest.mark.parametrize("name,overrides,layout", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
def test_layout_matches_single_process(tmp_path, single_losses, name, overrides, layout):
    summary = train_in_pool(tmp_path / name, *overrides)
    for key, value in layout.items():
        assert summary["layout"][key] == value
    _assert_same_curve(summary["losses"], single_losses)


@pytest.mark.slow
def test_torchrun_launch_matches_single_process(tmp_path, single_losses):
    summary = run_cli(tmp_path / "torchrun", "parallel=ep2", torchrun_procs=2)
    assert summary["layout"]["ep"] == 2
    _assert_same_curve(summary["losses"], single_losses)


@pytest.mark.slow
def test_cli_overrides_select_the_layout(tmp_path, single_losses):
    summary = run_cli(tmp_path / "override", "parallel.ep=2", "trainer.devices=2")
    assert summary["layout"]["ep"] == 2
    _assert_same_curve(summary["losses"], single_losses)


# Bad configurations: the CLI runs check_config before anything else, so that each of these fails
# there in-process as it does on the command line; two go through the CLI itself, one caught by
# check_config and one (an unknown dispatcher: a model that cannot be built on meta) by the model's
# own constructor before any process starts.
CLI_ERRORS = [
    (["parallel=ep2", "trainer.devices=3"], r"world_size 3 .*not divisible|world_size 3 != "),
    (["model.moe.dispatcher=broadcast"], r"dispatcher"),
]
CONFIG_ERRORS = [
    (["parallel=ep4", "model.moe.num_experts=6"], r"num_experts 6 .*not divisible by ep 4"),
    (["parallel=dp2", "data.global_batch_size=6"], r"global_batch_size 6 .*not divisible"),
    (["parallel.etp=3"], r"etp=3 must be 1 or equal to tp"),
    (["parallel=cp2", "parallel.cp_head_chunks=0"], r"cp_head_chunks=0 must be a positive integer"),
    (["parallel=pp2", "model.num_layers=3"], r"3 layers cannot be split evenly into pp\*pp_stages_per_rank = 2"),
    (["parallel=pp2", "parallel.pp_microbatches=1"], r"pp_microbatches=1 < pp=2"),
    (
        ["parallel=pp2", "data.global_batch_size=6"],
        r"global_batch_size 6 not divisible by micro_batch_size\*dp_ep\*pp_microbatches = 2\*1\*2 = 4",
    ),
    (["parallel=pp2_interleaved", "model.num_layers=2"], r"2 layers cannot be split evenly .* = 4"),
    (
        ["parallel=pp2", "parallel.pp_stage_layers=[1,2]"],
        r"pp_stage_layers=\[1, 2\] adds up to 3 layers, the model has 2",
    ),
    (["parallel=pp2", "parallel.pp_stage_layers=[2]"], r"pp_stage_layers=\[2\] lists 1 stages, the pipeline has"),
    (
        ["parallel=cp4", "parallel.cp_comm=a2a", "model.num_heads=2", "model.num_kv_heads=2"],
        r"num_heads=2 over tp=1: all-to-all \(Ulysses\) context parallelism splits the 2 query heads .*"
        r"or cp_comm='ring'",
    ),
    (["parallel=cp2", "parallel.cp_comm=ulysses"], r"cp_comm='ulysses' must be one of \('ring', 'a2a'\)"),
]


@pytest.mark.slow
@pytest.mark.parametrize("overrides,message", CLI_ERRORS, ids=["world_size", "dispatcher"])
def test_bad_configuration_fails_before_training(tmp_path, overrides, message):
    import re

    output = run_cli_error(tmp_path / "bad", *overrides)
    assert re.search(message, output), output[-3000:]
    assert "Epoch 0" not in output


@pytest.mark.parametrize(
    "overrides,message",
    CONFIG_ERRORS,
    ids=[
        "experts",
        "global_batch",
        "etp",
        "head_chunks",
        "pp_layers",
        "pp_microbatches",
        "pp_global_batch",
        "pp_virtual_stages",
        "pp_stage_layers_sum",
        "pp_stage_layers_length",
        "a2a_heads",
        "cp_comm",
    ],
)
def test_bad_configuration_is_refused_by_the_clis_first_check(tmp_path, overrides, message):
    from lightning_moe.train import check_config

    with pytest.raises(Exception, match=message):
        check_config(compose_train_config(tmp_path, [*TINY_RUN, *overrides]))


@pytest.mark.slow
def test_any_sdpa_module_gets_context_parallel(tmp_path):
    """A LightningModule that only calls F.scaled_dot_product_attention trains under cp=2 unchanged."""
    import json
    import os
    import subprocess
    import sys

    from tests.cli import ROOT
    from tests.dist_pool import trim_pools

    trim_pools()  # the launched processes get the cores but for a few idle pool ranks
    losses = {}
    for cp in (1, 2):
        out = tmp_path / f"cp{cp}.json"
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        proc = subprocess.run(
            [sys.executable, str(ROOT / "tests/scripts/user_sdpa_module.py"), str(cp), str(out)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        losses[cp] = json.loads(out.read_text())
    assert len(losses[1]) == 6
    _assert_same_curve(losses[2], losses[1])


# -- pipeline parallel -----------------------------------------------------------------------------
@pytest.mark.slow
def test_all_of_tp_cp_ep_pp_matches_single_process(tmp_path, single_losses):
    """16 processes: pp2 x cp2 x tp2 x ep2 (full5d adds dp2: 32 processes, too many for 2 cores)."""
    summary = train_in_pool(tmp_path / "pp2_cp2_tp2_ep2", "parallel=pp2_cp2_tp2_ep2")
    assert {k: summary["layout"][k] for k in ("pp", "cp", "tp", "ep")} == {"pp": 2, "cp": 2, "tp": 2, "ep": 2}
    _assert_same_curve(summary["losses"], single_losses)

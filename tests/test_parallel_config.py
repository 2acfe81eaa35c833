"""``ParallelConfig``: the strategy's layout options, checked in one place; ``MoE5DStrategy(**kwargs)`` and
``MoE5DStrategy(config=...)`` build the same one; every Hydra ``parallel`` preset maps onto it."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from omegaconf import OmegaConf

import lightning_moe
from lightning_moe import MoE5DStrategy, ParallelConfig
from lightning_moe.conf import CONF_DIR
from lightning_moe.parallel.config.options import PLANNED_FIELDS
from tests.presets import presets_this_torch_builds

# The strategy arguments that are not layout options: Lightning's own, and the config itself.
STRATEGY_ONLY = {"process_group_backend", "timeout", "config"}
PRESETS = sorted(path.stem for path in (CONF_DIR / "parallel").glob("*.yaml"))


def test_the_strategy_arguments_are_the_config_fields_with_the_same_defaults():
    parameters = dict(inspect.signature(MoE5DStrategy.__init__).parameters)
    parameters.pop("self")
    assert set(parameters) - STRATEGY_ONLY == set(ParallelConfig.field_names())
    for name in ParallelConfig.field_names():
        assert parameters[name].default == ParallelConfig.default(name), name
    assert set(PLANNED_FIELDS) <= set(ParallelConfig.field_names())


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"layout": "best"}, r"layout='best' must be 'manual' \(the sizes given\) or 'auto'"),
        ({"data_parallel": "zero3"}, r"data_parallel='zero3' must be one of"),
        ({"cp_head_chunks": 0}, r"cp_head_chunks=0 must be a positive integer dividing the key/value heads"),
        ({"cp_comm": "ulysses"}, r"cp_comm='ulysses' must be one of \('ring', 'a2a'\)"),
        ({"dp": 0}, r"dp=0 must be a positive integer or 'auto'"),
        ({"pp": 2, "save_distributed_checkpoint": False}, r"pp=2 > 1 needs save_distributed_checkpoint=True"),
        (
            {"async_checkpoint": True, "save_distributed_checkpoint": False},
            r"async_checkpoint=True needs save_distributed_checkpoint=True.*set async_checkpoint=False",
        ),
        (
            {"activation_checkpointing": "some"},
            r"activation_checkpointing='some' must be one of \('none', 'full', 'selective'\)",
        ),
        ({"compile": "yes"}, r"compile='yes' must be True or False"),
        (
            {"dp_replicate": 2},
            r"split dp for HSDP, but data_parallel='fsdp': set data_parallel='hsdp' or leave both unset",
        ),
        ({"data_parallel": "hsdp"}, r"data_parallel='hsdp' needs dp_replicate or dp_shard"),
        (
            {"gather_once_per_step": True, "data_parallel": "ddp"},
            r"gather_once_per_step=True needs data_parallel='fsdp' or 'hsdp' \(got data_parallel='ddp'\)",
        ),
        (
            {"overlap_ep_comm": True},
            r"overlap_ep_comm=True hides expert-parallel all-to-alls, but ep=1 has none: set ep > 1",
        ),
        (
            {"overlap_ep_comm": True, "ep": 2},
            r"overlap_ep_comm=True with data_parallel='fsdp' needs gather_once_per_step=True",
        ),
        ({"etp": 3, "tp": 2}, r"etp=3 must be 1 or equal to tp"),
        ({"fold_ep": "dp", "ep": 2}, r"fold_ep='dp': ep folds over the attention dims"),
        ({"pp": 2, "pp_microbatches": 1}, r"pp_microbatches=1 < pp=2"),
        ({"pp_schedule": "Zigzag"}, r"pp_schedule='Zigzag' must be one of"),
    ],
)
def test_a_bad_value_is_refused_naming_the_argument_and_the_fix(kwargs, message):
    with pytest.raises(MisconfigurationException, match=message):
        ParallelConfig(**kwargs)
    with pytest.raises(MisconfigurationException, match=message):  # the strategy refuses it alike
        MoE5DStrategy(**kwargs)


def test_overlap_under_auto_leaves_ep_to_the_planner():
    assert ParallelConfig(layout="auto", overlap_ep_comm=True, gather_once_per_step=True).ep == 1


def test_frozen_and_replace_checks_again():
    config = ParallelConfig(tp=2, ep=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.tp = 4  # type: ignore[misc]
    assert config.replace(ep=4) == ParallelConfig(tp=2, ep=4)
    with pytest.raises(MisconfigurationException, match=r"cp_comm='ulysses'"):
        config.replace(cp_comm="ulysses")


def test_lists_from_hydra_compare_equal_to_tuples():
    assert ParallelConfig(context_parallel_keys=["doc"], fold_ep=["cp", "tp"]) == ParallelConfig(
        context_parallel_keys=("doc",), fold_ep=("cp", "tp")
    )


def test_kwargs_and_config_build_equal_strategies():
    kwargs = {"tp": 2, "ep": 2, "pp": 2, "pp_microbatches": 4, "cp_comm": "a2a", "context_parallel_keys": ["doc"]}
    by_kwargs, by_config = MoE5DStrategy(**kwargs), MoE5DStrategy(config=ParallelConfig(**kwargs))
    assert by_kwargs.config == by_config.config == ParallelConfig(**kwargs)
    assert by_kwargs.parallel_dims == by_config.parallel_dims
    assert (by_config.pp_microbatches, by_config.cp_comm, by_config.context_parallel_keys) == (4, "a2a", ("doc",))
    assert MoE5DStrategy().config == ParallelConfig()
    assert MoE5DStrategy(pp=2).pp_microbatches == 2  # None: pp


def test_config_and_layout_arguments_together_are_refused():
    with pytest.raises(
        MisconfigurationException, match=r"got config=ParallelConfig\(...\) and the layout arguments \['ep'\]"
    ):
        MoE5DStrategy(ep=2, config=ParallelConfig(tp=2))
    with pytest.raises(MisconfigurationException, match=r"must be a lightning_moe.ParallelConfig"):
        MoE5DStrategy(config={"tp": 2})  # type: ignore[arg-type]
    # Lightning's own arguments go beside a config, and so do layout arguments at their defaults
    # (Hydra passes every key of the preset).
    strategy = MoE5DStrategy(config=ParallelConfig(ep=2), timeout=60, ep=1, dp="auto")
    assert strategy.config.ep == 2 and strategy._timeout.total_seconds() == 60


def test_the_planners_choice_replaces_the_planned_fields():
    config = ParallelConfig(layout="auto", pp_schedule="GPipe", cp_comm="a2a", ranks_per_node=2, compile=True)
    planned = config.with_planned(
        {"tp": 1, "cp": 1, "ep": 2, "dp": 2, "pp": 1, "etp": 1, "data_parallel": "hsdp", "dp_replicate": 2}
    )
    assert (planned.ep, planned.dp, planned.data_parallel, planned.dp_replicate) == (2, 2, "hsdp", 2)
    assert (planned.pp_schedule, planned.cp_comm) == ("1F1B", "ring")  # left out by the planner: defaults
    assert (planned.ranks_per_node, planned.compile, planned.layout) == (2, True, "auto")  # not planned: kept


@pytest.mark.parametrize("preset", presets_this_torch_builds(PRESETS))
def test_every_preset_builds_a_parallel_config(tmp_path, preset):
    """Each key of a preset file is a ParallelConfig field or a strategy-only argument, and the composed
    preset (what ``python -m lightning_moe.train parallel=<preset>`` instantiates) builds one."""
    own = yaml.safe_load((CONF_DIR / "parallel" / f"{preset}.yaml").read_text()) or {}
    allowed = set(ParallelConfig.field_names()) | STRATEGY_ONLY | {"defaults", "_target_", "_recursive_"}
    assert set(own) <= allowed, sorted(set(own) - allowed)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"trainer.default_root_dir={tmp_path}", f"parallel={preset}"])
    layout = {
        k: v for k, v in OmegaConf.to_container(cfg.parallel, resolve=True).items() if k in ParallelConfig.field_names()
    }
    config = ParallelConfig(**layout)
    assert instantiate(cfg.parallel).config == config


def test_a_hydra_config_key_takes_a_parallel_config(tmp_path):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[
                f"trainer.default_root_dir={tmp_path}",
                "parallel.config={_target_: lightning_moe.ParallelConfig, tp: 2, ep: 2}",
            ],
        )
    assert instantiate(cfg.parallel).config == ParallelConfig(tp=2, ep=2)


def test_parallel_dims_of_a_trainer():
    from types import SimpleNamespace

    strategy = MoE5DStrategy(ep=2)
    assert lightning_moe.parallel_dims_of(SimpleNamespace(strategy=strategy)) is strategy.parallel_dims
    assert lightning_moe.parallel_dims_of(SimpleNamespace(strategy=SimpleNamespace())) is None
    assert lightning_moe.parallel_dims_of(None) is None

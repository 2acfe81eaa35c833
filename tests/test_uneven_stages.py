"""Uneven pipeline stages: ``pp_stage_layers`` (``MoE5DStrategy(pp_stage_layers=[1, 3])``,
``parallel.pp_stage_layers=[1,3]``) gives each stage its number of layers, as Megatron places them.

- The split itself (in process): which layers, embedding and head each stage keeps, for MoEGPT, a Hugging
  Face model and a module's own ``pipeline_split`` hook.
- Bad lists are refused before any work, naming the argument and the fix.
- Uneven splits train the one-process losses over 20 steps (rel 1e-5, fp32, clipping on): [1, 3] and
  [3, 1] under 1F1B on the 4-layer model, and [1, 2, 2, 1] under Interleaved1F1B on 6 layers.
  (Resuming across an uneven and an even split: tests/test_checkpoint_layouts.py.)
"""

from __future__ import annotations

import re

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_moe import MoE5DStrategy, ParallelConfig
from lightning_moe.models import MoEGPT
from lightning_moe.parallel.plans.pipeline import check_pipeline_split, split_module
from tests.cli import train_in_pool

REL = 1e-5
STEPS = 20


def _model(num_layers: int = 4) -> MoEGPT:
    return MoEGPT(hidden_size=16, num_layers=num_layers, num_heads=2, moe={"num_experts": 2, "ffn_hidden_size": 16})


def _kept(model: nn.Module) -> tuple[list[str], bool, bool]:
    return list(model.layers.keys()), model.tok_embeddings is not None, model.output is not None


@pytest.mark.parametrize(
    "stage_layers,first,last",
    [([1, 3], ["0"], ["1", "2", "3"]), ([3, 1], ["0", "1", "2"], ["3"]), ([2, 2], ["0", "1"], ["2", "3"])],
)
def test_each_stage_keeps_its_count_of_layers_the_first_the_embedding_the_last_the_head(stage_layers, first, last):
    head, tail = _model(), _model()
    split_module(head, pp_rank=0, pp=2, stage_layers=stage_layers)
    split_module(tail, pp_rank=1, pp=2, stage_layers=stage_layers)
    assert _kept(head) == (first, True, False)
    assert _kept(tail) == (last, False, True)


def test_interleaved_stages_take_their_counts_in_stage_order():
    # Rank 0 runs stages 0 and 2, rank 1 stages 1 and 3 (loop placement).
    stages = split_module(_model(6), pp_rank=0, pp=2, stages_per_rank=2, stage_layers=[1, 2, 2, 1])
    assert [(index, list(stage.layers.keys())) for index, stage in stages] == [(0, ["0"]), (2, ["3", "4"])]
    stages = split_module(_model(6), pp_rank=1, pp=2, stages_per_rank=2, stage_layers=[1, 2, 2, 1])
    assert [(index, list(stage.layers.keys())) for index, stage in stages] == [(1, ["1", "2"]), (3, ["5"])]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"pp": 2, "pp_stage_layers": [1, 2, 1]}, "lists 3 stages, the pipeline has pp*pp_stages_per_rank = 2"),
        ({"pp": 2, "pp_stage_layers": [0, 4]}, "leaves a stage without layers"),
        ({"pp": 2, "pp_stage_layers": [1.5, 2.5]}, "must list whole numbers of layers"),
        (
            {"pp": 2, "pp_schedule": "Interleaved1F1B", "pp_stages_per_rank": 2, "pp_stage_layers": [2, 2]},
            "lists 2 stages, the pipeline has pp*pp_stages_per_rank = 4",
        ),
    ],
)
def test_a_bad_list_is_refused_when_the_strategy_is_built(kwargs, message):
    with pytest.raises(MisconfigurationException, match=re.escape(message)):
        MoE5DStrategy(**kwargs)
    with pytest.raises(MisconfigurationException, match=re.escape(message)):
        ParallelConfig(**kwargs)


def test_counts_that_do_not_add_up_to_the_model_are_refused_with_the_total():
    with pytest.raises(ValueError, match=r"pp_stage_layers=\[1, 2\] adds up to 3 layers, the model has 4"):
        check_pipeline_split(_model(), 2, [1, 2])


def test_the_config_keeps_the_counts_as_a_tuple_and_the_strategy_reads_them():
    assert ParallelConfig(pp=2, pp_stage_layers=[1, 3]) == ParallelConfig(pp=2, pp_stage_layers=(1, 3))
    assert MoE5DStrategy(pp=2, pp_stage_layers=[3, 1]).pp_stage_layers == (3, 1)


def test_a_module_split_by_keys_and_by_counts_is_refused():
    model = _model()
    model.pipeline_stage_layers = [["0"], ["1", "2", "3"]]
    with pytest.raises(ValueError, match="both split the pipeline: keep one of them"):
        check_pipeline_split(model, 2, [1, 3])


class _HookedModule(nn.Module):
    """A module with its own pipeline_split that knows nothing of stage_layers."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(4))

    def pipeline_split(self, stage_index: int, num_stages: int) -> nn.Module:
        return self


def test_a_pipeline_split_hook_without_stage_layers_is_told_to_take_them():
    with pytest.raises(ValueError, match="takes no stage_layers: add a stage_layers=None keyword"):
        check_pipeline_split(_HookedModule(), 2, [1, 3])
    check_pipeline_split(_HookedModule(), 2)  # an even split still calls it as before


def test_a_hugging_face_model_splits_by_the_counts_and_checks_them():
    pytest.importorskip("transformers")
    from lightning_moe.hf import TINY_CONFIGS, HFMoEModule

    module = HFMoEModule({"model_type": "qwen3_moe", **TINY_CONFIGS["qwen3_moe"], "num_hidden_layers": 4})
    with pytest.raises(ValueError, match=r"pp_stage_layers=\[1, 1\] adds up to 2 layers, the model has 4"):
        module.check_layout(pp=2, pp_stage_layers=[1, 1])
    module.check_layout(pp=2, pp_stage_layers=[1, 3])
    module.pipeline_split(1, 2, stage_layers=[1, 3])
    assert [key for key, _ in module.model.model.layers.named_children()] == ["1", "2", "3"]
    assert module.model.model.embed_tokens is None and module.model.lm_head is not None


# -- trainer level: 20 steps against one process -----------------------------------------------------
UNEVEN_RUNS = {
    "pp2_1_3": (4, ["parallel=pp2", "parallel.pp_stage_layers=[1,3]"]),
    "pp2_3_1": (4, ["parallel=pp2", "parallel.pp_stage_layers=[3,1]"]),
    "pp2_interleaved_1_2_2_1": (6, ["parallel=pp2_interleaved", "parallel.pp_stage_layers=[1,2,2,1]"]),
}


@pytest.fixture
def single_losses(one_process_losses):
    """One-process losses per layer count."""

    def losses(num_layers: int) -> list[float]:
        reference = one_process_losses(f"model.num_layers={num_layers}", f"trainer.max_steps={STEPS}")
        assert len(reference) == STEPS
        return reference

    return losses


@pytest.mark.slow
@pytest.mark.parametrize("name", list(UNEVEN_RUNS))
def test_uneven_stages_train_the_single_process_losses_over_20_steps(tmp_path, single_losses, name):
    num_layers, overrides = UNEVEN_RUNS[name]
    summary = train_in_pool(tmp_path / name, *overrides, f"model.num_layers={num_layers}", f"trainer.max_steps={STEPS}")
    assert summary["layout"]["pp"] == 2
    torch.testing.assert_close(
        torch.tensor(summary["losses"]), torch.tensor(single_losses(num_layers)), rtol=REL, atol=0.0
    )


# -- the planner ------------------------------------------------------------------------------------------
def _plan_inputs():
    from tests.test_planner import cluster, preset_shape

    return preset_shape("mixtral_8x7b"), cluster("h100_sxm")


def test_the_planner_runs_at_the_pace_of_the_slowest_uneven_stage():
    from lightning_moe.planner import Layout, estimate
    from lightning_moe.planner.candidate import rank_layers

    model, h100 = _plan_inputs()  # 32 layers
    common = {"tp": 8, "pp": 4, "dp": 2, "microbatches": 16, "pp_microbatches": 16}
    even = Layout(**common)
    uneven = Layout(**common, pp_stage_layers=(6, 10, 8, 8))
    assert rank_layers(model, uneven, 1) == tuple(range(6, 16))
    layouts = {"even": even, "even_listed": Layout(**common, pp_stage_layers=(8, 8, 8, 8)), "uneven": uneven}
    times = {
        name: estimate(model, layout, h100, seq_len=4096, global_batch_size=64) for name, layout in layouts.items()
    }
    assert times["even_listed"].step_time == pytest.approx(times["even"].step_time, rel=1e-12)
    # The second stage computes 10 layers where the even split's busiest computes 8 and the head (about
    # a third of a layer here: 1.20x in all): the pipeline runs at the slowest stage's pace.
    assert times["uneven"].compute_time > 1.15 * times["even"].compute_time
    assert times["uneven"].memory_pp_rank == 1, "its 10 layers make the second rank the fullest"
    assert "pp_stage_layers=6/10/8/8" in uneven.label()
    assert uneven.strategy_kwargs()["pp_stage_layers"] == [6, 10, 8, 8]


def test_the_planner_takes_deepseek_v3s_61_layers_over_32_virtual_stages():
    from lightning_moe.planner import Layout, layout_problems
    from tests.test_planner import preset_shape

    model = preset_shape("deepseek_v3")
    assert model.num_layers == 61
    sizes = {"tp": 2, "pp": 8, "ep": 64, "pp_schedule": "Interleaved1F1B", "pp_stages_per_rank": 4}
    sizes |= {"microbatches": 64, "pp_microbatches": 64}
    even = layout_problems(model, Layout(**sizes), seq_len=4096, global_batch_size=8192)
    assert "num_layers=61 is not divisible by pp*stages_per_rank=32" in even
    # Megatron's way: one layer on the first and on the last two stages, two on the 29 others.
    counts = (1, *[2] * 29, 1, 1)
    uneven = layout_problems(model, Layout(**sizes, pp_stage_layers=counts), seq_len=4096, global_batch_size=8192)
    assert not [p for p in uneven if "layers" in p], uneven
    short = layout_problems(model, Layout(**sizes, pp_stage_layers=counts[1:]), seq_len=4096, global_batch_size=8192)
    assert any("lists 31 stages, the pipeline has pp*pp_stages_per_rank = 32" in p for p in short), short


def test_the_planners_parameter_shards_of_uneven_stages_equal_a_dry_run():
    """Every rank of pp2 x ep2 with [1, 3] (and an interleaved [1, 2, 2, 1]) built for real on torch's fake
    process group: the same local shapes and bytes as the planner's."""
    from lightning_moe.plan import dry_run
    from tests.test_planner import TINY, sizes_layout

    for num_layers, sizes in [
        (4, dict(ep=2, pp=2, pp_stage_layers=(1, 3))),
        (6, dict(pp=2, pp_schedule="Interleaved1F1B", pp_stages_per_rank=2, pp_stage_layers=(1, 2, 2, 1))),
    ]:
        cfg = {**TINY, "num_layers": num_layers, "max_steps": 10, "max_seq_len": 64}
        lay = sizes_layout(sizes)
        views = dry_run({"_target_": "lightning_moe.models.MoEGPT", **cfg}, lay, ranks=range(lay.world_size))
        assert all(v.matches for v in views), [v.mismatches for v in views]
        assert views[0].parameter_bytes != views[-1].parameter_bytes

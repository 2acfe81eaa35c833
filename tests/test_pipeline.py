"""Pipeline parallelism: splitting, schedules, gradients and the strategy's errors.

The gradient cases run in the gloo worker pool (4 ranks, no Lightning): pipeline stages on pp,
FSDP or DDP on dp x ep, and the reduced gradient of every parameter must equal the single-process
gradient of the mean loss over the same micro-batches. Trainer-level invariance (loss curves) lives
in test_strategy_invariance.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.dist_pool import get_pool, layout

ATOL = 2e-6


def _tiny_model(num_layers: int = 2, **moe_overrides):
    from lightning_moe.models import MoEGPT

    moe = {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 24, "aux_loss_coeff": 0.1, "z_loss_coeff": 0.01}
    moe.update(moe_overrides)
    return MoEGPT(hidden_size=32, num_layers=num_layers, num_heads=4, moe=moe)


# -- splitting (one process) -------------------------------------------------------------------------
def test_default_split_keeps_only_the_local_stage():
    from lightning_moe.parallel.plans.pipeline import pipeline_stage_modules, split_module

    torch.manual_seed(0)
    full = _tiny_model(num_layers=4)
    names = {n for n, _ in full.named_parameters()}
    first, last = copy.deepcopy(full), copy.deepcopy(full)
    split_module(first, pp_rank=0, pp=2)
    split_module(last, pp_rank=1, pp=2)
    assert list(first.layers.keys()) == ["0", "1"] and first.norm is None and first.output is None
    assert list(last.layers.keys()) == ["2", "3"] and last.tok_embeddings is None
    first_names = {n for n, _ in first.named_parameters()}
    last_names = {n for n, _ in last.named_parameters()}
    assert first_names.isdisjoint(last_names) and first_names | last_names == names, "global names, no overlap"
    assert pipeline_stage_modules(first) == [(0, first)]
    # The two stages chained give the full model's output.
    tokens = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(last(first(tokens)), full(tokens))


def test_virtual_stages_share_parameters_with_the_module():
    from lightning_moe.parallel.plans.pipeline import split_module

    torch.manual_seed(0)
    full = _tiny_model(num_layers=4)
    model = copy.deepcopy(full)
    stages = split_module(model, pp_rank=0, pp=2, stages_per_rank=2)
    assert [index for index, _ in stages] == [0, 2]
    (_, s0), (_, s2) = stages
    assert list(s0.layers.keys()) == ["0"] and s0.norm is None
    assert list(s2.layers.keys()) == ["2"] and s2.tok_embeddings is None and s2.output is None
    assert list(model.layers.keys()) == ["0", "2"] and model.norm is None and model.output is None
    module_params = {id(p) for p in model.parameters()}
    assert {id(p) for p in s0.parameters()} | {id(p) for p in s2.parameters()} == module_params
    assert s0.layers["0"] is model.layers["0"]


def test_uneven_layer_count_names_the_numbers():
    from lightning_moe.parallel.plans.pipeline import split_module

    with pytest.raises(ValueError, match=r"3 layers cannot be split evenly into pp\*pp_stages_per_rank = 2"):
        split_module(_tiny_model(num_layers=3), pp_rank=0, pp=2)


def test_custom_split_hook_and_layer_lists():
    from lightning_moe.parallel.plans.pipeline import split_module

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def pipeline_split(self, stage, num_stages):
            stage_module = nn.Sequential(self.a if stage == 0 else self.b)
            return stage_module

    net = Net()
    ((index, stage),) = split_module(net, pp_rank=1, pp=2)
    assert index == 1 and net.a is None and stage[0] is net.b

    model = _tiny_model(num_layers=4)
    model.pipeline_stage_layers = [["0"], ["1", "2", "3"]]
    split_module(model, pp_rank=1, pp=2)
    assert list(model.layers.keys()) == ["1", "2", "3"]


@pytest.mark.parametrize(
    "pp,schedule,microbatches,stages_per_rank,message",
    [
        (2, "1F1B", 1, 1, r"pp_microbatches=1 < pp=2"),
        (2, "Interleaved1F1B", 2, 1, r"needs pp_stages_per_rank >= 2"),
        (2, "GPipe", 2, 2, r"one stage per rank"),
        (2, "Zero", 2, 1, r"must be one of"),
        (2, "Interleaved1F1B", 5, 2, r"multiple of max\(1, pp_microbatches // pp\) = 2"),
    ],
)
def test_schedule_configuration_errors(pp, schedule, microbatches, stages_per_rank, message):
    from lightning_moe.parallel.plans.pipeline import check_pipeline_config

    with pytest.raises(ValueError, match=message):
        check_pipeline_config(pp, schedule, microbatches, stages_per_rank)


def test_strategy_rejects_bad_schedules_at_construction():
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    from lightning_moe import MoE5DStrategy

    with pytest.raises(MisconfigurationException, match=r"pp_microbatches=1 < pp=2"):
        MoE5DStrategy(pp=2, pp_microbatches=1)
    strategy = MoE5DStrategy(pp=2)
    assert strategy.pp_microbatches == 2 and strategy.pp_schedule == "1F1B"


def test_grouped_loader_concatenates_and_passes_resume_state_through():
    from lightning_moe.parallel.plans.pipeline import GroupedBatchLoader

    class Loader:
        sampler = "the sampler"

        def __iter__(self):
            return iter([{"x": torch.full((2,), float(i))} for i in range(5)])

        def __len__(self):
            return 5

        def state_dict(self):
            return {"epoch": 0, "samples_consumed": 8}

    grouped = GroupedBatchLoader(Loader(), 2)
    batches = list(grouped)
    assert len(grouped) == len(batches) == 2
    assert batches[1]["x"].tolist() == [2.0, 2.0, 3.0, 3.0]
    assert grouped.sampler == "the sampler"
    assert grouped.state_dict() == {"epoch": 0, "samples_consumed": 8}


# -- gradients (4 gloo ranks) ------------------------------------------------------------------------
def _batch(seed: int, size: int = 2, loss_mask: bool = False) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (size, 33), generator=gen)
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
    if loss_mask:  # uneven masks: micro-batches and cp shards hold different numbers of loss tokens
        batch["loss_mask"] = (torch.rand(size, 32, generator=gen) < 0.6).to(torch.float32)
    return batch


def pipeline_grad_case(
    pp: int,
    ep: int = 1,
    tp: int = 1,
    schedule: str = "1F1B",
    microbatches: int = 2,
    stages_per_rank: int = 1,
    data_parallel: str = "fsdp",
    num_layers: int = 2,
    load_balancing: str = "aux_loss",
    clip: float | None = None,
    cp: int = 1,
    loss_mask: bool = False,
) -> float:
    from contextlib import nullcontext

    from torch.distributed.tensor import DTensor

    from lightning_moe import parallelize
    from lightning_moe.cp import context_parallel_attention
    from lightning_moe.moe import set_aux_loss_scale
    from lightning_moe.parallel.engines.pipeline_runner import PipelineRunner
    from lightning_moe.parallel.plans.context_parallel import shard_batch_for_context_parallel
    from lightning_moe.parallel.plans.pipeline import (
        concat_batches,
        pipeline_batch,
        pipeline_stage_modules,
        unpack_target_loss,
    )
    from lightning_moe.parallel.runtime.grad_norm import clip_grad_norm_

    dims = layout(pp=pp, ep=ep, tp=tp, cp=cp)
    torch.manual_seed(0)
    model = _tiny_model(num_layers, load_balancing=load_balancing)
    reference = copy.deepcopy(model)
    parallelize(model, dims, data_parallel=data_parallel, pp_stages_per_rank=stages_per_rank)
    runner = PipelineRunner(
        pipeline_stage_modules(model),
        num_stages=pp * stages_per_rank,
        group=dims.pp_group,
        device=torch.device("cpu"),
        schedule=schedule,
        microbatches=microbatches,
        loss_fn=lambda output, target: unpack_target_loss(model.loss_from_logits, output, target, cp),
    )
    replicas = dims.dp_ep_mesh.size()
    replica = dims.dp_ep_mesh.get_local_rank()
    # Micro-batch j of replica r is sample group r * microbatches + j; two pipeline steps accumulate.
    steps = 2
    scale = 1.0 / (steps * microbatches)
    # As the strategy does: each cp rank holds a partial aux loss, but gradients average over cp.
    set_aux_loss_scale(scale * cp)
    losses = []
    # FSDP2's gradient reduction (which of the two depends on the torch version).
    reduce_scatters = _CallCounter(dist, "reduce_scatter_tensor", "reduce_scatter_single")
    for step in range(steps):
        seeds = [100 * step + replica * microbatches + j for j in range(microbatches)]
        batch = concat_batches([_batch(seed, loss_mask=loss_mask) for seed in seeds])
        if cp > 1:
            batch = shard_batch_for_context_parallel(batch, dims)
        inputs, kwargs, target = pipeline_batch(batch, microbatches, cp_group=dims.cp_group if cp > 1 else None)
        with context_parallel_attention(dims.cp_group) if cp > 1 else nullcontext():
            out = runner.step(inputs, kwargs, target, grad_scale=scale)
        loss = runner.broadcast_mean(out)
        if cp > 1:  # each cp rank's loss is its tokens' part of the mean
            dist.all_reduce(loss, group=dims.cp_group)
            loss = loss / cp
        losses.append(loss)
    reduce_scatters.restore()

    total_mb = steps * microbatches * replicas
    set_aux_loss_scale(1.0 / total_mb)
    ref_losses = []
    for step in range(steps):
        step_losses = []
        for r in range(replicas):
            for j in range(microbatches):
                loss = reference.loss(_batch(100 * step + r * microbatches + j, loss_mask=loss_mask))
                (loss / total_mb).backward()
                if r == replica:
                    step_losses.append(loss.detach())
        ref_losses.append(torch.stack(step_losses).mean())
    set_aux_loss_scale(1.0)
    worst = max((a - b).abs().item() for a, b in zip(losses, ref_losses))
    if clip is not None:
        total = clip_grad_norm_(list(model.parameters()), clip, group=dims.pp_group)
        ref_total = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
        assert ref_total > 10 * clip, "the case must actually clip"
        worst = max(worst, (total - ref_total).abs().item())
    ref_params = dict(reference.named_parameters())
    local = dict(model.named_parameters())
    assert local and set(local) < set(ref_params), "each rank holds a strict subset of the model"
    for name, param in local.items():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        assert grad is not None, name
        worst = max(worst, (grad - ref_params[name].grad).abs().max().item())
    return {"worst": worst, "reduce_scatters_per_step": reduce_scatters.calls / steps}


class _CallCounter:
    """Counts the calls of the functions ``module.<name>`` (those that exist) until ``restore()``."""

    def __init__(self, module: object, *names: str) -> None:
        self.module, self.calls = module, 0
        self.originals = {name: getattr(module, name) for name in names if hasattr(module, name)}
        for name, original in self.originals.items():
            setattr(module, name, self._counted(original))

    def _counted(self, original):
        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        return counted

    def restore(self) -> None:
        for name, original in self.originals.items():
            setattr(self.module, name, original)


def pipeline_eval_case(pp: int, schedule: str, stages_per_rank: int = 1, num_layers: int = 2) -> float:
    """Forward-only steps (validation): the micro-batch losses equal the single-process ones on every rank."""
    from lightning_moe import parallelize
    from lightning_moe.parallel.engines.pipeline_runner import PipelineRunner
    from lightning_moe.parallel.plans.pipeline import pipeline_stage_modules

    dims = layout(pp=pp)
    torch.manual_seed(0)
    model = _tiny_model(num_layers)
    reference = copy.deepcopy(model)
    parallelize(model, dims, pp_stages_per_rank=stages_per_rank)
    runner = PipelineRunner(
        pipeline_stage_modules(model),
        pp * stages_per_rank,
        dims.pp_group,
        torch.device("cpu"),
        schedule,
        4,
        lambda output, labels: model.loss_from_logits(output, labels),
    )
    worst = 0.0
    replica = dims.dp_ep_mesh.get_local_rank()
    for step in range(2):
        parts = [_batch(10 * step + replica * 4 + j) for j in range(4)]
        input_ids, labels = torch.cat([p["input_ids"] for p in parts]), torch.cat([p["labels"] for p in parts])
        with torch.inference_mode():
            loss = runner.broadcast_mean(runner.step((input_ids,), {}, labels, train=False))
            expected = torch.stack([reference.loss(p) for p in parts]).mean()
        worst = max(worst, (loss - expected).abs().item())
    assert all(p.grad is None for p in model.parameters()), "forward only"
    return worst


@pytest.mark.slow
@pytest.mark.parametrize(
    "pp,schedule,stages_per_rank,num_layers", [(2, "1F1B", 1, 2), (4, "GPipe", 1, 4), (2, "Interleaved1F1B", 2, 4)]
)
def test_forward_only_pipeline_losses(pp, schedule, stages_per_rank, num_layers):
    worst = get_pool(4).run(
        pipeline_eval_case, pp=pp, schedule=schedule, stages_per_rank=stages_per_rank, num_layers=num_layers
    )
    assert max(worst) < ATOL, worst


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
@pytest.mark.parametrize("data_parallel", ["fsdp", "ddp"])
def test_pp2_dp2_gradients_equal_single_process(schedule, data_parallel):
    results = get_pool(4).run(pipeline_grad_case, pp=2, schedule=schedule, data_parallel=data_parallel)
    assert max(r["worst"] for r in results) < ATOL, results


@pytest.mark.slow
def test_fsdp_reduces_once_per_step_whatever_the_microbatches():
    """FSDP reduce-scatters in the last micro-batch's backward only, like gradient accumulation."""
    per_step = {m: get_pool(4).run(pipeline_grad_case, pp=2, microbatches=m) for m in (2, 4)}
    for results in per_step.values():
        assert max(r["worst"] for r in results) < ATOL, results
    counts = {m: [r["reduce_scatters_per_step"] for r in results] for m, results in per_step.items()}
    assert all(c > 0 for c in counts[2]), counts
    assert counts[4] == counts[2], counts


@pytest.mark.slow
def test_interleaved_pp2_dp2_gradients_equal_single_process():
    results = get_pool(4).run(
        pipeline_grad_case, pp=2, schedule="Interleaved1F1B", stages_per_rank=2, num_layers=4, microbatches=4
    )
    assert max(r["worst"] for r in results) < ATOL, results


@pytest.mark.slow
@pytest.mark.parametrize("ep,tp", [(2, 1), (1, 2)])
def test_pp2_with_ep_or_tp_gradients_equal_single_process(ep, tp):
    results = get_pool(4).run(pipeline_grad_case, pp=2, ep=ep, tp=tp, load_balancing="seq_aux_loss")
    assert max(r["worst"] for r in results) < ATOL, results


@pytest.mark.slow
@pytest.mark.parametrize("cp", [1, 2])
def test_loss_mask_and_context_parallel_under_pp(cp):
    """Masked tokens, uneven per micro-batch and per cp shard: each micro-batch divides by its own count."""
    results = get_pool(4).run(pipeline_grad_case, pp=2, cp=cp, loss_mask=True)
    assert max(r["worst"] for r in results) < ATOL, results


@pytest.mark.slow
def test_pp4_gradient_clipping_combines_the_stages():
    results = get_pool(4).run(pipeline_grad_case, pp=4, num_layers=4, microbatches=4, clip=0.01)
    assert max(r["worst"] for r in results) < ATOL, results


# -- trainer level: validation and metrics (CLI subprocesses) ---------------------------------------
def _val_losses(run_dir) -> list[float]:
    import csv

    rows = list(csv.DictReader((run_dir / "csv" / "metrics.csv").open()))
    return [float(row["val/loss"]) for row in rows if row.get("val/loss")]


@pytest.mark.slow
def test_validation_loss_and_moe_metrics_match_single_process(tmp_path):
    """Validation runs forward-only through the stages; MoE statistics combine the micro-batches.

    One Lightning batch under pp2 holds 2 loader batches: validating every 5 optimizer steps on the
    same 8 loader batches is val_check_interval 20 / limit 8 on one process and 10 / 4 under pp2.
    """
    from tests.cli import train_in_pool

    single = train_in_pool(
        tmp_path / "single",
        "parallel=single",
        "logger=csv",
        "trainer.val_check_interval=20",
        "trainer.limit_val_batches=8",
    )
    piped = train_in_pool(
        tmp_path / "pp2", "parallel=pp2", "logger=csv", "trainer.val_check_interval=10", "trainer.limit_val_batches=4"
    )
    torch.testing.assert_close(torch.tensor(piped["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=0)
    val_single, val_piped = _val_losses(tmp_path / "single"), _val_losses(tmp_path / "pp2")
    assert len(val_single) == len(val_piped) == 2
    torch.testing.assert_close(torch.tensor(val_piped), torch.tensor(val_single), rtol=1e-5, atol=0)
    assert piped["expert_load"] == single["expert_load"], "token counts of the last step, every layer"
    for name in ("aux_loss", "z_loss", "router_entropy"):
        torch.testing.assert_close(
            torch.tensor(piped["moe_history"][name]), torch.tensor(single["moe_history"][name]), rtol=1e-5, atol=1e-7
        )


@pytest.mark.slow
def test_stage_without_moe_layers_trains_and_logs(tmp_path):
    """moe_layer_freq=2: stage 0 holds only a dense layer, yet every rank joins the metric reductions."""
    from tests.cli import train_in_pool

    dense_first = ["model.moe_layer_freq=2"]
    single = train_in_pool(tmp_path / "single", "parallel=single", *dense_first)
    piped = train_in_pool(tmp_path / "pp2", "parallel=pp2", *dense_first)
    torch.testing.assert_close(torch.tensor(piped["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=0)
    assert list(piped["expert_load"]) == ["layer0"] and piped["expert_load"] == single["expert_load"]

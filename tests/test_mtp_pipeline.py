"""Multi-token prediction under pipeline parallelism: the MTP modules and a copy of the token
embedding on the last stage, the copies' gradients summed over {first, last} stage so they stay
equal, the MTP targets packed for the last stage's loss, and the one-process numbers (rel 1e-5)."""

from __future__ import annotations

import copy
import csv
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_moe.models import MoEGPT
from lightning_moe.models.mtp import add_mtp_targets
from lightning_moe.parallel.plans.pipeline import (
    concat_batches,
    pipeline_batch,
    split_module,
    tied_end_modules,
    unpack_target,
)
from tests.cli import train_in_pool
from tests.dist_pool import get_pool, layout
from tests.presets import NEEDS_V_SCHEDULE_TORCH

REL = 1e-5
MOE = {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 24, "aux_loss_coeff": 0.1, "z_loss_coeff": 0.01}


def _model(num_layers: int = 2, depth: int = 1) -> MoEGPT:
    torch.manual_seed(0)
    return MoEGPT(hidden_size=32, num_layers=num_layers, num_heads=4, moe=MOE, mtp_depth=depth, mtp_loss_weight=0.5)


def _batch(seed: int, size: int = 2) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (size, 17), generator=gen)
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
    batch["loss_mask"] = (torch.rand(size, 16, generator=gen) < 0.7).to(torch.float32)  # uneven per micro-batch
    return batch


# -- one process -------------------------------------------------------------------------------------
def test_the_last_stage_holds_mtp_and_a_copy_of_the_embedding():
    first, last = _model(), _model()
    split_module(first, pp_rank=0, pp=2)
    split_module(last, pp_rank=1, pp=2)
    assert tied_end_modules(last) == ("tok_embeddings",)
    assert {n.split(".")[0] for n in first.state_dict()} == {"tok_embeddings", "layers"}
    assert {n.split(".")[0] for n in last.state_dict()} == {"tok_embeddings", "layers", "norm", "mtp", "output"}
    torch.testing.assert_close(last.tok_embeddings.weight, first.tok_embeddings.weight, rtol=0, atol=0)
    plain = MoEGPT(hidden_size=32, num_layers=2, num_heads=4, moe=MOE)
    split_module(plain, pp_rank=1, pp=2)
    assert tied_end_modules(plain) == () and plain.tok_embeddings is None, "mtp_depth=0 stages are as before"


def test_the_packed_target_carries_each_depth_per_micro_batch():
    batch = add_mtp_targets(concat_batches([_batch(1), _batch(2)]), 2)
    (input_ids,), kwargs, target = pipeline_batch(batch, microbatches=2)
    assert kwargs["mtp_input_ids"] is batch["mtp_input_ids"]
    entries = unpack_target(target[2:])  # the second micro-batch, as the schedule splits it
    for key in ("labels", "loss_mask", "mtp_labels"):
        torch.testing.assert_close(entries[key].to(batch[key].dtype), batch[key][2:], rtol=0, atol=0)
    torch.testing.assert_close(entries["mtp_loss_mask"].bool(), batch["mtp_loss_mask"][2:])
    torch.testing.assert_close(entries["mtp_loss_token_count"], batch["mtp_loss_mask"][2:].sum((0, 1)).float())
    plain = pipeline_batch(add_mtp_targets({"input_ids": input_ids, "labels": batch["labels"]}, 1), 2)[2]
    assert unpack_target(plain)["loss_mask"].all() and unpack_target(plain)["mtp_labels"].shape == (4, 16, 1)


def test_a_split_without_room_on_the_last_stage_is_refused_or_warned():
    model = _model(num_layers=4)
    model.pipeline_stage_layers = [["0", "1"], ["2", "3"], []]
    with pytest.raises(
        ValueError, match=r"mtp_depth=1 under pipeline parallelism: the last of 3 stages .* none: move at"
    ):
        model.check_mtp_pipeline_split(3)
    model.pipeline_stage_layers = [["0", "1"], ["2", "3"]]
    model.check_mtp_pipeline_split(2)  # 2 layers + 1 MTP block vs 2: balanced enough
    with pytest.warns(UserWarning, match=r"runs 1 layers \+ 1 MTP blocks, the others at most 1 .*pp_stage_layers"):
        _model(num_layers=4).check_mtp_pipeline_split(4)


# -- gradients and optimizer steps (4 gloo ranks) -------------------------------------------------------
def mtp_pipeline_case(
    pp: int,
    dp: int = 1,
    ep: int = 1,
    depth: int = 1,
    num_layers: int = 2,
    schedule: str = "1F1B",
    stages_per_rank: int = 1,
    microbatches: int = 2,
    steps: int = 3,
) -> dict:
    """`steps` AdamW steps with gradient clipping through the pipeline against one process: the
    largest relative loss difference, the largest gradient difference of the first step (after
    clipping; Adam's later updates amplify rounding), and whether the ranks' embedding copies are bit-equal."""
    from torch.distributed.tensor import DTensor

    from lightning_moe import parallelize
    from lightning_moe.moe import set_aux_loss_scale
    from lightning_moe.parallel.engines.pipeline_runner import PipelineRunner
    from lightning_moe.parallel.plans.pipeline import pipeline_stage_modules
    from lightning_moe.parallel.runtime.grad_norm import clip_grad_norm_

    def full(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

    dims = layout(pp=pp, dp=dp, ep=ep)
    model = _model(num_layers, depth)
    reference = copy.deepcopy(model)
    parallelize(model, dims, pp_stages_per_rank=stages_per_rank, pp_schedule=schedule)

    def objective(output, target):
        return model.loss_terms_from_output(output, unpack_target(target))[0]

    runner = PipelineRunner(
        pipeline_stage_modules(model),
        pp * stages_per_rank,
        dims.pp_group,
        torch.device("cpu"),
        schedule,
        microbatches,
        objective,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01)
    replicas, replica = dims.dp_ep_mesh.size(), dims.dp_ep_mesh.get_local_rank()
    loss_worst = grad_worst = 0.0
    for step in range(steps):
        parts = [
            [add_mtp_targets(_batch(100 * step + r * microbatches + j), depth) for j in range(microbatches)]
            for r in range(replicas)
        ]
        set_aux_loss_scale(1.0 / microbatches)
        inputs, kwargs, target = pipeline_batch(concat_batches(parts[replica]), microbatches)
        loss = runner.broadcast_mean(runner.step(inputs, kwargs, target, grad_scale=1.0 / microbatches))
        clip_grad_norm_(list(model.parameters()), 0.05, group=dims.pp_group)
        set_aux_loss_scale(1.0 / (replicas * microbatches))
        ref_losses = [reference.loss(part) for group in parts for part in group]
        (torch.stack(ref_losses).sum() / len(ref_losses)).backward()
        assert torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05) > 0.5, "the case must clip"
        if step == 0:
            ref_params = dict(reference.named_parameters())
            grad_worst = max(
                (full(p.grad) - ref_params[n].grad).abs().max().item() for n, p in model.named_parameters()
            )
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad()
        expected = torch.stack(ref_losses[replica * microbatches : (replica + 1) * microbatches]).mean()
        loss_worst = max(loss_worst, ((loss - expected).abs() / expected).item())
    set_aux_loss_scale(1.0)
    local = full(model.tok_embeddings.weight).detach() if model.tok_embeddings is not None else None
    copies = [None] * dist.get_world_size(dims.pp_group)
    dist.all_gather_object(copies, local, group=dims.pp_group)
    held = [c for c in copies if c is not None]
    return {
        "loss": loss_worst,
        "grad": grad_worst,
        "copies": len(held),
        "equal": all(torch.equal(c, held[0]) for c in held),
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "copies"),
    [
        ({"pp": 2, "dp": 2}, 2),  # FSDP shards both copies over dp: shard-wise sums
        ({"pp": 2, "ep": 2, "depth": 2}, 2),
        ({"pp": 4, "num_layers": 4, "microbatches": 4}, 2),  # the end ranks' own group; middle stages hold none
        pytest.param(
            {"pp": 2, "dp": 2, "num_layers": 4, "schedule": "DualPipeV", "stages_per_rank": 2, "microbatches": 4},
            1,
            marks=NEEDS_V_SCHEDULE_TORCH,
        ),  # first and last stage on rank 0: one tensor
    ],
)
def test_pipelined_mtp_steps_equal_one_process_and_keep_the_copies_equal(case, copies):
    results = get_pool(4).run(mtp_pipeline_case, **case)
    assert max(r["loss"] for r in results) < REL and max(r["grad"] for r in results) < 2e-6, results
    assert all(r["equal"] and r["copies"] == copies for r in results), results


# -- trainer level: the one-process curves ---------------------------------------------------------------
# Depth 2, pp4 and the V schedules are the gradient cases above; every pp preset at 20 steps: docs/mtp.md.
STEPS = ["trainer.max_steps=5", "model.mtp_loss_weight=1.0", "logger=csv", "trainer.log_every_n_steps=1"]
# One loader batch per Lightning batch, as on one process: the logged train/loss and train/mtp_loss of
# a step are then those of the same micro-batch on both (Lightning logs a step's last training_step).
ONE_MICRO_BATCH = ("parallel.pp_schedule=GPipe", "parallel.pp_microbatches=1")
_CURVES: dict[tuple, dict[str, list[float]]] = {}


def _curves(run_dir: Path, *overrides: str) -> dict[str, list[float]]:
    """The objective per step (summary.json) and the logged terms."""
    summary = train_in_pool(run_dir, *STEPS, *overrides)
    rows = [row for row in csv.DictReader((run_dir / "csv" / "metrics.csv").open()) if row.get("train/mtp_loss")]
    return {
        "objective": summary["losses"],
        "loss": [float(r["train/loss"]) for r in rows],
        "mtp_loss": [float(r["train/mtp_loss"]) for r in rows],
    }


def _reference(tmp_path_factory, *overrides: str) -> dict[str, list[float]]:
    if overrides not in _CURVES:
        _CURVES[overrides] = _curves(tmp_path_factory.mktemp("mtp_single") / "run", "parallel=single", *overrides)
        assert all(len(curve) == 5 for curve in _CURVES[overrides].values())
    return _CURVES[overrides]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("preset", "overrides", "layout"),
    [
        ("pp2", ("model.mtp_depth=1",), ONE_MICRO_BATCH),
        ("pp2_ep2", ("model.mtp_depth=1",), ()),
    ],
)
def test_pipelined_mtp_trains_the_one_process_curves(tmp_path, tmp_path_factory, preset, overrides, layout):
    expected = _reference(tmp_path_factory, *overrides)
    curves = _curves(tmp_path / "run", f"parallel={preset}", *overrides, *layout)
    # The terms are logged per Lightning batch: comparable where one holds one loader batch.
    names = ["objective", "loss", "mtp_loss"] if layout == ONE_MICRO_BATCH else ["objective"]
    assert len(curves["mtp_loss"]) == 5, "train/mtp_loss is logged every step"
    for name in names:
        torch.testing.assert_close(torch.tensor(curves[name]), torch.tensor(expected[name]), rtol=REL, atol=0, msg=name)

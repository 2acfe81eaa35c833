"""Micro-batch overlap of the ep all-to-alls (``MoE5DStrategy(overlap_ep_comm=True)``).

The Lightning runs (the ``ep2_overlap`` preset against one process) are in test_strategy_invariance.py's
preset test; here: the hand-over itself, bitwise equality with running the micro-batches one after
the other under FSDP2, and the errors.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_moe import MoE5DStrategy
from lightning_moe.comm.interleave import hand_off, run_interleaved
from lightning_moe.parallel.engines.accumulation import MicroBatchOverlap
from tests.cli import train_in_pool
from tests.dist_pool import get_pool


def test_the_two_micro_batches_take_turns_at_each_all_to_all():
    order = []

    def backward() -> None:
        for i in range(3):
            order.append(f"b{i}")
            hand_off()

    def forward() -> str:
        for i in range(2):
            order.append(f"f{i}")
            hand_off()
        return "loss"

    assert run_interleaved(backward, forward) == "loss"
    # The backward starts; once the forward has ended, the backward's hand-overs return at once.
    assert order == ["b0", "f0", "b1", "f1", "b2"]
    hand_off()  # outside an overlap: nothing happens


def test_a_failing_forward_raises_in_the_caller_after_the_backward_ends():
    done = []

    def forward() -> None:
        hand_off()
        raise ValueError("forward failed")

    with pytest.raises(ValueError, match="forward failed"):
        run_interleaved(lambda: (hand_off(), done.append("backward")), forward)
    assert done == ["backward"]
    with pytest.raises(RuntimeError, match="does not nest"):
        run_interleaved(lambda: run_interleaved(lambda: None, lambda: None), lambda: None)


def test_a_backward_waits_for_the_next_forward_except_the_steps_last():
    overlap, order = MicroBatchOverlap(), []
    assert overlap.forward(lambda: order.append("f0") or 0) == 0
    overlap.backward(lambda: order.append("b0"), last=False)
    assert order == ["f0"]
    overlap.forward(lambda: order.append("f1"))
    overlap.backward(lambda: order.append("b1"), last=True)
    assert order == ["f0", "b0", "f1", "b1"]
    overlap.backward(lambda: None, last=False)
    with pytest.raises(RuntimeError, match="still pending"):
        overlap.backward(lambda: None, last=False)


def _fsdp_steps_with_and_without_overlap() -> dict:
    """ep=2 MoEGPT under FSDP2 gathering once per step: 2 optimizer-free steps of 3 micro-batches,
    one after the other and then interleaved; losses, gradients and the hand-overs."""
    import lightning_moe.moe.exchange as exchange
    from lightning_moe import ParallelDims, parallelize
    from lightning_moe.models import MoEGPT
    from lightning_moe.parallel.engines.fsdp_accumulation import GatherOncePerStep

    dims = ParallelDims(ep=2)
    dims.build_mesh("cpu")
    torch.manual_seed(0)
    model = MoEGPT(
        hidden_size=32, num_layers=2, num_heads=4, moe={"num_experts": 4, "ffn_hidden_size": 32}, max_seq_len=16
    )
    parallelize(model, dims, data_parallel="fsdp")
    gather = GatherOncePerStep(model)
    generator = torch.Generator().manual_seed(torch.distributed.get_rank())
    micro_batches = [torch.randint(0, 256, (2, 17), generator=generator) for _ in range(3)]
    hand_offs = []
    issue_and_hand_off = exchange.hand_off
    exchange.hand_off = lambda: (hand_offs.append(1), issue_and_hand_off())

    def step(overlap: bool) -> tuple[list[float], list[torch.Tensor]]:
        schedule, losses = MicroBatchOverlap() if overlap else None, []
        for i, ids in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            gather.begin_micro_batch(last and not overlap)
            forward = lambda ids=ids: model.loss({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})  # noqa: E731
            loss = forward() if schedule is None else schedule.forward(forward)
            losses.append(loss.item())

            def backward(loss: torch.Tensor = loss, last: bool = last) -> None:
                if last:
                    gather.begin_micro_batch(True)
                loss.backward()
                gather.end_micro_batch()

            backward() if schedule is None else schedule.backward(backward, last)
        grads = [p.grad.full_tensor().clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return losses, grads

    try:
        sequential = step(overlap=False)
        sequential_hand_offs = len(hand_offs)
        interleaved = step(overlap=True)
    finally:
        exchange.hand_off = issue_and_hand_off
    return {
        "same_losses": sequential[0] == interleaved[0],
        "same_grads": all(torch.equal(a, b) for a, b in zip(sequential[1], interleaved[1])),
        "hand_offs": (sequential_hand_offs, len(hand_offs) - sequential_hand_offs),
    }


@pytest.mark.slow
def test_interleaved_micro_batches_give_the_same_bits_under_fsdp():
    """Every all-to-all hands over, and the losses and accumulated gradients equal running the
    micro-batches one after the other. The default dispatcher (one copy per destination rank) issues
    4 exchanges a layer forward (expert ids, rows, gate weights, combined rows) and 3 backward (the
    gradients of all but the ids): 2 layers x 3 micro-batches x 7 = 42 hand-overs."""
    for rank_result in get_pool(2).run(_fsdp_steps_with_and_without_overlap):
        assert rank_result["same_losses"] and rank_result["same_grads"], rank_result
        assert rank_result["hand_offs"] == (42, 42), rank_result


@pytest.fixture
def single_losses(one_process_losses) -> list[float]:
    return one_process_losses()


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tp2_ep2", "cp2_ep2", "dp2_ep2_hsdp"])
def test_overlap_under_tensor_and_context_parallel_matches_one_process(tmp_path, single_losses, preset):
    """The tp collectives (DTensor) and the ring attention's P2P of both micro-batches, issued from the
    two threads in turn, keep one order on every rank: the one-process curve (rel 1e-5, 10 steps). Under
    HSDP the blocks stay gathered (gather_once_per_step) as under FSDP."""
    overlap = train_in_pool(
        tmp_path / preset, f"parallel={preset}", "parallel.gather_once_per_step=true", "parallel.overlap_ep_comm=true"
    )
    torch.testing.assert_close(torch.tensor(overlap["losses"]), torch.tensor(single_losses), rtol=1e-5, atol=0.0)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"ep": 1}, r"ep=1 has none: set ep > 1"),
        ({"ep": 2, "pp": 2}, r"pp=2 needs pp_schedule=.DualPipeV."),
        ({"ep": 2, "gather_once_per_step": True, "activation_checkpointing": "full"}, r"activation_checkpointing='full'"),
        ({"ep": 2}, r"data_parallel='fsdp' needs gather_once_per_step=True"),
        ({"ep": 2, "dp": 2, "data_parallel": "hsdp", "dp_replicate": 2}, r"data_parallel='hsdp' needs gather_once_per_step=True"),
        ({"ep": 2, "data_parallel": "ddp"}, r"data_parallel='ddp': torch's replicate swaps"),
    ],
)  # fmt: skip
def test_overlap_is_refused_where_it_cannot_run(kwargs, message):
    with pytest.raises(MisconfigurationException, match=message):
        MoE5DStrategy(overlap_ep_comm=True, **kwargs)


def test_overlap_is_off_by_default():
    assert MoE5DStrategy(ep=2).overlap_ep_comm is False
    assert MoE5DStrategy(ep=2, gather_once_per_step=True, overlap_ep_comm=True).overlap_ep_comm is True


def test_an_auto_layout_that_chose_overlap_runs_it(monkeypatch):
    """layout="auto" takes the planner's overlap_ep_comm (with the gather once per step it needs) and
    hands the planner the run's activation checkpointing, under which it never chooses overlap."""
    import lightning as L

    import lightning_moe.strategy

    chosen = {
        "tp": 1,
        "cp": 1,
        "ep": 2,
        "dp": 1,
        "pp": 1,
        "etp": 1,
        "gather_once_per_step": True,
        "overlap_ep_comm": True,
    }
    asked = {}
    monkeypatch.setattr(
        lightning_moe.strategy, "auto_layout", lambda world_size, options: asked.update(options) or dict(chosen)
    )
    strategy = MoE5DStrategy(layout="auto", layout_options={"seq_len": 64})
    L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_checkpointing=False)
    assert strategy.overlap_ep_comm and strategy.gather_once_per_step and strategy.parallel_dims.ep == 2
    assert asked == {"checkpointing": "none", "seq_len": 64}

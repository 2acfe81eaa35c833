"""Deliberate bugs for tests/test_verify.py, injected from outside the library.

Each is a Lightning Callback given to `python -m lightning_moe.verify` as
`+verify.callbacks.bug._target_=tests.scripts.verify_bugs.<Name>`: it is built in both runs and
monkeypatches (in its own spawned processes) only when the run has more than one process, so the
single-process reference stays right, as real layout bugs do.
"""

from __future__ import annotations

import lightning as L
import torch


class ExpertGradientTimesTwo(L.Callback):
    """Expert weight gradients x2 before the optimizer step: a reduction dividing by half the group."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # noqa: ANN001
        if trainer.world_size == 1:
            return
        with torch.no_grad():
            for name, param in pl_module.named_parameters():
                if ".experts." in name and param.grad is not None:
                    param.grad.mul_(2.0)


class DropLastTokenDispatcher(L.Callback):
    """The all-to-all dispatchers drop every micro-batch's last token (an off-by-one in their splits)."""

    def setup(self, trainer, pl_module, stage) -> None:  # noqa: ANN001
        if trainer.world_size == 1:
            return
        from lightning_moe.moe.ep_dispatcher import AllToAllDispatcher, PerRankAllToAllDispatcher

        # Every entry point that takes the keep mask (dropping twice is the same as once), in the
        # per-slot and the default one-copy-per-rank dispatcher.
        for cls in (AllToAllDispatcher, PerRankAllToAllDispatcher):
            for method in ("dispatch", "dispatch_start"):
                if method in vars(cls):
                    setattr(cls, method, _dropping_last_token(vars(cls)[method]))


def _dropping_last_token(original):  # noqa: ANN001, ANN202
    def dispatch(self, hidden, topk_idx, keep_mask, *args, **kwargs):  # noqa: ANN001, ANN202
        keep = torch.ones_like(topk_idx, dtype=torch.bool) if keep_mask is None else keep_mask.clone()
        keep[-1] = False
        return original(self, hidden, topk_idx, keep, *args, **kwargs)

    return dispatch


class WrongCausalRingBlock(L.Callback):
    """Ring attention forgets the causal mask on each rank's own (diagonal) block."""

    def setup(self, trainer, pl_module, stage) -> None:  # noqa: ANN001
        if trainer.world_size == 1:
            return
        import importlib

        ring = importlib.import_module("lightning_moe.cp.ring_attention")

        original = ring._plan_block

        def plan_block(rank, src, seq_local, causal, layout):  # noqa: ANN001
            block = original(rank, src, seq_local, causal, layout)
            return block._replace(causal=False) if block is not None and src == rank else block

        ring._plan_block = plan_block


class ColwiseOutputProjection(L.Callback):
    """The user's TP plan shards the attention output projection colwise instead of rowwise."""

    def setup(self, trainer, pl_module, stage) -> None:  # noqa: ANN001
        if trainer.world_size == 1:
            return
        from torch.distributed.tensor.parallel import ColwiseParallel

        from tests.scripts.user_moe_module import UserMoELM

        original = UserMoELM.tensor_parallel_plan

        def plan(self) -> dict:  # noqa: ANN001
            return {k: ColwiseParallel() if k.endswith("attn.out_proj") else v for k, v in original(self).items()}

        UserMoELM.tensor_parallel_plan = plan

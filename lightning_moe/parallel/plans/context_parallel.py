"""Context parallelism for any LightningModule: zigzag batch sharding and SDPA -> ring attention."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from lightning_moe.cp import check_seq_len, zigzag_shard
from lightning_moe.cp.comm import CpComm
from lightning_moe.layout import ulysses_heads_problem
from lightning_moe.parallel.dims import ParallelDims

# Sequence-shaped batch entries sharded by default (docs/architecture.md, "Batches"); users add their
# own keys. The `mtp_*` entries are multi-token prediction's targets `[batch, seq, depth]`, built from
# whole rows by the module's `before_sequence_sharding` (lightning_moe.models.mtp) so that shifted
# tokens cross shard borders.
SEQUENCE_KEYS: tuple[str, ...] = (
    "input_ids",
    "labels",
    "loss_mask",
    "position_ids",
    "document_ids",
    "mtp_input_ids",
    "mtp_labels",
    "mtp_loss_mask",
)
LOSS_TOKEN_COUNT_KEY = "loss_token_count"
MTP_LOSS_TOKEN_COUNT_KEY = "mtp_loss_token_count"


def shard_batch_for_context_parallel(batch: Any, dims: ParallelDims, extra_keys: Iterable[str] = ()) -> Any:
    """This cp rank's zigzag shard of a dict batch, with global ``position_ids`` added first.

    Also adds ``loss_token_count``: the number of loss tokens of the whole micro-batch divided by
    cp (a float tensor), and with multi-token prediction targets ``mtp_loss_token_count`` (the same,
    per depth). A module that divides its local loss sum by it returns a loss whose mean
    over the cp ranks is the mean over all tokens, whatever each rank's share of masked tokens.
    """
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        raise TypeError("context parallelism needs dict batches with an 'input_ids' [batch, seq] entry")
    input_ids = batch["input_ids"]
    seq_len = input_ids.shape[1]
    check_seq_len(seq_len, dims.cp)
    batch = dict(batch)
    if "position_ids" not in batch:
        batch["position_ids"] = torch.arange(seq_len, device=input_ids.device).expand_as(input_ids)
    mask = batch.get("loss_mask")
    count = (mask.sum() if mask is not None else torch.tensor(input_ids.numel())).to(torch.float32)
    mtp_mask = batch.get("mtp_loss_mask")
    if mtp_mask is not None:  # per depth, over the whole micro-batch, like loss_token_count
        batch[MTP_LOSS_TOKEN_COUNT_KEY] = mtp_mask.sum(dim=(0, 1)).to(torch.float32) / dims.cp
    cp_rank = dims.cp_mesh.get_local_rank()
    keys = set(SEQUENCE_KEYS) | set(extra_keys)
    for key in keys:
        value = batch.get(key)
        if isinstance(value, torch.Tensor):
            if value.dim() < 2 or value.shape[1] != seq_len:
                raise ValueError(
                    f"batch[{key!r}] of shape {tuple(value.shape)} is not [batch, {seq_len}, ...]: cannot shard it for cp"
                )
            batch[key] = zigzag_shard(value, cp_rank, dims.cp, dim=1)
    batch[LOSS_TOKEN_COUNT_KEY] = count / dims.cp
    return batch


def check_context_parallel_support(
    module: torch.nn.Module, dims: ParallelDims, cp_comm: str = CpComm.RING.value
) -> None:
    """Reject what context parallelism cannot reproduce exactly (before any work starts): token dropping
    decided per shard, and under ``cp_comm="a2a"`` query heads per tp rank that do not split over cp
    (modules exposing ``num_heads``)."""
    from lightning_moe.moe import MoELayer

    if dims.cp > 1 and cp_comm == CpComm.A2A:
        for name, layer in module.named_modules():
            heads = getattr(layer, "num_heads", None)
            kv_heads = getattr(layer, "num_kv_heads", None) or heads
            # Heads that tp does not divide are tp's to refuse (check_head_counts), with its own fix.
            if not isinstance(heads, int) or heads % dims.tp or kv_heads % dims.tp:
                continue
            problem = ulysses_heads_problem(heads // dims.tp, kv_heads // dims.tp, dims.cp)
            if problem:
                raise ValueError(f"{name or type(module).__name__}.num_heads={heads} over tp={dims.tp}: {problem}")
    if dims.cp * dims.tp == 1:
        return
    for name, layer in module.named_modules():
        if isinstance(layer, MoELayer) and layer.capacity_factor is not None:
            raise ValueError(
                f"{name}: capacity_factor={layer.capacity_factor} with cp*tp={dims.cp * dims.tp} > 1 is not supported yet"
                " (drops would be decided per sequence shard, not per micro-batch): use capacity_factor=None"
            )


__all__ = [
    "LOSS_TOKEN_COUNT_KEY",
    "MTP_LOSS_TOKEN_COUNT_KEY",
    "SEQUENCE_KEYS",
    "check_context_parallel_support",
    "shard_batch_for_context_parallel",
]

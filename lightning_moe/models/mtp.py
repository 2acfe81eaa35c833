"""Multi-token prediction (DeepSeek-V3): the per-depth module and the shifted targets it trains on.

Depth `k` (1-based) sees at position `t` the hidden state of depth `k - 1` at `t` and the embedding
of token `t + k`, and predicts token `t + k + 1` (the label at `t + k`) through the shared output
head. Positions whose target lies past the end of the row (or in another packed document) do not
count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_moe.models.blocks import TransformerBlock
from lightning_moe.models.causal_lm import next_token_loss

__all__ = ["MTP_KEYS", "MultiTokenPrediction", "add_mtp_targets", "mtp_loss"]

#: Sequence-shaped batch entries `[batch, seq, depth]` built by `add_mtp_targets`: the tokens `k`
#: ahead, their labels and which positions count. Under context parallelism they are built from the
#: whole row, then sharded like `input_ids`.
MTP_KEYS: tuple[str, ...] = ("mtp_input_ids", "mtp_labels", "mtp_loss_mask")


class MultiTokenPrediction(nn.Module):
    """One MTP depth: `block(eh_proj([enorm(embedding); hnorm(hidden)]))`; `norm` precedes the
    shared output head.

    The embedding comes first in the concatenation, as in the published DeepSeek-V3 weights, so
    `eh_proj.weight [hidden, 2 * hidden]` loads from them unchanged.

    Example:
        >>> from lightning_moe.models.blocks import Attention, FeedForward, rotary_cos_sin
        >>> mtp = MultiTokenPrediction(TransformerBlock(Attention(64, 4), FeedForward(64, 128), 64), 64)
        >>> cos, sin = rotary_cos_sin(torch.arange(10), 16)
        >>> mtp(torch.randn(2, 10, 64), torch.randn(2, 10, 64), cos, sin).shape
        torch.Size([2, 10, 64])
    """

    def __init__(self, block: TransformerBlock, hidden_size: int, norm_eps: float = 1e-6) -> None:
        super().__init__()
        self.enorm = nn.RMSNorm(hidden_size, eps=norm_eps)
        self.hnorm = nn.RMSNorm(hidden_size, eps=norm_eps)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.block = block
        self.norm = nn.RMSNorm(hidden_size, eps=norm_eps)

    def forward(
        self, hidden: torch.Tensor, embeddings: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """`hidden`: depth `k - 1`'s residual stream (before its final norm); `embeddings`: of the
        tokens `k` ahead. Returns depth `k`'s residual stream (`norm` then the head give its logits)."""
        combined = torch.cat([self.enorm(embeddings), self.hnorm(hidden)], dim=-1)
        return self.block(self.eh_proj(combined), cos, sin)


def add_mtp_targets(batch: Mapping[str, Any], depth: int) -> dict[str, Any]:
    """`batch` with `MTP_KEYS` added for depths `1..depth`, built from its full rows.

    `mtp_input_ids[:, t, k - 1] = input_ids[:, t + k]`, `mtp_labels[:, t, k - 1] = labels[:, t + k]`;
    `mtp_loss_mask[:, t, k - 1]` keeps `t + k < seq` where `loss_mask` (if any) keeps `t + k` and,
    for packed documents, `t` and `t + k` lie in the same document.
    """
    input_ids, labels = batch["input_ids"], batch["labels"]
    seq_len = input_ids.shape[1]
    if depth >= seq_len:
        raise ValueError(
            f"mtp_depth={depth} needs sequences longer than {depth} tokens, got seq_len={seq_len}: "
            "lower model.mtp_depth or raise data.seq_len"
        )
    loss_mask = batch.get("loss_mask")
    documents = batch.get("document_ids")
    ids, targets, masks = [], [], []
    for k in range(1, depth + 1):
        keep = torch.ones_like(input_ids, dtype=torch.bool)
        keep[:, seq_len - k :] = False
        if loss_mask is not None:
            keep[:, : seq_len - k] &= loss_mask[:, k:].bool()
        if documents is not None:
            keep[:, : seq_len - k] &= documents[:, k:] == documents[:, : seq_len - k]
        ids.append(_shift_left(input_ids, k))
        targets.append(_shift_left(labels, k))
        masks.append(keep)
    batch = dict(batch)
    batch["mtp_input_ids"] = torch.stack(ids, dim=-1)
    batch["mtp_labels"] = torch.stack(targets, dim=-1)
    batch["mtp_loss_mask"] = torch.stack(masks, dim=-1)
    return batch


def mtp_loss(depth_logits: Sequence[torch.Tensor], batch: Mapping[str, Any]) -> torch.Tensor:
    """The MTP loss: the mean over depths of each depth's next-token loss on the batch's `MTP_KEYS`.

    `depth_logits[k - 1]`: depth `k`'s logits `[B, S, vocab]`. Under context parallelism the
    batch's `mtp_loss_token_count` (each depth's loss tokens over the whole micro-batch) divides
    that depth's local sum, as `loss_token_count` does the main loss's.

    Example:
        >>> batch = add_mtp_targets({"input_ids": torch.zeros(1, 4, dtype=torch.long),
        ...                          "labels": torch.zeros(1, 4, dtype=torch.long)}, 1)
        >>> torch.isclose(mtp_loss([torch.zeros(1, 4, 8)], batch), torch.tensor(8.0).log()).item()
        True
    """
    counts = batch.get("mtp_loss_token_count")
    return torch.stack(
        [
            next_token_loss(
                logits,
                batch["mtp_labels"][..., k],
                batch["mtp_loss_mask"][..., k],
                counts[k] if counts is not None else None,
            )
            for k, logits in enumerate(depth_logits)
        ]
    ).mean()


def _shift_left(tokens: torch.Tensor, k: int) -> torch.Tensor:
    """`tokens[:, t + k]` at `t`, zeros (masked out) past the end."""
    shifted = torch.zeros_like(tokens)
    shifted[:, : tokens.shape[1] - k] = tokens[:, k:]
    return shifted

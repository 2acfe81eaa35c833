"""Modules for tests/test_verify.py (built by `python -m lightning_moe.verify` through `model._target_`).

- `UserMoELM`: a user's own LightningModule unlike MoEGPT: its own attention through
  F.scaled_dot_product_attention, LayerNorms, learned positions, an MoELayer per block and a
  tensor-parallel plan without SequenceParallel styles (Colwise q/k/v, Rowwise output projection).
- `DropoutGPT`: MoEGPT with dropout after the embeddings (verification must turn it off).
- `UnseededGPT`: MoEGPT whose configure_model draws from an unseeded generator.
"""

from __future__ import annotations

import os

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightning_moe.models import MoEGPT
from lightning_moe.moe import MoELayer


class UserAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.num_heads = heads
        self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[:2]
        q, k, v = (proj(x).view(b, s, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(attn.transpose(1, 2).reshape(b, s, -1))


class UserBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, num_experts: int, ffn: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = UserAttention(hidden, heads)
        self.ln2 = nn.LayerNorm(hidden)
        self.moe = MoELayer(hidden, ffn, num_experts, top_k=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


class UserMoELM(L.LightningModule):
    def __init__(self, vocab_size: int = 256, hidden_size: int = 32, num_heads: int = 4, num_layers: int = 2,
                 num_experts: int = 4, ffn_hidden_size: int = 32, max_seq_len: int = 32, lr: float = 3e-3) -> None:
        super().__init__()
        self.lr = lr
        self.embed = nn.Embedding(vocab_size, hidden_size)
        self.pos = nn.Embedding(max_seq_len, hidden_size)
        self.blocks = nn.ModuleList(UserBlock(hidden_size, num_heads, num_experts, ffn_hidden_size) for _ in range(num_layers))
        self.norm = nn.LayerNorm(hidden_size)
        self.head = nn.Linear(hidden_size, vocab_size, bias=False)

    def tensor_parallel_plan(self, sequence_parallel: bool = True) -> dict:
        plan = {}
        for i in range(len(self.blocks)):
            for name in ("q", "k", "v"):
                plan[f"blocks.{i}.attn.{name}"] = ColwiseParallel()
            plan[f"blocks.{i}.attn.out"] = RowwiseParallel()
        return plan

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids) + self.pos(position_ids)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        positions = batch.get("position_ids")
        if positions is None:
            positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        logits = self(ids, positions)
        per_token = F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(), reduction="none")
        count = batch.get("loss_token_count", per_token.numel())
        return per_token.sum() / count

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class DropoutGPT(MoEGPT):
    """MoEGPT with dropout on the embeddings, as a user might leave it on."""

    def __init__(self, *args, dropout: float = 0.1, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.embed_dropout = nn.Dropout(dropout)
        self.tok_embeddings.register_forward_hook(lambda module, args, out: self.embed_dropout(out))


class UnseededGPT(MoEGPT):
    """MoEGPT whose configure_model initialises a parameter from an unseeded generator."""

    def configure_model(self) -> None:
        generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
        with torch.no_grad():
            self.output.weight.normal_(0.0, 0.02, generator=generator)

"""Transformer building blocks of the reference model (pure torch, torchtitan naming).

The names (`attention.wq/wk/wv/wo`, `feed_forward.w1/w2/w3`, `attention_norm`, `ffn_norm`) are what
`MoEGPT.tensor_parallel_plan()` refers to. Nothing here hardcodes a head count in a reshape:
local head counts follow from the projections' output sizes, so the same code runs on
tensor-parallel shards.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_moe.moe.experts import SharedExpert

__all__ = ["Attention", "FeedForward", "TransformerBlock", "apply_rotary", "rotary_cos_sin"]


def rotary_cos_sin(
    position_ids: torch.Tensor, head_dim: int, theta: float = 10000.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables for the given positions: `cos, sin` of shape `[*position_ids.shape, head_dim/2]`.

    Computed from the position ids themselves (fp32), not from a table indexed by the local
    sequence index: a context-parallel shard that carries its global position ids rotates its
    tokens exactly like the unsharded sequence does.
    """
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim)
    angles = position_ids.to(torch.float32).unsqueeze(-1) * inv_freq
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x [..., seq, heads, head_dim]` by the angles of `cos/sin [..., seq, head_dim/2]`.

    Uses the "rotate half" pairing (dimension i with i + head_dim/2); the math runs in fp32.
    """
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE, through one `F.scaled_dot_product_attention`.

    The SDPA call goes through the `F.` module attribute so that context parallelism can swap it
    for ring attention with a `TorchFunctionMode`. `num_heads`/`num_kv_heads` are the global head
    counts (what tensor parallelism must divide); the local counts are read from the projections.

    Example:
        >>> attn = Attention(hidden_size=64, num_heads=4, num_kv_heads=2)
        >>> cos, sin = rotary_cos_sin(torch.arange(10), attn.head_dim)
        >>> attn(torch.randn(2, 10, 64), cos, sin).shape
        torch.Size([2, 10, 64])
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int | None = None) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size {hidden_size} not divisible by num_heads {num_heads}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} not divisible by num_kv_heads {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = hidden_size // num_heads
        if self.head_dim % 2:
            raise ValueError(f"head dimension hidden_size/num_heads = {self.head_dim} must be even for RoPE")
        self.wq = nn.Linear(hidden_size, num_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(num_heads * self.head_dim, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq = x.shape[0], x.shape[1]
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [batch, heads, seq, head_dim]
        # enable_gqa only when needed: some fused kernels do not take the flag.
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(SharedExpert):
    """Dense SwiGLU MLP of the non-MoE layers: `w2(silu(w1 x) * w3 x)`, the MoE shared expert's math.

    Example:
        >>> FeedForward(64, 176)(torch.randn(2, 5, 64)).shape
        torch.Size([2, 5, 64])
    """


class TransformerBlock(nn.Module):
    """Pre-norm block: `h = x + attention(attention_norm(x)); out = h + feed_forward(ffn_norm(h))`.

    `feed_forward` is any module mapping `[..., hidden] -> [..., hidden]`: a `FeedForward` or an
    `MoELayer`.

    Example:
        >>> block = TransformerBlock(Attention(64, 4), FeedForward(64, 176), 64)
        >>> cos, sin = rotary_cos_sin(torch.arange(10), 16)
        >>> block(torch.randn(2, 10, 64), cos, sin).shape
        torch.Size([2, 10, 64])
    """

    def __init__(self, attention: Attention, feed_forward: nn.Module, hidden_size: int, norm_eps: float = 1e-6) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(hidden_size, eps=norm_eps)
        self.attention = attention
        self.ffn_norm = nn.RMSNorm(hidden_size, eps=norm_eps)
        self.feed_forward = feed_forward

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))

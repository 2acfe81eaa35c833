"""torch's private compute kernels: ``torch._grouped_mm``, ``torch._foreach_mul_`` and aten's fused attention ops.

Floors: torch >= 2.11 (every kernel below is present there with the schema used).
"""

from __future__ import annotations

import torch


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs=offsets)`` (int32 offsets). Present in torch 2.9-2.13; its CPU
    kernels (fp32/bf16/fp16) run on 2.13. Checked on: torch 2.11-2.13."""
    return torch._grouped_mm(a, b, offsets)


def foreach_mul_(tensors: list[torch.Tensor], scalar: torch.Tensor) -> None:
    """``torch._foreach_mul_(tensors, scalar)``: every tensor multiplied in place by a one-element tensor,
    in one kernel per device and dtype (what ``torch.nn.utils.clip_grads_with_norm_`` scales with).
    Present in torch 2.0-2.13. Checked on: torch 2.11-2.13."""
    torch._foreach_mul_(tensors, scalar)


def torch_has_grouped_mm() -> bool:
    """Whether this torch has ``torch._grouped_mm`` (what :func:`grouped_mm` calls). Present in torch
    2.9-2.13. Checked on: torch 2.11-2.13."""
    return hasattr(torch, "_grouped_mm")


# Fused attention kernels that also return the log-sum-exp of each query row (what ring attention
# merges blocks with): aten's private SDPA ops, called without dropout, mask or varlen inputs.
# Their schemas are identical in torch 2.11 and 2.13 (native_functions.yaml); the CPU ones run on
# 2.13 (tests/test_ring_attention.py), the CUDA ones are not yet run in this project.
def flash_attention_cpu_available() -> bool:
    """Whether ``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` exists.
    Checked on: torch 2.11-2.13."""
    return hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def flash_attention_cpu(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, logsumexp [B, H, Sq] fp32)``: ``aten._scaled_dot_product_flash_attention_for_cpu``.
    Checked on: torch 2.11-2.13."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def flash_attention_cpu_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)``: ``aten._scaled_dot_product_flash_attention_for_cpu_backward``.
    Checked on: torch 2.11-2.13."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale
    )


def flash_attention_cuda(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, logsumexp [B, H, Sq] fp32, philox_seed, philox_offset)``:
    ``aten._scaled_dot_product_flash_attention`` (dense inputs, no debug mask).
    Checked on: torch 2.11-2.13."""
    out, lse, _, _, _, _, philox_seed, philox_offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale
    )
    return out, lse, philox_seed, philox_offset


def flash_attention_cuda_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    philox_seed: torch.Tensor,
    philox_offset: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)``: ``aten._scaled_dot_product_flash_attention_backward``. Without dropout the RNG
    state is never read (any forward's has the right type); the cumulative sequence lengths are for
    varlen inputs only (None). Checked on: torch 2.11-2.13."""
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout,
        q,
        k,
        v,
        out,
        lse,
        None,
        None,
        q.shape[2],
        k.shape[2],
        0.0,
        causal,
        philox_seed,
        philox_offset,
        scale=scale,
    )


def efficient_attention_cuda(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, logsumexp [B, H, ceil(Sq / 32) * 32] fp32, philox_seed, philox_offset)``:
    ``aten._scaled_dot_product_efficient_attention`` (no bias). The log-sum-exp keeps the kernel's
    padded columns. Checked on: torch 2.11-2.13."""
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)


def efficient_attention_cuda_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    philox_seed: torch.Tensor,
    philox_offset: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)``: ``aten._scaled_dot_product_efficient_attention_backward``; ``lse`` in the
    forward's padded layout. Checked on: torch 2.11-2.13."""
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout,
        q,
        k,
        v,
        None,
        out,
        lse,
        philox_seed,
        philox_offset,
        0.0,
        [True, True, True, False],
        causal,
        scale=scale,
    )
    return dq, dk, dv

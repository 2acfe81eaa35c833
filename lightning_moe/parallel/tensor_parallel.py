"""Tensor (and sequence) parallelism: the module's own DTensor plan, and its MoE layers' tokens."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

from lightning_moe import comm
from lightning_moe.moe import MoELayer
from lightning_moe.parallel.dims import ParallelDims


def apply_tensor_parallel(module: nn.Module, dims: ParallelDims, sequence_parallel: bool) -> None:
    """Shard ``module`` over ``tp`` with the plan it declares in ``tensor_parallel_plan()``.

    The plan maps module-name patterns to ``ParallelStyle``s (Colwise/Rowwise/SequenceParallel);
    it receives ``sequence_parallel``. MoE layers are not in plans: their tokens arrive as sequence
    shards (SP) or replicated (no SP), where each tp rank keeps only its 1/tp sequence slice and
    the outputs are all-gathered afterwards, so no token is dispatched twice.
    """
    plan_fn = getattr(module, "tensor_parallel_plan", None)
    if callable(plan_fn):
        check_head_counts(module, dims.tp)
        parallelize_module(module, dims.tp_mesh, plan_fn(sequence_parallel=sequence_parallel))
    elif _has_dense_parameters(module):
        raise ValueError(
            f"tp={dims.tp} needs a tensor-parallel plan: {type(module).__name__} has no tensor_parallel_plan() method"
            " returning {module-name pattern: ParallelStyle}; add one or set tp=1"
        )
    if not sequence_parallel:
        for layer in (m for m in module.modules() if isinstance(m, MoELayer)):
            layer.register_forward_pre_hook(partial(_keep_tp_slice, dims=dims))
            layer.register_forward_hook(partial(_gather_tp_slices, dims=dims))


def _has_dense_parameters(module: nn.Module) -> bool:
    """Parameters outside MoE layers (which tensor parallelism handles without a plan)."""
    in_moe = {id(p) for m in module.modules() if isinstance(m, MoELayer) for p in m.parameters()}
    return any(id(p) not in in_moe for p in module.parameters())


def check_head_counts(module: nn.Module, tp: int) -> None:
    """Attention heads and KV heads must split evenly over tp (modules exposing ``num_heads``)."""
    for name, sub in module.named_modules():
        for attr in ("num_heads", "num_kv_heads"):
            count = getattr(sub, attr, None)
            if isinstance(count, int) and count % tp:
                raise ValueError(f"{name}.{attr}={count} is not divisible by tp={tp}: choose tp dividing {attr}")


def _keep_tp_slice(layer: MoELayer, args: tuple[Any, ...], dims: ParallelDims) -> tuple[Any, ...]:
    x = args[0]
    seq_dim = x.dim() - 2
    if x.dim() < 2 or x.shape[seq_dim] % dims.tp:
        raise ValueError(
            f"MoE input {tuple(x.shape)}: sequence length not divisible by tp={dims.tp} (needed to split the"
            " replicated tokens between tp ranks): choose seq_len divisible by tp"
        )
    return (comm.split_to_rank(x, dims.tp_group, seq_dim, "tp"), *args[1:])


def _gather_tp_slices(layer: MoELayer, args: tuple[Any, ...], output: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    return comm.gather_from_ranks(output, dims.tp_group, output.dim() - 2, "tp")

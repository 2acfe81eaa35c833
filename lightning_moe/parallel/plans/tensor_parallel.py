"""Tensor (and sequence) parallelism: the module's own DTensor plan, and its MoE layers' tokens."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from lightning_moe import comm
from lightning_moe._compat import tensor_is_view
from lightning_moe.layout import heads_problem, sequence_split_problem
from lightning_moe.moe import MoELayer
from lightning_moe.parallel.dims import ParallelDims


def apply_tensor_parallel(module: nn.Module, dims: ParallelDims, sequence_parallel: bool) -> None:
    """Shard ``module`` over ``tp`` with the plan it declares in ``tensor_parallel_plan()``.

    The plan maps module-name patterns to ``ParallelStyle``s (Colwise/Rowwise/SequenceParallel);
    ``tensor_parallel_plan(self)`` and ``tensor_parallel_plan(self, sequence_parallel: bool)`` are
    both accepted (the second receives the strategy's ``sequence_parallel``).

    MoE layers are not in plans. Each reads what reaches it: a DTensor sharded over tp on the
    sequence dim (the second-last) is used as is, each tp rank dispatching its own tokens; tokens
    replicated over tp (a plain tensor, or a ``Replicate``/``Partial`` DTensor) are split so that
    each tp rank dispatches 1/tp of them and the outputs are all-gathered, so no token is
    dispatched twice. The output has the input's kind and placement.
    """
    plan_fn = getattr(module, "tensor_parallel_plan", None)
    if callable(plan_fn):
        parallelize_module(module, dims.tp_mesh, call_plan(plan_fn, sequence_parallel))
        # The outputs that leave the module (the root's, and under pp each stage's end modules,
        # which FSDP wraps as units of their own) must be no views: see own_view_outputs.
        for unit in (module, *module.children()):
            unit.register_forward_hook(own_view_outputs)
    elif _has_dense_parameters(module):
        raise ValueError(
            f"tp={dims.tp} needs a tensor-parallel plan: {type(module).__name__} has no tensor_parallel_plan() method"
            " returning {module-name pattern: ParallelStyle}; add one or set tp=1"
        )
    for layer in (m for m in module.modules() if isinstance(m, MoELayer)):
        # Innermost: after the plan's input hooks (which may mark the tokens as a DTensor) and
        # before its output hooks (which expect the output in the input's kind).
        layer.register_forward_pre_hook(partial(_enter_tp_tokens, dims=dims))
        layer.register_forward_hook(partial(_exit_tp_tokens, dims=dims), prepend=True)


class _OwnStorage(torch.autograd.Function):
    """Identity whose output is no view, sharing the input's storage and version counter.

    A custom Function's output is a view only if it is the input itself or a differentiable view
    of it; ``detach()`` is neither, yet keeps the storage (no copy) and the version counter (an
    in-place change the backward cannot tolerate still raises).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def own_view_outputs(module: nn.Module, args: Any, output: Any) -> Any:
    """Forward hook: every plain tensor of ``output`` that is an autograd view comes back as no view.

    A tensor-parallel style with ``use_local_output=True`` ends in ``DTensor.to_local()``, which
    returns a view (e.g. the replicated logits of a column-parallel head). FSDP2 hooks its
    pre-backward on a module's outputs and warns for every view, because an in-place op on one
    would drop that hook. Same values and gradients; no copy.
    """
    if not torch.is_grad_enabled():  # FSDP hooks no backward then
        return output

    def own(tensor: torch.Tensor) -> torch.Tensor:
        if isinstance(tensor, DTensor) or not tensor_is_view(tensor) or not tensor.requires_grad:
            return tensor
        return _OwnStorage.apply(tensor)

    if isinstance(output, torch.Tensor):  # the usual case: no container to rebuild
        return own(output)
    return apply_to_collection(output, torch.Tensor, own)


def call_plan(plan_fn: Callable[..., dict[str, ParallelStyle]], sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """``plan_fn(sequence_parallel=...)`` if it takes that keyword (or ``**kwargs``), else ``plan_fn()``."""
    params = inspect.signature(plan_fn).parameters.values()
    if any(p.name == "sequence_parallel" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return plan_fn(sequence_parallel=sequence_parallel)
    return plan_fn()


def _has_dense_parameters(module: nn.Module) -> bool:
    """Parameters outside MoE layers (which tensor parallelism handles without a plan)."""
    in_moe = {id(p) for m in module.modules() if isinstance(m, MoELayer) for p in m.parameters()}
    return any(id(p) not in in_moe for p in module.parameters())


def check_head_counts(module: nn.Module, tp: int) -> None:
    """Attention heads and KV heads must split evenly over tp (modules exposing ``num_heads``)."""
    for name, sub in module.named_modules():
        for attr in ("num_heads", "num_kv_heads"):
            count = getattr(sub, attr, None)
            problem = heads_problem(attr, count, tp, owner=name) if isinstance(count, int) else None
            if problem:
                raise ValueError(problem)


# How the tokens that reached a layer looked, per call in flight (a stack: activation checkpointing
# re-enters forward): None for a plain tensor, else the DTensor's (mesh, placements).
_TOKEN_LAYOUTS_ATTR = "_lightning_moe_tp_token_layouts"


def _enter_tp_tokens(layer: MoELayer, args: tuple[Any, ...], dims: ParallelDims) -> tuple[Any, ...]:
    """Forward pre-hook: hand the layer this tp rank's distinct tokens, whatever kind ``x`` is."""
    x = args[0]
    layouts = layer.__dict__.setdefault(_TOKEN_LAYOUTS_ATTR, [])
    if not isinstance(x, DTensor):
        layouts.append(None)
        return (_split_replicated(x, dims), *args[1:])
    seq_dim = x.dim() - 2
    placement = _tp_placement(x, dims)
    if isinstance(placement, Shard):
        if placement.dim % x.dim() != seq_dim:
            raise ValueError(
                f"MoE input DTensor {tuple(x.shape)} is sharded over tp on dim {placement.dim}: MoE layers take"
                f" tokens sharded on the sequence dim ({seq_dim}) or replicated; fix the tensor-parallel plan"
                " around the MoE layer (e.g. SequenceParallel, or a Replicate output before it)"
            )
        layouts.append((x.device_mesh, x.placements, False))
        return (x.to_local(), *args[1:])
    if isinstance(placement, Partial):
        x = x.redistribute(placements=[Replicate() if isinstance(p, Partial) else p for p in x.placements])
    layouts.append((x.device_mesh, x.placements, True))
    return (_split_replicated(x.to_local(), dims), *args[1:])


def _exit_tp_tokens(layer: MoELayer, args: tuple[Any, ...], output: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """Forward hook: the output in the input's kind and placement (replicated tokens all-gathered)."""
    layout = layer.__dict__[_TOKEN_LAYOUTS_ATTR].pop()
    if layout is None:
        return comm.gather_from_ranks(output, dims.tp_group, output.dim() - 2, "tp")
    mesh, placements, was_split = layout
    if was_split:
        output = comm.gather_from_ranks(output, dims.tp_group, output.dim() - 2, "tp")
    return DTensor.from_local(output, mesh, placements, run_check=False)


def _tp_placement(x: DTensor, dims: ParallelDims) -> Any:
    names = x.device_mesh.mesh_dim_names or ()
    if "tp" in names:
        return x.placements[names.index("tp")]
    if x.device_mesh.ndim == 1 and x.device_mesh.size() == dims.tp:
        return x.placements[0]
    raise ValueError(
        f"MoE input DTensor lives on a mesh {names or x.device_mesh.shape} without a 'tp' dim: convert it to a"
        " local tensor (replicated over tp) or a DTensor on the tp mesh"
    )


def _split_replicated(x: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    seq_dim = x.dim() - 2
    problem = "no sequence dim to split over tp" if x.dim() < 2 else sequence_split_problem(x.shape[seq_dim], dims.tp)
    if problem:
        raise ValueError(f"MoE input {tuple(x.shape)}: {problem}")
    return comm.split_to_rank(x, dims.tp_group, seq_dim, "tp")

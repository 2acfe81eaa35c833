"""How a converted transformers MoE causal LM is split: its tensor-parallel plan and its pipeline stages.

Both work on the transformers model (``model.model.layers``, ``model.lm_head``) and cover only
the parts still present, so a pipeline stage gets the plan of its own layers. What differs between
families comes from :func:`lightning_moe.hf.families.model_family`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)

from lightning_moe._compat import ParallelStyleWithApply, apply_parallel_style, module_parameter_table
from lightning_moe.hf.families import model_family
from lightning_moe.layout import stage_slices
from lightning_moe.moe import MoELayer
from lightning_moe.parallel.plans.pipeline import check_stage_layers

__all__ = ["ReduceGradOfTrailingColumns", "ShardHeadParameter", "split_pipeline_stage", "tensor_parallel_plan"]


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over ``group`` (Megatron's "f" operator)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceGradOfTrailingColumns(ParallelStyleWithApply):
    """For a replicated ``nn.Linear`` whose last output columns feed every tp rank's *local* heads
    without passing a DTensor op (MLA's shared rotary key ``k_rot``): sum their gradient over tp.

    The other columns reach the heads through a column-parallel projection, whose input gradient
    torch's tensor parallelism already reduces.
    """

    def __init__(self, start: int) -> None:
        super().__init__()
        self.start = start

    def apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        group, start = device_mesh.get_group(), self.start

        def hook(mod: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
            return torch.cat([out[..., :start], _SumGradOverGroup.apply(out[..., start:], group)], dim=-1)

        module.register_forward_hook(hook)
        return module


class ShardHeadParameter(ParallelStyleWithApply):
    """Shard a per-head parameter (GPT-OSS's attention ``sinks [heads]``) over tp like the heads.

    The parameter becomes a DTensor ``Shard(0)``; during the module's forward its local shard (a
    differentiable view) stands in for it, so the model code sees this rank's heads only.

    The view is taken of the parameter the module holds when its forward starts, not of the one
    made here: data parallelism (FSDP2) later replaces it by its own sharded parameter and, for each
    forward, registers an unsharded one. A view of the parameter made here would send the gradient
    to a tensor that is no longer trained (the sinks stayed at their initial values under tp2).
    """

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        name = self.name
        full = module_parameter_table(module)[name]
        module_parameter_table(module)[name] = nn.Parameter(
            distribute_tensor(full.detach(), device_mesh, [Shard(0)]), requires_grad=full.requires_grad
        )
        held: list[Any] = []  # the parameter the module holds during its forward

        def enter(mod: nn.Module, args: Any) -> None:
            param = module_parameter_table(mod)[name]
            held.append(param)
            module_parameter_table(mod)[name] = param.to_local() if isinstance(param, DTensor) else param  # type: ignore[assignment]

        def leave(mod: nn.Module, args: Any, out: Any) -> None:
            module_parameter_table(mod)[name] = held.pop()

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave)
        return module


class _Sequence(ParallelStyleWithApply):
    """Apply several styles to one module (``parallelize_module`` takes one per name)."""

    def __init__(self, *styles: ParallelStyle | None) -> None:
        super().__init__()
        self.styles = [s for s in styles if s is not None]

    def apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        for style in self.styles:
            module = apply_parallel_style(style, module, device_mesh)
        return module


def tensor_parallel_plan(
    model: nn.Module, sequence_parallel: bool = True, prefix: str = ""
) -> dict[str, ParallelStyle]:
    """Megatron-style plan over ``model.model.layers`` of a converted transformers causal LM.

    Attention q/k/v (MLA: ``q_b_proj``/``kv_b_proj``; ``q_proj`` without q-LoRA) column-wise,
    ``o_proj`` row-wise; dense MLPs ``gate/up`` column-wise, ``down`` row-wise; embeddings
    row-wise (vocab split) and ``lm_head`` column-wise with replicated logits. With
    ``sequence_parallel`` the norms run on sequence shards and the MoE layers receive
    sequence-sharded DTensors; otherwise the MoE layers receive replicated tokens. Multi-token
    prediction layers (after the main ones) get a layer's plan too.
    ``prefix``: where ``model`` sits in the module the plan is applied to (``"model."``).
    """
    family = model_family(model.config.model_type)
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {}
    inner = model.model
    if inner.embed_tokens is not None:
        plan[prefix + "model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if inner.norm is not None and sequence_parallel:
        plan[prefix + "model.norm"] = SequenceParallel(use_local_output=True)
    if model.lm_head is not None:
        plan[prefix + "lm_head"] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
    for key, layer in inner.layers.named_children():
        at = f"{prefix}model.layers.{key}."
        attn = layer.self_attn
        if sequence_parallel:
            plan[at + "input_layernorm"] = SequenceParallel(use_local_output=True)
            plan[at + "post_attention_layernorm"] = SequenceParallel(use_local_output=True)
            plan[at + "self_attn"] = PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
                use_local_output=True,
            )
        # Which projections exist depends on the config too (MLA without q-LoRA has q_proj).
        for name in ("q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj"):
            if getattr(attn, name, None) is not None:
                plan[at + f"self_attn.{name}"] = ColwiseParallel()
        if family.shared_rotary_key:
            plan[at + "self_attn.kv_a_proj_with_mqa"] = ReduceGradOfTrailingColumns(attn.kv_lora_rank)
        if family.attention_sinks:
            plan[at + "self_attn"] = _Sequence(plan.get(at + "self_attn"), ShardHeadParameter("sinks"))
        if family.qk_norm == "per_head":
            for name in ("q_norm", "k_norm"):
                # Per-head norms over [B, S, heads, head_dim]: the local heads are a shard of dim 2.
                plan[at + f"self_attn.{name}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan[at + "self_attn.o_proj"] = RowwiseParallel(output_layouts=seq)
        mlp = layer.mlp
        # A converted block is the MoELayer itself or, for a block returning a tuple, its ``.moe``;
        # anything else (DeepSeek-V3's dense first layers) is a dense MLP.
        moe_name = "mlp.moe" if isinstance(getattr(mlp, "moe", None), MoELayer) else "mlp"
        if isinstance(mlp, MoELayer) or moe_name == "mlp.moe":
            if sequence_parallel:
                plan[at + moe_name] = PrepareModuleInputOutput(
                    input_layouts=(Shard(1),),
                    desired_input_layouts=(Shard(1),),
                    use_local_input=False,
                    output_layouts=(Shard(1),),
                    desired_output_layouts=(Shard(1),),
                    use_local_output=True,
                )
        else:
            if sequence_parallel:
                plan[at + "mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            plan[at + "mlp.gate_proj"] = ColwiseParallel()
            plan[at + "mlp.up_proj"] = ColwiseParallel()
            plan[at + "mlp.down_proj"] = RowwiseParallel(output_layouts=seq)
        if sequence_parallel and hasattr(layer, "eh_proj"):
            # A multi-token prediction layer's own per-token parts (lightning_moe.hf.mtp) on sequence
            # shards: replicated weights, their gradients summed over tp.
            for name in ("enorm", "hnorm", "eh_proj", "shared_head.norm"):
                plan[at + name] = SequenceParallel(use_local_output=True)
    return plan


def split_pipeline_stage(
    model: nn.Module, stage_index: int, num_stages: int, stage_layers: Sequence[int] | None = None
) -> None:
    """Keep, in place, stage ``stage_index`` of ``num_stages``: its part of ``model.model.layers``
    (original keys; ``stage_layers`` per stage in stage order, else an even split), the embeddings on
    the first stage and the final norm and ``lm_head`` on the last.

    A model keeps one stage: splitting it again (several stages per rank) is refused.
    """
    inner = model.model
    keys = [key for key, _ in inner.layers.named_children()]
    # Fewer layers than the config's: an earlier call already cut this model to one stage.
    if len(keys) != model.config.num_hidden_layers:
        raise ValueError(
            "HFMoEModule runs one pipeline stage per rank: use pp_stages_per_rank=1 (schedules GPipe or 1F1B)"
        )
    if stage_layers is None:
        if len(keys) % num_stages:
            raise ValueError(
                f"{len(keys)} layers cannot be split evenly into {num_stages} pipeline stages: choose pp dividing"
                f" {len(keys)}, or give the layers of each stage with pp_stage_layers"
            )
        stage_layers = [len(keys) // num_stages] * num_stages
    check_stage_layers(stage_layers, num_stages, len(keys))
    mine = set(keys[stage_slices(stage_layers)[stage_index]])
    for key in keys:
        if key not in mine:
            delattr(inner.layers, key)
    if stage_index != 0:
        inner.embed_tokens = None
    if stage_index != num_stages - 1:
        inner.norm = None
        model.lm_head = None

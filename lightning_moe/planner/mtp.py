"""Multi-token prediction on the last pipeline stage (``MoEGPT(mtp_depth=D)``): its compute, memory-bound
traffic, parameters and activations.

Each depth (``lightning_moe.models.mtp.MultiTokenPrediction``) runs one transformer block built like
the main model's last layer (MoE when it is: its attention, FFN or experts, router and norms), the
norms ``enorm`` and ``hnorm`` of the token embedding ahead and of the hidden state, the projection
``eh_proj [hidden, 2 * hidden]`` of their concatenation, a final norm and the shared output head
over the same tokens as the main model. The embedding and the head are the main model's; under
pp > 1 the last stage holds a copy of the embedding weight of its own (the first stage's kept
equal to it, as Megatron ties the embedding of the first and last stage), so its rank counts that
copy's parameters, gradients and optimizer states too. ``parallelize`` shards the block as a
layer's, and runs ``enorm``, ``hnorm``, ``eh_proj`` and the final norm on sequence shards with
their weights replicated over tp. FSDP2 wraps each depth's experts (and, under tp, router and shared
expert) as units of their own; the rest joins the root unit under pp = 1, and under pp > 1 forms
one unit (the ``mtp`` child) beside the embedding copy's.

Where a term holds a block of the last layer's kind, the module counting that quantity for the main
model passes the block's figure in (:mod:`~lightning_moe.planner.flops`, :mod:`~lightning_moe.planner.memory`,
:mod:`~lightning_moe.planner.elementwise`), so those modules import this one and not the reverse.
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import lru_cache

from lightning_moe.planner.candidate import Layout
from lightning_moe.planner.dtypes import ACTIVATION_BYTES
from lightning_moe.planner.model_shape import ModelShape
from lightning_moe.planner.parameters import ParamSpec, local_shape, parameter_specs_for

__all__ = ["mtp_activation_bytes", "mtp_elementwise_bytes_per_token", "mtp_flops_per_microbatch", "mtp_parameter_specs",
           "mtp_units"]  # fmt: skip

# Per token and depth, elements of the hidden size the per-token modules keep for backward: enorm's
# and hnorm's inputs (the embedding ahead, the hidden state), their concatenation (eh_proj's input,
# 2 x hidden) and the final norm's input and output (the head's input).
MTP_SAVED_HIDDENS = 6
# HBM traffic of the same modules per token and depth, in elements of the hidden size: enorm and
# hnorm read and write hidden each (4), the concatenation reads 2 and writes 2 (4), the final norm
# reads and writes hidden (2).
MTP_TRAFFIC_HIDDENS = 10


def mtp_flops_per_microbatch(
    model: ModelShape, layout: Layout, seq_len: int, block: dict[str, float]
) -> dict[str, float]:
    """Forward FLOPs of the ``model.mtp_depth`` MTP modules on one rank of the last stage, by op kind:
    per depth ``block``, a layer of the last layer's kind by op kind (the keys of
    :func:`lightning_moe.planner.flops.flops_per_microbatch`, which passes it), with ``eh_proj`` and
    the shared output head added to its dense FLOPs.

    Example::

        block = flops_per_microbatch(shape, Layout(), 4096, [shape.num_layers - 1], last=False)
        mtp_flops_per_microbatch(shape, Layout(), 4096, block)["dense"]
    """
    if not model.mtp_depth:
        return {"dense": 0.0, "shared_expert": 0.0, "expert": 0.0, "attention": 0.0}
    tokens = layout.micro_batch_size * seq_len / layout.cp
    h = model.hidden_size
    # eh_proj runs on the tp rank's sequence shard, the head on the vocabulary shard: both / tp.
    depth = {**block, "dense": block["dense"] + 2 * tokens * (2 * h * h + h * model.vocab_size) / layout.tp}
    return {kind: model.mtp_depth * value for kind, value in depth.items()}


def mtp_parameter_specs(model: ModelShape, layout: Layout) -> tuple[ParamSpec, ...]:
    """One MTP depth's parameters (``mtp.0.*``; every depth shards alike) as ``parallelize`` shards
    them, and under pp > 1 the last stage's embedding copy (``mtp_embedding``), each in its FSDP2
    unit: the block's experts ``mtp.experts`` and router ``mtp.router`` (tp > 1) as a layer's; the
    rest in ``mtp``, a unit of its own under pp > 1 and part of the root (``last``) under pp = 1."""
    return _mtp_parameter_specs(model, layout.tp > 1, layout.etp == layout.tp, layout.pp > 1)


@lru_cache(maxsize=64)
def _mtp_parameter_specs(model: ModelShape, tp_on: bool, etp_is_tp: bool, pipelined: bool) -> tuple[ParamSpec, ...]:
    layer = model.num_layers - 1
    h = model.hidden_size
    rest = "mtp" if pipelined else "last"
    out = []
    for spec in parameter_specs_for(model, tp_on, etp_is_tp):
        if spec.stage_part == f"layer:{layer}":
            unit = spec.unit.replace(f"layer{layer}", "mtp") if "." in spec.unit else rest
            name = spec.name.replace(f"layers.{layer}.", "mtp.0.block.")
            out.append(replace(spec, name=name, unit=unit, stage_part="last"))
        elif spec.name == "tok_embeddings.weight" and pipelined:
            out.append(replace(spec, unit="mtp_embedding", stage_part="last"))
    for name, shape in (("enorm", (h,)), ("hnorm", (h,)), ("eh_proj", (h, 2 * h)), ("norm", (h,))):
        out.append(ParamSpec(f"mtp.0.{name}.weight", shape, None, False, rest, "dense", "last"))
    return tuple(out)


def mtp_units(model: ModelShape, layout: Layout, rank: int) -> dict[str, tuple[int, int, int, str]]:
    """``{unit: (units, padded shard, unsharded, FSDP group)}`` of the MTP parameters a rank of the
    last stage holds (:func:`mtp_parameter_specs` over all ``model.mtp_depth`` depths): how many
    units of that name, per unit the elements of FSDP2's padded shard on ``rank`` and of the local
    tensor it gathers, and the group it shards over. Units holding every depth (``mtp``, ``last``)
    count once with all depths' elements; the per-depth ones (experts, router) ``mtp_depth`` times.
    Empty without MTP.

    Example::

        mtp_units(ModelShape(mtp_depth=1, num_experts=4), Layout(ep=2), rank=0)["mtp.experts"]
    """
    return _mtp_units(model, layout.mesh, rank) if model.mtp_depth else {}


@lru_cache(maxsize=2**12)
def _mtp_units(model: ModelShape, mesh: Layout, rank: int) -> dict[str, tuple[int, int, int, str]]:
    depth = model.mtp_depth
    out: dict[str, tuple[int, int, int, str]] = {}
    for spec in mtp_parameter_specs(model, mesh):
        per_depth = "." in spec.unit
        once = spec.unit == "mtp_embedding"  # one copy, whatever the depth
        scale = 1 if per_depth or once else depth
        shard = scale * math.prod(local_shape(spec, mesh, rank, padded=True))
        unsharded = scale * math.prod(local_shape(spec, mesh, rank, fsdp=False))
        units, old_shard, old_unsharded, group = out.get(spec.unit, (depth if per_depth else 1, 0, 0, spec.group))
        out[spec.unit] = (units, old_shard + shard, old_unsharded + unsharded, group)
    return out


def mtp_activation_bytes(model: ModelShape, layout: Layout, seq_len: int, block: float, precision: str) -> float:
    """Activations the ``model.mtp_depth`` MTP depths keep for backward, for one micro-batch, on one
    rank of the last stage: per depth ``block``, what a layer of the last layer's kind keeps under the
    checkpointing mode (:func:`~lightning_moe.planner.memory.activation_bytes_per_layer`, which
    :func:`~lightning_moe.planner.memory.memory_per_rank` passes) and, in every mode, the per-token
    modules' :data:`MTP_SAVED_HIDDENS` hidden-size tensors on the rank's sequence shard. The
    depths' logits are :func:`~lightning_moe.planner.memory.memory_per_rank`'s.

    Example::

        block = activation_bytes_per_layer(shape, Layout(), 4096, shape.num_layers - 1, "none", "bf16-mixed")
        mtp_activation_bytes(shape, Layout(), 4096, block, "bf16-mixed")
    """
    if not model.mtp_depth:
        return 0.0
    tokens = layout.micro_batch_size * seq_len / layout.cp / layout.tp
    per_token = MTP_SAVED_HIDDENS * model.hidden_size * ACTIVATION_BYTES[precision]
    return model.mtp_depth * (block + tokens * per_token)


def mtp_elementwise_bytes_per_token(model: ModelShape, layer_bytes: float, loss_bytes: float, precision: str) -> float:
    """HBM bytes per token of the MTP depths' memory-bound ops (before the split over tp): per depth
    a layer of the last layer's kind (``layer_bytes``: what its memory-bound ops move per token), the
    per-token modules' :data:`MTP_TRAFFIC_HIDDENS` hidden-size tensors and a loss over the
    vocabulary (``loss_bytes``)."""
    per_depth = layer_bytes + MTP_TRAFFIC_HIDDENS * model.hidden_size * ACTIVATION_BYTES[precision] + loss_bytes
    return model.mtp_depth * per_depth

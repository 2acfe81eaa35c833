"""Parameters: every one of the main model, sharded as ``lightning_moe.parallelize`` shards it on each rank.

Tensor-parallel plan, experts ``Shard(0)`` over ep and their FFN dim over etp, then FSDP2's ``Shard(0)``
of the local tensor over the dense/expert/token data-parallel meshes, padded as FSDP2 pads (experts
fewer per rank than their edp group shard on another dim instead: :func:`expert_fsdp_dim`); and the
specs of each kind (embedding, last stage, one MoE and one dense layer) that per-rank sums read. The
multi-token prediction depths' specs start from these (:mod:`lightning_moe.planner.mtp`); what a rank
holds of both, and the FSDP2 units, are :mod:`lightning_moe.planner.rank_shards`'.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from lightning_moe.planner.candidate import Layout, holds_first_stage, holds_last_stage, rank_layers
from lightning_moe.planner.groups import fsdp_shard_group, group_index, group_size
from lightning_moe.planner.model_shape import ModelShape


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def chunk_size(length: int, parts: int, index: int) -> int:
    """Length of chunk ``index`` of ``torch.chunk(range(length), parts)`` (empty past the end).

    FSDP2 and DTensor ``Shard`` both split by these semantics. Example: ``chunk_size(10, 4, 3) == 1``.
    """
    size = _ceil_div(length, parts)
    return max(0, min(size, length - index * size))


def expert_fsdp_dim(local: tuple[int, ...] | list[int], tp_dim: int | None, n: int) -> int:
    """The dim FSDP2 shards an expert parameter's local tensor on over its ``n`` edp ranks, as
    ``lightning_moe.parallel.plans.data_parallel.expert_shard_dim`` chooses it: dim 0 when the rank holds at
    least ``n`` experts; else the largest dim other than dim 0 and ``tp_dim`` that ``n`` divides
    (ties: the lower dim), so each rank holds ``1 / (ep * edp)`` of the expert state; dim 0 if none.

    Example: ``expert_fsdp_dim((1, 4096, 7168), 2, 4) == 1`` (Mixtral-8x7B, ep8, etp2, edp4).
    """
    if local[0] >= n:
        return 0
    candidates = [d for d in range(1, len(local)) if d != tp_dim and local[d] % n == 0]
    return max(candidates, key=lambda d: (local[d], -d), default=0)


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: global shape, tensor-parallel split (dim or None), expert split, FSDP unit."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None  # dim sharded over tp (DTensor Shard), None: replicated over tp
    expert: bool  # Shard(0) over ep (and tp_dim over etp when etp = tp)
    unit: str  # FSDP unit name
    group: str  # FSDP mesh: "dense", "edp" or "token"
    stage_part: str  # "layer:<i>", "first" or "last"

    @property
    def layer(self) -> int | None:
        """The index of the layer the parameter belongs to (None: embedding, final norm, output)."""
        return int(self.stage_part.split(":")[1]) if self.stage_part.startswith("layer:") else None


def parameter_specs(model: ModelShape, layout: Layout) -> list[ParamSpec]:
    """Every parameter of the model with how ``lightning_moe.parallelize`` shards it."""
    return list(parameter_specs_for(model, layout.tp > 1, layout.etp == layout.tp))


@lru_cache(maxsize=64)
def parameter_specs_for(model: ModelShape, tp_on: bool, etp_is_tp: bool) -> tuple[ParamSpec, ...]:
    """:func:`parameter_specs` from the two facts of a layout the specs depend on: ``tp_on``, tensor
    parallelism (tp > 1), and ``etp_is_tp``, the experts split over tp as well (etp = tp). Cached per
    model and pair, so the layouts of a search share a handful of tuples (the MTP depths' specs,
    :func:`~lightning_moe.planner.mtp.mtp_parameter_specs`, start from the same)."""
    h, v = model.hidden_size, model.vocab_size
    specs = [
        ParamSpec("tok_embeddings.weight", (v, h), 0 if tp_on else None, False, "first", "dense", "first"),
        ParamSpec("norm.weight", (h,), None, False, "last", "dense", "last"),
        ParamSpec("output.weight", (v, h), 0 if tp_on else None, False, "last", "dense", "last"),
    ]
    etp = etp_is_tp and tp_on
    for i in range(model.num_layers):
        p, part = f"layers.{i}.", f"layer:{i}"
        block = f"layer{i}"
        specs += [
            ParamSpec(p + "attention_norm.weight", (h,), None, False, block, "dense", part),
            ParamSpec(p + "ffn_norm.weight", (h,), None, False, block, "dense", part),
            ParamSpec(p + "attention.wq.weight", (model.q_dim, h), 0 if tp_on else None, False, block, "dense", part),
            ParamSpec(p + "attention.wk.weight", (model.kv_dim, h), 0 if tp_on else None, False, block, "dense", part),
            ParamSpec(p + "attention.wv.weight", (model.kv_dim, h), 0 if tp_on else None, False, block, "dense", part),
            ParamSpec(p + "attention.wo.weight", (h, model.q_dim), 1 if tp_on else None, False, block, "dense", part),
        ]
        if model.is_moe(i):
            e, f = model.num_experts, model.moe_ffn_hidden_size
            side_unit, side_group = (f"layer{i}.router", "token") if tp_on else (block, "dense")
            specs.append(ParamSpec(p + "feed_forward.router.weight", (e, h), None, False, side_unit, side_group, part))
            if model.shared_expert_hidden_size:
                fs = model.shared_expert_hidden_size
                for name, shape in (("w1", (fs, h)), ("w3", (fs, h)), ("w2", (h, fs))):
                    specs.append(
                        ParamSpec(
                            p + f"feed_forward.shared_expert.{name}.weight",
                            shape,
                            None,
                            False,
                            side_unit,
                            side_group,
                            part,
                        )
                    )
            for name, shape, ffn_dim in (("w1", (e, h, f), 2), ("w3", (e, h, f), 2), ("w2", (e, f, h), 1)):
                specs.append(
                    ParamSpec(
                        p + f"feed_forward.experts.{name}",
                        shape,
                        ffn_dim if etp else None,
                        True,
                        f"layer{i}.experts",
                        "edp",
                        part,
                    )
                )
        else:
            f = model.ffn_hidden_size
            for name, shape, dim in (("w1", (f, h), 0), ("w3", (f, h), 0), ("w2", (h, f), 1)):
                specs.append(
                    ParamSpec(
                        p + f"feed_forward.{name}.weight", shape, dim if tp_on else None, False, block, "dense", part
                    )
                )
    return tuple(specs)


def local_shape(
    spec: ParamSpec, layout: Layout, rank: int, *, fsdp: bool = True, padded: bool = False
) -> tuple[int, ...]:
    """The shape of ``spec`` on ``rank``: ep and tp splits (DTensor chunks), then FSDP2's chunk: of dim 0,
    or for experts fewer per rank than their edp group, of :func:`expert_fsdp_dim` (an even split).
    Under HSDP FSDP2 shards over the group's shard part (:func:`~lightning_moe.planner.groups.fsdp_shard_group`).

    ``padded``: FSDP2's allocation (every rank holds ``ceil(dim0 / n)`` rows) instead of the chunk.
    """
    coords = layout.coordinates(rank)
    shape = list(spec.shape)
    if spec.expert:
        # the rank's place in its ep group, which spans the folded attention dims too
        shape[0] = chunk_size(shape[0], layout.ep, group_index(layout, "ep", coords))
    if spec.tp_dim is not None:
        shape[spec.tp_dim] = chunk_size(shape[spec.tp_dim], layout.tp, coords["tp"])
    if fsdp:
        group = fsdp_shard_group(layout, spec.group)  # HSDP: shards within the replica group only
        n = group_size(layout, group)
        dim = expert_fsdp_dim(shape, spec.tp_dim, n) if spec.expert and n > 1 else 0
        if dim:
            shape[dim] //= n  # FSDP2 shards a dim > 0 only evenly: no padding
        elif n > 1:
            shape[0] = _ceil_div(shape[0], n) if padded else chunk_size(shape[0], n, group_index(layout, group, coords))
    return tuple(shape)


def representative_specs(model: ModelShape, layout: Layout) -> list[ParamSpec]:
    """The embedding/norm/output specs and those of one MoE and one dense layer (all layers of a kind
    shard alike): with :func:`kind_of` and :func:`kind_counts`, per-rank sums need no loop over every layer."""
    return list(_representative_specs(model, layout.tp > 1, layout.etp == layout.tp))


@lru_cache(maxsize=64)
def _representative_specs(model: ModelShape, tp_on: bool, etp_is_tp: bool) -> tuple[ParamSpec, ...]:
    moe = next((i for i in range(model.num_layers) if model.is_moe(i)), None)
    dense = next((i for i in range(model.num_layers) if not model.is_moe(i)), None)
    keep = {"first", "last", f"layer:{moe}", f"layer:{dense}"}
    return tuple(s for s in parameter_specs_for(model, tp_on, etp_is_tp) if s.stage_part in keep)


def representative_numels(model: ModelShape, layout: Layout, rank: int) -> tuple[tuple[ParamSpec, str, int, int], ...]:
    """``(spec, kind, padded shard, unsharded)`` for each of :func:`representative_specs`: its
    :func:`kind_of` and the elements ``rank`` holds of it, FSDP2's padded shard and the local tensor
    FSDP2 gathers (ep and tp splits only). Cached per mesh (:attr:`Layout.mesh`): memory and FSDP
    traffic ask for the same ranks of every micro-batch and schedule variant of a mesh."""
    return _representative_numels(model, layout.mesh, rank)


@lru_cache(maxsize=2**16)
def _representative_numels(model: ModelShape, mesh: Layout, rank: int) -> tuple[tuple[ParamSpec, str, int, int], ...]:
    return tuple(
        (
            spec,
            kind_of(model, spec),
            math.prod(local_shape(spec, mesh, rank, padded=True)),
            math.prod(local_shape(spec, mesh, rank, fsdp=False)),
        )
        for spec in _representative_specs(model, mesh.tp > 1, mesh.etp == mesh.tp)
    )


def kind_of(model: ModelShape, spec: ParamSpec) -> str:
    """``"first"``, ``"last"``, or the kind of the spec's layer: ``"moe"`` or ``"dense"``."""
    if spec.layer is None:
        return spec.stage_part
    return "moe" if model.is_moe(spec.layer) else "dense"


def kind_counts(model: ModelShape, layout: Layout, pp_rank: int) -> dict[str, int]:
    """How many of each :func:`kind_of` pipeline rank ``pp_rank`` holds."""
    moe, dense = _layer_kinds(model, rank_layers(model, layout, pp_rank))
    return {
        "first": int(holds_first_stage(layout, pp_rank)),
        "last": int(holds_last_stage(layout, pp_rank)),
        "moe": moe,
        "dense": dense,
    }


@lru_cache(maxsize=4096)  # asked for each layout's edge ranks: few distinct pipelines
def _layer_kinds(model: ModelShape, layers: tuple[int, ...]) -> tuple[int, int]:
    """``(MoE layers, dense layers)`` among ``layers``."""
    return sum(model.is_moe(i) for i in layers), sum(not model.is_moe(i) for i in layers)

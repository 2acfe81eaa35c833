"""The parameter shards a rank holds, the main model's (:mod:`lightning_moe.planner.parameters`) and on the
last stage the multi-token prediction depths' and the embedding copy's (:mod:`lightning_moe.planner.mtp`),
and the FSDP2 units they are gathered in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_moe.planner.candidate import Layout, holds_first_stage, holds_last_stage, rank_layers
from lightning_moe.planner.dtypes import FP32_BYTES
from lightning_moe.planner.model_shape import ModelShape
from lightning_moe.planner.mtp import mtp_parameter_specs, mtp_units
from lightning_moe.planner.parameters import ParamSpec, local_shape, parameter_specs, representative_numels


@dataclass
class FsdpUnit:
    """One kind of FSDP2 unit (:func:`fsdp_units`): its name, the mesh it shards over, whether it is a root."""

    name: str
    group: str
    root: bool
    padded_shard_numel: float  # per rank, summed over the unit's parameters
    ranks_fraction: float  # fraction of all ranks holding one such unit (pipeline stages)
    count: int = 1  # units of this kind in the model


def _rank_holds(spec: ParamSpec, model: ModelShape, layout: Layout, pp_rank: int) -> bool:
    if spec.stage_part == "first":
        return holds_first_stage(layout, pp_rank)
    if spec.stage_part == "last":
        return holds_last_stage(layout, pp_rank)
    return spec.layer in rank_layers(model, layout, pp_rank)


def rank_parameters(
    model: ModelShape, layout: Layout, rank: int, *, padded: bool = False
) -> dict[str, tuple[int, ...]]:
    """``{name: local shape}`` of every parameter ``rank`` holds (FSDP shards included), the last
    stage's multi-token prediction depths and embedding copy among them (:mod:`~lightning_moe.planner.mtp`).

    Example::

        rank_parameters(shape, Layout(tp=2, dp=2), rank=3)["layers.0.attention.wq.weight"]
    """
    pp_rank = layout.coordinates(rank)["pp"]
    out = {
        spec.name: local_shape(spec, layout, rank, padded=padded)
        for spec in parameter_specs(model, layout)
        if _rank_holds(spec, model, layout, pp_rank)
    }
    if model.mtp_depth and holds_last_stage(layout, pp_rank):  # every depth shards as the first
        for spec in mtp_parameter_specs(model, layout):
            shape = local_shape(spec, layout, rank, padded=padded)
            out.update({spec.name.replace("mtp.0.", f"mtp.{k}.", 1): shape for k in range(model.mtp_depth)})
    return out


def parameter_bytes_per_rank(
    model: ModelShape, layout: Layout, rank: int, *, padded: bool = False, dtype_bytes: int = FP32_BYTES
) -> int:
    """Bytes of the parameter shards ``rank`` holds (exact chunks, or FSDP2's padded allocation)."""
    return dtype_bytes * sum(math.prod(shape) for shape in rank_parameters(model, layout, rank, padded=padded).values())


def fsdp_units(model: ModelShape, layout: Layout) -> list[FsdpUnit]:
    """FSDP2 units as ``apply_data_parallel`` wraps them: per block, experts, router (tp > 1), the root.

    Under pp = 1 the whole module is the root unit (embedding, final norm, output), which FSDP does
    not reshard after forward; under pp > 1 each of those children is a unit of its own and every
    top-level unit (embedding, norm, output, each block) is first called on its own and becomes a
    root. Experts and router units nest inside a block and never are. ``count``: units of that
    kind in the whole model. The last stage's multi-token prediction depths add theirs
    (:func:`~lightning_moe.planner.mtp.mtp_units`).
    """
    totals: dict[tuple[str, str], float] = {}
    groups: dict[tuple[str, str], str] = {}
    for spec, kind, padded_shard, _ in representative_numels(model, layout, rank=0):
        if kind in ("first", "last"):
            name = spec.name if layout.pp > 1 else "root"
        else:
            name = spec.unit.split(".", 1)[1] if "." in spec.unit else "block"
        key = (kind, name)
        totals[key] = totals.get(key, 0) + padded_shard
        groups[key] = spec.group
    counts = {"first": 1, "last": 1, "moe": model.num_moe_layers, "dense": model.num_layers - model.num_moe_layers}
    units = []
    for (kind, name), numel in totals.items():
        if kind in ("first", "last") and name == "root" and any(u.name == "root" for u in units):
            units[[u.name for u in units].index("root")].padded_shard_numel += numel  # type: ignore[misc]
            continue
        root = kind in ("first", "last") or (layout.pp > 1 and name == "block")
        units.append(FsdpUnit(name, groups[(kind, name)], root, numel, 1.0 / layout.pp, counts[kind]))
    for name, (count, shard, _, group) in mtp_units(model, layout, rank=0).items():
        if name == "last":  # pp = 1: the MTP modules' own parameters are the root's
            next(u for u in units if u.name == "root").padded_shard_numel += shard
            continue
        units.append(FsdpUnit(name, group, "." not in name, shard, 1.0 / layout.pp, count))
    return units

"""A candidate layout: the five sizes, its mesh coordinates and which layers each pipeline rank holds."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any

from lightning_moe.cp.comm import CpComm, check_cp_comm
from lightning_moe.layout import (
    MESH_DIMS,
    PARALLEL_DIMS,
    V_SCHEDULES,
    ResolvedLayout,
    hsdp_problem,
    normalize_fold_ep,
    rank_coordinates,
    stage_slices,
)
from lightning_moe.planner.model_shape import ModelShape

_RING = CpComm.RING.value  # read per layout


@dataclass(frozen=True)
class Layout:
    """One candidate: the five sizes, expert tensor parallel, micro-batch and pipeline schedule.

    ``microbatches``: micro-batches per optimizer step on each data-parallel rank; under pp > 1 each
    pipeline step runs ``pp_microbatches`` of them (0: all, one pipeline step per optimizer step).
    ``gather_once_per_step``: FSDP gathers each unit once per optimizer step (any pipeline schedule).
    ``fold_ep``: parallel folding, the attention dims (``"tp"``, ``"cp"``) the expert ep group spans
    too (:func:`lightning_moe.layout.normalize_fold_ep`). ``ep`` is the expert-parallel size either
    way, as ``ParallelDims`` takes it; the mesh's ep dim holds its unfolded part (:attr:`mesh_ep`).
    ``dp_replicate``: HSDP when > 1 (``data_parallel="hsdp"``): dp splits into that many replica
    groups of :attr:`dp_shard` ranks (replicas vary slower); FSDP2 shards parameters within a replica
    group only, over ``dp_shard`` x the group's other dims, and all-reduces gradient shards across
    the replica groups. ``overlap_ep_comm``: each micro-batch's backward runs interleaved with the
    next one's forward, each one's expert all-to-alls in flight while the other computes
    (:class:`lightning_moe.parallel.engines.accumulation.OverlapEngine`; the strategy takes it with ep > 1, and either pp = 1 and
    ``gather_once_per_step`` or ``pp_schedule="DualPipeV"``, whose paired forward and backward
    interleave the same way, :func:`lightning_moe.planner.search.layout_problems`).
    ``v_schedule``: the pipeline schedule places two stages per rank in a V (:attr:`v_schedule`).
    ``cp_comm``: how attention crosses the cp ranks under cp > 1, ``"ring"`` (ring attention, K/V
    blocks passed around the cp ring behind the block compute) or ``"a2a"`` (an all-to-all from
    sequence shards to head shards, full-sequence attention, and back; needs the query heads per tp
    rank divisible by cp: :func:`lightning_moe.planner.search.cp_comm_options`); cp = 1 has no cp
    attention, so its ``cp_comm`` is always ``"ring"`` (one layout, one label).
    ``strategy_kwargs()`` gives the :class:`~lightning_moe.MoE5DStrategy` arguments.

    The cost model asks a layout for its sizes millions of times in a search: what derives from the
    fields is computed once (``cached_property``, kept in the instance's ``__dict__``, which the
    frozen fields' equality, hash and ``dataclasses.replace`` never read).
    """

    tp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1
    pp: int = 1
    etp: int = 1
    micro_batch_size: int = 1
    microbatches: int = 1
    pp_schedule: str = "1F1B"
    pp_stages_per_rank: int = 1
    pp_microbatches: int = 0
    gather_once_per_step: bool = False
    fold_ep: tuple[str, ...] = ()
    dp_replicate: int = 1
    overlap_ep_comm: bool = False
    cp_comm: str = CpComm.RING.value
    pp_stage_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # a list (Hydra's) and a tuple are one layout; the counts themselves are checked by layout_problems
        object.__setattr__(self, "pp_stage_layers", tuple(self.pp_stage_layers))
        # "cp,tp", ["tp", "cp"] and ("cp", "tp") are one layout: one hash, one label
        object.__setattr__(self, "fold_ep", normalize_fold_ep(self.fold_ep))
        check_cp_comm(self.cp_comm)
        if self.cp == 1:  # no context-parallel attention to choose for
            object.__setattr__(self, "cp_comm", _RING)
        elif isinstance(self.cp_comm, CpComm):  # kept as the plain string
            object.__setattr__(self, "cp_comm", self.cp_comm.value)
        problem = hsdp_problem(self.dp, self.dp_replicate) if self.dp_replicate != 1 else None
        if problem:
            raise ValueError(problem)

    @property
    def hsdp(self) -> bool:
        """Whether data parallelism is HSDP (FSDP2 on 2-D ``(replicate, shard)`` meshes)."""
        return self.dp_replicate > 1

    @property
    def dp_shard(self) -> int:
        """The dp ranks of one HSDP replica group (dp itself without HSDP)."""
        return self.dp // self.dp_replicate

    @property
    def mesh_ep(self) -> int:
        """The size of the mesh's ep dim: ``ep`` over the folded dims' product (``ep`` unfolded)."""
        return self._sizes["ep"]

    @cached_property
    def mesh(self) -> Layout:
        """This layout's mesh alone (sizes, etp, folding, HSDP; the rest at its defaults): parameter
        shards and group geometry depend on nothing else, so caches keyed on it are shared by every
        micro-batch and schedule variant of a mesh. One instance per mesh (:func:`_mesh`), so that
        those caches find it by identity and its own cached sizes are computed once."""
        return _mesh(self.tp, self.cp, self.ep, self.dp, self.pp, self.etp, self.fold_ep, self.dp_replicate)

    @property
    def v_schedule(self) -> bool:
        """Whether the pipeline places its two stages per rank in a V (``ZBVZeroBubble``, ``DualPipeV``):
        rank r runs stages r and 2 pp - 1 - r."""
        return self.pp > 1 and self.pp_schedule in V_SCHEDULES

    @property
    def pipeline_microbatches(self) -> int:
        """Micro-batches of one pipeline step (all of the optimizer step's unless set)."""
        return self.pp_microbatches or self.microbatches

    @property
    def pipeline_steps(self) -> int:
        """Pipeline steps (Lightning batches) per optimizer step under pp > 1."""
        return max(1, self.microbatches // self.pipeline_microbatches)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.mesh_ep * self.dp * self.pp

    def size(self, dim: str) -> int:
        """A mesh dim's size (``ep``: :attr:`mesh_ep`), or an expert-view group's (``edp``, ``etp``):
        the product of the mesh dims it spans. The expert-parallel size is :attr:`ep`."""
        return self._sizes[dim]

    @cached_property
    def _sizes(self) -> dict[str, int]:
        """What :meth:`size` answers, one dict for the layouts of a mesh (never written to)."""
        return _mesh_sizes(self.tp, self.cp, self.ep, self.dp, self.pp, self.etp, self.fold_ep)

    def parallel_sizes(self) -> dict[str, int]:
        """The five sizes as the strategy takes them (``ep``: the expert-parallel size, folded or not)."""
        return {d: getattr(self, d) for d in PARALLEL_DIMS}

    def label(self) -> str:
        """Everything the estimate depends on besides the model and cluster, e.g.
        ``tp8·ep8·dp2·pp8 mb1 1F1B pp_microbatches=32``: the sizes, ``etp1`` when experts are not
        tensor-parallel, the micro-batch size and, under pp > 1, the schedule (``v2``: stages per
        rank, unwritten for ``ZBVZeroBubble`` and ``DualPipeV``, which always run two) and the
        micro-batches of one pipeline step (they set the bubble), so that two layouts with different
        estimates never share a label. A folded ep names the dims it folds over,
        ``tp8·ep8(fold tp)`` (8 ranks), apart from ``tp8·ep8`` (64); folding tp implies etp1. HSDP
        writes dp as replica groups x shard ranks: ``hsdp2x4`` is dp8 in 2 replica groups of 4.
        All-to-all context parallelism names itself, ``cp4(a2a)`` (ring attention, the default, is
        plain ``cp4``). ``gather_once_per_step`` and ``overlap_ep_comm`` are named when set."""
        sizes = self.parallel_sizes()
        parts = [self._size_note(d, n) for d, n in sizes.items() if n > 1] or ["single"]
        if self.tp > 1 and self.etp == 1 and "tp" not in self.fold_ep:
            parts.append("etp1")
        text = "·".join(parts) + f" mb{self.micro_batch_size}"
        if self.pp > 1:
            loops = self.pp_stages_per_rank > 1 and not self.v_schedule
            text += f" {self.pp_schedule}" + (f"v{self.pp_stages_per_rank}" if loops else "")
            text += f" pp_microbatches={self.pipeline_microbatches}"
            if self.pp_stage_layers:
                text += f" pp_stage_layers={'/'.join(map(str, self.pp_stage_layers))}"
        if self.gather_once_per_step:
            text += " gather_once_per_step"
        if self.overlap_ep_comm:
            text += " overlap_ep_comm"
        return text

    def _size_note(self, dim: str, size: int) -> str:
        """One dim of the label: ``ep8(fold tp)``, ``hsdp2x4`` (dp8 as 2 replica groups of 4),
        ``cp4(a2a)`` (all-to-all context parallelism), ``tp2``."""
        if dim == "cp" and self.cp_comm != _RING:
            return f"cp{size}({self.cp_comm})"
        if dim == "ep" and self.fold_ep:
            return f"ep{size}(fold {','.join(self.fold_ep)})"
        if dim == "dp" and self.hsdp:
            return f"hsdp{self.dp_replicate}x{self.dp_shard}"
        return f"{dim}{size}"

    def strategy_kwargs(self) -> dict[str, Any]:
        """The :class:`~lightning_moe.MoE5DStrategy` arguments that run this layout; options at the
        strategy's default are left out (``cp_comm`` appears as ``"a2a"`` only)."""
        kwargs: dict[str, Any] = self.parallel_sizes()
        kwargs["etp"] = self.etp
        if self.fold_ep:
            kwargs["fold_ep"] = ",".join(self.fold_ep)
        if self.hsdp:
            kwargs.update(data_parallel="hsdp", dp_replicate=self.dp_replicate)
        if self.pp > 1:
            kwargs.update(
                pp_schedule=self.pp_schedule,
                pp_microbatches=self.pipeline_microbatches,
                pp_stages_per_rank=self.pp_stages_per_rank,
            )
            if self.pp_stage_layers:
                kwargs["pp_stage_layers"] = list(self.pp_stage_layers)
        if self.gather_once_per_step:
            kwargs["gather_once_per_step"] = True
        if self.overlap_ep_comm:
            kwargs["overlap_ep_comm"] = True
        if self.cp_comm != _RING:
            kwargs["cp_comm"] = self.cp_comm
        return kwargs

    def coordinates(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of ``rank`` in the ``(pp, dp, ep, cp, tp)`` row-major mesh."""
        return rank_coordinates(self._sizes, rank)

    def mesh_sizes(self) -> dict[str, int]:
        """Each mesh dim's size."""
        return {dim: self._sizes[dim] for dim in MESH_DIMS}


@lru_cache(maxsize=2**14)
def _mesh(tp: int, cp: int, ep: int, dp: int, pp: int, etp: int, fold_ep: tuple[str, ...], dp_replicate: int) -> Layout:
    return Layout(tp, cp, ep, dp, pp, etp, fold_ep=fold_ep, dp_replicate=dp_replicate)


@lru_cache(maxsize=2**14)
def _mesh_sizes(tp: int, cp: int, ep: int, dp: int, pp: int, etp: int, fold_ep: tuple[str, ...]) -> dict[str, int]:
    """Each mesh dim's size, then each expert-view group's (the product of the mesh dims it spans)."""
    resolved = ResolvedLayout(tp, cp, ep, dp, pp, etp, fold_ep)
    return {**resolved.mesh_sizes, **{group: resolved.group_size(group) for group in ("edp", "etp")}}


def stage_layers(model: ModelShape, layout: Layout) -> tuple[tuple[int, ...], ...]:
    """The layers of each pipeline stage in order: ``layout.pp_stage_layers`` of them, else an equal share."""
    return _split_layers(model.num_layers, layout.pp * layout.pp_stages_per_rank, layout.pp_stage_layers)


@lru_cache(maxsize=1024)
def _split_layers(num_layers: int, stages: int, counts: tuple[int, ...] = ()) -> tuple[tuple[int, ...], ...]:
    layers = tuple(range(num_layers))
    return tuple(layers[part] for part in stage_slices(counts or (num_layers // stages,) * stages))


def rank_layers(model: ModelShape, layout: Layout, pp_rank: int) -> tuple[int, ...]:
    """The layers of every stage pipeline rank ``pp_rank`` runs, stage by stage."""
    return _rank_layers(
        model.num_layers, layout.pp, layout.pp_stages_per_rank, layout.v_schedule, pp_rank, layout.pp_stage_layers
    )


@lru_cache(maxsize=4096)  # asked for each layout's edge ranks: few distinct pipelines
def _rank_layers(
    num_layers: int, pp: int, stages_per_rank: int, v_schedule: bool, pp_rank: int, counts: tuple[int, ...] = ()
) -> tuple[int, ...]:
    stages = _split_layers(num_layers, pp * stages_per_rank, counts)
    return tuple(i for st in _rank_stages(pp, stages_per_rank, v_schedule, pp_rank) for i in stages[st])


def rank_stages(layout: Layout, pp_rank: int) -> list[int]:
    """Stages of pipeline rank ``pp_rank`` (lightning_moe.parallel.plans.pipeline.stage_ids): loop placement
    ``pp_rank + k * pp``, or under a V schedule ``pp_rank`` and ``2 * pp - 1 - pp_rank``."""
    return _rank_stages(layout.pp, layout.pp_stages_per_rank, layout.v_schedule, pp_rank)


def _rank_stages(pp: int, stages_per_rank: int, v_schedule: bool, pp_rank: int) -> list[int]:
    if v_schedule:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def edge_pp_ranks(layout: Layout) -> list[int]:
    """The first and the last pipeline rank, one of which is the busiest: the first holds the embedding
    and the most micro-batches in flight, the last the output and its logits (under a V schedule the
    first holds both); middle ranks hold as many layers and neither. Uneven stages (``pp_stage_layers``)
    can make any rank the busiest: all of them."""
    if layout.pp_stage_layers:
        return list(range(layout.pp))
    return sorted({0, layout.pp - 1})


def holds_first_stage(layout: Layout, pp_rank: int) -> bool:
    """Whether pipeline rank ``pp_rank`` runs the first stage (the embedding)."""
    return 0 in rank_stages(layout, pp_rank)


def holds_last_stage(layout: Layout, pp_rank: int) -> bool:
    """Whether pipeline rank ``pp_rank`` runs the last stage (final norm, output and loss)."""
    return layout.pp * layout.pp_stages_per_rank - 1 in rank_stages(layout, pp_rank)

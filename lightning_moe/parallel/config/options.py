"""``ParallelConfig``: the layout and parallel options of a :class:`~lightning_moe.MoE5DStrategy`, validated in one place.

The strategy's keyword arguments, except Lightning's own ``process_group_backend`` and ``timeout``,
are this dataclass's fields: ``MoE5DStrategy(tp=2, ep=2)`` builds ``ParallelConfig(tp=2, ep=2)`` and
keeps it as ``strategy.config``; ``MoE5DStrategy(config=cfg)`` takes a ready one. The Hydra
``parallel`` presets (``lightning_moe/conf/parallel/*.yaml``) hold these fields plus those two.

Example::

    cfg = ParallelConfig(tp=2, ep=2, data_parallel="fsdp")
    strategy = MoE5DStrategy(config=cfg, timeout=600)
    wider = MoE5DStrategy(config=cfg.replace(ep=4))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_moe.cp.comm import CpComm, check_cp_comm
from lightning_moe.layout import hsdp_problem
from lightning_moe.parallel.dims import ParallelDims
from lightning_moe.parallel.plans.activation_checkpoint import check_activation_checkpointing
from lightning_moe.parallel.plans.parallelize import DATA_PARALLEL_KINDS
from lightning_moe.parallel.plans.pipeline import check_pipeline_config, check_stage_layers

# The fields ``layout="auto"`` takes from the planner (:func:`lightning_moe.planner.resolve_auto_layout`):
# those its choice names get its value, the others their default (``ParallelConfig.with_planned``).
PLANNED_FIELDS: tuple[str, ...] = (
    "tp", "cp", "ep", "dp", "pp", "etp", "fold_ep", "pp_schedule", "pp_microbatches", "pp_stages_per_rank",
    "dp_replicate", "dp_shard", "gather_once_per_step", "overlap_ep_comm", "cp_comm",
)  # fmt: skip

__all__ = ["PLANNED_FIELDS", "ParallelConfig"]


@dataclass(frozen=True)
class ParallelConfig:
    """The layout and parallel options of one :class:`~lightning_moe.MoE5DStrategy` (its constructor's
    arguments but ``process_group_backend`` and ``timeout``), all by keyword.

    Frozen and checked on construction (also by :meth:`replace`): a bad value raises
    ``MisconfigurationException`` naming the argument and the fix, so ``ParallelConfig(...)``
    succeeding means ``MoE5DStrategy(config=...)`` builds. What needs the world size (``dp="auto"``,
    ``tp*cp*ep*dp*pp`` against the devices, HSDP's split) is checked when the strategy launches. The
    meaning of every field is in :class:`~lightning_moe.MoE5DStrategy`'s docstring and docs/strategy.md.

    Three fields are normalized: ``context_parallel_keys`` becomes a tuple, and ``fold_ep`` and
    ``pp_stage_layers``, when lists, tuples (Hydra passes lists), so that configs built either way compare equal.
    """

    # sizes
    tp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int | Literal["auto"] = "auto"
    pp: int = 1
    etp: int | None = None
    fold_ep: str | Sequence[str] | None = None
    # pipeline
    pp_schedule: Literal["GPipe", "1F1B", "Interleaved1F1B", "DualPipeV", "ZBVZeroBubble"] = "1F1B"
    pp_microbatches: int | None = None
    pp_stages_per_rank: int = 1
    pp_stage_layers: Sequence[int] | None = None
    # data parallel
    data_parallel: Literal["fsdp", "hsdp", "ddp", "none"] = "fsdp"
    dp_replicate: int | None = None
    dp_shard: int | None = None
    gather_once_per_step: bool = False
    overlap_ep_comm: bool = False
    # tensor and context parallel
    sequence_parallel: bool = True
    context_parallel_keys: Sequence[str] = ()
    cp_head_chunks: int = 1
    cp_comm: CpComm | str = CpComm.RING.value
    # checkpoints
    save_distributed_checkpoint: bool = True
    async_checkpoint: bool = False
    # layout choice and topology
    layout: Literal["manual", "auto"] = "manual"
    layout_options: Mapping[str, Any] | None = None
    ranks_per_node: int | None = None
    # training features
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    compile: bool = False
    deterministic: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "context_parallel_keys", tuple(self.context_parallel_keys))
        if self.fold_ep is not None and not isinstance(self.fold_ep, str):
            object.__setattr__(self, "fold_ep", tuple(self.fold_ep))
        if self.pp_stage_layers is not None:
            object.__setattr__(self, "pp_stage_layers", tuple(self.pp_stage_layers))
        object.__setattr__(self, "deterministic", bool(self.deterministic))
        self._check_arguments()
        self._check_overlap_ep_comm()
        try:  # the sizes without a world size, and the pipeline schedule, as the strategy builds them
            self.parallel_dims()
            check_pipeline_config(self.pp, self.pp_schedule, self.microbatches, self.pp_stages_per_rank)
            check_stage_layers(self.pp_stage_layers, self.pp * self.pp_stages_per_rank)
        except ValueError as err:
            raise MisconfigurationException(str(err)) from err

    def parallel_dims(self) -> ParallelDims:
        """A new :class:`~lightning_moe.ParallelDims` of these sizes (``dp="auto"``: -1, inferred at
        launch); ``ValueError`` naming the fix for sizes that fit no world size."""
        return ParallelDims(
            tp=self.tp,
            cp=self.cp,
            ep=self.ep,
            dp=-1 if self.dp == "auto" else self.dp,
            pp=self.pp,
            etp=self.etp,
            ranks_per_node=self.ranks_per_node,
            fold_ep=self.fold_ep,
        )

    @property
    def microbatches(self) -> int:
        """Loader micro-batches per pipeline step: ``pp_microbatches``, or ``pp`` when it is None."""
        return self.pp if self.pp_microbatches is None else self.pp_microbatches

    def _check_arguments(self) -> None:
        """The checks of single options and of options across the layout (the sizes: ``ParallelDims``)."""
        if self.layout not in ("manual", "auto"):
            raise MisconfigurationException(
                f"layout={self.layout!r} must be 'manual' (the sizes given) or 'auto' (the planner's)"
            )
        data_parallel = self.data_parallel
        if data_parallel not in DATA_PARALLEL_KINDS:
            raise MisconfigurationException(f"data_parallel={data_parallel!r} must be one of {DATA_PARALLEL_KINDS}")
        if not isinstance(self.cp_head_chunks, int) or self.cp_head_chunks < 1:
            raise MisconfigurationException(
                f"cp_head_chunks={self.cp_head_chunks!r} must be a positive integer dividing the key/value heads"
            )
        try:
            check_cp_comm(self.cp_comm)
        except ValueError as err:
            raise MisconfigurationException(str(err)) from err
        if self.dp != "auto" and (not isinstance(self.dp, int) or self.dp < 1):
            raise MisconfigurationException(f"dp={self.dp!r} must be a positive integer or 'auto'")
        if self.pp > 1 and not self.save_distributed_checkpoint:
            raise MisconfigurationException(
                f"pp={self.pp} > 1 needs save_distributed_checkpoint=True: each pipeline stage saves its own parameters"
            )
        if not isinstance(self.async_checkpoint, bool):
            raise MisconfigurationException(f"async_checkpoint={self.async_checkpoint!r} must be True or False")
        if self.async_checkpoint and not self.save_distributed_checkpoint:
            raise MisconfigurationException(
                "async_checkpoint=True needs save_distributed_checkpoint=True: background saves write DCP folders;"
                " set async_checkpoint=False to save one full file"
            )
        try:
            check_activation_checkpointing(self.activation_checkpointing)
        except ValueError as err:
            raise MisconfigurationException(str(err)) from err
        if not isinstance(self.compile, bool):
            raise MisconfigurationException(f"compile={self.compile!r} must be True or False")
        if not isinstance(self.gather_once_per_step, bool):
            raise MisconfigurationException(f"gather_once_per_step={self.gather_once_per_step!r} must be True or False")
        if data_parallel != "hsdp" and (self.dp_replicate is not None or self.dp_shard is not None):
            raise MisconfigurationException(
                f"dp_replicate={self.dp_replicate!r}, dp_shard={self.dp_shard!r} split dp for HSDP, but"
                f" data_parallel={data_parallel!r}: set data_parallel='hsdp' or leave both unset"
            )
        if data_parallel == "hsdp" and self.dp_replicate is None and self.dp_shard is None:
            raise MisconfigurationException(hsdp_problem(1))
        if self.gather_once_per_step and data_parallel not in ("fsdp", "hsdp"):
            raise MisconfigurationException(
                f"gather_once_per_step=True needs data_parallel='fsdp' or 'hsdp' (got data_parallel={data_parallel!r}):"
                " only FSDP gathers parameters; set data_parallel='fsdp' or gather_once_per_step=False"
            )

    def _check_overlap_ep_comm(self) -> None:
        """Where micro-batch overlap (:class:`lightning_moe.parallel.engines.accumulation.OverlapEngine`) cannot run,
        say why (under ``layout="auto"`` the planner chooses ep, so ep is not checked)."""
        overlap, pp, data_parallel = self.overlap_ep_comm, self.pp, self.data_parallel
        if not isinstance(overlap, bool):
            raise MisconfigurationException(f"overlap_ep_comm={overlap!r} must be True or False")
        if not overlap:
            return
        if self.ep == 1 and self.layout != "auto":
            raise MisconfigurationException(
                "overlap_ep_comm=True hides expert-parallel all-to-alls, but ep=1 has none: set ep > 1"
            )
        if pp > 1 and self.pp_schedule != "DualPipeV":
            raise MisconfigurationException(
                f"overlap_ep_comm=True with pp={pp} needs pp_schedule='DualPipeV' (its paired forward and backward of two"
                f" micro-batches interleave); pp_schedule={self.pp_schedule!r} runs one micro-batch at a time"
            )
        if self.activation_checkpointing != "none":
            raise MisconfigurationException(
                f"overlap_ep_comm=True with activation_checkpointing={self.activation_checkpointing!r}: the recomputation"
                " in backward swaps the random-number state, which the interleaved forward shares; use"
                " activation_checkpointing='none' or overlap_ep_comm=False"
            )
        if data_parallel == "ddp":
            raise MisconfigurationException(
                "overlap_ep_comm=True with data_parallel='ddp': torch's replicate swaps each module's parameters in and"
                " out around its forward, while the interleaved backward still uses them; use data_parallel='fsdp' with"
                " gather_once_per_step=True"
            )
        # Under DualPipeV the paired forward and backward run on the rank's two stages, never on one FSDP unit.
        if pp == 1 and data_parallel in ("fsdp", "hsdp") and not self.gather_once_per_step:
            raise MisconfigurationException(
                f"overlap_ep_comm=True with data_parallel={data_parallel!r} needs gather_once_per_step=True: FSDP2 would"
                " reshard a block after the next micro-batch's forward while the previous one's backward still needs it"
            )

    def replace(self, **changes: Any) -> ParallelConfig:
        """A copy with ``changes`` applied, checked again (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)

    def with_planned(self, chosen: Mapping[str, Any]) -> ParallelConfig:
        """This ``layout="auto"`` config once the planner has chosen: each of :data:`PLANNED_FIELDS` takes
        ``chosen``'s value, or its default where the choice leaves it out (the planner names only
        options off their default); ``chosen`` may also name ``data_parallel`` (HSDP)."""
        return self.replace(**{**{name: self.default(name) for name in PLANNED_FIELDS}, **chosen})

    @classmethod
    def default(cls, name: str) -> Any:
        """The default of field ``name`` (every field has one)."""
        return cls.__dataclass_fields__[name].default

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The names of the fields, in order: the :class:`~lightning_moe.MoE5DStrategy` arguments they hold."""
        return tuple(f.name for f in dataclasses.fields(cls))

"""Pipeline parallelism: split a module into stages over ``pp`` and run a ``torch.distributed.pipelining`` schedule.

A module says how it splits in one of three ways (first match wins):

1. ``pipeline_split(stage_index, num_stages) -> nn.Module``: returns the stage's module, which must
   share its parameters with ``module`` (e.g. a shallow copy with parts removed);
2. ``pipeline_stage_layers``: a list with, per stage, the keys of the block container it runs;
3. the default convention: the block container — ``module.layers``, or the attribute named by
   ``pipeline_layers_attr`` (e.g. ``"blocks"``), an ``nn.ModuleDict`` or ``nn.ModuleList`` — is cut
   in order, evenly or by the strategy's ``pp_stage_layers`` (layers per stage); the first stage
   also keeps ``pipeline_first_stage_modules`` (default ``("tok_embeddings",)``), the last one
   ``pipeline_last_stage_modules`` (default ``("norm", "output")``); on other stages these attributes are None, so ``forward`` must accept a
   hidden state as input and return one (``MoEGPT`` does). Blocks keep their keys on every stage
   (a ``ModuleList`` stage iterates over its own blocks, named ``blocks.2``, ``blocks.3``, ...).
   A module named in both lists (``MoEGPT``'s ``tok_embeddings`` under multi-token prediction) is
   *tied*: the first and the last stage each hold it under its own name, and
   :class:`~lightning_moe.parallel.engines.pipeline_runner.PipelineRunner` keeps the two copies equal.

``pp_stage_layers`` (``MoE5DStrategy(pp_stage_layers=[1, 3])``, Hydra ``parallel.pp_stage_layers``)
gives the number of blocks of each stage in stage order, as Megatron's uneven pipeline splits do; a
``pipeline_split`` hook receives it as ``stage_layers=`` (:func:`check_stage_layers` says what is refused).

Rank ``r`` of the pp group runs the stages ``r, r + pp, r + 2 pp, ...`` (``stages_per_rank`` of them,
"virtual" stages for the interleaved schedule); under the V schedules (:data:`lightning_moe.layout.V_SCHEDULES`) the two
stages ``r`` and ``2 pp - 1 - r``. :func:`split_module` removes from ``module``
everything no local stage uses, so the optimizer, FSDP and distributed checkpoints only see this
rank's parameters, under their names in the whole model (``layers.3.attention.wq.weight``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_moe._compat import module_child_table, require_v_schedule_internals, shallow_copy_module
from lightning_moe.layout import V_SCHEDULES, stage_layers_problem, stage_slices
from lightning_moe.parallel.plans.blocks import block_container, blocks_attr, remove_block, subset

PIPELINE_SCHEDULES: tuple[str, ...] = ("GPipe", "1F1B", "Interleaved1F1B", *V_SCHEDULES)
DEFAULT_FIRST_STAGE_MODULES: tuple[str, ...] = ("tok_embeddings",)
DEFAULT_LAST_STAGE_MODULES: tuple[str, ...] = ("norm", "output")
_STAGES_ATTR = "_lightning_moe_pipeline_stages"

__all__ = [
    "PIPELINE_SCHEDULES",
    "GroupedBatchLoader",
    "check_pipeline_config",
    "check_pipeline_split",
    "check_stage_layers",
    "concat_batches",
    "pipeline_batch",
    "pipeline_stage_modules",
    "split_module",
    "stage_ids",
    "stage_layer_keys",
    "stage_rank",
    "tied_end_modules",
    "unpack_target",
    "unpack_target_loss",
]


# -- configuration ---------------------------------------------------------------------------------
def check_pipeline_config(pp: int, schedule: str, microbatches: int, stages_per_rank: int) -> None:
    """Raise ``ValueError`` naming the numbers when a schedule cannot run this configuration."""
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"pp_schedule={schedule!r} must be one of {PIPELINE_SCHEDULES}")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"pp_microbatches={microbatches!r} must be an integer >= 1")
    if not isinstance(stages_per_rank, int) or stages_per_rank < 1:
        raise ValueError(f"pp_stages_per_rank={stages_per_rank!r} must be an integer >= 1")
    if pp == 1:
        return
    if schedule in V_SCHEDULES:
        require_v_schedule_internals(schedule)
        if stages_per_rank != 2:
            raise ValueError(
                f"pp_schedule={schedule} runs two stages per rank (placed in a V), got pp_stages_per_rank={stages_per_rank}:"
                " set pp_stages_per_rank=2"
            )
        if microbatches < 2 * pp:
            raise ValueError(
                f"pp_schedule={schedule} needs pp_microbatches >= the number of stages 2*pp = {2 * pp}, got"
                f" {microbatches}: raise pp_microbatches to at least {2 * pp}"
            )
        return
    if schedule == "Interleaved1F1B":
        if stages_per_rank < 2:
            raise ValueError(
                f"pp_schedule=Interleaved1F1B needs pp_stages_per_rank >= 2 (virtual stages), got {stages_per_rank}:"
                " set pp_stages_per_rank=2 or use 1F1B"
            )
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            raise ValueError(
                f"pp_schedule=Interleaved1F1B needs pp_microbatches ({microbatches}) to be a multiple of"
                f" max(1, pp_microbatches // pp) = {rounds} (pp={pp}): choose pp_microbatches as a multiple of pp={pp}"
            )
        return
    if stages_per_rank != 1:
        raise ValueError(
            f"pp_schedule={schedule} runs one stage per rank, got pp_stages_per_rank={stages_per_rank}:"
            " use pp_schedule=Interleaved1F1B for virtual stages"
        )
    if schedule == "1F1B" and microbatches < pp:
        raise ValueError(
            f"pp_schedule=1F1B needs pp_microbatches >= the number of stages: pp_microbatches={microbatches} < pp={pp};"
            f" raise pp_microbatches to at least {pp} or use GPipe"
        )


def check_stage_layers(stage_layers: Sequence[int] | None, num_stages: int, num_layers: int | None = None) -> None:
    """``ValueError`` with :func:`stage_layers_problem`'s message when there is one."""
    problem = stage_layers_problem(stage_layers, num_stages, num_layers)
    if problem:
        raise ValueError(problem)


def stage_ids(pp_rank: int, pp: int, stages_per_rank: int = 1, v_shape: bool = False) -> list[int]:
    """The stages rank ``pp_rank`` runs: ``pp_rank + k * pp`` (loop placement of virtual stages), or
    with ``v_shape`` (two stages per rank) ``pp_rank`` and ``2 * pp - 1 - pp_rank``."""
    if v_shape:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def stage_rank(stage: int, pp: int, v_shape: bool = False) -> int:
    """The pp rank that runs ``stage`` (the inverse of :func:`stage_ids`)."""
    return min(stage, 2 * pp - 1 - stage) if v_shape else stage % pp


# -- splitting -------------------------------------------------------------------------------------
def split_module(
    module: nn.Module,
    pp_rank: int,
    pp: int,
    stages_per_rank: int = 1,
    v_shape: bool = False,
    stage_layers: Sequence[int] | None = None,
) -> list[tuple[int, nn.Module]]:
    """Build this rank's stage modules and remove every part of ``module`` they do not use (in place).

    Returns ``[(stage_index, stage_module), ...]`` in increasing stage order; the stage modules share
    their parameters with ``module``. With one stage per rank and the default convention, the stage
    module is ``module`` itself. The result is also kept on the module (:func:`pipeline_stage_modules`).
    ``v_shape``: the V placement of two stages per rank (``lightning_moe.layout.V_SCHEDULES``).
    ``stage_layers``: blocks per stage in stage order (``pp_stage_layers``); None splits evenly.

    Example::

        stages = split_module(model, pp_rank=1, pp=2)   # model keeps layers 2, 3, norm and output
        stages = split_module(model, pp_rank=1, pp=2, stage_layers=[1, 3])   # layers 1, 2, 3, norm, output
    """
    num_stages = pp * stages_per_rank
    ids = stage_ids(pp_rank, pp, stages_per_rank, v_shape)
    hook = getattr(module, "pipeline_split", None)
    if callable(hook):
        check_pipeline_split(module, num_stages, stage_layers)  # the counts, and a hook that takes them
        extra = {} if stage_layers is None else {"stage_layers": list(stage_layers)}
        stages = [(i, hook(i, num_stages, **extra)) for i in ids]
    else:
        per_stage = _layer_keys_per_stage(module, num_stages, stage_layers)
        if len(ids) == 1:
            stages = [(ids[0], module)]
            _trim_in_place(module, ids[0], num_stages, per_stage[ids[0]])
        else:
            stages = [(i, _stage_copy(module, i, num_stages, per_stage[i])) for i in ids]
    used = {id(t) for _, stage in stages for t in _tensors(stage)}
    _remove_unused(module, used)
    object.__setattr__(module, _STAGES_ATTR, stages)
    return stages


def check_pipeline_split(module: nn.Module, num_stages: int, stage_layers: Sequence[int] | None = None) -> None:
    """Raise ``ValueError`` naming the fix if ``module`` cannot be split into ``num_stages`` stages (of
    ``stage_layers`` blocks each, when given): by the default convention, or by a ``pipeline_split``
    hook, which must then take ``stage_layers=``."""
    check_stage_layers(stage_layers, num_stages)
    hook = getattr(module, "pipeline_split", None)
    if callable(hook):
        if stage_layers is not None and "stage_layers" not in inspect.signature(hook).parameters:
            raise ValueError(
                f"pp_stage_layers={list(stage_layers)}: {type(module).__name__}.pipeline_split(stage_index, num_stages)"
                " takes no stage_layers: add a stage_layers=None keyword (blocks per stage, in stage order) or"
                " leave pp_stage_layers unset"
            )
        return
    _layer_keys_per_stage(module, num_stages, stage_layers)
    _end_modules(module)


def pipeline_stage_modules(module: nn.Module) -> list[tuple[int, nn.Module]] | None:
    """``[(stage_index, stage_module), ...]`` of this rank after :func:`split_module`, else None."""
    return getattr(module, _STAGES_ATTR, None)


def stage_layer_keys(module: nn.Module, num_stages: int, stage_layers: Sequence[int] | None = None) -> list[list[str]]:
    """The keys of the blocks each of ``num_stages`` stages runs under the default convention (an
    even split, ``stage_layers`` blocks per stage, or ``pipeline_stage_layers``); ``ValueError``
    naming the fix when there is none."""
    return _layer_keys_per_stage(module, num_stages, stage_layers)


def tied_end_modules(module: nn.Module) -> tuple[str, ...]:
    """The modules that both the first and the last stage hold (named in ``pipeline_first_stage_modules``
    and ``pipeline_last_stage_modules``), e.g. ``("tok_embeddings",)`` for ``MoEGPT`` with MTP."""
    if callable(getattr(module, "pipeline_split", None)):
        return ()
    first, last = _end_modules(module)
    return tuple(name for name in first if name in last)


def _layer_keys_per_stage(
    module: nn.Module, num_stages: int, stage_layers: Sequence[int] | None = None
) -> list[list[str]]:
    layers = block_container(module)
    if layers is None:
        name = blocks_attr(module)
        raise ValueError(
            f"pipeline parallelism needs {type(module).__name__}.{name} to be an nn.ModuleDict or nn.ModuleList of"
            " blocks (set pipeline_layers_attr to name another attribute), or a"
            f" pipeline_split(stage_index, num_stages) method; got {type(getattr(module, name, None)).__name__}"
        )
    keys = list(module_child_table(layers))
    explicit = getattr(module, "pipeline_stage_layers", None)
    if explicit is not None and stage_layers is not None:
        raise ValueError(
            f"pp_stage_layers={list(stage_layers)} and {type(module).__name__}.pipeline_stage_layers both split the"
            " pipeline: keep one of them"
        )
    if stage_layers is not None:
        check_stage_layers(stage_layers, num_stages, len(keys))
        return [keys[part] for part in stage_slices(stage_layers)]
    if explicit is not None:
        explicit = [list(stage) for stage in explicit]
        if len(explicit) != num_stages:
            raise ValueError(f"pipeline_stage_layers lists {len(explicit)} stages, the pipeline has {num_stages}")
        unknown = {k for stage in explicit for k in stage} - set(keys)
        if unknown:
            raise ValueError(f"pipeline_stage_layers names layers that do not exist: {sorted(unknown)}")
        return explicit
    if len(keys) % num_stages:
        raise ValueError(
            f"{len(keys)} layers cannot be split evenly into pp*pp_stages_per_rank = {num_stages} pipeline stages:"
            f" choose num_layers divisible by {num_stages}, change pp / pp_stages_per_rank, or give the layers of"
            " each stage with pp_stage_layers"
        )
    per = len(keys) // num_stages
    return [keys[s * per : (s + 1) * per] for s in range(num_stages)]


def _end_modules(module: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    first = tuple(getattr(module, "pipeline_first_stage_modules", DEFAULT_FIRST_STAGE_MODULES))
    last = tuple(getattr(module, "pipeline_last_stage_modules", DEFAULT_LAST_STAGE_MODULES))
    owned = set(first) | set(last) | {blocks_attr(module)}
    for name, child in module.named_children():
        if name not in owned and child is not None and any(True for _ in _tensors(child)):
            raise ValueError(
                f"{type(module).__name__}.{name} holds parameters but is neither in `{blocks_attr(module)}` nor in"
                f" pipeline_first_stage_modules {first} / pipeline_last_stage_modules {last}: list it in one of them"
                " or define pipeline_split(stage_index, num_stages)"
            )
    if any(True for _ in module.parameters(recurse=False)):
        raise ValueError(
            f"{type(module).__name__} has parameters of its own (not in a child module): pipeline stages cannot own them;"
            " move them into a submodule"
        )
    return first, last


def _parts_to_drop(module: nn.Module, stage: int, num_stages: int) -> list[str]:
    first, last = _end_modules(module)
    keep = set(first if stage == 0 else ()) | set(last if stage == num_stages - 1 else ())
    return [n for n in (*first, *last) if n not in keep and n in module_child_table(module)]


def _trim_in_place(module: nn.Module, stage: int, num_stages: int, keys: Sequence[str]) -> None:
    for name in _parts_to_drop(module, stage, num_stages):
        setattr(module, name, None)
    layers = block_container(module)
    for key in [k for k in module_child_table(layers) if k not in set(keys)]:
        remove_block(layers, key)


def _stage_copy(module: nn.Module, stage: int, num_stages: int, keys: Sequence[str]) -> nn.Module:
    """A shallow copy of ``module`` with its own child table: shares every submodule it keeps."""
    drop = _parts_to_drop(module, stage, num_stages)
    clone = shallow_copy_module(module)
    children = module_child_table(clone)
    for name in drop:
        children[name] = None
    children[blocks_attr(module)] = subset(block_container(module), list(keys))
    return clone


def _tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def _remove_unused(parent: nn.Module, used: set[int]) -> None:
    """Drop every child of ``parent`` (recursively) whose parameters and buffers no stage uses."""
    for name, child in list(parent.named_children()):
        tensors = list(_tensors(child))
        if not tensors or all(id(t) in used for t in tensors):
            continue
        if not any(id(t) in used for t in tensors):
            if isinstance(parent, (nn.ModuleDict, nn.ModuleList)):
                remove_block(parent, name)
            else:
                setattr(parent, name, None)
            continue
        _remove_unused(child, used)


# -- data ------------------------------------------------------------------------------------------
class GroupedBatchLoader:
    """Iterate ``loader`` ``group`` batches at a time, concatenated on dim 0 (one batch per pipeline step).

    Each loader batch becomes one pipeline micro-batch: the schedule splits the concatenation back
    into them. Incomplete groups at the end are dropped. Attributes (``sampler``, ``dataset``,
    ``state_dict``, ...) are those of ``loader`` (a :class:`lightning_moe.data.ResumableDataLoader`
    counts ``group`` loader batches per training batch itself).
    """

    def __init__(self, loader: Iterable, group: int) -> None:
        self.loader = loader
        self.group = group

    def __iter__(self) -> Iterator[Any]:
        pending: list[Any] = []
        for batch in self.loader:
            pending.append(batch)
            if len(pending) == self.group:
                yield concat_batches(pending)
                pending = []

    def __len__(self) -> int:
        return len(self.loader) // self.group  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        if name in ("loader", "group"):
            raise AttributeError(name)
        return getattr(self.loader, name)


def concat_batches(batches: Sequence[Any]) -> Any:
    """Concatenate same-structured batches on dim 0 (dicts, tuples and lists of tensors)."""
    first = batches[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(batches), dim=0)
    if isinstance(first, Mapping):
        return type(first)({k: concat_batches([b[k] for b in batches]) for k in first})  # type: ignore[call-arg]
    if isinstance(first, (tuple, list)):
        return type(first)(concat_batches(items) for items in zip(*batches))
    return first


def pipeline_batch(
    batch: Any,
    microbatches: int,
    *,
    with_positions: bool = True,
    with_sample_index: bool = False,
    cp_group: dist.ProcessGroup | None = None,
) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor], torch.Tensor]:
    """Schedule ``inputs`` (first stage), ``kwargs`` (every stage) and ``target`` (last stage) of a batch dict.

    ``position_ids`` go to every stage (later stages may receive sequence shards under sequence
    parallelism, from which no position can be derived); so does the batch's ``sample_index`` when
    ``with_sample_index`` (the stages' forward takes it: routing replay keys tokens by it), and its
    ``document_ids`` (each stage's pre-hook hands them to the attention mode, see
    :func:`lightning_moe.parallel.runtime.documents.take_document_ids`).
    Without ``loss_mask``, context parallelism and multi-token prediction the target is ``labels``;
    otherwise a float64 ``[B, S, F]`` packing of labels, each sample's loss tokens over the whole
    sequence (all ranks of ``cp_group``) and the mask, and the same three per MTP depth (the batch's
    ``mtp_labels``/``mtp_loss_mask``, from ``add_mtp_targets``), which :func:`unpack_target` turns into
    the loss entries of each micro-batch: the schedule splits it by sample like the inputs. With MTP
    the batch's ``mtp_input_ids`` go to every stage as a keyword (the last stage's MTP modules embed them).
    """
    if not isinstance(batch, Mapping) or "input_ids" not in batch or "labels" not in batch:
        raise TypeError("pipeline parallelism needs dict batches with 'input_ids' and 'labels' [batch, seq] entries")
    input_ids, labels = batch["input_ids"], batch["labels"]
    size, seq = input_ids.shape[0], input_ids.shape[1]
    if size % microbatches:
        raise ValueError(f"a batch of {size} samples cannot be split into pp_microbatches={microbatches}")
    kwargs: dict[str, torch.Tensor] = {}
    if with_positions:
        positions = batch.get("position_ids")
        if positions is None:
            positions = torch.arange(seq, device=input_ids.device).expand(size, seq)
        kwargs["position_ids"] = positions
    if with_sample_index and isinstance(batch.get("sample_index"), torch.Tensor):
        kwargs["sample_index"] = batch["sample_index"]
    if isinstance(batch.get("document_ids"), torch.Tensor):
        # Split per micro-batch with the inputs; each stage hands them to the attention mode.
        kwargs["document_ids"] = batch["document_ids"]
    mask = batch.get("loss_mask")
    mtp_labels = batch.get("mtp_labels")
    if mtp_labels is None and mask is None and cp_group is None:
        return (input_ids,), kwargs, labels
    if mask is None and mtp_labels is not None:  # the packing's layout: a mask field whenever MTP fields follow
        mask = torch.ones_like(labels, dtype=torch.float64)
    fields = [labels.to(torch.float64), _per_sample_count(mask, size, seq, cp_group, input_ids.device)]
    if mask is not None:
        fields.append(mask.to(torch.float64))
    if mtp_labels is not None:
        # The last stage's forward takes the tokens ahead; its loss the depths' labels and masks.
        kwargs["mtp_input_ids"] = batch["mtp_input_ids"]
        mtp_mask = batch["mtp_loss_mask"]
        for k in range(mtp_labels.shape[-1]):
            depth_mask = mtp_mask[..., k]
            count = _per_sample_count(depth_mask, size, seq, cp_group, input_ids.device)
            fields += [mtp_labels[..., k].to(torch.float64), count, depth_mask.to(torch.float64)]
    return (input_ids,), kwargs, torch.stack(fields, dim=-1)


def _per_sample_count(
    mask: torch.Tensor | None, size: int, seq: int, cp_group: dist.ProcessGroup | None, device: torch.device
) -> torch.Tensor:
    """Each sample's loss tokens over the whole sequence (all cp ranks), float64 ``[B, S]`` (repeated along S)."""
    if mask is not None:
        per_sample = mask.to(torch.float64).sum(1)
    else:
        per_sample = torch.full((size,), float(seq), dtype=torch.float64, device=device)
    if cp_group is not None:
        dist.all_reduce(per_sample, group=cp_group)
    return per_sample[:, None].expand(size, seq)


def unpack_target(target: torch.Tensor, cp: int = 1) -> dict[str, torch.Tensor]:
    """The loss entries of one micro-batch's :func:`pipeline_batch` target, named as in a batch dict:
    ``labels``, and when packed ``loss_mask``, ``loss_token_count`` (the micro-batch's loss tokens
    divided by ``cp``, as :func:`lightning_moe.parallel.plans.context_parallel.shard_batch_for_context_parallel`
    gives it) and with multi-token prediction ``mtp_labels``/``mtp_loss_mask`` ``[B, S, D]`` and
    ``mtp_loss_token_count [D]``.

    The packing: ``labels, count[, mask]``, then ``label, count, mask`` per MTP depth (a mask field
    is always present when MTP fields follow, so the field count decides the layout).
    """
    if target.dtype != torch.float64:  # plain labels
        return {"labels": target}
    fields = target.unbind(-1)

    def count(field: torch.Tensor) -> torch.Tensor:
        return field[:, 0].sum().to(torch.float32) / cp

    entries = {"labels": fields[0].long(), "loss_token_count": count(fields[1])}
    if len(fields) > 2:
        entries["loss_mask"] = fields[2]
    depths = [fields[i : i + 3] for i in range(3, len(fields), 3)]
    if depths:
        entries["mtp_labels"] = torch.stack([label.long() for label, _, _ in depths], dim=-1)
        entries["mtp_loss_token_count"] = torch.stack([count(c) for _, c, _ in depths])
        entries["mtp_loss_mask"] = torch.stack([mask for _, _, mask in depths], dim=-1)
    return entries


def unpack_target_loss(
    loss_from_logits: Callable[..., torch.Tensor], output: Any, target: torch.Tensor, cp: int = 1
) -> torch.Tensor:
    """``loss_from_logits(output, labels, loss_mask=..., loss_token_count=...)`` of a :func:`pipeline_batch`
    target (see :func:`unpack_target`)."""
    if target.dtype != torch.float64:  # plain labels
        return loss_from_logits(output, target)
    entries = unpack_target(target, cp)
    return loss_from_logits(
        output, entries["labels"], loss_mask=entries.get("loss_mask"), loss_token_count=entries["loss_token_count"]
    )

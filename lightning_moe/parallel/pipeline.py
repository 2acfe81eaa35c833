"""Pipeline parallelism: split a module into stages over ``pp`` and run a ``torch.distributed.pipelining`` schedule.

A module says how it splits in one of three ways (first match wins):

1. ``pipeline_split(stage_index, num_stages) -> nn.Module``: returns the stage's module, which must
   share its parameters with ``module`` (e.g. a shallow copy with parts removed);
2. ``pipeline_stage_layers``: a list with, per stage, the keys of the block container it runs;
3. the default convention: the block container — ``module.layers``, or the attribute named by
   ``pipeline_layers_attr`` (e.g. ``"blocks"``), an ``nn.ModuleDict`` or ``nn.ModuleList`` — is cut
   evenly in order; the first stage also keeps ``pipeline_first_stage_modules`` (default
   ``("tok_embeddings",)``), the last one ``pipeline_last_stage_modules`` (default
   ``("norm", "output")``); on other stages these attributes are None, so ``forward`` must accept a
   hidden state as input and return one (``MoEGPT`` does). Blocks keep their keys on every stage
   (a ``ModuleList`` stage iterates over its own blocks, named ``blocks.2``, ``blocks.3``, ...).

Rank ``r`` of the pp group runs the stages ``r, r + pp, r + 2 pp, ...`` (``stages_per_rank`` of them,
"virtual" stages for the interleaved schedule). :func:`split_module` removes from ``module``
everything no local stage uses, so the optimizer, FSDP and distributed checkpoints only see this
rank's parameters, under their names in the whole model (``layers.3.attention.wq.weight``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_moe._compat import require_pipeline_stage_internals, run_schedule_forward_only
from lightning_moe.parallel.blocks import block_container, blocks_attr, remove_block, subset

PIPELINE_SCHEDULES: tuple[str, ...] = ("GPipe", "1F1B", "Interleaved1F1B")
DEFAULT_FIRST_STAGE_MODULES: tuple[str, ...] = ("tok_embeddings",)
DEFAULT_LAST_STAGE_MODULES: tuple[str, ...] = ("norm", "output")
_STAGES_ATTR = "_lightning_moe_pipeline_stages"

__all__ = [
    "PIPELINE_SCHEDULES",
    "GroupedBatchLoader",
    "PipelineRunner",
    "check_pipeline_config",
    "check_pipeline_split",
    "concat_batches",
    "is_inferring_shapes",
    "pipeline_batch",
    "pipeline_stage_modules",
    "scale_gradient",
    "split_module",
    "stage_ids",
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


def stage_ids(pp_rank: int, pp: int, stages_per_rank: int = 1) -> list[int]:
    """The stages rank ``pp_rank`` runs: ``pp_rank + k * pp`` (loop placement of virtual stages)."""
    return [pp_rank + k * pp for k in range(stages_per_rank)]


# -- splitting -------------------------------------------------------------------------------------
def split_module(module: nn.Module, pp_rank: int, pp: int, stages_per_rank: int = 1) -> list[tuple[int, nn.Module]]:
    """Build this rank's stage modules and remove every part of ``module`` they do not use (in place).

    Returns ``[(stage_index, stage_module), ...]`` in increasing stage order; the stage modules share
    their parameters with ``module``. With one stage per rank and the default convention, the stage
    module is ``module`` itself. The result is also kept on the module (:func:`pipeline_stage_modules`).

    Example::

        stages = split_module(model, pp_rank=1, pp=2)   # model keeps layers 2, 3, norm and output
    """
    num_stages = pp * stages_per_rank
    ids = stage_ids(pp_rank, pp, stages_per_rank)
    hook = getattr(module, "pipeline_split", None)
    if callable(hook):
        stages = [(i, hook(i, num_stages)) for i in ids]
    else:
        per_stage = _layer_keys_per_stage(module, num_stages)
        if len(ids) == 1:
            stages = [(ids[0], module)]
            _trim_in_place(module, ids[0], num_stages, per_stage[ids[0]])
        else:
            stages = [(i, _stage_copy(module, i, num_stages, per_stage[i])) for i in ids]
    used = {id(t) for _, stage in stages for t in _tensors(stage)}
    _remove_unused(module, used)
    object.__setattr__(module, _STAGES_ATTR, stages)
    return stages


def check_pipeline_split(module: nn.Module, num_stages: int) -> None:
    """Raise ``ValueError`` naming the fix if the default convention cannot split ``module`` into ``num_stages``."""
    if callable(getattr(module, "pipeline_split", None)):
        return
    _layer_keys_per_stage(module, num_stages)
    _end_modules(module)


def pipeline_stage_modules(module: nn.Module) -> list[tuple[int, nn.Module]] | None:
    """``[(stage_index, stage_module), ...]`` of this rank after :func:`split_module`, else None."""
    return getattr(module, _STAGES_ATTR, None)


def _layer_keys_per_stage(module: nn.Module, num_stages: int) -> list[list[str]]:
    layers = block_container(module)
    if layers is None:
        name = blocks_attr(module)
        raise ValueError(
            f"pipeline parallelism needs {type(module).__name__}.{name} to be an nn.ModuleDict or nn.ModuleList of"
            " blocks (set pipeline_layers_attr to name another attribute), or a"
            f" pipeline_split(stage_index, num_stages) method; got {type(getattr(module, name, None)).__name__}"
        )
    keys = list(layers._modules)
    explicit = getattr(module, "pipeline_stage_layers", None)
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
            f" choose num_layers divisible by {num_stages} (or change pp / pp_stages_per_rank)"
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
    return [n for n in (*first, *last) if n not in keep and n in module._modules]


def _trim_in_place(module: nn.Module, stage: int, num_stages: int, keys: Sequence[str]) -> None:
    for name in _parts_to_drop(module, stage, num_stages):
        setattr(module, name, None)
    layers = block_container(module)
    for key in [k for k in layers._modules if k not in set(keys)]:
        remove_block(layers, key)


def _stage_copy(module: nn.Module, stage: int, num_stages: int, keys: Sequence[str]) -> nn.Module:
    """A shallow copy of ``module`` with its own child table: shares every submodule it keeps."""
    drop = _parts_to_drop(module, stage, num_stages)
    # Not copy.copy: a LightningModule's __getstate__ drops its trainer.
    clone = object.__new__(type(module))
    clone.__dict__.update(module.__dict__)
    clone._modules = dict(module._modules)
    for name in drop:
        clone._modules[name] = None
    clone._modules[blocks_attr(module)] = subset(block_container(module), list(keys))
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
    batch: Any, microbatches: int, *, with_positions: bool = True, cp_group: dist.ProcessGroup | None = None
) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor], torch.Tensor]:
    """Schedule ``inputs`` (first stage), ``kwargs`` (every stage) and ``target`` (last stage) of a batch dict.

    ``position_ids`` go to every stage (later stages may receive sequence shards under sequence
    parallelism, from which no position can be derived). Without ``loss_mask`` and context
    parallelism the target is ``labels``; otherwise a float64 ``[B, S, 2 or 3]`` packing of labels,
    each sample's loss tokens over the whole sequence (all ranks of ``cp_group``) and the mask,
    which :func:`unpack_target_loss` turns into ``loss_token_count`` per micro-batch: the schedule
    splits it by sample like the inputs.
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
    mask = batch.get("loss_mask")
    if mask is None and cp_group is None:
        return (input_ids,), kwargs, labels
    if mask is not None:
        per_sample = mask.to(torch.float64).sum(1)
    else:
        per_sample = torch.full((size,), float(seq), dtype=torch.float64, device=input_ids.device)
    if cp_group is not None:
        dist.all_reduce(per_sample, group=cp_group)
    fields = [labels.to(torch.float64), per_sample[:, None].expand(size, seq)]
    if mask is not None:
        fields.append(mask.to(torch.float64))
    return (input_ids,), kwargs, torch.stack(fields, dim=-1)


def unpack_target_loss(
    loss_from_logits: Callable[..., torch.Tensor], output: Any, target: torch.Tensor, cp: int = 1
) -> torch.Tensor:
    """``loss_from_logits(output, labels, loss_mask=..., loss_token_count=...)`` of a :func:`pipeline_batch` target.

    ``loss_token_count`` is the micro-batch's loss tokens divided by ``cp``, as
    :func:`lightning_moe.parallel.context_parallel.shard_batch_for_context_parallel` gives it.
    """
    if target.dtype != torch.float64:  # plain labels
        return loss_from_logits(output, target)
    labels, per_sample, *mask = target.unbind(-1)
    count = per_sample[:, 0].sum().to(torch.float32) / cp
    return loss_from_logits(output, labels.long(), loss_mask=mask[0] if mask else None, loss_token_count=count)


# -- running ---------------------------------------------------------------------------------------
class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def scale_gradient(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` unchanged in forward; its gradient multiplied by ``scale`` in backward."""
    return _ScaleGradient.apply(x, scale) if scale != 1.0 else x


_INFERRING = False


def is_inferring_shapes() -> bool:
    """True while a pipeline stage runs its shape-inference forward (not a real micro-batch).

    Hooks that record or count forwards (verify, metrics) skip that pass.
    """
    return _INFERRING


@functools.cache
def _make_stage_class() -> type:
    require_pipeline_stage_internals()  # the overrides below are torch 2.13's private methods
    from torch.distributed.pipelining import PipelineStage

    class _Stage(PipelineStage):
        """``PipelineStage`` whose metadata inference leaves no trace.

        torch infers the activation shapes by running the stage once on the first micro-batch (later
        stages on uninitialised tensors). Here the received inputs are zeros, the module's buffers
        (e.g. expert-load accumulators) and the communication counters are restored afterwards, MoE
        statistics of that forward are ignored, and gradients accumulated by earlier steps survive
        (torch would set them to None). FSDP/replicate units reduce their gradients once per step,
        in the backward of the stage's last micro-batch.
        """

        _saved_grads: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None

        def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
            self._save_grads()
            return super()._prepare_forward_infra(*args, **kwargs)

        def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> Any:
            self._save_grads()
            with _inference_guard(self.submod):
                return super()._prepare_backward_infra(*args, **kwargs)

        def _compute_outputs(self, *args: torch.Tensor, module: nn.Module, **kwargs: Any) -> Any:
            if not self.is_first:
                with torch.no_grad():
                    for arg in args:
                        if isinstance(arg, torch.Tensor) and arg.is_floating_point():
                            arg.zero_()
            with _inference_guard(module):
                return super()._compute_outputs(*args, module=module, **kwargs)

        def _post_metadata_inference_cleanup(self) -> None:
            super()._post_metadata_inference_cleanup()
            for param, grad in self._saved_grads or ():
                param.grad = grad
            self._saved_grads = None

        def _save_grads(self) -> None:
            if self._saved_grads is None:
                self._saved_grads = [(p, p.grad) for p in self.submod.parameters()]

        def backward_maybe_with_nosync(self, backward_type: Any, bwd_kwargs: dict, last_backward: bool = False) -> Any:
            # Reduce gradients once per step, in the last micro-batch's backward: torch does this
            # only when the stage module itself is the FSDP root, and ours wraps its children.
            from torch.distributed.fsdp import FSDPModule

            for unit in self.submod.modules():
                if isinstance(unit, FSDPModule):
                    unit.set_requires_gradient_sync(last_backward, recurse=False)
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    return _Stage


@contextlib.contextmanager
def _inference_guard(module: nn.Module) -> Iterator[None]:
    global _INFERRING
    from lightning_moe import comm

    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    counters = copy.deepcopy(comm.COUNTERS)
    previous, _INFERRING = _INFERRING, True
    try:
        yield
    finally:
        _INFERRING = previous
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        comm.COUNTERS.clear()
        comm.COUNTERS.update(counters)


class _MoEStatsAccumulator:
    """Combine ``MoELayer.stats`` over the pipeline micro-batches of one step.

    Each forward overwrites a layer's stats; callbacks read them once per Lightning batch. After a
    pipeline step the layer holds the statistics of all its micro-batches: token counts summed,
    scalars averaged (the mean over the data module's micro-batches, as without pipelining).
    """

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        from lightning_moe.moe import MoELayer

        seen: dict[int, nn.Module] = {}
        for module in modules:
            for layer in module.modules():
                if isinstance(layer, MoELayer):
                    seen[id(layer)] = layer
        self.layers = list(seen.values())
        self._records: dict[int, list[dict[str, torch.Tensor]]] = {}

    @contextlib.contextmanager
    def collect(self) -> Iterator[None]:
        self._records = {id(layer): [] for layer in self.layers}
        handles = [layer.register_forward_hook(self._hook) for layer in self.layers]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
        for layer in self.layers:
            records = self._records[id(layer)]
            if records:
                layer.stats = _combine_stats(records)
        self._records = {}

    def _hook(self, layer: nn.Module, args: Any, output: Any) -> None:
        if not _INFERRING:
            self._records[id(layer)].append(dict(layer.stats))


def _combine_stats(records: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    combined: dict[str, torch.Tensor] = {}
    for key in records[0]:
        values = torch.stack([r[key].detach() for r in records])
        combined[key] = values.sum(0) if key == "tokens_per_expert" else values.mean(0)
    return combined


class PipelineRunner:
    """This rank's pipeline stages and schedules (one for training, one forward-only for evaluation).

    Args:
        stages: ``[(stage_index, module), ...]`` of this rank (:func:`split_module`).
        num_stages: stages of the whole pipeline (``pp * stages_per_rank``).
        group: the pp process group; device: where the stages run.
        schedule: ``"GPipe"``, ``"1F1B"`` or ``"Interleaved1F1B"``; microbatches: per step.
        loss_fn: ``loss_fn(output, target) -> scalar`` of one micro-batch on the last stage.

    :meth:`step` runs forward and backward of ``microbatches`` micro-batches; the gradient of each
    micro-batch loss is multiplied by ``grad_scale`` (torch's own 1/n scaling is off: it would also
    divide gradients accumulated by earlier steps). It returns the micro-batch losses on the rank
    that holds the last stage and None elsewhere.
    """

    def __init__(
        self,
        stages: Sequence[tuple[int, nn.Module]],
        num_stages: int,
        group: dist.ProcessGroup,
        device: torch.device,
        schedule: str,
        microbatches: int,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    ) -> None:
        self.modules = [module for _, module in stages]
        self.stage_indices = [index for index, _ in stages]
        self.num_stages = num_stages
        self.group = group
        self.device = device
        self.schedule_name = schedule
        self.microbatches = microbatches
        self.loss_fn = loss_fn
        self.grad_scale = 1.0
        self.holds_last_stage = num_stages - 1 in self.stage_indices
        self.last_stage_group_rank = (num_stages - 1) % dist.get_world_size(group)
        self.forward_kwargs = _forward_parameters(self.modules[0])
        self.stats = _MoEStatsAccumulator(self.modules)
        self._train: Any = None
        self._eval: Any = None

    def _loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        return scale_gradient(self.loss_fn(output, target), self.grad_scale)

    def _build(self, train: bool) -> Any:
        from torch.distributed.pipelining import ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B

        stage_cls = _make_stage_class()
        stages = [
            stage_cls(module, index, self.num_stages, self.device, group=self.group)
            for index, module in zip(self.stage_indices, self.modules)
        ]
        kwargs = dict(n_microbatches=self.microbatches, loss_fn=self._loss, scale_grads=False)
        if self.schedule_name == "Interleaved1F1B":
            return ScheduleInterleaved1F1B(stages, **kwargs)
        if not train:
            # Any single-stage schedule runs forward-only the same way.
            return ScheduleGPipe(stages[0], **kwargs)
        cls = ScheduleGPipe if self.schedule_name == "GPipe" else Schedule1F1B
        return cls(stages[0], **kwargs)

    def _sync_mode(self, training: bool) -> None:
        for module in self.modules:
            if module.training != training:
                module.train(training)

    def step(
        self,
        inputs: tuple[Any, ...],
        kwargs: dict[str, Any],
        target: torch.Tensor | None,
        *,
        train: bool = True,
        grad_scale: float = 1.0,
    ) -> list[torch.Tensor] | None:
        """Run one schedule step; ``inputs`` are used by the first stage, ``target`` by the last."""
        if train and self._train is None:
            self._train = self._build(train=True)
        if not train and self._eval is None:
            self._eval = self._build(train=False)
        schedule = self._train if train else self._eval
        self._sync_mode(train)
        self.grad_scale = grad_scale
        losses: list[torch.Tensor] | None = [] if self.holds_last_stage else None
        args = inputs if 0 in self.stage_indices else ()
        tgt = target if self.holds_last_stage else None
        if train:
            with self.stats.collect():
                schedule.step(*args, target=tgt, losses=losses, return_outputs=False, **kwargs)
        else:
            # Plain no_grad, not inference mode (Lightning's evaluation context on some backends):
            # FSDP's unshard and the stages' receive buffers cannot be inference tensors.
            with torch.inference_mode(False), torch.no_grad():
                args, kwargs, tgt = _outside_inference((args, kwargs, tgt))
                run_schedule_forward_only(schedule, *args, target=tgt, losses=losses, **kwargs)
            # Without a backward FSDP units that are roots stay unsharded after forward: reshard,
            # so that training finds the sharded parameters (those the optimizer updates) in place.
            self._reshard()
        return [loss.detach() for loss in losses] if losses is not None else None

    def _reshard(self) -> None:
        from torch.distributed.fsdp import FSDPModule

        for module in self.modules:
            for sub in module.modules():
                if isinstance(sub, FSDPModule):
                    sub.reshard()

    def broadcast_mean(self, losses: list[torch.Tensor] | None) -> torch.Tensor:
        """Mean of the micro-batch losses, sent from the last stage to every rank of the pp group."""
        if losses is not None:
            value = torch.stack([loss.float() for loss in losses]).mean()
        else:
            value = torch.zeros((), dtype=torch.float32, device=self.device)
        dist.broadcast(value, group=self.group, group_src=self.last_stage_group_rank)
        return value


def _outside_inference(value: Any) -> Any:
    """A copy of every inference tensor in ``value`` (nested tuples and dicts) usable outside inference mode."""
    if isinstance(value, torch.Tensor):
        return value.clone() if value.is_inference() else value
    if isinstance(value, dict):
        return {k: _outside_inference(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_outside_inference(v) for v in value)
    return value


def _forward_parameters(module: nn.Module) -> set[str]:
    try:
        return set(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return set()

"""``PipelineRunner``: this rank's pipeline stages under a ``torch.distributed.pipelining`` schedule.

:meth:`PipelineRunner.step` runs forward and backward (or forward only, with losses) of one step's
micro-batches; :meth:`PipelineRunner.forward_only` runs the whole model's forward for evaluation and
prediction and returns the last stage's output on every rank of the pp group. The stages are
:func:`lightning_moe._compat.pipeline_stage_class` instances, whose shape-inference forward leaves no
trace (:func:`is_inferring_shapes` tells hooks that it is running).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_moe._compat import (
    interleave_overlapped_forward_backward,
    pipeline_stage_class,
    reduce_fsdp_gradients,
    run_schedule_forward_only,
    skip_backward_actions,
)
from lightning_moe.comm.interleave import run_interleaved
from lightning_moe.cp.documents import current_document_ids
from lightning_moe.layout import V_SCHEDULES
from lightning_moe.parallel.plans.pipeline import stage_rank, tied_end_modules
from lightning_moe.parallel.runtime.documents import take_document_ids
from lightning_moe.parallel.runtime.grad_norm import count_norm_elsewhere

__all__ = ["PipelineRunner", "is_inferring_shapes", "scale_gradient"]


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        # A copy, not a view: the split backward of the zero-bubble schedules detaches the loss in place.
        return x.clone()

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
    """This rank's pipeline stages and their schedules: training, evaluation with losses, forward only.

    Args:
        stages: ``[(stage_index, module), ...]`` of this rank
            (:func:`lightning_moe.parallel.plans.pipeline.split_module`).
        num_stages: stages of the whole pipeline (``pp * stages_per_rank``).
        group: the pp process group; device: where the stages run.
        schedule: one of :data:`~lightning_moe.parallel.plans.pipeline.PIPELINE_SCHEDULES`; microbatches: per step.
        loss_fn: ``loss_fn(output, target) -> scalar`` of one micro-batch on the last stage.
        overlap_ep_comm: DualPipeV runs each of its overlapped forward/backward pairs interleaved at the
            expert all-to-alls (:mod:`lightning_moe.comm.interleave`), not one after the other.
        gather_once_per_step: every FSDP2 unit stays gathered, and its gradients accumulate unsharded,
            from the first forward of an optimizer step to the end of its last pipeline step, which
            reduce-scatters them once (:meth:`step`'s ``steps_optimizer``).

    :meth:`step` runs forward and backward of ``microbatches`` micro-batches; the gradient of each
    micro-batch loss is multiplied by ``grad_scale`` (torch's own 1/n scaling is off: it would also
    divide gradients accumulated by earlier steps). FSDP2 gathers: under 1F1B, GPipe and
    Interleaved1F1B each unit once per micro-batch in forward (a nested unit, e.g. experts, again in
    backward) and reduces its gradients once per pipeline step; under the V schedules, whose weight
    gradients come apart from autograd's backward, once per pipeline step; with
    ``gather_once_per_step``, once per optimizer step, whatever the schedule. It returns the
    micro-batch losses on the rank that holds the last stage and None elsewhere. :meth:`forward_only` is the whole model's forward.

    Tied end modules (:func:`~lightning_moe.parallel.plans.pipeline.tied_end_modules`, e.g. the token
    embedding that multi-token prediction uses on the last stage): when the first and the last stage
    run on different ranks, each holds a copy, equal at the start (same initialisation or
    checkpoint); after each training step the gradients of the two copies are summed over those two
    ranks (:attr:`tied_group`, sharded gradients shard by shard), so that any optimizer keeps them
    equal, and gradient-norm clipping counts the last stage's copy once (on the first stage). When one
    rank holds both stages (the V schedules) one tensor serves both and nothing is reduced.

    Example::

        runner = PipelineRunner(pipeline_stage_modules(model), num_stages=2, group=dims.pp_group,
                                device=torch.device("cpu"), schedule="1F1B", microbatches=2, loss_fn=loss)
        losses = runner.step((input_ids,), {}, labels)          # forward and backward
        logits = runner.forward_only(input_ids)                 # on every pp rank
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
        overlap_ep_comm: bool = False,
        gather_once_per_step: bool = False,
    ) -> None:
        self.modules = [module for _, module in stages]
        self.stage_indices = [index for index, _ in stages]
        self.num_stages = num_stages
        self.group = group
        self.device = device
        self.schedule_name = schedule
        self.microbatches = microbatches
        self.loss_fn = loss_fn
        self.overlap_ep_comm = overlap_ep_comm
        self.gather_once_per_step = gather_once_per_step
        self.grad_scale = 1.0
        self.holds_first_stage = 0 in self.stage_indices
        self.holds_last_stage = num_stages - 1 in self.stage_indices
        self.v_shape = schedule in V_SCHEDULES
        # Units kept gathered through a pipeline step (or an optimizer step), reduced by reduce_fsdp_gradients.
        self.holds_gathered = self.v_shape or gather_once_per_step
        self._gradients_pending = False  # gather_once_per_step: unreduced gradients until the optimizer step
        self.last_stage_group_rank = stage_rank(num_stages - 1, dist.get_world_size(group), self.v_shape)
        self.forward_kwargs = _forward_parameters(self.modules[0])
        for module in self.modules:  # packed documents' ids reach the attention mode, not the stage
            module.register_forward_pre_hook(take_document_ids, with_kwargs=True)
        self.stats = _MoEStatsAccumulator(self.modules)
        self._schedules: dict[str, Any] = {}
        self.tied_parameters, self.tied_group = self._tie_end_stages()

    def _tie_end_stages(self) -> tuple[list[nn.Parameter], dist.ProcessGroup | None]:
        """This rank's copy of the tied end modules' parameters and the group {first-stage rank,
        last-stage rank} of its pipeline; nothing when it holds both end stages or neither."""
        if self.holds_first_stage == self.holds_last_stage:
            return [], None
        end = self.stage_indices.index(0 if self.holds_first_stage else self.num_stages - 1)
        module = self.modules[end]
        params = [p for name in tied_end_modules(module) for p in getattr(module, name).parameters()]
        if not params:
            return [], None
        if self.holds_last_stage:
            for param in params:
                count_norm_elsewhere(param)
        ranks = dist.get_process_group_ranks(self.group)
        if len(ranks) == 2:
            return params, self.group
        # Only the two end ranks of this pipeline create (and ever use) their group.
        pair = [ranks[0], ranks[self.last_stage_group_rank]]
        return params, dist.new_group(pair, use_local_synchronization=True)

    @torch.no_grad()
    def _sum_tied_gradients(self) -> None:
        from torch.distributed.tensor import DTensor

        for param in self.tied_parameters:
            if param.grad is None:  # a copy the step did not use still joins the sum
                param.grad = torch.zeros_like(param)
            grad = param.grad
            dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=self.tied_group)

    def _loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        return scale_gradient(self.loss_fn(output, target), self.grad_scale)

    def _schedule(self, kind: str) -> Any:
        """The ``"train"``, ``"eval"`` (forward with losses) or ``"forward"`` (no loss) schedule, built once."""
        if kind not in self._schedules:
            from torch.distributed.pipelining import (
                Schedule1F1B,
                ScheduleDualPipeV,
                ScheduleGPipe,
                ScheduleInterleaved1F1B,
                ScheduleZBVZeroBubble,
            )

            stage_cls = pipeline_stage_class(_inference_guard)
            stages = [
                stage_cls(module, index, self.num_stages, self.device, group=self.group)
                for index, module in zip(self.stage_indices, self.modules)
            ]
            for stage in stages:
                stage.reduce_after_step = self.holds_gathered
            kwargs = dict(
                n_microbatches=self.microbatches, loss_fn=None if kind == "forward" else self._loss, scale_grads=False
            )
            if self.v_shape and kind == "train":
                v_schedule = ScheduleDualPipeV if self.schedule_name == "DualPipeV" else ScheduleZBVZeroBubble
                schedule = v_schedule(stages, **kwargs)
                if self.overlap_ep_comm:
                    interleave_overlapped_forward_backward(schedule, run_interleaved)
            elif self.v_shape:  # forward only: ZB-V's order (no paired actions), its backwards skipped
                schedule = ScheduleZBVZeroBubble(stages, **kwargs)
                skip_backward_actions(schedule)
            elif len(stages) > 1:
                schedule = ScheduleInterleaved1F1B(stages, **kwargs)
            elif kind == "train" and self.schedule_name == "1F1B":
                schedule = Schedule1F1B(stages[0], **kwargs)
            else:  # any single-stage schedule runs forward-only the same way
                schedule = ScheduleGPipe(stages[0], **kwargs)
            self._schedules[kind] = schedule
        return self._schedules[kind]

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
        steps_optimizer: bool = True,
    ) -> list[torch.Tensor] | None:
        """Run one schedule step; ``inputs`` are used by the first stage, ``target`` by the last.
        ``steps_optimizer``: the optimizer steps after this pipeline step (with ``gather_once_per_step``
        only then are the gradients reduced; until then they accumulate unsharded)."""
        self._sync_mode(train)
        self.grad_scale = grad_scale
        losses: list[torch.Tensor] | None = [] if self.holds_last_stage else None
        args = inputs if self.holds_first_stage else ()
        tgt = target if self.holds_last_stage else None
        if train:
            units = self._fsdp_units() if self.holds_gathered else []
            for unit in units:  # gathered and unreduced until the step's last weight gradient
                unit.set_is_last_backward(False)
                unit.set_reshard_after_forward(False, recurse=False)
                unit.set_reshard_after_backward(False, recurse=False)
            with self.stats.collect():
                self._schedule("train").step(*args, target=tgt, losses=losses, return_outputs=False, **kwargs)
            self._gradients_pending = not steps_optimizer and self.gather_once_per_step
            if not self._gradients_pending:
                reduce_fsdp_gradients(units)
                self._sum_tied_gradients()
        else:
            self._run_forward_only("eval", args, dict(kwargs, target=tgt, losses=losses))
        return [loss.detach() for loss in losses] if losses is not None else None

    def forward_only(self, first_input: torch.Tensor, **kwargs: Any) -> Any:
        """The whole model's forward of a batch, split into ``microbatches``: the last stage's output
        (tensors in tuples/lists/dicts) on every rank of the pp group.

        ``first_input`` goes to the first stage, ``kwargs`` (e.g. ``position_ids``) to every stage;
        ``position_ids`` are derived from the sequence when the stages take them and none is given.
        """
        size = first_input.shape[0]
        if size % self.microbatches:
            raise ValueError(
                f"a batch of {size} samples cannot be split into pp_microbatches={self.microbatches}: under pp > 1"
                " every evaluation/predict batch runs through the pipeline in that many micro-batches; use a batch"
                " size (or dataset size) divisible by it"
            )
        if "position_ids" in self.forward_kwargs and kwargs.get("position_ids") is None and first_input.dim() >= 2:
            seq = first_input.shape[1]
            kwargs["position_ids"] = torch.arange(seq, device=first_input.device).expand(size, seq)
        documents = current_document_ids()
        if documents is not None and documents.shape[0] == size:  # a packed batch: ids per micro-batch
            kwargs["document_ids"] = documents
        self._sync_mode(False)
        args = (first_input,) if self.holds_first_stage else ()
        output = self._run_forward_only("forward", args, kwargs)
        return broadcast_from_last_stage(output if self.holds_last_stage else None, self)

    def _run_forward_only(self, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._gradients_pending:
            raise MisconfigurationException(
                "gather_once_per_step=True under pp > 1: an evaluation forward ran in the middle of an optimizer step,"
                " while the stages hold the step's unreduced gradients, which it would discard; evaluate between"
                " optimizer steps (val_check_interval a multiple of the accumulation) or set gather_once_per_step=False"
            )
        # Plain no_grad, not inference mode (Lightning's evaluation context on some backends):
        # FSDP's unshard and the stages' receive buffers cannot be inference tensors.
        with torch.inference_mode(False), torch.no_grad():
            args, kwargs = _outside_inference((args, kwargs))
            output = run_schedule_forward_only(self._schedule(kind), *args, **kwargs)
        # Without a backward FSDP units that are roots stay unsharded after forward: reshard, so
        # that training finds the sharded parameters (those the optimizer updates) in place.
        self.reshard()
        return output

    def reshard(self) -> None:
        """Free every FSDP unit's gathered parameters (after a forward without backward)."""
        for unit in self._fsdp_units():
            unit.reshard()

    def _fsdp_units(self) -> list[nn.Module]:
        from torch.distributed.fsdp import FSDPModule

        units = {id(sub): sub for module in self.modules for sub in module.modules() if isinstance(sub, FSDPModule)}
        return list(units.values())

    def broadcast_mean(self, losses: list[torch.Tensor] | None, shape: tuple[int, ...] = ()) -> torch.Tensor:
        """Mean of the micro-batch losses (scalars, or tensors of ``shape``, e.g. one entry per loss
        term), sent from the last stage to every rank of the pp group."""
        if losses is not None:
            value = torch.stack([loss.float() for loss in losses]).mean(0)
        else:
            value = torch.zeros(shape, dtype=torch.float32, device=self.device)
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


def broadcast_from_last_stage(output: Any, runner: PipelineRunner) -> Any:
    """Send the last stage's ``output`` (tensors in tuples/lists/dicts) to every rank of the pp group."""
    src = runner.last_stage_group_rank
    holder: list[Any] = [None]
    if runner.holds_last_stage:
        holder[0] = _structure(output)
    dist.broadcast_object_list(holder, group=runner.group, group_src=src)
    tensors = (
        _leaves(output)
        if runner.holds_last_stage
        else [torch.empty(shape, dtype=dtype, device=runner.device) for shape, dtype in _leaf_meta(holder[0])]
    )
    for tensor in tensors:
        dist.broadcast(tensor, group=runner.group, group_src=src)
    return _rebuild(holder[0], iter(tensors))


def _structure(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, dict):
        return ("dict", [(k, _structure(v)) for k, v in value.items()])
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, [_structure(v) for v in value])
    raise TypeError(f"a pipelined forward must return tensors (in tuples, lists or dicts), got {type(value).__name__}")


def _leaves(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value.contiguous()]
    items = value.values() if isinstance(value, dict) else value
    return [leaf for item in items for leaf in _leaves(item)]


def _leaf_meta(structure: Any) -> list[tuple[tuple[int, ...], torch.dtype]]:
    kind = structure[0]
    if kind == "tensor":
        return [(structure[1], structure[2])]
    children = [child for _, child in structure[1]] if kind == "dict" else structure[1]
    return [meta for child in children for meta in _leaf_meta(child)]


def _rebuild(structure: Any, tensors: Iterator[torch.Tensor]) -> Any:
    kind = structure[0]
    if kind == "tensor":
        return next(tensors)
    if kind == "dict":
        return {k: _rebuild(child, tensors) for k, child in structure[1]}
    items = [_rebuild(child, tensors) for child in structure[1]]
    return tuple(items) if kind == "tuple" else items

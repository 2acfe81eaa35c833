"""The whole model's forward under pipeline parallelism, for validation, test and predict steps.

Under ``pp > 1`` each rank holds only its stages, so a LightningModule's own ``validation_step``,
``test_step`` or ``predict_step`` cannot call ``self(...)``. :func:`pipelined_forward` stands in for
that call: it runs the stages forward-only (a schedule without loss) over the pipeline's
micro-batches and returns the last stage's output on *every* rank of the pp group, so the step
computes and logs the same values on all ranks. The strategy installs it as the module's
``forward`` for the duration of those steps (:func:`forward_through_pipeline`).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_moe._compat import run_schedule_forward_only
from lightning_moe.parallel.pipeline import PipelineRunner, _make_stage_class, _outside_inference

_SCHEDULE_ATTR = "_lightning_moe_inference_schedule"


def _inference_schedule(runner: PipelineRunner) -> Any:
    """A forward-only schedule over ``runner``'s stages (no loss function), built once per runner."""
    schedule = getattr(runner, _SCHEDULE_ATTR, None)
    if schedule is None:
        from torch.distributed.pipelining import ScheduleGPipe, ScheduleInterleaved1F1B

        stage_cls = _make_stage_class()
        stages = [
            stage_cls(module, index, runner.num_stages, runner.device, group=runner.group)
            for index, module in zip(runner.stage_indices, runner.modules)
        ]
        kwargs = dict(n_microbatches=runner.microbatches, loss_fn=None, scale_grads=False)
        schedule = ScheduleInterleaved1F1B(stages, **kwargs) if len(stages) > 1 else ScheduleGPipe(stages[0], **kwargs)
        setattr(runner, _SCHEDULE_ATTR, schedule)
    return schedule


def pipelined_forward(runner: PipelineRunner, forward_signature: inspect.Signature, *args: Any, **kwargs: Any) -> Any:
    """``module(*args, **kwargs)`` of the whole (unsplit) model, run through the pipeline stages.

    The first forward argument goes to the first stage; the others (e.g. ``position_ids``, derived
    from the sequence when the forward takes them and none is given) go to every stage. The batch
    is split into the pipeline's ``pp_microbatches``. Returns the last stage's output (a tensor, or
    a tuple/list/dict of tensors) on every rank of the pp group.
    """
    bound = forward_signature.bind(*args, **kwargs)
    names = list(bound.arguments)
    first, rest = bound.arguments[names[0]], {k: bound.arguments[k] for k in names[1:] if bound.arguments[k] is not None}
    size = first.shape[0]
    if size % runner.microbatches:
        raise ValueError(
            f"a batch of {size} samples cannot be split into pp_microbatches={runner.microbatches}: under pp > 1 every"
            " evaluation/predict batch runs through the pipeline in that many micro-batches; use a batch size (or"
            " dataset size) divisible by it"
        )
    if "position_ids" in runner.forward_kwargs and "position_ids" not in rest and first.dim() >= 2:
        rest["position_ids"] = torch.arange(first.shape[1], device=first.device).expand(size, first.shape[1])
    schedule = _inference_schedule(runner)
    for module in runner.modules:
        module.eval()
    stage_args = (first,) if 0 in runner.stage_indices else ()
    with torch.inference_mode(False), torch.no_grad():
        stage_args, rest = _outside_inference((stage_args, rest))
        output = run_schedule_forward_only(schedule, *stage_args, **rest)
    runner._reshard()
    return broadcast_from_last_stage(output if runner.holds_last_stage else None, runner)


def broadcast_from_last_stage(output: Any, runner: PipelineRunner) -> Any:
    """Send the last stage's ``output`` (tensors in tuples/lists/dicts) to every rank of the pp group."""
    src = runner.last_stage_group_rank
    holder: list[Any] = [None]
    if runner.holds_last_stage:
        holder[0] = _structure(output)
    dist.broadcast_object_list(holder, group=runner.group, group_src=src)
    tensors = _leaves(output) if runner.holds_last_stage else [
        torch.empty(shape, dtype=dtype, device=runner.device) for shape, dtype in _leaf_meta(holder[0])
    ]
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


@contextlib.contextmanager
def forward_through_pipeline(module: nn.Module, runner: PipelineRunner) -> Iterator[None]:
    """Within the block, ``module(...)`` (its ``forward``) runs the whole model through the pipeline."""
    signature = inspect.signature(type(module).forward)
    signature = signature.replace(parameters=list(signature.parameters.values())[1:])  # drop self

    def forward(*args: Any, **kwargs: Any) -> Any:
        # The stage may be ``module`` itself (one stage per rank, trimmed in place): its own forward
        # must run inside the schedule.
        del module.forward
        try:
            return pipelined_forward(runner, signature, *args, **kwargs)
        finally:
            module.forward = forward  # type: ignore[method-assign]

    module.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        if "forward" in module.__dict__:
            del module.forward

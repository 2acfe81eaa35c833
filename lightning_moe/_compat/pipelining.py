"""torch.distributed.pipelining internals: the stage class, the schedules' runtime, their P2P batcher,
and the V schedules (``DualPipeV``, ``ZBVZeroBubble``).

Floors: torch >= 2.11 (:data:`PIPELINE_MIN_TORCH`); the V schedules need torch >= 2.13
(:data:`V_SCHEDULE_MIN_TORCH`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import ModuleType
from typing import Any

import torch
from torch import nn

PIPELINE_MIN_TORCH = (2, 11)
"""The oldest torch whose pipeline-stage internals :func:`pipeline_stage_class` was written against (the pipeline tests ran on 2.11 and 2.13). Checked on: torch 2.11-2.13."""


def _torch_version() -> tuple[int, int]:
    # The (major, minor) of the installed torch, looked up at each call by every version check below:
    # replacing it here (tests pretend an older torch) reaches all of them.
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def pipeline_p2p_batcher() -> tuple[ModuleType, str] | None:
    """Where torch's pipeline schedules issue their point-to-point batches, as ``(module, name)``:
    ``torch.distributed.pipelining.schedules._batch_p2p(p2p_ops, desc=None)``, looked up as a module
    global at each call, so replacing the attribute reaches every schedule.

    A batch of sends only (or receives only) goes out as separate ``P2POp.op(...)`` calls, the
    ``dist.isend`` the op holds, never through ``dist.batch_isend_irecv``; a mixed batch goes
    through ``dist.batch_isend_irecv``. The comm accounting wraps it to count both. None where
    the module or the function is missing. Present and run on torch 2.13 (pipeline parallelism
    needs >= 2.13, :func:`require_pipeline_stage_internals`); present in 2.11 with the same
    signature, where it always calls ``dist.batch_isend_irecv``. Checked on: torch 2.11-2.13."""
    try:
        from torch.distributed.pipelining import schedules
    except ImportError:
        return None
    return (schedules, "_batch_p2p") if callable(getattr(schedules, "_batch_p2p", None)) else None


def run_schedule_forward_only(schedule: Any, *args: Any, **kwargs: Any) -> Any:
    """``_PipelineSchedule.eval``: a forward-only pass through the pipeline stages. Present in torch 2.9-2.13.
    Checked on: torch 2.11-2.13."""
    return schedule.eval(*args, **kwargs)


def interleave_overlapped_forward_backward(
    schedule: Any, interleave: Callable[[Callable[[], None], Callable[[], None]], None]
) -> None:
    """Run each ``OVERLAP_F_B`` action of a ``ScheduleDualPipeV`` (one micro-batch's forward on one
    stage and another's backward on the other) as ``interleave(backward, forward)`` instead of one
    after the other, through the schedule's ``register_custom_function``.

    torch gives the custom function the action and a context, not its own executor of the two
    sub-actions, so this repeats what the private ``_PipelineScheduleRuntime._step_microbatches``
    does for ``FORWARD`` and ``FULL_BACKWARD`` (wait for the received activation or gradient unless
    the neighbouring stage is on this rank, run the stage, compute or fetch the loss, count backwards
    for the last one's gradient reduction, hand the result to the neighbouring local stage), with its
    private ``_assert_unsharded``, ``fwd_recv_ops``/``bwd_recv_ops``, ``_maybe_compute_loss``,
    ``_maybe_get_loss``, ``backward_counter`` and ``_n_microbatches``. Forward outputs are not kept
    (``return_outputs=False``, what training steps pass). Checked on: torch 2.11-2.13."""
    from torch.distributed.pipelining.schedules import OVERLAP_F_B, _wait_batch_p2p

    def run(action: Any, ctx: Any) -> None:
        runtime = ctx.schedule_ref
        local = {stage.stage_index: stage for stage in runtime._stages}
        forward_action, backward_action = action.sub_actions

        def forward() -> None:
            stage, mb = local[forward_action.stage_index], forward_action.microbatch_index
            runtime._assert_unsharded(stage)
            if not stage.is_first and stage.stage_index - 1 not in local:
                _wait_batch_p2p(runtime.fwd_recv_ops.pop((stage.stage_index, mb)))
            output = stage.forward_one_chunk(mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb], save_forward_output=False)
            runtime._maybe_compute_loss(stage, output, ctx.target_mbs, mb)
            if stage.stage_index + 1 in local:
                local[stage.stage_index + 1].set_local_fwd_input(output, mb)

        def backward() -> None:
            stage, mb = local[backward_action.stage_index], backward_action.microbatch_index
            runtime._assert_unsharded(stage)
            if not stage.is_last and stage.stage_index + 1 not in local:
                _wait_batch_p2p(runtime.bwd_recv_ops.pop((stage.stage_index, mb)))
            loss = runtime._maybe_get_loss(stage, mb)
            runtime.backward_counter[stage.stage_index] += 1
            last_backward = runtime.backward_counter[stage.stage_index] == runtime._n_microbatches
            stage.backward_one_chunk(mb, loss=loss, full_backward=True, last_backward=last_backward)
            if stage.stage_index - 1 in local:
                local[stage.stage_index - 1].set_local_bwd_input(stage.get_local_bwd_output(mb), mb)

        interleave(backward, forward)

    schedule.register_custom_function(OVERLAP_F_B, run)


def skip_backward_actions(schedule: Any) -> None:
    """Let a ``ScheduleZBVZeroBubble`` run forward only (``eval()``): its backward actions do nothing.

    torch's runtime schedules skip a stage's backward without a loss, except where two consecutive
    stages share a rank (the V's turn), where the runtime still hands the skipped backward's gradient
    to the other stage and fails. A custom function per backward kind replaces those actions; it
    drops the (empty) receive of the gradient the action would have waited for, which the private
    ``bwd_recv_ops`` would otherwise keep into the next step. Checked on: torch 2.11-2.13."""
    from torch.distributed.pipelining.schedules import BACKWARD_INPUT, BACKWARD_WEIGHT, FULL_BACKWARD

    def skip(action: Any, ctx: Any) -> None:
        ctx.schedule_ref.bwd_recv_ops.pop((action.stage_index, action.microbatch_index), None)

    for kind in (FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT):
        schedule.register_custom_function(kind, skip)


V_SCHEDULE_MIN_TORCH = (2, 13)
"""The first torch release whose pipeline stages run the V schedules here (:func:`require_v_schedule_internals`).
Checked on: torch 2.11-2.13."""


def require_v_schedule_internals(schedule: str) -> None:
    """Refuse a V pipeline schedule (``DualPipeV``, ``ZBVZeroBubble``) on a torch older than
    :data:`V_SCHEDULE_MIN_TORCH` with ``ValueError``: on torch 2.11 the stages' first P2P, which
    sets up the V's neighbours, fails ("Pair is not connected"); torch 2.12 has not been run. The
    private pipeline names the V schedules use here exist in 2.11 too. Checked on: torch 2.11-2.13."""
    if _torch_version() < V_SCHEDULE_MIN_TORCH:
        raise ValueError(
            f"pp_schedule={schedule!r} needs torch >= {'.'.join(map(str, V_SCHEDULE_MIN_TORCH))}, found {torch.__version__}:"
            " on older releases the V's stages fail to connect; upgrade torch or use pp_schedule='1F1B' or 'Interleaved1F1B'"
        )


def require_pipeline_stage_internals() -> None:
    """Refuse pipeline parallelism on a torch older than :data:`PIPELINE_MIN_TORCH`: the stage class
    of :func:`pipeline_stage_class` overrides private shape-inference methods, written for torch
    2.11-2.12 (``_shape_inference``) and 2.13 (``_prepare_*_infra``, ``_compute_outputs``); older
    versions are refused rather than run with side effects the subclass cannot undo. torch 2.12 has
    not been run. Checked on: torch 2.11-2.13."""
    if _torch_version() < PIPELINE_MIN_TORCH:
        raise RuntimeError(
            f"pipeline parallelism (pp > 1) needs torch >= {'.'.join(map(str, PIPELINE_MIN_TORCH))}, found"
            f" {torch.__version__}: upgrade torch or use pp=1"
        )


@functools.cache
def pipeline_stage_class(inference_guard: Callable[[nn.Module], AbstractContextManager]) -> type:
    """A ``torch.distributed.pipelining.PipelineStage`` whose shape inference leaves no trace.

    torch infers the activation shapes by running each stage once on the first micro-batch's shapes
    (zeros on later stages). That forward runs inside ``inference_guard(module)``, which restores
    buffers and counters and hides the pass from statistics; gradients accumulated by earlier
    steps survive it. On torch 2.13 this overrides the private ``_prepare_forward_infra``,
    ``_prepare_backward_infra``, ``_compute_outputs`` and ``_post_metadata_inference_cleanup``
    (2.13 also infers backward metadata, then sets gradients to None); on torch 2.11-2.12 the
    private ``_shape_inference`` (forward only, on zeros). On both, ``backward_maybe_with_nosync``
    reduces FSDP/replicate gradients once per step, in the backward of the stage's last
    micro-batch: torch does this only when the stage module itself is the FSDP root, and ours wraps
    its children. Checked on: torch 2.11-2.13.
    """
    require_pipeline_stage_internals()
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining import PipelineStage

    class GradientSyncOncePerStep(PipelineStage):
        # Schedules that split backward into input and weight gradients (ZB-V, DualPipeV) reduce after
        # the step instead (reduce_fsdp_gradients): FSDP2's hook fires with the input gradients, before
        # the weight gradients exist.
        reduce_after_step = False

        def backward_maybe_with_nosync(self, backward_type: Any, bwd_kwargs: dict, last_backward: bool = False) -> Any:
            for unit in self.submod.modules():
                if isinstance(unit, FSDPModule):
                    unit.set_requires_gradient_sync(last_backward and not self.reduce_after_step, recurse=False)
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    if _torch_version() < (2, 13):

        class QuietShapeInferenceStage(GradientSyncOncePerStep):
            def _shape_inference(self, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Any:
                with inference_guard(self.submod):
                    return super()._shape_inference(args, kwargs)

        return QuietShapeInferenceStage

    class QuietMetadataStage(GradientSyncOncePerStep):
        _saved_grads: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None

        def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
            self._save_grads()
            return super()._prepare_forward_infra(*args, **kwargs)

        def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> Any:
            self._save_grads()
            with inference_guard(self.submod):
                return super()._prepare_backward_infra(*args, **kwargs)

        def _compute_outputs(self, *args: torch.Tensor, module: nn.Module, **kwargs: Any) -> Any:
            if not self.is_first:
                with torch.no_grad():
                    for arg in args:
                        if isinstance(arg, torch.Tensor) and arg.is_floating_point():
                            arg.zero_()
            with inference_guard(module):
                return super()._compute_outputs(*args, module=module, **kwargs)

        def _post_metadata_inference_cleanup(self) -> None:
            super()._post_metadata_inference_cleanup()
            for param, grad in self._saved_grads or ():
                param.grad = grad
            self._saved_grads = None

        def _save_grads(self) -> None:
            if self._saved_grads is None:
                self._saved_grads = [(p, p.grad) for p in self.submod.parameters()]

    return QuietMetadataStage

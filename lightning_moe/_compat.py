"""Every private or version-specific API of torch, Lightning, Hydra and transformers that lightning-moe calls.

One function (or name) per API, each with the versions it was checked against, so that an upgrade
breaks here, with the reason, and nowhere else. "Present in" means the call exists with this
signature in the released wheels of those versions; "run on" means the test suite ran it.
Every name in ``__all__`` states its range as ``Checked on: <package> <floor>-<ceiling>.`` in its
docstring (a string after the assignment for a constant or a module); tests/test_compat.py fails
when an installed version leaves that range, so that an upgrade re-checks the API first.
The floors in pyproject.toml follow from this file: torch >= 2.11 (the GPU machine's build; every
torch API below is present there; pipeline parallelism included, see
:func:`require_pipeline_stage_internals`), lightning >= 2.6, hydra-core >= 1.3.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy, ParallelStrategy
from torch import nn

# Differentiable functional collectives (all_to_all_single_autograd, ...): private module, the
# autograd-aware collectives torch's own TP/EP code uses. Present in torch 2.9-2.13, run on 2.13.
import torch.distributed._functional_collectives as funcol  # noqa: E402  (re-exported)

"""The module ``torch.distributed._functional_collectives``. Checked on: torch 2.11-2.13."""

__all__ = [
    "Fp32BuffersModule",
    "PIPELINE_MIN_TORCH",
    "LaunchCheckedModelParallelStrategy",
    "ParallelStyleWithApply",
    "TitledRichProgressBar",
    "apply_parallel_style",
    "attached_trainer",
    "attention_implementation",
    "distributed_checkpoint_load",
    "efficient_attention_cuda",
    "efficient_attention_cuda_backward",
    "fake_store",
    "flash_attention_cpu",
    "flash_attention_cpu_available",
    "flash_attention_cpu_backward",
    "flash_attention_cuda",
    "flash_attention_cuda_backward",
    "flatten_mesh",
    "force_sum_reduction",
    "fsdp_mixed_precision",
    "funcol",
    "grouped_mm",
    "hydra_args_parser",
    "hydra_sweep_jobs",
    "is_dropout_module",
    "local_shard_index",
    "materialize_distributed_module",
    "module_child_table",
    "module_parameter_table",
    "non_persistent_buffer_names",
    "optimizer_steps_after_this_batch",
    "optimizers_to_device",
    "pipeline_p2p_batcher",
    "pipeline_stage_class",
    "interleave_overlapped_forward_backward",
    "reduce_fsdp_gradients",
    "require_v_schedule_internals",
    "V_SCHEDULE_MIN_TORCH",
    "skip_backward_actions",
    "replicate_module",
    "require_pipeline_stage_internals",
    "route_gradient_clipping",
    "resolve_process_group",
    "run_schedule_forward_only",
    "set_attention_implementation",
    "set_fsdp_mixed_precision",
    "set_process_group_timeouts",
    "shallow_copy_module",
    "slice_flattened",
    "tensor_is_view",
    "trainer_logging_step",
    "trainer_should_update_logs",
    "wrap_distributed_functions",
]

PIPELINE_MIN_TORCH = (2, 11)
"""The oldest torch whose pipeline-stage internals :func:`pipeline_stage_class` was written against (the pipeline tests ran on 2.11 and 2.13). Checked on: torch 2.11-2.13."""


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


# -- torch ------------------------------------------------------------------------------------------
def grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs=offsets)`` (int32 offsets). Present in torch 2.9-2.13; its CPU
    kernels (fp32/bf16/fp16) run on 2.13. Checked on: torch 2.11-2.13."""
    return torch._grouped_mm(a, b, offsets)


class Fp32BuffersModule(nn.Module):
    """An ``nn.Module`` whose float32 buffers stay float32 when the module is cast: ``module.to(dtype)``,
    ``.half()``, ``.bfloat16()``, ``.double()`` change its parameters and other buffers, and move
    these to the new device only. Overrides ``nn.Module._apply`` (through which all of ``to``,
    ``cuda``, ``cpu``, ``type`` and the dtype casts go) and reads/writes its own ``_buffers``.
    Checked on: torch 2.11-2.13."""

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Fp32BuffersModule:
        fp32_buffers = {name: buf for name, buf in self._buffers.items() if buf is not None and buf.dtype == torch.float32}
        super()._apply(fn, recurse)
        for name, old in fp32_buffers.items():
            new = self._buffers[name]
            if new is not None and new.dtype != torch.float32:
                self._buffers[name] = old.to(new.device)
        return self


# Fused attention kernels that also return the log-sum-exp of each query row (what ring attention
# merges blocks with): aten's private SDPA ops, called without dropout, mask or varlen inputs.
# Their schemas are identical in torch 2.11 and 2.13 (native_functions.yaml); the CPU ones run on
# 2.13 (tests/test_ring_attention.py), the CUDA ones are not yet run in this project.
def flash_attention_cpu_available() -> bool:
    """Whether ``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` exists.
    Checked on: torch 2.11-2.13."""
    return hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def flash_attention_cpu(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, logsumexp [B, H, Sq] fp32)``: ``aten._scaled_dot_product_flash_attention_for_cpu``.
    Checked on: torch 2.11-2.13."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def flash_attention_cpu_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    causal: bool, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)``: ``aten._scaled_dot_product_flash_attention_for_cpu_backward``.
    Checked on: torch 2.11-2.13."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale
    )


def flash_attention_cuda(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, logsumexp [B, H, Sq] fp32, philox_seed, philox_offset)``:
    ``aten._scaled_dot_product_flash_attention`` (dense inputs, no debug mask).
    Checked on: torch 2.11-2.13."""
    out, lse, _, _, _, _, philox_seed, philox_offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale
    )
    return out, lse, philox_seed, philox_offset


def flash_attention_cuda_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    causal: bool, scale: float, philox_seed: torch.Tensor, philox_offset: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)``: ``aten._scaled_dot_product_flash_attention_backward``. Without dropout the RNG
    state is never read (any forward's has the right type); the cumulative sequence lengths are for
    varlen inputs only (None). Checked on: torch 2.11-2.13."""
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, philox_seed, philox_offset,
        scale=scale,
    )


def efficient_attention_cuda(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, logsumexp [B, H, ceil(Sq / 32) * 32] fp32, philox_seed, philox_offset)``:
    ``aten._scaled_dot_product_efficient_attention`` (no bias). The log-sum-exp keeps the kernel's
    padded columns. Checked on: torch 2.11-2.13."""
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)


def efficient_attention_cuda_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    causal: bool, scale: float, philox_seed: torch.Tensor, philox_offset: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)``: ``aten._scaled_dot_product_efficient_attention_backward``; ``lse`` in the
    forward's padded layout. Checked on: torch 2.11-2.13."""
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, lse, philox_seed, philox_offset, 0.0, [True, True, True, False], causal,
        scale=scale,
    )
    return dq, dk, dv


def local_shard_index(tensor: Any) -> tuple[slice, ...]:
    """The block of the global tensor a DTensor's local shard holds, as slices: from
    ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset`` (what DCP reshards
    with; it also covers FSDP's strided shards). Present in torch 2.9-2.13. Checked on: torch 2.11-2.13."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(slice(start, start + size) for start, size in zip(offset, shape))


def flatten_mesh(mesh: Any, name: str) -> Any:
    """``DeviceMesh._flatten(name)``: one process group over several mesh dims. Present in torch 2.9-2.13.
    Checked on: torch 2.11-2.13."""
    return mesh._flatten(name)


def slice_flattened(root: Any, names: tuple[str, ...]) -> Any:
    """``root[names]`` where some of ``names`` are dims flattened on ``root`` (:func:`flatten_mesh`).
    torch 2.11-2.13 slice them, warning that slicing a flattened dim from the root "will be
    deprecated"; HSDP needs it so that the full mesh (its dp flattened from dp_replicate x dp_shard)
    and the HSDP meshes share one root, as FSDP2 requires of a tensor-parallel parameter's mesh.
    Checked on: torch 2.11-2.13."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh", category=UserWarning)
        return root[names]


def replicate_module(modules: nn.Module | list[nn.Module], mesh: Any) -> None:
    """DDP-style replication with FSDP2's hooks and options:
    ``torch.distributed._composable.replicate_with_fsdp.replicate``. Present in torch 2.9-2.13.
    Checked on: torch 2.11-2.13."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    replicate(modules, mesh=mesh)


def force_sum_reduction(unit: Any, enabled: bool) -> None:
    """``FSDPModule.set_force_sum_reduction_for_comms``: sum in the collective, divide after (gloo has
    no PREMUL_SUM). Present in torch 2.9-2.13. Checked on: torch 2.11-2.13."""
    unit.set_force_sum_reduction_for_comms(enabled)


def set_fsdp_mixed_precision(unit: Any, policy: Any) -> None:
    """Replace an FSDP2 unit's ``MixedPrecisionPolicy`` after ``fully_shard`` (before its lazy init):
    ``FSDPState._mp_policy`` and ``FSDPParamGroup.mp_policy``, which ``lazy_init`` turns into the
    parameters' all-gather and reduce dtypes. Present in torch 2.9-2.13, run on 2.13.
    Checked on: torch 2.11-2.13."""
    state = unit._get_fsdp_state()
    if state._mp_policy == policy:
        return
    if state._is_root is not None:  # lazy init done: the dtypes are fixed
        raise RuntimeError("set the FSDP mixed-precision policy before the module's first forward")
    state._mp_policy = policy
    if state._fsdp_param_group is not None:
        state._fsdp_param_group.mp_policy = policy


def fsdp_mixed_precision(unit: Any) -> Any:
    """An FSDP2 unit's ``MixedPrecisionPolicy`` (``FSDPState._mp_policy``). Present in torch 2.9-2.13.
    Checked on: torch 2.11-2.13."""
    return unit._get_fsdp_state()._mp_policy


def set_process_group_timeouts(timeout: Any) -> int:
    """Give every process group of this process (sub-groups included) ``timeout``; return how many.

    ``new_group`` (and so ``init_device_mesh``) gives sub-groups the backend's default timeout (30
    minutes for gloo, 10 for nccl), not the one ``init_process_group`` got: a collective on a mesh
    sub-group whose peer died would wait that long. Uses ``c10d._world.pg_map`` and
    ``c10d._set_pg_timeout``. Present in torch 2.9-2.13, run on 2.13. Checked on: torch 2.11-2.13."""
    from torch.distributed import distributed_c10d as c10d

    groups = [pg for pg in list(c10d._world.pg_map) if not c10d._rank_not_in_group(pg)]
    for pg in groups:
        c10d._set_pg_timeout(timeout, pg)
    return len(groups)


def resolve_process_group(group: Any) -> dist.ProcessGroup:
    """The ``ProcessGroup`` behind a functional collective's ``group`` argument (group, name or mesh):
    ``c10d._resolve_process_group(funcol._resolve_group_name(group))``. Present in torch 2.9-2.13.
    Checked on: torch 2.11-2.13."""
    from torch.distributed import distributed_c10d as c10d

    return c10d._resolve_process_group(funcol._resolve_group_name(group))


def wrap_distributed_functions(
    c10d: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]],
    functional: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]],
    pipeline_batch: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
) -> Callable[[], None]:
    """Replace torch's collectives by wrappers; return ``restore()``, which puts the originals back.

    Each ``name: wrap`` of ``c10d`` replaces ``torch.distributed.<name>`` (``batch_isend_irecv``
    included) by ``wrap(original)``, each of ``functional`` the function of :data:`funcol`, and
    ``pipeline_batch`` the P2P batcher of torch's pipeline schedules (:func:`pipeline_p2p_batcher`);
    names this torch lacks are skipped. Code that looks the functions up as module attributes at
    each call (FSDP2, DTensor, the pipeline schedules, ``dist.all_reduce(...)``) reaches the
    wrappers; a reference taken before (``from torch.distributed import all_reduce``) does not.
    ``restore()`` puts the originals back in reverse order; calling it again does nothing. Not
    thread-safe: it rebinds module globals. Checked on: torch 2.11-2.13."""
    originals: list[tuple[ModuleType, str, Callable[..., Any]]] = []

    def install(module: ModuleType, name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        original = getattr(module, name)
        originals.append((module, name, original))
        setattr(module, name, wrap(original))

    def restore() -> None:
        while originals:
            module, name, original = originals.pop()
            setattr(module, name, original)

    try:
        for module, table in ((dist, c10d), (funcol, functional)):
            for name, wrap in table.items():
                if hasattr(module, name):
                    install(module, name, wrap)
        batcher = pipeline_p2p_batcher()
        if pipeline_batch is not None and batcher is not None:
            install(batcher[0], batcher[1], pipeline_batch)
    except BaseException:
        restore()
        raise
    return restore


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


def interleave_overlapped_forward_backward(schedule: Any, interleave: Callable[[Callable[[], None], Callable[[], None]], None]) -> None:
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


def reduce_fsdp_gradients(units: list[nn.Module]) -> None:
    """Reduce-scatter now the gradients that the FSDP2 ``units`` accumulated unsharded (with
    ``set_requires_gradient_sync(False)`` and ``set_reshard_after_backward(False)``), then reshard them,
    as a backward with gradient sync would have.

    For pipeline schedules that compute weight gradients apart from the autograd backward (the split
    backward of ZB-V and DualPipeV), which FSDP2's post-backward hooks never see. torch's pipeline
    stages do the same for a stage module that is itself an FSDP unit
    (``_PipelineStageBase.perform_reduce_grad``); ours wrap its children. Private: each unit's state's
    param groups (``_fsdp_param_groups`` on 2.13, one ``_fsdp_param_group`` on 2.11) and their
    ``post_backward()``, and the root state's ``_root_post_backward_final_callback()``.
    Checked on: torch 2.11-2.13."""
    from torch.distributed.fsdp import fully_shard

    if not units:
        return
    for unit in units:
        unit.set_is_last_backward(True)
        unit.set_requires_gradient_sync(True, recurse=False)
        unit.set_reshard_after_backward(True, recurse=False)
    states = [fully_shard.state(unit) for unit in units]  # type: ignore[attr-defined]
    for state in states:
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
        for group in groups:
            group.post_backward()
    root = next((state for state in states if state._is_root), states[0])
    root._root_post_backward_final_callback()


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


# nn.Module and Tensor internals: the child, parameter and buffer tables and the autograd view base.
def module_child_table(module: nn.Module) -> dict[str, nn.Module | None]:
    """The live ``nn.Module._modules`` dict of ``module``: its child slots in registration order,
    None-valued slots and one module under several names included (``named_children`` skips both).
    Writing to it replaces a slot without ``__setattr__``'s checks; a copy of it gives a shallow
    copy of a module its own child table. Checked on: torch 2.11-2.13."""
    return module._modules


def shallow_copy_module(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` with its own child table (a copy of ``_modules``): it shares every
    attribute, parameter, buffer and submodule, and replacing a child of the copy leaves ``module`` as
    it is. Not ``copy.copy``: a LightningModule's ``__getstate__`` drops its trainer.
    Checked on: torch 2.11-2.13."""
    clone = object.__new__(type(module))
    clone.__dict__.update(module.__dict__)
    clone._modules = dict(module._modules)
    return clone


def module_parameter_table(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """The live ``nn.Module._parameters`` dict of ``module`` (its own parameters, not its children's).
    Unlike ``register_parameter``, writing to it accepts a plain tensor (a parameter's local view
    for the duration of a forward) and runs no registration hooks. Checked on: torch 2.11-2.13."""
    return module._parameters


def non_persistent_buffer_names(module: nn.Module) -> set[str]:
    """Names of ``module``'s own buffers registered with ``persistent=False`` (left out of its
    ``state_dict``): ``nn.Module._non_persistent_buffers_set``. Checked on: torch 2.11-2.13."""
    return module._non_persistent_buffers_set


def is_dropout_module(module: nn.Module) -> bool:
    """Whether ``module`` is a torch dropout module with a probability ``p``: an instance of
    ``torch.nn.modules.dropout._DropoutNd``, the base of ``Dropout``, ``Dropout1d/2d/3d``,
    ``AlphaDropout`` and ``FeatureAlphaDropout``. Checked on: torch 2.11-2.13."""
    return isinstance(module, nn.modules.dropout._DropoutNd)


def tensor_is_view(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is an autograd view of another tensor: ``tensor._base is not None``.
    Checked on: torch 2.11-2.13."""
    return tensor._base is not None


def fake_store() -> dist.Store:
    """A ``dist.Store`` that holds nothing, for ``init_process_group(backend="fake", ...)``:
    ``torch.testing._internal.distributed.fake_pg.FakeStore()``. Checked on: torch 2.11-2.13."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


from torch.distributed.tensor.parallel import ParallelStyle  # noqa: E402


class ParallelStyleWithApply(ParallelStyle):
    """A tensor-parallel style (``parallelize_module`` plan entry) that subclasses write through the
    public :meth:`apply`: it overrides ``ParallelStyle._apply(module, device_mesh)``, the abstract
    method ``parallelize_module`` calls, and hands over to ``apply``. Checked on: torch 2.11-2.13."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        return self.apply(module, device_mesh)

    def apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        """Parallelize ``module`` over the 1-D ``device_mesh``; return the module to put in its place."""
        raise NotImplementedError(f"{type(self).__name__} does not implement apply(module, device_mesh)")


def apply_parallel_style(style: ParallelStyle, module: nn.Module, device_mesh: Any) -> nn.Module:
    """Apply one tensor-parallel style (torch's or :class:`ParallelStyleWithApply`) to ``module`` as
    ``parallelize_module`` does: ``style._apply(module, device_mesh)``. Checked on: torch 2.11-2.13."""
    return style._apply(module, device_mesh)


# -- Lightning --------------------------------------------------------------------------------------
def materialize_distributed_module(module: nn.Module, device: torch.device) -> None:
    """``lightning.fabric.utilities.init._materialize_distributed_module`` (what ModelParallelStrategy
    calls after ``configure_model``). Run on lightning 2.6. Checked on: lightning 2.6-2.6."""
    from lightning.fabric.utilities.init import _materialize_distributed_module

    _materialize_distributed_module(module, device)


def optimizers_to_device(optimizers: Any, device: torch.device) -> None:
    """``lightning.fabric.utilities.optimizer._optimizers_to_device``. Run on lightning 2.6. Checked on: lightning 2.6-2.6."""
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)


def trainer_logging_step(trainer: Any) -> int:
    """The step Lightning logs the current optimizer step's metrics at:
    ``trainer.fit_loop.epoch_loop._batches_that_stepped``. Checked on: lightning 2.6-2.6."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def trainer_should_update_logs(trainer: Any) -> bool:
    """Whether Lightning logs at this step (its ``log_every_n_steps`` cadence):
    ``trainer._logger_connector.should_update_logs``. Checked on: lightning 2.6-2.6."""
    return trainer._logger_connector.should_update_logs


def attached_trainer(module: Any) -> Any:
    """The ``Trainer`` a LightningModule is attached to, or None when it is detached (the public
    ``trainer`` property raises then, and returns a Fabric shim under Fabric): the private
    ``LightningModule._trainer``. Checked on: lightning 2.6-2.6."""
    return module._trainer


from lightning.pytorch.callbacks import RichProgressBar  # noqa: E402


class TitledRichProgressBar(RichProgressBar):
    """Lightning's ``RichProgressBar`` whose training-bar title comes from the public
    :meth:`train_bar_title`, for subclasses to override: it overrides the private
    ``RichProgressBar._get_train_description(current_epoch)``, the bar's one source of the title
    (called when the training bar is created and at each epoch start). Checked on: lightning 2.6-2.6."""

    def _get_train_description(self, current_epoch: int) -> str:
        return self.train_bar_title(current_epoch)

    def train_bar_title(self, current_epoch: int) -> str:
        """The training bar's title; Lightning's: ``Epoch 3/9``, padded to the validation title's width."""
        return super()._get_train_description(current_epoch)


def distributed_checkpoint_load(state: dict[str, Any], path: Path) -> None:
    """Load a DCP folder into ``state`` in place as ModelParallelStrategy does
    (``lightning.fabric.strategies.model_parallel._distributed_checkpoint_load``). Run on lightning 2.6.
    Checked on: lightning 2.6-2.6."""
    from lightning.fabric.strategies.model_parallel import _distributed_checkpoint_load

    _distributed_checkpoint_load(state, path)


class LaunchCheckedModelParallelStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` with public hooks for what only its private methods reach.

    - :meth:`before_launch` runs once devices and nodes are known, before any process starts
      (Lightning's private ``_configure_launcher``): the place to fail fast on bad sizes.
    - :meth:`setup_distributed` initialises the process group as ModelParallelStrategy does
      (``ParallelStrategy.setup_environment`` then the private ``_setup_distributed``), *without*
      building ModelParallelStrategy's own 2D (dp, tp) mesh: the subclass brings its own.
    - :meth:`use_device_mesh` sets the mesh that ``strategy.device_mesh`` and
      ``LightningModule.device_mesh`` return (the private ``_device_mesh`` of both).
    - :attr:`process_group_timeout` is the ``timeout`` given to the constructor (private ``_timeout``).

    Checked on: lightning 2.6-2.6.
    """

    def before_launch(self) -> None:
        """Called before the launcher is configured (and before any process starts)."""

    def _configure_launcher(self) -> None:
        self.before_launch()
        super()._configure_launcher()

    def setup_distributed(self) -> None:
        """The process group (and Lightning's environment) without ModelParallelStrategy's mesh."""
        ParallelStrategy.setup_environment(self)
        self._setup_distributed()

    def use_device_mesh(self, mesh: Any) -> None:
        """``mesh`` becomes ``self.device_mesh`` and the LightningModule's ``device_mesh``."""
        self._device_mesh = mesh
        if self.lightning_module is not None:
            self.lightning_module._device_mesh = mesh

    @property
    def process_group_timeout(self) -> Any:
        """The constructor's ``timeout`` (a ``timedelta`` or None)."""
        return self._timeout


def optimizer_steps_after_this_batch(trainer: Any) -> bool:
    """Whether Lightning's fit loop steps the optimizers after the current training batch (the last
    micro-batch of an accumulation window, or the epoch's last batch): the negation of the private
    ``trainer.fit_loop.epoch_loop._should_accumulate()``, valid from ``training_step`` on, which
    Lightning itself uses to skip DDP's gradient sync. Checked on: lightning 2.6-2.6."""
    return not trainer.fit_loop.epoch_loop._should_accumulate()


def route_gradient_clipping(plugin: Any, clip_by_norm: Callable[[Any, float], None]) -> None:
    """Make Lightning's ``gradient_clip_val`` (``gradient_clip_algorithm="norm"``) call
    ``clip_by_norm(optimizer, clip_val)``: Lightning's ``Precision.clip_gradients`` calls the
    plugin's ``clip_grad_by_norm``, which is replaced on this plugin instance (there is no strategy
    hook for it). Checked on: lightning 2.6-2.6."""
    plugin.clip_grad_by_norm = clip_by_norm


# -- Hydra ------------------------------------------------------------------------------------------
def hydra_args_parser() -> Any:
    """Hydra's own command-line parser (``hydra._internal.utils.get_args_parser``). Run on hydra-core 1.3.
    Checked on: hydra-core 1.3-1.3."""
    from hydra._internal.utils import get_args_parser

    return get_args_parser()


def hydra_sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """The basic sweeper's expansion of sweep overrides into jobs, in job order
    (``hydra._internal.core_plugins.basic_sweeper.BasicSweeper.split_arguments``). Run on hydra-core 1.3.
    Checked on: hydra-core 1.3-1.3."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    batches = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(overrides), None)
    return [list(job) for batch in batches for job in batch]


# -- transformers ------------------------------------------------------------------------------------
def attention_implementation(config: Any) -> str | None:
    """The attention implementation a transformers config selects (``"sdpa"``, ``"eager"``, a name
    registered with ``AttentionInterface``): its private ``_attn_implementation``; None for an
    object without one. Checked on: transformers 5.24-5.24."""
    return getattr(config, "_attn_implementation", None)


def set_attention_implementation(config: Any, name: str) -> None:
    """Make a transformers config select attention implementation ``name`` without the model-level
    checks of ``PreTrainedModel.set_attn_implementation``: the setter of the private
    ``_attn_implementation`` (which also sets its sub-configs'). Checked on: transformers 5.24-5.24."""
    config._attn_implementation = name

"""Every private or version-specific API of torch, Lightning and Hydra that lightning-moe calls.

One function (or name) per API, each with the versions it was checked against, so that an upgrade
breaks here, with the reason, and nowhere else. "Present in" means the call exists with this
signature in the released wheels of those versions; "run on" means the test suite ran it.
The floors in pyproject.toml follow from this file: torch >= 2.11 (the GPU machine's build; every
torch API below is present there), pipeline parallelism torch >= 2.13 (see
:func:`require_pipeline_stage_internals`), lightning >= 2.6, hydra-core >= 1.3.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# Differentiable functional collectives (all_to_all_single_autograd, ...): private module, the
# autograd-aware collectives torch's own TP/EP code uses. Present in torch 2.9-2.13, run on 2.13.
import torch.distributed._functional_collectives as funcol  # noqa: E402  (re-exported)

__all__ = [
    "PIPELINE_MIN_TORCH",
    "distributed_checkpoint_load",
    "flatten_mesh",
    "force_sum_reduction",
    "fsdp_mixed_precision",
    "funcol",
    "grouped_mm",
    "hydra_args_parser",
    "hydra_sweep_jobs",
    "local_shard_index",
    "materialize_distributed_module",
    "optimizers_to_device",
    "pipeline_p2p_batcher",
    "replicate_module",
    "require_pipeline_stage_internals",
    "resolve_process_group",
    "run_schedule_forward_only",
    "set_fsdp_mixed_precision",
    "set_process_group_timeouts",
]

PIPELINE_MIN_TORCH = (2, 13)


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


# -- torch ------------------------------------------------------------------------------------------
def grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs=offsets)`` (int32 offsets). Present in torch 2.9-2.13; its CPU
    kernels (fp32/bf16/fp16) run on 2.13."""
    return torch._grouped_mm(a, b, offsets)


def local_shard_index(tensor: Any) -> tuple[slice, ...]:
    """The block of the global tensor a DTensor's local shard holds, as slices: from
    ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset`` (what DCP reshards
    with; it also covers FSDP's strided shards). Present in torch 2.9-2.13."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(slice(start, start + size) for start, size in zip(offset, shape))


def flatten_mesh(mesh: Any, name: str) -> Any:
    """``DeviceMesh._flatten(name)``: one process group over several mesh dims. Present in torch 2.9-2.13."""
    return mesh._flatten(name)


def replicate_module(modules: nn.Module | list[nn.Module], mesh: Any) -> None:
    """DDP-style replication with FSDP2's hooks and options:
    ``torch.distributed._composable.replicate_with_fsdp.replicate``. Present in torch 2.9-2.13."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    replicate(modules, mesh=mesh)


def force_sum_reduction(unit: Any, enabled: bool) -> None:
    """``FSDPModule.set_force_sum_reduction_for_comms``: sum in the collective, divide after (gloo has
    no PREMUL_SUM). Present in torch 2.9-2.13."""
    unit.set_force_sum_reduction_for_comms(enabled)


def set_fsdp_mixed_precision(unit: Any, policy: Any) -> None:
    """Replace an FSDP2 unit's ``MixedPrecisionPolicy`` after ``fully_shard`` (before its lazy init):
    ``FSDPState._mp_policy`` and ``FSDPParamGroup.mp_policy``, which ``lazy_init`` turns into the
    parameters' all-gather and reduce dtypes. Present in torch 2.9-2.13, run on 2.13."""
    state = unit._get_fsdp_state()
    if state._mp_policy == policy:
        return
    if state._is_root is not None:  # lazy init done: the dtypes are fixed
        raise RuntimeError("set the FSDP mixed-precision policy before the module's first forward")
    state._mp_policy = policy
    if state._fsdp_param_group is not None:
        state._fsdp_param_group.mp_policy = policy


def fsdp_mixed_precision(unit: Any) -> Any:
    """An FSDP2 unit's ``MixedPrecisionPolicy`` (``FSDPState._mp_policy``). Present in torch 2.9-2.13."""
    return unit._get_fsdp_state()._mp_policy


def set_process_group_timeouts(timeout: Any) -> int:
    """Give every process group of this process (sub-groups included) ``timeout``; return how many.

    ``new_group`` (and so ``init_device_mesh``) gives sub-groups the backend's default timeout (30
    minutes for gloo, 10 for nccl), not the one ``init_process_group`` got: a collective on a mesh
    sub-group whose peer died would wait that long. Uses ``c10d._world.pg_map`` and
    ``c10d._set_pg_timeout``. Present in torch 2.9-2.13, run on 2.13."""
    from torch.distributed import distributed_c10d as c10d

    groups = [pg for pg in list(c10d._world.pg_map) if not c10d._rank_not_in_group(pg)]
    for pg in groups:
        c10d._set_pg_timeout(timeout, pg)
    return len(groups)


def resolve_process_group(group: Any) -> dist.ProcessGroup:
    """The ``ProcessGroup`` behind a functional collective's ``group`` argument (group, name or mesh):
    ``c10d._resolve_process_group(funcol._resolve_group_name(group))``. Present in torch 2.9-2.13."""
    from torch.distributed import distributed_c10d as c10d

    return c10d._resolve_process_group(funcol._resolve_group_name(group))


def pipeline_p2p_batcher() -> tuple[ModuleType, str] | None:
    """Where torch's pipeline schedules issue their point-to-point batches, as ``(module, name)``:
    ``torch.distributed.pipelining.schedules._batch_p2p(p2p_ops, desc=None)``, looked up as a module
    global at each call, so replacing the attribute reaches every schedule.

    A batch of sends only (or receives only) goes out as separate ``P2POp.op(...)`` calls, the
    ``dist.isend`` the op holds, never through ``dist.batch_isend_irecv``; a mixed batch goes
    through ``dist.batch_isend_irecv``. The comm accounting wraps it to count both. None where
    the module or the function is missing. Present and run on torch 2.13 (pipeline parallelism
    needs >= 2.13, :func:`require_pipeline_stage_internals`)."""
    try:
        from torch.distributed.pipelining import schedules
    except ImportError:
        return None
    return (schedules, "_batch_p2p") if callable(getattr(schedules, "_batch_p2p", None)) else None


def run_schedule_forward_only(schedule: Any, *args: Any, **kwargs: Any) -> Any:
    """``_PipelineSchedule.eval``: a forward-only pass through the pipeline stages. Present in torch 2.9-2.13."""
    return schedule.eval(*args, **kwargs)


def require_pipeline_stage_internals() -> None:
    """Pipeline parallelism subclasses ``PipelineStage`` and overrides its metadata inference
    (``_prepare_forward_infra``, ``_prepare_backward_infra``, ``_compute_outputs``,
    ``_post_metadata_inference_cleanup``, ``backward_maybe_with_nosync``): written against torch
    2.13; torch 2.11 infers shapes through other methods (``_shape_inference``), so older versions
    are refused rather than run with side effects the subclass cannot undo."""
    if _torch_version() < PIPELINE_MIN_TORCH:
        raise RuntimeError(
            f"pipeline parallelism (pp > 1) needs torch >= {'.'.join(map(str, PIPELINE_MIN_TORCH))}, found"
            f" {torch.__version__}: upgrade torch or use pp=1"
        )


# -- Lightning --------------------------------------------------------------------------------------
def materialize_distributed_module(module: nn.Module, device: torch.device) -> None:
    """``lightning.fabric.utilities.init._materialize_distributed_module`` (what ModelParallelStrategy
    calls after ``configure_model``). Run on lightning 2.6."""
    from lightning.fabric.utilities.init import _materialize_distributed_module

    _materialize_distributed_module(module, device)


def optimizers_to_device(optimizers: Any, device: torch.device) -> None:
    """``lightning.fabric.utilities.optimizer._optimizers_to_device``. Run on lightning 2.6."""
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)


def distributed_checkpoint_load(state: dict[str, Any], path: Path) -> None:
    """Load a DCP folder into ``state`` in place as ModelParallelStrategy does
    (``lightning.fabric.strategies.model_parallel._distributed_checkpoint_load``). Run on lightning 2.6."""
    from lightning.fabric.strategies.model_parallel import _distributed_checkpoint_load

    _distributed_checkpoint_load(state, path)


# -- Hydra ------------------------------------------------------------------------------------------
def hydra_args_parser() -> Any:
    """Hydra's own command-line parser (``hydra._internal.utils.get_args_parser``). Run on hydra-core 1.3."""
    from hydra._internal.utils import get_args_parser

    return get_args_parser()


def hydra_sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """The basic sweeper's expansion of sweep overrides into jobs, in job order
    (``hydra._internal.core_plugins.basic_sweeper.BasicSweeper.split_arguments``). Run on hydra-core 1.3."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    batches = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(overrides), None)
    return [list(job) for batch in batches for job in batch]

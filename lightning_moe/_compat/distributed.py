"""torch.distributed internals: functional collectives, c10d process groups, DeviceMesh, DTensor,
FSDP2 and replicate, tensor-parallel styles, and the fake process group.

Floors: torch >= 2.11 (every torch API below is present there).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch.distributed as dist
from torch import nn

from lightning_moe._compat.pipelining import pipeline_p2p_batcher

# isort: split
# Differentiable functional collectives (all_to_all_single_autograd, ...): private module, the
# autograd-aware collectives torch's own TP/EP code uses. Present in torch 2.9-2.13, run on 2.13.
import torch.distributed._functional_collectives as funcol  # noqa: E402  (re-exported)

"""The module ``torch.distributed._functional_collectives``. Checked on: torch 2.11-2.13."""


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


def flight_recorder_entries() -> dict[str, Any] | None:
    """torch's flight recorder of this process (the last collectives issued on every process group,
    gloo's included, with their group, sequence number and creation time), as its JSON dump decoded:
    ``torch._C._distributed_c10d._dump_fr_trace_json``. ``None`` where this torch has no dump. The
    recorder keeps entries only when ``TORCH_FR_BUFFER_SIZE`` was set before the process groups were
    created. Run on 2.13 (gloo groups record there); not run on 2.11, where a missing dump gives ``None``
    and the hang watchdog stays off. Checked on: torch 2.11-2.13."""
    import json

    from torch._C import _distributed_c10d as c10d_ext

    dump = getattr(c10d_ext, "_dump_fr_trace_json", None)
    return None if dump is None else json.loads(dump())


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


def reduce_fsdp_gradients(units: list[nn.Module]) -> None:
    """Reduce-scatter now the gradients that the FSDP2 ``units`` accumulated unsharded (with
    ``set_requires_gradient_sync(False)`` and ``set_reshard_after_backward(False)``), then reshard them,
    as a backward with gradient sync would have.

    For pipeline schedules that compute weight gradients apart from the autograd backward (the split
    backward of ZB-V and DualPipeV), which FSDP2's post-backward hooks never see. torch's pipeline
    stages do the same for a stage module that is itself an FSDP unit
    (``_PipelineStageBase.perform_reduce_grad``); ours wrap its children. Private: each unit's state's
    param groups (``_fsdp_param_groups`` on 2.13, one ``_fsdp_param_group`` on 2.11) and their
    ``post_backward()``, and each root state's ``_root_post_backward_final_callback()``.
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
    # Each root's callback finalizes its own tree and frees the reduce-scatter inputs it keeps: under
    # pp > 1 every top-level unit is a root, and a root left out would hold its inputs until its next backward.
    for root in [state for state in states if state._is_root] or states[:1]:
        root._root_post_backward_final_callback()


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

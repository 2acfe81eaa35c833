"""Every private or version-specific API of torch, Lightning, Hydra and transformers that lightning-moe calls.

One function (or name) per API, each with the versions it was checked against, so that an upgrade
breaks here, with the reason, and nowhere else. "Present in" means the call exists with this
signature in the released wheels of those versions; "run on" means the test suite ran it.
Every name in ``__all__`` states its range as ``Checked on: <package> <floor>-<ceiling>.`` in its
docstring (a string after the assignment for a constant or a module); tests/test_compat.py fails
when an installed version leaves that range, so that an upgrade re-checks the API first.

The door is this package, one module per upstream library; each module's docstring states the
floors it needs (``Floors: <package> >= <version>``), and tests/test_compat.py checks them against
pyproject.toml and against the ``Checked on:`` ranges of the module's names:

- :mod:`.distributed`: torch.distributed: functional collectives, c10d process groups, DeviceMesh,
  DTensor, FSDP2 and replicate, tensor-parallel styles, the fake process group.
- :mod:`.pipelining`: torch.distributed.pipelining: the stage class, the schedules' runtime, the V
  schedules.
- :mod:`.kernels`: ``torch._grouped_mm`` and aten's fused attention ops.
- :mod:`.modules`: torch.nn internals (a module's tables and ``_apply``, dropout, tensor views).
- :mod:`.lightning`: Lightning's strategy, trainer, loop, progress bar and precision internals.
- :mod:`.hydra`: Hydra's parser and sweeper (imported when called).
- :mod:`.transformers`: transformers' config and model attributes (transformers is never imported).

The floors in pyproject.toml follow from these modules: torch >= 2.11 (the GPU machine's build; every
torch API here is present there; pipeline parallelism included, see
:func:`require_pipeline_stage_internals`), lightning >= 2.6, hydra-core >= 1.3. Importing this
package imports neither transformers nor Hydra.
"""

from __future__ import annotations

# The modules the single-file _compat had at top level stay reachable here (``_compat.torch``, ...).
import torch  # noqa: F401
import torch.distributed as dist  # noqa: F401
from lightning.pytorch.callbacks import RichProgressBar  # noqa: F401
from lightning.pytorch.strategies import ModelParallelStrategy, ParallelStrategy  # noqa: F401
from torch import nn  # noqa: F401
from torch.distributed.tensor.parallel import ParallelStyle  # noqa: F401

from lightning_moe._compat.distributed import (
    ParallelStyleWithApply,
    apply_parallel_style,
    fake_store,
    flatten_mesh,
    flight_recorder_entries,
    force_sum_reduction,
    fsdp_mixed_precision,
    funcol,
    local_shard_index,
    reduce_fsdp_gradients,
    replicate_module,
    resolve_process_group,
    set_fsdp_mixed_precision,
    set_process_group_timeouts,
    slice_flattened,
    wrap_distributed_functions,
)
from lightning_moe._compat.hydra import hydra_args_parser, hydra_sweep_jobs
from lightning_moe._compat.kernels import (
    efficient_attention_cuda,
    efficient_attention_cuda_backward,
    flash_attention_cpu,
    flash_attention_cpu_available,
    flash_attention_cpu_backward,
    flash_attention_cuda,
    flash_attention_cuda_backward,
    foreach_mul_,
    grouped_mm,
    torch_has_grouped_mm,
)
from lightning_moe._compat.lightning import (
    LaunchCheckedModelParallelStrategy,
    TitledRichProgressBar,
    attached_trainer,
    attached_trainer_or_none,
    distributed_checkpoint_load,
    materialize_distributed_module,
    optimizer_steps_after_this_batch,
    optimizers_to_device,
    replay_training_batch,
    rewind_saved_logging_step,
    route_gradient_clipping,
    trainer_logging_step,
    trainer_should_update_logs,
)
from lightning_moe._compat.modules import (
    Fp32BuffersModule,
    is_dropout_module,
    module_child_table,
    module_parameter_table,
    non_persistent_buffer_names,
    shallow_copy_module,
    tensor_is_view,
    torch_function_disabled,
)
from lightning_moe._compat.pipelining import (
    PIPELINE_MIN_TORCH,
    V_SCHEDULE_MIN_TORCH,
    interleave_overlapped_forward_backward,
    pipeline_p2p_batcher,
    pipeline_stage_class,
    require_pipeline_stage_internals,
    require_v_schedule_internals,
    run_schedule_forward_only,
    skip_backward_actions,
)
from lightning_moe._compat.transformers import (
    attention_implementation,
    initialize_module_weights,
    set_attention_implementation,
    tied_weights_keys,
)

__all__ = [
    "Fp32BuffersModule",
    "PIPELINE_MIN_TORCH",
    "LaunchCheckedModelParallelStrategy",
    "ParallelStyleWithApply",
    "TitledRichProgressBar",
    "apply_parallel_style",
    "attached_trainer",
    "attached_trainer_or_none",
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
    "flight_recorder_entries",
    "force_sum_reduction",
    "foreach_mul_",
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
    "replay_training_batch",
    "rewind_saved_logging_step",
    "route_gradient_clipping",
    "resolve_process_group",
    "run_schedule_forward_only",
    "set_attention_implementation",
    "set_fsdp_mixed_precision",
    "set_process_group_timeouts",
    "shallow_copy_module",
    "slice_flattened",
    "tensor_is_view",
    "tied_weights_keys",
    "initialize_module_weights",
    "torch_has_grouped_mm",
    "trainer_logging_step",
    "trainer_should_update_logs",
    "wrap_distributed_functions",
    "torch_function_disabled",
]

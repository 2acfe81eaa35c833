"""``MoE5DStrategy``: Lightning glue for tensor, context, expert, data and pipeline parallelism."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch import Trainer
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_moe._compat import (
    LaunchCheckedModelParallelStrategy,
    optimizers_to_device,
    route_gradient_clipping,
    set_process_group_timeouts,
)
from lightning_moe.callbacks.console import use_lightning_moe_displays
from lightning_moe.checkpoint.commit import require_complete
from lightning_moe.checkpoint.state import (
    add_strategy_state,
    load_model_and_optimizers,
    load_one_file_checkpoint,
    optimizer_state_dict,
    read_metadata,
    resolve_checkpoint_path,
    restore_strategy_state,
)
from lightning_moe.checkpoint.writer import CheckpointWriter, save_file_atomically, split_checkpoint
from lightning_moe.cp import CpComm, all_to_all_attention, context_parallel_attention, document_attention
from lightning_moe.moe import update_expert_biases
from lightning_moe.parallel.config import ParallelConfig
from lightning_moe.parallel.config.world_size import resolve_world_size
from lightning_moe.parallel.engines import choose_step_engine
from lightning_moe.parallel.plans.context_parallel import (
    check_context_parallel_support,
    shard_batch_for_context_parallel,
)
from lightning_moe.parallel.plans.init import materialize
from lightning_moe.parallel.plans.parallelize import is_parallelized, parallelize
from lightning_moe.parallel.plans.precision import check_precision
from lightning_moe.parallel.plans.training_plans import apply_training_plans
from lightning_moe.parallel.runtime.cp_outputs import gather_sequence_outputs
from lightning_moe.parallel.runtime.documents import batch_document_ids, packed_documents
from lightning_moe.parallel.runtime.grad_norm import clip_grad_norm_
from lightning_moe.parallel.runtime.host_memory import return_large_blocks_to_the_system
from lightning_moe.parallel.runtime.watchdog import HangWatchdog, enable_flight_recorder, hang_watchdog
from lightning_moe.planner import resolve_auto_layout


def _config_field(name: str) -> property:
    """``strategy.<name>``: the strategy's ``config.<name>``, read-only."""
    return property(lambda self: getattr(self.config, name), doc=f"``config.{name}`` (read-only: see ParallelConfig)")


def _config_of_arguments(config: ParallelConfig | None, arguments: dict[str, Any]) -> ParallelConfig:
    """The strategy's ``ParallelConfig``: ``config`` when given (refusing layout arguments off their
    defaults beside it), else one built from ``arguments`` (its fields' values as given)."""
    built = ParallelConfig(**arguments)
    if config is None:
        return built
    if not isinstance(config, ParallelConfig):
        raise MisconfigurationException(
            f"config={config!r} must be a lightning_moe.ParallelConfig (or None: the layout from the other arguments)"
        )
    given = [name for name in ParallelConfig.field_names() if getattr(built, name) != ParallelConfig.default(name)]
    if given:
        raise MisconfigurationException(
            f"MoE5DStrategy got config=ParallelConfig(...) and the layout arguments {given}: pass one of the two,"
            " e.g. MoE5DStrategy(config=config.replace(...)) or MoE5DStrategy(...) without config"
        )
    return config


def auto_layout(world_size: int, layout_options: dict[str, Any] | None) -> dict[str, Any]:
    """``layout="auto"``: the planner's best layout for ``world_size`` as ``MoE5DStrategy`` keyword
    arguments (:func:`lightning_moe.planner.resolve_auto_layout` documents ``layout_options``); the
    choice and the runner-up are logged on rank 0. It is the strategy's, which sits above both the
    planner and ``parallel/``: ``parallel/`` imports no planner (tests/test_structure.py)."""
    try:
        best, runner_up = resolve_auto_layout(world_size, **dict(layout_options or {}))
    except (TypeError, ValueError) as err:
        raise MisconfigurationException(str(err)) from err
    other = f"; runner-up {runner_up.layout.label()} ({runner_up.step_time:.3g} s)" if runner_up else ""
    rank_zero_info(f"layout='auto': {best.layout.label()} (estimated {best.step_time:.3g} s per step){other}")
    return best.layout.strategy_kwargs()


class MoE5DStrategy(LaunchCheckedModelParallelStrategy):
    """Train any LightningModule with tensor, context, expert, data and pipeline parallelism.

    ``world_size = tp * cp * ep * dp * pp``; ``dp="auto"`` takes what is left. The strategy builds
    the ``(pp, dp, ep, cp, tp)`` DeviceMesh, calls ``configure_model()``, then
    :func:`lightning_moe.parallelize` unless the module already parallelized itself, splits samples
    over ``dp x ep`` and saves distributed (DCP) checkpoints atomically.

    Under ``pp > 1`` a ``torch.distributed.pipelining`` schedule replaces the module's
    ``training_step`` (:class:`~lightning_moe.parallel.engines.lightning_pipeline.PipelineEngine`): the
    module provides ``loss_from_logits(output, labels, loss_mask=None, loss_token_count=None)``, and
    ``self(...)`` in its evaluation steps runs the whole model through the stages. Under ``cp > 1``
    ``predict_step`` outputs come back whole, in token order. Precision follows the trainer
    (``"bf16-mixed"``: FSDP2 ``MixedPrecisionPolicy``; ``"16-mixed"`` is refused). docs/strategy.md
    has the details.

    Example::

        import lightning as L
        import lightning_moe  # registers "moe5d"
        trainer = L.Trainer(accelerator="cpu", devices=4, strategy=lightning_moe.MoE5DStrategy(ep=2))
        # the same layout: MoE5DStrategy(config=lightning_moe.ParallelConfig(ep=2))
        trainer.fit(lightning_moe.models.MoEGPT(), datamodule=lightning_moe.data.ByteTextDataModule())

    Args:
        tp, cp, ep, pp: tensor, context, expert and pipeline parallel sizes.
        dp: data parallel size, or ``"auto"`` for ``world_size // (tp*cp*ep*pp)``.
        etp: expert tensor parallel size, 1 or ``tp`` (default ``tp``; 1 when ep folds over tp).
        fold_ep: parallel folding: the attention dims (``"tp"``, ``"cp"``, ``"cp,tp"``) whose ranks the
            expert ep group spans too; ``MoE5DStrategy(tp=2, ep=2, fold_ep="tp")`` runs on 2 ranks.
            The world size counts only ep's unfolded part (``tp*cp*(ep/(tp*cp))*dp*pp`` folding both).
        ranks_per_node: ranks sharing a node (default: Lightning's devices per node, ``Trainer(devices=...)``);
            set it smaller to simulate nodes (see ``ParallelDims``).
        pp_schedule: ``"GPipe"``, ``"1F1B"``, ``"Interleaved1F1B"`` (needs ``pp_stages_per_rank >= 2``), or the V
            schedules ``"DualPipeV"`` and ``"ZBVZeroBubble"`` (``pp_stages_per_rank=2``, rank r runs stages r
            and 2 pp - 1 - r; with ``overlap_ep_comm`` DualPipeV interleaves its paired forward and backward).
        pp_microbatches: micro-batches per pipeline step (default ``pp``); 1F1B needs ``>= pp``.
        pp_stages_per_rank: virtual stages per rank (interleaved schedule; 2 for the V schedules).
        pp_stage_layers: the transformer layers of each (virtual) stage, in stage order, for uneven stages
            as Megatron places them (``[3, 5]``: 3 layers on stage 0 with the embedding, 5 on stage 1 with
            the head); their sum is the model's layer count. Default: an even split.
        data_parallel: ``"fsdp"`` (FSDP2 ``fully_shard``), ``"hsdp"`` (FSDP2 sharding within replica groups,
            all-reducing across them), ``"ddp"`` (replication) or ``"none"``.
        dp_replicate, dp_shard: under ``"hsdp"``, dp = ``dp_replicate * dp_shard`` (give one or both): the
            replica groups and the ranks of each (torchtitan's names). Expert data parallel splits alike.
        gather_once_per_step: under FSDP or HSDP with several micro-batches per optimizer step
            (gradient accumulation, pipeline micro-batches and pipeline steps alike), all-gather each unit
            once per optimizer step and reduce its gradients once, holding its unsharded parameters and
            gradients for the step (:mod:`lightning_moe.parallel.engines.fsdp_accumulation`; Megatron's
            distributed optimizer sends the same, docs/strategy.md).
        overlap_ep_comm: under gradient accumulation (pp = 1), run each micro-batch's backward interleaved
            with the next one's forward, so that each one's expert all-to-alls are in flight while the
            other computes (:class:`lightning_moe.parallel.engines.accumulation.OverlapEngine`); needs ep > 1 and
            ``data_parallel="fsdp"`` with ``gather_once_per_step=True``. The numbers are those without it.
        sequence_parallel: keep activations outside TP regions sharded on the sequence.
        context_parallel_keys: batch keys to shard on the sequence under cp > 1, besides
            ``input_ids``, ``labels``, ``loss_mask`` and ``position_ids``.
        cp_head_chunks: ring attention passes per attention call under cp > 1, each over an equal share
            of the key/value heads: K/V blocks in flight shrink by this factor, P2P messages grow by it.
        cp_comm: how attention crosses the cp ranks: ``"ring"`` (ring attention, K/V blocks passed around
            the cp ring) or ``"a2a"`` (all-to-all from sequence shards to head shards, attention on the
            full sequence, and back; DeepSpeed Ulysses; needs the heads per tp rank divisible by cp).
        process_group_backend: ``"gloo"``/``"nccl"``; default from the device.
        timeout: process-group timeout (a ``timedelta`` or seconds). With more than one process it is also
            the hang watchdog's: a rank that issues no collective for 95% of it writes its stacks to
            ``<default_root_dir>/stacks`` and exits naming the collective
            (:mod:`lightning_moe.parallel.runtime.watchdog`).
        save_distributed_checkpoint: save a sharded DCP folder (True) or one full file on rank 0.
        async_checkpoint: write DCP checkpoints in the background (``torch.distributed.checkpoint.async_save``):
            training goes on once the tensors are copied to host memory; at most one save is in flight
            (see :mod:`lightning_moe.checkpoint.writer`). Needs ``save_distributed_checkpoint=True``.
        activation_checkpointing: ``"none"``, ``"full"`` (each block recomputed in backward) or ``"selective"``
            (only the MoE expert FFNs and the attention core; dispatch all-to-alls run once), see
            :mod:`lightning_moe.parallel.plans.activation_checkpoint`.
        deterministic: ``torch.use_deterministic_algorithms(True)`` in every process, as
            ``Trainer(deterministic=True)`` does (either gives bitwise-identical runs of a layout).
        compile: compile each transformer block with ``torch.compile`` after parallelization (see
            :mod:`lightning_moe.parallel.plans.compile`).
        layout, layout_options: ``"auto"`` replaces the sizes above by the layout planner's best for
            the world size (``layout_options``: see ``lightning_moe.planner.resolve_auto_layout``).
        config: a ready :class:`~lightning_moe.ParallelConfig` instead of the arguments above (all but
            ``process_group_backend`` and ``timeout``, which stay the strategy's); giving both, with any of
            them off its default, is refused. Either way the strategy keeps it as ``strategy.config``,
            checked on construction, and its fields read as strategy attributes too (``strategy.cp_comm``).
    """

    strategy_name = "moe5d"
    # Every MoELayer's expert bias is updated here once per optimizer step, for any module.
    updates_expert_biases = True

    config: ParallelConfig
    # The options as attributes, read-only: a changed layout is a new ParallelConfig (config.replace(...)).
    layout = _config_field("layout")
    layout_options = _config_field("layout_options")
    data_parallel = _config_field("data_parallel")
    dp_replicate = _config_field("dp_replicate")
    dp_shard = _config_field("dp_shard")
    gather_once_per_step = _config_field("gather_once_per_step")
    overlap_ep_comm = _config_field("overlap_ep_comm")
    pp_schedule = _config_field("pp_schedule")
    pp_stages_per_rank = _config_field("pp_stages_per_rank")
    pp_stage_layers = _config_field("pp_stage_layers")
    sequence_parallel = _config_field("sequence_parallel")
    context_parallel_keys = _config_field("context_parallel_keys")
    cp_head_chunks = _config_field("cp_head_chunks")
    cp_comm = _config_field("cp_comm")
    save_distributed_checkpoint = _config_field("save_distributed_checkpoint")
    activation_checkpointing = _config_field("activation_checkpointing")
    compile = _config_field("compile")
    deterministic = _config_field("deterministic")

    def __init__(
        self,
        tp: int = 1,
        cp: int = 1,
        ep: int = 1,
        dp: int | Literal["auto"] = "auto",
        pp: int = 1,
        etp: int | None = None,
        fold_ep: str | Sequence[str] | None = None,
        pp_schedule: Literal["GPipe", "1F1B", "Interleaved1F1B", "DualPipeV", "ZBVZeroBubble"] = "1F1B",
        pp_microbatches: int | None = None,
        pp_stages_per_rank: int = 1,
        pp_stage_layers: Sequence[int] | None = None,
        data_parallel: Literal["fsdp", "hsdp", "ddp", "none"] = "fsdp",
        dp_replicate: int | None = None,
        dp_shard: int | None = None,
        gather_once_per_step: bool = False,
        overlap_ep_comm: bool = False,
        sequence_parallel: bool = True,
        context_parallel_keys: Sequence[str] = (),
        cp_head_chunks: int = 1,
        cp_comm: CpComm | str = CpComm.RING.value,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = default_pg_timeout,
        save_distributed_checkpoint: bool = True,
        async_checkpoint: bool = False,
        layout: Literal["manual", "auto"] = "manual",
        layout_options: dict[str, Any] | None = None,
        ranks_per_node: int | None = None,
        activation_checkpointing: Literal["none", "full", "selective"] = "none",
        compile: bool = False,
        deterministic: bool = False,
        config: ParallelConfig | None = None,
    ) -> None:
        arguments = dict(locals())  # first: the arguments as given, each ParallelConfig field among them
        if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
            timeout = timedelta(seconds=timeout)  # as a YAML config gives it
        config = _config_of_arguments(config, {name: arguments[name] for name in ParallelConfig.field_names()})
        super().__init__(
            save_distributed_checkpoint=config.save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._apply_config(config)
        self._hang_watchdog: HangWatchdog | None = None
        self.checkpoint_writer = CheckpointWriter(asynchronous=config.async_checkpoint)

    # -- launch and mesh ---------------------------------------------------------------------------
    def _apply_config(self, config: ParallelConfig) -> None:
        """Take ``config`` (from the constructor or, under ``layout="auto"``, with the planner's choice):
        its ``ParallelDims`` and step engine."""
        try:
            self.parallel_dims = config.parallel_dims()
            self.step_engine = choose_step_engine(
                self.parallel_dims,
                pp_schedule=config.pp_schedule,
                pp_microbatches=config.pp_microbatches,
                pp_stages_per_rank=config.pp_stages_per_rank,
                overlap_ep_comm=config.overlap_ep_comm,
                gather_once_per_step=config.gather_once_per_step,
            )
        except ValueError as err:
            raise MisconfigurationException(str(err)) from err
        self.config = config

    @override
    def before_launch(self) -> None:
        # Runs once devices and nodes are known, before any process starts: fail fast on bad sizes.
        config = self.config
        if config.layout == "auto":
            options = {"checkpointing": config.activation_checkpointing, **(config.layout_options or {})}
            self._apply_config(config.with_planned(auto_layout(self.num_nodes * self.num_processes, options)))
        if self.parallel_dims.ranks_per_node is None:
            self.parallel_dims.ranks_per_node = self.num_processes  # Lightning's devices per node
        try:
            resolve_world_size(
                self.parallel_dims,
                self.num_nodes * self.num_processes,
                self.config.data_parallel,
                self.config.dp_replicate,
                self.config.dp_shard,
            )
        except ValueError as err:
            raise MisconfigurationException(
                f"{err} (devices={self.num_processes}, num_nodes={self.num_nodes})"
            ) from err
        try:
            check_precision(self._precision_flag())
        except ValueError as err:
            raise MisconfigurationException(str(err)) from err

    def _precision_flag(self) -> str:
        """Lightning's precision flag (``"32-true"``, ``"bf16-mixed"``, ...) of the precision plugin."""
        return str(getattr(self.precision_plugin, "precision", "32-true"))

    @override
    def connect(self, model: Any) -> None:
        super().connect(model)
        # Before the callbacks' setup hooks: Lightning's default bar reads "Epoch 0/-2" and counts
        # loader batches against max_steps; its default summary prints 0 FLOPs.
        use_lightning_moe_displays(model.trainer)

    @override
    def setup_environment(self) -> None:
        if self.config.deterministic:
            # What Trainer(deterministic=True) does, for this strategy's flag: on CUDA the MoE
            # combine/dispatch backward's index_add_ and the router's scatter_add_ take their
            # deterministic kernels (CPU kernels already are); cuBLAS needs a fixed workspace.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        if self.root_device.type == "cpu":
            return_large_blocks_to_the_system()  # tensors' memory, once freed, leaves the process
        enable_flight_recorder()  # the hang watchdog reads it; before the process groups exist
        self.setup_distributed()
        self.parallel_dims.validate(self.world_size)
        self.use_device_mesh(self.parallel_dims.build_mesh(self.root_device.type))
        self._apply_timeout()

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        mesh = self.parallel_dims.dp_ep_mesh
        return {"num_replicas": mesh.size(), "rank": mesh.get_local_rank()}

    # -- model -------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.model is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        config = self.config
        check_context_parallel_support(self.model, self.parallel_dims, config.cp_comm)
        if trainer.state.fn == TrainerFn.FITTING:
            self.step_engine.setup(trainer, self.lightning_module, self.precision_plugin)
        if not is_parallelized(self.model):
            parallelize(
                self.model,
                self.parallel_dims,
                data_parallel=config.data_parallel,
                sequence_parallel=config.sequence_parallel,
                pp_stages_per_rank=config.pp_stages_per_rank,
                pp_schedule=config.pp_schedule,
                pp_stage_layers=config.pp_stage_layers,
            )
        apply_training_plans(
            self.model,
            precision=self._precision_flag(),
            activation_checkpointing=config.activation_checkpointing,
            recompute_attention=self.parallel_dims.cp == 1,
            compile=config.compile,
        )
        materialize(self.model, self.root_device, getattr(self.lightning_module, "initial_value", None))
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)
        # Dense and expert parameters are DTensors on different meshes, which torch's clip_grad_norm_
        # cannot stack: gradient_clip_val goes through ours (norms combined over pp stages).
        plugin, stages_group = self.precision_plugin, self.step_engine.stages_group
        route_gradient_clipping(
            plugin, lambda opt, clip_val: clip_grad_norm_(plugin.main_params(opt), clip_val, group=stages_group)
        )
        self.step_engine.build(self.model, self.lightning_module, self.root_device)
        self._apply_timeout()  # groups created while parallelizing
        # A rank that issues no collective for `timeout` ends with its stacks in the run directory.
        self._hang_watchdog = hang_watchdog(
            self.process_group_timeout, Path(trainer.default_root_dir) / "stacks", self.global_rank, self.world_size
        )

    def _apply_timeout(self) -> None:
        """Every process group, mesh sub-groups included, gets ``timeout`` (torch gives sub-groups its
        30-minute default): when rank 0 dies, only this timeout ends the ranks blocked in a collective."""
        if self.process_group_timeout is not None:
            set_process_group_timeouts(self.process_group_timeout)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        module = self.lightning_module
        return self.step_engine.backward(
            partial(super().backward, closure_loss, optimizer, *args, **kwargs),
            closure_loss,
            module.trainer,
            self.precision_plugin,
            module,
        )

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """The optimizer step, then every ``MoELayer``'s expert-bias update (loads of the whole step)."""
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        update_expert_biases(self.model)
        return output

    @property
    def pp_microbatches(self) -> int:
        """Micro-batches per pipeline step: ``config.pp_microbatches``, or pp when that is None."""
        return self.config.microbatches

    @property
    def microbatches_per_step(self) -> int:
        """Loader batches each Lightning batch holds: ``pp_microbatches`` under pp > 1, else 1
        (the step engine's ``loader_batches_per_step``)."""
        return self.step_engine.loader_batches_per_step

    @override
    def process_dataloader(self, dataloader: object) -> object:
        return self.step_engine.process_dataloader(super().process_dataloader(dataloader))

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._hang_watchdog is not None:
            self._hang_watchdog.start()  # from the first batch on: set-up work may go long without collectives

    @override
    def on_exception(self, exception: BaseException) -> None:
        if self._hang_watchdog is not None and self._hang_watchdog.running:
            print(
                self._hang_watchdog.report(f"training stopped by {type(exception).__name__}"),
                file=sys.stderr,
                flush=True,
            )

    @override
    def teardown(self) -> None:
        if self._hang_watchdog is not None:
            self._hang_watchdog.stop()
        self.checkpoint_writer.wait()  # a background save finishes before the process group goes
        self.step_engine.teardown(self.lightning_module.trainer if self.lightning_module is not None else None)
        super().teardown()

    # -- steps -------------------------------------------------------------------------------------
    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        dims = self.parallel_dims
        # A module's targets that look ahead in the sequence (e.g. multi-token prediction) come from
        # whole rows, before cp shards them; under pp they travel to the last stage with the labels.
        before_sharding = getattr(self.lightning_module, "before_sequence_sharding", None)
        if before_sharding is not None:
            batch = before_sharding(batch)
        if dims.cp > 1:
            batch = shard_batch_for_context_parallel(batch, dims, self.config.context_parallel_keys)
        return batch

    def _step_context(self, batch: Any = None) -> AbstractContextManager:
        """Inside a step, causal ``F.scaled_dot_product_attention`` becomes what the layout and the batch ask:
        under cp > 1 ring attention (``cp_comm="ring"``) or all-to-all attention (``"a2a"``), masked by
        the batch's ``document_ids`` when it carries them; on one cp rank document-causal attention
        when it does, else itself."""
        dims = self.parallel_dims
        documents = batch_document_ids(batch)
        if dims.cp > 1:
            attention = (
                all_to_all_attention(dims.cp_group, document_ids=documents)
                if self.config.cp_comm == CpComm.A2A
                else context_parallel_attention(
                    dims.cp_group, head_chunks=self.config.cp_head_chunks, document_ids=documents
                )
            )
        elif documents is not None:
            attention = document_attention(documents)
        else:
            return nullcontext()
        return packed_documents(attention, documents, dims.tp_mesh.get_local_rank(), dims.tp)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        assert module is not None
        batch = args[0] if args else kwargs.get("batch")
        return self.step_engine.training_step(
            partial(super().training_step, *args, **kwargs),
            batch,
            module.trainer,
            self.optimizers,
            module,
            partial(self._step_context, batch),
        )

    def _eval_step(self, hook: str, *args: Any, **kwargs: Any) -> Any:
        """The module's own evaluation step: under pp > 1 ``self(...)`` runs the whole model through the
        stages (output on every rank); under cp > 1 ``predict_step`` outputs come back whole, in token order."""
        assert self.lightning_module is not None
        step = getattr(super(), hook)
        batch = args[0] if args else kwargs.get("batch")
        with self._step_context(batch), self.step_engine.eval_context(self.lightning_module):
            output = step(*args, **kwargs)
        if hook == "predict_step" and self.parallel_dims.cp > 1:
            if isinstance(batch, dict) and isinstance(batch.get("input_ids"), torch.Tensor):
                output = gather_sequence_outputs(output, batch["input_ids"].shape[1], self.parallel_dims.cp_group)
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("predict_step", *args, **kwargs)

    # -- checkpoints -------------------------------------------------------------------------------
    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None = None
    ) -> None:
        """Write into a staging path, mark it complete, then swap it in: a crash mid-save leaves the
        previous checkpoint. With ``async_checkpoint`` the files are written in the background.

        The checkpoint is layout-free (see :mod:`lightning_moe.checkpoint.state`): any valid layout
        of the same model resumes it on the same curve.
        """
        assert self.lightning_module is not None
        add_strategy_state(checkpoint, self.parallel_dims, self.lightning_module.trainer.accumulate_grad_batches)
        path = Path(self.broadcast(str(filepath)))
        if not self.config.save_distributed_checkpoint:
            save_file_atomically(
                path,
                lambda staging: super(MoE5DStrategy, self).save_checkpoint(checkpoint, staging, storage_options),
                is_global_zero=self.is_global_zero,
                barrier=self.barrier,
            )
            return
        tensors, metadata = split_checkpoint(checkpoint)
        self.checkpoint_writer.save(
            tensors,
            metadata,
            path,
            global_step=checkpoint.get("global_step", 0),
            is_global_zero=self.is_global_zero,
            barrier=self.barrier,
        )

    @override
    def remove_checkpoint(self, filepath: str | Path) -> None:
        """Rank 0 deletes an old checkpoint (``ModelCheckpoint``'s keep-last-K), once the save in flight is committed."""
        if self.is_global_zero:
            self.checkpoint_writer.remove(Path(filepath))

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        # One form under every layout: each parameter's state and group options under its name in
        # the whole model (DCP writes non-tensor entries once, from rank 0, and pipeline stages hold
        # different parameters, so a nested param_groups list could not hold them all).
        return optimizer_state_dict(
            self.model,
            optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer,
            full=not self.config.save_distributed_checkpoint,
        )

    @override
    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a complete checkpoint written under any layout; never unpickles code (``weights_only`` is always on)."""
        path = Path(self.broadcast(str(resolve_checkpoint_path(checkpoint_path))))
        try:
            require_complete(path)
        except ValueError as err:
            raise MisconfigurationException(str(err)) from err
        assert self.model is not None and self.lightning_module is not None
        if path.is_file():  # one file of whole tensors (save_distributed_checkpoint=False)
            contents = load_one_file_checkpoint(
                self.model, self.optimizers, path, strict=self.lightning_module.strict_loading
            )
            restore_strategy_state(contents, self.lightning_module.trainer.accumulate_grad_batches)
            return contents
        metadata = read_metadata(path)
        load_model_and_optimizers(
            self.model,
            self.optimizers,
            path,
            complete=self.step_engine.stages_group is None,
            strict=self.lightning_module.strict_loading,
        )
        restore_strategy_state(metadata, self.lightning_module.trainer.accumulate_grad_batches)
        return metadata

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="lightning-moe 5D parallel strategy (tp, cp, ep, dp, pp)"
        )


def register() -> None:
    """Register ``"moe5d"`` in Lightning's StrategyRegistry (idempotent)."""
    if MoE5DStrategy.strategy_name not in StrategyRegistry:
        MoE5DStrategy.register_strategies(StrategyRegistry)


__all__ = ["MoE5DStrategy", "auto_layout", "register"]

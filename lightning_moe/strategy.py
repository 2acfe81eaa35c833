"""``MoE5DStrategy``: Lightning glue for tensor, context, expert, data and pipeline parallelism."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ModelParallelStrategy, ParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_moe.cp import context_parallel_attention
from lightning_moe.moe import set_aux_loss_scale
from lightning_moe.parallel.context_parallel import check_context_parallel_support, shard_batch_for_context_parallel
from lightning_moe.parallel.dims import ParallelDims
from lightning_moe.parallel.grad_norm import clip_grad_norm_
from lightning_moe.parallel.parallelize import DATA_PARALLEL_KINDS, is_parallelized, parallelize

_STAGING_SUFFIX = ".staging"
_PREVIOUS_SUFFIX = ".previous"


class MoE5DStrategy(ModelParallelStrategy):
    """Train any LightningModule with tensor, context, expert, data and pipeline parallelism.

    ``world_size = tp * cp * ep * dp * pp``; ``dp="auto"`` takes what is left. The strategy builds
    the ``(pp, dp, ep, cp, tp)`` DeviceMesh, calls ``configure_model()``, then
    :func:`lightning_moe.parallelize` unless the module already parallelized itself, splits samples
    over ``dp x ep`` and saves distributed (DCP) checkpoints atomically.

    Example::

        import lightning as L
        import lightning_moe  # registers "moe5d"
        trainer = L.Trainer(accelerator="cpu", devices=4, strategy=lightning_moe.MoE5DStrategy(ep=2))
        trainer.fit(lightning_moe.models.MoEGPT(), datamodule=lightning_moe.data.ByteTextDataModule())

    Args:
        tp, cp, ep, pp: tensor, context, expert and pipeline parallel sizes.
        dp: data parallel size, or ``"auto"`` for ``world_size // (tp*cp*ep*pp)``.
        etp: expert tensor parallel size, 1 or ``tp`` (default ``tp``).
        data_parallel: ``"fsdp"`` (FSDP2 ``fully_shard``), ``"ddp"`` (replication) or ``"none"``.
        sequence_parallel: keep activations outside TP regions sharded on the sequence.
        context_parallel_keys: batch keys to shard on the sequence under cp > 1, besides
            ``input_ids``, ``labels``, ``loss_mask`` and ``position_ids``.
        process_group_backend: ``"gloo"``/``"nccl"``; default from the device.
        timeout: process-group timeout.
        save_distributed_checkpoint: save a sharded DCP folder (True) or one full file on rank 0.
    """

    strategy_name = "moe5d"

    def __init__(
        self,
        tp: int = 1,
        cp: int = 1,
        ep: int = 1,
        dp: int | Literal["auto"] = "auto",
        pp: int = 1,
        etp: int | None = None,
        data_parallel: Literal["fsdp", "ddp", "none"] = "fsdp",
        sequence_parallel: bool = True,
        context_parallel_keys: Sequence[str] = (),
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        save_distributed_checkpoint: bool = True,
    ) -> None:
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        if data_parallel not in DATA_PARALLEL_KINDS:
            raise MisconfigurationException(f"data_parallel={data_parallel!r} must be one of {DATA_PARALLEL_KINDS}")
        if dp != "auto" and (not isinstance(dp, int) or dp < 1):
            raise MisconfigurationException(f"dp={dp!r} must be a positive integer or 'auto'")
        try:
            self.parallel_dims = ParallelDims(tp=tp, cp=cp, ep=ep, dp=-1 if dp == "auto" else dp, pp=pp, etp=etp)
        except ValueError as err:
            raise MisconfigurationException(str(err)) from err
        for name in ("pp",):
            if getattr(self.parallel_dims, name) > 1:
                raise MisconfigurationException(
                    f"{name}={getattr(self.parallel_dims, name)}: {name} > 1 is not supported yet by MoE5DStrategy;"
                    f" set {name}=1"
                )
        self.data_parallel = data_parallel
        self.sequence_parallel = sequence_parallel
        self.context_parallel_keys = tuple(context_parallel_keys)

    # -- launch and mesh ---------------------------------------------------------------------------
    @override
    def _configure_launcher(self) -> None:
        # Runs once devices and nodes are known, before any process starts: fail fast on bad sizes.
        try:
            self.parallel_dims.validate(self.num_nodes * self.num_processes)
        except ValueError as err:
            raise MisconfigurationException(
                f"{err} (devices={self.num_processes}, num_nodes={self.num_nodes})"
            ) from err
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        ParallelStrategy.setup_environment(self)
        self._setup_distributed()
        self.parallel_dims.validate(self.world_size)
        self._device_mesh = self.parallel_dims.build_mesh(self.root_device.type)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

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
        check_context_parallel_support(self.model, self.parallel_dims)
        if not is_parallelized(self.model):
            parallelize(
                self.model,
                self.device_mesh,
                data_parallel=self.data_parallel,
                sequence_parallel=self.sequence_parallel,
                etp=self.parallel_dims.etp,
            )
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        # Dense and expert parameters are DTensors on different meshes, which torch's
        # clip_grad_norm_ cannot stack: Lightning's gradient_clip_val goes through ours.
        plugin = self.precision_plugin
        plugin.clip_grad_by_norm = lambda optimizer, clip_val: clip_grad_norm_(plugin.main_params(optimizer), clip_val)

    # -- steps -------------------------------------------------------------------------------------
    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        if self.parallel_dims.cp > 1:
            batch = shard_batch_for_context_parallel(batch, self.parallel_dims, self.context_parallel_keys)
        return batch

    def _step_context(self) -> AbstractContextManager:
        """Inside a step under cp > 1, ``F.scaled_dot_product_attention`` becomes ring attention."""
        if self.parallel_dims.cp > 1:
            return context_parallel_attention(self.parallel_dims.cp_group)
        return nullcontext()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        # Lightning divides the task loss by the accumulation count; the MoE aux losses follow. Each
        # cp rank holds a partial aux loss (the cp ranks' parts sum to the micro-batch's) while
        # gradients are averaged over cp, hence the factor cp.
        assert self.lightning_module is not None
        set_aux_loss_scale(self.parallel_dims.cp / self.lightning_module.trainer.accumulate_grad_batches)
        with self._step_context():
            return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._step_context():
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._step_context():
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._step_context():
            return super().predict_step(*args, **kwargs)

    # -- checkpoints -------------------------------------------------------------------------------
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Write into a staging path, then swap it in: a crash mid-save leaves the previous checkpoint."""
        path = Path(self.broadcast(str(filepath)))
        staging = path.with_name(path.name + _STAGING_SUFFIX)
        previous = path.with_name(path.name + _PREVIOUS_SUFFIX)
        if self.is_global_zero:
            _remove(staging)
        self.barrier()
        super().save_checkpoint(checkpoint, staging, storage_options)
        self.barrier()
        if self.is_global_zero:
            _remove(previous)
            if path.exists():
                path.rename(previous)
            staging.rename(path)
            _remove(previous)
        self.barrier()

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(checkpoint_path)
        previous = path.with_name(path.name + _PREVIOUS_SUFFIX)
        if not path.exists() and previous.exists():
            # A save was interrupted between the two renames: the previous checkpoint is complete.
            path = previous
        return super().load_checkpoint(path, weights_only=weights_only)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="lightning-moe 5D parallel strategy (tp, cp, ep, dp, pp)")


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def register() -> None:
    """Register ``"moe5d"`` in Lightning's StrategyRegistry (idempotent)."""
    if MoE5DStrategy.strategy_name not in StrategyRegistry:
        MoE5DStrategy.register_strategies(StrategyRegistry)


__all__ = ["MoE5DStrategy", "register"]

"""Lightning internals: ModelParallelStrategy's private methods and attributes, the fit loop's
counters, the logger connector, the LightningModule's trainer, the rich progress bar's title,
the precision plugin's gradient clipping, and fabric's private helpers.

Floors: lightning >= 2.6 (what the suite runs; ModelParallelStrategy internals).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy, ParallelStrategy
from torch import nn


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


def attached_trainer_or_none(obj: Any) -> Any:
    """The ``Trainer`` ``obj`` is attached to, or None when it is detached or is no LightningModule
    (a plain transformers model, say): the private ``LightningModule._trainer``, read with a default.
    Checked on: lightning 2.6-2.6."""
    return getattr(obj, "_trainer", None)


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


# Set while replay_training_batch re-runs a batch of an optimizer step: whether that batch is the step's last.
_REPLAYED_BATCH_STEPS_OPTIMIZER: bool | None = None


def optimizer_steps_after_this_batch(trainer: Any) -> bool:
    """Whether Lightning's fit loop steps the optimizers after the current training batch (the last
    micro-batch of an accumulation window, or the epoch's last batch): the negation of the private
    ``trainer.fit_loop.epoch_loop._should_accumulate()``, valid from ``training_step`` on, which
    Lightning itself uses to skip DDP's gradient sync. While :func:`replay_training_batch` runs,
    what it was told. Checked on: lightning 2.6-2.6."""
    if _REPLAYED_BATCH_STEPS_OPTIMIZER is not None:
        return _REPLAYED_BATCH_STEPS_OPTIMIZER
    return not trainer.fit_loop.epoch_loop._should_accumulate()


def replay_training_batch(
    trainer: Any, batch: Any, batch_idx: int, optimizer: Any, steps_optimizer: bool
) -> torch.Tensor | None:
    """Run one training batch again as Lightning's automatic optimization runs it: the strategy's
    ``training_step`` (its hooks and ``self.log`` allowed), the loss divided by
    ``accumulate_grad_batches``, the strategy's ``backward``. ``steps_optimizer``: the batch is the
    last of its optimizer step (:func:`optimizer_steps_after_this_batch` says so meanwhile). Returns
    the loss as ``training_step`` returned it (detached), None when it returned none. The optimizer
    does not step. Uses the private ``lightning.pytorch.trainer.call._call_strategy_hook``, which sets
    the module's current hook name as the loop does. Checked on: lightning 2.6-2.6."""
    from lightning.pytorch.trainer import call

    global _REPLAYED_BATCH_STEPS_OPTIMIZER
    _REPLAYED_BATCH_STEPS_OPTIMIZER = steps_optimizer
    try:
        output = call._call_strategy_hook(trainer, "training_step", batch, batch_idx)
        loss = output.get("loss") if isinstance(output, Mapping) else output
        if loss is None:
            return None
        call._call_strategy_hook(trainer, "backward", loss / trainer.accumulate_grad_batches, optimizer)
        return loss.detach()
    finally:
        _REPLAYED_BATCH_STEPS_OPTIMIZER = None


def route_gradient_clipping(plugin: Any, clip_by_norm: Callable[[Any, float], None]) -> None:
    """Make Lightning's ``gradient_clip_val`` (``gradient_clip_algorithm="norm"``) call
    ``clip_by_norm(optimizer, clip_val)``: Lightning's ``Precision.clip_gradients`` calls the
    plugin's ``clip_grad_by_norm``, which is replaced on this plugin instance (there is no strategy
    hook for it). Checked on: lightning 2.6-2.6."""
    plugin.clip_grad_by_norm = clip_by_norm


def rewind_saved_logging_step(epoch_loop_state: MutableMapping[str, Any]) -> None:
    """Lower by one the step Lightning logs at (:func:`trainer_logging_step`) in a saved checkpoint's
    ``loops.fit_loop["epoch_loop.state_dict"]``: its private ``_batches_that_stepped`` key, left alone
    where absent. Checked on: lightning 2.6-2.6."""
    if "_batches_that_stepped" in epoch_loop_state:
        epoch_loop_state["_batches_that_stepped"] -= 1

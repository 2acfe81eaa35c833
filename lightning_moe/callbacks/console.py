"""What a training run shows on the console: a step-counting progress bar and a model summary without FLOPs.

Lightning's defaults read oddly for step-bounded MoE runs: its ``RichProgressBar`` titles the bar
``Epoch 0/-2`` when only ``max_steps`` bounds the run, and counts loader batches against
``max_steps`` (``240/30`` under gradient accumulation); its ``RichModelSummary`` prints a FLOPs
column that is 0 unless the module sets ``example_input_array`` (a dense forward the sharded
model cannot run on one rank anyway). ``python -m lightning_moe.train`` uses both classes below.

Example::

    from lightning_moe.callbacks import ParameterSummary, StepProgressBar

    trainer = L.Trainer(max_steps=200, strategy="moe5d", callbacks=[StepProgressBar(), ParameterSummary()])
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichModelSummary, RichProgressBar
from lightning.pytorch.utilities.model_summary.model_summary import get_formatted_model_size, get_human_readable_count
from lightning.pytorch.utilities.types import STEP_OUTPUT

from lightning_moe._compat import TitledRichProgressBar


def counts_optimizer_steps(trainer: pl.Trainer) -> bool:
    """Whether only ``max_steps`` bounds the run (Lightning sets ``max_epochs=-1`` then)."""
    return trainer.max_epochs in (None, -1) and trainer.max_steps is not None and trainer.max_steps > 0


class StepProgressBar(TitledRichProgressBar):
    """Lightning's ``RichProgressBar``, counting optimizer steps against ``max_steps`` when only
    ``max_steps`` bounds the run: ``Step ━━━━ 40/200``, whatever ``accumulate_grad_batches`` is, on
    one bar across epochs, starting from the resumed step after ``ckpt_path``. Runs bounded by
    ``max_epochs`` get Lightning's own bar (``Epoch 3/9``, loader batches of the epoch).

    Same arguments as ``RichProgressBar`` (``refresh_rate``, ``leave``, ``theme``, ``console_kwargs``).

    Example::

        trainer = L.Trainer(max_steps=200, accumulate_grad_batches=8, callbacks=[StepProgressBar()])
    """

    @property
    def total_train_batches(self) -> int | float:
        if counts_optimizer_steps(self.trainer):
            return self.trainer.max_steps
        return super().total_train_batches

    def train_bar_title(self, current_epoch: int) -> str:
        if counts_optimizer_steps(self.trainer):
            # Padded like Lightning's title, so that the bar does not move when validation starts.
            return f"{'Step':{len(self.validation_description)}}"
        return super().train_bar_title(current_epoch)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if counts_optimizer_steps(trainer) and self.train_progress_bar_id is not None:
            return  # one bar for the whole run: a new epoch does not reset the step count
        super().on_train_epoch_start(trainer, pl_module)
        if counts_optimizer_steps(trainer) and self.progress is not None and self.train_progress_bar_id is not None:
            self.progress.update(self.train_progress_bar_id, completed=trainer.global_step)  # a resumed run

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: STEP_OUTPUT, batch: Any, batch_idx: int
    ) -> None:
        if counts_optimizer_steps(trainer):
            # The parent sets the bar to batch_idx + 1: hand it the optimizer steps done instead.
            # Micro-batches that step no optimizer leave the count (and the steps/s rate) unchanged.
            batch_idx = trainer.global_step - 1
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


def use_lightning_moe_displays(trainer: pl.Trainer) -> None:
    """Turn the ``RichProgressBar`` and ``RichModelSummary`` that Lightning adds by default (a
    Trainer given no progress bar or summary) into :class:`StepProgressBar` and
    :class:`ParameterSummary`, keeping their settings.

    Matches the exact Lightning types only, so subclasses and other bars are left alone; a
    ``RichProgressBar`` passed explicitly looks the same as a default one and is turned too (its
    epoch-bounded display is unchanged). The subclasses add methods and no state, so each instance
    changes class in place: its settings stay, and so does every reference to it
    (``trainer.progress_bar_callback``). ``MoE5DStrategy`` can call this when it connects the model.

    Example::

        trainer = L.Trainer(max_steps=100)
        use_lightning_moe_displays(trainer)
        type(trainer.progress_bar_callback).__name__  # 'StepProgressBar'
    """
    for callback in trainer.callbacks:
        if type(callback) is RichProgressBar:
            callback.__class__ = StepProgressBar
        elif type(callback) is RichModelSummary:
            callback.__class__ = ParameterSummary


class ParameterSummary(RichModelSummary):
    """Lightning's ``RichModelSummary`` without the FLOPs column and the ``Total FLOPs`` line.

    Lightning counts FLOPs only with an ``example_input_array`` and prints 0 otherwise; for an MoE
    model the useful figure is per token and active experts only, which
    :class:`~lightning_moe.callbacks.ThroughputCallback` logs (``perf/model_flops_per_second``) and
    writes to ``summary.json`` (``model_flops_per_token``).

    Example::

        trainer = L.Trainer(callbacks=[ParameterSummary(max_depth=2)])
    """

    @staticmethod
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        from rich import get_console
        from rich.table import Table

        columns = [(name, values) for name, values in summary_data if name != "FLOPs"]
        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        for name, _ in columns:
            if name == " ":
                table.add_column(name, style="dim")
            elif name in ("Name", "Type", "Mode"):
                table.add_column(name, justify="left", no_wrap=name == "Name")
            else:  # counts and sizes
                table.add_column(name, justify="right")
        for row in zip(*(values for _, values in columns)):
            table.add_row(*row)

        grid = Table.grid(expand=True)
        grid.add_column()
        frozen = total_parameters - trainable_parameters
        grid.add_row(f"[bold]Trainable params[/]: {get_human_readable_count(int(trainable_parameters))}")
        grid.add_row(f"[bold]Non-trainable params[/]: {get_human_readable_count(int(frozen))}")
        grid.add_row(f"[bold]Total params[/]: {get_human_readable_count(int(total_parameters))}")
        grid.add_row(f"[bold]Total estimated model params size (MB)[/]: {get_formatted_model_size(model_size)}")
        grid.add_row(f"[bold]Modules in train mode[/]: {total_training_modes['train']}")
        grid.add_row(f"[bold]Modules in eval mode[/]: {total_training_modes['eval']}")

        console = get_console()
        console.print(table)
        console.print(grid)

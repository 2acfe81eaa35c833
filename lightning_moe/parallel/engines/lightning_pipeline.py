"""Pipeline parallelism inside Lightning's loops: the step engine of pp > 1.

Lightning calls ``training_step``, then ``backward``, per Lightning batch. Under pp > 1 one Lightning
batch holds ``pp_microbatches`` loader batches and the schedule runs forward *and* backward of all
of them inside ``training_step``. :class:`PipelineEngine` keeps Lightning's contract around that:

- gradient accumulation: the batch plan counts loader micro-batches; Lightning accumulates that
  many over ``pp_microbatches`` Lightning batches (:class:`~lightning_moe.parallel.engines.step_engine.StepEngine`);
- gradients: Lightning zeroes gradients *after* ``training_step`` and before its backward, so the
  schedule's gradients are stashed and added back in ``backward``, as Lightning's backward would;
- scaling: each micro-batch is ``1 / (pp_microbatches * accumulation)`` of the optimizer step, for
  the task loss and the MoE aux losses alike;
- FSDP: with ``gather_once_per_step`` each unit is gathered in the optimizer step's first pipeline
  step and its gradients reduced in the last (:class:`~lightning_moe.parallel.engines.pipeline_runner.PipelineRunner`);
- evaluation: inside ``validation_step``/``test_step``/``predict_step``, ``self(...)`` runs the
  whole model through the stages (:meth:`PipelineRunner.forward_only`).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_moe._compat import optimizer_steps_after_this_batch
from lightning_moe.moe import set_aux_loss_scale
from lightning_moe.parallel.dims import ParallelDims
from lightning_moe.parallel.engines.pipeline_runner import PipelineRunner
from lightning_moe.parallel.engines.step_engine import StepEngine
from lightning_moe.parallel.plans.pipeline import (
    GroupedBatchLoader,
    check_pipeline_config,
    pipeline_batch,
    pipeline_stage_modules,
    unpack_target,
    unpack_target_loss,
)

__all__ = ["PipelineEngine", "forward_through_pipeline"]


class PipelineEngine(StepEngine):
    """The pipeline schedule of a Lightning run, with Lightning's accumulation and gradient contract.

    Example (what ``MoE5DStrategy`` does under ``pp > 1``)::

        engine = PipelineEngine(dims, schedule="1F1B", microbatches=4, stages_per_rank=1)
        engine.setup(trainer, module, precision_plugin)        # checks the module and the batch plan
        engine.build(model, module, device)                    # after parallelize
        loss = engine.training_step(step, batch, trainer, optimizers, module, step_context)  # forward + backward
        engine.backward(backward, loss, trainer, precision_plugin, module)   # gradients back in place
    """

    def __init__(
        self,
        dims: ParallelDims,
        schedule: str,
        microbatches: int,
        stages_per_rank: int,
        overlap_ep_comm: bool = False,
        gather_once_per_step: bool = False,
    ) -> None:
        check_pipeline_config(dims.pp, schedule, microbatches, stages_per_rank)
        super().__init__()
        self.dims = dims
        self.overlap_ep_comm = overlap_ep_comm
        self.gather_once_per_step = gather_once_per_step
        self.schedule = schedule
        self.microbatches = microbatches
        self.stages_per_rank = stages_per_rank
        self.runner: PipelineRunner | None = None
        self._stashed_grads: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None
        self._precision: Any = None
        self._term_names: tuple[str, ...] = ("loss",)
        self._step_terms: list[torch.Tensor] = []

    @property
    def stages_group(self) -> torch.distributed.ProcessGroup:  # type: ignore[override]
        """The pp group: every stage holds part of the model."""
        return self.dims.pp_group

    @property
    def loader_batches_per_step(self) -> int:  # type: ignore[override]
        """Each Lightning batch runs ``pp_microbatches`` loader micro-batches through the schedule."""
        return self.microbatches

    # -- setup and teardown ------------------------------------------------------------------------
    def setup(self, trainer: Any, module: Any, precision_plugin: Any) -> None:
        """Before fitting: refuse what the schedule cannot run, and a batch plan that does not fill
        whole pipeline steps."""
        if not callable(getattr(module, "loss_from_logits", None)):
            raise MisconfigurationException(
                f"pp={self.dims.pp} > 1: {type(module).__name__} needs a method"
                " loss_from_logits(output, labels, loss_mask=None, loss_token_count=None) returning the mean loss"
                " of one micro-batch from the last stage's output (the strategy runs the pipeline schedule"
                " instead of training_step)"
            )
        if getattr(precision_plugin, "scaler", None) is not None:
            raise MisconfigurationException(
                "pp > 1 with a gradient scaler (precision='16-mixed') is not supported: the pipeline runs"
                " backward itself; use precision='bf16-mixed' or '32-true'"
            )
        accumulation = self.accumulation if self.accumulation is not None else self._user_value(trainer)
        if accumulation % self.microbatches:
            raise MisconfigurationException(
                f"accumulate_grad_batches {accumulation} (micro-batches per optimizer step and rank) is not divisible by"
                f" pp_microbatches={self.microbatches}: every pipeline step runs pp_microbatches micro-batches"
            )
        self._precision = precision_plugin
        super().setup(trainer, module, precision_plugin)

    def build(self, model: nn.Module, module: Any, device: torch.device) -> None:
        """This rank's stages of the parallelized ``model`` under the schedule; ``module`` gives the loss."""
        stages = pipeline_stage_modules(model)
        if stages is None:
            raise MisconfigurationException(
                f"pp={self.dims.pp} > 1 but the module was parallelized without a pipeline split:"
                " let the strategy parallelize it, or call lightning_moe.parallelize(..., pp_stages_per_rank=...)"
                " in configure_model"
            )
        cp = self.dims.cp
        # A module whose objective has several terms (MoEGPT's multi-token prediction) computes them
        # from the last stage's output; each is logged like the objective.
        terms_from_output = getattr(module, "loss_terms_from_output", None)
        self._term_names = tuple(getattr(module, "loss_term_names", ("loss",)))

        def loss(output: Any, target: torch.Tensor) -> torch.Tensor:
            if terms_from_output is None:
                return unpack_target_loss(module.loss_from_logits, output, target, cp)
            objective, terms = terms_from_output(output, unpack_target(target, cp))
            self._step_terms.append(torch.stack([terms[name].detach().float() for name in self._term_names]))
            return objective

        self.runner = PipelineRunner(
            stages,
            num_stages=self.dims.pp * self.stages_per_rank,
            group=self.dims.pp_group,
            device=device,
            schedule=self.schedule,
            microbatches=self.microbatches,
            loss_fn=loss,
            overlap_ep_comm=self.overlap_ep_comm,
            gather_once_per_step=self.gather_once_per_step,
        )

    def process_dataloader(self, dataloader: object) -> GroupedBatchLoader:
        """``pp_microbatches`` loader batches per Lightning batch."""
        return GroupedBatchLoader(dataloader, self.microbatches)

    # -- steps -------------------------------------------------------------------------------------
    def training_step(
        self,
        step: Callable[[], Any],
        batch: Any,
        trainer: Any,
        optimizers: list[torch.optim.Optimizer],
        module: Any,
        step_context: Callable[[], contextlib.AbstractContextManager],
    ) -> Any:
        """Forward and backward of every micro-batch of ``batch`` by the schedule (the module's own
        ``step`` does not run): the mean loss on every rank, logged as ``train/loss`` (with several
        loss terms, ``loss_term_names``, each term ``train/<name>``, and the objective returned).

        The gradients of the ``optimizers``' parameters (``module``'s without optimizers) are
        stashed until :meth:`backward`.
        """
        with step_context(), self._precision.train_step_context():
            loss, size = self._schedule_step(
                batch, trainer.accumulate_grad_batches, optimizers, module, optimizer_steps_after_this_batch(trainer)
            )
        terms = {"loss": loss}
        if self._term_names != ("loss",):
            runner = self._built()
            means = runner.broadcast_mean(
                self._step_terms if runner.holds_last_stage else None, (len(self._term_names),)
            )
            terms = dict(zip(self._term_names, means.unbind()))
        for name, value in terms.items():
            module.log(f"train/{name}", value, prog_bar=name == "loss", on_step=True, on_epoch=False, batch_size=size)
        return loss

    def _schedule_step(
        self,
        batch: Any,
        accumulate_grad_batches: int,
        optimizers: Sequence[torch.optim.Optimizer],
        module: nn.Module,
        steps_optimizer: bool,
    ) -> tuple[torch.Tensor, int]:
        runner = self._built()
        inputs, kwargs, target = pipeline_batch(
            batch,
            self.microbatches,
            with_positions="position_ids" in runner.forward_kwargs,
            with_sample_index="sample_index" in runner.forward_kwargs,
            cp_group=self.dims.cp_group if self.dims.cp > 1 else None,
        )
        self._restore_gradients()  # a previous step's gradients, if its backward never ran
        # Lightning zeroes gradients *after* training_step, before its backward: the schedule must
        # not add to the previous gradients, whose fate (zeroed or kept) is decided later.
        previous = [(p, p.grad) for p in _optimized_parameters(optimizers, module)]
        for param, _ in previous:
            param.grad = None
        grad_scale = 1.0 / (accumulate_grad_batches * self.microbatches)
        # Each cp rank holds a partial aux loss while gradients are averaged over cp: hence the factor cp.
        set_aux_loss_scale(self.dims.cp * grad_scale)
        self._step_terms = []
        losses = runner.step(inputs, kwargs, target, train=True, grad_scale=grad_scale, steps_optimizer=steps_optimizer)
        loss = runner.broadcast_mean(losses)
        self._stashed_grads = [(p, p.grad) for p, _ in previous]
        for param, grad in previous:
            param.grad = grad
        return loss, inputs[0].shape[0]

    def backward(
        self, backward: Callable[[], Any], closure_loss: torch.Tensor, trainer: Any, precision_plugin: Any, module: Any
    ) -> torch.Tensor:
        """The schedule already ran backward inside ``training_step``: only the precision hooks run, and
        the stashed gradients go back in place."""
        closure_loss = precision_plugin.pre_backward(closure_loss, module)
        self._restore_gradients()
        return precision_plugin.post_backward(closure_loss, module)

    def _restore_gradients(self) -> None:
        """Add the stashed gradients of the last training step, as Lightning's backward would."""
        if self._stashed_grads is None:
            return
        for param, grad in self._stashed_grads:
            if grad is not None:
                param.grad = grad if param.grad is None else param.grad + grad
        self._stashed_grads = None

    def _built(self) -> PipelineRunner:
        if self.runner is None:
            raise RuntimeError("PipelineEngine.build(model, module, device) must run before the first step")
        return self.runner

    def eval_context(self, module: nn.Module) -> contextlib.AbstractContextManager:
        """Within the block, ``module(...)`` runs the whole model through the stages (once built:
        evaluation outside ``fit`` runs the module as it is)."""
        return forward_through_pipeline(module, self.runner) if self.runner is not None else contextlib.nullcontext()


@contextlib.contextmanager
def forward_through_pipeline(module: nn.Module, runner: PipelineRunner) -> Iterator[None]:
    """Within the block, ``module(...)`` (its ``forward``) runs the whole model through the pipeline
    (:meth:`PipelineRunner.forward_only`): the first forward argument goes to the first stage, the
    others to every stage; the last stage's output comes back on every rank of the pp group."""
    signature = inspect.signature(type(module).forward)
    signature = signature.replace(parameters=list(signature.parameters.values())[1:])  # drop self

    def forward(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        names = list(bound.arguments)
        rest = {k: bound.arguments[k] for k in names[1:] if bound.arguments[k] is not None}
        # The stage may be ``module`` itself (one stage per rank, trimmed in place): its own forward
        # must run inside the schedule.
        del module.forward
        try:
            return runner.forward_only(bound.arguments[names[0]], **rest)
        finally:
            module.forward = forward  # type: ignore[method-assign]

    module.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        if "forward" in module.__dict__:
            del module.forward


def _optimized_parameters(optimizers: Sequence[torch.optim.Optimizer], module: nn.Module) -> list[torch.Tensor]:
    """The optimizers' parameters (FSDP's sharded ones, whatever state the modules are in)."""
    params = {id(p): p for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]}
    return list(params.values()) if params else list(module.parameters())

"""``ParallelHooks``: the optional methods and attributes of a user's LightningModule that
:class:`~lightning_moe.MoE5DStrategy` and :func:`~lightning_moe.parallelize` look up.

Every member is optional: a module defines only those its layout needs (docs/own-module.md has a
table of when each is needed). The strategy finds them by name (``getattr``), so the Protocol is the
typed list of the names and signatures, for readers and type checkers, not a base class to derive
from and not checked at run time.

Example::

    class MyModule(L.LightningModule):   # structurally a ParallelHooks for what it defines
        pipeline_layers_attr = "blocks"

        def tensor_parallel_plan(self, sequence_parallel: bool) -> dict[str, ParallelStyle]:
            return {"blocks.*.attn.q_proj": ColwiseParallel(), "blocks.*.attn.o_proj": RowwiseParallel()}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["ParallelHooks"]


class ParallelHooks(Protocol):
    """The optional hooks of a module trained under ``moe5d`` (each looked up by name; all optional).

    Attributes:
        pipeline_layers_attr: the attribute holding the blocks, an ``nn.ModuleList`` or ``nn.ModuleDict``
            (default ``"layers"``): the pipeline splits it into stages and FSDP wraps each block.
        pipeline_first_stage_modules: the children only the first pipeline stage keeps (default
            ``("tok_embeddings",)``); on other stages they are None.
        pipeline_last_stage_modules: the children only the last stage keeps (default ``("norm", "output")``).
        pipeline_stage_layers: the block keys of each pipeline stage, ``[[keys of stage 0], ...]``, instead
            of an even split.
        loss_term_names: under pp > 1 with ``loss_terms_from_output``, the names of its terms (default
            ``("loss",)``), each logged like the objective.
    """

    pipeline_layers_attr: str
    pipeline_first_stage_modules: Sequence[str]
    pipeline_last_stage_modules: Sequence[str]
    pipeline_stage_layers: Sequence[Sequence[str]]
    loss_term_names: Sequence[str]

    def tensor_parallel_plan(self, sequence_parallel: bool) -> Mapping[str, ParallelStyle]:
        """tp > 1: ``{module-name pattern: ParallelStyle}`` applied with ``parallelize_module`` (``*``
        patterns such as ``"blocks.*.attn.q_proj"`` work). The form without ``sequence_parallel`` is
        accepted too; this one receives the strategy's ``sequence_parallel``."""
        ...

    def pipeline_split(self, stage_index: int, num_stages: int) -> nn.Module:
        """pp > 1: the module of stage ``stage_index`` of ``num_stages`` (sharing parameters with this
        module), for stages the block-list convention (``pipeline_layers_attr``) cannot express."""
        ...

    def loss_from_logits(
        self, output: Any, labels: torch.Tensor, loss_mask: torch.Tensor | None = None, loss_token_count: Any = None
    ) -> torch.Tensor:
        """pp > 1 (required there): the mean loss of one micro-batch from the last stage's ``output``;
        the pipeline schedule runs instead of ``training_step``."""
        ...

    def loss_terms_from_output(
        self, output: Any, targets: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, Mapping[str, torch.Tensor]]:
        """pp > 1, an objective of several terms (``MoEGPT``'s multi-token prediction): the objective and
        ``{name: term}`` for each of ``loss_term_names``, from the last stage's output and the
        micro-batch's targets (``labels``, ``loss_mask``, ...); used instead of ``loss_from_logits`` when defined."""
        ...

    def before_sequence_sharding(self, batch: Any) -> Any:
        """Called on each batch (on the device) before cp shards it on the sequence: for targets that
        look ahead in the whole rows (add their keys to ``context_parallel_keys``). Runs under every cp."""
        ...

    def initial_value(self, name: str, tensor: torch.Tensor, index: tuple[slice, ...]) -> torch.Tensor:
        """Meta-device init: the block ``index`` (slices of the global shape) of the initial value of
        parameter or buffer ``name`` (its name in the whole model), so every layout starts from the
        single-process values (:func:`lightning_moe.parallel.plans.init.materialize_sharded`)."""
        ...

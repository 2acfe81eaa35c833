"""Activation checkpointing for any module with a block list (``"none"``, ``"full"``, ``"selective"``).

- ``"full"``: each transformer block (the module's block list, see
  :mod:`lightning_moe.parallel.plans.blocks`) keeps only its inputs; backward runs its forward again,
  MoE dispatch included.
- ``"selective"``: inside each block only the MoE expert FFNs (``MoELayer.experts``: the grouped
  GEMMs between dispatch and combine) and the attention core (``F.scaled_dot_product_attention``)
  are recomputed. The dispatch and combine all-to-alls, the router and the aux losses run once per
  forward, so the ep all-to-all count per step is the one without checkpointing. Under context
  parallelism the attention core is ring attention, whose recomputation would send K/V around the
  ring again: there it is not recomputed.

Both use torch's non-reentrant ``torch.utils.checkpoint.checkpoint`` (what ``checkpoint_wrapper``
runs), applied by replacing the ``forward`` of the block (or experts module) instance: parameter
names stay as they are, so checkpoints do not depend on the setting, and FSDP2's hooks stay
outside the recomputed region, as with torchtitan's ``fully_shard(checkpoint_wrapper(block))``.
A recomputed forward restores the block's buffers afterwards (an expert-bias load accumulator, say,
counts the tokens of a micro-batch once), so no statistic or aux loss is counted twice: aux losses
enter the gradient through the first forward's graph only.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from lightning_moe.cp.documents import recompute_in_active_attention_mode
from lightning_moe.moe.documents import recompute_with_routing_documents
from lightning_moe.parallel.plans.blocks import iter_blocks, require_block_container

ACTIVATION_CHECKPOINTING_MODES: tuple[str, ...] = ("none", "full", "selective")
_WRAPPED_ATTR = "_lightning_moe_activation_checkpointing"


def check_activation_checkpointing(mode: str) -> None:
    if mode not in ACTIVATION_CHECKPOINTING_MODES:
        raise ValueError(f"activation_checkpointing={mode!r} must be one of {ACTIVATION_CHECKPOINTING_MODES}")


@contextlib.contextmanager
def _restore_buffers(module: nn.Module) -> Iterator[None]:
    """Buffers as they were before the block: a recomputation leaves no trace in them."""
    saved = [(buffer, buffer.detach().clone()) for buffer in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


@contextlib.contextmanager
def _recomputing(first_forward: list[contextlib.AbstractContextManager], module: nn.Module | None) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for context in first_forward:
            stack.enter_context(context)
        if module is not None:
            stack.enter_context(_restore_buffers(module))
        yield


def _recompute_context(module: nn.Module | None = None) -> tuple[Any, Any]:
    """checkpoint's ``context_fn``: the recomputation runs as the first forward did, in its attention mode
    (ring or all-to-all attention, the micro-batch's document mask) and with the MoE layers' document
    ids (captured now, entered in backward), and leaves ``module``'s buffers as they were."""
    first_forward = [recompute_in_active_attention_mode(), recompute_with_routing_documents()]
    return contextlib.nullcontext(), _recomputing(first_forward, module)


def _checkpointed_forward(module: nn.Module, forward: Any) -> Any:
    def context_fn() -> tuple[Any, Any]:
        return _recompute_context(module)

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    return run


class _CheckpointedAttention(TorchFunctionMode):
    """``F.scaled_dot_product_attention`` keeps only its inputs; backward computes it again."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and torch.is_grad_enabled():
            return checkpoint(func, *args, use_reentrant=False, context_fn=_recompute_context, **kwargs)
        return func(*args, **kwargs)


def _with_checkpointed_attention(forward: Any) -> Any:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        with _CheckpointedAttention():
            return forward(*args, **kwargs)

    return run


def apply_activation_checkpointing(module: nn.Module, mode: str, *, attention: bool = True) -> int:
    """Checkpoint ``module``'s blocks (``"full"``) or their expert FFNs and attention cores
    (``"selective"``; ``attention=False`` leaves attention alone, as under cp > 1); return the
    number of modules wrapped. ``"none"`` does nothing. Run it before the first forward, after or
    before :func:`lightning_moe.parallelize` (only the blocks this pipeline stage holds are wrapped).

    Example::

        parallelize(model, dims)
        apply_activation_checkpointing(model, "selective")
    """
    check_activation_checkpointing(mode)
    if mode == "none":
        return 0
    blocks = require_block_container(module, f"activation_checkpointing={mode!r}")
    from lightning_moe.moe import MoELayer

    wrapped = 0
    for block in iter_blocks(blocks):
        if block is None or getattr(block, _WRAPPED_ATTR, None):
            continue
        setattr(block, _WRAPPED_ATTR, mode)
        if mode == "full":
            block.forward = _checkpointed_forward(block, block.forward)  # type: ignore[method-assign]
            wrapped += 1
            continue
        for layer in (m for m in block.modules() if isinstance(m, MoELayer)):
            experts = layer.experts
            experts.forward = _checkpointed_forward(experts, experts.forward)  # type: ignore[method-assign]
            wrapped += 1
        if attention:
            block.forward = _with_checkpointed_attention(block.forward)  # type: ignore[method-assign]
            wrapped += 1
    return wrapped

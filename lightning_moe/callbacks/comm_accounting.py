"""Communication accounting: bytes and calls per optimizer step for each parallel dimension.

Two sources add up in :data:`lightning_moe.comm.COUNTERS`:

- the collectives our own code issues (expert dispatch, tensor/context parallel, router
  statistics) go through the :mod:`lightning_moe.comm` wrappers, which name their dimension and
  record their backward too;
- every other collective issued during the step is counted by :func:`count_collectives`, which
  wraps the ``torch.distributed`` functions (FSDP2's parameter all-gathers and gradient
  reduce-scatters, DDP-style all-reduces, P2P, the send batches of torch's pipeline schedules,
  which bypass ``batch_isend_irecv``) and the functional collectives of
  ``torch.distributed._functional_collectives`` (DTensor redistributions: tensor-parallel plans,
  the gradient-norm reduction of clipping) for the duration of the step, and maps each call's
  process group to a dimension by its ranks (see :func:`group_dims`).

Not counted: the backward of an ``*_autograd`` functional collective called outside
:mod:`lightning_moe.comm` (autograd issues it from C++), ``all_gather_object`` and friends, and the
observability callbacks' own reductions (they run under :func:`uncounted`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from lightning.pytorch.utilities import rank_zero_warn

from lightning_moe import comm
from lightning_moe._compat import funcol, wrap_distributed_functions
from lightning_moe.callbacks.base import OptimizerStepCallback, log_to_loggers
from lightning_moe.comm.traffic import (
    C10D_SENT_BYTES,
    FUNCOL_SENT_BYTES,
    OTHER,
    GroupDims,
    SentBytes,
    group_dims,
    resolve_group,
    tensor_bytes,
)
from lightning_moe.layout import PARALLEL_DIMS
from lightning_moe.parallel.dims import parallel_dims_of

_ROWS: tuple[str, ...] = (*PARALLEL_DIMS, OTHER)  # rows of the per-step counters
# Bytes the ep dispatchers sent to ranks on other nodes (a part of "ep", recorded by
# lightning_moe.moe.exchange): logged as comm/ep_internode_bytes, not added to the total.
INTERNODE = "ep_internode"
_ALL_ROWS: tuple[str, ...] = (*_ROWS, INTERNODE)

# Calls from these modules are not counted: lightning_moe.comm records its own calls under the dim
# it names, and torch's collective modules call one another (a deprecated alias, a wrapper).
# lightning_moe.moe.exchange (the dispatchers' all-to-all) records through lightning_moe.comm as well.
_SKIPPED_CALLERS = frozenset({comm.__name__, funcol.__name__, c10d.__name__, "lightning_moe.moe.exchange"})
# Wrappers of other tools (the link simulator) between a caller and ours: the caller is behind them.
_TRANSPARENT_CALLERS = frozenset({"lightning_moe.comm.link_simulator"})

_ACTIVE_GROUPS: GroupDims | None = None  # set while count_collectives() is active
_GROUP_CACHE: dict[tuple[str, bool], tuple[int, int, str]] = {}  # (group, functional) -> (size, rank, dim)
_PAUSE_DEPTH = 0


def _group_info(group: Any, functional: bool = False) -> tuple[int, int, str]:
    """``(size, rank, dim)`` of a call's process group."""
    assert _ACTIVE_GROUPS is not None
    pg = resolve_group(group)
    key = (pg.group_name, functional)
    info = _GROUP_CACHE.get(key)
    if info is None:
        info = (dist.get_world_size(pg), dist.get_rank(pg), _ACTIVE_GROUPS.dim_of(pg, functional))
        _GROUP_CACHE[key] = info
    return info


def _counts_this_call() -> bool:
    """Whether the collective whose wrapper called this function is to be recorded."""
    if _ACTIVE_GROUPS is None or _PAUSE_DEPTH:
        return False
    # This frame, then the wrapper's, then the frame that called the wrapper (a chain, so that no
    # local holds this frame: that would be a reference cycle).
    caller = inspect.currentframe().f_back.f_back  # type: ignore[union-attr]
    while caller.f_globals.get("__name__") in _TRANSPARENT_CALLERS and caller.f_back is not None:  # type: ignore[union-attr]
        caller = caller.f_back  # type: ignore[union-attr]
    return caller.f_globals.get("__name__") not in _SKIPPED_CALLERS  # type: ignore[union-attr]


def _counted(fn: Callable[..., Any], sent_bytes: SentBytes, functional: bool) -> Callable[..., Any]:
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _counts_this_call():
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            size, rank, dim = _group_info(bound.arguments.get("group"), functional)
            if size > 1:
                comm.record(dim, sent_bytes(bound.arguments, size, rank))
        return fn(*args, **kwargs)

    return wrapper


def _counted_batch_isend_irecv(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(p2p_op_list: list[dist.P2POp]) -> Any:
        if _counts_this_call():
            sent: dict[str, int] = {}
            for op in p2p_op_list:
                size, _, dim = _group_info(op.group)
                if op.op is dist.isend and size > 1:
                    sent[dim] = sent.get(dim, 0) + tensor_bytes(op.tensor)
            for dim, nbytes in sent.items():
                comm.record(dim, nbytes)
        return fn(p2p_op_list)

    return wrapper


def _counted_pipeline_batch(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Count the sends of torch's pipeline schedules (:func:`lightning_moe._compat.pipeline_p2p_batcher`):
    one call per send, its tensor's bytes, under its group's dim. Whatever the batcher calls
    inside (separate ``isend`` calls, or ``batch_isend_irecv`` for a mixed batch) is not counted
    again."""

    @functools.wraps(fn)
    def wrapper(p2p_ops: list[dist.P2POp], *args: Any, **kwargs: Any) -> Any:
        if not _counts_this_call():
            return fn(p2p_ops, *args, **kwargs)
        for op in p2p_ops:
            if op.op is dist.isend:
                size, _, dim = _group_info(op.group)
                if size > 1:
                    comm.record(dim, tensor_bytes(op.tensor))
        with uncounted():
            return fn(p2p_ops, *args, **kwargs)

    return wrapper


@contextmanager
def count_collectives(groups: GroupDims) -> Iterator[None]:
    """Record into :data:`lightning_moe.comm.COUNTERS` every collective issued inside the block, under
    the dimension ``groups`` gives its process group (see :func:`group_dims`; one-rank groups are
    not counted).

    Calls made by :mod:`lightning_moe.comm`'s wrappers are skipped (they record themselves), and so
    are calls inside :func:`uncounted`. Re-entering an active block changes nothing.

    Example::

        comm.reset()
        with count_collectives(group_dims(strategy.parallel_dims)):
            loss = model(batch).sum(); loss.backward()     # FSDP all-gathers and reduce-scatters
        comm.snapshot()["dp"]                              # {"bytes": ..., "calls": ...}
    """
    global _ACTIVE_GROUPS
    if _ACTIVE_GROUPS is not None:
        yield
        return
    restore = wrap_distributed_functions(
        c10d={
            **{
                name: functools.partial(_counted, sent_bytes=bytes_, functional=False)
                for name, bytes_ in C10D_SENT_BYTES.items()
            },
            "batch_isend_irecv": _counted_batch_isend_irecv,
        },
        functional={
            name: functools.partial(_counted, sent_bytes=bytes_, functional=True)
            for name, bytes_ in FUNCOL_SENT_BYTES.items()
        },
        pipeline_batch=_counted_pipeline_batch,
    )
    try:
        _ACTIVE_GROUPS = groups
        yield
    finally:
        _ACTIVE_GROUPS = None
        _GROUP_CACHE.clear()
        restore()


@contextmanager
def uncounted() -> Iterator[None]:
    """Leave the collectives of the block out of :func:`count_collectives` (e.g. a callback's own
    metric reductions, which are not training traffic)."""
    global _PAUSE_DEPTH
    _PAUSE_DEPTH += 1
    try:
        yield
    finally:
        _PAUSE_DEPTH -= 1


class CommAccountingCallback(OptimizerStepCallback):
    """Log the bytes and calls of every parallel dimension per optimizer step.

    The counters are reset when an optimizer step starts and read when it ends (all its
    micro-batches, forward and backward, the optimizer step and the expert-bias update included).
    Values are per rank, averaged over ranks (one all-reduce per step):

    - ``comm/<dim>_bytes``: bytes one rank sent to its peers in the step, for dim in
      ``tp, cp, ep, dp, pp`` (``dp`` covers FSDP/DDP gradient and parameter traffic, measured);
    - ``comm/<dim>_calls``: collective calls per rank in the step;
    - ``comm/total_bytes``: the sum over dims; ``comm/other_*`` only when some collective ran on a
      group that is none of the dims';
    - ``comm/ep_internode_bytes``: the part of ``comm/ep_bytes`` sent to ranks on other nodes
      (``MoE5DStrategy(ranks_per_node=...)``), counted from the dispatchers' actual sends; 0 when
      the ep group sits on one node.

    ``summary.json`` gets ``comm``: ``{dim: {"bytes": ..., "calls": ...}}``, per step averaged over
    the run (see :class:`~lightning_moe.callbacks.SummaryCallback`).

    Everything is measured (module docstring: :mod:`lightning_moe.callbacks.comm_accounting`): the
    step runs inside :func:`count_collectives`, which wraps the ``torch.distributed`` functions for
    its duration. That costs microseconds per collective; under ``torch.compile`` the wrapped
    functions break the graph, so leave this callback out of compiled runs.

    Example::

        trainer = pl.Trainer(strategy=MoE5DStrategy(ep=2), devices=2, callbacks=[CommAccountingCallback()])
        trainer.fit(model, datamodule=dm)   # logs comm/ep_bytes, comm/dp_bytes, ...
    """

    def __init__(self) -> None:
        self._groups = GroupDims()
        self._counting = ExitStack()
        self._totals = torch.zeros(len(_ALL_ROWS), 2, dtype=torch.float64)  # (bytes, calls) per row
        self._steps = 0
        self.metrics: dict[str, float] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if getattr(trainer.strategy, "compile", False):
            rank_zero_warn(
                "CommAccountingCallback under MoE5DStrategy(compile=True): it counts only collectives that run"
                " eagerly (those inside compiled blocks are not counted) and its wrappers break graphs; drop it"
                " from compiled runs (callbacks=... without comm_accounting)"
            )
        dims = parallel_dims_of(trainer)
        self._groups = group_dims(dims) if dims is not None and dist.is_initialized() else GroupDims()
        self._totals.zero_()
        self._steps = 0

    def on_step_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        comm.reset()
        self._counting.enter_context(count_collectives(self._groups))

    def on_step_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._counting.close()
        snapshot = comm.snapshot()
        local = torch.tensor(
            [[snapshot.get(d, {}).get("bytes", 0), snapshot.get(d, {}).get("calls", 0)] for d in _ALL_ROWS],
            dtype=torch.float64,
        )
        # Every rank takes part, whatever it holds: a fixed-size tensor, one collective.
        per_rank = trainer.strategy.reduce(local.to(trainer.strategy.root_device), reduce_op="mean").cpu()
        self._totals += per_rank
        self._steps += 1
        metrics: dict[str, float] = {}
        for name, (nbytes, calls) in zip(_ROWS, per_rank.tolist()):
            if name in PARALLEL_DIMS or calls:
                metrics[f"comm/{name}_bytes"] = nbytes
                metrics[f"comm/{name}_calls"] = calls
        metrics["comm/total_bytes"] = float(per_rank[: len(_ROWS), 0].sum())
        metrics[f"comm/{INTERNODE}_bytes"] = float(per_rank[len(_ROWS), 0])
        self.metrics = metrics
        log_to_loggers(trainer, metrics)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._counting.close()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._counting.close()

    def summary_fields(self) -> dict[str, Any]:
        """``comm``: bytes and calls per optimizer step and rank, for each dim, averaged over the run;
        ``ep_internode_bytes`` (when the ep group spans nodes): the part of ``comm.ep`` sent across nodes."""
        if not self._steps:
            return {}
        mean = (self._totals / self._steps).tolist()
        fields: dict[str, Any] = {
            "comm": {
                name: {"bytes": nbytes, "calls": calls}
                for name, (nbytes, calls) in zip(_ROWS, mean)
                if name in PARALLEL_DIMS or calls
            }
        }
        if mean[len(_ROWS)][1]:
            fields["ep_internode_bytes"] = mean[len(_ROWS)][0]
        return fields

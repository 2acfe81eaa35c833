"""Communication accounting: bytes and calls per optimizer step for each parallel dimension.

Two sources add up in :data:`lightning_moe.comm.COUNTERS`:

- the collectives our own code issues (expert dispatch, tensor/context parallel, router
  statistics) go through the :mod:`lightning_moe.comm` wrappers, which name their dimension;
- every other ``torch.distributed`` collective issued during the step, above all FSDP2's
  parameter all-gathers and gradient reduce-scatters (or all-reduces under ``ddp``), is counted by
  :func:`count_collectives`, which wraps the ``torch.distributed`` functions for the duration of
  the step and maps each call's process group to a dimension.

Not counted: functional collectives issued outside :mod:`lightning_moe.comm` (DTensor
redistributions, e.g. the mesh-wise gradient-norm reduction of gradient clipping) and the
observability callbacks' own reductions (they run under :func:`uncounted`).
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_moe import comm
from lightning_moe.callbacks.base import OptimizerStepCallback, log_to_loggers

DIMS: tuple[str, ...] = ("tp", "cp", "ep", "dp", "pp")
OTHER = "other"  # collectives on a process group that is none of the dims' (e.g. the world group)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _all_to_all_single_bytes(a: Mapping[str, Any], size: int, rank: int) -> int:
    splits = a.get("input_split_sizes")
    tensor = a["input"]
    if not splits:
        return _nbytes(tensor) * (size - 1) // size
    row_bytes = _nbytes(tensor) // max(tensor.shape[0], 1)
    return (sum(splits) - splits[rank]) * row_bytes


# Bytes this rank sends to its peers, by the same conventions as lightning_moe.comm (logical
# payload; an all-reduce counts the 2(n-1)/n of a ring). `a`: the call's bound arguments.
_SENT_BYTES: dict[str, Callable[[Mapping[str, Any], int, int], int]] = {
    "all_reduce": lambda a, n, r: 2 * _nbytes(a["tensor"]) * (n - 1) // n,
    "all_gather": lambda a, n, r: _nbytes(a["tensor"]) * (n - 1),
    "all_gather_single": lambda a, n, r: _nbytes(a["input_tensor"]) * (n - 1),
    "all_gather_into_tensor": lambda a, n, r: _nbytes(a["input_tensor"]) * (n - 1),
    "reduce_scatter": lambda a, n, r: sum(_nbytes(t) for i, t in enumerate(a["input_list"]) if i != r),
    "reduce_scatter_single": lambda a, n, r: _nbytes(a["output"]) * (n - 1),
    "reduce_scatter_tensor": lambda a, n, r: _nbytes(a["output"]) * (n - 1),
    "all_to_all": lambda a, n, r: sum(_nbytes(t) for i, t in enumerate(a["input_tensor_list"]) if i != r),
    "all_to_all_single": _all_to_all_single_bytes,
    "broadcast": lambda a, n, r: _nbytes(a["tensor"]) * (n - 1) if r == _broadcast_source(a) else 0,
    "send": lambda a, n, r: _nbytes(a["tensor"]),
}

_ACTIVE_GROUP_DIMS: Mapping[str, str] | None = None  # set while count_collectives() is active
_PAUSE_DEPTH = 0


def _broadcast_source(a: Mapping[str, Any]) -> int:
    group_src = a.get("group_src")
    if group_src is not None:
        return group_src
    return dist.get_group_rank(a.get("group") or dist.group.WORLD, a["src"])


def _group_name(group: dist.ProcessGroup) -> str:
    return group.group_name


def group_dims(parallel_dims: Any) -> dict[str, str]:
    """Map process-group names to dimensions from a :class:`~lightning_moe.ParallelDims`.

    The data-parallel gradient groups (``dense_grad``, ``edp``, ``dp_ep``, ``token``) come first, so
    a group that is also another dim's (``ep`` alone: ``dp x ep`` is the ep group) counts as ``dp``:
    FSDP's traffic on it is gradient reduction. Groups the dims do not have (yet) are skipped.

    Example::

        group_dims(trainer.strategy.parallel_dims)  # {"2": "dp", "1": "ep", ...}
    """
    candidates = [
        ("dense_grad_group", "dp"), ("edp_group", "dp"), ("dp_ep_group", "dp"), ("token_group", "dp"),
        ("tp_group", "tp"), ("etp_group", "tp"), ("cp_group", "cp"), ("sequence_group", "cp"),
        ("ep_group", "ep"), ("pp_group", "pp"),
    ]  # fmt: skip
    mapping: dict[str, str] = {}
    for attr, dim in candidates:
        try:
            group = getattr(parallel_dims, attr)
        except (AttributeError, NotImplementedError):
            continue
        mapping.setdefault(_group_name(group), dim)
    return mapping


def _counts_this_call() -> bool:
    """Whether the collective whose wrapper called this function is to be recorded."""
    if _ACTIVE_GROUP_DIMS is None or _PAUSE_DEPTH:
        return False
    # Frame 2 called the wrapper. Calls from lightning_moe.comm's wrappers are already recorded
    # there, under the dim they name.
    return sys._getframe(2).f_globals.get("__name__") != comm.__name__


def _counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(fn)
    sent_bytes = _SENT_BYTES[name]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _counts_this_call():
            assert _ACTIVE_GROUP_DIMS is not None
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            group = bound.arguments.get("group") or dist.group.WORLD
            size = dist.get_world_size(group)
            if size > 1:
                dim = _ACTIVE_GROUP_DIMS.get(_group_name(group), OTHER)
                comm.record(dim, sent_bytes(bound.arguments, size, dist.get_rank(group)))
        return fn(*args, **kwargs)

    return wrapper


def _batch_isend_irecv(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(p2p_op_list: list[dist.P2POp]) -> Any:
        if _counts_this_call():
            assert _ACTIVE_GROUP_DIMS is not None
            sent: dict[str, int] = {}
            for op in p2p_op_list:
                if op.op is dist.isend:
                    dim = _ACTIVE_GROUP_DIMS.get(_group_name(op.group or dist.group.WORLD), OTHER)
                    sent[dim] = sent.get(dim, 0) + _nbytes(op.tensor)
            for dim, nbytes in sent.items():
                comm.record(dim, nbytes)
        return fn(p2p_op_list)

    return wrapper


@contextmanager
def count_collectives(group_dims: Mapping[str, str]) -> Iterator[None]:
    """Record into :data:`lightning_moe.comm.COUNTERS` every ``torch.distributed`` collective issued
    inside the block, under the dimension ``group_dims`` gives its process group (see
    :func:`group_dims`; unknown groups count as ``"other"``, one-rank groups not at all).

    Calls made by :mod:`lightning_moe.comm`'s wrappers are skipped (they record themselves), and so
    are calls inside :func:`uncounted`. Re-entering an active block changes nothing.

    Example::

        comm.reset()
        with count_collectives(group_dims(strategy.parallel_dims)):
            loss = model(batch).sum(); loss.backward()     # FSDP all-gathers and reduce-scatters
        comm.snapshot()["dp"]                              # {"bytes": ..., "calls": ...}
    """
    global _ACTIVE_GROUP_DIMS
    if _ACTIVE_GROUP_DIMS is not None:
        yield
        return
    originals = {name: getattr(dist, name) for name in (*_SENT_BYTES, "batch_isend_irecv") if hasattr(dist, name)}
    try:
        for name, fn in originals.items():
            setattr(dist, name, _batch_isend_irecv(fn) if name == "batch_isend_irecv" else _counted(name, fn))
        _ACTIVE_GROUP_DIMS = dict(group_dims)
        yield
    finally:
        _ACTIVE_GROUP_DIMS = None
        for name, fn in originals.items():
            setattr(dist, name, fn)


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
      group that is none of the dims'.

    ``summary.json`` gets ``comm``: ``{dim: {"bytes": ..., "calls": ...}}``, per step averaged over
    the run (see :class:`~lightning_moe.callbacks.SummaryCallback`).

    Example::

        trainer = pl.Trainer(strategy=MoE5DStrategy(ep=2), devices=2, callbacks=[CommAccountingCallback()])
        trainer.fit(model, datamodule=dm)   # logs comm/ep_bytes, comm/dp_bytes, ...
    """

    def __init__(self) -> None:
        self._group_dims: dict[str, str] = {}
        self._counting = ExitStack()
        self._totals = torch.zeros(len(DIMS) + 1, 2, dtype=torch.float64)  # rows: DIMS + other; (bytes, calls)
        self._steps = 0
        self.metrics: dict[str, float] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        dims = getattr(trainer.strategy, "parallel_dims", None)
        self._group_dims = group_dims(dims) if dims is not None and dist.is_initialized() else {}
        self._totals.zero_()
        self._steps = 0

    def on_step_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        comm.reset()
        self._counting.enter_context(count_collectives(self._group_dims))

    def on_step_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._counting.close()
        snapshot = comm.snapshot()
        names = (*DIMS, OTHER)
        local = torch.tensor(
            [[snapshot.get(d, {}).get("bytes", 0), snapshot.get(d, {}).get("calls", 0)] for d in names],
            dtype=torch.float64,
        )
        # Every rank takes part, whatever it holds: a fixed-size tensor, one collective.
        per_rank = trainer.strategy.reduce(local.to(trainer.strategy.root_device), reduce_op="mean").cpu()
        self._totals += per_rank
        self._steps += 1
        metrics: dict[str, float] = {}
        for name, (nbytes, calls) in zip(names, per_rank.tolist()):
            if name in DIMS or calls:
                metrics[f"comm/{name}_bytes"] = nbytes
                metrics[f"comm/{name}_calls"] = calls
        metrics["comm/total_bytes"] = float(per_rank[:, 0].sum())
        self.metrics = metrics
        log_to_loggers(trainer, metrics)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._counting.close()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._counting.close()

    def summary_fields(self) -> dict[str, Any]:
        """``comm``: bytes and calls per optimizer step and rank, for each dim, averaged over the run."""
        if not self._steps:
            return {}
        mean = (self._totals / self._steps).tolist()
        return {
            "comm": {
                name: {"bytes": nbytes, "calls": calls}
                for name, (nbytes, calls) in zip((*DIMS, OTHER), mean)
                if name in DIMS or calls
            }
        }

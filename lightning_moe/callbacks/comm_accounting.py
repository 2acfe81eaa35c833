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
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from lightning.pytorch.utilities import rank_zero_warn

from lightning_moe import comm
from lightning_moe._compat import funcol, resolve_process_group, wrap_distributed_functions
from lightning_moe.callbacks.base import OptimizerStepCallback, log_to_loggers
from lightning_moe.layout import ACCOUNTED_GROUPS, PARALLEL_DIMS, accounted_dim, accounted_shared_dim

OTHER = "other"  # collectives on a process group that is none of the dims' (e.g. a user's own group)
_ROWS: tuple[str, ...] = (*PARALLEL_DIMS, OTHER)  # rows of the per-step counters
# Bytes the ep dispatchers sent to ranks on other nodes (a part of "ep", recorded by
# lightning_moe.moe.exchange): logged as comm/ep_internode_bytes, not added to the total.
INTERNODE = "ep_internode"
_ALL_ROWS: tuple[str, ...] = (*_ROWS, INTERNODE)

# Calls from these modules are not counted: lightning_moe.comm records its own calls under the dim
# it names, and torch's collective modules call one another (a deprecated alias, a wrapper).
# lightning_moe.moe.exchange (the dispatchers' all-to-all) records through lightning_moe.comm as well.
_SKIPPED_CALLERS = frozenset({comm.__name__, funcol.__name__, c10d.__name__, "lightning_moe.moe.exchange"})

SentBytes = Callable[[Mapping[str, Any], int, int], int]  # (bound arguments, group size, group rank)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _all_to_all_bytes(tensor: torch.Tensor, splits: list[int] | None, size: int, rank: int) -> int:
    if not splits:
        return _nbytes(tensor) * (size - 1) // size
    row_bytes = math.prod(tensor.shape[1:]) * tensor.element_size()  # from the shape: there may be no row
    return (sum(splits) - splits[rank]) * row_bytes


def _broadcast_source(a: Mapping[str, Any]) -> int:
    """The broadcasting rank, in the group's numbering."""
    if a.get("group_src") is not None:
        return a["group_src"]
    return dist.get_group_rank(_resolve_group(a.get("group")), a["src"])


def _ring_all_reduce(key: str) -> SentBytes:
    return lambda a, n, r: 2 * _nbytes(a[key]) * (n - 1) // n


def _to_every_peer(key: str) -> SentBytes:
    return lambda a, n, r: _nbytes(a[key]) * (n - 1)


def _peers_chunks(key: str) -> SentBytes:
    return lambda a, n, r: _nbytes(a[key]) // n * (n - 1)


def _list_except_mine(key: str) -> SentBytes:
    return lambda a, n, r: sum(_nbytes(t) for i, t in enumerate(a[key]) if i != r)


# Bytes this rank sends to its peers, by the conventions of lightning_moe.comm (logical payload;
# an all-reduce counts the 2(n-1)/n of a ring), for each wrapped function of each module.
_C10D: dict[str, SentBytes] = {
    "all_reduce": _ring_all_reduce("tensor"),
    "all_gather": _to_every_peer("tensor"),
    "all_gather_single": _to_every_peer("input_tensor"),
    "all_gather_into_tensor": _to_every_peer("input_tensor"),
    "reduce_scatter": _list_except_mine("input_list"),
    "reduce_scatter_single": _peers_chunks("input"),
    "reduce_scatter_tensor": _peers_chunks("input"),
    "all_to_all": _list_except_mine("input_tensor_list"),
    "all_to_all_single": lambda a, n, r: _all_to_all_bytes(a["input"], a.get("input_split_sizes"), n, r),
    "broadcast": lambda a, n, r: _nbytes(a["tensor"]) * (n - 1) if r == _broadcast_source(a) else 0,
    "send": lambda a, n, r: _nbytes(a["tensor"]),
}
_FUNCOL: dict[str, SentBytes] = {
    "all_reduce": _ring_all_reduce("self"),
    **{name: _to_every_peer("self") for name in (
        "all_gather_tensor", "all_gather_tensor_autograd", "all_gather_single", "all_gather_single_autograd",
    )},
    **{name: _peers_chunks("self") for name in (
        "reduce_scatter_tensor", "reduce_scatter_tensor_autograd", "reduce_scatter_single",
        "reduce_scatter_single_autograd",
    )},
    **{name: lambda a, n, r: _all_to_all_bytes(a["self"], a.get("input_split_sizes"), n, r) for name in (
        "all_to_all_single", "all_to_all_single_autograd",
    )},
    "permute_tensor": lambda a, n, r: _nbytes(a["self"]) if a["src_dst"][r] != r else 0,
}  # fmt: skip

_ACTIVE_GROUPS: GroupDims | None = None  # set while count_collectives() is active
_GROUP_CACHE: dict[tuple[str, bool], tuple[int, int, str]] = {}  # (group, functional) -> (size, rank, dim)
_PAUSE_DEPTH = 0


@dataclass(frozen=True)
class GroupDims:
    """Which parallel dimension a process group's traffic counts for.

    A group of a DeviceMesh dim (``group_desc`` ``"mesh_<name>"``: ``tp``, ``ep``, ``edp``,
    ``dp_ep_cp``, ...) counts for that dim: flattened dims with ``dp`` (and ``edp``) for ``dp``,
    others for their first part of size above 1. Any other group (one that reuses the default
    group because it spans every rank, or a user's ``new_group``) is looked up by its ranks in
    ``by_ranks``; unknown ones count as ``"other"``. Build it with :func:`group_dims`.

    Example::

        GroupDims(by_ranks={frozenset({0, 1}): ("dp", "tp")}).dim_of(dist.group.WORLD)  # "dp" on 2 ranks
    """

    by_ranks: Mapping[frozenset[int], tuple[str, ...]] = field(default_factory=dict)
    sizes: Mapping[str, int] = field(default_factory=dict)

    def dim_of(self, group: dist.ProcessGroup, functional: bool = False) -> str:
        """The dim of ``group``'s traffic; ``functional``: the call is a functional collective."""
        description = getattr(group, "group_desc", "")
        if description.startswith("mesh_"):
            dim = accounted_dim(description[len("mesh_") :].split("_"), self.sizes)
            if dim is not None:
                return dim
        dims = self.by_ranks.get(frozenset(dist.get_process_group_ranks(group)), (OTHER,))
        return accounted_shared_dim(dims, functional)


def group_dims(parallel_dims: Any) -> GroupDims:
    """The :class:`GroupDims` of a :class:`~lightning_moe.ParallelDims` with its mesh built.

    Rank sets come from the full mesh's coordinates (no process group is created). A rank set
    several dims share (ep alone makes dp x ep the ep ranks) counts for the first of: the
    data-parallel gradient groups (dense, expert, token), tp, cp, ep, pp: the traffic of such a
    group that is not a mesh dim's own group is FSDP's gradient reduction. Functional collectives
    (DTensor's) on such a set count for the first dim other than dp, when there is one: a mesh dim
    that spans every rank reuses the default group, and FSDP never issues functional collectives.

    Example::

        group_dims(trainer.strategy.parallel_dims).dim_of(dims.ep_group)  # "ep"
    """
    mesh = parallel_dims.mesh
    names = list(mesh.mesh_dim_names)
    sizes = dict(zip(names, mesh.shape))
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the mesh
        return GroupDims(sizes=sizes)
    by_ranks: dict[frozenset[int], tuple[str, ...]] = {}
    for spanned, dim in ACCOUNTED_GROUPS:
        index = tuple(slice(None) if name in spanned else c for name, c in zip(names, coordinate))
        ranks = frozenset(mesh.mesh[index].flatten().tolist())
        if dim not in by_ranks.get(ranks, ()):
            by_ranks[ranks] = (*by_ranks.get(ranks, ()), dim)
    return GroupDims(by_ranks, sizes)


def _resolve_group(group: Any) -> dist.ProcessGroup:
    if group is None:
        return dist.group.WORLD
    if isinstance(group, dist.ProcessGroup):
        return group
    # Functional collectives take ranks, meshes, (mesh, dim) or names; resolved as they do it.
    return resolve_process_group(group)


def _group_info(group: Any, functional: bool = False) -> tuple[int, int, str]:
    """``(size, rank, dim)`` of a call's process group."""
    assert _ACTIVE_GROUPS is not None
    pg = _resolve_group(group)
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
                    sent[dim] = sent.get(dim, 0) + _nbytes(op.tensor)
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
                    comm.record(dim, _nbytes(op.tensor))
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
            **{name: functools.partial(_counted, sent_bytes=bytes_, functional=False) for name, bytes_ in _C10D.items()},
            "batch_isend_irecv": _counted_batch_isend_irecv,
        },
        functional={name: functools.partial(_counted, sent_bytes=bytes_, functional=True) for name, bytes_ in _FUNCOL.items()},
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
        dims = getattr(trainer.strategy, "parallel_dims", None)
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

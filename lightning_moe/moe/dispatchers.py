"""The dispatcher kinds (``MoEConfig.dispatcher``): their names, what each needs and offers, and their construction.

One home per kind: :class:`DispatcherKind` names them, :data:`CAPABILITIES` says per kind what the
rest of the code branches on (the layout checks of ``lightning_moe.parallel.plans.expert_parallel``, the
planner's byte models and overlap rules), and :func:`build_dispatcher` builds the dispatcher object,
on one device (no groups) and under expert parallelism (:class:`ExpertGroups`) alike.

The kinds are plain strings to users and to Hydra: ``MoEConfig(dispatcher="alltoall")`` works and
``DispatcherKind.ALLTOALL == "alltoall"``.

Example::

    DispatcherKind("hierarchical").capabilities.node_stages     # True: needs the ep group on >= 2 nodes
    build_dispatcher("alltoall", 8)                               # LocalDispatcher: no ep group
    build_dispatcher("alltoall_dedup", 8, ExpertGroups(ep_group)) # PerRankAllToAllDispatcher
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import torch.distributed as dist

from lightning_moe.moe.dispatcher import Dispatcher, LocalDispatcher
from lightning_moe.moe.ep_dispatcher import (
    AllGatherDispatcher,
    AllToAllDispatcher,
    ExpertTensorParallelDispatcher,
    PerRankAllToAllDispatcher,
)
from lightning_moe.moe.exchange import check_wire
from lightning_moe.moe.hierarchical import HierarchicalDispatcher

__all__ = [
    "CAPABILITIES",
    "DEFAULT_DISPATCHER",
    "DISPATCHERS",
    "DispatcherCapabilities",
    "DispatcherKind",
    "ExpertGroups",
    "build_dispatcher",
    "check_dispatcher",
    "dispatcher_kind",
]


class DispatcherKind(str, Enum):
    """A dispatcher kind; a ``str`` equal to its value (``enum.StrEnum`` is Python >= 3.11, the floor 3.10).

    - ``ALLTOALL_DEDUP`` (the default): one row per (token, destination ep rank), expanded there
      (:class:`~lightning_moe.moe.ep_dispatcher.PerRankAllToAllDispatcher`);
    - ``ALLTOALL``: one row per (token, expert) slot each way, kept for comparison
      (:class:`~lightning_moe.moe.ep_dispatcher.AllToAllDispatcher`);
    - ``ALLGATHER``: every rank gathers every token
      (:class:`~lightning_moe.moe.ep_dispatcher.AllGatherDispatcher`);
    - ``HIERARCHICAL``: across nodes once per token, then inside the node
      (:class:`~lightning_moe.moe.hierarchical.HierarchicalDispatcher`).
    """

    ALLTOALL = "alltoall"
    ALLTOALL_DEDUP = "alltoall_dedup"
    ALLGATHER = "allgather"
    HIERARCHICAL = "hierarchical"

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__  # f"{kind}" is its value on every Python

    @property
    def capabilities(self) -> DispatcherCapabilities:
        return CAPABILITIES[self]


# MoEConfig's default kind.
DEFAULT_DISPATCHER = DispatcherKind.ALLTOALL_DEDUP
# The kinds as plain strings, in their order (what error messages list: ('alltoall', 'alltoall_dedup', ...)).
DISPATCHERS: tuple[str, ...] = tuple(k.value for k in DispatcherKind)


@dataclass(frozen=True)
class ExpertGroups:
    """The process groups a dispatcher runs over, from ``lightning_moe.parallel.plans.expert_parallel``.

    ``ep_group``: the ranks exchanging tokens (None or of size 1: no expert parallelism);
    ``node_ids``: the node of each ep rank (inter-node bytes are counted; None: one node);
    ``node_groups``: ``(ep_node group, ep_local group)`` of ``ParallelDims.ep_node_mesh``, which the
    kinds with :attr:`DispatcherCapabilities.node_stages` need;
    ``tp_group``: under expert tensor parallelism (etp = tp > 1), the tp group the dispatcher is
    wrapped over (:class:`~lightning_moe.moe.ep_dispatcher.ExpertTensorParallelDispatcher`, any kind).
    """

    ep_group: dist.ProcessGroup | None = None
    node_ids: list[int] | None = None
    node_groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None
    tp_group: dist.ProcessGroup | None = None


@dataclass(frozen=True)
class DispatcherCapabilities:
    """What one kind needs and offers; the code asks these instead of comparing kind names.

    - ``wire``: accepts ``dispatch_dtype`` (``"bf16"``/``"fp8"`` on the wire; ``MoEConfig`` refuses
      it otherwise);
    - ``token_all_to_all``: issues token all-to-alls, where ``overlap_ep_comm`` hands over between
      micro-batches (the planner refuses ``overlap_ep_comm`` otherwise);
    - ``intra_layer_overlap``: the planner counts its token all-to-alls as overlapped with the
      layer's own compute under ``dispatch_chunks`` / the shared expert (``planner.step_time``);
    - ``node_stages``: splits the ep group by node (ep node and ep local groups, an even split): needs
      the ep group on more than one node and refuses ``fold_ep``;
    - ``build``: ``build(num_experts, groups, wire) -> Dispatcher`` under expert parallelism.

    Every kind runs under expert tensor parallelism (the wrapper takes any dispatcher).
    """

    wire: bool
    token_all_to_all: bool
    intra_layer_overlap: bool
    node_stages: bool
    build: Callable[[int, ExpertGroups, str | None], Dispatcher]


def _hierarchical(num_experts: int, groups: ExpertGroups, wire: str | None) -> Dispatcher:
    node_ids = groups.node_ids
    if groups.node_groups is None or node_ids is None or len(set(node_ids)) < 2:
        raise ValueError(
            "dispatcher='hierarchical' needs ep ranks on more than one node; with one node it is the same as"
            " 'alltoall': use dispatcher='alltoall', or set ranks_per_node (MoE5DStrategy / ParallelDims) smaller"
            " than the ranks of the ep group to simulate nodes"
        )
    return HierarchicalDispatcher(num_experts, *groups.node_groups, wire=wire)


CAPABILITIES: dict[DispatcherKind, DispatcherCapabilities] = {
    DispatcherKind.ALLTOALL: DispatcherCapabilities(
        wire=True, token_all_to_all=True, intra_layer_overlap=True, node_stages=False,
        build=lambda e, g, wire: AllToAllDispatcher(e, g.ep_group, wire=wire, node_ids=g.node_ids),
    ),
    DispatcherKind.ALLTOALL_DEDUP: DispatcherCapabilities(
        wire=True, token_all_to_all=True, intra_layer_overlap=True, node_stages=False,
        build=lambda e, g, wire: PerRankAllToAllDispatcher(e, g.ep_group, wire=wire, node_ids=g.node_ids),
    ),
    DispatcherKind.ALLGATHER: DispatcherCapabilities(
        wire=False, token_all_to_all=False, intra_layer_overlap=False, node_stages=False,
        build=lambda e, g, wire: AllGatherDispatcher(e, g.ep_group),
    ),
    DispatcherKind.HIERARCHICAL: DispatcherCapabilities(
        wire=True, token_all_to_all=True, intra_layer_overlap=False, node_stages=True, build=_hierarchical,
    ),
}  # fmt: skip


_KIND_OF: dict[str, DispatcherKind] = {k.value: k for k in DispatcherKind}  # a dict: the planner asks per layout


def dispatcher_kind(kind: str) -> DispatcherKind:
    """``kind`` as a :class:`DispatcherKind`; ``ValueError`` naming the kinds for an unknown one."""
    try:
        return _KIND_OF[kind]
    except (KeyError, TypeError):
        raise ValueError(f"dispatcher={kind!r} is unknown: choose one of {DISPATCHERS}") from None


def check_dispatcher(kind: str, wire: str | None) -> None:
    """``ValueError`` for an unknown dispatcher ``kind``, an unknown ``wire`` (``dispatch_dtype``) or a
    wire the dispatcher cannot send."""
    caps = dispatcher_kind(kind).capabilities
    check_wire(wire)
    if not caps.wire and wire is not None:
        # the default first, then the others in order: 'alltoall_dedup', 'alltoall' or 'hierarchical'
        takes = [
            repr(k.value) for k in sorted(DispatcherKind, key=lambda k: k != DEFAULT_DISPATCHER) if k.capabilities.wire
        ]
        raise ValueError(
            f"dispatch_dtype={wire!r} applies to the all-to-all dispatchers: use dispatcher={', '.join(takes[:-1])}"
            f" or {takes[-1]}, or dispatch_dtype=None"
        )


def build_dispatcher(
    kind: str,
    num_experts: int,
    groups: ExpertGroups | dist.ProcessGroup | None = None,
    *,
    wire: str | None = None,
    node_ids: list[int] | None = None,
    node_groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None,
) -> Dispatcher:
    """The dispatcher for ``kind`` (one of :data:`DISPATCHERS`) over ``groups``: the one place a
    layer's dispatcher is built (``MoELayer`` on construction, ``lightning_moe.parallelize`` with
    the groups).

    ``groups``: an :class:`ExpertGroups`, or the ep group alone (then ``node_ids``/``node_groups``
    as in :class:`ExpertGroups`). A :class:`~lightning_moe.moe.dispatcher.LocalDispatcher` when there
    is no expert parallelism (no ep group, or one of size 1); ``kind`` and ``wire`` are checked either
    way, so that a layer fails at construction rather than when it is parallelized. ``wire``: the
    dispatch dtype (``None``, ``"bf16"``, ``"fp8"``; the kinds with ``capabilities.wire``). With
    ``groups.tp_group``, the result is wrapped for expert tensor parallelism.
    """
    check_dispatcher(kind, wire)
    if not isinstance(groups, ExpertGroups):
        groups = ExpertGroups(groups, node_ids, node_groups)
    elif node_ids is not None or node_groups is not None:
        raise TypeError("build_dispatcher takes node_ids/node_groups in its ExpertGroups, not beside it")
    ep_group = groups.ep_group
    if ep_group is None or dist.get_world_size(ep_group) == 1:
        dispatcher: Dispatcher = LocalDispatcher(num_experts)
    else:
        dispatcher = dispatcher_kind(kind).capabilities.build(num_experts, groups, wire)
    if groups.tp_group is not None:
        dispatcher = ExpertTensorParallelDispatcher(dispatcher, groups.tp_group)
    return dispatcher

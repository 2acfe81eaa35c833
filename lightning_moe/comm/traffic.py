"""What a ``torch.distributed`` call sends, and for which parallel dimension: shared by the comm
accounting (:mod:`lightning_moe.callbacks.comm_accounting`, which counts it) and the link
simulator (:mod:`lightning_moe.comm.link_simulator`, which delays it).

- :data:`C10D_SENT_BYTES` and :data:`FUNCOL_SENT_BYTES`: for each wrapped function of
  ``torch.distributed`` and of the functional collectives, the bytes this rank sends to its peers
  from the call's bound arguments, by the conventions of :mod:`lightning_moe.comm` (logical
  payload; an all-reduce counts the ``2(n-1)/n`` of a ring).
- :class:`GroupDims` / :func:`group_dims`: the dim a process group's traffic counts for.
- :func:`resolve_group`: the ``ProcessGroup`` behind any call's ``group`` argument.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lightning_moe._compat import resolve_process_group
from lightning_moe.layout import ACCOUNTED_GROUPS, accounted_dim, accounted_shared_dim

__all__ = [
    "C10D_SENT_BYTES",
    "FUNCOL_SENT_BYTES",
    "OTHER",
    "GroupDims",
    "SentBytes",
    "group_dims",
    "resolve_group",
    "tensor_bytes",
]

OTHER = "other"  # traffic on a process group that is none of the dims' (e.g. a user's own group)

SentBytes = Callable[[Mapping[str, Any], int, int], int]  # (bound arguments, group size, group rank)


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _all_to_all_bytes(tensor: torch.Tensor, splits: list[int] | None, size: int, rank: int) -> int:
    if not splits:
        return tensor_bytes(tensor) * (size - 1) // size
    row_bytes = math.prod(tensor.shape[1:]) * tensor.element_size()  # from the shape: there may be no row
    return (sum(splits) - splits[rank]) * row_bytes


def _broadcast_source(a: Mapping[str, Any]) -> int:
    """The broadcasting rank, in the group's numbering."""
    if a.get("group_src") is not None:
        return a["group_src"]
    return dist.get_group_rank(resolve_group(a.get("group")), a["src"])


def _ring_all_reduce(key: str) -> SentBytes:
    return lambda a, n, r: 2 * tensor_bytes(a[key]) * (n - 1) // n


def _to_every_peer(key: str) -> SentBytes:
    return lambda a, n, r: tensor_bytes(a[key]) * (n - 1)


def _peers_chunks(key: str) -> SentBytes:
    return lambda a, n, r: tensor_bytes(a[key]) // n * (n - 1)


def _list_except_mine(key: str) -> SentBytes:
    return lambda a, n, r: sum(tensor_bytes(t) for i, t in enumerate(a[key]) if i != r)


# Bytes this rank sends to its peers, for each wrapped function of torch.distributed.
C10D_SENT_BYTES: dict[str, SentBytes] = {
    "all_reduce": _ring_all_reduce("tensor"),
    "all_gather": _to_every_peer("tensor"),
    "all_gather_single": _to_every_peer("input_tensor"),
    "all_gather_into_tensor": _to_every_peer("input_tensor"),
    "reduce_scatter": _list_except_mine("input_list"),
    "reduce_scatter_single": _peers_chunks("input"),
    "reduce_scatter_tensor": _peers_chunks("input"),
    "all_to_all": _list_except_mine("input_tensor_list"),
    "all_to_all_single": lambda a, n, r: _all_to_all_bytes(a["input"], a.get("input_split_sizes"), n, r),
    "broadcast": lambda a, n, r: tensor_bytes(a["tensor"]) * (n - 1) if r == _broadcast_source(a) else 0,
    "send": lambda a, n, r: tensor_bytes(a["tensor"]),
}
# The same for the functional collectives (torch.distributed._functional_collectives).
FUNCOL_SENT_BYTES: dict[str, SentBytes] = {
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
    "permute_tensor": lambda a, n, r: tensor_bytes(a["self"]) if a["src_dst"][r] != r else 0,
}  # fmt: skip


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


def resolve_group(group: Any) -> dist.ProcessGroup:
    """The ``ProcessGroup`` of a call's ``group`` argument: ``None`` is the default group;
    functional collectives take ranks, meshes, ``(mesh, dim)`` or names, resolved as they do it."""
    if group is None:
        return dist.group.WORLD
    if isinstance(group, dist.ProcessGroup):
        return group
    return resolve_process_group(group)

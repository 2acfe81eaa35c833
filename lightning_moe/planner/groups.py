"""Group geometry: which global ranks a mesh group holds and how much of its traffic crosses nodes.

Ranks are laid out in the mesh order (pp, dp, ep, cp, tp), row-major: tp neighbours share a node first.
The groups are those of :mod:`lightning_moe.layout`, the spans ``ParallelDims`` builds its meshes from.
Under HSDP a data-parallel group splits in two parts, named ``"<group>:shard"`` (FSDP2's shard group:
the ranks of ``<group>`` in this rank's replica group) and ``"dp:replicate"`` (the ranks of this
rank's dp group at the same place in the other replica groups), as ``ParallelDims``' 2-D FSDP meshes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import lru_cache

from lightning_moe.layout import DENSE_GROUPS, MESH_DIMS, expert_group_spans, spanned_ranks
from lightning_moe.planner.candidate import Layout

# Mesh groups the code communicates on, as the mesh dims they span: the single dims (ep unfolded:
# :func:`group_spans` gives a folded ep group's), the dense view's groups the cost model charges
# (dense: FSDP of dense parameters; token: router and shared expert under tp, expert-bias loads;
# sequence: MoE statistics) and every rank.
GROUP_SPANS: dict[str, tuple[str, ...]] = {
    **{dim: (dim,) for dim in MESH_DIMS},
    "dense": DENSE_GROUPS["dense_grad"],
    "token": DENSE_GROUPS["token"],
    "sequence": DENSE_GROUPS["sequence"],
    "world": MESH_DIMS,
}


HSDP_PARTS: tuple[str, ...] = ("shard", "replicate")


def fsdp_shard_group(layout: Layout, group: str) -> str:
    """The group FSDP2 shards ``group``'s parameters over: ``group`` itself, under HSDP its shard part."""
    return f"{group}:shard" if layout.hsdp else group


def group_spans(layout: Layout, group: str) -> tuple[str, ...]:
    """Mesh dims ``group`` spans: a key of :data:`GROUP_SPANS`, or ``"edp"``, the experts' data-parallel
    mesh, which takes tp in when experts are not tensor-parallel (etp = 1). ``"ep"`` is the expert
    view's all-to-all group: the mesh's ep dim and, folded, the attention dims it spans too. An HSDP
    part (``"dense:shard"``) spans its group's dims, dp only in part."""
    return _group_spans(layout.tp, layout.etp, layout.fold_ep, group)


@lru_cache(maxsize=None)  # a handful of keys: the sizes of tp and etp, the folds and the group names
def _group_spans(tp: int, etp: int, fold_ep: tuple[str, ...], group: str) -> tuple[str, ...]:
    group, _, part = group.partition(":")
    if part and (part not in HSDP_PARTS or "dp" not in _group_spans(tp, etp, fold_ep, group)):
        raise ValueError(f"group {group}:{part}: HSDP splits a data-parallel group into {HSDP_PARTS}")
    if group in ("edp", "ep"):
        return expert_group_spans(tp, etp, fold_ep)[group]
    return GROUP_SPANS[group]


def group_ranks(layout: Layout, group: str, rank: int = 0) -> list[int]:
    """Global ranks of ``rank``'s group ``group`` (a key of :data:`GROUP_SPANS`, ``"edp"``, or an
    HSDP part): a shard part keeps the ranks of ``rank``'s replica group (dp coordinate // dp_shard),
    a replicate part those at its place in every replica group (dp coordinate % dp_shard)."""
    ranks = spanned_ranks(layout.mesh_sizes(), group_spans(layout, group), rank)
    part = group.partition(":")[2]
    if not part:
        return ranks
    shard = layout.dp_shard

    def key(r: int) -> int:
        dp = layout.coordinates(r)["dp"]
        return dp // shard if part == "shard" else dp % shard

    mine = key(rank)
    return [r for r in ranks if key(r) == mine]


def group_size(layout: Layout, group: str) -> int:
    """Ranks of ``group``; an HSDP shard part holds ``1 / dp_replicate`` of its group, a replicate part ``dp_replicate``."""
    return _group_size(layout.mesh, group)  # cached per mesh: see Layout.mesh


@lru_cache(maxsize=2**16)
def _group_size(layout: Layout, group: str) -> int:
    size = math.prod(layout.size(d) for d in group_spans(layout, group))
    part = group.partition(":")[2]
    if part == "shard":
        return size // layout.dp_replicate
    return layout.dp_replicate if part == "replicate" else size


def peer_split(layout: Layout, group: str, gpus_per_node: int) -> tuple[float, float]:
    """``(intra, inter)`` fractions of the bytes a rank sends to its group peers, traffic spread evenly
    over the peers (all-to-all, ring all-gather/reduce-scatter payload), averaged over the group."""
    return _peer_split(layout.mesh, group, gpus_per_node)  # cached per mesh: see Layout.mesh


@lru_cache(maxsize=4096)
def _peer_split(layout: Layout, group: str, gpus_per_node: int) -> tuple[float, float]:
    ranks = group_ranks(layout, group)
    n = len(ranks)
    if n == 1:
        return 1.0, 0.0
    nodes: dict[int, int] = {}
    for r in ranks:
        nodes[r // gpus_per_node] = nodes.get(r // gpus_per_node, 0) + 1
    same = sum(c * (c - 1) for c in nodes.values()) / (n * (n - 1))
    return same, 1.0 - same


def ring_split(layout: Layout, group: str, gpus_per_node: int, wrap: bool = True) -> tuple[float, float]:
    """``(intra, inter)`` fractions of point-to-point hops ``rank -> next rank`` of a group (a ring when
    ``wrap``, a pipeline chain otherwise) that stay inside a node and that cross nodes."""
    return _ring_split(layout.mesh, group, gpus_per_node, wrap)


@lru_cache(maxsize=4096)
def _ring_split(layout: Layout, group: str, gpus_per_node: int, wrap: bool = True) -> tuple[float, float]:
    ranks = group_ranks(layout, group)
    pairs = list(zip(ranks, ranks[1:] + (ranks[:1] if wrap else [])))
    if not pairs:
        return 1.0, 0.0
    same = sum(a // gpus_per_node == b // gpus_per_node for a, b in pairs) / len(pairs)
    return same, 1.0 - same


def group_index(layout: Layout, group: str, coords: Mapping[str, int]) -> int:
    """A rank's index in ``group`` from its mesh coordinates (lightning_moe.parallel.dims: flattened
    row-major; an HSDP shard part counts dp by its place in the replica group, ``dp % dp_shard``)."""
    part = group.partition(":")[2]
    index = 0
    for d in group_spans(layout, group):
        size, c = layout.size(d), coords[d]
        if d == "dp" and part == "shard":
            size, c = layout.dp_shard, c % layout.dp_shard
        elif part == "replicate":
            if d != "dp":
                continue
            size, c = layout.dp_replicate, c // layout.dp_shard
        index = index * size + c
    return index


@lru_cache(maxsize=4096)
def nodes_spanned(layout: Layout, group: str, gpus_per_node: int) -> int:
    """How many nodes of ``gpus_per_node`` ranks rank 0's ``group`` spans (the hierarchical
    dispatcher's first stage runs across them)."""
    return len({r // gpus_per_node for r in group_ranks(layout, group)})

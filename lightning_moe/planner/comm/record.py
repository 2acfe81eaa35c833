"""A collective's record (:class:`CommRecord`: bytes one rank sends per optimizer step) and its split into
intra-node and inter-node bytes by where its group's ranks sit."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from lightning_moe.cp.comm import CpComm
from lightning_moe.layout import PARALLEL_DIMS
from lightning_moe.planner.candidate import Layout
from lightning_moe.planner.cluster import Cluster
from lightning_moe.planner.groups import peer_split, ring_split

# Ring attention's pattern, the plain string ``CommRecord.pattern`` holds, read per record.
_RING = CpComm.RING.value


@dataclass
class CommRecord:
    """Bytes one rank sends per optimizer step (mean over all ranks) for one kind of collective.

    ``dim``: the parallel dimension it serves; ``group``: the group it runs on (a key of
    :data:`~lightning_moe.planner.groups.GROUP_SPANS` or ``"edp"``); ``recorded_as``: the dim
    :mod:`lightning_moe.comm`'s wrapper names (None: a ``torch.distributed`` or functional
    collective, attributed by its group); ``functional``: a DTensor (functional) collective;
    ``pattern``: ``"spread"`` (to all peers) or ``"ring"``/``"chain"`` (to the next rank; ``"ring"`` is
    ring attention's, ``CpComm.RING``, wrapping around the cp group);
    ``overlapped``: the code overlaps it with compute; ``reduction``: a gradient reduction (FSDP2's
    reduce-scatters, HSDP's all-reduce), whose last one per step waits for the last backward
    (:func:`~lightning_moe.planner.step_time.overlap_budget`); ``split``: the ``(intra, inter)``
    node share of its bytes where its group is not one of the layout's (the hierarchical
    dispatcher's stages: across nodes only, inside the node only); ``all_to_all``: an all-to-all outside ep
    (ep's are known by their dim), whose bytes to in-node and to other nodes' peers flow at once,
    each tier at its own pace, where a ring collective over a group that spans nodes runs at the
    slowest link's (:func:`~lightning_moe.planner.step_time.record_seconds`).
    """

    what: str
    dim: str
    group: str
    bytes: float
    calls: float
    recorded_as: str | None = None
    functional: bool = False
    pattern: str = "spread"
    overlapped: bool = False
    routing_dependent: bool = False
    all_to_all: bool = False
    reduction: bool = False
    split: tuple[float, float] | None = None


def record_split(rec: CommRecord, layout: Layout, cluster: Cluster) -> tuple[float, float]:
    """``(intra, inter)`` fractions of ``rec``'s bytes that stay inside a node and that cross nodes."""
    if rec.split is not None:
        return rec.split
    if rec.pattern == "spread":
        return peer_split(layout, rec.group, cluster.gpus_per_node)
    return ring_split(layout, rec.group, cluster.gpus_per_node, wrap=rec.pattern == _RING)


def comm_bytes_by_dim(records: Iterable[CommRecord], layout: Layout, cluster: Cluster) -> dict[str, dict[str, float]]:
    """``{dim: {"intra": bytes, "inter": bytes}}`` per optimizer step and rank."""
    out = {d: {"intra": 0.0, "inter": 0.0} for d in PARALLEL_DIMS}
    for rec in records:
        intra, inter = record_split(rec, layout, cluster)
        out[rec.dim]["intra"] += rec.bytes * intra
        out[rec.dim]["inter"] += rec.bytes * inter
    return out

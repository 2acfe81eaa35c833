"""Communication as :class:`~lightning_moe.callbacks.CommAccountingCallback` records it: the planned
bytes mapped onto the dims under which the callback counts them, for checks against real runs."""

from __future__ import annotations

from lightning_moe.layout import ACCOUNTED_GROUPS, MESH_DIMS, PARALLEL_DIMS, accounted_dim, accounted_shared_dim
from lightning_moe.planner.candidate import Layout
from lightning_moe.planner.comm import comm_records
from lightning_moe.planner.comm.record import CommRecord
from lightning_moe.planner.groups import group_spans
from lightning_moe.planner.model_shape import ModelShape


def _accounted_dim(rec: CommRecord, layout: Layout) -> str:
    """The dim :class:`~lightning_moe.callbacks.comm_accounting.GroupDims` gives ``rec``'s traffic.

    A mesh group that spans every rank is torch's default group: it is looked up by its ranks
    (the first matching entry of the accounting's table; a functional collective takes the first
    that is not dp). Any other mesh group counts for dp when it includes dp, else for its first dim
    of size > 1.
    """
    if rec.recorded_as is not None:
        return rec.recorded_as
    if ":" in rec.group:
        # an HSDP part (FSDP2's shard or replica mesh dim, "dp_shard_ep_cp", "dp_replicate",
        # "edp_shard"): the accounting charges it to dp, as on any rank set it shares (gradient groups first)
        return "dp"
    spans = group_spans(layout, rec.group)
    busy = {d for d in MESH_DIMS if layout.size(d) > 1}
    if busy and busy <= set(spans):  # the default group
        matches = []
        for spanned, dim in ACCOUNTED_GROUPS:
            if busy <= set(spanned) and dim not in matches:
                matches.append(dim)
        return accounted_shared_dim(matches, rec.functional) if matches else "other"
    return accounted_dim(spans, layout.mesh_sizes()) or "other"


def accounted_comm_bytes(
    model: ModelShape,
    layout: Layout,
    seq_len: int,
    precision: str = "32-true",
    *,
    ep_ranks_per_token: float | None = None,
) -> dict[str, float]:
    """Bytes per optimizer step and rank, per dim, as ``comm/<dim>_bytes`` of
    :class:`~lightning_moe.callbacks.CommAccountingCallback` records them (mean over ranks);
    ``ep_ranks_per_token``: as :func:`~lightning_moe.planner.comm.comm_records` takes it.

    Example::

        accounted_comm_bytes(shape, Layout(ep=2, microbatches=2), seq_len=32)["ep"]
    """
    out = {d: 0.0 for d in (*PARALLEL_DIMS, "other")}
    for rec in comm_records(model, layout, seq_len, precision, ep_ranks_per_token=ep_ranks_per_token):
        out[_accounted_dim(rec, layout)] += rec.bytes
    return out

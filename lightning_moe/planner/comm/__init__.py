"""Communication: every collective of one optimizer step, in bytes per rank, split intra/inter-node.

From the same collectives the code issues, counted by the conventions of :mod:`lightning_moe.comm`
(bytes a rank sends to its peers; an all-reduce counts ``2 (n-1)/n``: :mod:`.collective_bytes`), each
recorded as a :class:`~.record.CommRecord` and split into intra-node and inter-node bytes by where
its group's ranks sit (:func:`~.record.record_split`). One module per parallel dimension issues its
records from the step's counts (:class:`~.step.StepCounts`):

- :mod:`.tp`: sequence parallelism's all-gathers and reduce-scatters, the replicated weights'
  gradient all-reduces, expert tensor parallelism's rows;
- :mod:`.cp`: ring or all-to-all attention, the MoE statistics over the sequence group;
- :mod:`.ep`: each dispatcher kind's token exchange, keyed by ``DispatcherKind``;
- :mod:`.dp`: FSDP2's gathers and reductions, HSDP's replica all-reduce, the token group's load
  statistics, Lightning's per-batch flag;
- :mod:`.pp`: the stage boundaries, the loss's broadcasts, the tied embedding's gradient sum.

:func:`comm_records` gathers them.
"""

from __future__ import annotations

from lightning_moe.planner.candidate import Layout
from lightning_moe.planner.comm.cp import cp_records
from lightning_moe.planner.comm.dp import dp_records, sigterm_flag_records
from lightning_moe.planner.comm.ep import ep_records
from lightning_moe.planner.comm.pp import pp_records
from lightning_moe.planner.comm.record import CommRecord
from lightning_moe.planner.comm.step import StepCounts
from lightning_moe.planner.comm.tp import tp_records
from lightning_moe.planner.model_shape import ModelShape


def comm_records(
    model: ModelShape,
    layout: Layout,
    seq_len: int,
    precision: str = "32-true",
    *,
    gpus_per_node: int | None = None,
    ep_ranks_per_token: float | None = None,
) -> list[CommRecord]:
    """Every collective of one optimizer step, bytes per rank averaged over all ranks.

    Expert dispatch bytes assume balanced routing: each token slot lands on any ep rank with equal
    probability, so ``(ep - 1) / ep`` of a rank's slots leave it (and as many arrive); dropless.
    ``dispatcher="alltoall_dedup"`` (the default) sends a token once per other ep rank among the
    ranks holding its experts: ``ep_ranks_per_token`` of them on average, by default the expectation
    of uniform routing (:func:`~.ep.expected_nodes_per_token`, each rank a "node" of ``E / ep``); pass
    a measured or replayed routing's mean to count that routing's rows.
    Everything else is deterministic. Sequence parallelism is on (the strategy's default).
    ``gpus_per_node``: where nodes begin, which the hierarchical dispatcher needs (its stages are the
    ep group's nodes and the ranks inside each). A collective a rank never runs (the dense FFN's
    under tp where every layer is MoE, say) leaves no record.

    Example::

        comm_records(shape, Layout(ep=4, microbatches=2), seq_len=4096, precision="bf16-mixed")
        comm_records(shape, Layout(ep=2, microbatches=2), 32, ep_ranks_per_token=2.0)  # every token on both ranks
    """
    step = StepCounts.of(model, layout, seq_len, precision, gpus_per_node=gpus_per_node,
                         ep_ranks_per_token=ep_ranks_per_token)  # fmt: skip
    # Lightning's flag last, after every dim's: the step time adds the records' seconds in this order.
    records = [*tp_records(step), *cp_records(step), *ep_records(step), *dp_records(step), *pp_records(step),
               *sigterm_flag_records(step)]  # fmt: skip
    return [rec for rec in records if rec.bytes or rec.calls]

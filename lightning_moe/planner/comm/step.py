"""What one optimizer step runs on a rank, averaged over the pipeline ranks: the counts every
dimension's records multiply (micro-batches, blocks of each kind, tokens, gradient reductions)."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_moe.planner.candidate import Layout
from lightning_moe.planner.dtypes import ACTIVATION_BYTES
from lightning_moe.planner.model_shape import ModelShape


@dataclass
class StepCounts:
    """One optimizer step of ``model`` under ``layout`` on ``seq_len`` tokens a sample, per rank.

    Averages over the pipeline ranks, each holding ``1/pp`` of the world: ``first`` and ``last``, the
    share of ranks holding the first stage (the embedding) and the last (final norm, output, the MTP
    depths); ``mtp_blocks``, the MTP depths' blocks (each one more block of the last layer's kind, on
    the last stage: :mod:`lightning_moe.planner.mtp`); ``layers``, ``moe_layers`` and
    ``dense_layers``, the blocks of each kind a rank runs, MTP's included. The expert dispatch's byte
    models take two more facts: ``gpus_per_node``, where nodes begin (the hierarchical dispatcher's
    stages are the ep group's nodes; None: not given), and ``ep_ranks_per_token``, the mean number of
    distinct ep ranks holding a token's experts (None: uniform routing's expectation).
    """

    model: ModelShape
    layout: Layout
    seq_len: int
    precision: str
    first: float
    last: float
    mtp_blocks: float
    layers: float
    moe_layers: float
    dense_layers: float
    gpus_per_node: int | None = None
    ep_ranks_per_token: float | None = None

    @classmethod
    def of(
        cls,
        model: ModelShape,
        layout: Layout,
        seq_len: int,
        precision: str,
        *,
        gpus_per_node: int | None = None,
        ep_ranks_per_token: float | None = None,
    ) -> StepCounts:
        """The counts of ``model`` under ``layout``, the blocks averaged over the pipeline ranks."""
        pp = layout.pp
        first = last = 1.0 / pp
        mtp_blocks = model.mtp_depth * last
        mtp_moe = model.is_moe(model.num_layers - 1)
        return cls(
            model, layout, seq_len, precision, first, last, mtp_blocks,
            layers=model.num_layers / pp + mtp_blocks,
            moe_layers=model.num_moe_layers / pp + (mtp_blocks if mtp_moe else 0),
            dense_layers=(model.num_layers - model.num_moe_layers) / pp + (0 if mtp_moe else mtp_blocks),
            gpus_per_node=gpus_per_node, ep_ranks_per_token=ep_ranks_per_token,
        )  # fmt: skip

    @property
    def activation_bytes(self) -> int:
        """Bytes of an activation element (the compute dtype of :attr:`precision`)."""
        return ACTIVATION_BYTES[self.precision]

    @property
    def seq_local(self) -> int:
        """Tokens of one sample on a cp rank."""
        return self.seq_len // self.layout.cp

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch a rank routes and dispatches: its sequence-parallel shard over tp."""
        return self.layout.micro_batch_size * self.seq_local // self.layout.tp

    @property
    def dispatch_chunks(self) -> int:
        """The chunks an MoE layer dispatches a rank's :attr:`tokens` in (``MoELayer``: ``dispatch_chunks``,
        at most one per token). Each exchanges counts of its own, while its rows are a share of the
        whole; records keep one call per micro-batch and layer, and the step time charges each chunk's
        extra calls (:func:`~lightning_moe.planner.step_time.estimate`)."""
        return max(1, min(self.model.dispatch_chunks, int(self.tokens)))


def fsdp_reduces(layout: Layout) -> int:
    """FSDP2 gradient reductions per optimizer step: once with ``gather_once_per_step`` (gradient
    sync only after the step's last backward), after every micro-batch's backward (pp = 1), or at the
    end of each pipeline step (pp > 1, ``lightning_moe._compat.pipeline_stage_class``'s
    ``backward_maybe_with_nosync``)."""
    if layout.gather_once_per_step:
        return 1
    return layout.pipeline_steps if layout.pp > 1 else layout.microbatches


def fsdp_gathers(layout: Layout, root: bool) -> int:
    """FSDP2 all-gathers of one unit per optimizer step: once with ``gather_once_per_step``; once per
    pipeline step under the V schedules (``PipelineRunner`` keeps their stages gathered until the
    step's weight gradients); otherwise in every micro-batch's forward and, for a unit that is not a
    root (which FSDP2 reshards after forward), again in its backward."""
    if layout.gather_once_per_step:
        return 1
    if layout.v_schedule:
        return layout.pipeline_steps
    return (1 if root else 2) * layout.microbatches

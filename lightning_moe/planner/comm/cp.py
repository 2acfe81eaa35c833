"""Context parallelism's collectives: ring attention's K/V shifts or all-to-all (Ulysses) attention's
exchanges (``Layout.cp_comm``), the MoE statistics' all-reduces over the sequence group (cp x tp) and
the pipeline's loss-token count."""

from __future__ import annotations

from lightning_moe.cp.comm import CpComm
from lightning_moe.layout import ulysses_bytes_per_rank
from lightning_moe.planner.comm.collective_bytes import all_reduce_bytes
from lightning_moe.planner.comm.record import CommRecord
from lightning_moe.planner.comm.step import StepCounts
from lightning_moe.planner.dtypes import FP32_BYTES, FP64_BYTES

# The kinds as the plain strings ``Layout.cp_comm`` and ``CommRecord.pattern`` hold, read per layout.
_RING, _A2A = CpComm.RING.value, CpComm.A2A.value


def ulysses_attention_bytes(
    batch: int,
    heads: int,
    kv_heads: int,
    seq_len: int,
    head_dim: int,
    cp: int,
    dtype_bytes: int,
    *,
    backward: bool = True,
) -> int:
    """Bytes one rank sends to its cp peers in the all-to-alls of one attention call under
    ``cp_comm="a2a"`` (all-to-all, Ulysses context parallelism).

    Arguments:

    - ``batch``: samples of the micro-batch;
    - ``heads``, ``kv_heads``: query and key/value heads of the rank's attention, i.e. per tp rank
      (``num_heads // tp``, ``num_kv_heads // tp``);
    - ``seq_len``: the full sequence (each cp rank holds ``seq_len / cp`` tokens of it);
    - ``head_dim``: elements per head (q, k, v and the output share it);
    - ``cp``: the cp group's size (0 bytes for cp = 1);
    - ``dtype_bytes``: bytes per element exchanged, the activations' dtype
      (:data:`~lightning_moe.planner.dtypes.ACTIVATION_BYTES`: the runtime casts q, k, v to the
      autocast dtype before the exchange, so 2 under ``bf16-mixed``, 4 under ``32-true``);
    - ``backward``: add the backward's all-to-alls (dQ, dK, dV back to sequence shards and dO to
      head shards: the same bytes again); False gives the forward's alone
      (:func:`lightning_moe.layout.ulysses_bytes_per_rank`, which the runtime's accounting uses too).

    Forward: one all-to-all of Q, K and V (K and V with
    :func:`~lightning_moe.layout.ulysses_kv_heads` heads, repeated up to a multiple of cp) from
    ``[batch, H, seq_len/cp, head_dim]`` sequence shards to head shards, one of the output back. Of a
    tensor of ``n`` elements per rank a rank sends the ``(cp - 1) / cp`` bound for its peers:
    ``n = batch x (2 heads + 2 kv') x seq_len / cp x head_dim``, and the forward sends
    ``n (cp - 1) / cp x dtype_bytes``. Independent of the mask (causal or document-causal); the
    document ids' all-gather of packed batches is not counted.

    Example::

        ulysses_attention_bytes(1, 8, 2, 4096, 128, cp=4, dtype_bytes=2)   # 2 x 3/4 x (8+8+4+4) x 1024 x 128 x 2
    """
    forward = ulysses_bytes_per_rank(batch, heads, kv_heads, seq_len, head_dim, cp, dtype_bytes)
    return 2 * forward if backward else forward


def cp_records(step: StepCounts) -> list[CommRecord]:
    """The cp group's collectives of one optimizer step, and the sequence group's (cp x tp), which the
    comm accounting records as cp.

    - MoE statistics: each MoE layer all-reduces its routing sums over the sequence group (tokens and
      router probability per expert, four scalars; under ``seq_aux_loss`` the per-sample ones too);
    - all-to-all attention (``cp_comm="a2a"``), not overlapped: the exchange sits between the
      projections and the attention kernel; forward, Q/K/V in one all-to-all and the output in
      another; backward, their gradients, as many bytes again (:func:`ulysses_attention_bytes`);
    - ring attention: ``cp - 1`` shifts of (K, V) forward, and in backward ``cp - 1`` of (K, V) and
      ``cp`` of the fp32 (dK, dV), overlapped with the block compute;
    - under pp > 1, each pipeline step all-reduces each sample's loss-token count (float64) over cp.
    """
    model, layout = step.model, step.layout
    tp, cp, pp = layout.tp, layout.cp, layout.pp
    a, b, m = step.activation_bytes, layout.micro_batch_size, layout.microbatches
    layers, moe = step.layers, step.moe_layers
    records = []
    n_seq = cp * tp
    if n_seq > 1 and moe:
        totals = all_reduce_bytes((2 * model.num_experts + 4) * FP32_BYTES, n_seq)
        records.append(CommRecord("MoE statistics all-reduce", "cp", "sequence", totals * m * moe, m * moe,
                                  recorded_as="cp"))  # fmt: skip
        if model.load_balancing == "seq_aux_loss":
            seq_totals = all_reduce_bytes(b * (2 * model.num_experts + 1) * FP32_BYTES, n_seq)
            records.append(CommRecord("sequence aux-loss all-reduce", "cp", "sequence", seq_totals * m * moe, m * moe,
                                      recorded_as="cp"))  # fmt: skip
    if cp == 1:
        return records
    heads, kv_heads = model.num_heads // tp, model.num_kv_heads // tp  # those of a tp rank
    if layout.cp_comm == _A2A:
        per_attention = ulysses_attention_bytes(b, heads, kv_heads, step.seq_len, model.head_dim, cp, a)
        records.append(CommRecord("all-to-all attention Q/K/V and output", "cp", "cp", per_attention * m * layers,
                                  4 * m * layers, all_to_all=True))  # fmt: skip
    else:
        kv_block = b * kv_heads * step.seq_local * model.head_dim
        per_attention = (2 * (cp - 1) * 2 * kv_block * a) + cp * 2 * kv_block * FP32_BYTES
        records.append(CommRecord("ring attention K/V and dK/dV", "cp", "cp", per_attention * m * layers,
                                  (3 * cp - 2) * m * layers, pattern=_RING, overlapped=True))  # fmt: skip
    if pp > 1:
        counts = all_reduce_bytes(b * layout.pipeline_microbatches * FP64_BYTES, cp)  # each sample's, per pipeline step
        steps = layout.pipeline_steps
        records.append(CommRecord("loss-token count all-reduce", "cp", "cp", counts * steps, steps))
    return records

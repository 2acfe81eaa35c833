"""The memory-bound work beside the GEMMs: norms, residual adds, rotary embedding, the SwiGLU
activation, the router's softmax, the experts' permutation and the loss, as HBM bytes per micro-batch.

These ops move every element they touch through HBM at least once in and once out (eager torch runs
each as its own kernel), so their time is bytes over the HBM bandwidth the cluster's
``elementwise_efficiency`` grants; the GEMM peak never sees them.
"""

from __future__ import annotations

from collections.abc import Iterable

from lightning_moe.planner.candidate import Layout
from lightning_moe.planner.dtypes import ACTIVATION_BYTES, FP32_BYTES
from lightning_moe.planner.model_shape import ModelShape
from lightning_moe.planner.mtp import mtp_elementwise_bytes_per_token

# A backward reads the forward's input and the output's gradient and writes the input's gradient:
# twice a forward's traffic, the same ratio as the GEMMs' 2 x forward FLOPs.
BACKWARD_TRAFFIC = 2.0
# Cross-entropy in fp32 over the logits: the upcast copy is written and read twice (log-softmax, then
# the gathered target and its gradient) besides the bf16 logits read once.
LOSS_PASSES_FP32 = 3


def elementwise_bytes_per_microbatch(
    model: ModelShape, layout: Layout, seq_len: int, layers: Iterable[int], last: bool, precision: str
) -> float:
    """HBM bytes the memory-bound ops of one micro-batch's forward move on one rank.

    Per token and layer, with ``a`` bytes per activation element (``ACTIVATION_BYTES``): two RMSNorms
    (read and write ``h``) and two residual adds (read ``2h``, write ``h``); rotary embedding of q and
    k (read and write them); a dense FFN's SwiGLU (read ``2F``, write ``F``); an MoE layer's router
    softmax over ``E`` fp32 scores, and per routed slot the permutation and the weighted un-permutation
    (read and write ``h`` each) and the SwiGLU of ``F_e``, and the shared expert's SwiGLU; the last
    stage's loss over the vocabulary, and there the multi-token prediction depths'
    (:func:`~lightning_moe.planner.mtp.mtp_elementwise_bytes_per_token`). Each rank holds ``1/tp`` of
    these elements (sequence-parallel norms, heads and FFN columns over tp); tokens are the rank's
    ``micro_batch x seq_len / cp``.

    Example::

        elementwise_bytes_per_microbatch(shape, Layout(ep=2), 4096, range(shape.num_layers), True, "bf16-mixed")
    """
    a = ACTIVATION_BYTES[precision]
    h = model.hidden_size
    tokens = layout.micro_batch_size * seq_len / layout.cp
    norms_and_residuals = 2 * (2 * h) + 2 * (3 * h)
    rotary = 2 * (model.q_dim + model.kv_dim)
    attention_part = (norms_and_residuals + rotary) * a
    dense_ffn = 3 * model.ffn_hidden_size * a
    shared = 3 * model.shared_expert_hidden_size * a if model.shared_expert_hidden_size else 0
    routed = model.top_k * (2 * (2 * h) + 3 * model.moe_ffn_hidden_size) * a
    router = 2 * model.num_experts * FP32_BYTES

    def layer(i: int) -> float:
        return attention_part + (router + routed + shared if model.is_moe(i) else dense_ffn)

    per_token = sum(layer(i) for i in layers)
    if last:
        loss = model.vocab_size * (a + LOSS_PASSES_FP32 * FP32_BYTES)
        per_token += loss + mtp_elementwise_bytes_per_token(model, layer(model.num_layers - 1), loss, precision)
    return per_token * tokens / layout.tp

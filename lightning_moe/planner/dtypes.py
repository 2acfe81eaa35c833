"""Bytes per element of what the code keeps and sends, by training precision (each with its source)."""

from __future__ import annotations

PRECISIONS: tuple[str, ...] = ("32-true", "bf16-mixed")

# Bytes per element. fp32 master weights, fp32 gradients and two fp32 Adam moments: what the code
# keeps (torch.optim.AdamW on FSDP2's fp32 sharded parameters).
FP32_BYTES = 4  # IEEE 754 single
BF16_BYTES = 2  # bfloat16
FP64_BYTES = 8  # IEEE 754 double
INT64_BYTES = 8  # token counts exchanged by the dispatchers (torch.bincount gives int64)
INT32_BYTES = 4  # the hierarchical dispatcher's node-local expert ids (lightning_moe.moe.hierarchical)
ADAM_STATE_BYTES = 2 * FP32_BYTES  # exp_avg and exp_avg_sq (torch.optim.AdamW)
# Activation bytes per element that cross the network or are stored, by training precision.
# "bf16-mixed" is torch.autocast: GEMM outputs are bf16; ring attention's dK/dV accumulators and the
# router's logits stay fp32 (lightning_moe.cp.ring_attention, lightning_moe.moe.router).
ACTIVATION_BYTES = {"32-true": FP32_BYTES, "bf16-mixed": BF16_BYTES}
# FSDP2 all-gathers parameters in the MixedPrecisionPolicy's param_dtype (bf16 under "bf16-mixed",
# none under "32-true") and reduce-scatters gradients in its reduce_dtype, fp32 under both
# (lightning_moe.parallel.plans.precision.mixed_precision_policy).
FSDP_GATHER_BYTES = {"32-true": FP32_BYTES, "bf16-mixed": BF16_BYTES}
FSDP_REDUCE_BYTES = FP32_BYTES

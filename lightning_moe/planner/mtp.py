"""Multi-token prediction's compute on the last pipeline stage (``MoEGPT(mtp_depth=D)``).

Each depth runs one transformer block (MoE when the last layer is), the projection
``eh_proj [hidden, 2 * hidden]`` and the shared output head over the same tokens as the main model.
Its parameters and activations are not in the memory model yet.
"""

from __future__ import annotations

from lightning_moe.planner.candidate import Layout
from lightning_moe.planner.model_shape import ModelShape

__all__ = ["mtp_flops_per_microbatch"]


def mtp_flops_per_microbatch(model: ModelShape, layout: Layout, seq_len: int) -> dict[str, float]:
    """Forward FLOPs of the ``model.mtp_depth`` MTP modules on one rank of the last stage, by op kind
    (the keys of :func:`lightning_moe.planner.flops.flops_per_microbatch`).

    Example::

        mtp_flops_per_microbatch(ModelShape(mtp_depth=1), Layout(), seq_len=4096)["dense"]
    """
    from lightning_moe.planner.flops import flops_per_microbatch

    if not model.mtp_depth:
        return {"dense": 0.0, "shared_expert": 0.0, "expert": 0.0, "attention": 0.0}
    block = flops_per_microbatch(model, layout, seq_len, [model.num_layers - 1], last=False)
    tokens = layout.micro_batch_size * seq_len / layout.cp
    h = model.hidden_size
    # eh_proj runs on the tp rank's sequence shard, the head on the vocabulary shard: both / tp.
    block["dense"] += 2 * tokens * (2 * h * h + h * model.vocab_size) / layout.tp
    return {kind: model.mtp_depth * value for kind, value in block.items()}

"""Step outputs under context parallelism, back in the original sequence order.

Under ``cp > 1`` each rank holds a zigzag shard of every sequence, so a ``predict_step`` returns
per-token outputs (logits, hidden states) for the shard only, in zigzag order.
:func:`gather_sequence_outputs` all-gathers them over the cp group and undoes the zigzag: every cp
rank returns the full sequences in their original order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_moe.cp import zigzag_unshard


def gather_sequence_outputs(output: Any, local_seq_len: int, group: dist.ProcessGroup) -> Any:
    """Every tensor of ``output`` (nested dicts, tuples, lists) whose dim 1 is ``local_seq_len``,
    gathered over ``group`` and un-zigzagged on dim 1; other values are returned as they are.

    Example::

        logits = model(batch["input_ids"])                       # [B, S/cp, V], zigzag order
        full = gather_sequence_outputs(logits, batch["input_ids"].shape[1], cp_group)   # [B, S, V]
    """
    if isinstance(output, torch.Tensor):
        if output.dim() < 2 or output.shape[1] != local_seq_len:
            return output
        local = output.contiguous()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local, group=group)
        return zigzag_unshard(parts, dim=1)
    if isinstance(output, dict):
        return type(output)({k: gather_sequence_outputs(v, local_seq_len, group) for k, v in output.items()})
    if isinstance(output, (tuple, list)):
        return type(output)(gather_sequence_outputs(v, local_seq_len, group) for v in output)
    return output

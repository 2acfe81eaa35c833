"""Communication accounting: every collective our code issues goes through these wrappers.

Each wrapper records, under a parallel-dimension name (``"tp"``, ``"cp"``, ``"ep"``, ``"dp"``,
``"pp"``), the bytes this rank sends to *other* ranks and the number of calls, forward and
backward alike (the backward of a differentiable collective is recorded through a gradient hook).
Bytes are logical payload: an all-to-all counts the splits addressed to other ranks, an all-gather
counts the local tensor once per peer, a reduce-scatter counts the chunks owned by peers.

Example::

    from lightning_moe import comm
    comm.reset()
    ...  # run a step
    comm.snapshot()   # {"ep": {"bytes": 123456, "calls": 8}}
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist

from lightning_moe._compat import funcol

COUNTERS: defaultdict[str, dict[str, int]] = defaultdict(lambda: {"bytes": 0, "calls": 0})


def record(dim: str, nbytes: int) -> None:
    entry = COUNTERS[dim]
    entry["bytes"] += int(nbytes)
    entry["calls"] += 1


def reset() -> None:
    COUNTERS.clear()


def snapshot() -> dict[str, dict[str, int]]:
    return {dim: dict(entry) for dim, entry in COUNTERS.items()}


def _record_backward(output: torch.Tensor, dim: str, nbytes: int) -> None:
    if output.requires_grad:
        output.register_hook(lambda grad: record(dim, nbytes))


def all_to_all_counts(counts: torch.Tensor, group: dist.ProcessGroup, dim: str) -> torch.Tensor:
    """Exchange one equal-sized block per rank (e.g. token counts per expert); not differentiable."""
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts, group=group)
    size = dist.get_world_size(group)
    record(dim, counts.numel() * counts.element_size() * (size - 1) // size)
    return out


def all_to_all_autograd(
    x: torch.Tensor,
    output_split_sizes: list[int],
    input_split_sizes: list[int],
    group: dist.ProcessGroup,
    dim: str,
) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` with uneven splits along dim 0."""
    me = dist.get_rank(group)
    row_bytes = math.prod(x.shape[1:]) * x.element_size()
    sent = (sum(input_split_sizes) - input_split_sizes[me]) * row_bytes
    received = (sum(output_split_sizes) - output_split_sizes[me]) * row_bytes
    record(dim, sent)
    out = funcol.all_to_all_single_autograd(x, output_split_sizes, input_split_sizes, group)
    out = funcol.wait_tensor(out)
    # The backward all-to-all sends back what this rank received.
    _record_backward(out, dim, received)
    return out


def all_gather_autograd(x: torch.Tensor, group: dist.ProcessGroup, dim: str) -> torch.Tensor:
    """Differentiable all-gather along dim 0 (backward: reduce-scatter)."""
    size = dist.get_world_size(group)
    nbytes = x.numel() * x.element_size()
    record(dim, nbytes * (size - 1))
    out = funcol.wait_tensor(funcol.all_gather_single_autograd(x, 0, group))
    _record_backward(out, dim, nbytes * (size - 1))
    return out


def reduce_scatter_autograd(x: torch.Tensor, group: dist.ProcessGroup, dim: str) -> torch.Tensor:
    """Differentiable sum reduce-scatter along dim 0 (backward: all-gather)."""
    size = dist.get_world_size(group)
    chunk_bytes = x.numel() * x.element_size() // size
    record(dim, chunk_bytes * (size - 1))
    out = funcol.wait_tensor(funcol.reduce_scatter_single_autograd(x, "sum", 0, group))
    _record_backward(out, dim, chunk_bytes * (size - 1))
    return out


def gather_to(
    tensor: torch.Tensor, received: list[torch.Tensor] | None, owner: int, group: dist.ProcessGroup, dim: str
) -> None:
    """``dist.gather`` of equal-sized ``tensor``s into ``received`` on the global rank ``owner``."""
    if dist.get_rank() != owner:
        record(dim, tensor.numel() * tensor.element_size())
    dist.gather(tensor, received, dst=owner, group=group)


def scatter_from(
    output: torch.Tensor, pieces: list[torch.Tensor] | None, owner: int, group: dist.ProcessGroup, dim: str
) -> None:
    """``dist.scatter`` of the equal-sized ``pieces`` on the global rank ``owner`` into ``output``."""
    if dist.get_rank() == owner:
        record(dim, output.numel() * output.element_size() * (dist.get_world_size(group) - 1))
    dist.scatter(output, pieces, src=owner, group=group)


def all_reduce_(
    tensor: torch.Tensor, group: dist.ProcessGroup | None, dim: str, op: dist.ReduceOp = dist.ReduceOp.SUM
) -> torch.Tensor:
    """In-place, non-differentiable all-reduce (statistics, counts); a no-op for a 1-rank group."""
    if group is None or dist.get_world_size(group) == 1:
        return tensor
    size = dist.get_world_size(group)
    record(dim, 2 * tensor.numel() * tensor.element_size() * (size - 1) // size)
    dist.all_reduce(tensor, op=op, group=group)
    return tensor


class _SplitForwardGatherBackward(torch.autograd.Function):
    """Forward: keep this rank's chunk of a tensor replicated over ``group``; backward: all-gather.

    For a replicated activation whose consumers are replicated too, every rank needs the whole
    gradient back (Megatron's ``scatter_to_sequence_parallel_region``).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, dim: int, dim_name: str) -> torch.Tensor:  # noqa: ANN001
        ctx.group, ctx.dim, ctx.dim_name = group, dim, dim_name
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        return x.chunk(size, dim)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        return _gather(grad.contiguous(), ctx.group, ctx.dim, ctx.dim_name), None, None, None


class _GatherForwardSplitBackward(torch.autograd.Function):
    """Forward: all-gather chunks into the replicated tensor; backward: keep this rank's chunk."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, dim: int, dim_name: str) -> torch.Tensor:  # noqa: ANN001
        ctx.group, ctx.dim = group, dim
        return _gather(x.contiguous(), group, dim, dim_name)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, ctx.dim)[rank].contiguous(), None, None, None


def _gather(x: torch.Tensor, group: dist.ProcessGroup, dim: int, dim_name: str) -> torch.Tensor:
    size = dist.get_world_size(group)
    record(dim_name, x.numel() * x.element_size() * (size - 1))
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim)


def split_to_rank(x: torch.Tensor, group: dist.ProcessGroup, dim: int, dim_name: str) -> torch.Tensor:
    """This rank's chunk of a tensor replicated over ``group`` (gradient all-gathered back)."""
    return _SplitForwardGatherBackward.apply(x, group, dim, dim_name)


def gather_from_ranks(x: torch.Tensor, group: dist.ProcessGroup, dim: int, dim_name: str) -> torch.Tensor:
    """Concatenate every rank's chunk along ``dim`` (gradient: this rank's chunk only)."""
    return _GatherForwardSplitBackward.apply(x, group, dim, dim_name)


def all_gather_uneven_autograd(x: torch.Tensor, sizes: list[int], group: dist.ProcessGroup, dim: str) -> torch.Tensor:
    """Concatenate every rank's ``[sizes[r], ...]`` rows (backward: sum-reduce-scatter of the grads).

    Built on the uneven all-to-all: this rank sends its rows to every peer.
    """
    size = dist.get_world_size(group)
    return all_to_all_autograd(x.repeat(size, *([1] * (x.dim() - 1))), sizes, [x.shape[0]] * size, group, dim)


def reduce_scatter_uneven_autograd(
    x: torch.Tensor, sizes: list[int], group: dist.ProcessGroup, dim: str
) -> torch.Tensor:
    """Sum over ranks of row block ``r`` of ``x`` lands on rank r (inverse of :func:`all_gather_uneven_autograd`)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    mine = sizes[rank]
    received = all_to_all_autograd(x, [mine] * size, sizes, group, dim)
    return received.view(size, mine, *x.shape[1:]).sum(0)

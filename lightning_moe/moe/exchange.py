"""The token all-to-all of the expert-parallel dispatchers: differentiable, asynchronous, low precision.

:func:`exchange_start` issues ``all_to_all_single`` with uneven splits along dim 0 without
waiting; :func:`exchange_wait` waits and returns the received rows. Between the two the caller
computes (expert GEMMs of another chunk, the shared expert): that is the overlap of
``MoELayer(dispatch_chunks=n)``. :func:`exchange` does both at once. The backward runs the reverse
all-to-all, issued when the received rows' gradient arrives and waited for when the input's gradient
is needed. Right after issuing one, forward or backward, control passes to the other micro-batch
under :mod:`lightning_moe.comm.interleave`.

``wire`` is what travels (``MoELayer(dispatch_dtype=...)``):

- ``None``: the rows as they are; their gradient as it is;
- ``"bf16"``: the rows in bf16, the gradient in bf16;
- ``"fp8"``: each row as ``float8_e4m3fn`` with one fp32 scale (``amax / 448``) packed behind it,
  sent as raw bytes (``uint8``: gloo has no float8); the gradient in bf16.

The receiver casts back to the sender's dtype. Bytes are recorded in :mod:`lightning_moe.comm` under
``"ep"`` (what is sent to other ranks, forward and backward), and, when ``remote`` marks which
peers sit on another node, under ``"ep_internode"`` (what is sent to those peers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lightning_moe import comm
from lightning_moe.comm.interleave import hand_off

__all__ = [
    "WIRES",
    "INTERNODE",
    "Exchange",
    "check_wire",
    "exchange",
    "exchange_splits",
    "exchange_start",
    "exchange_wait",
]

WIRES: tuple[str | None, ...] = (None, "bf16", "fp8")
INTERNODE = "ep_internode"  # the comm counter of bytes sent to ranks on other nodes
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def check_wire(wire: str | None) -> None:
    """Raise ``ValueError`` for an unknown wire format or fp8 on a torch without float8 dtypes."""
    if wire not in WIRES:
        raise ValueError(f"dispatch_dtype={wire!r} is unknown: choose one of {WIRES}")
    if wire == "fp8" and not hasattr(torch, "float8_e4m3fn"):
        raise ValueError(
            f"dispatch_dtype='fp8' needs torch.float8_e4m3fn, which torch {torch.__version__} lacks: "
            "use dispatch_dtype='bf16' or upgrade torch"
        )


def _encode(x: torch.Tensor, wire: str | None) -> torch.Tensor:
    if wire is None:
        return x.contiguous()
    if wire == "bf16":
        return x.to(torch.bfloat16).contiguous()
    rows = x.float()
    scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / FP8_MAX
    quantized = (rows / scale).to(torch.float8_e4m3fn)
    return torch.cat([quantized.view(torch.uint8), scale.contiguous().view(torch.uint8)], dim=1)


def _decode(payload: torch.Tensor, wire: str | None, dtype: torch.dtype) -> torch.Tensor:
    if wire != "fp8":
        return payload.to(dtype)
    quantized = payload[:, :-4].contiguous().view(torch.float8_e4m3fn)
    scale = payload[:, -4:].contiguous().view(torch.float32)
    return (quantized.float() * scale).to(dtype)


@dataclass
class Exchange:
    """One all-to-all in flight (forward and, later, its backward)."""

    output_splits: list[int]
    input_splits: list[int]
    group: dist.ProcessGroup
    wire: str | None
    remote: list[bool] | None
    dtype: torch.dtype = torch.float32
    work: Any = None
    received: torch.Tensor | None = None
    grad_work: Any = None
    grad_received: torch.Tensor | None = None
    grad_dtype: torch.dtype = torch.float32
    send: torch.Tensor | None = field(default=None, repr=False)
    grad_send: torch.Tensor | None = field(default=None, repr=False)
    result: torch.Tensor | None = field(default=None, repr=False)


def _issue(
    payload: torch.Tensor, recv_splits: list[int], send_splits: list[int], handle: Exchange
) -> tuple[Any, torch.Tensor]:
    """Start the all-to-all of ``payload`` over ``handle.group`` and count the bytes it sends to other ranks.

    Returns ``(work, receive buffer)``; the caller keeps ``payload`` alive until the work is done.
    """
    received = payload.new_empty(sum(recv_splits), *payload.shape[1:])
    row_bytes = math.prod(payload.shape[1:]) * payload.element_size()
    me = dist.get_rank(handle.group)
    comm.record("ep", (sum(send_splits) - send_splits[me]) * row_bytes)
    if handle.remote is not None and any(handle.remote):
        comm.record(INTERNODE, sum(n for n, far in zip(send_splits, handle.remote) if far) * row_bytes)
    work = dist.all_to_all_single(received, payload, recv_splits, send_splits, group=handle.group, async_op=True)
    return work, received


class _Start(torch.autograd.Function):
    """Issue the all-to-all; the output is an empty tensor that orders :class:`_Wait` after it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, handle: Exchange) -> torch.Tensor:
        ctx.handle = handle
        handle.dtype = x.dtype
        payload = _encode(x, handle.wire)
        handle.work, handle.received = _issue(payload, handle.output_splits, handle.input_splits, handle)
        handle.send = payload  # the send buffer must outlive the asynchronous call
        hand_off()
        return x.new_empty(0)

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[torch.Tensor, None]:
        handle = ctx.handle
        handle.grad_work.wait()
        grad = handle.grad_received.to(handle.grad_dtype)
        handle.grad_work = handle.grad_received = handle.grad_send = None
        return grad, None


class _Wait(torch.autograd.Function):
    """Wait for the all-to-all and decode; the backward issues the reverse all-to-all of the gradient."""

    @staticmethod
    def forward(ctx: Any, link: torch.Tensor, handle: Exchange) -> torch.Tensor:
        ctx.handle = handle
        handle.work.wait()
        out = _decode(handle.received, handle.wire, handle.dtype)
        handle.work = handle.received = handle.send = None
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        handle = ctx.handle
        handle.grad_dtype = grad.dtype
        # The gradient travels in bf16 whenever the forward used a low-precision wire.
        payload = (grad.to(torch.bfloat16) if handle.wire is not None else grad).contiguous()
        handle.grad_work, handle.grad_received = _issue(payload, handle.input_splits, handle.output_splits, handle)
        handle.grad_send = payload
        hand_off()
        return grad.new_empty(0), None


def exchange_start(
    x: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: dist.ProcessGroup,
    *,
    wire: str | None = None,
    remote: list[bool] | None = None,
) -> Exchange:
    """Send ``input_splits[r]`` rows of ``x`` to rank r of ``group``; receive ``output_splits[r]`` from it.

    Returns the handle for :func:`exchange_wait`. Every rank of ``group`` must issue its exchanges
    in the same order. ``remote[r]``: rank r is on another node (counted as inter-node bytes).
    """
    handle = Exchange(list(output_splits), list(input_splits), group, wire, remote)
    handle.result = _Start.apply(x, handle)
    return handle


def exchange_wait(handle: Exchange) -> torch.Tensor:
    """The rows received by the exchange ``handle`` (in the sender's dtype), differentiable."""
    link = handle.result
    handle.result = None
    return _Wait.apply(link, handle)


def exchange(
    x: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: dist.ProcessGroup,
    *,
    wire: str | None = None,
    remote: list[bool] | None = None,
) -> torch.Tensor:
    """:func:`exchange_start` and :func:`exchange_wait` at once."""
    return exchange_wait(exchange_start(x, output_splits, input_splits, group, wire=wire, remote=remote))


def exchange_splits(
    send_counts: torch.Tensor, group: dist.ProcessGroup, remote: list[bool] | None = None
) -> tuple[torch.Tensor, list[int], list[int]]:
    """Tell every rank of ``group`` how many rows it will receive from this one (not differentiable).

    ``send_counts[r, ...]``: the rows for rank r, by any finer grouping (e.g. by expert). Returns
    ``(recv_counts, input_splits, output_splits)``: ``recv_counts[r, ...]``, the rows rank r sends
    here, grouped the same way, and the rows per rank to send and to receive, for
    :func:`exchange_start`. The counts' bytes are recorded (inter-node ones as well).
    """
    recv_counts = comm.all_to_all_counts(send_counts, group, "ep")
    if remote is not None and any(remote):
        block = send_counts.numel() // len(remote) * send_counts.element_size()
        comm.record(INTERNODE, block * sum(remote))
    peers = len(send_counts)
    return recv_counts, send_counts.reshape(peers, -1).sum(1).tolist(), recv_counts.reshape(peers, -1).sum(1).tolist()

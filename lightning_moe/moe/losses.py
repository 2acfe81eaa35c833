"""Router losses (load balancing, z-loss), Sinkhorn normalisation and the aux-loss auto-scaler.

All functions take fp32 router tensors. The load-balancing losses are written on *sufficient
statistics* (per-expert probability sums and slot counts) so that a distributed caller can pass
counts reduced over a process group (they carry no gradient) together with local, differentiable
probability sums whose sum over the group is the full loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_moe import comm

__all__ = [
    "MoEAuxLossAutoScaler",
    "global_aux_loss",
    "load_balancing_loss",
    "seq_aux_loss",
    "set_aux_loss_scale",
    "sinkhorn",
    "switch_aux_loss",
    "z_loss",
]


def load_balancing_loss(
    prob_sum: torch.Tensor,
    counts: torch.Tensor,
    num_tokens: torch.Tensor | float,
    num_slots: torch.Tensor | float,
    coeff: float,
) -> torch.Tensor:
    """``coeff * E * mean_batch(sum_i f_i * P_i)`` from statistics, batched over leading dims.

    Args:
        prob_sum: ``[..., E]`` sum over tokens of the per-token normalised routing probabilities
            (may be a partial sum of this rank's tokens).
        counts: ``[..., E]`` routed (token, choice) slots per expert; ``f_i = counts_i / num_slots``.
        num_tokens: tokens that ``P_i = prob_sum_i / num_tokens`` averages over (``[...]`` or scalar).
        num_slots: slots that ``f`` is normalised by, ``tokens * top_k`` (``[...]`` or scalar).
        coeff: loss coefficient.
    """
    num_experts = prob_sum.shape[-1]
    if isinstance(num_tokens, torch.Tensor):
        num_tokens = num_tokens.unsqueeze(-1)
    if isinstance(num_slots, torch.Tensor):
        num_slots = num_slots.unsqueeze(-1)
    per_batch = ((counts / num_slots) * (prob_sum / num_tokens)).sum(-1)
    return coeff * num_experts * per_batch.mean()


def _counts(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    return torch.bincount(topk_idx.reshape(-1), minlength=num_experts).float()


def switch_aux_loss(probs: torch.Tensor, topk_idx: torch.Tensor, coeff: float) -> torch.Tensor:
    """Switch-Transformer load-balancing loss ``coeff * E * sum_i f_i * P_i`` over one batch.

    ``probs [T, E]`` are per-token normalised routing probabilities, ``topk_idx [T, k]`` the chosen
    experts; ``f_i`` is the fraction of the ``T * k`` slots routed to expert i and ``P_i`` the mean
    probability of expert i. Perfectly uniform routing gives exactly ``coeff``.
    """
    num_tokens, top_k = topk_idx.shape
    counts = _counts(topk_idx, probs.shape[-1])
    return load_balancing_loss(probs.sum(0), counts, float(num_tokens), float(num_tokens * top_k), coeff)


def seq_aux_loss(probs: torch.Tensor, topk_idx: torch.Tensor, coeff: float) -> torch.Tensor:
    """DeepSeek-V3 sequence-wise balance loss: the Switch loss of each sequence, averaged.

    ``probs [B, S, E]``, ``topk_idx [B, S, k]``.
    """
    batch, seq, top_k = topk_idx.shape
    num_experts = probs.shape[-1]
    offsets = torch.arange(batch, device=topk_idx.device).view(batch, 1, 1) * num_experts
    counts = torch.bincount((topk_idx + offsets).reshape(-1), minlength=batch * num_experts)
    counts = counts.view(batch, num_experts).float()
    return load_balancing_loss(probs.sum(1), counts, float(seq), float(seq * top_k), coeff)


def global_aux_loss(
    probs: torch.Tensor, global_counts: torch.Tensor, global_num_tokens: float, top_k: int, coeff: float
) -> torch.Tensor:
    """Global-batch balance loss: ``f`` from counts over the whole data-parallel batch, ``P`` local.

    ``probs [T, E]`` are this rank's probabilities; ``global_counts [E]`` the routed slots of every
    rank of the global batch, ``global_num_tokens`` its token count.
    """
    return load_balancing_loss(
        probs.sum(0), global_counts.float(), float(probs.shape[0]), float(global_num_tokens * top_k), coeff
    )


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """Router z-loss ``coeff * mean(logsumexp(logits, -1) ** 2)`` (ST-MoE)."""
    return coeff * torch.logsumexp(logits.float(), dim=-1).square().mean()


@torch.no_grad()
def sinkhorn(
    logits: torch.Tensor, tol: float = 1e-4, max_iters: int = 100, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Sinkhorn-Knopp normalisation of ``exp(logits) [T, E]`` (Megatron's routing, no gradient).

    Returns ``d0[:, None] * exp(logits) * d1[None, :]`` whose columns sum to ``1/E`` and rows to
    ``1/T`` (relative error below ``tol``): a transport plan with uniform marginals, i.e.
    ``T * result`` is row-stochastic and gives every expert ``T/E`` tokens' worth of mass. Very
    peaked logits converge slowly; after ``max_iters`` the rows are only approximately balanced,
    which is all routing needs.

    ``group``: the ranks that hold the other tokens of the same micro-batch (cp x tp shards). The
    column sums, the token count, the max and the stopping test are reduced over it, so each rank
    gets its rows of the plan of the whole micro-batch, as one process would.

    Example::

        plan = sinkhorn(torch.randn(16, 4))
        plan.sum(1)  # ~ 1/16 everywhere;  plan.sum(0) ~ 1/4 everywhere
    """
    distributed = group is not None and dist.get_world_size(group) > 1
    logits = logits.float()
    peak = logits.max()
    num_tokens = logits.new_tensor(float(logits.shape[0]))
    if distributed:
        comm.all_reduce_(peak, group, "cp", op=dist.ReduceOp.MAX)
        comm.all_reduce_(num_tokens, group, "cp")
    # Subtracting the max changes no ratio (the scalings absorb it) and keeps exp finite.
    cost = torch.exp(logits - peak)
    num_experts = cost.shape[1]
    eps = 1e-8
    d1 = torch.ones(num_experts, device=cost.device, dtype=cost.dtype)
    cost_d1 = cost @ d1
    for _ in range(max_iters):
        d0 = 1.0 / (num_tokens * (cost_d1 + eps))
        column_sums = d0 @ cost
        if distributed:
            comm.all_reduce_(column_sums, group, "cp")
        d1 = 1.0 / (num_experts * (column_sums + eps))  # columns now sum to 1/E exactly
        cost_d1 = cost @ d1
        error = (num_tokens * d0 * cost_d1 - 1.0).abs().max() if cost.shape[0] else cost.new_zeros(())
        if distributed:
            comm.all_reduce_(error, group, "cp", op=dist.ReduceOp.MAX)
        if error.item() < tol:
            break
    return d0.unsqueeze(1) * cost * d1.unsqueeze(0)


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Attach an auxiliary loss to an activation so that it receives a gradient in backward.

    ``forward(output, aux_loss)`` returns ``output`` unchanged; in backward ``aux_loss`` gets the
    gradient ``main_loss_backward_scale`` (Megatron's trick). The user never adds the aux losses
    to the task loss, and pipeline stages get them without passing them between stages.
    :func:`set_aux_loss_scale` sets the scale, e.g. ``1/accumulate_grad_batches`` so the aux losses
    are averaged over micro-batches like the task loss.

    Example::

        y = MoEAuxLossAutoScaler.apply(y, aux_loss)   # aux_loss now trains the router
        y.pow(2).mean().backward()
    """

    main_loss_backward_scale: float = 1.0

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_output: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        (aux_loss,) = ctx.saved_tensors
        scale = MoEAuxLossAutoScaler.main_loss_backward_scale
        return grad_output, torch.full_like(aux_loss, scale)


def set_aux_loss_scale(scale: float) -> None:
    """Set the gradient that every MoE aux loss receives in backward (default 1.0)."""
    MoEAuxLossAutoScaler.main_loss_backward_scale = float(scale)

"""Top-k token router: fp32 scores, top-k selection (optionally group-limited, biased or Sinkhorn)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_moe import comm
from lightning_moe._compat import Fp32BuffersModule
from lightning_moe.moe.losses import sinkhorn

__all__ = ["SCORE_FUNCS", "RouterOutput", "TopKRouter", "check_node_limit", "check_routing"]

SCORE_FUNCS: tuple[str, ...] = ("softmax", "sigmoid")


@dataclass
class RouterOutput:
    """What the router computed for ``T`` tokens (all fp32 except the indices)."""

    logits: torch.Tensor  # [T, E] x @ weight.T
    scores: torch.Tensor  # [T, E] score_func(logits): where the gate weights come from
    probs: torch.Tensor  # [T, E] scores normalised to sum 1 per token (losses, entropy)
    topk_idx: torch.Tensor  # [T, k] int64 chosen experts
    topk_weights: torch.Tensor  # [T, k] gate weights (from unbiased scores)
    tokens_per_expert: torch.Tensor  # [E] int64 routed slots per expert, before any capacity drop


class TopKRouter(Fp32BuffersModule):
    """Route each token to ``top_k`` of ``num_experts`` experts, with the math in fp32.

    Its fp32 buffers (``expert_bias``, ``expert_load``) stay fp32 under ``module.to(torch.bfloat16)``
    (pure-bf16 training): bf16 cannot resolve ``bias_update_rate`` steps on a bias of order 1e-1.

    - ``score_func``: ``"softmax"`` or ``"sigmoid"`` over the logits ``x @ weight.T``.
    - ``topk_norm``: divide the k gate weights by their sum (Mixtral / DeepSeek-V3).
    - ``expert_bias``: a buffer ``expert_bias [E]`` added to the scores *for selection only*; the
      gate weights come from the unbiased scores (DeepSeek-V3 aux-loss-free balancing). Loads
      accumulate while grad is enabled; :meth:`update_expert_bias` applies
      ``b += rate * sign(mean_load - load)`` and resets them.
    - ``num_groups``/``group_topk``: experts are split in ``num_groups`` contiguous groups; each
      token first keeps the ``group_topk`` best groups, then picks its top-k experts inside them.
      A group's score is the sum of its two best (biased) scores for sigmoid, as in DeepSeek-V3,
      and its best score for softmax, as in DeepSeek-V2.
    - ``bias``: a learned logit bias ``bias [E]`` (``logits = x @ weight.T + bias``, GPT-OSS).
    - ``routed_scaling_factor``: the gate weights are multiplied by it after the top-k
      normalisation (DeepSeek-V3's 2.5); selection and the balancing losses do not see it.
    - ``max_nodes_per_token``/``num_nodes``: node-limited routing (DeepSeek-V3). The experts live on
      ``num_nodes`` nodes in contiguous blocks of ``E / num_nodes`` (the expert-parallel placement);
      each token first keeps the ``max_nodes_per_token`` nodes with the highest sum of their
      ``ceil(top_k / max_nodes_per_token)`` best (biased) scores, then picks its top-k experts
      inside them (after any group limit).
    - ``use_sinkhorn``: in training, experts are chosen on the Sinkhorn-normalised logits
      (balanced assignment, Megatron's ``"sinkhorn"``); gate weights still come from the scores.
      In eval the scores choose.

    Example::

        router = TopKRouter(64, num_experts=8, top_k=2, score_func="sigmoid", expert_bias=True)
        out = router(torch.randn(10, 64))
        out.topk_idx.shape, out.topk_weights.shape   # (10, 2), (10, 2)
        router.update_expert_bias()                  # once per optimizer step
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int = 2,
        *,
        score_func: str = "softmax",
        topk_norm: bool = True,
        expert_bias: bool = False,
        bias_update_rate: float = 1e-3,
        num_groups: int | None = None,
        group_topk: int | None = None,
        use_sinkhorn: bool = False,
        bias: bool = False,
        routed_scaling_factor: float = 1.0,
        max_nodes_per_token: int | None = None,
        num_nodes: int | None = None,
    ) -> None:
        super().__init__()
        check_routing(num_experts, top_k, score_func, num_groups, group_topk, bias_update_rate)
        self.num_nodes: int | None = None
        self.max_nodes_per_token = max_nodes_per_token
        self.set_nodes(num_nodes, num_experts, top_k)
        if not routed_scaling_factor > 0:
            raise ValueError(f"routed_scaling_factor must be > 0, got {routed_scaling_factor}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.score_func = score_func
        self.topk_norm = topk_norm
        self.use_expert_bias = expert_bias
        self.bias_update_rate = bias_update_rate
        self.num_groups = num_groups
        self.group_topk = group_topk
        self.use_sinkhorn = use_sinkhorn
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.register_parameter("bias", nn.Parameter(torch.zeros(num_experts)) if bias else None)
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
            # Not checkpointed: it is reset after every optimizer step.
            self.register_buffer("expert_load", torch.zeros(num_experts, dtype=torch.float32), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's default initialisation.
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(
        self, x: torch.Tensor, sequence_group: dist.ProcessGroup | None = None, topk_idx: torch.Tensor | None = None
    ) -> RouterOutput:
        """Route ``x [T, H]``; fp32 (fp64 for fp64 inputs) whatever an enclosing autocast says.

        ``sequence_group``: the ranks holding the micro-batch's other tokens (cp x tp shards), over
        which Sinkhorn balances, as one process balances the whole micro-batch.
        ``topk_idx [T, k]``: the experts to use (routing replay, :mod:`lightning_moe.moe.replay`)
        instead of choosing them; the gate weights still come from the scores at those experts,
        normalised as usual, so the router gets gradients. Bias, group, node limits and Sinkhorn
        do not select then; expert-bias loads count the replayed choice.
        """
        if self.max_nodes_per_token is not None and self.max_nodes_per_token > 1 and self.num_nodes is None:
            raise ValueError(
                f"max_nodes_per_token={self.max_nodes_per_token} exceeds the 1 node the experts live on: set num_nodes"
                " (the nodes of the ep layout to route like, e.g. ParallelDims(ep=4, ranks_per_node=2).ep_num_nodes)"
                " or run under ep with ranks_per_node"
            )
        router_dtype = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(device_type=x.device.type, enabled=False):
            bias = self.bias.to(router_dtype) if self.bias is not None else None
            logits = F.linear(x.to(router_dtype), self.weight.to(router_dtype), bias)
        if self.score_func == "softmax":
            # Softmax over the expert dim of [E, T] runs ~4x faster on CPU than over a short last dim.
            scores = torch.softmax(logits.t(), dim=0).t().contiguous()
            probs = scores
        else:
            scores = torch.sigmoid(logits)
            probs = scores / scores.sum(-1, keepdim=True)

        # Loads count while grad is enabled (training), not in evaluation under no_grad.
        accumulate_load = self.use_expert_bias and torch.is_grad_enabled()
        with torch.no_grad():
            if topk_idx is not None:
                topk_idx = self._check_replayed(topk_idx, logits.shape[0])
            else:
                topk_idx = self._choose(logits, scores, sequence_group)
            tokens_per_expert = torch.bincount(topk_idx.reshape(-1), minlength=self.num_experts)
            if accumulate_load:
                self.expert_load += tokens_per_expert

        topk_weights = scores.gather(1, topk_idx)
        if self.topk_norm:
            # The epsilon only guards sigmoid scores that all underflow to 0.
            topk_weights = topk_weights / (topk_weights.sum(-1, keepdim=True) + 1e-20)
        if self.routed_scaling_factor != 1.0:
            topk_weights = topk_weights * self.routed_scaling_factor
        return RouterOutput(logits, scores, probs, topk_idx, topk_weights, tokens_per_expert)

    def _check_replayed(self, topk_idx: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """A replayed ``[T, k]`` choice, checked against this router's tokens, ``top_k`` and experts."""
        if tuple(topk_idx.shape) != (num_tokens, self.top_k):
            raise ValueError(
                f"replayed experts of shape {tuple(topk_idx.shape)} do not fit {num_tokens} tokens x top_k={self.top_k}"
            )
        if topk_idx.numel() and not (0 <= int(topk_idx.min()) and int(topk_idx.max()) < self.num_experts):
            raise ValueError(f"replayed experts {topk_idx.unique().tolist()} outside [0, {self.num_experts})")
        return topk_idx.to(torch.int64)

    def _choose(
        self, logits: torch.Tensor, scores: torch.Tensor, sequence_group: dist.ProcessGroup | None
    ) -> torch.Tensor:
        """The top-k experts of each token: ``[T, k]`` (no gradient)."""
        choice = sinkhorn(logits, group=sequence_group) if self.use_sinkhorn and self.training else scores
        if self.use_expert_bias:
            choice = choice + self.expert_bias
        if self.num_groups is not None:
            choice = self._keep_best_groups(choice)
        if (
            self.max_nodes_per_token is not None
            and self.num_nodes is not None
            and self.max_nodes_per_token < self.num_nodes
        ):
            choice = self._keep_best_nodes(choice)
        return choice.topk(self.top_k, dim=-1).indices

    def _keep_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Set the scores outside each token's ``group_topk`` best groups to -inf."""
        assert self.num_groups is not None and self.group_topk is not None
        num_tokens = choice.shape[0]
        grouped = choice.view(num_tokens, self.num_groups, -1)
        if self.score_func == "sigmoid":
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        else:
            group_scores = grouped.amax(dim=-1)
        best = group_scores.topk(self.group_topk, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(num_tokens, -1)

    def set_nodes(self, num_nodes: int | None, num_experts: int | None = None, top_k: int | None = None) -> None:
        """Set how many nodes the experts are spread over and check node-limited routing.

        ``None``: not known yet (``lightning_moe.parallelize`` sets it from the ep topology; on one
        device a ``max_nodes_per_token`` above 1 is then an error at the first forward).
        """
        num_experts = self.num_experts if num_experts is None else num_experts
        top_k = self.top_k if top_k is None else top_k
        check_node_limit(num_nodes, self.max_nodes_per_token, num_experts, top_k)
        self.num_nodes = num_nodes

    def _keep_best_nodes(self, choice: torch.Tensor) -> torch.Tensor:
        """Set the scores outside each token's ``max_nodes_per_token`` best nodes to -inf.

        A node's score is the sum of its ``ceil(top_k / M)`` best scores (DeepSeek-V3's rule).
        """
        assert self.num_nodes is not None and self.max_nodes_per_token is not None
        num_tokens = choice.shape[0]
        per_node = choice.view(num_tokens, self.num_nodes, -1)
        best_per_node = min(math.ceil(self.top_k / self.max_nodes_per_token), per_node.shape[-1])
        node_scores = per_node.topk(best_per_node, dim=-1).values.sum(-1)
        best = node_scores.topk(self.max_nodes_per_token, dim=-1).indices
        keep = torch.zeros_like(node_scores, dtype=torch.bool).scatter_(1, best, True)
        return per_node.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(num_tokens, -1)

    @torch.no_grad()
    def update_expert_bias(self, group: dist.ProcessGroup | None = None) -> None:
        """Apply ``b += rate * sign(mean_load - load)`` to the loads accumulated since the last call.

        ``group``: the data-parallel ranks whose loads are summed first (None on one device).
        A no-op without ``expert_bias``.
        """
        if not self.use_expert_bias:
            return
        load = self.expert_load.clone()
        comm.all_reduce_(load, group, "dp")
        self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load)
        self.expert_load.zero_()


def check_node_limit(num_nodes: int | None, max_nodes_per_token: int | None, num_experts: int, top_k: int) -> None:
    """``ValueError`` unless ``num_nodes`` (None: one node, not known yet) divides ``num_experts`` and
    ``max_nodes_per_token`` (None: no limit) is a node count those nodes can serve with ``top_k`` experts."""
    limit = max_nodes_per_token
    nodes = 1 if num_nodes is None else num_nodes
    if not isinstance(nodes, int) or nodes < 1 or num_experts % nodes:
        raise ValueError(
            f"num_nodes={num_nodes!r} must be a positive divisor of num_experts={num_experts} (experts per node are"
            " contiguous blocks)"
        )
    if limit is not None:
        if not isinstance(limit, int) or limit < 1:
            raise ValueError(f"max_nodes_per_token={limit!r} must be an integer >= 1 (or None: no node limit)")
        if num_nodes is not None and limit > nodes:
            raise ValueError(
                f"max_nodes_per_token={limit} exceeds the {nodes} node(s) the experts live on: lower it, or set"
                " num_nodes (on one device) / ranks_per_node (under ep) so that the experts span more nodes"
            )
        if limit * (num_experts // nodes) < top_k:
            raise ValueError(
                f"max_nodes_per_token={limit} nodes of {num_experts // nodes} experts hold fewer than top_k={top_k}"
                " experts: raise max_nodes_per_token or lower top_k"
            )


def check_routing(
    num_experts: int,
    top_k: int,
    score_func: str,
    num_groups: int | None,
    group_topk: int | None,
    bias_update_rate: float,
) -> None:
    """``ValueError`` for routing settings a :class:`TopKRouter` cannot take (each names the argument and the fix)."""
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} exceeds num_experts={num_experts}: choose top_k <= num_experts")
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func={score_func!r} is unknown: choose one of {SCORE_FUNCS}")
    if bias_update_rate < 0:
        raise ValueError(f"bias_update_rate must be >= 0, got {bias_update_rate}")
    if group_topk is not None and num_groups is None:
        raise ValueError(f"group_topk={group_topk} requires num_groups: set num_groups (a divisor of num_experts)")
    if num_groups is None:
        return
    if group_topk is None:
        raise ValueError(f"num_groups={num_groups} requires group_topk: set how many groups each token may use")
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by num_groups={num_groups}: choose num_groups dividing num_experts"
        )
    if not 1 <= group_topk <= num_groups:
        raise ValueError(f"group_topk={group_topk} must be between 1 and num_groups={num_groups}")
    if group_topk * (num_experts // num_groups) < top_k:
        raise ValueError(
            f"group_topk={group_topk} groups of {num_experts // num_groups} experts hold fewer than top_k={top_k} "
            "experts: raise group_topk or lower top_k"
        )

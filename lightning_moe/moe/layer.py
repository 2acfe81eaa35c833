"""``MoELayer``: router -> (capacity) -> dispatch -> grouped SwiGLU experts -> combine (+ shared expert)."""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from lightning_moe import comm
from lightning_moe.moe.capacity import capacity_keep_mask, expert_capacity
from lightning_moe.moe.config import LOAD_BALANCING, ROUTINGS, MoEConfig
from lightning_moe.moe.dispatcher import Dispatcher
from lightning_moe.moe.dispatchers import DISPATCHERS, DispatcherKind, ExpertGroups, build_dispatcher
from lightning_moe.moe.documents import (
    agreed_documents_per_row,
    current_routing_documents,
    document_balance_loss,
    document_balance_statistics,
)
from lightning_moe.moe.experts import GroupedExperts, SharedExpert, compute_dtype
from lightning_moe.moe.losses import MoEAuxLossAutoScaler, load_balancing_loss
from lightning_moe.moe.router import RouterOutput, TopKRouter

__all__ = [
    "DISPATCHERS",
    "LOAD_BALANCING",
    "ROUTINGS",
    "ExpertOutputBias",
    "MoEConfig",
    "MoELayer",
    "RoutingHook",
    "build_dispatcher",
    "update_expert_biases",
]


class RoutingHook(Protocol):
    """What :attr:`MoELayer.routing_hook` provides (routing record and replay, :mod:`lightning_moe.moe.replay`)."""

    def replayed_choice(self, layer: MoELayer, x: torch.Tensor) -> torch.Tensor | None:
        """The experts ``[T, k]`` the tokens of ``x [..., H]`` must use, or None to let the router choose."""

    def observe(self, layer: MoELayer, x: torch.Tensor, routing: RouterOutput) -> None:
        """Called with the routing of ``x`` once the router ran."""


class MoELayer(nn.Module):
    """A Mixture-of-Experts SwiGLU feed-forward layer: ``x [..., H] -> y [..., H]``.

    Built from an :class:`~lightning_moe.moe.MoEConfig` (``MoELayer(config=cfg)``) or from its
    arguments (``MoELayer(hidden_size, ffn_hidden_size, num_experts, top_k, **options)``, which builds
    one); ``layer.config`` holds it, and its settings read as attributes (``layer.num_experts``,
    ``layer.top_k``, ``layer.capacity_factor``, ...; ``layer.dispatcher_kind`` is ``config.dispatcher``).

    Each token goes to ``top_k`` of ``num_experts`` experts chosen by ``router`` (fp32 math);
    ``y = sum_k w_k * expert_{i_k}(x)`` (+ the shared expert). Parameters: ``router.weight [E, H]``,
    ``experts.w1/w3 [E, H, F]``, ``experts.w2 [E, F, H]`` and, with ``shared_expert_hidden_size``,
    ``shared_expert.w1/w3/w2`` (``nn.Linear``). See docs/moe-layer.md.

    Load balancing (``load_balancing``): ``"aux_loss"`` (Switch, ``coeff * E * sum_i f_i P_i``),
    ``"seq_aux_loss"`` (the same per sequence, averaged; the sequence is the second-last dim of
    ``x``), ``"global_aux_loss"`` (``f`` from counts summed over ``data_group``), ``"sinkhorn"``
    (balanced assignment, no aux loss) or ``"none"`` (e.g. with ``expert_bias=True``, DeepSeek-V3's
    aux-loss-free balancing). The aux and z losses reach the router through
    :class:`MoEAuxLossAutoScaler`: never add them to the task loss.

    ``capacity_factor=None`` is dropless; otherwise each expert keeps at most
    ``ceil(T * k / E * capacity_factor)`` slots by ``drop_policy`` and dropped slots add zero.

    ``stats`` (detached, after every forward): ``tokens_per_expert [E]`` (slots before dropping),
    ``aux_loss``, ``z_loss``, ``dropped_fraction``, ``router_entropy``; reduced over
    ``sequence_group`` when it is set.

    Options real models need (docs/hf.md):

    - ``routed_scaling_factor``: the routed gate weights are multiplied by it after the top-k
      normalisation (DeepSeek-V3: 2.5).
    - ``shared_expert_gate``: the shared expert's output is scaled per token by
      ``sigmoid(x @ shared_expert_gate.weight.T)`` (Qwen2-MoE; weight ``[1, H]``). Needs
      ``shared_expert_hidden_size``.
    - ``router_bias``: ``router.bias [E]`` is added to the router logits (GPT-OSS).
    - ``expert_linear_bias``: the experts' gate/up projections get ``experts.b1/b3 [E, F]`` and the
      down projection ``expert_output_bias.weight [E, H]`` (GPT-OSS). The down bias is added per
      token as ``sum_k w_k * b[i_k]`` over the kept slots, which equals adding it inside each expert
      but needs no expert sharding: it is a token-level parameter like ``router.weight``.
    - ``activation``: ``"swiglu"`` (default) or ``"gpt_oss"``: ``(clamp(up, -L, L) + 1) * g *
      sigmoid(alpha * g)`` with ``g = clamp(gate, max=L)``, ``alpha = swiglu_alpha`` (1.702) and
      ``L = swiglu_limit`` (7.0).

    Topology-aware expert parallelism (docs/scaling.md):

    - ``max_nodes_per_token``/``num_nodes``: node-limited routing. The experts live on ``num_nodes``
      nodes in contiguous blocks (under ep, ``None`` takes the node count of the ep group from
      ``ParallelDims(ranks_per_node=...)``; state it, e.g. ``ParallelDims(ep=4,
      ranks_per_node=2).ep_num_nodes``, to route the same way on one device and any layout); each
      token's top-k experts come from at most ``max_nodes_per_token`` of them (DeepSeek-V3's rule,
      see :class:`TopKRouter`).
    - ``dispatcher="alltoall_dedup"`` (default) sends each token once to each ep rank holding one of
      its experts, which expands it and sums its experts' outputs before one row goes back;
      ``"alltoall"`` sends one row per (token, expert) slot each way (the former default, kept for
      comparison; :mod:`lightning_moe.moe.ep_dispatcher`).
    - ``dispatcher="hierarchical"``: each token crosses the node boundary once, then fans out inside
      the node (:mod:`lightning_moe.moe.hierarchical`).
    - ``dispatch_dtype``: ``None``, ``"bf16"`` or ``"fp8"`` (``float8_e4m3fn`` with one fp32 scale per
      token): what the dispatched tokens travel as; the combine and both backwards travel in bf16
      when it is set (:mod:`lightning_moe.moe.exchange`).
    - ``dispatch_chunks=n``: the tokens go in ``n`` chunks; chunk ``i+1``'s all-to-all is in flight
      while the experts compute chunk ``i``, the combines are pipelined the same way, and the shared
      expert runs while the first dispatch is in flight. Same outputs as ``n=1``.
    - ``routing="expert_choice"``: each expert picks its ``C = floor(capacity_factor * T * k / E)``
      best-scoring tokens (``T``: the tokens of the whole ep group, whose ``[T, E]`` scores are
      all-gathered, never the tokens) and weights them by their score; tokens no expert picked pass
      through as zeros. Needs ``capacity_factor``; the load-balancing losses do not apply (the load
      is balanced by construction), the z-loss does.

    ``sequence_group``/``data_group`` are set by :func:`lightning_moe.parallelize` (None on one
    device): the ranks sharing one micro-batch's tokens, and all ranks of one optimizer step.

    Example::

        layer = MoELayer(64, 128, num_experts=8, top_k=2, score_func="sigmoid",
                         load_balancing="none", expert_bias=True, shared_expert_hidden_size=128)
        y = layer(torch.randn(2, 16, 64))
        y.square().mean().backward()     # the aux losses train the router without being added
        layer.update_expert_bias()       # once per optimizer step
        layer.stats["tokens_per_expert"]
    """

    def __init__(self, *args: Any, config: MoEConfig | None = None, **kwargs: Any) -> None:
        """``MoELayer(config=MoEConfig(...))``, or the :class:`MoEConfig` arguments themselves:
        ``MoELayer(hidden_size, ffn_hidden_size, num_experts, top_k=2, *, score_func=..., ...)`` builds
        ``MoEConfig(hidden_size, ffn_hidden_size, num_experts, top_k=2, *, score_func=..., ...)``.

        Giving both a config and arguments is a ``TypeError`` (no silent override): derive a changed
        config with ``config.replace(name=value)``.
        """
        if config is None:
            config = MoEConfig(*args, **kwargs)
        elif args or kwargs:
            raise TypeError(
                "MoELayer takes config=MoEConfig(...) or the MoEConfig arguments, not both (got config and"
                f" {len(args)} positional, {sorted(kwargs)} keyword arguments): build it from"
                " config.replace(name=value, ...) to change settings"
            )
        elif not isinstance(config, MoEConfig):
            raise TypeError(f"config must be an MoEConfig, got {type(config).__name__}")
        super().__init__()
        self.config = c = config  # the settings, read-only (the properties below read them)
        self.router = TopKRouter(
            c.hidden_size,
            c.num_experts,
            c.top_k,
            score_func=c.score_func,
            topk_norm=c.topk_norm,
            expert_bias=c.expert_bias,
            bias_update_rate=c.bias_update_rate,
            num_groups=c.num_groups,
            group_topk=c.group_topk,
            use_sinkhorn=c.load_balancing == "sinkhorn",
            bias=c.router_bias,
            routed_scaling_factor=c.routed_scaling_factor,
            max_nodes_per_token=c.max_nodes_per_token,
            num_nodes=c.num_nodes,
        )
        self.experts = GroupedExperts(
            c.num_experts,
            c.hidden_size,
            c.ffn_hidden_size,
            activation=c.activation,
            bias=c.expert_linear_bias,
            alpha=c.swiglu_alpha,
            limit=c.swiglu_limit,
        )
        self.shared_expert = (
            SharedExpert(c.hidden_size, c.shared_expert_hidden_size)
            if c.shared_expert_hidden_size is not None
            else None
        )
        self.shared_expert_gate = nn.Linear(c.hidden_size, 1, bias=False) if c.shared_expert_gate else None
        self.expert_output_bias = ExpertOutputBias(c.num_experts, c.hidden_size) if c.expert_linear_bias else None
        self.dispatcher: Dispatcher = self.new_dispatcher()  # lightning_moe.parallelize builds it over the groups
        # Set by lightning_moe.parallelize: the ep group (expert choice ranks its tokens together) and size.
        self.ep_group: dist.ProcessGroup | None = None
        self.ep_size = 1
        self.sequence_group: dist.ProcessGroup | None = None
        self.data_group: dist.ProcessGroup | None = None
        self.stats: dict[str, torch.Tensor] = {}
        # Routing record/replay (lightning_moe.moe.replay sets it within record_routing / replay_routing):
        # ``replayed_choice(layer, x) -> [T, k] | None`` before routing, ``observe(layer, x, routing)`` after.
        self.routing_hook: RoutingHook | None = None

    # The settings other code reads off the layer, from ``config`` (read-only: build a new layer from
    # ``config.replace(...)`` to change them).
    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def num_experts(self) -> int:
        return self.config.num_experts

    @property
    def top_k(self) -> int:
        return self.config.top_k

    @property
    def load_balancing(self) -> str:
        return self.config.load_balancing

    @property
    def aux_loss_coeff(self) -> float:
        return self.config.aux_loss_coeff

    @property
    def z_loss_coeff(self) -> float:
        return self.config.z_loss_coeff

    @property
    def capacity_factor(self) -> float | None:
        return self.config.capacity_factor

    @property
    def drop_policy(self) -> str:
        return self.config.drop_policy

    @property
    def dispatcher_kind(self) -> DispatcherKind:
        """``config.dispatcher`` as a :class:`~lightning_moe.moe.dispatchers.DispatcherKind` (equal to the
        string; ``dispatcher`` is the :class:`Dispatcher` object in use)."""
        return DispatcherKind(self.config.dispatcher)

    @property
    def max_nodes_per_token(self) -> int | None:
        return self.config.max_nodes_per_token

    @property
    def num_nodes(self) -> int | None:
        """As given: None follows the ep topology (the router holds the node count in use)."""
        return self.config.num_nodes

    @property
    def dispatch_dtype(self) -> str | None:
        return self.config.dispatch_dtype

    @property
    def dispatch_chunks(self) -> int:
        return self.config.dispatch_chunks

    @property
    def routing(self) -> str:
        return self.config.routing

    def new_dispatcher(self, groups: ExpertGroups | None = None) -> Dispatcher:
        """A dispatcher of this layer's kind and wire over ``groups`` (None: one device), from
        :func:`~lightning_moe.moe.dispatchers.build_dispatcher`, the one place dispatchers are built;
        ``lightning_moe.parallelize`` sets ``layer.dispatcher = layer.new_dispatcher(groups)``."""
        return build_dispatcher(self.dispatcher_kind, self.num_experts, groups, wire=self.dispatch_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"MoELayer expects inputs [..., {self.hidden_size}], got {tuple(x.shape)}")
        tokens = x.reshape(-1, self.hidden_size)
        if self.routing == "expert_choice":
            self._expert_choice_capacity(tokens.shape[0] * self.ep_size)  # bad settings fail before any work
        hook = self.routing_hook
        replayed = hook.replayed_choice(self, x) if hook is not None else None
        routing = self.router(tokens, self.sequence_group, replayed)
        if hook is not None:
            hook.observe(self, x, routing)
        keep = None
        if self.routing == "expert_choice":
            routing, keep = self._expert_choice(routing)
        elif self.capacity_factor is not None:
            capacity = expert_capacity(tokens.shape[0], self.num_experts, self.top_k, self.capacity_factor)
            keep = capacity_keep_mask(
                routing.topk_idx, routing.topk_weights.detach(), self.num_experts, capacity, self.drop_policy
            )
        # Cast before dispatch so that the permutation (and any all-to-all) moves bf16 under autocast.
        out, shared = self._dispatch_experts_combine(tokens.to(compute_dtype(tokens)), routing, keep, tokens)
        if self.expert_output_bias is not None:
            out = out + self.expert_output_bias(routing.topk_idx, routing.topk_weights, keep).to(out.dtype)
        if shared is not None:
            out = out + shared
        loss = self._losses_and_stats(routing, keep, x.shape)
        if loss is not None and loss.requires_grad:
            out = MoEAuxLossAutoScaler.apply(out, loss)
        return out.view(x.shape)

    def _shared_output(self, tokens: torch.Tensor) -> torch.Tensor | None:
        if self.shared_expert is None:
            return None
        shared = self.shared_expert(tokens)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(tokens)) * shared
        return shared

    def _dispatch_experts_combine(
        self, hidden: torch.Tensor, routing: RouterOutput, keep: torch.Tensor | None, tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Dispatch, expert GEMMs and combine, in ``dispatch_chunks`` chunks; returns ``(routed, shared)``.

        Dispatchers with ``dispatch_start``/``dispatch_finish`` (the all-to-all ones) overlap: chunk
        ``i+1``'s all-to-all is issued before the experts compute chunk ``i``, each combine is issued
        before the next chunk's experts, and the shared expert runs while chunk 0 is in flight.
        """
        dispatcher = self.dispatcher
        overlap = hasattr(dispatcher, "dispatch_start")
        num_tokens = hidden.shape[0]
        chunks = max(1, min(self.dispatch_chunks, num_tokens))
        bounds = [num_tokens * i // chunks for i in range(chunks + 1)]
        pieces = [slice(bounds[i], bounds[i + 1]) for i in range(chunks)]

        def start(piece: slice):  # noqa: ANN202
            args = (hidden[piece], routing.topk_idx[piece], None if keep is None else keep[piece])
            return dispatcher.dispatch_start(*args) if overlap else dispatcher.dispatch(*args)

        pending = start(pieces[0])
        shared = self._shared_output(tokens)  # while the first dispatch is in flight
        combines = []
        for i, piece in enumerate(pieces):
            following = start(pieces[i + 1]) if i + 1 < chunks else None
            ctx = dispatcher.dispatch_finish(pending) if overlap else pending
            expert_output = self.experts(ctx.expert_input, ctx.tokens_per_local_expert)
            weights = routing.topk_weights[piece]
            if overlap:
                combines.append(dispatcher.combine_start(expert_output, weights, ctx))
            else:
                combines.append(dispatcher.combine(expert_output, weights, ctx))
            pending = following
        outputs = [dispatcher.combine_finish(c) for c in combines] if overlap else combines
        return (outputs[0] if chunks == 1 else torch.cat(outputs)), shared

    def _expert_choice_capacity(self, total: int) -> int:
        """``C = floor(capacity_factor * total * top_k / E)``; ``ValueError`` when it is below 1."""
        capacity = int(self.capacity_factor * total * self.top_k / self.num_experts)  # type: ignore[operator]
        if capacity < 1:
            raise ValueError(
                f"routing='expert_choice' with capacity_factor={self.capacity_factor}, top_k={self.top_k} and"
                f" {self.num_experts} experts gives C = floor({self.capacity_factor} * {total} tokens * {self.top_k} /"
                f" {self.num_experts}) = {capacity} < 1 token per expert: raise capacity_factor or top_k, or route more tokens"
            )
        return capacity

    def _expert_choice(self, routing: RouterOutput) -> tuple[RouterOutput, torch.Tensor]:
        """Each expert picks its ``C`` best-scoring tokens of the ep group: ``(routing over all E, keep [T, E])``.

        The ``[T, E]`` scores of the ep group are all-gathered (no gradient); every rank takes the same
        choice and keeps its own rows. Gate weights are the (differentiable) scores of the picks.
        """
        scores = routing.scores
        num_tokens, num_experts = scores.shape
        with torch.no_grad():
            group = self.ep_group if self.ep_size > 1 else None
            all_scores = scores.detach() if group is None else comm.all_gather_autograd(scores.detach(), group, "ep")
            total = all_scores.shape[0]
            capacity = min(self._expert_choice_capacity(total), total)
            picks = all_scores.topk(capacity, dim=0).indices  # [C, E]
            chosen = torch.zeros(total, num_experts, dtype=torch.bool, device=scores.device)
            chosen.scatter_(0, picks, True)
            offset = dist.get_rank(group) * num_tokens if group is not None else 0
            keep = chosen[offset : offset + num_tokens]
            experts = torch.arange(num_experts, device=scores.device).expand(num_tokens, num_experts)
        routed = RouterOutput(routing.logits, scores, routing.probs, experts, scores, keep.sum(0))
        return routed, keep

    def update_expert_bias(self) -> None:
        """Apply the expert-bias rule to the loads accumulated since the last call (no-op without bias).

        Call once per optimizer step; loads are summed over ``data_group`` first.
        """
        self.router.update_expert_bias(self.data_group)

    def _losses_and_stats(
        self, routing: RouterOutput, keep: torch.Tensor | None, shape: torch.Size
    ) -> torch.Tensor | None:
        """Record ``stats`` and return the differentiable sum of the aux and z losses (None if unused).

        Under a ``sequence_group`` the counts and token totals are all-reduced (no gradient) and each
        rank's differentiable part is its partial sum over its own tokens divided by the group's
        token count, so the group's local losses add up to the loss of the whole micro-batch.
        """
        num_experts, top_k = self.num_experts, self.top_k
        num_tokens = routing.logits.shape[0]
        probs = routing.probs
        use_aux = (
            self.aux_loss_coeff > 0
            and self.load_balancing in ("aux_loss", "seq_aux_loss", "global_aux_loss")
            and self.routing == "topk"
        )
        use_z = self.z_loss_coeff > 0
        prob_sum = probs.sum(0)
        lse_sq_sum = torch.logsumexp(routing.logits, dim=-1).square().sum() if use_z else None

        with torch.no_grad():
            if self.routing == "expert_choice":
                assert keep is not None
                # Dropped: the tokens no expert picked.
                kept = keep.any(1).sum() * top_k
            else:
                kept = keep.sum() if keep is not None else num_tokens * top_k
            entropy = torch.special.entr(probs).sum()
            zero = probs.new_zeros(())
            # One all-reduce for everything that sums over the micro-batch.
            totals = torch.cat(
                [
                    routing.tokens_per_expert.float(),
                    prob_sum.detach(),
                    torch.stack(
                        [
                            probs.new_tensor(float(num_tokens)),
                            torch.as_tensor(kept, dtype=torch.float32, device=probs.device),
                            entropy,
                            lse_sq_sum.detach() if lse_sq_sum is not None else zero,
                        ]
                    ),
                ]
            )
            comm.all_reduce_(totals, self.sequence_group, "cp")
            counts, prob_sum_all = totals[:num_experts], totals[num_experts : 2 * num_experts]
            total_tokens, total_kept, entropy_all, lse_sq_all = totals[2 * num_experts :].unbind()

        loss = None
        aux_value = zero
        if use_aux:
            if self.load_balancing == "seq_aux_loss":
                loss, aux_value = self._seq_aux_loss(routing, shape)
            else:
                slot_counts, slot_tokens = counts, total_tokens
                if self.load_balancing == "global_aux_loss":
                    with torch.no_grad():
                        local = torch.cat([routing.tokens_per_expert.float(), probs.new_tensor([float(num_tokens)])])
                        comm.all_reduce_(local, self.data_group, "dp")
                        slot_counts, slot_tokens = local[:num_experts], local[num_experts]
                args = (slot_counts, total_tokens, slot_tokens * top_k, self.aux_loss_coeff)
                loss = load_balancing_loss(prob_sum, *args)
                aux_value = load_balancing_loss(prob_sum_all, *args)
        z_value = zero
        if use_z:
            assert lse_sq_sum is not None
            z = self.z_loss_coeff * lse_sq_sum / total_tokens
            z_value = self.z_loss_coeff * lse_sq_all / total_tokens
            loss = z if loss is None else loss + z

        self.stats = {
            "tokens_per_expert": counts,
            "aux_loss": aux_value.detach(),
            "z_loss": z_value.detach(),
            "dropped_fraction": 1.0 - total_kept / (total_tokens * top_k),
            "router_entropy": entropy_all / total_tokens,
        }
        return loss

    def _seq_aux_loss(self, routing: RouterOutput, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-sequence Switch loss, averaged over sequences: ``(differentiable, reduced value)``.

        Inside :func:`~lightning_moe.moe.documents.routing_documents` each (row, document) is a sequence.
        """
        documents = current_routing_documents()
        if documents is not None:
            return self._document_seq_aux_loss(routing, shape, documents)
        num_experts, top_k = self.num_experts, self.top_k
        seq_len = shape[-2] if len(shape) >= 3 else math.prod(shape[:-1])
        batch = routing.logits.shape[0] // seq_len
        probs = routing.probs.view(batch, seq_len, num_experts)
        offsets = torch.arange(batch, device=probs.device).view(batch, 1, 1) * num_experts
        topk_idx = routing.topk_idx.view(batch, seq_len, top_k)
        prob_sum = probs.sum(1)
        with torch.no_grad():
            counts = torch.bincount((topk_idx + offsets).reshape(-1), minlength=batch * num_experts)
            totals = torch.cat(
                [
                    counts.view(batch, num_experts).float(),
                    prob_sum.detach(),
                    probs.new_full((batch, 1), float(seq_len)),
                ],
                dim=1,
            )
            comm.all_reduce_(totals, self.sequence_group, "cp")
            counts, prob_sum_all, seq_tokens = totals[:, :num_experts], totals[:, num_experts:-1], totals[:, -1]
        args = (counts, seq_tokens, seq_tokens * top_k, self.aux_loss_coeff)
        return load_balancing_loss(prob_sum, *args), load_balancing_loss(prob_sum_all, *args)

    def _document_seq_aux_loss(
        self, routing: RouterOutput, shape: torch.Size, documents: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_seq_aux_loss` with each (row, document) of ``documents [batch, seq]`` as one sequence.

        The groups' statistics are summed over ``sequence_group`` (the ranks holding other shards of
        the same rows, whose ids number the same documents): counts and token totals without
        gradient, while the differentiable part is this rank's partial prob sums over the global
        totals, so the ranks' losses add up to the loss of the whole micro-batch. The group count
        (``1 + max id`` over the group) is agreed by a MAX all-reduce first.
        """
        num_experts, top_k = self.num_experts, self.top_k
        seq_len = shape[-2] if len(shape) >= 3 else math.prod(shape[:-1])
        batch = routing.logits.shape[0] // seq_len if seq_len else 0
        if tuple(documents.shape) != (batch, seq_len):
            raise ValueError(
                f"routing documents of shape {tuple(documents.shape)} do not match the MoE layer's input of"
                f" [batch, seq] = {(batch, seq_len)} (input {tuple(shape)}): give the ids of the tokens this layer sees"
            )
        documents_per_row = agreed_documents_per_row(documents, self.sequence_group, routing.probs.device)
        shards = dist.get_world_size(self.sequence_group) if self.sequence_group is not None else 1
        if documents_per_row > seq_len * shards:
            raise ValueError(
                f"routing documents hold ids up to {documents_per_row - 1} in rows of {seq_len * shards} tokens: number"
                " the documents of each row from 0 (0 0 0 1 1 2 ...), not across the batch or the corpus"
            )
        probs = routing.probs.view(batch, seq_len, num_experts)
        topk_idx = routing.topk_idx.view(batch, seq_len, top_k)
        prob_sum, counts, tokens = document_balance_statistics(probs, topk_idx, documents, documents_per_row)
        with torch.no_grad():
            totals = torch.cat([counts, prob_sum.detach(), tokens.unsqueeze(1)], dim=1)
            comm.all_reduce_(totals, self.sequence_group, "cp")
            counts, prob_sum_all, tokens = totals[:, :num_experts], totals[:, num_experts:-1], totals[:, -1]
        args = (counts, tokens, top_k, self.aux_loss_coeff)
        return document_balance_loss(prob_sum, *args), document_balance_loss(prob_sum_all, *args)


class ExpertOutputBias(nn.Module):
    """The experts' down-projection biases ``weight [E, H]``, added per token after the combine.

    ``forward(topk_idx [T, k], topk_weights [T, k], keep [T, k] | None) -> [T, H]`` (fp32):
    ``sum_k keep_k * w_k * weight[i_k]``: exactly what adding ``weight[e]`` to expert e's output
    inside every expert would contribute, but computed where the token is, so it needs no
    expert-parallel sharding and no dispatch.
    """

    def __init__(self, num_experts: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))

    def forward(self, topk_idx: torch.Tensor, topk_weights: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        weights = topk_weights if keep is None else topk_weights * keep.to(topk_weights.dtype)
        num_tokens, top_k = topk_idx.shape
        gates = weights.new_zeros(num_tokens, self.weight.shape[0]).scatter_add_(1, topk_idx, weights)
        return gates @ self.weight.to(gates.dtype)


def update_expert_biases(module: nn.Module) -> None:
    """Call :meth:`MoELayer.update_expert_bias` on every MoE layer of ``module`` (once per optimizer step)."""
    for layer in module.modules():
        if isinstance(layer, MoELayer):
            layer.update_expert_bias()

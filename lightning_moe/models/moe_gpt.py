"""`MoEGPT`: the reference byte-level Mixture-of-Experts decoder, as a LightningModule."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.optim.lr_scheduler import LambdaLR

from lightning_moe.models.blocks import Attention, FeedForward, TransformerBlock, rotary_cos_sin
from lightning_moe.moe import MoELayer, update_expert_biases
from lightning_moe.parallel.init import seeded_generator

__all__ = ["MoEGPT", "is_moe_layer", "next_token_loss", "warmup_cosine_factor"]


def is_moe_layer(layer_index: int, moe_layer_freq: int) -> bool:
    """Whether layer `layer_index` (0-based) gets an MoE FFN: every `moe_layer_freq`-th layer,
    counting from 1, i.e. `(layer_index + 1) % moe_layer_freq == 0`.

    `freq=1`: all layers; `freq=2`: layers 1, 3, 5, ... (the first layer stays dense, as in GShard
    and DeepSeek); `freq=0`: none.
    """
    return moe_layer_freq > 0 and (layer_index + 1) % moe_layer_freq == 0


def warmup_cosine_factor(
    step: int, *, warmup_steps: int, max_steps: int, min_lr_ratio: float
) -> float:
    """LR multiplier after `step` optimizer steps: linear warmup then cosine decay.

    `(step + 1) / warmup_steps` while `step < warmup_steps` (the first step already trains), then
    cosine from 1 at `warmup_steps` to `min_lr_ratio` at `max_steps`, constant afterwards.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def next_token_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    loss_token_count: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Mean next-token cross entropy (fp32 softmax) over the tokens of `labels` that `loss_mask`
    keeps, divided by `loss_token_count` when given: under context parallelism the strategy passes
    the micro-batch's loss tokens per cp rank, so the cp ranks' losses average to the mean over
    all tokens (not a mean of means)."""
    per_token = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), reduction="none")
    if loss_mask is not None:
        per_token = per_token * loss_mask.flatten().to(per_token.dtype)
    count = loss_token_count
    if count is None:
        count = loss_mask.sum() if loss_mask is not None else per_token.numel()
    return per_token.sum() / torch.as_tensor(count, dtype=per_token.dtype).clamp_min(1.0)


class MoEGPT(pl.LightningModule):
    """Byte-level decoder-only transformer with MoE FFNs: the reference model of lightning-moe.

    `tok_embeddings -> layers["0".."n-1"] (TransformerBlock) -> norm -> output`. Layer `i` has an
    `MoELayer(hidden_size, **moe)` FFN when `(i + 1) % moe_layer_freq == 0` (see `is_moe_layer`),
    otherwise a dense SwiGLU `FeedForward(hidden_size, ffn_hidden_size)`.

    Args:
        vocab_size: 256 for bytes.
        hidden_size, num_layers, num_heads: transformer shape.
        num_kv_heads: grouped-query K/V heads (None: `num_heads`).
        ffn_hidden_size: dense FFN width (None: `8/3 * hidden_size` rounded up to a multiple of 64,
            the SwiGLU width with the parameters of a `4 * hidden_size` MLP).
        moe_layer_freq: see above; 0 means no MoE layer.
        moe: `MoELayer` keyword arguments except `hidden_size`, merged over
            `{"num_experts": 8, "top_k": 2, "ffn_hidden_size": <dense ffn_hidden_size>}`.
        max_seq_len: longest sequence accepted when `position_ids` are not given.
        rope_theta: RoPE base.
        lr, min_lr_ratio, weight_decay, betas, warmup_steps, max_steps: AdamW with linear warmup
            and cosine decay to `lr * min_lr_ratio` at `max_steps` (None: the trainer's).
        init_std: std of the normal init of every matrix; the residual-output projections
            (`wo`, `w2`) use `init_std / sqrt(2 * num_layers)` (GPT-2). See `initial_value`: the
            same seed gives the same model on every layout, also when built on the meta device
            (`trainer.init_module(empty_init=True)`), where no rank ever holds the full model.

    Conventions other parts of lightning-moe rely on:
        - attention goes through `F.scaled_dot_product_attention` (context parallel swaps it);
        - `tensor_parallel_plan()` declares tensor/sequence parallelism;
        - a pipeline stage is this module with `layers` entries deleted and `tok_embeddings`
          (first stage) or `norm`/`output` (last stage) set to None: `forward` then takes or
          returns hidden states; `loss_from_logits(logits, labels, ...)` is the loss the
          strategy computes on the last stage for every pipeline micro-batch.

    Example:
        >>> model = MoEGPT(hidden_size=64, num_layers=2, moe={"num_experts": 4, "ffn_hidden_size": 64})
        >>> model(torch.randint(0, 256, (2, 16))).shape
        torch.Size([2, 16, 256])
        >>> lightning.Trainer(max_steps=60).fit(model, datamodule=ByteTextDataModule())  # doctest: +SKIP
    """

    def __init__(
        self,
        vocab_size: int = 256,
        hidden_size: int = 128,
        num_layers: int = 4,
        num_heads: int = 4,
        num_kv_heads: int | None = None,
        ffn_hidden_size: int | None = None,
        moe_layer_freq: int = 1,
        moe: Mapping[str, Any] | None = None,
        max_seq_len: int = 2048,
        rope_theta: float = 10000.0,
        lr: float = 3e-3,
        min_lr_ratio: float = 0.1,
        weight_decay: float = 0.1,
        betas: Sequence[float] = (0.9, 0.95),
        warmup_steps: int = 10,
        max_steps: int | None = None,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        if moe_layer_freq < 0:
            raise ValueError(f"moe_layer_freq must be >= 0 (0: no MoE layer), got {moe_layer_freq}")
        self.save_hyperparameters()
        if ffn_hidden_size is None:
            ffn_hidden_size = 64 * math.ceil(8 * hidden_size / 3 / 64)
        moe_kwargs = {"num_experts": 8, "top_k": 2, "ffn_hidden_size": ffn_hidden_size}
        moe_kwargs.update(dict(moe or {}))
        self.max_seq_len = max_seq_len
        self.rope_theta = rope_theta

        self.tok_embeddings = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleDict()
        for i in range(num_layers):
            if is_moe_layer(i, moe_layer_freq):
                feed_forward: nn.Module = MoELayer(hidden_size, **moe_kwargs)
            else:
                feed_forward = FeedForward(hidden_size, ffn_hidden_size)
            attention = Attention(hidden_size, num_heads, num_kv_heads)
            self.layers[str(i)] = TransformerBlock(attention, feed_forward, hidden_size)
        self.norm = nn.RMSNorm(hidden_size, eps=1e-6)
        self.output = nn.Linear(hidden_size, vocab_size, bias=False)
        self.head_dim = hidden_size // num_heads
        # The seed of the initial weights (torch.manual_seed / seed_everything before construction):
        # every tensor's initial value derives from it and its name, on any layout (initial_value).
        self.init_seed = torch.initial_seed()
        if not any(p.is_meta for p in self.parameters()):
            self.reset_parameters()

    def initial_value(self, name: str, tensor: torch.Tensor, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The initial value of parameter or buffer `name` (CPU, the global shape of `tensor`), or
        its block `index` (slices of that shape: a rank's shard).

        Matrices (linear, embedding, router and expert weights; ndim >= 2) are normal with std
        `init_std`, the residual-output projections (`wo`, `w2`) `init_std / sqrt(2 * num_layers)`
        (GPT-2), each drawn from its own generator seeded by `init_seed` and the name, so a rank
        that holds a shard draws exactly the slice one process draws. Norm weights are ones, other
        vectors (biases, expert-bias buffers) zeros. A strategy that builds the model on the meta
        device materialises its shards from this (`lightning_moe.parallel.init.materialize_sharded`).
        """
        index = index or ()
        if tensor.ndim < 2:
            return (torch.ones if name.endswith("norm.weight") else torch.zeros)(tensor.shape)[index]
        hp = self.hparams
        parts = name.split(".")
        leaf = parts[-2] if parts[-1] == "weight" else parts[-1]
        # Projections that write into the residual stream: smaller so depth adds up to ~std.
        std = hp.init_std / math.sqrt(2 * hp.num_layers) if leaf in ("wo", "w2") else hp.init_std
        whole = torch.empty(tensor.shape).normal_(0.0, std, generator=seeded_generator(self.init_seed, name))
        return whole[index]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Set every parameter and buffer to its `initial_value` (a model built on a real device)."""
        for name, tensor in itertools.chain(self.named_parameters(), self.named_buffers()):
            tensor.copy_(self.initial_value(name, tensor))

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`input_ids [B, S]` (int64) -> logits `[B, S, vocab]`.

        `position_ids [B, S]` or `[S]` drive RoPE (default `arange(S)`); context parallelism passes
        the global positions of its shard. On a pipeline stage without `tok_embeddings`,
        `input_ids` is the hidden state `[B, S, hidden]`; without `output`, hidden states return.
        """
        if position_ids is None:
            # input_ids, not the embeddings: under sequence parallelism those are sequence shards.
            seq_len = input_ids.shape[1]
            if seq_len > self.max_seq_len:
                raise ValueError(
                    f"sequence length {seq_len} exceeds max_seq_len {self.max_seq_len}: "
                    "raise max_seq_len or pass position_ids"
                )
            position_ids = torch.arange(seq_len, device=input_ids.device)
        cos, sin = rotary_cos_sin(position_ids, self.head_dim, self.rope_theta)
        h = self.tok_embeddings(input_ids) if self.tok_embeddings is not None else input_ids
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def loss(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Mean next-token cross entropy of a batch dict (`input_ids`, `labels`, optional
        `position_ids`, `loss_mask` and `loss_token_count`; masked tokens are left out of the
        mean, which divides by `loss_token_count` when the strategy provides it). Logits are cast
        to fp32 for the softmax."""
        logits = self(batch["input_ids"], batch.get("position_ids"))
        return self.loss_from_logits(
            logits, batch["labels"], batch.get("loss_mask"), batch.get("loss_token_count")
        )

    def loss_from_logits(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        loss_mask: torch.Tensor | None = None,
        loss_token_count: torch.Tensor | float | None = None,
    ) -> torch.Tensor:
        """The loss of `loss()` from logits `[B, S, vocab]`: the mean cross entropy over the tokens
        of `labels [B, S]` that `loss_mask` keeps, divided by `loss_token_count` when given. Under
        pipeline parallelism the strategy calls it on the last stage for every micro-batch."""
        return next_token_loss(logits, labels, loss_mask, loss_token_count)

    def training_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=False,
                 batch_size=batch["input_ids"].shape[0])
        return loss

    def validation_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("val/loss", loss, prog_bar=True, on_step=False, on_epoch=True, sync_dist=True,
                 batch_size=batch["input_ids"].shape[0])
        return loss

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        """Lightning's step, then the aux-loss-free expert-bias update once per optimizer step (after
        the loads of all its micro-batches were accumulated), unless the strategy does it itself
        (`MoE5DStrategy` does, for any module)."""
        super().optimizer_step(*args, **kwargs)
        if not getattr(self.trainer.strategy, "updates_expert_biases", False):
            update_expert_biases(self)

    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW; weight decay on matrices (ndim >= 2: linear, router and expert weights) except
        the token embedding; none on vectors (norm weights). Linear warmup then cosine decay,
        stepped every optimizer step."""
        hp = self.hparams
        decay, no_decay = [], []
        for name, param in self.named_parameters():
            if param.requires_grad:
                wants_decay = param.ndim >= 2 and not name.startswith("tok_embeddings.")
                (decay if wants_decay else no_decay).append(param)
        groups = [
            {"params": params, "weight_decay": wd}
            for params, wd in ((decay, hp.weight_decay), (no_decay, 0.0))
            if params
        ]
        optimizer = torch.optim.AdamW(groups, lr=hp.lr, betas=tuple(hp.betas))
        schedule = partial(
            warmup_cosine_factor,
            warmup_steps=hp.warmup_steps,
            max_steps=self._total_steps(),
            min_lr_ratio=hp.min_lr_ratio,
        )
        scheduler = LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _total_steps(self) -> int:
        if self.hparams.max_steps is not None:
            return int(self.hparams.max_steps)
        if self.trainer.max_steps > 0:
            return int(self.trainer.max_steps)
        estimated = self.trainer.estimated_stepping_batches
        if not math.isfinite(estimated):
            raise ValueError(
                "cannot size the cosine schedule: set MoEGPT(max_steps=...) or "
                "Trainer(max_steps=...)"
            )
        return int(estimated)

    def tensor_parallel_plan(self, sequence_parallel: bool = True) -> dict[str, ParallelStyle]:
        """Tensor-parallel plan for `parallelize_module(self, tp_mesh, plan)` (Megatron layout).

        - attention: `wq/wk/wv` column-wise (heads split over tp), `wo` row-wise;
        - dense SwiGLU: `w1/w3` column-wise, `w2` row-wise;
        - `tok_embeddings`: row-wise (vocab split), `output`: column-wise, logits replicated;
        - with `sequence_parallel`: the norms run on sequence shards (`SequenceParallel`), the
          residual stream between blocks is a local tensor sharded on the sequence dim (dim 1),
          gathered before the attention/FFN projections (`PrepareModuleInput`) and
          reduce-scattered after `wo`/`w2`; without it everything outside those regions is
          replicated.

        MoE FFNs get no sharding style: with sequence parallelism their input is marked as a
        sequence-sharded DTensor (`PrepareModuleInputOutput`), without it they receive replicated
        tokens; `lightning_moe.parallelize` owns expert sharding and reads which of the two arrives. Only layers present in `self.layers` are listed, so the plan also fits
        a pipeline stage.
        """
        seq = Shard(1) if sequence_parallel else Replicate()
        plan: dict[str, ParallelStyle] = {}
        if self.tok_embeddings is not None:
            plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
        if self.norm is not None and sequence_parallel:
            plan["norm"] = SequenceParallel(use_local_output=True)
        if self.output is not None:
            plan["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
        for key, block in self.layers.items():
            prefix = f"layers.{key}."
            if sequence_parallel:
                plan[prefix + "attention_norm"] = SequenceParallel(use_local_output=True)
                plan[prefix + "ffn_norm"] = SequenceParallel(use_local_output=True)
                # One all-gather for q, k and v together; cos/sin pass through unchanged.
                plan[prefix + "attention"] = PrepareModuleInput(
                    input_layouts=(Shard(1), None, None),
                    desired_input_layouts=(Replicate(), None, None),
                )
            for name in ("wq", "wk", "wv"):
                plan[f"{prefix}attention.{name}"] = ColwiseParallel()
            plan[prefix + "attention.wo"] = RowwiseParallel(output_layouts=seq)
            if isinstance(block.feed_forward, MoELayer):
                if sequence_parallel:
                    # Tell the MoE layer its tokens are sequence shards (a plain tensor would mean
                    # replicated tokens); the residual stream stays a local tensor.
                    plan[prefix + "feed_forward"] = PrepareModuleInputOutput(
                        input_layouts=(Shard(1),),
                        desired_input_layouts=(Shard(1),),
                        use_local_input=False,
                        output_layouts=(Shard(1),),
                        desired_output_layouts=(Shard(1),),
                        use_local_output=True,
                    )
            elif isinstance(block.feed_forward, FeedForward):
                if sequence_parallel:
                    plan[prefix + "feed_forward"] = PrepareModuleInput(
                        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                    )
                plan[prefix + "feed_forward.w1"] = ColwiseParallel()
                plan[prefix + "feed_forward.w3"] = ColwiseParallel()
                plan[prefix + "feed_forward.w2"] = RowwiseParallel(output_layouts=seq)
        return plan

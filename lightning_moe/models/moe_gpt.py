"""`MoEGPT`: the reference byte-level Mixture-of-Experts decoder, as a LightningModule."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
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

from lightning_moe.models.blocks import Attention, FeedForward, TransformerBlock, rotary_cos_sin
from lightning_moe.models.causal_lm import CausalLMModule, check_optimizer, next_token_loss, warmup_cosine_factor
from lightning_moe.moe import MoEConfig, MoELayer, token_keys
from lightning_moe.moe.config import DEFAULT_NUM_EXPERTS
from lightning_moe.parallel.init import seeded_generator

__all__ = ["MoEGPT", "is_moe_layer", "next_token_loss", "warmup_cosine_factor"]


def is_moe_layer(layer_index: int, moe_layer_freq: int) -> bool:
    """Whether layer `layer_index` (0-based) gets an MoE FFN: every `moe_layer_freq`-th layer,
    counting from 1, i.e. `(layer_index + 1) % moe_layer_freq == 0`.

    `freq=1`: all layers; `freq=2`: layers 1, 3, 5, ... (the first layer stays dense, as in GShard
    and DeepSeek); `freq=0`: none.
    """
    return moe_layer_freq > 0 and (layer_index + 1) % moe_layer_freq == 0


class MoEGPT(CausalLMModule):
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
        moe: `MoEConfig` (`MoELayer`) keyword arguments except `hidden_size`, merged over
            `{"num_experts": 8, "ffn_hidden_size": <dense ffn_hidden_size>}` (the rest: `MoEConfig`'s
            defaults, e.g. `top_k=2`). Every MoE layer is built from the one `MoEConfig`.
        max_seq_len: longest sequence accepted when `position_ids` are not given.
        rope_theta: RoPE base.
        lr, min_lr_ratio, weight_decay, betas, warmup_steps, max_steps: AdamW with linear warmup
            and cosine decay to `lr * min_lr_ratio` at `max_steps` (None: the trainer's).
        optimizer: `"adamw"`, or `"muon"` (`lightning_moe.optim.Muon` with the same `lr`, schedule
            and weight decay: its update is scaled to AdamW's RMS).
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

    Training (loss, steps, optimizer and schedule, expert-bias update) is
    `lightning_moe.models.causal_lm.CausalLMModule`'s, shared with `HFMoEModule`.
    """

    lr_hparam = "lr"

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
        optimizer: str = "adamw",
    ) -> None:
        super().__init__()
        check_optimizer(optimizer)
        if moe_layer_freq < 0:
            raise ValueError(f"moe_layer_freq must be >= 0 (0: no MoE layer), got {moe_layer_freq}")
        self.save_hyperparameters()
        if ffn_hidden_size is None:
            ffn_hidden_size = 64 * math.ceil(8 * hidden_size / 3 / 64)
        moe_kwargs = {"num_experts": DEFAULT_NUM_EXPERTS, "ffn_hidden_size": ffn_hidden_size}
        moe_kwargs.update(dict(moe or {}))
        # Checked once, and only when some layer is an MoE layer (moe_layer_freq=0 never reads it).
        moe_layers = [i for i in range(num_layers) if is_moe_layer(i, moe_layer_freq)]
        moe_config = MoEConfig(hidden_size, **moe_kwargs) if moe_layers else None
        self.max_seq_len = max_seq_len
        self.rope_theta = rope_theta

        self.tok_embeddings = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleDict()
        for i in range(num_layers):
            if moe_config is not None and i in moe_layers:
                feed_forward: nn.Module = MoELayer(config=moe_config)
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
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        sample_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`input_ids [B, S]` (int64) -> logits `[B, S, vocab]`.

        `position_ids [B, S]` or `[S]` drive RoPE (default `arange(S)`); context parallelism passes
        the global positions of its shard. On a pipeline stage without `tok_embeddings`,
        `input_ids` is the hidden state `[B, S, hidden]`; without `output`, hidden states return.
        `sample_index [B]`: the samples' global indices (dataset batches carry them); with the
        positions they key each token for routing record/replay (`lightning_moe.moe.replay`).
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
        with token_keys(sample_index, position_ids):
            for layer in self.layers.values():
                h = layer(h, cos, sin)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

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

"""`MoEGPT`: the reference byte-level Mixture-of-Experts decoder, as a LightningModule."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
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
from lightning_moe.models.mtp import MultiTokenPrediction, add_mtp_targets, mtp_loss
from lightning_moe.moe import MoEConfig, MoELayer, token_keys
from lightning_moe.moe.config import DEFAULT_NUM_EXPERTS
from lightning_moe.parallel.dims import parallel_dims_of
from lightning_moe.parallel.plans.init import seeded_generator
from lightning_moe.parallel.plans.pipeline import stage_layer_keys

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
        mtp_depth: multi-token prediction depths (DeepSeek-V3; 0: none). Depth `k` combines the
            hidden state of depth `k - 1` with the embedding of the token `k` ahead, runs one
            `TransformerBlock` and predicts through the shared `output` head
            (`lightning_moe.models.mtp.MultiTokenPrediction`, in `self.mtp["0".."D-1"]`).
        mtp_loss_weight: the training objective is `loss + mtp_loss_weight * mtp_loss`, `mtp_loss`
            the mean over depths of each depth's cross entropy; both are logged
            (`train/loss`, `train/mtp_loss`).
        mtp_moe: whether the MTP blocks get an MoE FFN (None: as the last layer does).

    Conventions other parts of lightning-moe rely on:
        - attention goes through `F.scaled_dot_product_attention` (context parallel swaps it);
        - `tensor_parallel_plan()` declares tensor/sequence parallelism;
        - a pipeline stage is this module with `layers` entries deleted and `tok_embeddings`
          (first stage) or `norm`/`output` (last stage) set to None: `forward` then takes or
          returns hidden states; `loss_from_logits(logits, labels, ...)` is the loss the
          strategy computes on the last stage for every pipeline micro-batch. With MTP the last
          stage also holds `mtp` and a copy of `tok_embeddings` that the strategy keeps equal to
          the first stage's (`pipeline_last_stage_modules`), and its loss is `loss_terms_from_output`.

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
        mtp_depth: int = 0,
        mtp_loss_weight: float = 0.3,
        mtp_moe: bool | None = None,
    ) -> None:
        super().__init__()
        check_optimizer(optimizer)
        if moe_layer_freq < 0:
            raise ValueError(f"moe_layer_freq must be >= 0 (0: no MoE layer), got {moe_layer_freq}")
        _check_mtp(mtp_depth, mtp_loss_weight, max_seq_len)
        self.save_hyperparameters()
        if ffn_hidden_size is None:
            ffn_hidden_size = 64 * math.ceil(8 * hidden_size / 3 / 64)
        moe_kwargs = {"num_experts": DEFAULT_NUM_EXPERTS, "ffn_hidden_size": ffn_hidden_size}
        moe_kwargs.update(dict(moe or {}))
        # Checked once, and only when some layer is an MoE layer (moe_layer_freq=0 never reads it).
        moe_layers = [i for i in range(num_layers) if is_moe_layer(i, moe_layer_freq)]
        if mtp_moe is None:
            mtp_moe = is_moe_layer(num_layers - 1, moe_layer_freq)
        moe_config = MoEConfig(hidden_size, **moe_kwargs) if moe_layers or (mtp_depth and mtp_moe) else None
        self.max_seq_len = max_seq_len
        self.rope_theta = rope_theta

        def block(moe_ffn: bool) -> TransformerBlock:
            feed_forward = MoELayer(config=moe_config) if moe_ffn else FeedForward(hidden_size, ffn_hidden_size)
            return TransformerBlock(Attention(hidden_size, num_heads, num_kv_heads), feed_forward, hidden_size)

        self.tok_embeddings = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleDict({str(i): block(i in moe_layers) for i in range(num_layers)})
        self.norm = nn.RMSNorm(hidden_size, eps=1e-6)
        self.mtp = nn.ModuleDict({str(k): MultiTokenPrediction(block(mtp_moe), hidden_size) for k in range(mtp_depth)})
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
        device materialises its shards from this (`lightning_moe.parallel.plans.init.materialize_sharded`).
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
        mtp_input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """`input_ids [B, S]` (int64) -> logits `[B, S, vocab]`.

        `position_ids [B, S]` or `[S]` drive RoPE (default `arange(S)`); context parallelism passes
        the global positions of its shard. On a pipeline stage after the first, `input_ids` is the
        hidden state `[B, S, hidden]` (floating point); on a stage without `output`, hidden states
        return (and `mtp_input_ids` is ignored: the MTP modules sit on the last stage).
        `sample_index [B]`: the samples' global indices (dataset batches carry them); with the
        positions they key each token for routing record/replay (`lightning_moe.moe.replay`).
        `mtp_input_ids [B, S, D]`: the tokens `k` ahead for each MTP depth (`add_mtp_targets`);
        with them the result is the tuple `(logits, logits of depth 1, ..., logits of depth D)`. The
        loss goes through here, not around it, so that a fully sharded module gathers its parameters
        once for both.
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
        # Token ids start the model; a pipeline stage after the first receives a hidden state. The
        # last stage holds tok_embeddings too under multi-token prediction, so its presence cannot tell.
        h = input_ids if input_ids.is_floating_point() else self.tok_embeddings(input_ids)
        with token_keys(sample_index, position_ids):
            for layer in self.layers.values():
                h = layer(h, cos, sin)
            if self.output is None:  # a pipeline stage before the last
                return h
            head_inputs = [self.norm(h)]
            if mtp_input_ids is not None:
                # One embedding call and one head call for all depths: a module called twice would be
                # gathered (FSDP2) and its gradient reduced once per call.
                ahead = self.tok_embeddings(mtp_input_ids)  # [B, S, D, hidden]
                depth_hidden = h
                for k, module in enumerate(self.mtp.values()):
                    depth_hidden = module(depth_hidden, ahead[..., k, :], cos, sin)
                    head_inputs.append(module.norm(depth_hidden))
        if mtp_input_ids is None:
            return self.output(head_inputs[0])
        # Flat: a pipeline's last stage may return only tensors.
        return self.output(torch.cat(head_inputs)).chunk(len(head_inputs))

    # -- multi-token prediction --------------------------------------------------------------------
    def loss(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The training objective: the next-token loss, plus `mtp_loss_weight` times the MTP loss
        when `mtp_depth > 0` (see `loss_terms`)."""
        return self.loss_terms(batch)[0]

    def loss_terms(self, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """`(objective, {"loss": next-token loss, "mtp_loss": mean over depths})`; without MTP the
        objective is the next-token loss alone.

        Depth `k` trains on the batch's `mtp_*` entries (`lightning_moe.models.mtp.add_mtp_targets`,
        added in `before_sequence_sharding`, so that under context parallelism they come from the
        whole row); a batch without them gets them here. Under cp, `mtp_loss_token_count` (the
        depths' loss tokens of the whole micro-batch over cp) divides each depth's local sum, as
        `loss_token_count` does the main loss's.
        """
        depth = self.hparams.mtp_depth  # not len(self.mtp): a pipeline rank before the last holds none
        if not depth:
            main = super().loss(batch)
            return main, {"loss": main}
        if "mtp_labels" not in batch:
            batch = add_mtp_targets(batch, depth)
        output = self(
            batch["input_ids"],
            batch.get("position_ids"),
            **self.sample_index_kwargs(batch),
            mtp_input_ids=batch["mtp_input_ids"],
        )
        return self.loss_terms_from_output(output, batch)

    @property
    def loss_term_names(self) -> tuple[str, ...]:
        """The names of `loss_terms`' terms, in order (each logged as `train/<name>`)."""
        return ("loss", "mtp_loss") if self.hparams.mtp_depth else ("loss",)

    def loss_terms_from_output(
        self, output: torch.Tensor | tuple[torch.Tensor, ...], targets: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """`loss_terms` from `forward`'s output: logits, or `(logits, *mtp_logits)`, with their targets
        (`labels` and the optional `loss_mask`, `loss_token_count` and `mtp_*` entries of a batch).
        Under pipeline parallelism the strategy calls it on the last stage for every micro-batch."""
        logits, *depth_logits = output if isinstance(output, tuple) else (output,)
        main = self.loss_from_logits(
            logits, targets["labels"], targets.get("loss_mask"), targets.get("loss_token_count")
        )
        if not depth_logits:
            return main, {"loss": main}
        extra = mtp_loss(depth_logits, targets)
        return main + self.hparams.mtp_loss_weight * extra, {"loss": main, "mtp_loss": extra}

    def before_sequence_sharding(self, batch: Any) -> Any:
        """Add the MTP targets (`MTP_KEYS`) while rows are whole: the strategy calls this before it
        shards a batch for context parallelism, and under pipeline parallelism before it packs the
        targets for the last stage (otherwise :meth:`loss_terms` adds them itself)."""
        if self.hparams.mtp_depth and isinstance(batch, Mapping) and "labels" in batch:
            return add_mtp_targets(batch, self.hparams.mtp_depth)
        return batch

    @property
    def pipeline_last_stage_modules(self) -> tuple[str, ...]:
        """The last pipeline stage's modules: `norm` and `output`, with MTP also `mtp` and a copy of
        `tok_embeddings` (tied to the first stage's: see `lightning_moe.parallel.plans.pipeline`)."""
        return ("norm", "output", "mtp", "tok_embeddings") if self.hparams.mtp_depth else ("norm", "output")

    def setup(self, stage: str) -> None:
        """Refuse what MTP cannot train on before any work: sequences not longer than `mtp_depth`
        (the datamodule's `seq_len`), and under pipeline parallelism a last stage without a main
        layer (`check_mtp_pipeline_split`)."""
        depth = self.hparams.mtp_depth
        if not depth:
            return
        seq_len = getattr(self.trainer.datamodule, "seq_len", None)
        if isinstance(seq_len, int) and depth >= seq_len:
            raise ValueError(
                f"mtp_depth={depth} needs sequences longer than {depth} tokens, got seq_len={seq_len}: "
                "lower model.mtp_depth or raise data.seq_len"
            )
        dims = parallel_dims_of(self.trainer)
        if dims is not None and dims.pp > 1:
            strategy = self.trainer.strategy
            self.check_mtp_pipeline_split(
                dims.pp * getattr(strategy, "pp_stages_per_rank", 1), getattr(strategy, "pp_stage_layers", None)
            )

    def check_mtp_pipeline_split(self, num_stages: int, stage_layers: Sequence[int] | None = None) -> None:
        """The MTP blocks run on the last of `num_stages` pipeline stages, after its share of the
        main layers (``stage_layers``: the strategy's ``pp_stage_layers``): refuse a split
        (`pp_stage_layers` or `pipeline_stage_layers`) that gives it none, and warn when they
        make it at least twice as heavy, in blocks, as the heaviest other stage (the pipeline then
        runs at the last stage's pace), naming the fix for both."""
        depth = self.hparams.mtp_depth
        stages = stage_layer_keys(self, num_stages, stage_layers)
        last, heaviest_other = len(stages[-1]), max(len(keys) for keys in stages[:-1])
        if last == 0:
            raise ValueError(
                f"mtp_depth={depth} under pipeline parallelism: the last of {num_stages} stages runs the MTP blocks"
                " after at least one main layer, but pipeline_stage_layers gives it none: move at least one layer"
                " to the last stage"
            )
        if last + depth >= 2 * heaviest_other:
            rank_zero_warn(
                f"mtp_depth={depth} under pipeline parallelism: the last of {num_stages} stages runs {last} layers"
                f" + {depth} MTP blocks, the others at most {heaviest_other} layers; to balance the stages give the"
                " last one fewer layers (the strategy's pp_stage_layers, parallel.pp_stage_layers in the CLI) or use"
                " more layers per stage"
            )

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
            plan.update(_block_plan(f"layers.{key}.", block, sequence_parallel))
        for key, module in (self.mtp or {}).items():  # None on pipeline stages before the last
            prefix = f"mtp.{key}."
            if sequence_parallel:
                # Per-token modules on sequence shards: replicated weights, gradients summed over tp.
                for name in ("enorm", "hnorm", "eh_proj", "norm"):
                    plan[prefix + name] = SequenceParallel(use_local_output=True)
            plan.update(_block_plan(prefix + "block.", module.block, sequence_parallel))
        return plan


def _check_mtp(mtp_depth: int, mtp_loss_weight: float, max_seq_len: int) -> None:
    if mtp_depth < 0:
        raise ValueError(f"mtp_depth must be >= 0 (0: no multi-token prediction), got {mtp_depth}")
    if mtp_depth >= max_seq_len:
        raise ValueError(
            f"mtp_depth={mtp_depth} needs sequences longer than {mtp_depth} tokens, got max_seq_len={max_seq_len}: "
            "lower mtp_depth or raise max_seq_len"
        )
    if mtp_loss_weight < 0:
        raise ValueError(f"mtp_loss_weight must be >= 0, got {mtp_loss_weight}")


def _block_plan(prefix: str, block: TransformerBlock, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of one `TransformerBlock` under `prefix` (see `MoEGPT.tensor_parallel_plan`)."""
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {}
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

"""``HFMoEModule``: a transformers MoE causal LM (converted to ``MoELayer``) as a LightningModule."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_moe._compat import attached_trainer, attention_implementation
from lightning_moe.hf.convert import check_supported, convert_moe_blocks, hf_state_dict
from lightning_moe.hf.families import model_family
from lightning_moe.hf.loading import PADDED_SDPA, load_causal_lm, use_padded_sdpa_if_needed
from lightning_moe.hf.mtp import add_mtp_layers, main_layers, mtp_forward, mtp_layers, resolve_mtp_depth
from lightning_moe.hf.plans import split_pipeline_stage, tensor_parallel_plan
from lightning_moe.hf.sharded_load import PretrainedShards, SafetensorsFolder, load_mtp_layers
from lightning_moe.layout import size_problems, stage_layers_problem
from lightning_moe.models.causal_lm import CausalLMModule, check_optimizer
from lightning_moe.models.mtp import add_mtp_targets, mtp_loss
from lightning_moe.moe import DispatcherKind, MoELayer, TopKRouter
from lightning_moe.parallel.dims import parallel_dims_of
from lightning_moe.parallel.plans.init import seeded_generator

__all__ = ["HFMoEModule"]


class HFMoEModule(CausalLMModule):
    """A Hugging Face MoE causal LM trained under ``moe5d`` (or any strategy), with its sparse blocks as ``MoELayer``.

    Args:
        model: a transformers ``PreTrainedModel``, a ``PretrainedConfig`` (random init), a config
            mapping ``{"model_type": "qwen3_moe", ...}`` (Hydra presets) or a local folder.
        pretrained: a local folder (Hydra's ``model=hf model.pretrained=...``), instead of ``model``.
        learning_rate, warmup_steps, max_steps, min_lr_ratio, weight_decay, betas: AdamW with
            linear warmup and cosine decay (``max_steps=None``: the trainer's).
        optimizer: ``"adamw"``, or ``"muon"`` (:class:`lightning_moe.optim.Muon` with the same
            learning rate, schedule and weight decay).
        aux_loss_coeff, z_loss_coeff, capacity_factor, dispatcher, bias_update_rate: passed to
            :func:`~lightning_moe.hf.convert_moe_blocks` (``aux_loss_coeff=None``: the config's
            ``router_aux_loss_coef``).
        attn_implementation: ``"sdpa"`` (default; context parallelism swaps SDPA for ring attention).
        mtp_depth: multi-token prediction depths (DeepSeek-V3's ``config.num_nextn_predict_layers``
            layers, :mod:`lightning_moe.hf.mtp`). None (default): every depth whose weights the
            pretrained folder holds (none when built from a config or a model object); 0: none;
            ``k``: the first ``k`` (from a config or model object: ``k`` new ones). Refused above the
            folder's count and for families without MTP layers.
        mtp_loss_weight: the training objective is ``loss + mtp_loss_weight * mtp_loss``, ``mtp_loss``
            the mean over depths of each depth's cross entropy (logged as ``train/mtp_loss``), as
            in ``MoEGPT``.

    ``module.model`` is the converted transformers model; ``module(input_ids, position_ids=None)``
    returns logits. Training (batch dicts ``input_ids``, ``labels``, optional
    ``loss_mask``/``position_ids``; the loss; AdamW and its schedule; the expert-bias update once per
    optimizer step under any strategy, e.g. DeepSeek-V3's) is
    :class:`~lightning_moe.models.causal_lm.CausalLMModule`'s, shared with ``MoEGPT``. transformers'
    own router loss is off: the MoE layers add theirs through the autoscaler. :meth:`save_hf` writes a folder that
    ``AutoModelForCausalLM.from_pretrained`` loads.

    Example::

        config = transformers.Qwen3MoeConfig(hidden_size=32, num_hidden_layers=2, ...)
        module = HFMoEModule(config, learning_rate=1e-3)
        trainer = L.Trainer(strategy=MoE5DStrategy(ep=2), devices=2, max_steps=10)
        trainer.fit(module, datamodule=ByteTextDataModule(seq_len=64))
        module.save_hf("out/hf")           # rank 0 writes; from_pretrained("out/hf") loads it

        HFMoEModule(pretrained="deepseek-v3-folder/")                   # its MTP layers train too
        HFMoEModule(pretrained="deepseek-v3-folder/", mtp_depth=0)      # main model only
    """

    def __init__(
        self,
        model: Any = None,
        learning_rate: float = 1e-3,
        warmup_steps: int = 10,
        max_steps: int | None = None,
        min_lr_ratio: float = 0.1,
        weight_decay: float = 0.1,
        betas: Sequence[float] = (0.9, 0.95),
        aux_loss_coeff: float | None = None,
        z_loss_coeff: float = 0.0,
        capacity_factor: float | None = None,
        dispatcher: str = DispatcherKind.ALLTOALL_DEDUP.value,
        bias_update_rate: float = 1e-3,
        attn_implementation: str | None = "sdpa",
        pretrained: str | os.PathLike | None = None,
        optimizer: str = "adamw",
        mtp_depth: int | None = None,
        mtp_loss_weight: float = 0.3,
    ) -> None:
        super().__init__()
        check_optimizer(optimizer)
        if mtp_loss_weight < 0:
            raise ValueError(f"mtp_loss_weight must be >= 0, got {mtp_loss_weight}")
        if (model is None) == (pretrained is None):
            raise ValueError("pass exactly one of model (a model, config or folder) and pretrained (a local folder)")
        model = pretrained if model is None else model
        keep = model if isinstance(model, (str, os.PathLike, Mapping)) else None
        self.save_hyperparameters(ignore=["model", "pretrained"])
        # A path or config mapping is kept (checkpoints say what was trained); a model object is not.
        self.hparams["model"] = str(keep) if isinstance(keep, os.PathLike) else keep
        # Built on the meta device (trainer.init_module(empty_init=True)): nothing is read now; the
        # strategy materialises each rank's shards from initial_value (pretrained: read shard by shard).
        on_meta = torch.empty(()).is_meta
        self.pretrained_folder = Path(model).expanduser() if isinstance(model, (str, os.PathLike)) and on_meta else None
        self.init_seed = torch.initial_seed()
        self._pretrained_shards: Any = None
        hf = load_causal_lm(model, attn_implementation, weights=self.pretrained_folder is None)
        check_supported(hf)
        folder = Path(model).expanduser() if isinstance(model, (str, os.PathLike)) else None
        has_mtp = model_family(hf.config.model_type).mtp_layers
        checkpoint = (folder, SafetensorsFolder(folder).files) if folder is not None and has_mtp else None
        self.mtp_depth = resolve_mtp_depth(hf.config, mtp_depth, checkpoint)
        # The resolved count: a checkpoint of this module rebuilds it without reading the folder's names.
        self.hparams["mtp_depth"] = self.mtp_depth
        add_mtp_layers(hf, self.mtp_depth)
        convert_moe_blocks(
            hf,
            aux_loss_coeff=aux_loss_coeff,
            z_loss_coeff=z_loss_coeff,
            capacity_factor=capacity_factor,
            dispatcher=dispatcher,
            bias_update_rate=bias_update_rate,
        )
        if self.mtp_depth and folder is not None and self.pretrained_folder is None:
            load_mtp_layers(hf, folder)
        hf.config.use_cache = False
        use_padded_sdpa_if_needed(hf)
        self.model = hf
        self.family: str = hf.config.model_type

    # -- model ---------------------------------------------------------------------------------------
    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def vocab_size(self) -> int:
        return (
            int(self.model.get_input_embeddings().num_embeddings)
            if self.model.model.embed_tokens is not None
            else int(self.config.vocab_size)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        mtp_input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """``input_ids [B, S]`` -> logits ``[B, S, vocab]`` (hidden states in and/or out on a pipeline stage).

        ``position_ids`` (``[B, S]`` or ``[S]``) drive RoPE; context parallelism passes the global
        positions of the local shard. Attention gets no mask (SDPA's ``is_causal``), except for
        models whose attention needs one (sliding windows, GPT-OSS), built for the local sequence.
        ``mtp_input_ids [B, S, D]``: the tokens ``k`` ahead for each MTP depth
        (:func:`~lightning_moe.models.mtp.add_mtp_targets`); with them the result is
        ``(logits, [logits of depth 1..D])``.
        """
        # Through ``self.model.__call__`` with this loop as its forward: hooks on the transformers
        # model (FSDP units under pipeline parallelism) run, and ``module.model`` keeps its own forward.
        lm = self.model
        lm.forward = partial(self._decoder_loop, lm)
        try:
            return lm(input_ids, position_ids, mtp_input_ids)
        finally:
            del lm.forward

    def _decoder_loop(
        self,
        lm: nn.Module,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        mtp_input_ids: torch.Tensor | None,
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        inner = lm.model
        embed = inner.embed_tokens
        h = embed(input_ids) if embed is not None else input_ids
        seq_len = input_ids.shape[1] if position_ids is None else position_ids.shape[-1]
        if position_ids is None:
            position_ids = torch.arange(seq_len, device=input_ids.device)
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0)
        local = h.to_local() if isinstance(h, DTensor) else h
        masks = self._attention_masks(local, seq_len)
        position_embeddings = inner.rotary_emb(local, position_ids)
        layer_types = getattr(self.config, "layer_types", None)
        for key, layer in main_layers(lm):
            kind = layer_types[int(key)] if layer_types else "full_attention"
            mask = masks.get(kind, masks["full_attention"]) if masks else None
            h = layer(h, attention_mask=mask, position_ids=position_ids, position_embeddings=position_embeddings)
        depth_logits = []
        if mtp_input_ids is not None:
            depth_hidden = h
            mask = masks["full_attention"] if masks else None
            for k, (_, layer) in enumerate(mtp_layers(lm)):
                depth_hidden = mtp_forward(
                    layer,
                    depth_hidden,
                    embed(mtp_input_ids[..., k]),
                    attention_mask=mask,
                    position_ids=position_ids,
                    position_embeddings=position_embeddings,
                )
                depth_logits.append(lm.lm_head(layer.shared_head.norm(depth_hidden)))
        if inner.norm is not None:
            h = inner.norm(h)
        logits = lm.lm_head(h) if lm.lm_head is not None else h
        return (logits, depth_logits) if mtp_input_ids is not None else logits

    # -- multi-token prediction ----------------------------------------------------------------------
    def loss(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The training objective: the next-token loss, plus ``mtp_loss_weight`` times the MTP loss
        when the module has MTP depths (see :meth:`loss_terms`)."""
        return self.loss_terms(batch)[0]

    def loss_terms(self, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(objective, {"loss": next-token loss, "mtp_loss": mean over depths})``; without MTP depths
        the objective is the next-token loss alone. As ``MoEGPT``'s: the batch's ``mtp_*`` entries
        (added by :meth:`before_sequence_sharding` under context parallelism, else here), one
        forward for all terms (a fully sharded module gathers its parameters once)."""
        if not self.mtp_depth:
            main = super().loss(batch)
            return main, {"loss": main}
        if "mtp_labels" not in batch:
            batch = add_mtp_targets(batch, self.mtp_depth)
        logits, depth_logits = self(batch["input_ids"], batch.get("position_ids"), mtp_input_ids=batch["mtp_input_ids"])
        main = self.loss_from_logits(logits, batch["labels"], batch.get("loss_mask"), batch.get("loss_token_count"))
        extra = mtp_loss(depth_logits, batch)
        return main + self.hparams.mtp_loss_weight * extra, {"loss": main, "mtp_loss": extra}

    def before_sequence_sharding(self, batch: Any) -> Any:
        """Add the MTP targets while rows are whole: the strategy calls this before it shards a batch
        for context parallelism (without cp, :meth:`loss_terms` adds them itself)."""
        if self.mtp_depth and isinstance(batch, Mapping) and "labels" in batch:
            return add_mtp_targets(batch, self.mtp_depth)
        return batch

    def _attention_masks(self, h: torch.Tensor, seq_len: int) -> dict[str, Any] | None:
        config = self.config
        sliding = getattr(config, "sliding_window", None)
        if attention_implementation(config) in ("sdpa", PADDED_SDPA) and not sliding:
            return None  # causal SDPA (is_causal=True): what context parallelism turns into ring attention
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        embeds = h.new_empty(h.shape[0], seq_len, 1)
        positions = torch.arange(seq_len, device=h.device).unsqueeze(0)
        kwargs = dict(config=config, inputs_embeds=embeds, attention_mask=None, cache=None, position_ids=positions)
        masks = {"full_attention": create_causal_mask(**kwargs)}
        if sliding:
            masks["sliding_attention"] = create_sliding_window_causal_mask(**kwargs)
            if getattr(config, "layer_types", None) is None:
                masks["full_attention"] = masks["sliding_attention"]
        return masks

    # -- checks before any work ------------------------------------------------------------------------
    def initial_value(self, name: str, tensor: torch.Tensor, index: tuple[slice, ...]) -> torch.Tensor:
        """Block ``index`` of the initial value of parameter or buffer ``name`` (meta-device builds).

        From a pretrained folder: read from its safetensors, only that block
        (:class:`~lightning_moe.hf.sharded_load.PretrainedShards`). From a config: matrices are
        normal with the config's ``initializer_range``, each from a generator seeded by the run's
        seed and the name (the same values on every layout), norm weights ones, other vectors zeros.
        Buffers transformers computes (rotary frequencies) are computed the same way.
        """
        owner_name, _, attr = name.rpartition(".")
        owner = self.get_submodule(owner_name)
        if not isinstance(tensor, nn.Parameter) and not isinstance(owner, TopKRouter):
            return getattr(type(owner)(config=self.config), attr)[index]
        if self.pretrained_folder is not None:
            if self._pretrained_shards is None:
                self._pretrained_shards = PretrainedShards(self.pretrained_folder, self.model)
            return self._pretrained_shards(name, tensor, index)
        if tensor.ndim < 2:
            return (torch.ones if "norm" in attr or "norm" in owner_name.rsplit(".", 1)[-1] else torch.zeros)(
                tensor.shape
            )[index]
        generator = seeded_generator(self.init_seed, name)
        return torch.empty(tensor.shape).normal_(0.0, self.config.initializer_range, generator=generator)[index]

    @property
    def bytes_read(self) -> int:
        """Bytes this rank read from the pretrained folder while materialising its shards."""
        return self._pretrained_shards.folder.bytes_read if self._pretrained_shards is not None else 0

    def setup(self, stage: str) -> None:
        """Refuse layouts this model cannot take, tokenizers larger than its embeddings and sequences
        not longer than its MTP depths, before any work."""
        trainer = attached_trainer(self)
        dims = parallel_dims_of(trainer)
        if dims is not None:
            stage_layers = getattr(trainer.strategy, "pp_stage_layers", None)
            self.check_layout(tp=dims.tp, cp=dims.cp, ep=dims.ep, pp=dims.pp, pp_stage_layers=stage_layers)
        datamodule = getattr(trainer, "datamodule", None)
        seq_len = getattr(datamodule, "seq_len", None)
        if self.mtp_depth and isinstance(seq_len, int) and self.mtp_depth >= seq_len:
            raise ValueError(
                f"mtp_depth={self.mtp_depth} needs sequences longer than {self.mtp_depth} tokens, got seq_len={seq_len}:"
                " lower mtp_depth (++model.mtp_depth) or raise data.seq_len"
            )
        data_vocab = getattr(datamodule, "vocab_size", None)
        if isinstance(data_vocab, int) and data_vocab > self.config.vocab_size:
            raise ValueError(
                f"the data's tokenizer has {data_vocab} tokens but the model's embeddings hold {self.config.vocab_size}:"
                f" use a tokenizer of at most {self.config.vocab_size} tokens or a model with vocab_size >= {data_vocab}"
            )

    def check_layout(
        self, tp: int = 1, cp: int = 1, ep: int = 1, pp: int = 1, pp_stage_layers: Sequence[int] | None = None
    ) -> None:
        """``ValueError`` naming the fix when this model cannot be split as asked.

        The size rules (heads by tp, experts by ep) are :func:`lightning_moe.layout.size_problems`';
        this adds what only this model says: its family's refusals, its config's sliding window and
        tied embeddings, and its layer count by pp (or the sum of ``pp_stage_layers``, layers per stage).
        """
        config = self.config
        unsupported = model_family(self.family).unsupported
        problems = [
            f"{dim}={size} is not supported for {self.family}: {unsupported[dim]}; use {dim}=1"
            for dim, size in (("tp", tp), ("cp", cp), ("ep", ep), ("pp", pp))
            if size > 1 and dim in unsupported
        ]
        # A family refusing cp already says why (GPT-OSS: its window among the reasons).
        if cp > 1 and getattr(config, "sliding_window", None) and "cp" not in unsupported:
            problems.append(
                f"cp={cp} with sliding_window={config.sliding_window}: the window needs an explicit attention mask,"
                " which ring attention cannot take; set sliding_window=None in the config or use cp=1"
            )
        tied = getattr(config, "tie_word_embeddings", False)
        for dim, size in (("tp", tp), ("pp", pp)):
            if size > 1 and tied:
                problems.append(
                    f"{dim}={size} with tie_word_embeddings=True: the embedding and lm_head are one tensor, which"
                    f" {dim} would split two ways; untie them (tie_word_embeddings=False) or use {dim}=1"
                )
        heads = config.num_attention_heads
        experts = next((m.num_experts for m in self.model.modules() if isinstance(m, MoELayer)), None)
        problems += size_problems(
            tp,
            cp,
            ep,
            pp=pp,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            num_experts=experts,
        )
        if pp > 1 and self.mtp_depth:
            problems.append(
                f"mtp_depth={self.mtp_depth} with pp={pp}: the multi-token prediction layers of Hugging Face models do not"
                " run under pipeline parallelism; use pp=1 or mtp_depth=0 (on the command line: ++model.mtp_depth=0)"
            )
        # Not a size_problems rule (it knows no layer count): each stage must get as many layers.
        layers = config.num_hidden_layers
        if pp > 1 and pp_stage_layers is not None:
            problem = stage_layers_problem(pp_stage_layers, pp, layers)
            problems += [problem] if problem else []
        elif pp > 1 and layers % pp:
            problems.append(
                f"num_hidden_layers={layers} is not divisible by pp={pp}: choose pp dividing {layers}, or give the"
                " layers of each stage with pp_stage_layers"
            )
        if problems:
            raise ValueError(f"{type(self.model).__name__} cannot take this layout: " + "; ".join(problems))

    # -- tensor parallelism ----------------------------------------------------------------------------
    def tensor_parallel_plan(self, sequence_parallel: bool = True) -> dict[str, ParallelStyle]:
        """Megatron-style plan over ``model.model.layers`` (only the layers present: fits a pipeline
        stage), with sequence parallelism on the norms: :func:`lightning_moe.hf.plans.tensor_parallel_plan`."""
        return tensor_parallel_plan(self.model, sequence_parallel, prefix="model.")

    # -- pipeline parallelism --------------------------------------------------------------------------
    def pipeline_split(self, stage_index: int, num_stages: int, stage_layers: Sequence[int] | None = None) -> nn.Module:
        """Keep this stage's part of ``model.model.layers`` (original keys; ``stage_layers`` of them per
        stage, else an even split), embeddings on the first
        stage and the final norm and ``lm_head`` on the last (:func:`lightning_moe.hf.plans.split_pipeline_stage`);
        returns ``self`` (one stage per rank)."""
        split_pipeline_stage(self.model, stage_index, num_stages, stage_layers)
        return self

    # -- export ----------------------------------------------------------------------------------------
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The full transformers state dict (collective under parallelism: every rank must call it)."""
        return hf_state_dict(self.model, full=_full_tensor)

    def save_hf(self, path: str | os.PathLike) -> None:
        """Write ``config.json`` and safetensors that ``AutoModelForCausalLM.from_pretrained(path)`` loads.

        Under any layout every rank must call it (the shards are gathered: expert shards over
        ep/etp, tp shards, FSDP shards, pipeline stages); rank 0 alone writes.
        """
        from lightning_moe.hf.save import save_hf

        save_hf(self, path)


def _full_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t

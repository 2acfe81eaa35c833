"""``HFMoEModule``: a transformers MoE causal LM (converted to ``MoELayer``) as a LightningModule."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)

from lightning_moe.hf.convert import SUPPORTED_MODEL_TYPES, check_supported, convert_moe_blocks, hf_state_dict
from lightning_moe.hf.sharded_load import PretrainedShards
from lightning_moe.models.causal_lm import CausalLMModule
from lightning_moe.moe import MoELayer, TopKRouter
from lightning_moe.parallel.init import seeded_generator

__all__ = ["HFMoEModule", "load_causal_lm"]

# Layouts each family cannot take (checked before any work): dimension -> reason.
UNSUPPORTED_LAYOUTS: dict[str, dict[str, str]] = {
    "gpt_oss": {
        "cp": "its attention sinks and sliding window need an explicit mask, which ring attention cannot take",
    },
    "olmoe": {"tp": "its q/k norms span all heads (a tp shard holds only some heads)"},
}


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over ``group`` (Megatron's "f" operator)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceGradOfTrailingColumns(ParallelStyle):
    """For a replicated ``nn.Linear`` whose last output columns feed every tp rank's *local* heads
    without passing a DTensor op (MLA's shared rotary key ``k_rot``): sum their gradient over tp.

    The other columns reach the heads through a column-parallel projection, whose input gradient
    torch's tensor parallelism already reduces.
    """

    def __init__(self, start: int) -> None:
        super().__init__()
        self.start = start

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        group, start = device_mesh.get_group(), self.start

        def hook(mod: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
            return torch.cat([out[..., :start], _SumGradOverGroup.apply(out[..., start:], group)], dim=-1)

        module.register_forward_hook(hook)
        return module


class ShardHeadParameter(ParallelStyle):
    """Shard a per-head parameter (GPT-OSS's attention ``sinks [heads]``) over tp like the heads.

    The parameter becomes a DTensor ``Shard(0)``; during the module's forward its local shard (a
    differentiable view) stands in for it, so the model code sees this rank's heads only.

    The view is taken of the parameter the module holds when its forward starts, not of the one
    made here: data parallelism (FSDP2) later replaces it by its own sharded parameter and, for each
    forward, registers an unsharded one. A view of the parameter made here would send the gradient
    to a tensor that is no longer trained (the sinks stayed at their initial values under tp2).
    """

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        from torch.distributed.tensor import distribute_tensor

        name = self.name
        full = module._parameters[name]
        module._parameters[name] = nn.Parameter(
            distribute_tensor(full.detach(), device_mesh, [Shard(0)]), requires_grad=full.requires_grad
        )
        held: list[Any] = []  # the parameter the module holds during its forward

        def enter(mod: nn.Module, args: Any) -> None:
            param = mod._parameters[name]
            held.append(param)
            mod._parameters[name] = param.to_local() if isinstance(param, DTensor) else param  # type: ignore[assignment]

        def leave(mod: nn.Module, args: Any, out: Any) -> None:
            mod._parameters[name] = held.pop()

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave)
        return module


class _Sequence(ParallelStyle):
    """Apply several styles to one module (``parallelize_module`` takes one per name)."""

    def __init__(self, *styles: ParallelStyle | None) -> None:
        super().__init__()
        self.styles = [s for s in styles if s is not None]

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        for style in self.styles:
            module = style._apply(module, device_mesh)
        return module


def load_causal_lm(
    model: Any, attn_implementation: str | None = "sdpa", dtype: torch.dtype = torch.float32, weights: bool = True
) -> nn.Module:
    """A transformers causal LM from a ``PreTrainedModel``, a ``PretrainedConfig``, a config mapping
    (``{"model_type": ..., **kwargs}``) or a local folder (``from_pretrained``, nothing downloaded;
    ``weights=False``: only its config, the weights are read later shard by shard).

    A config gives a random init from the global RNG (same seed, same model on every rank).
    """
    import transformers
    from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

    if isinstance(model, PreTrainedModel):
        return model
    if isinstance(model, (str, os.PathLike)):
        path = Path(model).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(
                f"pretrained model folder {str(path)!r} does not exist: pass a local folder holding config.json and"
                " *.safetensors (e.g. written by save_pretrained or save_hf); nothing is downloaded"
            )
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{str(path)!r} has no config.json: it is not a saved Hugging Face model folder")
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        _check_model_type(config)
        kwargs = _attn_kwargs(config, attn_implementation)
        if not weights:
            return AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
        return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype, **kwargs)
    if isinstance(model, Mapping):
        from lightning_moe.hf.configs import build_config

        spec = dict(model)
        if "model_type" not in spec:
            raise ValueError(f"a config mapping needs a 'model_type' key (one of {SUPPORTED_MODEL_TYPES}), got {sorted(spec)}")
        model = build_config(spec.pop("model_type"), **spec)
    if isinstance(model, PretrainedConfig):
        _check_model_type(model)
        return AutoModelForCausalLM.from_config(model, dtype=dtype, **_attn_kwargs(model, attn_implementation))
    raise TypeError(
        f"model must be a transformers PreTrainedModel, a PretrainedConfig, a config mapping or a local folder path,"
        f" got {type(model).__name__}"
    )


def _check_model_type(config: Any) -> None:
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        archs = getattr(config, "architectures", None) or [config.model_type]
        raise ValueError(
            f"unknown architecture {archs[0]!r} (model_type={config.model_type!r}): lightning_moe.hf supports"
            f" {SUPPORTED_MODEL_TYPES}"
        )


PADDED_SDPA = "lightning_moe_sdpa"


def _padded_v_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """transformers' SDPA attention with V zero-padded to the q/k head dim and the output cut back.

    MLA (DeepSeek-V3) has ``v_head_dim < qk_head_dim``; ring attention (context parallelism) needs
    equal head dims. The padding columns produce zero outputs that are dropped: the result is exact.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dv = value.shape[-1]
    if dv == query.shape[-1]:
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)
    value = F.pad(value, (0, query.shape[-1] - dv))
    out, weights = sdpa_attention_forward(module, query, key, value, *args, **kwargs)
    return out[..., :dv], weights


def _use_padded_sdpa(model: nn.Module) -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(PADDED_SDPA, _padded_v_sdpa)
    model.config._attn_implementation = PADDED_SDPA
    for sub in model.modules():
        config = getattr(sub, "config", None)
        if config is not None and getattr(config, "_attn_implementation", None) == "sdpa":
            config._attn_implementation = PADDED_SDPA


def _attn_kwargs(config: Any, attn_implementation: str | None) -> dict[str, Any]:
    # GPT-OSS's attention sinks have no SDPA form: it keeps transformers' default (eager).
    if attn_implementation is None or config.model_type == "gpt_oss":
        return {}
    return {"attn_implementation": attn_implementation}


class HFMoEModule(CausalLMModule):
    """A Hugging Face MoE causal LM trained under ``moe5d`` (or any strategy), with its sparse blocks as ``MoELayer``.

    Args:
        model: a transformers ``PreTrainedModel``, a ``PretrainedConfig`` (random init), a config
            mapping ``{"model_type": "qwen3_moe", ...}`` (Hydra presets) or a local folder.
        pretrained: a local folder (Hydra's ``model=hf model.pretrained=...``), instead of ``model``.
        learning_rate, warmup_steps, max_steps, min_lr_ratio, weight_decay, betas: AdamW with
            linear warmup and cosine decay (``max_steps=None``: the trainer's).
        aux_loss_coeff, z_loss_coeff, capacity_factor, dispatcher, bias_update_rate: passed to
            :func:`~lightning_moe.hf.convert_moe_blocks` (``aux_loss_coeff=None``: the config's
            ``router_aux_loss_coef``).
        attn_implementation: ``"sdpa"`` (default; context parallelism swaps SDPA for ring attention).

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
        dispatcher: str = "alltoall",
        bias_update_rate: float = 1e-3,
        attn_implementation: str | None = "sdpa",
        pretrained: str | os.PathLike | None = None,
    ) -> None:
        super().__init__()
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
        convert_moe_blocks(
            hf, aux_loss_coeff=aux_loss_coeff, z_loss_coeff=z_loss_coeff, capacity_factor=capacity_factor,
            dispatcher=dispatcher, bias_update_rate=bias_update_rate,
        )
        hf.config.use_cache = False
        if hf.config.model_type == "deepseek_v3" and hf.config._attn_implementation == "sdpa":
            _use_padded_sdpa(hf)
        self.model = hf
        self.family: str = hf.config.model_type
        self._stage: tuple[int, int] | None = None

    # -- model ---------------------------------------------------------------------------------------
    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_input_embeddings().num_embeddings) if self.model.model.embed_tokens is not None else int(self.config.vocab_size)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids [B, S]`` -> logits ``[B, S, vocab]`` (hidden states in and/or out on a pipeline stage).

        ``position_ids`` (``[B, S]`` or ``[S]``) drive RoPE; context parallelism passes the global
        positions of the local shard. Attention gets no mask (SDPA's ``is_causal``), except for
        models whose attention needs one (sliding windows, GPT-OSS), built for the local sequence.
        """
        # Through ``self.model.__call__`` with this loop as its forward: hooks on the transformers
        # model (FSDP units under pipeline parallelism) run, and ``module.model`` keeps its own forward.
        lm = self.model
        lm.forward = partial(self._decoder_loop, lm)
        try:
            return lm(input_ids, position_ids)
        finally:
            del lm.forward

    def _decoder_loop(self, lm: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
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
        for key, layer in inner.layers._modules.items():
            kind = layer_types[int(key)] if layer_types else "full_attention"
            mask = masks.get(kind, masks["full_attention"]) if masks else None
            h = layer(h, attention_mask=mask, position_ids=position_ids, position_embeddings=position_embeddings)
        if inner.norm is not None:
            h = inner.norm(h)
        return lm.lm_head(h) if lm.lm_head is not None else h

    def _attention_masks(self, h: torch.Tensor, seq_len: int) -> dict[str, Any] | None:
        config = self.config
        sliding = getattr(config, "sliding_window", None)
        if config._attn_implementation in ("sdpa", PADDED_SDPA) and not sliding:
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
            return (torch.ones if "norm" in attr or "norm" in owner_name.rsplit(".", 1)[-1] else torch.zeros)(tensor.shape)[index]
        generator = seeded_generator(self.init_seed, name)
        return torch.empty(tensor.shape).normal_(0.0, self.config.initializer_range, generator=generator)[index]

    @property
    def bytes_read(self) -> int:
        """Bytes this rank read from the pretrained folder while materialising its shards."""
        return self._pretrained_shards.folder.bytes_read if self._pretrained_shards is not None else 0

    def setup(self, stage: str) -> None:
        """Refuse layouts this model cannot take and tokenizers larger than its embeddings, before any work."""
        trainer = self._trainer
        dims = getattr(getattr(trainer, "strategy", None), "parallel_dims", None)
        if dims is not None:
            self.check_layout(tp=dims.tp, cp=dims.cp, ep=dims.ep, pp=dims.pp)
        datamodule = getattr(trainer, "datamodule", None)
        data_vocab = getattr(datamodule, "vocab_size", None)
        if isinstance(data_vocab, int) and data_vocab > self.config.vocab_size:
            raise ValueError(
                f"the data's tokenizer has {data_vocab} tokens but the model's embeddings hold {self.config.vocab_size}:"
                f" use a tokenizer of at most {self.config.vocab_size} tokens or a model with vocab_size >= {data_vocab}"
            )

    def check_layout(self, tp: int = 1, cp: int = 1, ep: int = 1, pp: int = 1) -> None:
        """``ValueError`` naming the fix when this model cannot be split as asked."""
        config = self.config
        problems = []
        for dim, size in (("tp", tp), ("cp", cp), ("pp", pp)):
            reason = UNSUPPORTED_LAYOUTS.get(self.family, {}).get(dim)
            if size > 1 and reason:
                problems.append(f"{dim}={size} is not supported for {self.family}: {reason}; use {dim}=1")
        if cp > 1 and getattr(config, "sliding_window", None) and self.family not in UNSUPPORTED_LAYOUTS:
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
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if tp > 1 and heads % tp:
            problems.append(f"num_attention_heads={heads} is not divisible by tp={tp}: choose tp dividing {heads}")
        if tp > 1 and kv_heads % tp:
            problems.append(f"num_key_value_heads={kv_heads} is not divisible by tp={tp}: choose tp dividing {kv_heads}")
        for layer in (m for m in self.model.modules() if isinstance(m, MoELayer)):
            if layer.num_experts % ep:
                problems.append(f"{layer.num_experts} experts are not divisible by ep={ep}: choose ep dividing {layer.num_experts}")
                break
        layers = config.num_hidden_layers
        if pp > 1 and layers % pp:
            problems.append(f"num_hidden_layers={layers} is not divisible by pp={pp}: choose pp dividing {layers}")
        if problems:
            raise ValueError(f"{type(self.model).__name__} cannot take this layout: " + "; ".join(problems))

    # -- tensor parallelism ----------------------------------------------------------------------------
    def tensor_parallel_plan(self, sequence_parallel: bool = True) -> dict[str, ParallelStyle]:
        """Megatron-style plan over ``model.model.layers`` (only the layers present: fits a pipeline stage).

        Attention q/k/v (MLA: ``q_b_proj``/``kv_b_proj``; ``q_proj`` without q-LoRA) column-wise,
        ``o_proj`` row-wise; dense MLPs ``gate/up`` column-wise, ``down`` row-wise; embeddings
        row-wise (vocab split) and ``lm_head`` column-wise with replicated logits. With
        ``sequence_parallel`` the norms run on sequence shards and the MoE layers receive
        sequence-sharded DTensors; otherwise the MoE layers receive replicated tokens.
        """
        seq = Shard(1) if sequence_parallel else Replicate()
        plan: dict[str, ParallelStyle] = {}
        inner = self.model.model
        if inner.embed_tokens is not None:
            plan["model.model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
        if inner.norm is not None and sequence_parallel:
            plan["model.model.norm"] = SequenceParallel(use_local_output=True)
        if self.model.lm_head is not None:
            plan["model.lm_head"] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
        for key, layer in inner.layers._modules.items():
            prefix = f"model.model.layers.{key}."
            attn = layer.self_attn
            if sequence_parallel:
                plan[prefix + "input_layernorm"] = SequenceParallel(use_local_output=True)
                plan[prefix + "post_attention_layernorm"] = SequenceParallel(use_local_output=True)
                plan[prefix + "self_attn"] = PrepareModuleInput(
                    input_kwarg_layouts={"hidden_states": Shard(1)},
                    desired_input_kwarg_layouts={"hidden_states": Replicate()},
                    use_local_output=True,
                )
            for name in ("q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj"):
                if getattr(attn, name, None) is not None:
                    plan[prefix + f"self_attn.{name}"] = ColwiseParallel()
            if getattr(attn, "kv_a_proj_with_mqa", None) is not None:
                plan[prefix + "self_attn.kv_a_proj_with_mqa"] = ReduceGradOfTrailingColumns(attn.kv_lora_rank)
            if isinstance(getattr(attn, "sinks", None), nn.Parameter):
                plan[prefix + "self_attn"] = _Sequence(plan.get(prefix + "self_attn"), ShardHeadParameter("sinks"))
            for name in ("q_norm", "k_norm"):
                if getattr(attn, name, None) is not None:
                    # Per-head norms over [B, S, heads, head_dim]: the local heads are a shard of dim 2.
                    plan[prefix + f"self_attn.{name}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan[prefix + "self_attn.o_proj"] = RowwiseParallel(output_layouts=seq)
            mlp = layer.mlp
            moe_name = "mlp.moe" if isinstance(getattr(mlp, "moe", None), MoELayer) else "mlp"
            if isinstance(mlp, MoELayer) or moe_name == "mlp.moe":
                if sequence_parallel:
                    plan[prefix + moe_name] = PrepareModuleInputOutput(
                        input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_input=False,
                        output_layouts=(Shard(1),), desired_output_layouts=(Shard(1),), use_local_output=True,
                    )
            else:
                if sequence_parallel:
                    plan[prefix + "mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
                plan[prefix + "mlp.gate_proj"] = ColwiseParallel()
                plan[prefix + "mlp.up_proj"] = ColwiseParallel()
                plan[prefix + "mlp.down_proj"] = RowwiseParallel(output_layouts=seq)
        return plan

    # -- pipeline parallelism --------------------------------------------------------------------------
    def pipeline_split(self, stage_index: int, num_stages: int) -> nn.Module:
        """Keep this stage's part of ``model.model.layers`` (original keys), embeddings on the first
        stage and the final norm and ``lm_head`` on the last; returns ``self`` (one stage per rank)."""
        if self._stage is not None:
            raise ValueError(
                "HFMoEModule runs one pipeline stage per rank: use pp_stages_per_rank=1 (schedules GPipe or 1F1B)"
            )
        inner = self.model.model
        keys = list(inner.layers._modules.keys())
        if len(keys) % num_stages:
            raise ValueError(
                f"{len(keys)} layers cannot be split evenly into {num_stages} pipeline stages: choose pp dividing {len(keys)}"
            )
        per = len(keys) // num_stages
        mine = set(keys[stage_index * per : (stage_index + 1) * per])
        for key in keys:
            if key not in mine:
                del inner.layers._modules[key]
        if stage_index != 0:
            inner.embed_tokens = None
        if stage_index != num_stages - 1:
            inner.norm = None
            self.model.lm_head = None
        self._stage = (stage_index, num_stages)
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

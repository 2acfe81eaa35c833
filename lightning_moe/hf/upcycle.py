"""Sparse upcycling: a dense transformers causal LM becomes an MoE ``HFMoEModule`` with the same function.

Komatsuzaki et al. 2022 ("Sparse Upcycling"), with Megatron's granular variant (He et al. 2024,
"Upcycling Large Language Models into Mixture of Experts"). See docs/upcycling.md.

The dense model is mapped onto the transformers MoE architecture of its family (:data:`UPCYCLE_TARGETS`:
Llama and Mistral -> Mixtral, Qwen2 -> Qwen2-MoE, Qwen3 -> Qwen3-MoE), built on the meta device and
handed to :class:`~lightning_moe.hf.HFMoEModule`'s conversion; every weight is then filled by
:meth:`UpcycledHFMoEModule.initial_value` from the dense weights: non-MLP weights are copied, the
experts are cut from the dense MLP. The same recipe fills a whole model (eager) or, when the module
is built on the meta device (the CLI), only each rank's shards, read slice by slice from the dense
folder's safetensors.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_moe.hf.module import HFMoEModule
from lightning_moe.parallel.plans.init import materialize_sharded, seeded_generator

__all__ = ["UPCYCLE_TARGETS", "UpcycledHFMoEModule", "upcycle", "upcycle_config"]

Index = tuple[slice, ...]
Reader = Callable[[str, Index], torch.Tensor]


@dataclass(frozen=True)
class UpcycleTarget:
    """Which transformers MoE architecture a dense family becomes, and what it cannot keep."""

    moe_model_type: str
    # Config keys copied as they are (besides the common ones).
    copied: tuple[str, ...] = ()
    # (dense config key, value that cannot be kept, why): refused with the reason.
    refused: tuple[tuple[str, Any, str], ...] = ()


_COMMON_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "initializer_range",
    "rms_norm_eps",
    "tie_word_embeddings",
    "rope_parameters",
    "attention_dropout",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
)

UPCYCLE_TARGETS: dict[str, UpcycleTarget] = {
    # Mixtral's decoder is Mistral's (sliding window included) with a sparse MLP.
    "mistral": UpcycleTarget("mixtral", copied=("sliding_window",)),
    # Llama is Mixtral without a window, as long as its projections carry no bias.
    "llama": UpcycleTarget(
        "mixtral",
        refused=(
            (
                "attention_bias",
                True,
                "Mixtral's q/k/v/o projections have no bias, so the dense attention biases would be lost",
            ),
            (
                "mlp_bias",
                True,
                "Mixtral's experts (and MoELayer's SwiGLU experts) have no bias, so the dense MLP biases would be lost",
            ),
        ),
    ),
    # Qwen2-MoE keeps Qwen2's q/k/v biases and per-layer windows; its shared expert starts at zero output.
    "qwen2": UpcycleTarget(
        "qwen2_moe", copied=("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")
    ),
    # Qwen3-MoE: the same attention (q/k norms per head); one sliding window for all layers or none.
    "qwen3": UpcycleTarget("qwen3_moe", copied=("attention_bias", "use_sliding_window", "sliding_window")),
}

_MLP = re.compile(r"^model\.layers\.(\d+)\.mlp\.(.+)$")


def _check_arguments(
    num_experts: int, top_k: int, granularity: int, intermediate_size: int, router_std: float | None
) -> None:
    for name, value in (("num_experts", num_experts), ("top_k", top_k), ("granularity", granularity)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"upcycle: {name} must be a positive integer, got {value!r}")
    if num_experts % granularity:
        raise ValueError(
            f"upcycle: num_experts={num_experts} is not a multiple of granularity={granularity}: the experts are"
            f" num_experts/granularity replicas of the dense MLP's {granularity} slices; choose num_experts a multiple"
            f" of {granularity} (e.g. {granularity * max(1, num_experts // granularity)}) or granularity dividing {num_experts}"
        )
    if intermediate_size % granularity:
        raise ValueError(
            f"upcycle: the dense intermediate_size={intermediate_size} is not divisible by granularity={granularity}:"
            f" the MLP cannot be cut into {granularity} equal slices; choose a granularity dividing {intermediate_size}"
        )
    replicas = num_experts // granularity
    if top_k > replicas:
        raise ValueError(
            f"upcycle: top_k={top_k} at granularity={granularity} routes top_k*granularity={top_k * granularity} experts"
            f" per token but num_experts={num_experts} holds only {replicas} full copies of the dense MLP; lower top_k to"
            f" at most {replicas} or raise num_experts to at least {top_k * granularity}"
        )
    if router_std is not None and router_std < 0:
        raise ValueError(f"upcycle: router_std must be >= 0, got {router_std}")
    if router_std == 0 and granularity > 1:
        raise ValueError(
            f"upcycle: router_std=0 at granularity={granularity}: a zero router ties every expert, and which tied"
            " experts top-k picks is up to the kernel, so the picked slices need not add up to the dense MLP; use"
            " router_std > 0 (default: the config's initializer_range) or granularity=1"
        )


def upcycle_config(
    dense_config: Any,
    num_experts: int,
    top_k: int,
    granularity: int = 1,
    *,
    shared_expert_intermediate_size: int | None = None,
    router_aux_loss_coef: float | None = None,
    router_std: float | None = None,
) -> Any:
    """The transformers MoE config that :func:`upcycle` builds from a dense config (all checks included).

    ``ValueError`` naming the argument and the fix for what cannot keep the dense function.
    """
    from transformers import AutoConfig

    model_type = getattr(dense_config, "model_type", None)
    target = UPCYCLE_TARGETS.get(model_type)
    if target is None:
        raise ValueError(
            f"upcycle: dense model_type {model_type!r} is not supported: upcycle takes {tuple(UPCYCLE_TARGETS)}"
            " (Llama and Mistral become Mixtral, Qwen2 Qwen2-MoE, Qwen3 Qwen3-MoE)"
        )
    problems = [
        f"{key}={value!r}: {why}" for key, value, why in target.refused if getattr(dense_config, key, None) == value
    ]
    act = getattr(dense_config, "hidden_act", "silu")
    if act != "silu":
        problems.append(
            f"hidden_act={act!r}: MoELayer's experts are SwiGLU with silu, so the dense MLP's {act} cannot be kept"
        )
    if model_type == "qwen3":
        kinds = set(getattr(dense_config, "layer_types", None) or ["full_attention"])
        if len(kinds) > 1:
            problems.append(
                f"layer_types mixes {sorted(kinds)} (sliding window on some layers only, max_window_layers="
                f"{getattr(dense_config, 'max_window_layers', None)}): Qwen3-MoE applies one window to every layer"
            )
    if problems:
        raise ValueError(
            f"upcycle: this {model_type} model cannot become {target.moe_model_type} with the same function: "
            + "; ".join(problems)
        )
    intermediate = int(dense_config.intermediate_size)
    _check_arguments(num_experts, top_k, granularity, intermediate, router_std)
    if shared_expert_intermediate_size is not None and target.moe_model_type != "qwen2_moe":
        raise ValueError(
            f"upcycle: shared_expert_intermediate_size is for Qwen2 (Qwen2-MoE's shared expert); {model_type} becomes"
            f" {target.moe_model_type}, which has none: leave it None"
        )
    ffn = intermediate // granularity
    kwargs = {key: getattr(dense_config, key) for key in (*_COMMON_KEYS, *target.copied) if hasattr(dense_config, key)}
    if kwargs.get("head_dim") is None:
        kwargs["head_dim"] = dense_config.hidden_size // dense_config.num_attention_heads
    routed = top_k * granularity
    if target.moe_model_type == "mixtral":
        kwargs.setdefault("sliding_window", None)
        kwargs.update(
            intermediate_size=ffn, num_local_experts=num_experts, num_experts_per_tok=routed, router_jitter_noise=0.0
        )
    else:
        kwargs.update(
            intermediate_size=intermediate,
            moe_intermediate_size=ffn,
            num_experts=num_experts,
            num_experts_per_tok=routed,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
        if target.moe_model_type == "qwen2_moe":
            kwargs.update(qkv_bias=True, shared_expert_intermediate_size=shared_expert_intermediate_size or ffn)
        elif "sliding_attention" in (getattr(dense_config, "layer_types", None) or []):
            kwargs.update(use_sliding_window=True, sliding_window=dense_config.sliding_window)
        else:
            kwargs.update(use_sliding_window=False, sliding_window=None)
    if router_aux_loss_coef is not None:
        kwargs["router_aux_loss_coef"] = router_aux_loss_coef
    kwargs["output_router_logits"] = False
    config = AutoConfig.for_model(target.moe_model_type, **kwargs)
    if target.moe_model_type == "qwen2_moe" and list(config.layer_types) != list(dense_config.layer_types):
        raise ValueError(
            f"upcycle: Qwen2-MoE derived layer_types {config.layer_types} from this config, not the dense model's"
            f" {dense_config.layer_types}: the attention windows would differ"
        )
    return config


class UpcycledHFMoEModule(HFMoEModule):
    """An :class:`~lightning_moe.hf.HFMoEModule` upcycled from a dense transformers causal LM.

    Built by :func:`upcycle` (Python) or the Hydra preset ``model=hf_upcycle`` (CLI, built on the
    meta device: each rank then reads only its slices of the dense folder). Arguments: those of
    :func:`upcycle`; ``pretrained`` is the dense folder (the CLI's ``model.pretrained``), instead of ``dense``,
    and replaces a ``dense`` config mapping (``{"model_type": "qwen3", ...}``: a random dense model, the
    preset's default, so that ``model=hf_upcycle`` alone runs without a folder).
    """

    def __init__(
        self,
        dense: Any = None,
        num_experts: int = 8,
        top_k: int = 1,
        granularity: int = 1,
        *,
        pretrained: str | os.PathLike | None = None,
        router_std: float | None = None,
        shared_expert_intermediate_size: int | None = None,
        seed: int | None = None,
        dtype: torch.dtype = torch.float32,
        **module_kwargs: Any,
    ) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

        if dense is None and pretrained is None:
            raise ValueError("upcycle: pass dense (a model, config mapping or folder) or pretrained (a local folder)")
        if dense is not None and pretrained is not None and not isinstance(dense, Mapping):
            raise ValueError(
                "upcycle: pass either dense or pretrained, not both (pretrained replaces only a config mapping)"
            )
        source = pretrained if pretrained is not None else dense
        random_shapes: dict[str, tuple[int, ...]] | None = None
        on_meta = torch.empty(()).is_meta
        folder: Path | None = None
        state: Mapping[str, torch.Tensor] | None = None
        device = torch.device("cpu")
        if isinstance(source, (str, os.PathLike)):
            folder = Path(source).expanduser()
            if not (folder / "config.json").is_file():
                raise FileNotFoundError(
                    f"upcycle: {str(folder)!r} is not a saved Hugging Face model folder (no config.json): pass a local"
                    " folder written by save_pretrained; nothing is downloaded"
                )
            dense_config = AutoConfig.from_pretrained(folder, local_files_only=True)
            if not on_meta:  # eager: transformers reads the folder (any format it knows)
                with torch.device("cpu"):
                    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=dtype)
                state = model.state_dict()
        elif isinstance(source, Mapping):  # a random dense model (the preset's demo default): seeded per tensor
            from lightning_moe.hf.configs import build_config

            spec = dict(source)
            if "model_type" not in spec:
                raise ValueError(f"upcycle: a dense config mapping needs a 'model_type' key, got {sorted(spec)}")
            dense_config = build_config(spec.pop("model_type"), **spec)
            with torch.device("meta"):
                shapes = AutoModelForCausalLM.from_config(dense_config).state_dict()
            random_shapes = {k: tuple(v.shape) for k, v in shapes.items()}
        elif isinstance(source, PreTrainedModel):
            dense_config = source.config
            state = source.state_dict()
            first = next(iter(state.values()))
            dtype, device = first.dtype, first.device
        else:
            raise TypeError(
                f"upcycle: dense must be a transformers PreTrainedModel or a local folder, got {type(source).__name__}"
            )
        moe_config = upcycle_config(
            dense_config,
            num_experts,
            top_k,
            granularity,
            shared_expert_intermediate_size=shared_expert_intermediate_size,
            router_std=router_std,
        )
        attn = module_kwargs.get("attn_implementation", "sdpa")
        with torch.device("meta"):
            moe = AutoModelForCausalLM.from_config(
                moe_config, dtype=dtype, **({"attn_implementation": attn} if attn else {})
            )
        with warnings.catch_warnings():  # Lightning's note that ``dense`` (a module) is in the init args
            warnings.filterwarnings("ignore", message=r"Attribute 'dense' is an instance of `nn.Module`")
            super().__init__(moe, **module_kwargs)
        # The hyper-parameters rebuild this module (``cls(**hparams)``): a folder, a config mapping and the
        # arguments; a model object does not belong in checkpoints, nor HFMoEModule's ``model`` (the MoE).
        self.hparams.pop("model", None)
        if not isinstance(dense, Mapping):
            self.hparams.pop("dense", None)
        if folder is not None:
            self.hparams["pretrained"] = str(folder)
        self.upcycled_from = str(folder) if folder is not None else dense_config.model_type
        self.dense_model_type: str = dense_config.model_type
        self.granularity = granularity
        self.router_std = float(router_std if router_std is not None else dense_config.initializer_range)
        self.upcycle_seed = torch.initial_seed() if seed is None else int(seed)
        self._dense_folder = folder
        self._dense_state = state
        self._random_dense = random_shapes
        self._dense_reader: Reader | None = None
        self._check_weights_match(self._dense_keys())
        if not on_meta:
            materialize_sharded(self, device, self.initial_value)
            self._dense_state = self._dense_reader = None  # the dense weights are no longer needed

    # -- reading the dense weights -------------------------------------------------------------------
    def _dense_keys(self) -> dict[str, tuple[int, ...]]:
        if self._dense_state is not None:
            return {k: tuple(v.shape) for k, v in self._dense_state.items()}
        if self._random_dense is not None:
            return self._random_dense
        from safetensors import safe_open

        from lightning_moe.hf.sharded_load import SafetensorsFolder

        folder = SafetensorsFolder(self._dense_folder)  # type: ignore[arg-type]
        shapes = {}
        for key, file in folder.files.items():
            with safe_open(file, framework="pt") as handle:
                shapes[key] = tuple(handle.get_slice(key).get_shape())
        return shapes

    def _read(self, key: str, index: Index) -> torch.Tensor:
        if self._dense_reader is None:
            if self._dense_state is not None:
                state = self._dense_state
                self._dense_reader = lambda k, i: state[k][i]
            elif self._random_dense is not None:
                self._dense_reader = self._random_dense_value
            else:
                from lightning_moe.hf.sharded_load import SafetensorsFolder

                self._dense_reader = SafetensorsFolder(self._dense_folder).read  # type: ignore[arg-type]
        if key == "lm_head.weight" and self.config.tie_word_embeddings:
            key = "model.embed_tokens.weight"  # tied: often not written separately
        return self._dense_reader(key, index).detach()

    def _random_dense_value(self, key: str, index: Index) -> torch.Tensor:
        """A random dense model's tensor: norms ones, other vectors zeros, matrices normal(0, initializer_range),
        each from a generator seeded by ``seed`` and its name (the same on every rank and layout)."""
        shape = self._random_dense[key]  # type: ignore[index]
        if len(shape) < 2:
            return (torch.ones if "norm" in key else torch.zeros)(shape)[index]
        generator = seeded_generator(self.upcycle_seed, "dense." + key)
        return torch.empty(shape).normal_(0.0, self.config.initializer_range, generator=generator)[index]

    def _check_weights_match(self, dense: Mapping[str, tuple[int, ...]]) -> None:
        """Every non-MLP weight of the MoE model must be a dense weight of the same shape, and the dense
        model must hold nothing else than those and its bias-free SwiGLU MLPs."""
        problems = []
        moe_names = set()
        for name, tensor in self.named_parameters():
            key = name.removeprefix("model.")
            if _MLP.match(key):
                continue
            moe_names.add(key)
            if key == "lm_head.weight" and self.config.tie_word_embeddings:
                key = "model.embed_tokens.weight"
            if key not in dense:
                problems.append(f"{key} is not in the dense model")
            elif tuple(dense[key]) != tuple(tensor.shape):
                problems.append(f"{key} has shape {tuple(dense[key])} in the dense model, {tuple(tensor.shape)} here")
        for key in dense:
            match = _MLP.match(key)
            if match:
                if match.group(2) not in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"):
                    problems.append(f"dense MLP weight {key} has no place in the experts")
            elif key not in moe_names and not (key == "lm_head.weight" and self.config.tie_word_embeddings):
                problems.append(f"dense weight {key} has no place in {type(self.model).__name__}")
        if problems:
            raise ValueError(
                f"upcycle: the dense {self.dense_model_type} weights do not map onto {type(self.model).__name__}: "
                + "; ".join(problems[:8])
                + ("" if len(problems) <= 8 else f" (and {len(problems) - 8} more)")
            )

    # -- the recipe ----------------------------------------------------------------------------------
    def initial_value(self, name: str, tensor: torch.Tensor, index: Index) -> torch.Tensor:
        """Block ``index`` of the upcycled value of ``name`` (the exactness rule: :func:`upcycle`).

        Non-MLP weights: the dense ones. Layer ``i``'s MoE: expert ``e`` holds slice ``s = e % g`` of the
        dense MLP (``F = intermediate_size / g`` columns of gate and up, rows of down, down times ``g``);
        router rows ``[E/g, H]`` normal(0, router_std), each repeated for the ``g`` experts of its group;
        Qwen2-MoE's shared expert: gate/up normal, down and the sigmoid gate zero (its output is zero).
        Buffers: as :class:`~lightning_moe.hf.HFMoEModule` computes them; router counters zero.
        """
        key = name.removeprefix("model.")
        match = _MLP.match(key)
        if match is None:
            if isinstance(tensor, nn.Parameter):
                return self._read(key, index)
            return super().initial_value(name, tensor, index)
        mlp, rest = f"model.layers.{match.group(1)}.mlp", match.group(2)
        g = self.granularity
        if rest in ("experts.w1", "experts.w3"):
            experts, hidden, cols = index  # [E, H, F] <- gate/up_proj [I, H] rows of slice e % g, transposed
            ffn = tensor.shape[-1]
            dense_key = f"{mlp}.{'gate_proj' if rest == 'experts.w1' else 'up_proj'}.weight"
            blocks = [
                self._read(dense_key, (_shift(cols, (e % g) * ffn, ffn), hidden)).t()
                for e in range(*experts.indices(tensor.shape[0]))
            ]
            return torch.stack(blocks)
        if rest == "experts.w2":
            experts, rows, hidden = index  # [E, F, H] <- down_proj [H, I] columns of slice e % g, transposed, times g
            ffn = tensor.shape[1]
            blocks = [
                self._read(f"{mlp}.down_proj.weight", (hidden, _shift(rows, (e % g) * ffn, ffn))).t() * g
                for e in range(*experts.indices(tensor.shape[0]))
            ]
            return torch.stack(blocks)
        if rest == "router.weight":
            groups = torch.empty(tensor.shape[0] // g, tensor.shape[1]).normal_(
                0.0, self.router_std, generator=seeded_generator(self.upcycle_seed, key)
            )
            return groups.repeat_interleave(g, dim=0)[index]
        if rest in ("shared_expert.w1.weight", "shared_expert.w3.weight"):
            whole = torch.empty(tensor.shape).normal_(
                0.0, self.config.initializer_range, generator=seeded_generator(self.upcycle_seed, key)
            )
            return whole[index]
        if rest in ("shared_expert.w2.weight", "shared_expert_gate.weight") or rest.startswith("router."):
            return torch.zeros(tensor.shape)[index]
        raise KeyError(f"upcycle: no recipe for {name}")


def _shift(index: slice, offset: int, size: int) -> slice:
    start, stop, _ = index.indices(size)
    return slice(start + offset, stop + offset)


def upcycle(
    model: Any,
    num_experts: int,
    top_k: int,
    granularity: int = 1,
    *,
    router_std: float | None = None,
    shared_expert_intermediate_size: int | None = None,
    seed: int | None = None,
    dtype: torch.dtype = torch.float32,
    **module_kwargs: Any,
) -> UpcycledHFMoEModule:
    """Sparse upcycling: an :class:`~lightning_moe.hf.HFMoEModule` whose MLPs are ``MoELayer`` s cut from a
    dense causal LM, with the dense model's function at initialisation.

    Args:
        model: a transformers dense causal LM (``LlamaForCausalLM``, ``MistralForCausalLM``,
            ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``; its dtype and device are kept), a local folder
            (read with ``from_pretrained``, in ``dtype``; nothing is downloaded) or a config mapping
            ``{"model_type": "qwen3", ...}`` (a random dense model, seeded per tensor). Llama and Mistral become
            Mixtral, Qwen2 Qwen2-MoE, Qwen3 Qwen3-MoE (:data:`UPCYCLE_TARGETS`).
        num_experts: the number of routed experts per layer, Megatron's ``--num-experts``: the
            fine-grained count, ``granularity`` slices times ``num_experts / granularity`` replicas.
        top_k: how many *dense-MLP-sized* experts each token uses. Each MoE layer routes
            ``top_k * granularity`` fine-grained experts (Megatron's ``--moe-router-topk`` for the
            same model), so one token's compute is ``top_k`` dense MLPs at any granularity.
        granularity: Megatron's ``--moe-upcycling-granularity``: each expert's FFN size is
            ``intermediate_size / granularity``.
        router_std: the router's init std (default: the config's ``initializer_range``).
        shared_expert_intermediate_size: Qwen2 only: the size of Qwen2-MoE's shared expert (default: the
            experts' size). It starts with a zero down projection, so it adds nothing at initialisation.
        seed: seeds the router (and the shared expert) per tensor name (default: ``torch.initial_seed()``).
        dtype: the dtype a folder is read in.
        module_kwargs: :class:`~lightning_moe.hf.HFMoEModule`'s arguments (``learning_rate``,
            ``aux_loss_coeff``, ``attn_implementation``, ...).

    Exactness rule (logits equal the dense model's at fp32 rounding; tested at rel 1e-5 on one
    process, ep2 and tp2): with ``g = granularity`` and ``E = num_experts``, expert ``e`` holds slice
    ``s = e % g`` of the dense MLP (columns ``s*F:(s+1)*F`` of gate and up, rows of down, ``F = I/g``),
    its down projection multiplied by ``g``. The router's ``E`` rows are ``E/g`` random rows each repeated
    ``g`` times, so the ``g`` experts of a group (one full MLP cut in ``g`` slices) always score alike and
    top-``k*g`` picks ``k`` whole groups. Routing normalises the top-k weights (Mixtral; Qwen MoE with
    ``norm_topk_prob=True``): each picked expert of group ``j`` weighs ``p_j / (g * sum of the picked p)``,
    so the output is ``sum_j p_j / sum p * (sum_s g * slice_s(x)) / g = mlp(x)``. At ``g = 1`` this is
    Komatsuzaki et al.'s copies of the MLP with any router. (A zero router would tie all experts at
    ``g > 1``, and which tied experts top-k returns is up to the kernel: refused. Scaling gate/up
    as well, Megatron's cube-root rule, would not be exact for SwiGLU: only down is scaled.)

    Refused with a ``ValueError`` naming the argument and the fix: ``num_experts`` not a multiple of
    ``granularity``; ``intermediate_size`` not divisible by it; ``top_k * granularity > num_experts``;
    an architecture that cannot keep the function (Llama with ``attention_bias`` or ``mlp_bias``, a
    ``hidden_act`` other than silu, Qwen3 with a sliding window on some layers only) or a dense weight
    with no place in the MoE model.

    Example::

        dense = transformers.AutoModelForCausalLM.from_pretrained("path/to/qwen3")
        module = upcycle(dense, num_experts=8, top_k=2, granularity=2)   # Qwen3-MoE, 8 experts, top-4
        trainer.fit(module, datamodule=...); module.save_hf("out/qwen3_moe")
    """
    key = "pretrained" if isinstance(model, (str, os.PathLike)) else "dense"
    return UpcycledHFMoEModule(
        num_experts=num_experts,
        top_k=top_k,
        granularity=granularity,
        router_std=router_std,
        shared_expert_intermediate_size=shared_expert_intermediate_size,
        seed=seed,
        dtype=dtype,
        **{key: model},
        **module_kwargs,
    )

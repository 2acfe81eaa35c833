"""Tokens per second and model FLOPs utilisation (MFU), per optimizer step."""

from __future__ import annotations

import functools
import time
from collections import deque
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.throughput import get_available_flops
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from lightning_moe.callbacks.base import (
    OptimizerStepCallback,
    StepClock,
    count_tokens,
    data_parallel_size,
    log_to_loggers,
)
from lightning_moe.callbacks.comm_accounting import uncounted
from lightning_moe.moe import MoELayer
from lightning_moe.parallel.dims import parallel_dims_of

_PRECISION_DTYPES = {"bf16": torch.bfloat16, "16": torch.float16, "64": torch.float64}


def active_parameters(module: nn.Module) -> float:
    """Parameters one token multiplies with: all but embedding tables (a lookup, no FLOPs), with every
    ``MoELayer``'s routed experts scaled by ``top_k / num_experts``. DTensors count their global size.

    Example::

        active_parameters(MoELayer(64, 128, num_experts=8, top_k=2))  # router + 2/8 of the experts
    """
    scale: dict[int, float] = {}
    for layer in module.modules():
        if isinstance(layer, MoELayer):
            for param in layer.experts.parameters():
                scale[id(param)] = layer.top_k / layer.num_experts
    embeddings = {id(p) for m in module.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    return float(sum(p.numel() * scale.get(id(p), 1.0) for p in module.parameters() if id(p) not in embeddings))


def model_flops_per_token(module: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token (forward and backward): ``6 * active_parameters + 12 * sum_l(h_l) * seq_len``.

    The second term is attention's score and value products (PaLM's estimate, appendix B), summed
    over the attention modules: submodules with integer ``num_heads`` and ``head_dim`` attributes,
    ``h_l = num_heads * head_dim``. See :func:`active_parameters` for the first; multi-token
    prediction's depths run the output head once more each (:func:`reapplied_head_parameters`).

    Example::

        model_flops_per_token(MoEGPT(hidden_size=64, num_layers=2), seq_len=128)
    """
    attention = sum(
        m.num_heads * m.head_dim
        for m in module.modules()
        if m is not module
        and isinstance(getattr(m, "num_heads", None), int)
        and isinstance(getattr(m, "head_dim", None), int)
    )
    return 6.0 * (active_parameters(module) + reapplied_head_parameters(module)) + 12.0 * attention * seq_len


def reapplied_head_parameters(module: nn.Module) -> float:
    """``mtp_depth`` times the output head's parameters: DeepSeek-V3's MTP depths share the main
    model's head and apply it to their own hidden states. The depth is the module's
    ``hparams["mtp_depth"]``; the head its ``output`` (``MoEGPT``; None on a pipeline stage before the
    last) or its Hugging Face model's ``get_output_embeddings()``."""
    depth = getattr(module, "hparams", {}).get("mtp_depth") or 0
    if not depth:
        return 0.0
    head = getattr(module, "output", None)
    hf = getattr(module, "model", None)
    if head is None and callable(getattr(hf, "get_output_embeddings", None)):
        head = hf.get_output_embeddings()
    return float(depth * sum(p.numel() for p in head.parameters())) if isinstance(head, nn.Module) else 0.0


@functools.cache
def measured_matmul_flops(device: torch.device, dtype: torch.dtype, size: int = 512, seconds: float = 0.2) -> float:
    """FLOP/s of a square matmul on ``device``: a stand-in peak where no datasheet figure is known (CPUs).

    Measured once per process (cached), so the jobs of an in-process sweep share one figure.
    """
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b  # warm-up
    done, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        done += 1
    return 2.0 * size**3 * done / elapsed


def _precision_dtype(precision: str) -> torch.dtype:
    return next(
        (dtype for prefix, dtype in _PRECISION_DTYPES.items() if str(precision).startswith(prefix)), torch.float32
    )


class ThroughputCallback(OptimizerStepCallback):
    """Log training throughput and an MFU estimate once per optimizer step.

    - ``perf/tokens_per_second``: tokens of the global batch per second, over the last ``window``
      optimizer steps (validation time excluded); the progress bar shows it as ``tokens/s``;
    - ``perf/step_seconds``: wall-clock seconds of the last optimizer step;
    - ``perf/model_flops_per_second``: ``model_flops_per_token * tokens_per_second`` (all devices);
    - ``perf/mfu``: that over ``peak_flops_per_device * world_size``.

    ``model_flops_per_token`` comes from the module (:func:`model_flops_per_token`: 6 x active
    parameters, experts scaled by top_k / num_experts, plus attention; pipeline stages summed).
    ``peak_flops_per_device``: the accelerator's peak FLOP/s for the training precision; ``None``
    takes Lightning's datasheet table (CUDA, TPU) or, where it has none (CPU), measures a matmul
    once at the start (a practical peak, not a datasheet one). ``summary_fields`` adds
    ``model_flops_per_token``, ``peak_flops_per_device`` and ``mfu`` (all steps but the first) to
    ``summary.json``. No collective per step: every data-parallel rank processes the same number
    of tokens.

    Example::

        trainer = pl.Trainer(callbacks=[ThroughputCallback(peak_flops_per_device=989e12)])  # H100 bf16
    """

    def __init__(self, peak_flops_per_device: float | None = None, window: int = 10, prog_bar: bool = True) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.peak_flops_per_device = peak_flops_per_device
        self.window = window
        self.prog_bar = prog_bar
        self.metrics: dict[str, float] = {}
        self._reset()

    def _reset(self) -> None:
        self.flops_per_token: float | None = None  # from the first batch (its sequence length)
        self._peak: float | None = self.peak_flops_per_device
        self._world_size = 1
        self._clock = StepClock()
        self._recent: deque[tuple[float, float]] = deque(maxlen=self.window)  # (tokens, seconds) of later steps
        self._step_tokens = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset()
        self._world_size = trainer.world_size
        if self._peak is None:
            device, dtype = trainer.strategy.root_device, _precision_dtype(trainer.precision)
            available = get_available_flops(device, dtype)
            self._peak = float(available) if available else measured_matmul_flops(device, dtype)
            if not available:
                rank_zero_info(
                    f"ThroughputCallback: no datasheet peak for {device.type}, MFU relative to a measured {dtype} "
                    f"matmul ({self._peak / 1e9:.1f} GFLOP/s per device); set peak_flops_per_device to change it"
                )

    def on_step_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        if self.flops_per_token is None:
            self.flops_per_token = self._model_flops_per_token(trainer, pl_module, batch)
        self._clock.start()

    def on_micro_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any) -> None:
        self._step_tokens += count_tokens(batch)

    def on_step_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.flops_per_token is not None and self._peak is not None
        tokens = float(self._step_tokens * data_parallel_size(trainer))
        self._step_tokens = 0
        seconds = self._clock.lap(tokens)
        if self._clock.after_first[1]:  # the first step holds the start-up: left out once others exist
            self._recent.append((tokens, seconds))
        steps = self._recent or [(tokens, seconds)]
        tokens_per_second = sum(t for t, _ in steps) / sum(s for _, s in steps)
        flops = self.flops_per_token * tokens_per_second
        self.metrics = {
            "perf/tokens_per_second": tokens_per_second,
            "perf/step_seconds": seconds,
            "perf/model_flops_per_second": flops,
            "perf/mfu": flops / (self._peak * self._world_size),
        }
        log_to_loggers(trainer, self.metrics)
        if self.prog_bar:
            pl_module.log("tokens/s", tokens_per_second, prog_bar=True, logger=False, batch_size=1)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._clock.pause()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._clock.resume()

    def _model_flops_per_token(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> float:
        seq_len = batch["input_ids"].shape[-1] if isinstance(batch, dict) and "input_ids" in batch else 1
        flops = model_flops_per_token(pl_module, seq_len)
        dims = parallel_dims_of(trainer)
        if dims is not None and dims.pp > 1:  # each stage holds its own layers
            total = torch.tensor(flops, dtype=torch.float64, device=trainer.strategy.root_device)
            with uncounted():
                dist.all_reduce(total, group=dims.pp_group)
            flops = float(total)
        return flops

    def summary_fields(self) -> dict[str, Any]:
        """``model_flops_per_token``, ``peak_flops_per_device`` and ``mfu`` (over all steps but the first)."""
        totals = self._clock.totals()
        if self.flops_per_token is None or self._peak is None or totals is None:
            return {}
        tokens, seconds = totals
        mfu = self.flops_per_token * tokens / seconds / (self._peak * self._world_size)
        return {"model_flops_per_token": self.flops_per_token, "peak_flops_per_device": self._peak, "mfu": mfu}

"""``make bench-gpu``: the CUDA figures of lightning-moe in one short run (< 8 minutes on one H200).

Imports neither Hydra, OmegaConf nor W&B, so it runs with a GPU machine's preinstalled torch
(>= 2.11) and lightning 2.6 straight from a checkout:

    python -m experiments.bench.gpu --out bench_gpu.json          # on the GPU machine
    python -m experiments.bench.gpu --smoke --out /tmp/smoke.json # tiny shapes, CPU, seconds

Sections (each writes its rows into the JSON as soon as it finishes, so a run cut short keeps
what it measured; a section that fails records its error and the next one runs):

1. ``moe_layer``: :class:`MoELayer` forward+backward in bf16 (parameters and activations) at
   realistic shapes, next to a dense bf16 SwiGLU chain of equal GEMM FLOPs measured in the same
   run (interleaved), and torchtitan's MoE if that package is installed. TFLOP/s count the expert
   GEMMs only (``18 * T * k * H * F`` for forward+backward); router, permutation and combine are
   overhead the layer pays. Target (issue 17): MoE >= 60% of the dense chain at E=8, k=2.
2. ``ring_attention``: :func:`ring_attention` with cp=1 (flash kernel per block) against
   ``F.scaled_dot_product_attention``, causal, forward+backward.
3. ``train_step``: one-GPU training steps of a ~1B-parameter Mixtral-like :class:`MoEGPT` under
   bf16 autocast with AdamW: tokens/s and MFU (model FLOPs ``6 * active params + attention``
   over the bf16 dense peak). Target: MFU >= 40%.
4. ``dense_gemm``: one large bf16 GEMM, the machine's achievable peak, for reference.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_moe.cp import ring_attention
from lightning_moe.models import MoEGPT
from lightning_moe.moe import MoELayer

# Dense bf16 tensor-core peaks (no sparsity), TFLOP/s, for MFU.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "H20": 148.0, "A100": 312.0, "B200": 2250.0, "GH200": 989.0}

# (tokens, hidden, ffn, experts, top_k): Mixtral 8x7B, DeepSeek/Qwen-style fine-grained experts.
MOE_SHAPES = ((16384, 4096, 14336, 8, 2), (16384, 4096, 1408, 64, 6), (16384, 4096, 2816, 32, 8))
SMOKE_MOE_SHAPES = ((256, 64, 96, 4, 2),)
# (batch, heads, seq, head_dim)
ATTN_SHAPES = ((4, 32, 8192, 128),)
SMOKE_ATTN_SHAPES = ((1, 2, 64, 16),)
# ~1.25B parameters (~0.4B active): Mixtral's design (8 experts, top-2, GQA 4:1, every layer MoE)
# at hidden 2048 with expert FFN 1.75x hidden.
TRAIN_MODEL = dict(
    vocab_size=32000,
    hidden_size=2048,
    num_layers=6,
    num_heads=16,
    num_kv_heads=4,
    moe=dict(num_experts=8, top_k=2, ffn_hidden_size=3584, aux_loss_coeff=1e-2),
)
TRAIN_BATCH = (4, 4096)  # (batch, seq)
SMOKE_TRAIN_MODEL = dict(
    vocab_size=256,
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    moe=dict(num_experts=4, top_k=2, ffn_hidden_size=96),
)
SMOKE_TRAIN_BATCH = (2, 32)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fns: dict[str, Callable[[], Any]], device: torch.device, warmup: int, iters: int) -> dict[str, float]:
    """Median seconds per call of each function, measured round-robin (drift hits all alike)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    _sync(device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_BF16_TFLOPS[key]
    return None


# -- 1. MoE layer vs an equal-FLOP dense chain ---------------------------------------------------------
def _torchtitan_layer(hidden: int, ffn: int, experts: int, top_k: int, device: torch.device) -> Any:
    """torchtitan's MoE layer if installed (its API moves between releases: any failure -> None)."""
    if importlib.util.find_spec("torchtitan") is None:
        return None
    try:
        from torchtitan.models.moe import MoE, MoEArgs  # type: ignore[import-not-found]

        layer = MoE(MoEArgs(num_experts=experts, top_k=top_k), dim=hidden, hidden_dim=ffn)
        layer.init_weights(0.02, device)
        return layer.to(device=device, dtype=torch.bfloat16)
    except Exception:  # noqa: BLE001
        return None


def bench_moe_layer(device: torch.device, shapes: tuple, warmup: int, iters: int) -> list[dict]:
    rows = []
    for shape in shapes:
        rows.append(_bench_moe_shape(device, *shape, warmup=warmup, iters=iters))
        if device.type == "cuda":  # the shape's tensors went with its function's frame
            torch.cuda.empty_cache()
    return rows


def _bench_moe_shape(
    device: torch.device, tokens: int, hidden: int, ffn: int, experts: int, top_k: int, *, warmup: int, iters: int
) -> dict[str, Any]:
    torch.manual_seed(0)
    dtype = torch.bfloat16
    layer = MoELayer(hidden, ffn, experts, top_k=top_k).to(device=device, dtype=dtype)
    dense = [
        (torch.randn(o, i, device=device, dtype=dtype) * 0.02).requires_grad_(True)
        for o, i in ((top_k * ffn, hidden), (top_k * ffn, hidden), (hidden, top_k * ffn))
    ]
    x = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(tokens, hidden, device=device, dtype=dtype)

    def moe_step(module: Any = layer) -> None:
        out = module(x)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(grad)

    def dense_step() -> None:
        h = F.silu(F.linear(x, dense[0])) * F.linear(x, dense[1])
        F.linear(h, dense[2]).backward(grad)

    fns: dict[str, Callable[[], Any]] = {"moe": moe_step, "dense": dense_step}
    titan = _torchtitan_layer(hidden, ffn, experts, top_k, device) if device.type == "cuda" else None
    if titan is not None:
        fns["torchtitan"] = lambda: moe_step(titan)
    seconds = _time(fns, device, warmup, iters)
    flops = 18 * tokens * top_k * hidden * ffn
    row: dict[str, Any] = dict(
        tokens=tokens, hidden=hidden, ffn=ffn, experts=experts, top_k=top_k, expert_gemm_flops=flops
    )
    for name, s in seconds.items():
        row[f"{name}_ms"] = 1e3 * s
        row[f"{name}_tflops"] = flops / s / 1e12
    row["moe_over_dense"] = seconds["dense"] / seconds["moe"]
    return row


# -- 2. Ring attention (cp=1) vs SDPA -----------------------------------------------------------------
def _single_rank_group() -> bool:
    """A one-rank default process group for ring attention's cp=1 ring; True if this call made it."""
    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError("bench-gpu runs in one process: found a default process group of several ranks")
        return False
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return True


def bench_ring_attention(device: torch.device, shapes: tuple, warmup: int, iters: int) -> list[dict]:
    made = _single_rank_group()
    rows = []
    try:
        group = dist.group.WORLD
        dtype = torch.bfloat16
        for batch, heads, seq, head_dim in shapes:
            torch.manual_seed(0)
            q, k, v = (
                torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
                for _ in range(3)
            )
            dout = torch.randn_like(q)

            def sdpa() -> None:
                F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(dout)

            def ring() -> None:
                ring_attention(q, k, v, group, causal=True).backward(dout)

            with torch.no_grad():
                ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                got = ring_attention(q, k, v, group, causal=True)
                max_abs_diff = (ref.float() - got.float()).abs().max().item()
            seconds = _time({"sdpa": sdpa, "ring_cp1": ring}, device, warmup, iters)
            flops = 3.5 * 4 * batch * heads * seq * seq * head_dim / 2  # causal; backward = 2.5x forward
            row: dict[str, Any] = dict(
                batch=batch, heads=heads, seq=seq, head_dim=head_dim, causal=True, max_abs_diff=max_abs_diff
            )
            for name, s in seconds.items():
                row[f"{name}_ms"] = 1e3 * s
                row[f"{name}_tflops"] = flops / s / 1e12
            row["ring_over_sdpa"] = seconds["sdpa"] / seconds["ring_cp1"]
            rows.append(row)
    finally:
        if made:
            dist.destroy_process_group()
    return rows


# -- 3. One-GPU training step of a ~1B MoE ------------------------------------------------------------
def model_flops_per_token(model: MoEGPT, seq: int) -> tuple[float, int, int]:
    """``(training FLOPs per token, total params, active params)``: ``6 * active`` (embedding
    lookup excluded, output head included) plus causal attention ``6 * layers * seq * hidden``."""
    total = sum(p.numel() for p in model.parameters())
    embed = model.tok_embeddings.weight.numel()
    inactive = 0
    for module in model.modules():
        if isinstance(module, MoELayer):
            expert_params = sum(p.numel() for p in module.experts.parameters())
            inactive += expert_params * (module.num_experts - module.top_k) // module.num_experts
    active = total - embed - inactive
    hp = model.hparams
    attention = 6 * hp.num_layers * seq * hp.hidden_size  # 12 * L * S * H halved by the causal mask
    return 6.0 * active + attention, total, active


def bench_train_step(device: torch.device, model_kwargs: dict, batch_shape: tuple, warmup: int, iters: int) -> dict:
    torch.manual_seed(0)
    batch, seq = batch_shape
    # Built on CPU, then moved: MoEGPT draws each initial tensor on CPU from its own generator
    # (under a `torch.device("cuda")` context that draw would meet a CUDA tensor and fail).
    model = MoEGPT(max_seq_len=seq, max_steps=warmup + iters, **model_kwargs).to(device)
    flops_per_token, total, active = model_flops_per_token(model, seq)
    fused = {"fused": True} if device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **fused)
    ids = torch.randint(0, model_kwargs["vocab_size"], (batch, seq + 1), device=device)
    data = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    losses: list[float] = []

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model.loss(data)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = _time({"step": step}, device, warmup, iters)["step"]
    tokens_per_s = batch * seq / seconds
    peak = peak_tflops(device)
    achieved = flops_per_token * tokens_per_s / 1e12
    return dict(
        model=model_kwargs,
        batch=batch,
        seq=seq,
        params=total,
        active_params=active,
        step_ms=1e3 * seconds,
        tokens_per_second=tokens_per_s,
        model_tflops=achieved,
        peak_bf16_tflops=peak,
        mfu=achieved / peak if peak else None,
        losses=[float(x) for x in losses],
        max_memory_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    )


# -- 4. Dense GEMM peak --------------------------------------------------------------------------------
def bench_dense_gemm(device: torch.device, size: int, warmup: int, iters: int) -> dict:
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    seconds = _time({"mm": lambda: a @ b}, device, warmup, iters)["mm"]
    return dict(size=size, ms=1e3 * seconds, tflops=2 * size**3 / seconds / 1e12)


# -- driver --------------------------------------------------------------------------------------------
def _environment(device: torch.device) -> dict:
    env: dict[str, Any] = dict(
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        torch=torch.__version__,
        python=platform.python_version(),
        device=str(device),
        cuda=torch.version.cuda,
    )
    try:
        import lightning

        env["lightning"] = lightning.__version__
    except ImportError:
        env["lightning"] = None
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["capability"] = list(torch.cuda.get_device_capability(device))
    return env


def run(args: argparse.Namespace) -> dict:
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    else:
        device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    warmup, iters = (1, 2) if args.smoke else (args.warmup, args.iters)
    sections: dict[str, Callable[[], Any]] = {
        "dense_gemm": lambda: bench_dense_gemm(device, 256 if args.smoke else 8192, warmup, iters),
        "moe_layer": lambda: bench_moe_layer(device, SMOKE_MOE_SHAPES if args.smoke else MOE_SHAPES, warmup, iters),
        "ring_attention": lambda: bench_ring_attention(
            device, SMOKE_ATTN_SHAPES if args.smoke else ATTN_SHAPES, warmup, iters
        ),
        "train_step": lambda: bench_train_step(
            device,
            SMOKE_TRAIN_MODEL if args.smoke else TRAIN_MODEL,
            SMOKE_TRAIN_BATCH if args.smoke else TRAIN_BATCH,
            warmup,
            iters,
        ),
    }
    only = args.only.split(",") if args.only else list(sections)
    result: dict[str, Any] = {"environment": _environment(device), "smoke": args.smoke, "seconds": {}, "errors": {}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in only:
        start = time.perf_counter()
        print(f"[bench-gpu] {name} ...", flush=True)
        try:
            result[name] = sections[name]()
        except Exception as exc:  # noqa: BLE001  (one failing section must not lose the others)
            result["errors"][name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            if args.strict:
                raise
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        result["seconds"][name] = round(time.perf_counter() - start, 2)
        out.write_text(json.dumps(result, indent=2, default=str))
        print(json.dumps({name: result.get(name), "error": result["errors"].get(name)}, default=str)[:2000], flush=True)
    targets = {}
    for row in result.get("moe_layer") or []:
        if (row["experts"], row["top_k"]) == (8, 2):
            targets["moe_over_dense_E8_k2 (target >= 0.60)"] = row["moe_over_dense"]
    if isinstance(result.get("train_step"), dict) and result["train_step"].get("mfu") is not None:
        targets["train_mfu (target >= 0.40)"] = result["train_step"]["mfu"]
    result["targets"] = targets
    out.write_text(json.dumps(result, indent=2, default=str))
    print(f"[bench-gpu] wrote {out}: {json.dumps(targets)}", flush=True)
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_gpu.json", help="the JSON file the figures go to")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: checks the script in seconds")
    parser.add_argument("--device", default="auto", help="auto (cuda if present, cpu with --smoke), cpu, cuda, cuda:N")
    parser.add_argument(
        "--only", default="", help="comma-separated sections: dense_gemm,moe_layer,ring_attention,train_step"
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--strict", action="store_true", help="stop at the first failing section")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    result = run(parse_args(argv))
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    sys.exit(main())

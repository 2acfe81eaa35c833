"""MoE layer forward+backward throughput next to an equal-FLOP dense chain and a naive expert loop.

All three run the same SwiGLU expert math on the same tokens, measured round-robin in one run
(so machine-load drift hits them alike), median of ``iters`` after ``warmup``. Every iteration
routes new random tokens, as a training step does: the per-expert row counts, and so the expert
GEMM shapes, change from one iteration to the next (on CPU, oneDNN builds a kernel per new bf16
shape; repeating one batch would hide that cost).

- ``moe``: :class:`lightning_moe.moe.MoELayer` (router, permutation, grouped GEMMs, combine);
- ``dense``: a dense SwiGLU MLP of hidden size ``top_k * ffn``: the same GEMM FLOPs as the experts
  (3 matmuls of ``T * k * H * F`` multiply-adds), without routing;
- ``naive``: the same router, then a Python loop over experts (gather, MLP, ``index_add_``);
- ``exact rows``: the MoE layer without the dispatcher's row padding (``pad_rows=False``), to
  show what padding the per-expert row counts to few sizes buys.

    python -m experiments.bench.moe_layer
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from experiments.bench.table import print_table
from lightning_moe.moe import LocalDispatcher, MoELayer

# (tokens, hidden, ffn, experts, top_k)
SHAPES: tuple[tuple[int, int, int, int, int], ...] = ((4096, 256, 512, 8, 2), (8192, 512, 1024, 8, 2))
PRECISIONS: tuple[str, ...] = ("fp32", "bf16")


def _naive_moe(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    routing = layer.router(x)
    out = torch.zeros_like(x)
    experts = layer.experts
    for e in range(layer.num_experts):
        token, choice = torch.where(routing.topk_idx == e)
        h = x[token]
        y = (F.silu(h @ experts.w1[e]) * (h @ experts.w3[e])) @ experts.w2[e]
        out.index_add_(0, token, (y * routing.topk_weights[token, choice, None]).to(out.dtype))
    return out


def _dense_swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def _measure(fns: dict[str, Callable[[], None]], warmup: int, iters: int) -> dict[str, float]:
    """Median seconds per call of each function, timed round-robin."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def run_moe_layer_bench(
    shapes: tuple[tuple[int, int, int, int, int], ...] = SHAPES,
    precisions: tuple[str, ...] = PRECISIONS,
    warmup: int = 3,
    iters: int = 9,
    threads: int = 2,
) -> list[dict]:
    """Forward+backward tokens/s of the MoE layer, the equal-FLOP dense chain and the naive loop.

    ``precisions``: ``"fp32"`` and/or ``"bf16"`` (``torch.autocast``, fp32 parameters). Returns one
    row per (shape, precision) with the throughputs and the ratios ``moe/dense`` and ``moe/naive``.
    """
    torch.set_num_threads(threads)
    rows = []
    for tokens, hidden, ffn, num_experts, top_k in shapes:
        torch.manual_seed(0)
        layer = MoELayer(hidden, ffn, num_experts, top_k, aux_loss_coeff=1e-2)
        exact_rows = copy.deepcopy(layer)
        exact_rows.dispatcher = LocalDispatcher(num_experts, pad_rows=False)
        dense = [
            torch.nn.Parameter(torch.randn(top_k * ffn, hidden) * hidden**-0.5),
            torch.nn.Parameter(torch.randn(top_k * ffn, hidden) * hidden**-0.5),
            torch.nn.Parameter(torch.randn(hidden, top_k * ffn) * (top_k * ffn) ** -0.5),
        ]
        inputs = [torch.randn(tokens, hidden, requires_grad=True) for _ in range(warmup + iters)]
        grad = torch.randn(tokens, hidden)
        params = [*layer.parameters(), *exact_rows.parameters(), *dense, *inputs]

        for precision in precisions:
            autocast = precision == "bf16"

            def step(forward: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
                batches = iter(inputs)

                def run() -> None:
                    x = next(batches)
                    for p in params:
                        p.grad = None
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                        y = forward(x)
                    y.backward(grad.to(y.dtype))

                return run

            seconds = _measure(
                {
                    "moe": step(layer),
                    "exact rows": step(exact_rows),
                    "dense": step(lambda x: _dense_swiglu(x, *dense)),
                    "naive": step(lambda x: _naive_moe(layer, x)),
                },
                warmup,
                iters,
            )
            rate = {name: tokens / s for name, s in seconds.items()}
            rows.append(
                {
                    "shape T/H/F/E/k": f"{tokens}/{hidden}/{ffn}/{num_experts}/{top_k}",
                    "precision": precision,
                    "moe tok/s": rate["moe"],
                    "dense tok/s": rate["dense"],
                    "naive tok/s": rate["naive"],
                    "moe ms": seconds["moe"] * 1e3,
                    "moe/dense": rate["moe"] / rate["dense"],
                    "moe/naive": rate["moe"] / rate["naive"],
                    "exact rows/dense": rate["exact rows"] / rate["dense"],
                }
            )
    return rows


def main() -> None:
    threads = 2
    print(
        f"MoE layer forward+backward on CPU, {threads} threads, median of round-robin runs (higher ratios are better)"
    )
    print_table(run_moe_layer_bench(threads=threads))


if __name__ == "__main__":
    main()

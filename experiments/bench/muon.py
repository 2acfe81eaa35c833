"""Muon vs AdamW: optimizer step time on ep2 and dp2, and how evenly the ranks share Newton-Schulz.

One MoEGPT (hidden 128, 2 layers, 8 experts of FFN 256) on 2 gloo processes per layout, parallelized as
the strategy does (FSDP2 and experts on ep); gradients are set by hand, so only the optimizer step is
timed: ``torch.optim.AdamW`` and ``lightning_moe.optim.Muon`` (fp32 Newton-Schulz, its default) on the
same model, alternating, median of the repeats. The Newton-Schulz share is each rank's FLOPs of the
matrices it orthogonalized (owners round-robin), max / mean over ranks (1.0: even).

    python -m experiments.bench.muon
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODEL = {"hidden_size": 128, "num_layers": 2, "num_heads": 4}
MOE = {"num_experts": 8, "top_k": 2, "ffn_hidden_size": 256}
LAYOUTS = {"ep2": {"ep": 2}, "dp2": {"dp": 2}}
REPEATS = 7


def _step_seconds(optimizer: torch.optim.Optimizer) -> float:
    dist.barrier()
    start = time.perf_counter()
    optimizer.step()
    dist.barrier()
    return time.perf_counter() - start


def _measure(rank: int, world: int, store: str, sizes: dict, out: dict) -> None:
    from torch.distributed.tensor import DTensor

    from lightning_moe import ParallelDims, parallelize
    from lightning_moe.models import MoEGPT
    from lightning_moe.optim import Muon
    from lightning_moe.planner.muon import newton_schulz_flops

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    dims = ParallelDims(**sizes)
    dims.build_mesh("cpu")
    torch.manual_seed(0)
    model = MoEGPT(**MODEL, moe=MOE)
    parallelize(model, dims)
    for param in model.parameters():
        param.grad = torch.randn_like(param) if isinstance(param, DTensor) else torch.randn(param.shape)
    adamw, muon = torch.optim.AdamW(model.parameters(), lr=1e-4), Muon(model, lr=1e-4)
    adamw.step(), muon.step()  # state allocated, Muon's shard groups set up
    times = {"adamw": [], "muon": []}
    for _ in range(REPEATS):
        times["adamw"].append(_step_seconds(adamw))
        times["muon"].append(_step_seconds(muon))
    flops = sum(count * newton_schulz_flops(rows, cols) for rows, cols, count in muon.newton_schulz_matrices())
    every_rank = [None] * world
    dist.all_gather_object(every_rank, flops)
    if rank == 0:
        out.update({name: statistics.median(t) for name, t in times.items()}, flops=every_rank)
    dist.destroy_process_group()


def _run_layout(sizes: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        out = manager.dict()
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        mp.spawn(_measure, args=(2, os.path.join(tmp, "store"), sizes, out), nprocs=2)
        return dict(out)


def run_muon_bench() -> list[dict]:
    rows = []
    for label, sizes in LAYOUTS.items():
        result = _run_layout(sizes)
        flops = result["flops"]
        rows.append({
            "layout (2 ranks)": label,
            "AdamW step ms": result["adamw"] * 1e3,
            "Muon step ms": result["muon"] * 1e3,
            "Muon / AdamW": result["muon"] / result["adamw"],
            "Newton-Schulz MFLOP per rank (max)": max(flops) / 1e6,
            "max / mean over ranks": max(flops) / statistics.mean(flops),
        })  # fmt: skip
    return rows


def main() -> None:
    from experiments.bench.table import print_table

    print("Muon vs AdamW: optimizer step (MoEGPT hidden 128, 2 layers, 8 experts; fp32, CPU gloo, median of 7)")
    print_table(run_muon_bench())


if __name__ == "__main__":
    main()

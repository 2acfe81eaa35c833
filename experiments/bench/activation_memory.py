"""Activation memory per rank with activation checkpointing none/full/selective, and step times.

Two gloo processes, ep=2 (data_parallel="fsdp"), MoEGPT at a size where activations dominate.
Activation memory per rank is what autograd keeps for backward after the forward: the bytes of the
distinct tensor storages saved through ``torch.autograd.graph.saved_tensors_hooks`` (parameters not
counted). Tensors saved inside a checkpointed region go through the checkpoint's own hooks and are
not counted: that is the saving; the region's inputs, which the checkpoint keeps alive for the
recomputation, are not counted either (under ``full`` one ``[batch, seq, hidden]`` tensor per block,
0.5 MB each at this size). Step time is forward+backward+AdamW,
median of a few steps after a warm-up, with each setting relative to AC none; the second table
gives bf16-mixed (autocast plus the FSDP2 bf16 policy the strategy sets) relative to fp32.

    python -m experiments.bench.activation_memory
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from experiments.bench.table import print_table

MODEL = dict(
    vocab_size=256,
    hidden_size=128,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    max_seq_len=256,
    moe={"num_experts": 8, "top_k": 2, "ffn_hidden_size": 256},
)
BATCH, SEQ, STEPS, WARMUP = 4, 256, 4, 1


def _saved_activation_bytes(model: torch.nn.Module, ids: torch.Tensor) -> int:
    params = {p.data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.data_ptr() not in params and tensor.device.type != "meta":
            seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids).float().square().mean()
    loss.backward()
    return sum(seen.values())


def _worker(rank: int, world: int, store_file: str, out: dict) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    from lightning_moe import ParallelDims, parallelize
    from lightning_moe.models import MoEGPT
    from lightning_moe.parallel.plans.activation_checkpoint import apply_activation_checkpointing
    from lightning_moe.parallel.plans.precision import apply_mixed_precision, mixed_precision_policy

    dims = ParallelDims(ep=world)
    dims.validate(world)
    dims.build_mesh("cpu")
    ids = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(rank))
    results = {}
    for name, mode, precision in (
        ("none", "none", "32-true"),
        ("full", "full", "32-true"),
        ("selective", "selective", "32-true"),
        ("bf16-mixed", "none", "bf16-mixed"),
    ):
        torch.manual_seed(0)
        model = parallelize(MoEGPT(**MODEL), dims)
        apply_mixed_precision(model, mixed_precision_policy(precision))
        apply_activation_checkpointing(model, mode)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed")
        with autocast:
            saved = _saved_activation_bytes(model, ids)
        optimizer.zero_grad()
        times = []
        for step in range(WARMUP + STEPS):
            dist.barrier()
            start = time.perf_counter()
            with autocast:
                loss = torch.nn.functional.cross_entropy(model(ids).float().flatten(0, 1), ids.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            dist.barrier()
            if step >= WARMUP:
                times.append(time.perf_counter() - start)
        results[name] = (saved, statistics.median(times))
    out[rank] = results
    dist.barrier()
    dist.destroy_process_group()


def measure() -> dict:
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(2, f"{tmp}/store", out), nprocs=2, join=True)
        return dict(out)


def main() -> None:
    per_rank = measure()
    saved = {k: max(r[k][0] for r in per_rank.values()) for k in per_rank[0]}
    step = {k: max(r[k][1] for r in per_rank.values()) for k in per_rank[0]}
    print(
        f"Activation checkpointing, ep=2 on CPU (MoEGPT hidden {MODEL['hidden_size']}, {MODEL['num_layers']} layers,"
        f" batch {BATCH}x{SEQ} per rank): saved activations per rank (max over ranks), step time vs none"
    )
    print_table(
        [
            {
                "activation_checkpointing": k,
                "activation MB per rank": saved[k] / 1e6,
                "memory / none": saved[k] / saved["none"],
                "step time s": step[k],
                "step time / none": step[k] / step["none"],
            }
            for k in ("none", "selective", "full")
        ]
    )
    print()
    print("bf16-mixed vs fp32 step time, ep=2 (FSDP2 bf16 all-gathers, fp32 reduction)")
    print_table(
        [
            {"precision": "32-true", "step time s": step["none"], "ratio": 1.0},
            {"precision": "bf16-mixed", "step time s": step["bf16-mixed"], "ratio": step["bf16-mixed"] / step["none"]},
        ]
    )


if __name__ == "__main__":
    main()

"""Bytes the EP dispatchers move per training step, next to the theoretical minimum.

The minimum counts, for one forward, one row per (token, other ep rank holding one of its
experts), times hidden size times bytes per element, each way (dispatch and combine); the
backward moves the same again. Measured bytes come from :mod:`lightning_moe.comm`, which wraps the
collectives the dispatchers actually issue (the count exchanges, and the default dispatcher's
expert ids and gate weights, included).

The second table counts the copies of a token each (token, other ep rank) pair costs: one per
routed slot with ``dispatcher="alltoall"``, one per pair with ``"alltoall_dedup"`` (rows read off the
splits the dispatchers exchange), for top-2 of 8 and top-8 of 64 experts over ep 4 and 8.

The third table compares tp=2 without sequence parallelism, where every tp rank holds the same
tokens: with the deduplication each tp rank dispatches its 1/tp slice; the naive layout (measured,
not estimated) dispatches every token from every tp rank.

    python -m experiments.bench.dispatch_bytes
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TOKENS, HIDDEN, FFN, EXPERTS, TOP_K = 2048, 256, 512, 8, 2


def _worker(rank: int, world: int, store_file: str, case: dict, out: dict) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    from lightning_moe import ParallelDims, comm, parallelize
    from lightning_moe.moe import MoELayer

    dims = ParallelDims(ep=case["ep"], tp=case.get("tp", 1), etp=1)
    dims.build_mesh("cpu")
    torch.manual_seed(0)
    layer = MoELayer(HIDDEN, FFN, EXPERTS, top_k=TOP_K, dispatcher=case["dispatcher"])
    parallelize(layer, dims, data_parallel="none", sequence_parallel=False)
    # Micro-batch of this rank: its ep coordinate (tp and "naive" dp replicas share one).
    micro_batch = dims.ep_mesh.get_local_rank()
    x = torch.randn(1, TOKENS, HIDDEN, generator=torch.Generator().manual_seed(micro_batch), requires_grad=True)
    comm.reset()
    layer(x).sum().backward()
    measured = comm.snapshot().get("ep", {"bytes": 0, "calls": 0})
    with torch.no_grad():
        owner = layer.router(x.reshape(-1, HIDDEN)).topk_idx // (EXPERTS // dims.ep)
    remote_pairs = sum(len(set(row) - {micro_batch}) for row in owner.tolist())
    minimum = remote_pairs * HIDDEN * x.element_size() * 2 * 2  # dispatch + combine, forward + backward
    total = torch.tensor([measured["bytes"], measured["calls"], minimum], dtype=torch.float64)
    dist.all_reduce(total)
    if rank == 0:
        out["result"] = dict(zip(("bytes", "calls", "minimum"), total.tolist()))
    dist.destroy_process_group()


def _measure(world: int, case: dict) -> dict:
    # A file store, not a TCP port: nothing else on the machine can take it between runs.
    with mp.Manager() as manager, tempfile.TemporaryDirectory() as tmp:
        out = manager.dict()
        mp.start_processes(_worker, args=(world, f"{tmp}/store", case, out), nprocs=world, start_method="spawn")
        return dict(out["result"])


def run_dispatch_bytes_bench(ep_sizes: tuple[int, ...] = (2, 4)) -> list[dict]:
    """Per-rank bytes and calls per step of each dispatcher against the minimum."""
    rows = []
    for ep in ep_sizes:
        for dispatcher in ("alltoall_dedup", "alltoall", "allgather"):
            result = _measure(ep, {"ep": ep, "dispatcher": dispatcher})
            rows.append(
                {
                    "dispatcher": dispatcher,
                    "ep": ep,
                    "MB/rank/step": result["bytes"] / ep / 2**20,
                    "minimum MB/rank/step": result["minimum"] / ep / 2**20,
                    "measured/minimum": result["bytes"] / result["minimum"],
                    "calls/rank/step": result["calls"] / ep,
                }
            )
    return rows


# (experts, top_k) of the copies table: Mixtral's and a fine-grained (DeepSeek-like) routing.
COPIES_ROUTINGS = ((8, 2), (64, 8))


def _copies_worker(rank: int, world: int, store_file: str, out: dict) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    from lightning_moe import ParallelDims
    from lightning_moe.moe import build_dispatcher

    dims = ParallelDims(ep=world)
    dims.build_mesh("cpu")
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(rank))
    for experts, top_k in COPIES_ROUTINGS:
        # Uniform routing: top_k distinct experts per token.
        scores = torch.rand(TOKENS, experts, generator=torch.Generator().manual_seed(100 + rank))
        topk_idx = scores.topk(top_k, dim=1).indices
        local = experts // world
        remote_pairs = sum(len({e // local for e in row} - {rank}) for row in topk_idx.tolist())
        for kind in ("alltoall", "alltoall_dedup"):
            ctx = build_dispatcher(kind, experts, dims.ep_group).dispatch(x, topk_idx, None)
            sent = torch.tensor([sum(ctx.input_splits) - ctx.input_splits[rank], remote_pairs], dtype=torch.float64)
            dist.all_reduce(sent)
            if rank == 0:
                out[(experts, top_k, kind)] = sent[0].item() / sent[1].item()
    dist.destroy_process_group()


def run_copies_bench(ep_sizes: tuple[int, ...] = (4, 8)) -> list[dict]:
    """Rows sent per (token, other ep rank) pair of each all-to-all dispatcher, one forward dispatch."""
    rows = []
    for ep in ep_sizes:
        with mp.Manager() as manager, tempfile.TemporaryDirectory() as tmp:
            out = manager.dict()
            mp.start_processes(_copies_worker, args=(ep, f"{tmp}/store", out), nprocs=ep, start_method="spawn")
            result = dict(out)
        for experts, top_k in COPIES_ROUTINGS:
            rows.append({
                "routing": f"top-{top_k} of {experts}", "ep": ep,
                "alltoall copies/(token, rank)": result[(experts, top_k, "alltoall")],
                "alltoall_dedup copies/(token, rank)": result[(experts, top_k, "alltoall_dedup")],
            })  # fmt: skip
    return rows


def run_tp_dedup_bench() -> list[dict]:
    """ep=2 x tp=2 without SP: dispatch bytes per token with and without the deduplication."""
    tokens = 2 * TOKENS  # two micro-batches, one per ep coordinate
    dedup = _measure(4, {"ep": 2, "tp": 2, "dispatcher": "alltoall_dedup"})
    # The naive layout: both "tp" replicas of an ep coordinate dispatch all of its tokens.
    naive = _measure(4, {"ep": 2, "tp": 1, "dispatcher": "alltoall_dedup"})
    return [
        {"tp=2, sequence parallel off": "deduplicated (ours)", "ep bytes/token": dedup["bytes"] / tokens},
        {"tp=2, sequence parallel off": "naive duplicated", "ep bytes/token": naive["bytes"] / tokens},
        {"tp=2, sequence parallel off": "ratio naive/ours", "ep bytes/token": naive["bytes"] / dedup["bytes"]},
    ]


def main() -> None:
    from experiments.bench.table import print_table

    print(
        f"EP dispatch bytes per rank per step ({TOKENS} tokens/rank, hidden {HIDDEN}, {EXPERTS} experts, top-{TOP_K}, fp32, fwd+bwd)"
    )
    print_table(run_dispatch_bytes_bench())
    print()
    print(f"Copies of a token per (token, other ep rank) pair ({TOKENS} tokens/rank, uniform routing)")
    print_table(run_copies_bench())
    print()
    print("Token deduplication under tensor parallelism (ep=2, tp=2, fwd+bwd)")
    print_table(run_tp_dedup_bench())


if __name__ == "__main__":
    main()

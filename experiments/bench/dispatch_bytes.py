"""Bytes each EP dispatcher moves per training step, next to the theoretical minimum.

The minimum counts, for one forward, the routed slots whose expert lives on another ep rank,
times hidden size times bytes per element, each way (dispatch and combine); the backward moves
the same again. Measured bytes come from :mod:`lightning_moe.comm`, which wraps the collectives
the dispatchers actually issue.

    python -m experiments.bench.dispatch_bytes
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TOKENS, HIDDEN, FFN, EXPERTS, TOP_K = 2048, 256, 512, 8, 2


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world: int, port: int, dispatcher: str, out: dict) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from lightning_moe import ParallelDims, comm, parallelize
    from lightning_moe.moe import MoELayer

    dims = ParallelDims(ep=world)
    mesh = dims.build_mesh("cpu")
    torch.manual_seed(0)
    layer = parallelize(MoELayer(HIDDEN, FFN, EXPERTS, top_k=TOP_K, dispatcher=dispatcher), mesh, data_parallel="none")
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(rank))
    comm.reset()
    layer(x).sum().backward()
    measured = comm.snapshot().get("ep", {"bytes": 0, "calls": 0})
    counts = layer.stats["tokens_per_expert"]
    local = EXPERTS // world
    remote_slots = counts.sum().item() - counts[rank * local : (rank + 1) * local].sum().item()
    minimum = remote_slots * HIDDEN * x.element_size() * 2 * 2  # dispatch + combine, forward + backward
    total = torch.tensor([measured["bytes"], minimum, measured["calls"]], dtype=torch.float64)
    dist.all_reduce(total)
    if rank == 0:
        out[(dispatcher, world)] = (total / world).tolist()
    dist.destroy_process_group()


def run_dispatch_bytes_bench(ep_sizes: tuple[int, ...] = (2, 4)) -> list[dict]:
    rows = []
    manager = mp.Manager()
    for world in ep_sizes:
        for dispatcher in ("alltoall", "allgather"):
            out = manager.dict()
            mp.start_processes(_worker, args=(world, _port(), dispatcher, out), nprocs=world, start_method="spawn")
            measured, minimum, calls = out[(dispatcher, world)]
            rows.append({
                "dispatcher": dispatcher, "ep": world, "MB/rank/step": measured / 2**20,
                "min MB/rank/step": minimum / 2**20, "ratio": measured / minimum if minimum else float("nan"),
                "calls/rank/step": calls,
            })
    return rows


def main() -> None:
    from experiments.bench.table import print_table

    print(f"EP dispatch bytes per rank per step ({TOKENS} tokens/rank, hidden {HIDDEN}, {EXPERTS} experts, top-{TOP_K}, fp32, fwd+bwd)")
    print_table(run_dispatch_bytes_bench())


if __name__ == "__main__":
    main()

"""Topology-aware expert parallelism on 2 simulated nodes: bytes across the node boundary, wire dtypes,
overlap.

Everything is measured by the comm accounting (:mod:`lightning_moe.comm`), which records what the
dispatchers actually send: ``ep`` (all ep traffic) and ``ep_internode`` (what goes to ranks on the
other node). One ``MoELayer`` forward+backward per rank, ``TOKENS`` tokens per rank, ep4 with
``ranks_per_node=2`` and ep8 with ``ranks_per_node=4`` (2 nodes each), gloo on CPU.

- Inter-node bytes per token for the flat all-to-all, the hierarchical dispatcher, and both with
  node-limited routing (``max_nodes_per_token=1``), against the theoretical minimum: every token sent
  once to each distinct *other* node holding one of its experts, ``hidden x 4 bytes`` per transfer,
  times 4 transfers (dispatch, combine, and their gradients). What the hierarchical dispatcher sends
  above it is metadata: per (token, node) row the slots' node-local expert ids (int32) and gate
  weights (fp32, forward and gradient), plus the count exchange.
- ``comm/ep_bytes`` per rank for fp32, bf16 and fp8 dispatch (``dispatch_dtype``).
- Forward+backward time with ``dispatch_chunks`` 1/2/4, as a ratio to 1 chunk (median of repeats).
  On a shared 2-core CPU with gloo this ratio is noise-dominated: the all-to-all is a memory copy
  between local processes, so there is little transfer to hide; the number shows the chunking's
  overhead, not the overlap a GPU cluster would get.

    python -m experiments.bench.ep_topology
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TOKENS, HIDDEN, FFN, EXPERTS, TOP_K = 1024, 256, 256, 16, 2
TIMING_REPEATS = 5

ROUTING_CASES = (
    # label, dispatcher, max_nodes_per_token
    ("flat alltoall", "alltoall", None),
    ("hierarchical", "hierarchical", None),
    ("flat alltoall, M=1", "alltoall", 1),
    ("hierarchical, M=1", "hierarchical", 1),
)


def _step(layer, x: torch.Tensor) -> None:  # noqa: ANN001
    layer(x).square().mean().backward()


def _worker(rank: int, world: int, ranks_per_node: int, store_file: str, out: dict) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    from lightning_moe import ParallelDims, comm, parallelize
    from lightning_moe.moe import MoELayer

    dims = ParallelDims(ep=world, ranks_per_node=ranks_per_node)
    dims.build_mesh("cpu")
    nodes, my_node = dims.ep_num_nodes, dims.ep_node_ids[dims.ep_mesh.get_local_rank()]
    x = torch.randn(1, TOKENS, HIDDEN, generator=torch.Generator().manual_seed(rank), requires_grad=True)

    def build(**options):  # noqa: ANN202
        torch.manual_seed(0)
        layer = MoELayer(HIDDEN, FFN, EXPERTS, top_k=TOP_K, **options)
        return parallelize(layer, dims, data_parallel="none")

    def measure(layer) -> tuple[int, int]:  # noqa: ANN001
        comm.reset()
        _step(layer, x)
        snap = comm.snapshot()
        return snap["ep"]["bytes"], snap.get("ep_internode", {}).get("bytes", 0)

    results: dict = {}
    for label, dispatcher, max_nodes in ROUTING_CASES:
        layer = build(dispatcher=dispatcher, max_nodes_per_token=max_nodes)
        ep_bytes, internode = measure(layer)
        with torch.no_grad():
            slot_nodes = layer.router(x.reshape(-1, HIDDEN)).topk_idx // (EXPERTS // nodes)
        remote_nodes = sum(len(set(row) - {my_node}) for row in slot_nodes.tolist())
        minimum = remote_nodes * HIDDEN * 4 * 4
        results[label] = torch.tensor([ep_bytes, internode, minimum], dtype=torch.float64)
    for wire in (None, "bf16", "fp8"):
        ep_bytes, internode = measure(build(dispatch_dtype=wire))
        results[f"wire {wire}"] = torch.tensor([ep_bytes, internode, 0], dtype=torch.float64)
    for chunks in (1, 2, 4):
        layer = build(dispatch_chunks=chunks)
        _step(layer, x)  # warm-up
        times = []
        for _ in range(TIMING_REPEATS):
            dist.barrier()
            start = time.perf_counter()
            _step(layer, x)
            dist.barrier()
            times.append(time.perf_counter() - start)
        results[f"chunks {chunks}"] = torch.tensor([statistics.median(times), 0, 0], dtype=torch.float64)
    for key, value in results.items():
        if not key.startswith("chunks"):
            dist.all_reduce(value)  # bytes summed over ranks
    if rank == 0:
        out["result"] = {key: value.tolist() for key, value in results.items()}
    dist.destroy_process_group()


def _measure(world: int, ranks_per_node: int) -> dict:
    with mp.Manager() as manager, tempfile.TemporaryDirectory() as tmp:
        out = manager.dict()
        mp.start_processes(
            _worker, args=(world, ranks_per_node, f"{tmp}/store", out), nprocs=world, start_method="spawn"
        )
        return dict(out["result"])


def run_ep_topology_bench(layouts: tuple[tuple[int, int], ...] = ((4, 2), (8, 4))) -> dict[str, list[dict]]:
    """The three tables (inter-node bytes, wire dtypes, chunk timing) for each ``(ep, ranks_per_node)``."""
    routing, wires, chunks = [], [], []
    for ep, ranks_per_node in layouts:
        result = _measure(ep, ranks_per_node)
        tokens = ep * TOKENS
        name = f"ep{ep}, 2 nodes x {ranks_per_node}"
        for label, _, _ in ROUTING_CASES:
            ep_bytes, internode, minimum = result[label]
            routing.append(
                {
                    "layout": name,
                    "dispatch": label,
                    "inter-node B/token": internode / tokens,
                    "minimum B/token": minimum / tokens,
                    "measured/minimum": internode / minimum,
                    "vs flat": internode / result["flat alltoall"][1],
                    "all ep B/token": ep_bytes / tokens,
                }
            )
        base = result["wire None"][0]
        for wire in (None, "bf16", "fp8"):
            ep_bytes, internode, _ = result[f"wire {wire}"]
            wires.append(
                {
                    "layout": name,
                    "dispatch_dtype": str(wire),
                    "comm/ep_bytes per rank": ep_bytes / ep,
                    "ratio to fp32": ep_bytes / base,
                    "inter-node per rank": internode / ep,
                }
            )
        one = result["chunks 1"][0]
        for n in (1, 2, 4):
            chunks.append(
                {
                    "layout": name,
                    "dispatch_chunks": n,
                    "step time / 1 chunk (noisy CPU)": result[f"chunks {n}"][0] / one,
                }
            )
    return {"routing": routing, "wires": wires, "chunks": chunks}


def main() -> None:
    from experiments.bench.table import print_table

    tables = run_ep_topology_bench()
    setting = f"{TOKENS} tokens/rank, hidden {HIDDEN}, {EXPERTS} experts, top-{TOP_K}, fp32, fwd+bwd"
    print(
        f"Inter-node bytes per token on 2 simulated nodes ({setting}; minimum: distinct other nodes x hidden x 4 B x 4)"
    )
    print_table(tables["routing"])
    print()
    print(f"EP bytes by dispatch_dtype, flat alltoall ({setting}; combine and backward in bf16 when set)")
    print_table(tables["wires"])
    print()
    print(
        "dispatch_chunks: forward+backward time relative to 1 chunk (CPU/gloo on shared cores: noisy, overhead not overlap)"
    )
    print_table(tables["chunks"])


if __name__ == "__main__":
    main()

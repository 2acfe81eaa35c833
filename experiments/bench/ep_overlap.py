"""How much of the ep all-to-all time ``MoELayer(dispatch_chunks=2)`` and a shared expert hide, under the link simulator.

On one host a gloo all-to-all costs almost nothing, so the overlap cannot show in step time. Here
2 gloo processes (ep=2, one thread each) run an MoE layer's forward+backward under
:class:`lightning_moe.link_simulator.LinkSimulator` with an ep bandwidth chosen so that the
simulated ep comm time of a step equals the expert compute time of a step:

1. ``expert time``: the experts' grouped GEMMs, forward and backward, timed alone on the rows a
   rank's experts receive in a step (tokens x top_k, split evenly over the local experts);
2. ``ep bytes``: what one rank sends on ep in a step (dispatch and combine, forward and backward,
   the per-expert counts included), as the comm accounting counts it;
3. ``bandwidth = ep bytes / expert time`` (the ranks' mean), latency 0.

For each case — ``dispatch_chunks=1`` without a shared expert (no overlap), ``dispatch_chunks=2``
(chunk i+1's all-to-all in flight behind chunk i's experts; the combines likewise) and a shared
expert of the routed experts' FFN size (computed while the dispatch is in flight; in backward its
gradient while the dispatch's gradient travels) — the step time is measured with infinite
bandwidth (no simulator) and under the simulated link, round-robin, median of ``rounds``; the step
time of a round is the slowest rank's. The link is set once, from the no-overlap layer. Then

    fraction hidden = 1 - (step time - step time with infinite bandwidth) / simulated ep comm time

where the simulated ep comm time is the sum of ``latency + bytes / bandwidth`` over the step's ep
calls (``LinkSimulator.stats``). 0: every simulated second adds to the step; 1: all hidden.
Step times carry the machine's compute noise (a shared 2-core host moves them by tens of ms), so
the table also gives ``hidden (by waits)``: ``1 - ep wait / ep comm``, where ep wait is the time
the ranks slept waiting for simulated completions (``stats["exposed"]``, mean over ranks), a
cross-check that compute noise does not enter.
A model, not a measurement of real links: see docs/link-simulator.md.

    python -m experiments.bench.ep_overlap
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TOKENS, HIDDEN, FFN, EXPERTS, TOP_K = 2048, 256, 512, 8, 2
EP = 2
# What runs while the token all-to-alls are in flight: nothing; the next chunk's experts; the shared
# expert (MoELayer computes it between issuing the dispatch and waiting for it).
CASES = {
    "no overlap": {"dispatch_chunks": 1},
    "dispatch_chunks=2": {"dispatch_chunks": 2},
    "shared expert": {"dispatch_chunks": 1, "shared_expert_hidden_size": FFN},
}


def _step(layer: torch.nn.Module, x: torch.Tensor) -> None:
    layer(x).sum().backward()


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _mean(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def _timed_step(layer: torch.nn.Module, x: torch.Tensor) -> float:
    dist.barrier()
    start = time.perf_counter()
    _step(layer, x)
    return _slowest(time.perf_counter() - start)


def _expert_seconds(layer: torch.nn.Module, reps: int = 5) -> float:
    """Forward+backward of this rank's experts on the rows they get in a step (even split)."""
    local_experts = EXPERTS // EP
    rows = TOKENS * TOP_K  # every rank routes TOKENS * TOP_K slots; balanced, a rank's experts get as many
    counts = torch.full((local_experts,), rows // local_experts, dtype=torch.int64)
    x = torch.randn(rows, HIDDEN, requires_grad=True, generator=torch.Generator().manual_seed(1))
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        layer.experts(x, counts).sum().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _worker(rank: int, world: int, store_file: str, rounds: int, out: dict) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    from lightning_moe import ParallelDims, parallelize
    from lightning_moe.link_simulator import LinkSimulator
    from lightning_moe.moe import MoELayer

    dims = ParallelDims(ep=EP)
    mesh = dims.build_mesh("cpu")
    layers = {}
    for label, options in CASES.items():
        torch.manual_seed(0)
        layer = MoELayer(HIDDEN, FFN, EXPERTS, top_k=TOP_K, **options)
        parallelize(layer, mesh, data_parallel="none", sequence_parallel=False)
        layers[label] = layer
    base = layers["no overlap"]
    x = torch.randn(1, TOKENS, HIDDEN, generator=torch.Generator().manual_seed(rank), requires_grad=True)

    # The setting: ep comm time of a step = expert compute time of a step.
    expert_seconds = _mean(_expert_seconds(base))
    counter = LinkSimulator(ep=1e18)  # records the bytes, delays nothing measurable
    with counter.simulate(dims):
        _step(base, x)
    ep_bytes = _mean(counter.stats["ep"]["bytes"])
    bandwidth = ep_bytes / expert_seconds
    sim = LinkSimulator(ep=bandwidth)

    times: dict[tuple[str, str], list[float]] = {(c, m): [] for c in CASES for m in ("inf", "sim")}
    comm_seconds: dict[str, list[float]] = {c: [] for c in CASES}
    exposed_seconds: dict[str, list[float]] = {c: [] for c in CASES}
    for round_ in range(rounds + 1):  # round 0 warms up
        for case in CASES:
            inf = _timed_step(layers[case], x)
            with sim.simulate(dims):
                simulated = _timed_step(layers[case], x)
                seconds = _mean(sim.stats["ep"]["seconds"])
                exposed = _mean(sim.stats["ep"]["exposed"])
            if round_:
                times[(case, "inf")].append(inf)
                times[(case, "sim")].append(simulated)
                comm_seconds[case].append(seconds)
                exposed_seconds[case].append(exposed)
    if rank == 0:
        out["setting"] = {"expert_seconds": expert_seconds, "ep_bytes": ep_bytes, "bandwidth": bandwidth}
        out["rows"] = [
            {
                "overlap": case,
                "step s (inf bw)": statistics.median(times[(case, "inf")]),
                "step s (simulated)": statistics.median(times[(case, "sim")]),
                "ep comm s (simulated)": statistics.median(comm_seconds[case]),
                "ep wait s (slept)": statistics.median(exposed_seconds[case]),
            }
            for case in CASES
        ]
    dist.destroy_process_group()


def run_ep_overlap_bench(rounds: int = 3) -> tuple[dict, list[dict]]:
    """``(setting, rows)``: the chosen bandwidth and, per case of :data:`CASES`, median step times and
    the fraction of the simulated ep comm time hidden."""
    with mp.Manager() as manager, tempfile.TemporaryDirectory() as tmp:
        out = manager.dict()
        mp.start_processes(_worker, args=(EP, f"{tmp}/store", rounds, out), nprocs=EP, start_method="spawn")
        setting, rows = dict(out["setting"]), [dict(r) for r in out["rows"]]
    for row in rows:
        exposed = row["step s (simulated)"] - row["step s (inf bw)"]
        row["fraction hidden"] = 1 - exposed / row["ep comm s (simulated)"]
        row["hidden (by waits)"] = 1 - row["ep wait s (slept)"] / row["ep comm s (simulated)"]
    return setting, rows


def main() -> None:
    from experiments.bench.table import print_table

    setting, rows = run_ep_overlap_bench()
    print(
        f"EP comm hidden by dispatch_chunks and the shared expert under the link simulator (ep={EP}, {TOKENS} tokens/rank, hidden {HIDDEN},"
        f" ffn {FFN}, {EXPERTS} experts, top-{TOP_K}, fp32, fwd+bwd, 1 thread/rank, median of 3)"
    )
    print(
        f"simulated ep link: {setting['bandwidth'] / 1e6:.1f} MB/s, latency 0 = {setting['ep_bytes'] / 1e6:.2f} MB per rank"
        f" and step / {setting['expert_seconds'] * 1e3:.0f} ms of expert GEMMs (fwd+bwd): ep comm time = expert compute time"
    )
    print_table(rows)


if __name__ == "__main__":
    main()

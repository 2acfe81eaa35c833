"""How much of the ep all-to-all time each overlap option hides, under the link simulator.

On one host a gloo all-to-all costs almost nothing, so overlap cannot show in step time. Here 2
gloo processes (ep=2, one thread each) run training steps of a 2-layer MoEGPT (attention and an
MoE layer per block) under :class:`lightning_moe.link_simulator.LinkSimulator`, each step being
forward and backward of ``MICRO_BATCHES`` micro-batches (gradient accumulation, pp = 1), with an
ep bandwidth chosen so that the simulated ep comm time of a step equals the expert compute time of
a step:

1. ``expert time``: the experts' grouped GEMMs, forward and backward, timed alone on the rows a
   rank's experts receive in a step (tokens x top_k per layer, split evenly over the local experts);
2. ``ep bytes``: what one rank sends on ep in a step (dispatch and combine, forward and backward,
   the per-expert counts included), as the comm accounting counts it;
3. ``bandwidth = ep bytes / expert time`` (the ranks' mean), latency 0.

The cases (:data:`CASES`):

- ``no overlap``: every all-to-all waited for right after it is issued;
- ``dispatch_chunks=2``: within a layer, chunk i+1's all-to-all in flight behind chunk i's experts;
- ``shared expert``: a shared expert of the routed experts' FFN size, computed while the dispatch is
  in flight (in backward, its gradient while the dispatch's gradient travels);
- ``micro-batch overlap``: ``MoE5DStrategy(overlap_ep_comm=True)``'s schedule
  (:mod:`lightning_moe.microbatch_overlap`): micro-batch i's backward interleaved with micro-batch
  i+1's forward, each one's all-to-alls in flight while the other computes.

Each runs with infinite bandwidth (no simulator) and under the simulated link, round-robin, median
of ``rounds``; the step time of a round is the slowest rank's. The link is set once, from the
no-overlap model. Then

    fraction hidden = 1 - (step time - step time with infinite bandwidth) / simulated ep comm time

where the simulated ep comm time is the sum of ``latency + bytes / bandwidth`` over the step's ep
calls (``LinkSimulator.stats``). 0: every simulated second adds to the step; 1: all hidden. Step
times carry the machine's compute noise (a shared 2-core host moves them by tens of ms), so the
table also gives ``hidden (by waits)``: ``1 - ep wait / ep comm``, where ep wait is the time the
ranks slept waiting for simulated completions (``stats["exposed"]``, mean over ranks), a
cross-check that compute noise does not enter.
A model, not a measurement of real links: see docs/link-simulator.md.

    python -m experiments.bench.ep_overlap
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MICRO_BATCHES, SAMPLES, SEQ = 4, 4, 128  # per rank and step: 4 x 4 x 128 = 2048 tokens
HIDDEN, FFN, EXPERTS, TOP_K, LAYERS, HEADS = 256, 512, 8, 2, 2, 4
EP = 2
# MoE options of each case, and whether micro-batches overlap.
CASES: dict[str, tuple[dict, bool]] = {
    "no overlap": ({}, False),
    "dispatch_chunks=2": ({"dispatch_chunks": 2}, False),
    "shared expert": ({"shared_expert_hidden_size": FFN}, False),
    "micro-batch overlap": ({}, True),
}


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _mean(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def _training_step(model: torch.nn.Module, micro_batches: list[torch.Tensor], overlap: bool) -> None:
    """Forward and backward of every micro-batch, gradients accumulated (as Lightning's loop runs them)."""
    from lightning_moe.microbatch_overlap import MicroBatchOverlap

    schedule = MicroBatchOverlap() if overlap else None
    for i, ids in enumerate(micro_batches):
        step: Callable[[], torch.Tensor] = lambda ids=ids: model.loss({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
        if schedule is None:
            step().backward()
        else:
            loss = schedule.forward(step)
            schedule.backward(loss.backward, last=i == len(micro_batches) - 1)
    model.zero_grad(set_to_none=True)


def _timed_step(model: torch.nn.Module, micro_batches: list[torch.Tensor], overlap: bool) -> float:
    dist.barrier()
    start = time.perf_counter()
    _training_step(model, micro_batches, overlap)
    return _slowest(time.perf_counter() - start)


def _expert_seconds(model: torch.nn.Module, reps: int = 5) -> float:
    """Forward+backward of this rank's experts, every MoE layer, on the rows they get in a step (even split)."""
    from lightning_moe.moe import MoELayer

    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    local_experts = EXPERTS // EP
    rows = MICRO_BATCHES * SAMPLES * SEQ * TOP_K  # a rank routes this many slots per layer; balanced, its experts get as many
    counts = torch.full((local_experts,), rows // local_experts, dtype=torch.int64)
    x = torch.randn(rows, HIDDEN, requires_grad=True, generator=torch.Generator().manual_seed(1))
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        for layer in layers:
            layer.experts(x, counts).sum().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _worker(rank: int, world: int, store_file: str, rounds: int, out: dict) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    from lightning_moe import ParallelDims, parallelize
    from lightning_moe.link_simulator import LinkSimulator
    from lightning_moe.models import MoEGPT

    dims = ParallelDims(ep=EP)
    mesh = dims.build_mesh("cpu")
    models = {}
    for label, (moe_options, _) in CASES.items():
        torch.manual_seed(0)
        moe = {"num_experts": EXPERTS, "top_k": TOP_K, "ffn_hidden_size": FFN, **moe_options}
        model = MoEGPT(hidden_size=HIDDEN, num_layers=LAYERS, num_heads=HEADS, moe=moe, max_seq_len=SEQ)
        parallelize(model, mesh, data_parallel="none", sequence_parallel=False)
        models[label] = model
    generator = torch.Generator().manual_seed(rank)
    micro_batches = [torch.randint(0, 256, (SAMPLES, SEQ + 1), generator=generator) for _ in range(MICRO_BATCHES)]
    base = models["no overlap"]

    # The setting: ep comm time of a step = expert compute time of a step.
    expert_seconds = _mean(_expert_seconds(base))
    counter = LinkSimulator(ep=1e18)  # records the bytes, delays nothing measurable
    with counter.simulate(dims):
        _training_step(base, micro_batches, overlap=False)
    ep_bytes = _mean(counter.stats["ep"]["bytes"])
    bandwidth = ep_bytes / expert_seconds
    sim = LinkSimulator(ep=bandwidth)

    times: dict[tuple[str, str], list[float]] = {(c, m): [] for c in CASES for m in ("inf", "sim")}
    comm_seconds: dict[str, list[float]] = {c: [] for c in CASES}
    exposed_seconds: dict[str, list[float]] = {c: [] for c in CASES}
    for round_ in range(rounds + 1):  # round 0 warms up
        for case, (_, overlap) in CASES.items():
            inf = _timed_step(models[case], micro_batches, overlap)
            with sim.simulate(dims):
                simulated = _timed_step(models[case], micro_batches, overlap)
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
        f"EP comm hidden under the link simulator (ep={EP}, MoEGPT {LAYERS} layers, hidden {HIDDEN}, {EXPERTS} experts of ffn {FFN},"
        f" top-{TOP_K}, {MICRO_BATCHES} micro-batches of {SAMPLES}x{SEQ} tokens per rank and step, fp32, 1 thread/rank, median of 3)"
    )
    print(
        f"simulated ep link: {setting['bandwidth'] / 1e6:.1f} MB/s, latency 0 = {setting['ep_bytes'] / 1e6:.2f} MB per rank"
        f" and step / {setting['expert_seconds'] * 1e3:.0f} ms of expert GEMMs (fwd+bwd): ep comm time = expert compute time"
    )
    print_table(rows)


if __name__ == "__main__":
    main()

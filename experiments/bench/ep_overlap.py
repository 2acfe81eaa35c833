"""How much of the ep all-to-all time each overlap option hides, under the link simulator.

On one host a gloo all-to-all costs almost nothing, so overlap cannot show in step time. Here 2
gloo processes (ep=2, one thread each) run training steps of a 2-layer MoEGPT (attention and an
MoE layer per block) under :class:`lightning_moe.comm.link_simulator.LinkSimulator`, each step being
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
  (:class:`lightning_moe.parallel.engines.accumulation.MicroBatchOverlap`): micro-batch i's backward
  interleaved with micro-batch i+1's forward, each one's all-to-alls in flight while the other computes.

Each runs with infinite bandwidth (no simulator) and under the simulated link, round-robin, median
of ``rounds``; the step time of a round is the slowest rank's. The link is set once, from the
no-overlap model. Then

    fraction hidden = 1 - (step time - step time with infinite bandwidth) / simulated ep comm time

where the simulated ep comm time is the sum of ``latency + bytes / bandwidth`` over the step's ep
calls (``LinkSimulator.stats``). 0: every simulated second adds to the step; 1: all hidden. Step
times carry the machine's compute noise (a shared 2-core host moves them by tens of ms), so the
table also gives ``hidden (by blocking)``: ``1 - ep blocked / ep comm``, where ep blocked is the
time the ranks' threads spent blocked on ep calls, real call and simulated wait together
(``stats["blocked"]``, mean over ranks): compute noise does not enter it, and without overlap it is
about 0.

Beside each case, the planner's prediction for the same shapes and option (:func:`planner_hidden`):
the planner's own :func:`~lightning_moe.planner.step_time.estimate` of the bench's model and layout
on ``cpu_local`` with asynchronous collectives, no latency and an ep bandwidth set as the bench sets
its link (the planner's ep comm time of a step = its expert compute time of a step), the hidden
share of its ep comm time; and whether measurement and prediction agree within
:data:`AGREEMENT`, on the share hidden by blocking and on the same share less the no-overlap case's
(``gain by blocking``: the waits on a slower peer and on the FIFO link that every case pays, which
the planner does not model, taken out).
A model, not a measurement of real links: see docs/link-simulator.md.

    python -m experiments.bench.ep_overlap
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MICRO_BATCHES, SAMPLES, SEQ = 8, 2, 128  # per rank and step: 8 x 2 x 128 = 2048 tokens
HIDDEN, FFN, EXPERTS, TOP_K, LAYERS, HEADS = 256, 512, 8, 2, 2, 4
EP = 2
VOCAB = 256  # MoEGPT's default, which _build keeps
# MoE options of each case, and whether micro-batches overlap.
CASES: dict[str, tuple[dict, bool]] = {
    "no overlap": ({}, False),
    "dispatch_chunks=2": ({"dispatch_chunks": 2}, False),
    "shared expert": ({"shared_expert_hidden_size": FFN}, False),
    "micro-batch overlap": ({}, True),
}
# The pipeline part's cases: overlap_ep_comm under DualPipeV or not.
PIPELINE_CASES: dict[str, bool] = {"DualPipeV pp2": False, "DualPipeV pp2 + overlap_ep_comm": True}
# Measurement and the planner's prediction agree when their hidden shares differ by at most this.
AGREEMENT = 0.1


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _mean(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def _build(moe_options: dict, dims: object, num_layers: int, **parallel: object) -> torch.nn.Module:
    from lightning_moe import parallelize
    from lightning_moe.models import MoEGPT

    torch.manual_seed(0)
    moe = {"num_experts": EXPERTS, "top_k": TOP_K, "ffn_hidden_size": FFN, **moe_options}
    model = MoEGPT(hidden_size=HIDDEN, num_layers=num_layers, num_heads=HEADS, moe=moe, max_seq_len=SEQ)
    return parallelize(model, dims, data_parallel="none", sequence_parallel=False, **parallel)


def _micro_batches(rank: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(rank)
    return [torch.randint(0, 256, (SAMPLES, SEQ + 1), generator=generator) for _ in range(MICRO_BATCHES)]


def _training_step(model: torch.nn.Module, micro_batches: list[torch.Tensor], overlap: bool) -> None:
    """Forward and backward of every micro-batch, gradients accumulated (as Lightning's loop runs them)."""
    from lightning_moe.parallel.engines.accumulation import MicroBatchOverlap

    schedule = MicroBatchOverlap() if overlap else None
    for i, ids in enumerate(micro_batches):

        def step(ids: torch.Tensor = ids) -> torch.Tensor:
            return model.loss({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})

        if schedule is None:
            step().backward()
        else:
            loss = schedule.forward(step)
            schedule.backward(loss.backward, last=i == len(micro_batches) - 1)
    model.zero_grad(set_to_none=True)


def _expert_seconds(model: torch.nn.Module, reps: int = 5) -> float:
    """Forward+backward of this rank's experts, every MoE layer, on the rows they get in a step (even split)."""
    from lightning_moe.moe import MoELayer

    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    local_experts = EXPERTS // EP
    rows = (
        MICRO_BATCHES * SAMPLES * SEQ * TOP_K
    )  # a rank routes this many slots per layer; balanced, its experts get as many
    counts = torch.full((local_experts,), rows // local_experts, dtype=torch.int64)
    x = torch.randn(rows, HIDDEN, requires_grad=True, generator=torch.Generator().manual_seed(1))
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        for layer in layers:
            layer.experts(x, counts).sum().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _measure(
    steps: dict[str, Callable[[], None]], dims: object, expert_seconds: float, rounds: int
) -> tuple[dict, list[dict]]:
    """Set the ep link from the first case (ep comm time = ``expert_seconds``), then time every case
    with infinite bandwidth and under the link, round-robin; the medians, on every rank."""
    from lightning_moe.comm.link_simulator import LinkSimulator

    expert_seconds = _mean(expert_seconds)
    counter = LinkSimulator(ep=1e18)  # records the bytes, delays nothing measurable
    with counter.simulate(dims):
        next(iter(steps.values()))()
    ep_bytes = _mean(counter.stats["ep"]["bytes"])
    sim = LinkSimulator(ep=ep_bytes / expert_seconds)

    def timed(step: Callable[[], None]) -> float:
        dist.barrier()
        start = time.perf_counter()
        step()
        return _slowest(time.perf_counter() - start)

    samples: dict[str, dict[str, list[float]]] = {
        case: {"inf": [], "sim": [], "comm": [], "blocked": []} for case in steps
    }
    for round_ in range(rounds + 1):  # round 0 warms up
        for case, step in steps.items():
            inf = timed(step)
            with sim.simulate(dims):
                simulated = timed(step)
                comm, blocked = _mean(sim.stats["ep"]["seconds"]), _mean(sim.stats["ep"]["blocked"])
            if round_:
                for key, value in (("inf", inf), ("sim", simulated), ("comm", comm), ("blocked", blocked)):
                    samples[case][key].append(value)
    setting = {"expert_seconds": expert_seconds, "ep_bytes": ep_bytes, "bandwidth": ep_bytes / expert_seconds}
    rows = [
        {
            "overlap": case,
            "step s (inf bw)": statistics.median(values["inf"]),
            "step s (simulated)": statistics.median(values["sim"]),
            "ep comm s (simulated)": statistics.median(values["comm"]),
            "ep blocked s": statistics.median(values["blocked"]),
        }
        for case, values in samples.items()
    ]
    return setting, rows


def _layer_worker(rank: int, world: int, store_file: str, rounds: int, out: dict) -> None:
    """pp = 1, ep = 2: the :data:`CASES`."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    from lightning_moe import ParallelDims

    dims = ParallelDims(ep=EP)
    dims.build_mesh("cpu")
    micro_batches = _micro_batches(rank)
    models = {case: _build(moe_options, dims, LAYERS) for case, (moe_options, _) in CASES.items()}
    steps = {
        case: functools.partial(_training_step, models[case], micro_batches, overlap)
        for case, (_, overlap) in CASES.items()
    }
    setting, rows = _measure(steps, dims, _expert_seconds(models["no overlap"]), rounds)
    if rank == 0:
        out["setting"], out["rows"] = setting, rows
    dist.destroy_process_group()


def _pipeline_worker(rank: int, world: int, store_file: str, rounds: int, out: dict) -> None:
    """pp = 2 (DualPipeV, 2 stages of one layer per rank), ep = 2: without and with ``overlap_ep_comm``."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    from lightning_moe import ParallelDims
    from lightning_moe.models.causal_lm import next_token_loss
    from lightning_moe.parallel.engines.pipeline_runner import PipelineRunner
    from lightning_moe.parallel.plans.pipeline import pipeline_batch, pipeline_stage_modules

    dims = ParallelDims(pp=2, ep=EP)
    dims.build_mesh("cpu")
    model = _build({}, dims, 2 * LAYERS, pp_stages_per_rank=2, pp_schedule="DualPipeV")
    ids = torch.cat(_micro_batches(dims.ep_mesh.get_local_rank()))
    inputs, kwargs, target = pipeline_batch({"input_ids": ids[:, :-1], "labels": ids[:, 1:]}, MICRO_BATCHES)
    runners = {
        label: PipelineRunner(pipeline_stage_modules(model), num_stages=4, group=dims.pp_group, device=torch.device("cpu"),
                              schedule="DualPipeV", microbatches=MICRO_BATCHES, loss_fn=next_token_loss, overlap_ep_comm=overlap)
        for label, overlap in PIPELINE_CASES.items()
    }  # fmt: skip

    def step(runner: PipelineRunner) -> None:
        runner.step(inputs if runner.holds_first_stage else (), kwargs, target if runner.holds_last_stage else None)
        model.zero_grad(set_to_none=True)

    steps = {label: functools.partial(step, runner) for label, runner in runners.items()}
    setting, rows = _measure(steps, dims, _expert_seconds(model), rounds)
    if rank == 0:
        out["pipeline_setting"], out["pipeline_rows"] = setting, rows
    dist.destroy_process_group()


def run_ep_overlap_bench(rounds: int = 3) -> tuple[dict, list[dict], dict, list[dict]]:
    """``(setting, rows, pipeline setting, pipeline rows)``: per part, the chosen bandwidth and, per
    case, median step times and the fraction of the simulated ep comm time hidden."""
    with mp.Manager() as manager, tempfile.TemporaryDirectory() as tmp:
        out = manager.dict()
        mp.start_processes(_layer_worker, args=(EP, f"{tmp}/store", rounds, out), nprocs=EP, start_method="spawn")
        mp.start_processes(
            _pipeline_worker, args=(2 * EP, f"{tmp}/store_pp", rounds, out), nprocs=2 * EP, start_method="spawn"
        )
        parts = (dict(out["setting"]), [dict(r) for r in out["rows"]],
                 dict(out["pipeline_setting"]), [dict(r) for r in out["pipeline_rows"]])  # fmt: skip
    predicted = planner_hidden_fractions()
    for rows in (parts[1], parts[3]):
        for row in rows:
            exposed = row["step s (simulated)"] - row["step s (inf bw)"]
            row["fraction hidden"] = 1 - exposed / row["ep comm s (simulated)"]
            row["hidden (by blocking)"] = 1 - row["ep blocked s"] / row["ep comm s (simulated)"]
        baseline = rows[0]["hidden (by blocking)"]  # the part's case without overlap
        for row in rows:
            planner = predicted[row["overlap"]]
            row["gain by blocking"] = row["hidden (by blocking)"] - baseline
            row["planner"] = planner
            row[f"agree (blocking, {AGREEMENT})"] = (
                "yes" if abs(row["hidden (by blocking)"] - planner) <= AGREEMENT else "no"
            )
            row[f"agree (gain, {AGREEMENT})"] = "yes" if abs(row["gain by blocking"] - planner) <= AGREEMENT else "no"
    return parts


def planner_hidden(moe_options: dict, num_layers: int, **layout_options: object) -> float:
    """The planner's share of the step's ep comm time hidden, for the bench's model with ``moe_options``
    and ``num_layers`` layers, on ep2 with the bench's micro-batches (``layout_options``: the rest of
    the :class:`~lightning_moe.planner.Layout`), estimated as the bench measures: ``cpu_local``'s
    compute, collectives asynchronous as the link simulator runs them, no latency, routing balanced,
    and the ep bandwidth that makes the planner's ep comm time of a step equal to its expert compute
    time (forward and backward) of a step.

    Example::

        planner_hidden({"dispatch_chunks": 2}, 2)   # 0.5: the first dispatch and last combine stay exposed
    """
    from omegaconf import OmegaConf

    from experiments.bench.cli import ROOT
    from lightning_moe.planner import Cluster, Layout, ModelShape, comm_records, estimate
    from lightning_moe.planner.step_time import forward_seconds_by_kind, record_seconds

    cpu_local = Cluster.from_config(
        OmegaConf.to_container(OmegaConf.load(ROOT / "lightning_moe/conf/cluster/cpu_local.yaml"))
    )
    cluster = dataclasses.replace(cpu_local, fsdp_overlap=True, collective_latency=0.0, comm_efficiency=1.0)
    shape = ModelShape.from_config({
        "vocab_size": VOCAB, "hidden_size": HIDDEN, "num_layers": num_layers, "num_heads": HEADS,
        "moe": {"num_experts": EXPERTS, "top_k": TOP_K, "ffn_hidden_size": FFN, **moe_options},
    })  # fmt: skip
    layout = Layout(ep=EP, micro_batch_size=SAMPLES, microbatches=MICRO_BATCHES, **layout_options)  # type: ignore[arg-type]
    expert = 3 * forward_seconds_by_kind(shape, layout, cluster, SEQ, precision="32-true")["expert"] * MICRO_BATCHES
    ep_bytes = sum(r.bytes for r in comm_records(shape, layout, SEQ, "32-true") if r.dim == "ep")
    cluster = dataclasses.replace(
        cluster, intra_node_bandwidth=ep_bytes / expert, inter_node_bandwidth=ep_bytes / expert
    )
    est = estimate(shape, layout, cluster, SEQ, EP * MICRO_BATCHES * SAMPLES, precision="32-true", load_imbalance=1.0)
    ep_seconds = sum(record_seconds(r, layout, cluster) for r in est.records if r.dim == "ep")
    return sum(est.hidden_ep_comm_time.values()) / ep_seconds


def planner_hidden_fractions() -> dict[str, float]:
    """:func:`planner_hidden` of every case of both parts, by the case's name."""
    out = {case: planner_hidden(moe, LAYERS, gather_once_per_step=overlap, overlap_ep_comm=overlap)
           for case, (moe, overlap) in CASES.items()}  # fmt: skip
    for case, overlap in PIPELINE_CASES.items():
        out[case] = planner_hidden(
            {}, 2 * LAYERS, pp=2, pp_schedule="DualPipeV", pp_stages_per_rank=2, overlap_ep_comm=overlap
        )
    return out


def main() -> None:
    from experiments.bench.table import print_table

    setting, rows, pipeline_setting, pipeline_rows = run_ep_overlap_bench()
    print(
        f"EP comm hidden under the link simulator (ep={EP}, MoEGPT hidden {HIDDEN}, {EXPERTS} experts of ffn {FFN}, top-{TOP_K},"
        f" {MICRO_BATCHES} micro-batches of {SAMPLES}x{SEQ} tokens per rank and step, fp32, 1 thread/rank, median of 3)"
    )
    for title, part, table in ((f"pp=1, {LAYERS} layers, 2 processes", setting, rows),
                               (f"pp=2 DualPipeV, {2 * LAYERS} layers (2 per rank), 4 processes", pipeline_setting, pipeline_rows)):  # fmt: skip
        print(
            f"{title}: simulated ep link {part['bandwidth'] / 1e6:.1f} MB/s, latency 0 = {part['ep_bytes'] / 1e6:.2f} MB per rank"
            f" and step / {part['expert_seconds'] * 1e3:.0f} ms of expert GEMMs (fwd+bwd): ep comm time = expert compute time"
        )
        print_table(table)
    print(
        "planner: the share of the ep comm time planner.estimate hides for the same model, layout and option on cpu_local"
        " (asynchronous collectives, no latency, balanced routing) at the link the bench sets (its ep comm time = its"
        " expert compute time); gain by blocking: hidden (by blocking) less the part's no-overlap case (the waits on a"
        f" slower peer and on the FIFO link every case pays); agree: within {AGREEMENT}"
    )


if __name__ == "__main__":
    main()

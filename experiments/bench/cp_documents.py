"""Context parallelism over packed documents: ring attention's work against the ideal, and ring
against all-to-all (Ulysses) attention at cp = 4 under the link simulator.

Measured side by side in one run (figures, never timed assertions); one spawn of 4 gloo
processes (cp = 4, one thread each):

1. **Work vs ideal.** For mixes of document lengths (drawn log-uniform, the last one of a row cut
   to fit; :data:`MIXES`), ``document_plan(...)`` on every cp rank at the full size
   (``plan_seq`` tokens x ``plan_batch`` rows) gives the (query, key) pairs each rank computes and
   the visible ones (``DocumentPlan.computed_pairs`` / ``visible_pairs``, per head; attention FLOPs
   are ``4 x pairs x head_dim`` forward, the backward runs the same blocks), for ``document_tile``
   64 and 128. Summed over the ranks: *computed / visible* (1.0 is the ideal; the excess is the
   masked squares of packed short documents), *computed / causal* (the share of plain causal
   attention's ``S (S + 1) / 2`` pairs computed) and the per-rank balance (*work max/mean*). The
   visible total is checked against ``sum L (L + 1) / 2`` over the documents. The plans need no
   attention run; to confirm that the ring computes what its plan says, ring attention runs forward
   and backward at a smaller size (``check_seq``) under ``trace_ring_attention()`` and its
   ``AttentionTrace.pairs`` / ``visible_pairs`` of both phases are compared with the plan.
2. **Ring vs all-to-all.** One attention forward + backward (``[1, Hq, S / cp, D]`` per rank, fp32,
   zigzag shards; ``heads_kv`` K/V heads: grouped-query, then one per query head) with
   ``ring_attention`` and with Ulysses, plain causal and document-causal (one row of the second
   mix, ``document_tile`` 128). As the strategy's attention modes do, the
   document ids are gathered once outside the timed call (a :class:`DocumentPlan` for the ring,
   :class:`UlyssesAttentionMode`'s cached ids for all-to-all), so the cp bytes are attention
   traffic only. Bytes per rank charged to cp by the comm accounting (``count_collectives``) are
   set beside the planner's (``comm_records`` of a one-layer model of this shape at cp = 4:
   ``ulysses_attention_bytes`` for all-to-all, the ring record's ``2 (cp-1) 2 kv a + cp 2 kv 4``).
   Times: every case without link simulation and under ``LinkSimulator(cp=bandwidth)`` (latency
   0), round-robin, median of ``rounds``; a round's time is the slowest rank's. The bandwidth is
   set once, for both shapes, so that the all-to-all's simulated comm time equals the ring's
   causal time without a link at the first shape (``bandwidth = planner all-to-all bytes / that
   time``): communication as costly as the attention itself.

   Predicted a2a/ring time ratio, by the planner's rules (``lightning_moe.planner.step_time``):
   comm seconds = ``record_seconds(record, Layout(cp=4), cluster)`` with the simulated bandwidth
   (``comm_efficiency`` 1, no latency, no ring-step overhead); all-to-all comm is exposed, ring comm
   hidden by the planner's own rule (``overlapped_hidden_seconds``, what ``estimate`` hides on a
   backend with asynchronous P2P, as the simulator models it), each hidden second slowing the
   compute by ``cpu_local``'s ``overlap_slowdown``. *measured compute*: each method's time without a link as its
   compute; *planner compute*: the planner's own attention FLOPs (causal ``S^2 / 2`` for both
   methods, documents or not) at ``cpu_local``'s peak and attention efficiency.

A model, not a measurement of real links (docs/link-simulator.md): 4 processes share 2 cores,
so a rank sleeping on the simulated link frees a core for the others.

    python -m experiments.bench.cp_documents            # about 1.5 minutes on 2 CPU cores
    python -m experiments.bench.cp_documents --smoke    # tiny sizes: checks the script in seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from experiments.bench.cli import ROOT
from experiments.bench.table import print_table

CP = 4
TILES = (64, 128)
TIMED_TILE = 128  # the ring's default document_tile
SHORT = 16  # tokens of the short documents of the second mix
# (label, shortest, longest, fraction of documents SHORT tokens long): log-uniform lengths.
MIXES: tuple[tuple[str, int, int, float], ...] = (
    ("64-2048", 64, 2048, 0.0),
    (f"64-2048, 1/3 of docs {SHORT} tok", 64, 2048, 1 / 3),
    ("16-256 (short)", 16, 256, 0.0),
)
TIMED_MIX = 1  # the mix of the timed document-causal attention
# heads_kv: the timed shapes' K/V heads (grouped-query, then one per query head); one link for both.
FULL = dict(
    plan_seq=8192,
    plan_batch=4,
    check_seq=1024,
    check_batch=2,
    check_heads=2,
    check_dim=16,
    seq=4096,
    heads_q=8,
    heads_kv=(2, 8),
    head_dim=64,
    rounds=5,
)
SMOKE = dict(
    plan_seq=1024,
    plan_batch=2,
    check_seq=256,
    check_batch=2,
    check_heads=2,
    check_dim=8,
    seq=256,
    heads_q=4,
    heads_kv=(2, 4),
    head_dim=16,
    rounds=1,
)
CASES = (("ring", False), ("a2a", False), ("ring", True), ("a2a", True))  # (method, documents)


# --- documents ------------------------------------------------------------------------------------


def document_lengths(seq: int, lo: int, hi: int, short_fraction: float, seed: int) -> list[int]:
    """Lengths of the documents packed into one row of ``seq`` tokens: log-uniform in ``[lo, hi]``
    (a ``short_fraction`` of them :data:`SHORT` tokens instead), the last one cut to fit."""
    rng = random.Random(seed)
    lengths: list[int] = []
    total = 0
    while total < seq:
        if rng.random() < short_fraction:
            length = SHORT
        else:
            length = int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
        length = min(length, seq - total)
        lengths.append(length)
        total += length
    return lengths


def document_ids(rows: list[list[int]]) -> torch.Tensor:
    """``[len(rows), seq]`` int64 ids, documents numbered from 0 along each row."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows])


def mix_rows(mix: int, seq: int, batch: int, seed: int = 0) -> list[list[int]]:
    _, lo, hi, short = MIXES[mix]
    return [document_lengths(seq, lo, hi, short, seed=1000 * seed + 100 * mix + row) for row in range(batch)]


# --- the worker -----------------------------------------------------------------------------------


def _gather(value: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _plan_counts(group: dist.ProcessGroup, sizes: dict) -> list[dict]:
    """Per (mix, tile): every rank's computed and visible pairs per head from its document plan."""
    from lightning_moe.cp import zigzag_shard
    from lightning_moe.cp.ring_attention import document_plan

    rank = dist.get_rank(group)
    results = []
    for mix in range(len(MIXES)):
        rows = mix_rows(mix, sizes["plan_seq"], sizes["plan_batch"])
        local = zigzag_shard(document_ids(rows), rank, CP, dim=1)
        for tile in TILES:
            plan = document_plan(local, group, document_tile=tile)
            per_rank = _gather((plan.computed_pairs, plan.visible_pairs))
            results.append(
                {
                    "mix": mix,
                    "tile": tile,
                    "rows": rows,
                    "computed": [c for c, _ in per_rank],
                    "visible": [v for _, v in per_rank],
                }
            )
    return results


def _fresh(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_() for t in tensors]


def _trace_checks(group: dist.ProcessGroup, sizes: dict) -> list[dict]:
    """Ring attention forward + backward under the trace, at the check size, against its plan."""
    from lightning_moe.cp import ring_attention, trace_ring_attention, zigzag_shard
    from lightning_moe.cp.ring_attention import document_plan

    rank = dist.get_rank(group)
    batch, heads, dim = sizes["check_batch"], sizes["check_heads"], sizes["check_dim"]
    seq_local = sizes["check_seq"] // CP
    generator = torch.Generator().manual_seed(rank)
    q, k, v, grad = (torch.randn(batch, heads, seq_local, dim, generator=generator) for _ in range(4))
    results = []
    for mix in range(len(MIXES)):
        local = zigzag_shard(document_ids(mix_rows(mix, sizes["check_seq"], batch, seed=1)), rank, CP, dim=1)
        for tile in TILES:
            plan = document_plan(local, group, document_tile=tile)
            qq, kk, vv = _fresh(q, k, v)
            with trace_ring_attention() as trace:  # the ring plans from the ids itself
                ring_attention(qq, kk, vv, group, document_ids=local, document_tile=tile).backward(grad)
            counts = {
                f"{what} {phase}": getattr(trace, what)(phase)
                for what in ("pairs", "visible_pairs")
                for phase in ("forward", "backward")
            }
            matches = all(counts[f"pairs {p}"] == plan.computed_pairs * heads for p in ("forward", "backward")) and all(
                counts[f"visible_pairs {p}"] == plan.visible_pairs * heads for p in ("forward", "backward")
            )
            per_rank = _gather((counts, matches))
            results.append(
                {"mix": mix, "tile": tile, "counts": [c for c, _ in per_rank], "matches": all(m for _, m in per_rank)}
            )
    return results


def _max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _mean(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def _timing(group: dist.ProcessGroup, sizes: dict, hkv: int, bandwidth: float | None) -> dict:
    """Ring and all-to-all attention with ``hkv`` K/V heads, causal and document-causal, without and
    under a simulated cp link of ``bandwidth`` (None: set from the first case): bytes, times,
    simulated link time, and the difference of their results."""
    from lightning_moe import comm
    from lightning_moe.callbacks.comm_accounting import count_collectives
    from lightning_moe.comm.link_simulator import LinkSimulator
    from lightning_moe.comm.traffic import GroupDims
    from lightning_moe.cp import ring_attention, trace_ring_attention, ulysses_attention, zigzag_shard
    from lightning_moe.cp.ring_attention import document_plan
    from lightning_moe.cp.ulysses import UlyssesAttentionMode

    rank = dist.get_rank(group)
    seq, hq, dim = sizes["seq"], sizes["heads_q"], sizes["head_dim"]
    generator = torch.Generator().manual_seed(10 + rank)
    q0 = torch.randn(1, hq, seq // CP, dim, generator=generator)
    k0, v0 = (torch.randn(1, hkv, seq // CP, dim, generator=generator) for _ in range(2))
    grad = torch.randn(1, hq, seq // CP, dim, generator=generator)
    rows = mix_rows(TIMED_MIX, seq, 1, seed=2)
    local_ids = zigzag_shard(document_ids(rows), rank, CP, dim=1)
    plan = document_plan(local_ids, group, document_tile=TIMED_TILE)  # gathered once, as RingAttentionMode does
    mode = UlyssesAttentionMode(group, "zigzag", local_ids)  # gathers at its first call, then reuses the ids
    groups = GroupDims(by_ranks={frozenset(range(CP)): ("cp",)})

    def step(method: str, documents: bool) -> list[torch.Tensor]:
        q, k, v = _fresh(q0, k0, v0)
        if method == "ring":
            out = ring_attention(q, k, v, group, document_ids=plan if documents else None)
        elif documents:
            with mode:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            out = ulysses_attention(q, k, v, group, enable_gqa=True)
        out.backward(grad)
        return [out.detach(), q.grad, k.grad, v.grad]

    # Warm-up: every case once; the ring's trace of the document case against its plan; ring vs a2a.
    results = {case: step(*case) for case in CASES if case != ("ring", True)}
    with trace_ring_attention() as trace:
        results[("ring", True)] = step("ring", True)
    trace_matches = trace.pairs("forward") == trace.pairs("backward") == plan.computed_pairs * hq and (
        trace.visible_pairs("forward") == trace.visible_pairs("backward") == plan.visible_pairs * hq
    )
    difference = {
        documents: _max(
            max(float((r - a).abs().max()) for r, a in zip(results[("ring", documents)], results[("a2a", documents)]))
        )
        for documents in (False, True)
    }
    del results

    samples = {case: {"inf": [], "sim": [], "comm": [], "blocked": [], "sim_bytes": []} for case in CASES}
    counted: dict[tuple[str, bool], dict] = {}
    sim = None if bandwidth is None else LinkSimulator(cp=bandwidth)
    for round_ in range(sizes["rounds"]):
        for case in CASES:
            dist.barrier()
            if round_ == 0:  # bytes charged to cp, counted once per case
                comm.reset()
                with count_collectives(groups):
                    start = time.perf_counter()
                    step(*case)
                    elapsed = time.perf_counter() - start
                counted[case] = comm.snapshot().get("cp", {"bytes": 0, "calls": 0})
            else:
                start = time.perf_counter()
                step(*case)
                elapsed = time.perf_counter() - start
            samples[case]["inf"].append(_max(elapsed))
            if sim is None:  # the first case is the causal ring: the a2a's comm time is set equal to it
                bandwidth = sizes["a2a_bytes"] / samples[case]["inf"][0]
                sim = LinkSimulator(cp=bandwidth)
            dist.barrier()
            with sim.simulate(groups=groups):
                start = time.perf_counter()
                step(*case)
                elapsed = time.perf_counter() - start
            stats = dict(sim.stats.get("cp", {"seconds": 0.0, "blocked": 0.0, "bytes": 0}))
            samples[case]["sim"].append(_max(elapsed))
            samples[case]["comm"].append(_mean(stats["seconds"]))
            samples[case]["blocked"].append(_mean(stats["blocked"]))
            samples[case]["sim_bytes"].append(stats["bytes"])
    bytes_per_rank = {case: _gather(counted[case]) for case in CASES}
    sim_bytes = {case: _gather(samples[case]["sim_bytes"][0]) for case in CASES}
    return {
        "heads_kv": hkv,
        "bandwidth": bandwidth,
        "rows": rows,
        "trace_matches": _max(float(not trace_matches)) == 0.0,
        "visible": _gather(plan.visible_pairs),
        "computed": _gather(plan.computed_pairs),
        "difference": difference,
        "cases": {
            case: {
                "inf": statistics.median(s["inf"]),
                "sim": statistics.median(s["sim"]),
                "comm": statistics.median(s["comm"]),
                "blocked": statistics.median(s["blocked"]),
                "counted": bytes_per_rank[case],
                "sim_bytes": sim_bytes[case],
            }
            for case, s in samples.items()
        },
    }


def _worker(rank: int, store: str, sizes: dict, out: dict) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=CP)
    group = dist.new_group(list(range(CP)))
    started = time.perf_counter()
    plans = _plan_counts(group, sizes)
    checks = _trace_checks(group, sizes)
    part1 = time.perf_counter() - started
    timing = []
    bandwidth = None
    for hkv in sizes["heads_kv"]:
        timing.append(_timing(group, sizes, hkv, bandwidth))
        bandwidth = timing[0]["bandwidth"]
    if rank == 0:
        out["plans"], out["checks"], out["timing"] = plans, checks, timing
        out["seconds"] = {"work": part1, "timing": time.perf_counter() - started - part1}
    dist.destroy_process_group()


# --- the planner's figures ------------------------------------------------------------------------


def planner_records(sizes: dict, hkv: int) -> dict[str, Any]:
    """The planner's cp record of one attention call at cp = 4 with ``hkv`` K/V heads for ``ring`` and
    ``a2a`` (fp32), and its forward attention FLOPs per rank."""
    from lightning_moe.planner.candidate import Layout
    from lightning_moe.planner.comm import comm_records
    from lightning_moe.planner.comm.cp import ulysses_attention_bytes
    from lightning_moe.planner.flops import flops_per_microbatch
    from lightning_moe.planner.model_shape import ModelShape

    hq, dim, seq = sizes["heads_q"], sizes["head_dim"], sizes["seq"]
    shape = ModelShape(hidden_size=hq * dim, num_layers=1, num_heads=hq, num_kv_heads=hkv)
    out: dict[str, Any] = {}
    for method in ("ring", "a2a"):
        layout = Layout(cp=CP, cp_comm=method)
        prefix = "ring attention" if method == "ring" else "all-to-all attention"
        out[method] = next(r for r in comm_records(shape, layout, seq, "32-true") if r.what.startswith(prefix))
        out[f"{method} layout"] = layout
    assert out["a2a"].bytes == ulysses_attention_bytes(1, hq, hkv, seq, dim, CP, 4)
    out["attention_flops"] = flops_per_microbatch(shape, out["ring layout"], seq, [0], last=False)["attention"]
    return out


def _cpu_local() -> Any:
    from omegaconf import OmegaConf

    from lightning_moe.planner.cluster import Cluster

    return Cluster.from_config(
        OmegaConf.to_container(OmegaConf.load(ROOT / "lightning_moe/conf/cluster/cpu_local.yaml"))
    )


def predicted_ratio(records: dict[str, Any], bandwidth: float | None, compute: dict[str, float]) -> float:
    """a2a/ring time by the planner's rules: ``compute + comm - hidden + overlap_slowdown x hidden``;
    a2a's comm exposed in full (the planner overlaps none of it), the ring's shifts hidden as the
    planner hides them in a step (``overlapped_hidden_seconds``: one call's forward and backward as
    the step's compute, its backward the last); comm seconds from ``record_seconds`` at ``bandwidth``
    (None: infinite)."""
    from lightning_moe.planner.flops import RECOMPUTE_FORWARDS
    from lightning_moe.planner.step_time import overlapped_hidden_seconds, record_seconds

    cluster = dataclasses.replace(_cpu_local(), comm_efficiency=1.0, collective_latency=0.0, ring_step_overhead=0.0)
    if bandwidth is not None:
        cluster = dataclasses.replace(cluster, intra_node_bandwidth=bandwidth, inter_node_bandwidth=bandwidth)

    def comm_seconds(method: str) -> float:
        return 0.0 if bandwidth is None else record_seconds(records[method], records[f"{method} layout"], cluster)

    passes = 3.0 + RECOMPUTE_FORWARDS["none"]  # a forward and a backward of twice its FLOPs
    ring_comm = comm_seconds("ring")
    hidden = overlapped_hidden_seconds(
        records["ring layout"], compute["ring"], compute["ring"] * (passes - 1) / passes, 0.0, ring_comm, 0.0
    )
    ring = compute["ring"] + ring_comm - hidden + cluster.overlap_slowdown * hidden
    return (compute["a2a"] + comm_seconds("a2a")) / ring


# --- the run ----------------------------------------------------------------------------------------


def _work_rows(plans: list[dict], seq: int) -> list[dict]:
    rows = []
    for p in plans:
        computed, visible = sum(p["computed"]), sum(p["visible"])
        ideal = sum(length * (length + 1) // 2 for row in p["rows"] for length in row)
        causal = len(p["rows"]) * seq * (seq + 1) // 2
        ratio = computed / visible
        rows.append(
            {
                "mix (log-uniform tokens)": MIXES[p["mix"]][0],
                "docs/row": sum(len(r) for r in p["rows"]) / len(p["rows"]),
                "tile": p["tile"],
                "computed / visible": ratio,
                "within 5%": "yes" if ratio <= 1.05 else "no",
                "computed / causal": computed / causal,
                "visible / causal": visible / causal,
                "work max/mean": max(p["computed"]) / (computed / len(p["computed"])),
                "visible = ideal": "yes" if visible == ideal else f"NO ({visible} != {ideal})",
            }
        )
    return rows


def _check_rows(checks: list[dict]) -> list[dict]:
    rows = []
    for c in checks:
        total = {key: sum(counts[key] for counts in c["counts"]) for key in c["counts"][0]}
        rows.append(
            {
                "mix (log-uniform tokens)": MIXES[c["mix"]][0],
                "tile": c["tile"],
                "fwd computed / visible": total["pairs forward"] / total["visible_pairs forward"],
                "bwd computed / visible": total["pairs backward"] / total["visible_pairs backward"],
                "trace = plan (fwd, bwd, all ranks)": "yes" if c["matches"] else "NO",
            }
        )
    return rows


def run(smoke: bool = False) -> dict[str, Any]:
    """Every measurement, printed as tables; returns them (``smoke``: tiny sizes, seconds)."""
    sizes = dict(SMOKE if smoke else FULL)
    records = {hkv: planner_records(sizes, hkv) for hkv in sizes["heads_kv"]}
    sizes["a2a_bytes"] = records[sizes["heads_kv"][0]]["a2a"].bytes  # sets the link
    started = time.perf_counter()
    with mp.Manager() as manager, tempfile.TemporaryDirectory() as tmp:
        out = manager.dict()
        mp.start_processes(_worker, args=(f"{tmp}/store", sizes, out), nprocs=CP, start_method="spawn")
        plans, checks, timings, seconds = out["plans"], out["checks"], list(out["timing"]), dict(out["seconds"])
    seconds["total"] = time.perf_counter() - started

    work = _work_rows(plans, sizes["plan_seq"])
    print(
        f"Document-masked ring attention at cp={CP} (zigzag): (query, key) pairs computed vs visible, summed over the"
        f" ranks' document plans ({sizes['plan_batch']} rows x {sizes['plan_seq']} tokens per mix, lengths log-uniform,"
        " last document of a row cut to fit; FLOPs = 4 x pairs x head_dim; the backward runs the same blocks)"
    )
    print_table(work)
    print(
        "computed / visible: 1.0 is the ideal (every visible pair once, nothing else); the excess is the masked squares"
        " of packed short documents. computed / causal: the share of plain causal attention's pairs computed."
        " work max/mean: the busiest rank's pairs over the mean."
    )
    print()
    check = _check_rows(checks)
    print(
        f"Ring attention run forward + backward under trace_ring_attention() ({sizes['check_batch']} rows x"
        f" {sizes['check_seq']} tokens, {sizes['check_heads']} heads, head_dim {sizes['check_dim']}): the trace"
        " against document_plan on every rank"
    )
    print_table(check)
    print()

    shape = f"[1, {sizes['heads_q']}, {sizes['seq']}/{CP}, {sizes['head_dim']}] q, fp32, zigzag"
    byte_rows = []
    for timing in timings:
        hkv = timing["heads_kv"]
        for method, documents in CASES:
            case = timing["cases"][(method, documents)]
            counted = case["counted"]
            measured = statistics.mean(c["bytes"] for c in counted)
            planned = records[hkv][method].bytes
            byte_rows.append(
                {
                    "K/V heads": hkv,
                    "attention": "ring" if method == "ring" else "all-to-all",
                    "mask": "documents" if documents else "causal",
                    "cp calls": statistics.mean(c["calls"] for c in counted),
                    "planner calls": records[hkv][method].calls,
                    "cp MB/rank (accounting)": measured / 1e6,
                    "planner MB/rank": planned / 1e6,
                    "measured / planner": measured / planned,
                    "ranks equal": "yes" if len({c["bytes"] for c in counted}) == 1 else "no",
                    "link simulator MB/rank": statistics.mean(case["sim_bytes"]) / 1e6,
                }
            )
    print(f"CP bytes per rank of one attention forward+backward at cp={CP} ({shape}): comm accounting vs planner")
    print_table(byte_rows)
    print(
        "cp bytes: what count_collectives charged to cp (the ring's P2P sends, the all-to-alls); planner:"
        " comm_records' cp record (ring: 2(cp-1) x 2 x K/V block x 4 B + cp x 2 x K/V block x 4 B (fp32 dK/dV);"
        " a2a: ulysses_attention_bytes, K/V heads repeated up to a multiple of cp). Document ids gathered before the"
        " call (as the strategy's modes do once per micro-batch), so not in these bytes."
    )
    print()

    cluster = _cpu_local()
    slowdown = max(1.0, CP / (cluster.concurrent_ranks or CP))
    rate = cluster.peak_flops * cluster.attention_efficiency
    time_rows = []
    for timing in timings:
        hkv, bandwidth = timing["heads_kv"], timing["bandwidth"]
        planner_compute = dict.fromkeys(("ring", "a2a"), 3 * records[hkv]["attention_flops"] / rate * slowdown)
        for documents in (False, True):
            ring, a2a = timing["cases"][("ring", documents)], timing["cases"][("a2a", documents)]
            measured_compute = {"ring": ring["inf"], "a2a": a2a["inf"]}
            for key, bw in (("inf", None), ("sim", bandwidth)):
                time_rows.append(
                    {
                        "K/V heads": hkv,
                        "mask": "documents" if documents else "causal",
                        "cp link": "none" if bw is None else f"{bw / 1e6:.1f} MB/s",
                        "ring s": ring[key],
                        "a2a s": a2a[key],
                        "a2a / ring": a2a[key] / ring[key],
                        "predicted (measured compute)": predicted_ratio(records[hkv], bw, measured_compute)
                        if bw
                        else "-",
                        "predicted (planner compute)": predicted_ratio(records[hkv], bw, planner_compute),
                        "ring sim comm s": ring["comm"] if bw else "-",
                        "a2a sim comm s": a2a["comm"] if bw else "-",
                        "ring comm hidden": 1 - (ring["sim"] - ring["inf"]) / ring["comm"] if bw else "-",
                    }
                )
    first = timings[0]
    visible, computed = sum(first["visible"]), sum(first["computed"])
    causal = sizes["seq"] * (sizes["seq"] + 1) // 2
    print(
        f"Ring vs all-to-all attention at cp={CP}, one forward+backward ({shape}), {CP} gloo processes of 1 thread on"
        f" the shared cores, median of {sizes['rounds']} round-robin rounds, slowest rank"
    )
    print_table(time_rows)
    print(
        f"cp link: LinkSimulator(cp=...), latency 0, one for both shapes, set so that the all-to-all's simulated comm"
        f" time equals the ring's causal time without a link at {sizes['heads_kv'][0]} K/V heads"
        f" ({sizes['a2a_bytes'] / 1e6:.2f} MB / {sizes['a2a_bytes'] / first['bandwidth']:.3f} s, first round)."
        f" documents: one row of mix '{MIXES[TIMED_MIX][0]}' ({len(first['rows'][0])} docs, tile {TIMED_TILE}): the"
        f" ring computes {computed / causal:.3f} of causal attention's pairs ({computed / visible:.3f} of the visible"
        " ones); all-to-all on CPU runs SDPA with a dense [S, S] boolean mask, every pair. ring comm hidden:"
        " 1 - (time under the link - time without) / simulated ring comm time."
    )
    print(
        "predicted: the planner's rules, compute + exposed comm, comm = record_seconds(cp record) at the link's"
        " bandwidth; a2a exposed in full, ring hidden by the planner's overlapped_hidden_seconds. measured compute: each method's time"
        " without a link; planner compute: causal attention FLOPs (no document sparsity) at cpu_local's"
        f" {cluster.peak_flops / 1e9:.0f} GFLOP/s x {cluster.attention_efficiency} with {CP} ranks on"
        f" {cluster.concurrent_ranks} cores, the same for both methods"
        f" ({3 * records[sizes['heads_kv'][0]]['attention_flops'] / rate * slowdown:.3f} s)."
    )
    for timing in timings:
        print(
            f"{timing['heads_kv']} K/V heads: ring = a2a (max |difference| of output and gradients): causal"
            f" {timing['difference'][False]:.1e}, documents {timing['difference'][True]:.1e}; the ring's trace"
            f" equals its plan at this size: {'yes' if timing['trace_matches'] else 'NO'}"
        )
    print(f"(work part {seconds['work']:.1f} s, timing part {seconds['timing']:.1f} s, bench {seconds['total']:.1f} s)")
    return {
        "work": work,
        "checks": check,
        "bytes": byte_rows,
        "times": time_rows,
        "timings": timings,
        "seconds": seconds,
    }


def main(smoke: bool = False) -> None:
    run(smoke=smoke)


def _cli(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks the script in seconds")
    args = parser.parse_args(argv)
    main(smoke=args.smoke)


if __name__ == "__main__":
    _cli()

"""Does the cost model rank CPU layouts like the measured step times? ``python -m experiments.bench.plan_check``.

``--anchors`` instead plans the published runs (:data:`ANCHORS`, as ``python -m lightning_moe.plan``
with the same overrides) and prints each first choice's estimate as a range beside the published
figure: no overlap, the modelled overlap, perfect overlap. Pure planner, about a minute.

Trains a small MoEGPT for a few steps under six 2-process layouts (dp2, tp2, tp2 with etp=1, cp2,
ep2, pp2) with ``python -m lightning_moe.train``, reads each run's tokens/s (steps after the first),
and compares the step times with :func:`lightning_moe.planner.estimate` on the
``cpu_local`` cluster preset: Spearman rank correlation of the estimated vs measured step times
(the issue asks for >= 0.7). Each layout runs ``REPEATS`` times, round-robin, and keeps its
fastest run: on a shared machine other jobs' load changes a run's time by up to 3x. Takes about
``REPEATS`` x 3 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from experiments.bench.cli import ROOT, run_training
from lightning_moe.planner import Cluster, Layout, ModelShape, estimate

MODEL = {"vocab_size": 256, "hidden_size": 128, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 256,
         "moe": {"num_experts": 8, "top_k": 2, "ffn_hidden_size": 256}}  # fmt: skip
SEQ, GLOBAL_BATCH, MICRO_BATCH, STEPS = 256, 16, 4, 6
REPEATS = int(os.environ.get("PLAN_CHECK_REPEATS", "2"))
LAYOUTS = {  # name: (CLI overrides, planner layout)
    "dp2": (["parallel=dp2"], dict(dp=2)),
    "tp2": (["parallel=tp2"], dict(tp=2, etp=2)),
    "tp2 etp1": (["parallel=tp2", "parallel.etp=1"], dict(tp=2, etp=1)),
    "cp2": (["parallel=cp2"], dict(cp=2)),
    "ep2": (["parallel=ep2"], dict(ep=2)),
    "pp2": (["parallel=pp2"], dict(pp=2)),
}


# Published runs: (name, published figure, unit, plan overrides). The unit "MFU" compares MFU; "TFLOP/s"
# compares model FLOP/s per GPU (MFU x the bf16 peak, both counting full attention).
ANCHORS = [
    ("Mixtral-8x22B, 1024 H100, bf16 (MoE Parallel Folding, arXiv 2504.14960)", 0.493, "MFU",
     ["model=mixtral_8x22b", "cluster=h100_sxm", "world_size=1024", "data.global_batch_size=1024"]),
    ("DeepSeek-V3, 1024 H100, FP8 (Megatron-Bridge performance summary)", 338e12, "TFLOP/s",
     ["model=deepseek_v3", "cluster=h100_sxm", "world_size=1024", "data.global_batch_size=8192", "fp8_gemms=true",
      "model.moe.dispatcher=hierarchical", "model.moe.max_nodes_per_token=4", "model.moe.dispatch_dtype=fp8"]),
    ("DeepSeek-V3, flat all-to-all (no per-node dispatch)", 338e12, "TFLOP/s",
     ["model=deepseek_v3", "cluster=h100_sxm", "world_size=1024", "data.global_batch_size=8192", "fp8_gemms=true",
      "model.moe.max_nodes_per_token=4", "model.moe.dispatch_dtype=fp8"]),
    ("DeepSeek-V3 with its MTP depth (as published)", 338e12, "TFLOP/s",
     ["model=deepseek_v3", "cluster=h100_sxm", "world_size=1024", "data.global_batch_size=8192", "fp8_gemms=true",
      "model.moe.dispatcher=hierarchical", "model.moe.max_nodes_per_token=4", "model.moe.dispatch_dtype=fp8",
      "model.mtp_depth=1"]),
]  # fmt: skip


def anchors() -> None:
    """Print each published run's figure beside the planner's first choice, as a range."""
    from lightning_moe.conf import CONF_DIR
    from lightning_moe.plan import run_plan

    print("| run | published | estimate: modelled (no overlap – perfect overlap) | first choice |\n|---|---|---|---|")
    for name, published, unit, overrides in ANCHORS:
        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            cfg = compose("plan", overrides=overrides)
        with contextlib.redirect_stdout(io.StringIO()):
            out = run_plan(cfg, None, dict(o.split("=", 1) for o in overrides if o.startswith(("model=", "cluster="))))
        best = out["layouts"][0]
        scale = 1.0 if unit == "MFU" else cfg.cluster.peak_flops
        figures = [best["mfu_bounds"][k] * scale for k in ("modelled", "no_overlap", "perfect_overlap")]
        show = (lambda x: f"{x:.1%}") if unit == "MFU" else (lambda x: f"{x / 1e12:.0f}")
        print(
            f"| {name} | {show(published)} {unit} | {show(figures[0])} ({show(figures[1])} – {show(figures[2])}) | {best['label']} |"
        )


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rho: Pearson correlation of the ranks, tied values sharing their mean rank.

    Example: ``spearman([1, 2, 3], [1, 3, 2]) == 0.5``.
    """

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        start = 0
        while start < len(order):
            end = start
            while end + 1 < len(order) and math.isclose(values[order[end + 1]], values[order[start]], rel_tol=1e-9):
                end += 1
            for k in range(start, end + 1):
                out[order[k]] = (start + end) / 2
            start = end + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def measure(name: str, overrides: list[str], out: Path) -> float:
    """Seconds per optimizer step of one layout (tokens/s over the steps after the first)."""
    run_dir = out / name.replace(" ", "_")
    model = [f"model.{k}={v}" for k, v in MODEL.items() if k != "moe"] + [
        f"model.moe.{k}={v}" for k, v in MODEL["moe"].items()
    ]
    run_training(["logger=none", f"trainer.max_steps={STEPS}", "trainer.val_check_interval=null",
                  "trainer.limit_val_batches=0", f"data.seq_len={SEQ}", f"data.global_batch_size={GLOBAL_BATCH}",
                  f"data.micro_batch_size={MICRO_BATCH}", "data.max_corpus_bytes=400000", "~callbacks.progress_bar",
                  "~callbacks.expert_load_plots", *model, *overrides], run_dir, env={"WANDB_MODE": "offline"}, timeout=1200)  # fmt: skip
    summary = json.loads((run_dir / "summary.json").read_text())
    return GLOBAL_BATCH * SEQ / summary["tokens_per_second"]


def main() -> None:
    cluster = Cluster.from_config(
        OmegaConf.to_container(OmegaConf.load(ROOT / "lightning_moe/conf/cluster/cpu_local.yaml"))
    )
    shape = ModelShape.from_config(MODEL)
    estimates = {}
    for name, (_, sizes) in LAYOUTS.items():
        lay = Layout(**sizes)
        per_rank = GLOBAL_BATCH // (lay.dp * lay.ep)
        lay = Layout(**{**sizes, "micro_batch_size": MICRO_BATCH, "microbatches": per_rank // MICRO_BATCH,
                        "pp_microbatches": lay.pp if lay.pp > 1 else 0})  # fmt: skip
        estimates[name] = estimate(shape, lay, cluster, SEQ, GLOBAL_BATCH, precision="32-true").step_time
    measured: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(REPEATS):
            for name, (overrides, _) in LAYOUTS.items():
                measured[name].append(measure(name, overrides, Path(tmp) / str(repeat)))
    rows = [(name, estimates[name], min(measured[name])) for name in LAYOUTS]
    print("| layout | estimated s/step | measured s/step | estimated / measured |\n|---|---|---|---|")
    for name, est, meas in rows:
        print(f"| {name} | {est:.3f} | {meas:.3f} | {est / meas:.2f} |")
    rho = spearman([r[1] for r in rows], [r[2] for r in rows])
    print(f"\nSpearman rank correlation, estimated vs measured step time over {len(rows)} layouts: {rho:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--anchors", action="store_true", help="plan the published runs instead of timing CPU layouts")
    if parser.parse_args().anchors:
        anchors()
    else:
        main()

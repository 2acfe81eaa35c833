"""Calibration: a cluster preset's efficiency constants measured by ``make bench-gpu``.

``experiments/bench/gpu.py`` writes a JSON of the machine's figures; this command derives from it
the constants the cost model otherwise assumes and writes them, each with its source, into
``conf/cluster/<cluster>_calibrated.yaml`` beside the preset (the preset itself, with its datasheet
sources and assumptions, is left as it is; rerunning replaces the calibrated file atomically):

    python -m lightning_moe.planner.calibrate bench_gpu.json --cluster h200_sxm
    python -m lightning_moe.plan cluster=h200_sxm_calibrated model=mixtral_8x7b world_size=256

What the JSON gives (:func:`derive_constants`), over the preset's dense bf16 ``peak_flops``:

- ``gemm_efficiency``: ``dense_gemm``'s large bf16 GEMM, its TFLOP/s;
- ``grouped_gemm_efficiency``: ``moe_layer``'s expert-GEMM TFLOP/s of the MoE layer's forward and
  backward (router, permutation and combine inside the time), the median over its shapes;
- ``attention_efficiency``: ``ring_attention``'s SDPA (the flash kernel a cp = 1 layer runs) causal
  forward and backward, recounted with the planner's backward of 2 forwards (the bench counts 2.5:
  the flash backward recomputes the scores).

Refused, naming the fix, before anything is written: a JSON of another device than the preset's
``device_name`` (H100 figures for an H200 preset), a smoke or CPU run, one that records errors or
lacks a section, and a derived efficiency outside (0, 1].
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from lightning_moe.planner.cluster import Cluster

__all__ = ["CALIBRATED_SUFFIX", "REQUIRED_SECTIONS", "Measurement", "bench_problems", "calibrate", "calibrated_text",
           "derive_constants", "main"]  # fmt: skip

CLUSTER_DIR = Path(__file__).resolve().parents[1] / "conf" / "cluster"
CALIBRATED_SUFFIX = "_calibrated"
# The sections of experiments/bench/gpu.py's JSON the constants come from.
REQUIRED_SECTIONS: tuple[str, ...] = ("dense_gemm", "moe_layer", "ring_attention")
# Forward + backward of the attention core in forwards: the bench's count (flash recomputes the scores
# in backward: 2.5 forwards) and the planner's (backward 2 forwards, as every op kind).
BENCH_ATTENTION_PASSES = 3.5
PLANNER_ATTENTION_PASSES = 3.0
RERUN = "rerun `make bench-gpu` (ARGS='--only dense_gemm,moe_layer,ring_attention' for these sections alone)"


@dataclass(frozen=True)
class Measurement:
    """One constant derived from the bench: its value and how (the figures it divides).

    Example::

        Measurement("gemm_efficiency", 0.79, "dense_gemm 8192^3 bf16: 781.6 TFLOP/s / peak 989.4")
    """

    constant: str
    value: float
    how: str


def read_bench(path: Path) -> dict[str, Any]:
    """The JSON ``experiments/bench/gpu.py`` wrote; ``ValueError`` naming the fix if it is not one."""
    if not path.is_file():
        raise ValueError(
            f"bench JSON {path} does not exist: run `make bench-gpu` (it writes bench_gpu.json) and pass that file"
        )
    try:
        bench = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"bench JSON {path} is not JSON ({err}): pass the file `make bench-gpu` wrote") from err
    if not isinstance(bench, dict) or not isinstance(bench.get("environment"), dict):
        raise ValueError(
            f"bench JSON {path} has no 'environment': pass the file `make bench-gpu` (experiments/bench/gpu.py) wrote"
        )
    return bench


def _device_matches(gpu: str, device_name: str) -> bool:
    """Whether the GPU's name holds ``device_name`` as a word: ``H200`` in ``NVIDIA H200``, not in ``NVIDIA GH200``."""
    return re.search(rf"(?<![A-Za-z0-9]){re.escape(device_name)}(?![A-Za-z0-9])", gpu, re.IGNORECASE) is not None


def bench_problems(bench: Mapping[str, Any], cluster: Cluster) -> list[str]:
    """Why ``bench`` cannot calibrate ``cluster`` (empty: it can), each with its fix."""
    if cluster.device_name is None:
        return [
            f"cluster {cluster.name} names no device_name, so no GPU bench can calibrate it: calibrate a GPU preset"
            " (h100_sxm, h200_sxm, b200) or add `device_name:` to its YAML"
        ]
    env = bench.get("environment", {})
    gpu = env.get("gpu")
    want = f"run `make bench-gpu` on a machine with {cluster.device_name} GPUs and calibrate from its bench_gpu.json"
    if bench.get("smoke"):
        return [
            f"the bench JSON is a --smoke run (tiny shapes on {env.get('device', 'cpu')}), not the machine's figures: {want}"
        ]
    if not str(env.get("device", "")).startswith("cuda") or not gpu:
        return [f"the bench JSON ran on {env.get('device')!r}, not a GPU: {want}"]
    problems = []
    if not _device_matches(str(gpu), cluster.device_name):
        problems.append(
            f"the bench JSON ran on {gpu!r}, and cluster {cluster.name} is {cluster.device_name}: calibrate the preset of that"
            f" GPU (--cluster <its preset>), or {want}"
        )
    errors = bench.get("errors") or {}
    if errors:
        listed = "; ".join(f"{name}: {msg}" for name, msg in errors.items())
        problems.append(f"the bench JSON records errors ({listed}): fix them and {RERUN}")
    missing = [s for s in REQUIRED_SECTIONS if not bench.get(s)]
    if missing:
        problems.append(f"the bench JSON lacks sections {missing} (a run cut short, or --only without them): {RERUN}")
    return problems


def derive_constants(bench: Mapping[str, Any], cluster: Cluster) -> list[Measurement]:
    """The constants the bench measures (see the module docstring), over ``cluster.peak_flops``;
    ``ValueError`` if one falls outside (0, 1] (the JSON's device or the preset's peak is wrong)."""
    peak = cluster.peak_flops / 1e12
    gemm = bench["dense_gemm"]
    moe = sorted(bench["moe_layer"], key=lambda row: row["moe_tflops"])
    attention = sorted(bench["ring_attention"], key=lambda row: row["sdpa_tflops"])
    moe_tflops = statistics.median(row["moe_tflops"] for row in moe)
    sdpa_tflops = statistics.median(row["sdpa_tflops"] for row in attention)
    shapes = ", ".join(f"E{r['experts']} k{r['top_k']} F{r['ffn']}: {r['moe_tflops']:.1f}" for r in moe)
    attention_shapes = ", ".join(
        f"B{r['batch']} H{r['heads']} S{r['seq']} D{r['head_dim']}: {r['sdpa_tflops']:.1f} (ring cp1 {r['ring_cp1_tflops']:.1f})"
        for r in attention
    )
    scale = PLANNER_ATTENTION_PASSES / BENCH_ATTENTION_PASSES
    out = [
        Measurement("gemm_efficiency", gemm["tflops"] / peak,
                    f"dense_gemm {gemm['size']}^3 bf16 GEMM: {gemm['tflops']:.1f} TFLOP/s / peak {peak:.1f}"),
        Measurement("grouped_gemm_efficiency", moe_tflops / peak,
                    f"moe_layer expert-GEMM TFLOP/s, median of [{shapes}] = {moe_tflops:.1f} / peak {peak:.1f}"),
        Measurement("attention_efficiency", sdpa_tflops * scale / peak,
                    f"ring_attention SDPA causal fwd+bwd TFLOP/s, median of [{attention_shapes}] = {sdpa_tflops:.1f},"
                    f" x {PLANNER_ATTENTION_PASSES:g}/{BENCH_ATTENTION_PASSES:g} (backward 2 forwards, not 2.5) / peak {peak:.1f}"),
    ]  # fmt: skip
    for m in out:
        if not 0 < m.value <= 1:
            raise ValueError(
                f"{m.constant} = {m.value:.3f} from the bench JSON ({m.how}) is outside (0, 1]: the bench's device is not"
                f" the one cluster {cluster.name}'s peak_flops describes, or that peak is wrong; fix the preset's peak_flops"
                " or calibrate the GPU's own preset"
            )
    return out


def calibrated_text(base: str, name: str, measurements: Sequence[Measurement], source: str, command: str) -> str:
    """The calibrated preset's YAML: ``base`` (the preset's text, its comments kept) named ``name``,
    each measured constant's line replaced by the measured value, and a ``measured:`` mapping of each
    to ``source`` (file, date, device) and how it was derived."""
    values = {m.constant: m for m in measurements}
    lines, skipping = [], False
    for line in base.splitlines():
        key = line.split(":", 1)[0] if re.match(r"^[a-z_0-9]+:", line) else None
        if skipping and (line.startswith((" ", "\t")) or not line.strip()):
            continue  # a previous measured: mapping's entries
        skipping = key == "measured"
        if skipping:
            continue
        if key == "name":
            line = f"name: {name}"
        elif key in values:
            old = line.split(":", 1)[1].split("#", 1)[0].strip()
            line = f"{key}: {values[key].value:.4g}  # measured (see measured.{key}); the preset assumed {old}"
            del values[key]
        lines.append(line)
    lines += [f"{key}: {m.value:.4g}  # measured (see measured.{key})" for key, m in values.items()]
    header = [f"# Written by `{command}` at {datetime.now(timezone.utc).isoformat(timespec='seconds')}: rerun it rather than"
              " editing this file.", "# The measured constants' sources are under `measured:`; every other constant is the preset's."]  # fmt: skip
    measured = ["measured:", *(f"  {m.constant}: {json.dumps(f'{source}: {m.how}')}" for m in measurements)]
    return "\n".join([*header, *lines, *measured]) + "\n"


def _write_atomically(path: Path, text: str) -> None:
    """``text`` into ``path`` whole or not at all: a temporary file beside it, then renamed over it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def calibrate(
    bench_path: Path | str, cluster: str, *, out: Path | str | None = None, conf_dir: Path | None = None
) -> Path:
    """Calibrate preset ``cluster`` (a ``conf_dir/<cluster>.yaml``, by default the package's
    ``conf/cluster``) from the bench JSON at ``bench_path``;
    writes ``out`` (default ``conf_dir/<cluster>_calibrated.yaml``) and returns its path.
    ``ValueError`` naming the fix, before anything is written, when the JSON cannot calibrate it
    (:func:`bench_problems`, :func:`derive_constants`).

    Example::

        calibrate("bench_gpu.json", "h200_sxm")   # -> lightning_moe/conf/cluster/h200_sxm_calibrated.yaml
    """
    from omegaconf import OmegaConf

    bench_path = Path(bench_path)
    conf_dir = CLUSTER_DIR if conf_dir is None else conf_dir
    presets = sorted(p.stem for p in conf_dir.glob("*.yaml") if not p.stem.endswith(CALIBRATED_SUFFIX))
    if cluster.endswith(CALIBRATED_SUFFIX):
        raise ValueError(
            f"--cluster {cluster} is a calibrated preset: calibrate its base, --cluster {cluster.removesuffix(CALIBRATED_SUFFIX)}"
        )
    if cluster not in presets:
        raise ValueError(f"--cluster {cluster!r} is not a preset in {conf_dir}: choose one of {presets}")
    base_path = conf_dir / f"{cluster}.yaml"
    base = base_path.read_text()
    machine = Cluster.from_config(OmegaConf.to_container(OmegaConf.create(base), resolve=True))  # type: ignore[arg-type]
    bench = read_bench(bench_path)
    problems = bench_problems(bench, machine)
    if problems:
        raise ValueError(f"{bench_path} cannot calibrate {cluster}: " + "; ".join(problems))
    measurements = derive_constants(bench, machine)
    env = bench["environment"]
    source = f"{bench_path.name}, {env.get('date')}, {env.get('gpu')}"
    name = f"{cluster}{CALIBRATED_SUFFIX}"
    command = f"python -m lightning_moe.planner.calibrate {bench_path.name} --cluster {cluster}"
    text = calibrated_text(base, name, measurements, source, command)
    # what the planner will read back: the measured values and their sources, nothing else changed
    check = Cluster.from_config(OmegaConf.to_container(OmegaConf.create(text), resolve=True))  # type: ignore[arg-type]
    assert sorted(check.constants()["measured"]) == sorted(m.constant for m in measurements), text
    target = Path(out) if out is not None else conf_dir / f"{name}.yaml"
    _write_atomically(target, text)
    return target


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m lightning_moe.planner.calibrate BENCH_JSON --cluster PRESET [--out PATH]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bench_json", help="the JSON `make bench-gpu` wrote (bench_gpu.json)")
    parser.add_argument(
        "--cluster", required=True, help="the preset of the GPU it ran on (conf/cluster/<name>.yaml), e.g. h200_sxm"
    )
    parser.add_argument("--out", default=None, help="where to write (default: conf/cluster/<cluster>_calibrated.yaml)")
    args = parser.parse_args(argv)
    try:
        path = calibrate(args.bench_json, args.cluster, out=args.out)
    except ValueError as err:
        print(f"calibrate: {err}", file=sys.stderr)
        return 2
    from omegaconf import OmegaConf

    written = Cluster.from_config(OmegaConf.to_container(OmegaConf.load(path), resolve=True))  # type: ignore[arg-type]
    for constant, entry in written.constants()["measured"].items():
        print(f"{constant} = {entry['value']:.4g}: {entry['source']}")
    print(f"wrote {path}: plan with cluster={path.stem}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

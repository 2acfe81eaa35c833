"""``python -m lightning_moe.planner.calibrate``: a cluster preset's efficiency constants from a
``make bench-gpu`` JSON, written beside the preset with their sources, and the planner saying which
constants are measured and which assumed. Hand-built JSONs (no GPU here), the real script's smoke
JSON for a refusal; hand-computed values."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from lightning_moe.conf import CONF_DIR
from lightning_moe.plan import run_plan
from lightning_moe.planner.calibrate import calibrate, main
from lightning_moe.planner.cluster import MODEL_CONSTANTS, Cluster
from lightning_moe.planner.report import format_constants

H200_PEAK_TFLOPS = 989.4  # conf/cluster/h200_sxm.yaml's peak_flops
# What experiments/bench/gpu.py writes on an H200 (its keys; figures chosen to divide evenly).
BENCH = {
    "environment": {"date": "2026-12-04T01:00:00+00:00", "device": "cuda", "gpu": "NVIDIA H200", "torch": "2.11.0"},
    "smoke": False,
    "seconds": {},
    "errors": {},
    "dense_gemm": {"size": 8192, "ms": 1.39, "tflops": 0.8 * H200_PEAK_TFLOPS},
    "moe_layer": [
        {"tokens": 16384, "hidden": 4096, "ffn": 14336, "experts": 8, "top_k": 2, "moe_tflops": 0.6 * H200_PEAK_TFLOPS},
        {"tokens": 16384, "hidden": 4096, "ffn": 1408, "experts": 64, "top_k": 6, "moe_tflops": 0.3 * H200_PEAK_TFLOPS},
        {"tokens": 16384, "hidden": 4096, "ffn": 2816, "experts": 32, "top_k": 8, "moe_tflops": 0.5 * H200_PEAK_TFLOPS},
    ],
    # the bench counts the attention backward as 2.5 forwards, the planner as 2: 0.7 x 3/3.5 = 0.6
    "ring_attention": [{"batch": 4, "heads": 32, "seq": 8192, "head_dim": 128, "sdpa_tflops": 0.7 * H200_PEAK_TFLOPS,
                        "ring_cp1_tflops": 0.5 * H200_PEAK_TFLOPS}],
}  # fmt: skip


@pytest.fixture
def conf_dir(tmp_path: Path) -> Path:
    """A copy of the cluster presets, so that calibration writes beside them and not into the package."""
    target = tmp_path / "cluster"
    shutil.copytree(CONF_DIR / "cluster", target)
    return target


def write_bench(path: Path, bench: dict) -> Path:
    path.write_text(json.dumps(bench))
    return path


def load(path: Path) -> Cluster:
    return Cluster.from_config(OmegaConf.to_container(OmegaConf.load(path), resolve=True))


def test_calibration_writes_the_measured_constants_with_their_sources_beside_the_preset(conf_dir, tmp_path):
    preset = (conf_dir / "h200_sxm.yaml").read_text()
    path = calibrate(write_bench(tmp_path / "bench_gpu.json", BENCH), "h200_sxm", conf_dir=conf_dir)
    assert path == conf_dir / "h200_sxm_calibrated.yaml"
    assert (conf_dir / "h200_sxm.yaml").read_text() == preset  # the preset keeps its sources and assumptions
    assert sorted(p.name for p in conf_dir.iterdir() if p.name.startswith(".")) == []  # no temporary file left
    cluster, base = load(path), load(conf_dir / "h200_sxm.yaml")
    assert cluster.name == "h200_sxm_calibrated"
    assert cluster.gemm_efficiency == pytest.approx(0.8, abs=1e-4)
    assert cluster.grouped_gemm_efficiency == pytest.approx(0.5, abs=1e-4)  # the median of 0.6, 0.3, 0.5
    assert cluster.attention_efficiency == pytest.approx(0.6, abs=1e-4)
    constants = cluster.constants()
    assert sorted(constants["measured"]) == ["attention_efficiency", "gemm_efficiency", "grouped_gemm_efficiency"]
    assert set(constants["assumed"]) == set(MODEL_CONSTANTS) - set(constants["measured"])
    source = constants["measured"]["gemm_efficiency"]["source"]
    assert source.startswith("bench_gpu.json, 2026-12-04T01:00:00+00:00, NVIDIA H200: dense_gemm 8192^3")
    # everything not measured is the preset's, datasheet figures and assumptions alike
    for key in Cluster.__dataclass_fields__:
        if key not in ("name", "measured", *constants["measured"]):
            assert getattr(cluster, key) == getattr(base, key), key
    assert "# H200 datasheet: 4.8 TB/s" in path.read_text()
    # calibrating again replaces the file as a whole
    faster = copy.deepcopy(BENCH)
    faster["dense_gemm"]["tflops"] = 0.75 * H200_PEAK_TFLOPS
    calibrate(write_bench(tmp_path / "again.json", faster), "h200_sxm", conf_dir=conf_dir)
    again = load(path)
    assert again.gemm_efficiency == pytest.approx(0.75, abs=1e-4)
    assert again.constants()["measured"]["gemm_efficiency"]["source"].startswith("again.json")


def test_the_planner_says_which_constants_are_measured_and_which_assumed(conf_dir, tmp_path):
    calibrated = load(calibrate(write_bench(tmp_path / "bench_gpu.json", BENCH), "h200_sxm", conf_dir=conf_dir))
    footer = format_constants(calibrated)
    first = footer.splitlines()[0]
    assert first.startswith("Constants of h200_sxm_calibrated: measured gemm_efficiency 0.8, grouped_gemm_efficiency 0.5,"
                            " attention_efficiency 0.6; assumed comm_efficiency 0.8,")  # fmt: skip
    assert "  gemm_efficiency measured: bench_gpu.json, 2026-12-04T01:00:00+00:00, NVIDIA H200" in footer
    assert "measured none; assumed gemm_efficiency 0.7" in format_constants(load(conf_dir / "h200_sxm.yaml"))
    assert "elementwise_efficiency none" in format_constants(load(conf_dir / "cpu_local.yaml"))
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("plan", overrides=["model=tiny", "cluster=h200_sxm", "world_size=2", "top=1"])
    cfg.cluster = OmegaConf.create(OmegaConf.to_container(OmegaConf.load(conf_dir / "h200_sxm_calibrated.yaml")))
    out = run_plan(cfg, None, {"model": "tiny"})
    assert out["constants"] == calibrated.constants()


def h100_bench() -> dict:
    bench = copy.deepcopy(BENCH)
    bench["environment"]["gpu"] = "NVIDIA H100 80GB HBM3"
    return bench


@pytest.mark.parametrize(
    "edit,cluster,problem",
    [
        (lambda b: h100_bench(), "h200_sxm", "ran on 'NVIDIA H100 80GB HBM3', and cluster h200_sxm is H200: calibrate the preset"),
        (lambda b: {**b, "environment": {**b["environment"], "gpu": "NVIDIA GH200 480GB"}}, "h200_sxm", "cluster h200_sxm is H200"),
        (lambda b: {**b, "errors": {"moe_layer": "OutOfMemoryError: CUDA out of memory"}}, "h200_sxm",
         "records errors (moe_layer: OutOfMemoryError: CUDA out of memory): fix them and rerun `make bench-gpu`"),
        (lambda b: {k: v for k, v in b.items() if k != "ring_attention"}, "h200_sxm",
         "lacks sections ['ring_attention'] (a run cut short, or --only without them): rerun `make bench-gpu`"),
        (lambda b: {**b, "dense_gemm": {**b["dense_gemm"], "tflops": 1.2 * H200_PEAK_TFLOPS}}, "h200_sxm",
         "gemm_efficiency = 1.200 from the bench JSON"),
        (lambda b: b, "cpu_local", "cluster cpu_local names no device_name"),
        (lambda b: b, "h200_sxm_calibrated", "is a calibrated preset: calibrate its base, --cluster h200_sxm"),
        (lambda b: b, "dgx_z", "'dgx_z' is not a preset"),
    ],
)  # fmt: skip
def test_calibration_refuses_a_json_that_cannot_calibrate_the_preset_before_writing(
    conf_dir, tmp_path, edit, cluster, problem
):
    bench = write_bench(tmp_path / "bench_gpu.json", edit(copy.deepcopy(BENCH)))
    with pytest.raises(ValueError) as err:
        calibrate(bench, cluster, conf_dir=conf_dir)
    assert problem in str(err.value)
    assert not list(conf_dir.glob("*_calibrated.yaml"))


def test_the_scripts_own_smoke_json_is_refused_from_the_command_line(conf_dir, tmp_path, capsys, monkeypatch):
    """The JSON ``experiments/bench/gpu.py --smoke`` writes (its quickest section, in this process)."""
    from experiments.bench import gpu

    smoke = tmp_path / "smoke.json"
    gpu.run(gpu.parse_args(["--smoke", "--out", str(smoke), "--only", "dense_gemm"]))
    capsys.readouterr()
    monkeypatch.setattr("lightning_moe.planner.calibrate.CLUSTER_DIR", conf_dir)
    assert main([str(smoke), "--cluster", "h200_sxm"]) == 2
    err = capsys.readouterr().err
    assert (
        "is a --smoke run (tiny shapes on cpu), not the machine's figures: run `make bench-gpu` on a machine with H200"
        in err
    )
    assert not list(conf_dir.glob("*_calibrated.yaml"))
    assert main([str(write_bench(tmp_path / "bench_gpu.json", BENCH)), "--cluster", "h200_sxm"]) == 0
    assert "wrote " + str(conf_dir / "h200_sxm_calibrated.yaml") in capsys.readouterr().out

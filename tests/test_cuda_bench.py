"""``make bench-gpu``'s script (experiments/bench/gpu.py) in its ``--smoke`` mode: tiny shapes on
CPU, every section, in seconds. The full run needs a GPU; this keeps the script from rotting."""

from __future__ import annotations

import json

from experiments.bench import gpu


def test_bench_gpu_smoke_runs_every_section_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    assert gpu.main(["--smoke", "--device", "cpu", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["errors"] == {} and result["smoke"] is True
    assert result["environment"]["torch"] == gpu.torch.__version__
    (moe,) = result["moe_layer"]
    assert moe["moe_tflops"] > 0 and moe["dense_tflops"] > 0 and moe["moe_over_dense"] > 0
    (attn,) = result["ring_attention"]
    assert attn["max_abs_diff"] < 1e-2 and attn["ring_over_sdpa"] > 0  # bf16
    train = result["train_step"]
    assert train["tokens_per_second"] > 0 and len(train["losses"]) == 3  # warmup 1 + iters 2
    assert 0 < train["active_params"] < train["params"]
    assert set(result["seconds"]) == {"dense_gemm", "moe_layer", "ring_attention", "train_step"}


def test_bench_gpu_sizes_and_flop_model():
    # The 1B model of the full run, built on the meta device: ~1.25B parameters, ~0.4B active.
    import torch

    from lightning_moe.models import MoEGPT

    with torch.device("meta"):
        model = MoEGPT(max_seq_len=gpu.TRAIN_BATCH[1], **gpu.TRAIN_MODEL)
    flops, total, active = gpu.model_flops_per_token(model, gpu.TRAIN_BATCH[1])
    assert 1.0e9 < total < 1.5e9 and 0.3e9 < active < 0.5e9
    assert flops > 6 * active
    assert gpu.peak_tflops(torch.device("cpu")) is None

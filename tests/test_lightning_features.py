"""Issue 14: what a Lightning user switches on with a flag works under MoE5DStrategy.

Mixed precision (FSDP2 policy from the trainer's precision), predict/validate/test on every
dimension, failures that end every rank within the process-group timeout. Trainer-level runs go
through the CLI or a script in a subprocess (Lightning's launcher re-executes ``sys.argv``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import pytest

from tests.cli import run_cli, run_cli_error

BF16_REL = 2e-2


# -- mixed precision ---------------------------------------------------------------------------------
def _tiny_gpt():
    from lightning_moe.models import MoEGPT

    torch.manual_seed(0)
    return MoEGPT(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=16,
                  moe={"num_experts": 4, "top_k": 2, "ffn_hidden_size": 32})


def policy_case(precision: str) -> dict:
    """dp2 x ep2: the FSDP2 units' policy and the dp bytes of one forward (all-gathers only)."""
    from lightning_moe import comm, parallelize
    from lightning_moe.callbacks import count_collectives, group_dims
    from lightning_moe.parallel.precision import apply_mixed_precision, fsdp_policies, mixed_precision_policy
    from tests.dist_pool import layout

    dims = layout(ep=2)
    model = parallelize(_tiny_gpt(), dims.mesh)
    units = apply_mixed_precision(model, mixed_precision_policy(precision))
    master_dtypes = sorted({str(p.dtype) for p in model.parameters()})  # the sharded parameters
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    comm.reset()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed")
    with torch.no_grad(), autocast, count_collectives(group_dims(dims)):
        logits = model(ids)
    snapshot = comm.snapshot()
    comm.reset()
    policies = fsdp_policies(model)
    return {
        "units": units,
        "param_dtypes": sorted({str(p.param_dtype) for p in policies}),
        "reduce_dtypes": sorted({str(p.reduce_dtype) for p in policies}),
        "master_dtypes": master_dtypes,
        "dp_bytes": snapshot["dp"]["bytes"],
        "logits": logits.float(),
    }


def test_bf16_mixed_gives_fsdp_bf16_all_gathers_at_half_the_bytes(pool4):
    fp32 = pool4.run(policy_case, precision="32-true")
    bf16 = pool4.run(policy_case, precision="bf16-mixed")
    for full, half in zip(fp32, bf16):
        assert full["units"] == 0 and half["units"] > 0
        assert half["param_dtypes"] == ["torch.bfloat16"] and half["reduce_dtypes"] == ["torch.float32"]
        assert half["master_dtypes"] == ["torch.float32"]  # fp32 master weights
        assert full["dp_bytes"] > 0 and half["dp_bytes"] * 2 == full["dp_bytes"]
        torch.testing.assert_close(half["logits"], full["logits"], rtol=0, atol=BF16_REL * full["logits"].abs().max().item())


def test_sixteen_bit_precisions_are_refused_with_the_fix():
    from lightning_moe.parallel.precision import check_precision

    with pytest.raises(ValueError, match=r"precision='16-mixed'.*gradient scaler.*Use precision='bf16-mixed'"):
        check_precision("16-mixed")
    check_precision("bf16-true")


@pytest.fixture(scope="module")
def single_fp32(tmp_path_factory) -> dict:
    return run_cli(tmp_path_factory.mktemp("single") / "run", "parallel=single")


def _assert_close_curve(losses: list[float], reference: list[float], rel: float) -> None:
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=rel, atol=0.0)


@pytest.mark.slow
@pytest.mark.parametrize("preset,precision", [("ep2", "bf16-mixed"), ("tp2", "bf16-mixed"), ("ep2", "bf16-true")])
def test_bf16_training_follows_the_fp32_curve(tmp_path, single_fp32, preset, precision):
    summary = run_cli(tmp_path / preset, f"parallel={preset}", f"trainer.precision={precision}")
    _assert_close_curve(summary["losses"], single_fp32["losses"], BF16_REL)
    assert summary["losses"] != single_fp32["losses"]  # bf16 really ran


@pytest.mark.slow
def test_sixteen_mixed_fails_before_training(tmp_path):
    output = run_cli_error(tmp_path / "fp16", "parallel=ep2", "trainer.precision=16-mixed")
    assert "bf16-mixed" in output and "16-mixed" in output, output[-3000:]
    assert "Epoch 0" not in output

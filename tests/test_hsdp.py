"""HSDP (``data_parallel="hsdp"``): FSDP2 shards within ``dp_replicate`` replica groups of ``dp_shard``
ranks and all-reduces across them, for dense, token and expert parameters alike.

The training curves (one-process losses at rel 1e-5) come from the CLI runs: the ``dp2x2_hsdp``
and ``dp2_ep2_hsdp`` presets in tests/test_strategy_invariance.py's default-data runs and
``tp2_dp2_hsdp`` in its layout variants. Here: where the shards lie, which dim their traffic counts
for, and the errors.
"""

from __future__ import annotations

import pytest
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_moe import MoE5DStrategy
from lightning_moe.layout import hsdp_problem, hsdp_sizes
from tests.dist_pool import get_pool
from tests.dist_pool import layout as pool_layout

TINY = {"vocab_size": 256, "hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 128,
        "moe": {"num_experts": 2, "top_k": 1, "ffn_hidden_size": 32}}  # fmt: skip


def _shards(sizes: dict) -> dict:
    """Every parameter's mesh dims, placements and local shape after ``parallelize(..., "hsdp")``, and
    the dims comm accounting charges the HSDP groups to."""
    import torch
    from torch.distributed.tensor import DTensor

    from lightning_moe import parallelize
    from lightning_moe.comm.traffic import group_dims
    from lightning_moe.models import MoEGPT

    dims = pool_layout(**sizes)
    torch.manual_seed(0)
    model = parallelize(MoEGPT(**TINY), dims, data_parallel="hsdp")
    params = {}
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), name
        params[name] = (param.device_mesh.mesh_dim_names, [type(p).__name__ for p in param.placements],
                        tuple(param.to_local().shape), tuple(param.shape))  # fmt: skip
    accounting = group_dims(dims)
    meshes = (dims.dense_fsdp_mesh, dims.edp_fsdp_mesh)
    charged = {accounting.dim_of(mesh.get_group(d)) for mesh in meshes for d in range(mesh.ndim)}
    return {"params": params, "charged": charged}


@pytest.mark.slow
def test_dense_and_expert_parameters_shard_within_replica_groups():
    """dp=4 as 2 replica groups of 2, then ep2·dp2 as 2 groups of 1 (the experts' edp splits alike):
    every parameter is replicated over the replica dim and sharded over the shard dim only."""
    pool = get_pool(4)
    dense = pool.run(_shards, sizes={"dp": 4, "dp_replicate": 2})[0]
    for name, (mesh, placements, local, full) in dense["params"].items():
        expected = (
            ("edp_replicate", "edp_shard", "ep", "etp") if ".experts." in name else ("dp_replicate", "dp_shard_ep_cp")
        )
        assert mesh == expected and placements[:2] == ["Replicate", "Shard"], (name, mesh, placements)
        if ".experts." not in name:
            assert local[0] == -(-full[0] // 2), (
                name,
                local,
                full,
            )  # half of dim 0 (rounded up), whole across replicas
    expert = pool.run(_shards, sizes={"ep": 2, "dp": 2, "dp_replicate": 2})[0]
    w1 = next(v for k, v in expert["params"].items() if k.endswith("experts.w1"))
    # Replicated over the 2 replica groups; the 1-rank shard dim shards dim 0 after ep (a strided shard).
    assert w1[0][:2] == ("edp_replicate", "edp_shard") and w1[1][0] == "Replicate", w1
    assert w1[2][0] == 1 and w1[3][0] == 2  # one expert of two per ep rank, none sharded within a 1-rank group
    attention = expert["params"]["layers.0.attention.wq.weight"]
    assert attention[0] == ("dp_replicate", "dp_shard_ep_cp") and attention[1] == ["Replicate", "Shard"], attention
    assert dense["charged"] == expert["charged"] == {"dp"}


def test_hsdp_sizes_and_their_errors():
    assert hsdp_sizes(8, dp_replicate=2) == (2, 4) and hsdp_sizes(8, dp_shard=2) == (4, 2)
    assert hsdp_problem(4, 2, 2) is None
    assert hsdp_problem(4, 2, 3).startswith("dp_replicate*dp_shard = 2*3 != dp = 4")
    with pytest.raises(MisconfigurationException, match=r"data_parallel='hsdp' needs dp_replicate or dp_shard"):
        MoE5DStrategy(dp=4, data_parallel="hsdp")
    with pytest.raises(MisconfigurationException, match=r"split dp for HSDP, but data_parallel='fsdp'"):
        MoE5DStrategy(dp=4, dp_replicate=2)
    assert MoE5DStrategy(dp=4, data_parallel="hsdp", dp_replicate=2, gather_once_per_step=True).gather_once_per_step


def test_replica_groups_that_do_not_split_dp_fail_at_launch():
    import lightning as L

    with pytest.raises(MisconfigurationException, match=r"dp_replicate\*dp_shard = 3\*None != dp = 4"):
        L.Trainer(
            accelerator="cpu", devices=4, logger=False, strategy=MoE5DStrategy(data_parallel="hsdp", dp_replicate=3)
        ).strategy.before_launch()


def test_an_auto_layout_that_chose_hsdp_runs_hsdp(monkeypatch):
    """layout="auto" takes the planner's data_parallel and dp_replicate with its sizes."""
    import lightning as L

    import lightning_moe.strategy

    chosen = {"tp": 1, "cp": 1, "ep": 1, "dp": 4, "pp": 1, "etp": 1, "data_parallel": "hsdp", "dp_replicate": 2}
    monkeypatch.setattr(lightning_moe.strategy, "auto_layout", lambda world_size, options: dict(chosen))
    strategy = MoE5DStrategy(layout="auto")
    L.Trainer(accelerator="cpu", devices=4, strategy=strategy, logger=False, enable_checkpointing=False)
    assert (strategy.data_parallel, strategy.parallel_dims.dp, strategy.parallel_dims.dp_replicate) == ("hsdp", 4, 2)

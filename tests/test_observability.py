"""Observability across ranks and through the CLI.

- ``MoEStatsMetric`` gives single-device numbers whichever ranks hold which layers (no hang);
- communication accounting of a hand-computable expert-parallel layer (fixed router), with and
  without FSDP;
- the CLI with W&B offline logs the metric keys and heatmap images;
- router metrics under ep=2, dp=2 and pp=2 equal the single-process ones for the same global batch.
"""

from __future__ import annotations

import functools
import struct
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.cli import run_cli, train_in_pool
from tests.dist_pool import get_pool

WORLD = 4


# -- MoEStatsMetric over ranks holding different layers ----------------------------------------------
def _rank_inputs(rank: int, micro_batch: int, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.arange(num_experts, dtype=torch.float32) * (rank + 1) + micro_batch
    scalars = torch.tensor([0.1 * rank + 0.01 * micro_batch, float(rank)])
    return counts, scalars


def metric_case(split: str) -> dict:
    """``split="stages"``: ranks 0-1 hold layer "a" (4 experts), ranks 2-3 layer "b" (2 experts), like
    two pipeline stages of two data-parallel ranks. ``split="shared"``: every rank holds both layers
    and ranks (0, 1), (2, 3) see the same samples, like tp=2 x dp=2."""
    from lightning_moe.callbacks.moe_metrics import MoELayerInfo, MoEStatsMetric, _gather_layer_infos

    rank = dist.get_rank()
    infos = {"a": MoELayerInfo("a", 4, False), "b": MoELayerInfo("b", 2, True)}
    if split == "stages":
        local = [infos["a"]] if rank < 2 else [infos["b"]]
        sample_rank = rank  # the rank whose samples this rank holds
    else:
        local = [infos["a"], infos["b"]]
        sample_rank = rank // 2 * 2
    layers = _gather_layer_infos(local)
    metric = MoEStatsMetric([info.num_experts for info in layers], num_scalars=2, data_parallel_size=2)
    index = torch.tensor([layers.index(info) for info in local])
    for micro_batch in range(2):
        counts = torch.zeros(len(local), 4)
        scalars = torch.zeros(len(local), 2)
        for row, info in enumerate(local):
            c, s = _rank_inputs(sample_rank, micro_batch, info.num_experts)
            counts[row, : info.num_experts], scalars[row] = c, s
        metric.update(index, counts, scalars)
    counts, scalars = metric.compute()
    return {
        "names": [info.name for info in layers],
        "counts": [c.tolist() for c in counts],
        "scalars": scalars.tolist(),
    }


def _expected_metric(sample_ranks_by_layer: dict[str, list[int]]) -> dict:
    experts = {"a": 4, "b": 2}
    out: dict = {"counts": [], "scalars": []}
    for name in ("a", "b"):
        inputs = [_rank_inputs(r, mb, experts[name]) for r in sample_ranks_by_layer[name] for mb in range(2)]
        out["counts"].append(torch.stack([c for c, _ in inputs]).sum(0).tolist())
        out["scalars"].append(torch.stack([s for _, s in inputs]).double().mean(0).tolist())
    return out


@pytest.mark.slow
@pytest.mark.parametrize("split", ["stages", "shared"])
def test_stats_metric_gives_global_batch_numbers_whatever_ranks_hold(split):
    results = get_pool(WORLD).run(metric_case, split=split)
    # Data-parallel coordinates: stages -> ranks {0, 1} for "a", {2, 3} for "b"; shared -> {0, 2}.
    samples = {"a": [0, 1], "b": [2, 3]} if split == "stages" else {"a": [0, 2], "b": [0, 2]}
    expected = _expected_metric(samples)
    for result in results:  # every rank gets every layer, in module (rank) order
        assert result["names"] == ["a", "b"]
        for got, want in zip(result["counts"], expected["counts"]):
            assert got == pytest.approx(want)
        assert result["scalars"] == [pytest.approx(row) for row in expected["scalars"]]


def test_layers_come_in_model_order_whatever_the_stage_order():
    """Interleaved stages put layers 0 and 2 on rank 0 and 1 and 3 on rank 1; indices sort as numbers."""
    from lightning_moe.callbacks.moe_metrics import MoELayerInfo, _gather_layer_infos

    names = ["model.layers.0.ffn", "model.layers.2.ffn", "model.layers.10.ffn", "model.layers.1.ffn"]
    layers = _gather_layer_infos([MoELayerInfo(name, 4, False) for name in names])
    assert [info.name for info in layers] == [names[0], names[3], names[1], names[2]]


# -- communication accounting by hand -------------------------------------------------------------
H, F, E, K = 8, 16, 4, 2
BATCH, SEQ = 2, 3
TOKENS = BATCH * SEQ
FP32 = 4


def comm_case(data_parallel: str) -> dict:
    """ep=2 x dp=2; the router sends every token to experts 0 and 1, both on ep rank 0."""
    from lightning_moe import comm, parallelize
    from lightning_moe.callbacks import count_collectives, group_dims
    from lightning_moe.moe import MoELayer
    from tests.dist_pool import layout

    dims = layout(ep=2)
    torch.manual_seed(0)
    layer = MoELayer(H, F, E, top_k=K, aux_loss_coeff=1e-2, dispatcher="alltoall")  # the hand count is per expert slot
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0] = 1.0
        layer.router.weight[1] = 0.9
    parallelize(layer, dims, data_parallel=data_parallel)
    # An activation, as in a model: the dispatch all-to-all has a backward.
    x = torch.rand(BATCH, SEQ, H, generator=torch.Generator().manual_seed(dist.get_rank())) + 0.1
    x.requires_grad_(True)
    # Ranks 0 and 3 differ in dp and ep: no dim's group.
    other = dist.new_group([0, 3])
    comm.reset()
    with count_collectives(group_dims(dims)):
        layer(x).square().sum().backward()
        if dist.get_rank() in (0, 3):
            dist.all_reduce(torch.ones(4), group=other)
    snapshot = comm.snapshot()
    comm.reset()
    return {
        "rank": dist.get_rank(),
        "ep_rank": dims.ep_mesh.get_local_rank(),
        "counters": snapshot,
        "slots": layer.stats["tokens_per_expert"].tolist(),
    }


def _expected_ep() -> dict:
    """Per rank, whichever ep rank it is (ep rank 0 owns experts 0 and 1, so all 2T slots of ep rank 1
    travel to it and back; ep rank 0 keeps its own):

    - token counts all-to-all: E int64 counts, half of them to the peer: ``E * 8 / 2`` bytes;
    - dispatch: ep1 sends 2T rows; combine: ep0 sends those 2T rows back;
    - backward: each all-to-all sends back what it received (ep0: the dispatch's 2T rows, ep1: the
      combine's 2T rows).

    Calls: counts, dispatch, combine, and the two backward all-to-alls.
    """
    rows = K * TOKENS * H * FP32
    return {"bytes": E * 8 // 2 + 2 * rows, "calls": 5}


def _expected_dp() -> dict:
    """FSDP2 units of a bare MoELayer: ``experts`` over edp (dp, 2 ranks) and the root (router weight)
    over dp x ep (4 ranks). A unit all-gathers its shard to every peer in forward and, except the
    root (kept unsharded after forward), again in backward; it reduce-scatters the gradient, sending
    the peers' shards. The all-gather and reduce-scatter of one unit move its flat shard."""
    expert_shard = 3 * (E // 2) * H * F // 2 * FP32  # w1, w3, w2 of 2 local experts, halved over dp
    router_shard = E * H // 4 * FP32
    return {"bytes": 3 * expert_shard * (2 - 1) + 2 * router_shard * (4 - 1), "calls": 3 + 2}


@functools.cache
def _comm_results(data_parallel: str) -> tuple[dict, ...]:
    results = get_pool(WORLD).run(comm_case, data_parallel=data_parallel)
    assert sorted(r["ep_rank"] for r in results) == [0, 0, 1, 1]
    assert all(r["slots"][2:] == [0.0, 0.0] for r in results)  # nothing routed to ep rank 1's experts
    return tuple(results)


@pytest.mark.slow
@pytest.mark.parametrize("data_parallel", ["none", "fsdp"])
def test_expert_dispatch_bytes_match_the_count_by_hand(data_parallel):
    for result in _comm_results(data_parallel):
        assert result["counters"]["ep"] == _expected_ep(), result


@pytest.mark.slow
@pytest.mark.parametrize("data_parallel", ["none", "fsdp"])
def test_fsdp_and_other_collectives_match_the_count_by_hand(data_parallel):
    for result in _comm_results(data_parallel):
        counters = result["counters"]
        if result["rank"] in (0, 3):
            assert counters.pop("other") == {"bytes": 2 * 4 * FP32 * 1 // 2, "calls": 1}
        if data_parallel == "fsdp":
            assert counters.pop("dp") == _expected_dp(), result
        assert set(counters) == {"ep"}
        assert counters["ep"]["calls"] == _expected_ep()["calls"]


def uncounted_case() -> dict:
    import torch.distributed._functional_collectives as funcol

    from lightning_moe import comm
    from lightning_moe.callbacks import GroupDims, count_collectives, uncounted

    world = dist.new_group(list(range(dist.get_world_size())))
    comm.reset()
    with count_collectives(GroupDims(by_ranks={frozenset(range(dist.get_world_size())): ("dp",)})):
        dist.all_reduce(torch.ones(8), group=world)  # counted: 2 * 32 * 3 / 4
        funcol.all_reduce(torch.ones(8), "sum", world)  # a functional collective (DTensor's kind): the same
        dist.broadcast(torch.ones(8), src=0, group=world)  # rank 0 sends 32 bytes to 3 peers
        comm.all_reduce_(torch.ones(8), world, "cp")  # recorded once, by lightning_moe.comm, as "cp"
        with uncounted():
            dist.all_reduce(torch.ones(8), group=world)
    dist.all_reduce(torch.ones(8), group=world)  # after the block
    return comm.snapshot()


def pipeline_p2p_case() -> dict:
    """torch's pipeline schedules hand their P2P to ``schedules._batch_p2p``: a batch of sends only
    goes out as separate ``isend`` calls, a mixed batch through ``batch_isend_irecv``."""
    from torch.distributed.pipelining import schedules

    from lightning_moe import comm
    from lightning_moe.callbacks import GroupDims, count_collectives

    rank = dist.get_rank()
    peer = rank ^ 1  # pairs (0, 1) and (2, 3), like two pipeline stages
    world = dist.new_group(list(range(dist.get_world_size())))
    comm.reset()
    with count_collectives(GroupDims(by_ranks={frozenset(range(dist.get_world_size())): ("pp",)})):
        if rank % 2 == 0:  # sends only: 8 and 4 floats
            ops = [dist.P2POp(dist.isend, torch.ones(n), peer, group=world) for n in (8, 4)]
        else:
            ops = [dist.P2POp(dist.irecv, torch.empty(n), peer, group=world) for n in (8, 4)]
        schedules._wait_batch_p2p(schedules._batch_p2p(ops, desc="sends"))
        # a mixed batch: 16 floats each way
        ops = [
            dist.P2POp(dist.isend, torch.ones(16), peer, group=world),
            dist.P2POp(dist.irecv, torch.empty(16), peer, group=world),
        ]
        schedules._wait_batch_p2p(schedules._batch_p2p(ops, desc="mixed"))
    return comm.snapshot()


@pytest.mark.slow
def test_pipeline_schedule_sends_are_counted_once():
    for rank, counters in enumerate(get_pool(WORLD).run(pipeline_p2p_case)):
        sends_only = {"bytes": (8 + 4) * FP32, "calls": 2} if rank % 2 == 0 else {"bytes": 0, "calls": 0}
        expected = {"bytes": sends_only["bytes"] + 16 * FP32, "calls": sends_only["calls"] + 1}
        assert counters == {"pp": expected}, (rank, counters)


@pytest.mark.slow
def test_collectives_are_counted_once_and_only_inside_the_block():
    for rank, counters in enumerate(get_pool(WORLD).run(uncounted_case)):
        broadcast = 32 * 3 if rank == 0 else 0
        assert counters == {"dp": {"bytes": 48 + 48 + broadcast, "calls": 3}, "cp": {"bytes": 48, "calls": 1}}


# -- the CLI ------------------------------------------------------------------------------------------
OBSERVED = ["trainer.log_every_n_steps=1", "callbacks.expert_load_plots.every_n_steps=2", "~callbacks.progress_bar"]


def _wandb_records(path: Path) -> list:
    """Records of an offline ``.wandb`` file (LevelDB log format: 32 KiB blocks of chunks, each with
    a 7-byte header: crc32, length, type; FULL=1, FIRST=2, MIDDLE=3, LAST=4) as protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


@pytest.mark.slow
def test_wandb_offline_run_holds_the_metrics_and_heatmaps(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_home"))
    run_cli(tmp_path / "run", "logger=wandb", "trainer.max_steps=4", *OBSERVED, plots=True)
    (run_dir,) = (tmp_path / "wandb_home" / "wandb").glob("offline-run-*")
    keys: set[str] = set()
    for record in _wandb_records(next(run_dir.glob("run-*.wandb"))):
        if record.WhichOneof("record_type") == "history":
            # Images are nested items: ["moe/expert_load", "filenames"], ...
            keys |= {item.key or item.nested_key[0] for item in record.history.item}
    expected = {
        "train/loss", "moe/aux_loss", "moe/z_loss", "moe/load_imbalance", "moe/load_cv", "moe/no_token_fraction",
        "moe/dropped_fraction", "moe/router_entropy", "moe/load_imbalance_p50", "moe/load_imbalance_p90",
        "moe/load_imbalance_max", "moe/layer0/load_imbalance", "moe/layer1/aux_loss", "comm/ep_bytes",
        "comm/dp_calls", "comm/total_bytes", "perf/tokens_per_second", "perf/mfu", "moe/expert_load",
        "moe/load_imbalance_curve",
    }  # fmt: skip
    assert expected <= keys, expected - keys
    images = sorted((run_dir / "files" / "media" / "images").rglob("*.png"))
    assert len([p for p in images if "expert_load" in p.name]) >= 2  # steps 2 and 4
    assert any("load_imbalance_curve" in p.name for p in images)
    plots = sorted(p.name for p in (tmp_path / "run" / "plots").iterdir())
    assert plots == ["expert_load_step000002.png", "expert_load_step000004.png", "load_imbalance.png"]


@pytest.mark.slow
def test_router_metrics_under_ep2_dp2_and_pp2_equal_the_single_process_ones(tmp_path):
    overrides = [
        "trainer.max_steps=4",
        "trainer.log_every_n_steps=1",
        "~callbacks.progress_bar",
    ]
    single = train_in_pool(tmp_path / "single", *overrides)
    # pp2: each stage holds one of the two MoE layers; every rank still logs both.
    for layout, busy_dim in (("parallel=ep2", "ep"), ("parallel=dp2", "dp"), ("parallel=pp2", "pp")):
        other = train_in_pool(tmp_path / layout.split("=")[1], layout, *overrides)
        assert other["comm"][busy_dim]["bytes"] > 0
        assert list(other["expert_load"]) == ["layer0", "layer1"]
        assert other["model_flops_per_token"] == single["model_flops_per_token"]
        for name, values in single["moe_history"].items():
            # Token counts may flip a near-tie after a few steps of float noise (1 slot in 128 per expert).
            tolerance = dict(rel=1e-4, abs=0.02) if name.startswith(("load_", "no_token")) else dict(rel=1e-4, abs=1e-7)
            assert other["moe_history"][name] == pytest.approx(values, **tolerance), (layout, name)
            assert other["moe_history"][name][0] == pytest.approx(values[0], rel=1e-5, abs=1e-7), (layout, name)
        for key, value in single["moe_metrics"].items():
            if key.split("/")[-1].startswith(("aux_loss", "z_loss", "router_entropy", "dropped_fraction")):
                assert other["moe_metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-7), (layout, key)
    assert all(entry == {"bytes": 0.0, "calls": 0.0} for entry in single["comm"].values())

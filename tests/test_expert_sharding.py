"""Fully sharded experts: with fewer experts per ep rank than the edp group, FSDP2 shards the experts
on a non-expert dim, and training, clipping, meta-device initialisation and checkpoints still give
the single-process numbers.

The layout: 2 experts over ep=2 (one per rank) with dp=2 on 4 ranks, so edp=2 > 1 expert per rank.
Dim 0 would leave each rank one whole expert (or a padded empty one); the new placement gives every
rank half of its expert.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from tests.dist_pool import get_pool, layout

REL = 1e-5
CLIP = 0.05
LR = 1e-2
GLOBAL_MICRO_BATCHES = 4  # per optimizer step, whatever the layout: each replica runs 4 / replicas of them
# FFN 24 != hidden 32: w1/w3 [E, 32, 24] shard on dim 1 (hidden), w2 [E, 24, 32] on dim 2 (hidden).
MODEL = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
             moe={"num_experts": 2, "top_k": 1, "topk_norm": False, "ffn_hidden_size": 24,
                  "aux_loss_coeff": 0.1, "z_loss_coeff": 0.01})  # fmt: skip
SHARDED = {"ep": 2}  # dp 2 inferred: edp = 2, one expert per ep rank
OTHER = {"tp": 2, "ep": 2}  # etp = tp: experts split over tp, edp = 1 (no FSDP split of experts)


# -- pure: the rule and its planner mirror -----------------------------------------------------------
def test_the_planner_applies_the_data_parallel_rule():
    import itertools

    from lightning_moe.parallel.plans.data_parallel import expert_shard_dim
    from lightning_moe.planner.parameters import expert_fsdp_dim

    assert expert_shard_dim((1, 32, 24), frozenset(), 2) == 1
    assert expert_shard_dim((1, 24, 32), frozenset(), 2) == 2
    assert expert_shard_dim((1, 4096, 7168), frozenset({2}), 4) == 1  # Mixtral-8x7B ep8 etp2 edp4: not the tp-split FFN
    assert expert_shard_dim((1, 4096, 14336), frozenset(), 4) == 2  # etp 1: the largest dim
    assert expert_shard_dim((4, 32, 24), frozenset(), 4) == 0  # enough experts: FSDP2's dim 0
    assert expert_shard_dim((2, 32, 32), frozenset(), 6) == 0  # no dim divisible by 6: dim 0 and padding
    for experts, h, f, n, tp_dim in itertools.product((1, 2, 4), (6, 16, 32), (8, 12, 24), (2, 3, 4, 8), (None, 1, 2)):
        shape = (experts, h, f)
        assert expert_fsdp_dim(shape, tp_dim, n) == expert_shard_dim(
            shape, frozenset() if tp_dim is None else {tp_dim}, n
        )


# -- multi-process -----------------------------------------------------------------------------------
def _batch(index: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + index)
    tokens = torch.randint(0, 256, (2, 33), generator=gen)
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}


def _train(model, optimizer, steps: range, replica: int, replicas: int, group) -> tuple[list[float], list[float]]:
    """Optimizer steps over the same 4 micro-batches per step on any layout (accumulating 4 / replicas
    per replica), gradients clipped; the global mean loss and the total norm of each step."""
    from lightning_moe.moe import set_aux_loss_scale
    from lightning_moe.parallel.runtime.grad_norm import clip_grad_norm_

    micro = GLOBAL_MICRO_BATCHES // replicas
    losses, norms = [], []
    for step in steps:
        total = torch.zeros(())
        set_aux_loss_scale(1.0 / micro)  # aux losses averaged over the micro-batches as the main loss
        for j in range(micro):
            loss = model.loss(_batch(step * GLOBAL_MICRO_BATCHES + replica * micro + j)) / micro
            loss.backward()
            total += loss.detach()
        set_aux_loss_scale(1.0)
        if group is not None:
            dist.all_reduce(total, group=group)
        losses.append(total.item() / replicas)
        if group is None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        else:
            norms.append(clip_grad_norm_(model.parameters(), CLIP).item())
        optimizer.step()
        optimizer.zero_grad()
    return losses, norms


def _placement(placement) -> str:
    return f"{type(placement).__name__}({getattr(placement, 'dim', '')})"


def _full_state(model, optimizer) -> dict[str, torch.Tensor]:
    """Parameters and Adam moments, whole, keyed as a consolidated checkpoint keys them."""
    from torch.distributed.tensor import DTensor

    def whole(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    state = {}
    for name, param in model.named_parameters():
        state[name] = whole(param)
        for key in ("exp_avg", "exp_avg_sq"):
            state[f"optimizer_0.state.{name}.{key}"] = whole(optimizer.state[param][key])
    return state


def train_case(sizes: dict | None, steps: list[int], load: str | None = None, save: str | None = None) -> dict:
    """``sizes=None``: the single-process reference, on rank 0 only. Otherwise every rank trains the
    layout ``sizes``, optionally loading a DCP checkpoint first and saving one after."""
    from torch.distributed.tensor import DTensor

    from lightning_moe import parallelize
    from lightning_moe.checkpoint.state import load_model_and_optimizers, optimizer_state_dict
    from lightning_moe.models import MoEGPT

    if sizes is None and dist.get_rank() != 0:
        return {}
    torch.manual_seed(0)
    model = MoEGPT(**MODEL)
    report: dict = {}
    if sizes is None:
        replica, replicas, group = 0, 1, None
    else:
        dims = layout(**sizes)
        parallelize(model, dims, data_parallel="fsdp")
        replica, replicas, group = dims.dp_ep_mesh.get_local_rank(), dims.dp_ep_mesh.size(), dims.dp_ep_mesh.get_group()
        report["edp"], report["ep"] = dims.edp_mesh.size(), dims.ep
        report["experts"] = {
            name: {"local_numel": p.to_local().numel(), "numel": p.numel(), "placements": [_placement(x) for x in p.placements],
                   "local_shape": tuple(p.to_local().shape)}
            for name, p in model.named_parameters() if ".experts." in name and isinstance(p, DTensor)
        }  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    if load is not None:
        load_model_and_optimizers(model, [optimizer], load, complete=True)
        loaded = _full_state(model, optimizer)  # full_tensor is a collective: every rank
        if dist.get_rank() == 0:
            report["loaded"] = loaded
    report["losses"], report["norms"] = _train(model, optimizer, range(*steps), replica, replicas, group)
    if save is not None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        dcp.save(
            {"state_dict": get_model_state_dict(model), "optimizer_0": optimizer_state_dict(model, optimizer)},
            checkpoint_id=save,
        )
        if dist.get_rank() == 0:  # what the strategy writes beside the shards (read by consolidate)
            from lightning_moe.checkpoint.state import METADATA_FILE

            torch.save({"global_step": steps[1]}, f"{save}/{METADATA_FILE}")
    if sizes is None or dist.get_rank() == 0:
        report["state"] = _full_state(model, optimizer)
    else:
        _full_state(model, optimizer)  # full_tensor is a collective
    return report


def _reference_after(steps: int) -> dict:
    key = ("reference", steps)
    if key not in _RUNS:
        _RUNS[key] = get_pool(4).run(train_case, sizes=None, steps=[0, steps])[0]
    return _RUNS[key]


_RUNS: dict = {}


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> dict:
    """ep2·dp2 (sharded experts) 2 steps -> save -> tp2·ep2 1 step -> save -> ep2·dp2 1 step."""
    folder = tmp_path_factory.mktemp("expert_sharding")
    first, second = str(folder / "after2"), str(folder / "after3")
    pool = get_pool(4)
    runs = {
        "a": pool.run(train_case, sizes=SHARDED, steps=[0, 2], save=first),
        "b": pool.run(train_case, sizes=OTHER, steps=[2, 3], load=first, save=second),
        "c": pool.run(train_case, sizes=SHARDED, steps=[3, 4], load=second),
    }
    return {**runs, "first": first, "second": second}


def _assert_close(got, want, what: str) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=REL, atol=0.0, msg=what)


@pytest.mark.slow
def test_sharded_experts_train_the_single_process_losses_with_clipping(chain):
    reference = _reference_after(4)
    assert min(reference["norms"]) > 10 * CLIP, "the case must actually clip"
    for rank, report in enumerate(chain["a"]):
        _assert_close(report["losses"], reference["losses"][:2], f"rank {rank} losses")
        _assert_close(report["norms"], reference["norms"][:2], f"rank {rank} grad norms")
    _assert_state_close(chain["a"][0]["state"], _reference_after(2)["state"])


def _assert_state_close(got: dict, want: dict) -> None:
    """Weights and Adam moments after a few steps: fp32 reduction order moves a few elements by about
    1e-6 (Adam turns a tiny gradient difference into a visible update), hence atol 1e-5."""
    assert set(got) == set(want)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.slow
def test_each_rank_holds_its_share_of_every_expert_on_a_non_expert_dim(chain):
    for rank, report in enumerate(chain["a"]):
        ep, edp = report["ep"], report["edp"]
        assert (ep, edp) == (2, 2)
        assert len(report["experts"]) == 2 * 3  # two MoE layers x w1, w2, w3
        for name, info in report["experts"].items():
            assert info["local_numel"] == math.ceil(info["numel"] / (ep * edp)), (rank, name, info)
            fsdp_dim = 2 if name.endswith("w2") else 1  # the hidden dim (32, even over edp), never the expert dim
            assert info["placements"][0] == f"Shard({fsdp_dim})", (rank, name, info)
            assert info["placements"][1] == "Shard(0)", (rank, name, info)  # ep
            assert info["local_shape"][0] == 1 and info["local_shape"][fsdp_dim] == 16, (rank, name, info)


@pytest.mark.slow
def test_checkpoints_of_sharded_experts_resume_on_other_layouts(chain):
    """Saved sharded on dims 1/2, loaded under tp2·ep2 (experts split over tp, no edp), saved there and
    loaded back into the sharded layout: the weights and Adam moments arrive bit for bit, every step
    is the single-process step, and the checkpoint consolidates in one process to the same tensors."""
    from lightning_moe.checkpoint.consolidate import consolidate

    for source, target in (("a", "b"), ("b", "c")):
        saved, loaded = chain[source][0]["state"], chain[target][0]["loaded"]
        assert set(saved) == set(loaded)
        assert [n for n in saved if not torch.equal(saved[n], loaded[n])] == [], (source, target)
    consolidated = consolidate(chain["first"], with_optimizer=True)
    assert [n for n, t in chain["a"][0]["state"].items() if not torch.equal(consolidated[n], t)] == []
    reference = _reference_after(4)
    for rank in range(4):
        _assert_close(chain["b"][rank]["losses"], reference["losses"][2:3], f"tp2·ep2 rank {rank}")
        _assert_close(chain["c"][rank]["losses"], reference["losses"][3:4], f"ep2·dp2 rank {rank}")
    _assert_state_close(chain["c"][0]["state"], reference["state"])


def meta_init_case() -> dict:
    from torch.distributed.tensor import DTensor

    from lightning_moe import parallelize
    from lightning_moe.models import MoEGPT
    from lightning_moe.parallel.plans.init import materialize_sharded

    dims = layout(**SHARDED)
    torch.manual_seed(7)
    reference = MoEGPT(**MODEL)
    torch.manual_seed(7)
    with torch.device("meta"):
        model = MoEGPT(**MODEL)
    parallelize(model, dims)
    materialize_sharded(model, torch.device("cpu"), model.initial_value)
    want = dict(reference.named_parameters())
    mismatches, placements = [], set()
    for name, param in model.named_parameters():
        if ".experts." in name:
            placements.add(_placement(param.placements[0]))
        whole = param.full_tensor() if isinstance(param, DTensor) else param
        if not torch.equal(whole, want[name].detach()):
            mismatches.append(name)
    return {"mismatches": mismatches, "placements": sorted(placements)}


@pytest.mark.slow
def test_meta_device_shards_on_the_hidden_dim_equal_the_eager_model():
    for rank, report in enumerate(get_pool(4).run(meta_init_case)):
        assert report["placements"] == ["Shard(1)", "Shard(2)"], report
        assert not report["mismatches"], f"rank {rank}: {report['mismatches']}"

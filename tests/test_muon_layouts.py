"""Muon on every layout: ``model.optimizer=muon`` gives the single-process losses (rel 1e-5) on the
presets, on a Hugging Face family and on a user module that returns ``Muon(self)``, and its state
resumes on another layout (ep2 -> tp2 and back) with the uninterrupted numbers.

The suite runs 4 steps per layout (the full 20-step sweep over every preset of at most 8 processes is
in docs/muon.md); one 6-step single-process run is the reference of all of them (the schedule is
sized by ``model.max_steps=6`` everywhere, so a 4-step run follows its first 4 steps).
"""

from __future__ import annotations

import pytest
import torch

from lightning_moe.optim import Muon
from tests.cli import train_in_pool
from tests.scripts.user_moe_module import UserMoELM
from tests.test_strategy_invariance import DEFAULT_DATA_RUN, _preset_processes

REL = 1e-5
STEPS = 4
MUON_RUN = [
    *(o for o in DEFAULT_DATA_RUN if not o.startswith("trainer.max_steps=")),
    "model.optimizer=muon",
    "model.max_steps=6",
    f"trainer.max_steps={STEPS}",
]
# By process count (the runs of one count share a test pool): the dims Muon gathers over, one by one
# and together: FSDP (dp), experts (ep, edp split), tp with FSDP's strided shards, folded ep, pp, cp.
PRESETS = sorted(
    ["ep2", "dp2", "tp2", "pp2", "cp2", "tp2_ep2_folded", "tp2_etp1_ep2", "dp2_ep2_hsdp"], key=_preset_processes
)


def _same_curve(losses: list[float], reference: list[float]) -> None:
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=REL, atol=0.0)


@pytest.fixture(scope="module")
def single_losses(tmp_path_factory) -> list[float]:
    summary = train_in_pool(
        tmp_path_factory.mktemp("muon_single") / "run", "parallel=single", "trainer.max_steps=6", base=MUON_RUN
    )
    assert len(summary["losses"]) == 6
    return summary["losses"]


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_muon_preset_matches_single_process(tmp_path, single_losses, preset):
    summary = train_in_pool(tmp_path / preset, f"parallel={preset}", base=MUON_RUN)
    _same_curve(summary["losses"], single_losses[:STEPS])


@pytest.mark.slow
@pytest.mark.parametrize("source,target", [("ep2", "tp2"), ("tp2", "ep2")])
def test_muon_state_resumes_on_another_layout(tmp_path, single_losses, source, target):
    """3 steps on ``source``, a DCP checkpoint, 3 more on ``target``: steps 4-6 of the single run."""
    first = tmp_path / "first"
    train_in_pool(
        first,
        f"parallel={source}",
        "trainer.max_steps=3",
        "callbacks=checkpoint",
        "callbacks.checkpoint.every_n_train_steps=3",
        base=MUON_RUN,
    )
    resumed = train_in_pool(
        tmp_path / "resumed",
        f"parallel={target}",
        "trainer.max_steps=6",
        f"ckpt_path={first / 'checkpoints' / 'last.ckpt'}",
        base=MUON_RUN,
    )
    assert len(resumed["losses"]) == 3, "the resumed run starts at step 4"
    _same_curve(resumed["losses"], single_losses[3:])


class UserMoELMWithMuon(UserMoELM):
    """The user module of tests/scripts/user_moe_module.py, trained with ``Muon(self)``."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return Muon(self, lr=1e-2)


USER_RUN = [
    *(o for o in MUON_RUN if not o.startswith("model.")),
    "model=custom",
    f"model._target_={__name__}.UserMoELMWithMuon",
]
HF_RUN = [
    *(o for o in MUON_RUN if not o.startswith("model.")),
    "model=hf_tiny_qwen3_moe",
    "model.optimizer=muon",
    "model.max_steps=6",
]


@pytest.mark.slow
@pytest.mark.parametrize("name,base", [("user_module", USER_RUN), ("hf_qwen3_moe", HF_RUN)])
def test_muon_user_module_and_hf_family_match_single_process_on_tp2_ep2(tmp_path, name, base):
    single = train_in_pool(tmp_path / "single", "parallel=single", base=base)
    sharded = train_in_pool(tmp_path / "tp2_ep2", "parallel=tp2_ep2", base=base)
    assert len(single["losses"]) == STEPS
    _same_curve(sharded["losses"], single["losses"])


# -- bytes: the comm accounting of one Muon step against the planner's model ---------------------------
BYTES_MODEL = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 4}
BYTES_MOE = {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 32}


def muon_step_bytes(sizes: dict, fold_ep: str | None = None) -> dict[str, int]:
    """One Muon step of MoEGPT on the layout ``sizes`` (gradients set by hand: only the optimizer's
    traffic counts), its collectives counted per dim as the comm accounting callback counts them."""
    from torch.distributed.tensor import DTensor

    from lightning_moe import comm, parallelize
    from lightning_moe.callbacks.comm_accounting import count_collectives
    from lightning_moe.comm.traffic import group_dims
    from lightning_moe.models import MoEGPT
    from tests.dist_pool import layout

    dims = layout(**sizes, **({"fold_ep": fold_ep} if fold_ep else {}))
    torch.manual_seed(0)
    model = MoEGPT(**BYTES_MODEL, moe=BYTES_MOE)
    parallelize(model, dims)
    optimizer = Muon(model)
    for param in model.parameters():
        param.grad = torch.ones_like(param) if isinstance(param, DTensor) else torch.ones(param.shape)
    optimizer.step()  # the first step sets up the shard groups
    comm.reset()
    with count_collectives(group_dims(dims)):
        optimizer.step()
    return {dim: counts["bytes"] for dim, counts in comm.snapshot().items()}


@pytest.mark.slow
@pytest.mark.parametrize(
    "sizes,fold_ep",
    [({"ep": 2}, None), ({"dp": 2}, None), ({"tp": 2}, None), ({"tp": 2, "ep": 2}, "tp")],
    ids=["ep2", "dp2", "tp2", "tp2_ep2_folded"],
)
def test_muon_bytes_per_dim_equal_the_planners_model(sizes, fold_ep):
    from lightning_moe.layout import PARALLEL_DIMS
    from lightning_moe.planner.candidate import Layout
    from lightning_moe.planner.model_shape import ModelShape
    from lightning_moe.planner.muon import muon_comm_bytes
    from tests.dist_pool import get_pool

    per_rank = get_pool(2).run(muon_step_bytes, sizes=sizes, fold_ep=fold_ep)
    shape = ModelShape(**BYTES_MODEL, num_experts=4, top_k=2, moe_ffn_hidden_size=32, shared_expert_hidden_size=None)
    etp = 1 if fold_ep else sizes.get("tp", 1)
    planned = muon_comm_bytes(shape, Layout(**sizes, etp=etp, fold_ep=(fold_ep,) if fold_ep else ()))
    for dim in (*PARALLEL_DIMS, "other"):
        measured = sum(rank.get(dim, 0) for rank in per_rank) / len(per_rank)
        assert measured == pytest.approx(planned[dim], abs=0.5), (dim, per_rank, planned)
    assert sum(planned.values()) > 0

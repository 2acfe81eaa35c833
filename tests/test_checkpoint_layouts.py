"""Checkpoints move between layouts: train 5 steps on A, resume on B, get the uninterrupted single-process curve.

Every pair compares steps 6-10 with 10 uninterrupted steps on one process (rel 1e-5, fp32, clipping
on): model, Adam moments, LR schedule, step counters, RNG and the data position all carry over.
The 4-layer tiny model lets the interleaved pipeline (4 virtual stages) take part.
"""

from __future__ import annotations

import pytest
import torch

from tests.cli import TINY_RUN, run_cli_error, train_in_pool

REL = 1e-5
FOUR_LAYERS = ["model.num_layers=4"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    summary = train_in_pool(tmp_path_factory.mktemp("reference") / "run", "parallel=single", *FOUR_LAYERS)
    assert len(summary["losses"]) == 10
    return summary["losses"]


_CHECKPOINTS: dict[str, object] = {}


def checkpoint_after_5_steps(tmp_path_factory, name: str, *overrides: str):
    """Train 5 of the 10 scheduled steps on a layout (once per test session) and return its DCP folder."""
    if name not in _CHECKPOINTS:
        run_dir = tmp_path_factory.mktemp(f"ckpt_{name}") / "run"
        train_in_pool(
            run_dir,
            *overrides,
            *FOUR_LAYERS,
            "trainer.max_steps=5",
            "model.max_steps=10",
            "callbacks=checkpoint",
            "callbacks.checkpoint.every_n_train_steps=5",
        )
        ckpt = run_dir / "checkpoints" / "last.ckpt"
        one_file = "parallel.save_distributed_checkpoint=false" in overrides
        assert ckpt.is_file() if one_file else ckpt.is_dir(), (
            "one file of whole tensors, or a sharded DCP checkpoint folder"
        )
        assert not list(run_dir.glob("checkpoints/*.staging")), "no half-written checkpoint is left behind"
        _CHECKPOINTS[name] = ckpt
    return _CHECKPOINTS[name]


# (id, layout A, layout B): each A checkpoint is written once and resumed by every pair that names it.
A_LAYOUTS = {
    "ep2": ["parallel=ep2"],
    "tp2": ["parallel=tp2"],
    "pp2_interleaved": ["parallel=pp2_interleaved"],
    "dp2_tp2_ep2": ["parallel=dp2_tp2_ep2"],  # 8 processes
    "tp2_ep2_folded": ["parallel=tp2_ep2_folded"],  # experts at ep2 over the tp ranks: 2 processes
    "ep2_one_file": ["parallel=ep2", "parallel.save_distributed_checkpoint=false"],  # whole tensors from rank 0
    "pp2_uneven": ["parallel=pp2", "parallel.pp_stage_layers=[1,3]"],  # stage 0 holds 1 layer, stage 1 three
}
# By the target's process count: the runs of one count share a test pool, which starts once.
PAIRS = [
    ("ep2_to_pp2", "ep2", ["parallel=pp2"]),  # pp 1 -> 2
    ("tp2_to_cp2", "tp2", ["parallel=cp2"]),
    ("interleaved_to_1f1b", "pp2_interleaved", ["parallel=pp2"]),
    # Uneven stages (pp_stage_layers) to an even split and from one.
    ("uneven_1_3_to_even_pp2", "pp2_uneven", ["parallel=pp2"]),
    ("interleaved_to_uneven_3_1", "pp2_interleaved", ["parallel=pp2", "parallel.pp_stage_layers=[3,1]"]),
    ("8_processes_to_ep2", "dp2_tp2_ep2", ["parallel=ep2"]),
    ("ep2_to_ep4", "ep2", ["parallel=ep4"]),
    ("fsdp_to_ddp", "ep2", ["parallel=dp2_ep2", "parallel.data_parallel=ddp"]),
    # Parallel folding both ways: the experts' ep group over tp ranks <-> ep ranks of their own.
    ("unfolded_to_folded_cp2_tp2_ep4", "ep2", ["parallel=cp2_tp2_ep4_folded"]),
    ("folded_to_unfolded_tp2_etp1_ep2", "tp2_ep2_folded", ["parallel=tp2_etp1_ep2"]),
    ("one_file_ep2_to_tp2", "ep2_one_file", ["parallel=tp2"]),
    ("ep2_to_single", "ep2", ["parallel=single"]),  # ep 2 -> 1, accumulation 2 -> 4
    (
        "pp2_to_single_micro4",
        "pp2_interleaved",
        ["parallel=single", "data.micro_batch_size=4"],
    ),  # pp 2 -> 1, micro 2 -> 4
]


@pytest.mark.slow
@pytest.mark.parametrize("name,source,target", PAIRS, ids=[pair[0] for pair in PAIRS])
def test_resume_on_another_layout_continues_the_single_process_curve(
    tmp_path, tmp_path_factory, reference, name, source, target
):
    ckpt = checkpoint_after_5_steps(tmp_path_factory, source, *A_LAYOUTS[source])
    resumed = train_in_pool(tmp_path / name, *target, *FOUR_LAYERS, "model.max_steps=10", f"ckpt_path={ckpt}")
    assert len(resumed["losses"]) == 5, "the resumed run starts at step 6"
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(reference[5:]), rtol=REL, atol=0.0)


# Two experts: dp2·ep2 holds one expert per ep rank, fewer than its edp group of 2, so FSDP2 splits
# each expert on its hidden dim (lightning_moe.parallel.plans.data_parallel.expert_shard_dim).
TWO_EXPERTS_RUN = [o for o in TINY_RUN if not o.startswith("model.moe.num_experts=")] + ["model.moe.num_experts=2"]


@pytest.mark.slow
def test_dp2_ep2_experts_sharded_on_the_hidden_dim_resume_on_one_process(tmp_path):
    reference = train_in_pool(tmp_path / "reference", "parallel=single", *FOUR_LAYERS, base=TWO_EXPERTS_RUN)["losses"]
    source = tmp_path / "source"
    train_in_pool(
        source,
        "parallel=dp2_ep2",
        *FOUR_LAYERS,
        "trainer.max_steps=5",
        "model.max_steps=10",
        "callbacks=checkpoint",
        "callbacks.checkpoint.every_n_train_steps=5",
        base=TWO_EXPERTS_RUN,
    )
    ckpt = source / "checkpoints" / "last.ckpt"
    resumed = train_in_pool(
        tmp_path / "resumed",
        "parallel=single",
        *FOUR_LAYERS,
        "model.max_steps=10",
        f"ckpt_path={ckpt}",
        base=TWO_EXPERTS_RUN,
    )["losses"]
    assert len(resumed) == 5, "the resumed run starts at step 6"
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(reference[5:]), rtol=REL, atol=0.0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["model.hidden_size=48"],
            r"the checkpoint holds another model .*shape differs: .*tok_embeddings.weight is \(256, 32\)",
        ),
        (["parallel=ep4", "model.moe.num_experts=6"], r"num_experts 6 is not divisible by ep 4"),
    ],
    ids=["another_model", "experts_not_divisible"],
)
def test_bad_resume_fails_before_training(tmp_path, tmp_path_factory, overrides, message):
    import re

    ckpt = checkpoint_after_5_steps(tmp_path_factory, "ep2", *A_LAYOUTS["ep2"])
    output = run_cli_error(tmp_path / "bad", *FOUR_LAYERS, "model.max_steps=10", f"ckpt_path={ckpt}", *overrides)
    assert re.search(message, output, re.S), output[-3000:]


@pytest.mark.slow
def test_missing_checkpoint_folder_names_itself(tmp_path):
    output = run_cli_error(tmp_path / "bad", *FOUR_LAYERS, f"ckpt_path={tmp_path / 'nowhere' / 'last.ckpt'}")
    assert "nowhere/last.ckpt" in output and ("does not exist" in output or "not found" in output.lower()), output[
        -3000:
    ]


# -- the checkpoint CLI and crash safety -------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("source", sorted(name for name in A_LAYOUTS if name != "ep2_one_file"))  # DCP folders
def test_consolidate_equals_the_single_process_state_after_the_same_steps(tmp_path, tmp_path_factory, source):
    """Model and Adam moments, consolidated from any layout's checkpoint in this plain process."""
    from lightning_moe.checkpoint.__main__ import main

    single = checkpoint_after_5_steps(tmp_path_factory, "single", "parallel=single")
    other = checkpoint_after_5_steps(tmp_path_factory, source, *A_LAYOUTS[source])
    for ckpt, out in ((single, tmp_path / "single.pt"), (other, tmp_path / "other.pt")):
        assert main(["consolidate", str(ckpt), str(out), "--with-optimizer"]) == 0
    want, got = (
        torch.load(tmp_path / "single.pt", weights_only=True),
        torch.load(tmp_path / "other.pt", weights_only=True),
    )
    assert "tok_embeddings.weight" in want and "layers.3.feed_forward.experts.w1" in want
    assert set(got) == set(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-7, msg=key)


@pytest.mark.slow
def test_inspect_reports_layout_step_samples_and_tensors(tmp_path_factory, capsys):
    from lightning_moe.checkpoint.__main__ import main

    ckpt = checkpoint_after_5_steps(tmp_path_factory, "ep2", *A_LAYOUTS["ep2"])
    assert main(["inspect", str(ckpt)]) == 0
    report = capsys.readouterr().out
    assert "layout: tp=1 cp=1 ep=2 dp=1 pp=1 etp=1" in report
    assert "global step: 5" in report and "samples consumed in the epoch: 40" in report  # 5 steps x 8 samples
    assert "state_dict.layers.0.feed_forward.experts.w1" in report and "(4, 32, 32)" in report


def test_cli_errors_on_a_missing_folder(tmp_path, capsys):
    from lightning_moe.checkpoint.__main__ import main

    assert main(["consolidate", str(tmp_path / "missing"), str(tmp_path / "out.pt")]) == 2
    assert "missing does not exist" in capsys.readouterr().err


def test_pickled_objects_are_refused(tmp_path):
    """Loading never runs code from a checkpoint: a meta.pt holding a pickled object is refused."""
    from lightning_moe.checkpoint import read_metadata

    class Payload:
        def __reduce__(self):  # would run on an unrestricted torch.load
            return (print, ("code ran",))

    folder = tmp_path / "last.ckpt"
    folder.mkdir()
    torch.save({"global_step": 5, "payload": Payload()}, folder / "meta.pt")
    with pytest.raises(ValueError, match=r"holds pickled Python objects, which lightning-moe refuses to load"):
        read_metadata(folder)
    torch.save({"global_step": 5, "loops": {}, "weights": torch.ones(2)}, folder / "meta.pt")
    assert read_metadata(folder)["global_step"] == 5


def test_an_interrupted_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    from lightning_moe.checkpoint.state import PREVIOUS_SUFFIX, STAGING_SUFFIX, resolve_checkpoint_path

    path = tmp_path / "last.ckpt"
    path.mkdir()
    # Interrupted while writing the staging folder: the old checkpoint is still in place.
    (tmp_path / f"last.ckpt{STAGING_SUFFIX}").mkdir()
    assert resolve_checkpoint_path(path) == path
    # Interrupted between the two renames: only the previous one is complete.
    path.rename(tmp_path / f"last.ckpt{PREVIOUS_SUFFIX}")
    assert resolve_checkpoint_path(path) == tmp_path / f"last.ckpt{PREVIOUS_SUFFIX}"


def test_batch_counters_follow_the_new_accumulation():
    from lightning_moe.checkpoint import rescale_batch_progress

    def loops(processed: int) -> dict:
        counters = {"ready": processed, "started": processed, "processed": processed, "completed": processed - 1}
        return {"fit_loop": {"epoch_loop.batch_progress": {"total": dict(counters), "current": dict(counters)}}}

    state = loops(20)  # 5 steps x 4 batches, saved inside the 20th batch
    rescale_batch_progress(state, old_accumulate=4, new_accumulate=2)
    assert state["fit_loop"]["epoch_loop.batch_progress"]["current"] == {
        "ready": 10,
        "started": 10,
        "processed": 10,
        "completed": 9,
    }
    with pytest.raises(ValueError, match=r"saved after 21 training batches, not at an optimizer step"):
        rescale_batch_progress(loops(21), old_accumulate=4, new_accumulate=2)


@pytest.mark.slow
def test_to_hf_writes_mixtral_with_the_same_logits(tmp_path, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from lightning_moe.checkpoint.__main__ import main
    from lightning_moe.checkpoint.consolidate import consolidate
    from lightning_moe.checkpoint.state import read_metadata
    from lightning_moe.models import MoEGPT

    ckpt = checkpoint_after_5_steps(tmp_path_factory, "ep2", *A_LAYOUTS["ep2"])
    assert main(["to-hf", str(ckpt), str(tmp_path / "hf")]) == 0
    model = MoEGPT(**read_metadata(ckpt)["hyper_parameters"])
    model.load_state_dict(consolidate(ckpt))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(hf).__name__ == "MixtralForCausalLM"
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model.eval()(tokens), rtol=1e-5, atol=1e-6)


def test_moegpt_without_a_mixtral_equivalent_is_refused():
    from lightning_moe.hf.moegpt import moegpt_to_mixtral
    from lightning_moe.models import MoEGPT

    model = MoEGPT(
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        moe_layer_freq=2,
        moe={"num_experts": 4, "ffn_hidden_size": 32, "shared_expert_hidden_size": 32},
    )
    with pytest.raises(
        ValueError, match=r"does not map exactly onto Mixtral: moe_layer_freq=2 leaves dense layers.*a shared expert"
    ):
        moegpt_to_mixtral(model)


def _fit_loop_state(*, epoch_closed: bool, last_batch: bool) -> dict:
    """The counters Lightning saves after 12 training batches of one epoch (3 steps of 4 batches)."""

    def progress(done: int, running: int) -> dict:
        counters = {"ready": done, "started": done, "processed": done, "completed": running}
        return {"total": dict(counters), "current": dict(counters)}

    epoch_done = 1 if epoch_closed else 0
    epochs = progress(1, epoch_done)
    for scope in ("total", "current"):
        epochs[scope]["processed"] = epoch_done
    return {
        "epoch": epoch_done,
        "loops": {
            "fit_loop": {
                "epoch_progress": epochs,
                "epoch_loop.batch_progress": {**progress(12, 12 if epoch_closed else 11), "is_last_batch": last_batch},
                "epoch_loop.state_dict": {"_batches_that_stepped": 3 if epoch_closed else 2},
                "state_dict": {"combined_loader": [{"epoch": epoch_done, "samples_consumed": 24}]},
            }
        },
    }


def test_a_checkpoint_saved_when_max_steps_cuts_the_epoch_reads_as_saved_at_that_step():
    """ModelCheckpoint's last.ckpt at the end of a max_steps run resumes in the same epoch, at the next sample."""
    from lightning_moe.checkpoint import rewind_epoch_cut_short

    at_train_end = _fit_loop_state(epoch_closed=True, last_batch=False)
    rewind_epoch_cut_short(at_train_end)
    assert at_train_end == _fit_loop_state(epoch_closed=False, last_batch=False)
    # Saved at the step itself, or after the epoch ran out of data: left as Lightning wrote it.
    for state in (
        _fit_loop_state(epoch_closed=False, last_batch=False),
        _fit_loop_state(epoch_closed=True, last_batch=True),
    ):
        unchanged = _fit_loop_state(
            epoch_closed=state["epoch"] == 1,
            last_batch=state["loops"]["fit_loop"]["epoch_loop.batch_progress"]["is_last_batch"],
        )
        rewind_epoch_cut_short(state)
        assert state == unchanged

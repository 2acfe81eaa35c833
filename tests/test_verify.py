"""`python -m lightning_moe.verify` and `lightning_moe.verify_layout`: PASS on right layouts, a localised
FAIL on deliberate bugs (injected from outside the library by tests/scripts/verify_bugs.py), clear
errors on bad input.

Every case runs real multi-process Lightning runs. The verification worker (`lightning_moe.verify.worker`,
which the runner starts as a new process through `run_worker`) runs on the ranks of the test pool instead,
as under torchrun, so that its processes' start-up and imports are paid once per pool; the case that starts
the CLI itself (a refusal, exit code 2) and the README's verify command (a PASS, exit code 0,
tests/test_readme.py) start the CLI and its workers as a user's run does. The CLI's own work, composing and
checking the config, is done in the test process; one single-process reference per model is shared through
`verify.cache_dir`, and most cases record module outputs in the main runs (`verify.localize=always`) so that
a failure needs no re-run. The data config is the default one
(global batch 16, `micro_batch_size` unset) with shorter sequences and a smaller corpus: a correct
module must PASS with what a user gets without setting anything.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import warnings
from functools import partial
from pathlib import Path

import pytest
import torch

from tests.cli import ROOT
from tests.dist_pool import pool_of, trim_pools
from tests.launched_rank import launched_rank

# The default data config (global_batch_size 16, micro_batch_size unset), shorter and smaller. Clipping
# is active at this size: a mis-scaled gradient changes the steps after the first.
DATA = ["logger=none", "++trainer.gradient_clip_val=0.05", "data.seq_len=32", "data.max_corpus_bytes=200000"]
MOEGPT = [
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.moe.num_experts=4",
    "model.moe.ffn_hidden_size=32",
]
# The user module of docs/own-module.md: its own attention through SDPA, LayerNorms, learned positions, a TP plan
# without SequenceParallel styles, MoE layers with DeepSeek-V3-style expert bias and a shared expert,
# lr 1e-2 (Adam turns the rounding noise of near-zero gradients into visible differences in weights).
USER = ["~model", "+model._target_=tests.scripts.user_moe_module.UserMoELM"]
BUG = "+verify.callbacks.bug._target_=tests.scripts.verify_bugs."


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("verify_cache")


@pytest.fixture(autouse=True)
def workers_in_the_pool(monkeypatch):
    monkeypatch.setattr("lightning_moe.verify.runner.run_worker", worker_in_pool)


def worker_in_pool(spec_path: Path, devices: int, timeout_s: float) -> int:
    """What ``run_worker`` starts, on the ``devices`` ranks of a test pool: the same exit code (1 when a rank
    raised) and ``log.txt`` (every rank's output, or the failed rank's traceback). ``timeout_s`` gives way to
    the pool's own task timeout."""
    try:
        outputs = pool_of(devices).run(_verify_worker_on_this_rank, spec_path=str(spec_path))
    except AssertionError as failure:  # the pool's report of a rank that raised
        (spec_path.parent / "log.txt").write_text(str(failure))
        return 1
    (spec_path.parent / "log.txt").write_text("".join(outputs))
    return 0


def _verify_worker_on_this_rank(spec_path: str) -> str:
    from lightning_moe.verify.worker import SPEC_ENV, main

    with launched_rank(env={SPEC_ENV: "1"}, capture=True) as output:
        main(spec_path)
    return output.text


def run_verify(
    run_dir: Path, cache: Path, *overrides: str, timeout: int = 600, data: list[str] = DATA, cli: bool = False
) -> tuple[int, str, dict | None]:
    """What ``python -m lightning_moe.verify`` does after ``data`` (default DATA); returns (exit code, stdout +
    stderr, verify.json or None).

    By default the CLI's work runs in this process (:func:`_verify_in_process`): the config composed from
    the same overrides, ``verify_config`` called, its exit code mapped as ``main`` maps it; its runs go to the
    test pool (:func:`worker_in_pool`). ``cli=True`` starts the CLI itself, which starts its runs' processes
    (their imports of torch and Lightning cost 5-10 s on 2 loaded cores).
    """
    overrides = (*data, *overrides, f"verify.cache_dir={cache}")
    if not cli:
        return _verify_in_process(run_dir, overrides)
    trim_pools()  # the launched processes get the cores but for a few idle pool ranks
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "lightning_moe.verify", *overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    path = run_dir / "verify.json"
    return proc.returncode, proc.stdout + proc.stderr, json.loads(path.read_text()) if path.exists() else None


def _verify_in_process(run_dir: Path, overrides: tuple[str, ...]) -> tuple[int, str, dict | None]:
    """``lightning_moe.verify.__main__.main`` without a new Python process.

    The config is composed as the CLI composes it; the one ``${hydra:...}`` in it
    (``trainer.default_root_dir``, the Hydra output dir, which ``job_from_config`` replaces by None) is
    given ``run_dir``. The launched runs get what the CLI's environment gave them: ``OMP_NUM_THREADS=1``
    and the repository on ``PYTHONPATH`` (tests.scripts.*), and the repository as working directory.
    Warnings the CLI would have printed on stderr are appended to the output.
    """
    from hydra import compose, initialize_config_dir

    from lightning_moe.conf import CONF_DIR
    from lightning_moe.verify.__main__ import verify_config
    from lightning_moe.verify.runner import VerifyConfigError

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("verify", overrides=[*overrides, f"trainer.default_root_dir={run_dir}"])
    run_dir.mkdir(parents=True, exist_ok=True)  # as Hydra does before the job starts
    out, err = io.StringIO(), io.StringIO()
    saved_env = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "PYTHONPATH")}
    saved_cwd = os.getcwd()
    os.environ.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    os.chdir(ROOT)
    try:
        with (
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
            warnings.catch_warnings(record=True) as caught,
        ):
            warnings.simplefilter("default")
            try:
                code = 0 if verify_config(cfg, run_dir).passed else 1
            except VerifyConfigError as error:
                print(f"verify: error: {error}", file=sys.stderr)
                code = 2
    finally:
        os.chdir(saved_cwd)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    shown = "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in caught)
    path = run_dir / "verify.json"
    return code, out.getvalue() + err.getvalue() + shown, json.loads(path.read_text()) if path.exists() else None


def _moegpt_parameter_names() -> set[str]:
    """The parameters of the model the verify CLI builds from the same overrides (composed here)."""
    import hydra
    from hydra import compose, initialize_config_dir

    from lightning_moe.conf import CONF_DIR

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("verify", overrides=[*DATA, *MOEGPT])
    return {name for name, _ in hydra.utils.instantiate(cfg.model).named_parameters()}


# -- PASS ------------------------------------------------------------------------------------------
# ep2 alone (its expert shards are reassembled as in tp2_ep2, and the README's `verify parallel=ep2`
# passes in `make test`) runs in `make test-long`, for MoEGPT and for the user module.
EP2_IN_TEST_LONG = pytest.param("ep2", marks=pytest.mark.long)


@pytest.mark.slow
@pytest.mark.parametrize("preset", [EP2_IN_TEST_LONG, "tp2_ep2", "cp2", "pp2"])
def test_moegpt_layout_passes_and_lists_every_parameter(tmp_path, cache, preset):
    code, out, report = run_verify(tmp_path / preset, cache, *MOEGPT, f"parallel={preset}", "verify.localize=always")
    assert code == 0, out[-4000:]
    assert "PASS" in out and "FAIL" not in out
    assert report is not None and report["passed"] is True
    names = _moegpt_parameter_names()
    assert {p["name"] for p in report["parameters"]} == names
    table = out.split("parameter", 1)[1]
    assert all(f"\n{name} " in table for name in names)
    assert len(report["losses"]) == 3 and all(r["rel"] <= 1e-5 for r in report["losses"])
    assert all(p["grad_rel"] <= 1e-5 and p["final_rel"] <= 1e-5 for p in report["parameters"])
    assert report["micro_batching"] is None  # the reference cut every step into the layout's micro-batches
    # The module outputs at step 1 were reassembled (DTensor/TP shards, CP zigzag, pipeline stages) and match.
    compared = [m for m in report["modules"] if m.get("output") is not None]
    assert len(compared) >= 20 and all(m["output"] <= 1e-5 for m in compared), report["modules"]


@pytest.mark.slow
@pytest.mark.parametrize("preset", [EP2_IN_TEST_LONG, "tp2_ep2"])
def test_user_module_passes_with_default_data(tmp_path, cache, preset):
    code, out, report = run_verify(tmp_path / preset, cache, *USER, f"parallel={preset}", "verify.localize=always")
    assert code == 0, out[-4000:]
    assert "PASS" in out and report["passed"] and report["micro_batching"] is None
    from tests.scripts.user_moe_module import UserMoELM

    rows = {p["name"]: p for p in report["parameters"]}
    assert set(rows) == {name for name, _ in UserMoELM().named_parameters()} | {
        f"blocks.{i}.moe.router.expert_bias" for i in (0, 1)
    }
    assert all(rows[f"blocks.{i}.moe.router.weight"]["grad_rel"] <= 1e-5 for i in (0, 1))
    assert all(p["grad_rel"] <= 1e-5 for p in rows.values())
    # A final weight outside rtol passes only where step-1 gradient rounding explains it, and says so.
    for p in rows.values():
        if p["final_rel"] > 1e-5 and not p["zero_grad"]:
            assert p["final_excess"] <= 1e-5 and "optimizer noise" in p["note"], p
    compared = [m for m in report["modules"] if m.get("output") is not None]
    assert len(compared) >= 20 and all(m["output"] <= 1e-5 for m in compared)


@pytest.mark.slow
def test_micro_batching_that_cannot_be_matched_explains_the_fail_and_names_the_fix(tmp_path, cache):
    code, out, report = run_verify(
        tmp_path / "unsized",
        cache,
        *MOEGPT,
        "parallel=ep2",
        "verify.localize=always",
        "~data",
        "+data._target_=tests.scripts.verify_models.UnsizedLayoutBatchDataModule",
        "+data.seq_len=32",
        "+data.max_corpus_bytes=200000",
        data=[o for o in DATA if not o.startswith("data.")],
    )
    assert code == 1, out[-4000:]
    assert report["micro_batching"] == {
        **report["micro_batching"],
        "single_micro_batch_size": 16,
        "layout_micro_batch_size": 8,
    }
    # The forward is the same; the load-balancing loss of other micro-batches reaches the routers.
    assert all(m["output"] <= 1e-5 for m in report["modules"] if m.get("output") is not None)
    rows = {p["name"]: p for p in report["parameters"]}
    assert rows["layers.0.feed_forward.router.weight"]["grad_rel"] > 1e-5
    assert report["localisation"]["explained_by"] == "micro_batching"
    first = report["first_difference"]
    assert (
        "explained by micro-batching: the one-process run cut step 1 into 1 micro-batch of 16 samples, the"
        " layout into 2 data-parallel ranks x 1 micro-batch of 8 samples"
    ) in first
    assert "(load_balancing='aux_loss', routing='topk' in layers.0.feed_forward, layers.1.feed_forward)" in first
    assert "Fix: give the data module a micro_batch_size argument" in first and "'seq_aux_loss'" in first
    assert "explained by micro-batching" in out


# -- FAIL, localised -------------------------------------------------------------------------------
@pytest.mark.slow
def test_expert_gradient_times_two_names_the_experts_and_the_ratio(tmp_path, cache):
    # The default localisation (on_failure): step 1 is re-run with forward hooks. A FAIL is exit code 1 (the
    # README's command checks through the CLI process that a PASS is 0).
    code, out, report = run_verify(tmp_path / "x2", cache, *MOEGPT, "parallel=ep2", BUG + "ExpertGradientTimesTwo")
    assert code == 1, out[-4000:]
    assert "FAIL" in out
    loc = report["localisation"]
    assert loc["kind"] == "gradient" and loc["parameter"] == "layers.0.feed_forward.experts.w1", loc
    assert abs(loc["ratio"] - 2.0) < 1e-3
    assert "ratio 2.000 on all elements: a reduction divides by the wrong group size" in report["first_difference"]
    differing = {p["name"] for p in report["parameters"] if p["grad_rel"] > 1e-5}
    assert differing == {f"layers.{i}.feed_forward.experts.{w}" for i in (0, 1) for w in ("w1", "w2", "w3")}
    assert (tmp_path / "x2" / "layout_step1").is_dir()


@pytest.mark.slow
def test_dispatcher_dropping_a_token_names_the_moe_layer(tmp_path, cache):
    code, out, report = run_verify(
        tmp_path / "drop", cache, *MOEGPT, "parallel=ep2", "verify.localize=always", BUG + "DropLastTokenDispatcher"
    )
    assert code == 1, out[-4000:]
    loc = report["localisation"]
    assert loc == {**loc, "kind": "module_output", "module": "layers.0.feed_forward", "type": "MoELayer"}
    assert "first difference: layers.0.feed_forward (MoELayer) output, rel" in out
    assert "inputs equal" in report["first_difference"]


@pytest.mark.slow
def test_wrong_causal_ring_block_names_the_attention(tmp_path, cache):
    code, out, report = run_verify(
        tmp_path / "ring", cache, *MOEGPT, "parallel=cp2", "verify.localize=always", BUG + "WrongCausalRingBlock"
    )
    assert code == 1, out[-4000:]
    loc = report["localisation"]
    assert loc["kind"] == "forward_code" and loc["module"] == "layers.0.attention" and loc["type"] == "Attention", loc
    assert loc["child"] == "layers.0.attention.wo"
    modules = {m["module"]: m for m in report["modules"]}
    assert all(modules[f"layers.0.attention.{p}"]["output"] <= 1e-5 for p in ("wq", "wk", "wv"))


@pytest.mark.slow
def test_colwise_output_projection_names_the_projection(tmp_path, cache):
    code, out, report = run_verify(
        tmp_path / "colwise", cache, *USER, "parallel=tp2", "verify.localize=always", BUG + "ColwiseOutputProjection"
    )
    assert code == 1, out[-4000:]
    assert "in blocks.0.attn.out_proj (Linear) inside blocks.0.attn (SelfAttention)" in report["first_difference"]
    assert report["error"]["module"] == "blocks.0.attn.out_proj"


# -- the Python API --------------------------------------------------------------------------------
@pytest.mark.slow
def test_verify_layout_api_passes_with_the_layouts_micro_batches_and_turns_dropout_off(tmp_path):
    import lightning_moe
    from tests.scripts.verify_models import DropoutGPT, LayoutBatchDataModule

    model = partial(
        DropoutGPT,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        max_seq_len=32,
        moe={"num_experts": 4, "ffn_hidden_size": 32},
        dropout=0.2,
    )
    # Its micro_batch_size=None is one micro-batch per rank: 4 samples under ep2, 8 on one process.
    data = partial(LayoutBatchDataModule, seq_len=32, global_batch_size=8, max_corpus_bytes=200000)
    with pytest.warns(UserWarning, match=r"dropout is not disabled \(embed_dropout \(Dropout p=0.2\)\)"):
        report = lightning_moe.verify_layout(
            model,
            data,
            {"ep": 2},
            devices=2,
            steps=2,
            out_dir=tmp_path,
            trainer_kwargs={"accelerator": "cpu"},
            verbose=False,
        )
    assert isinstance(report, lightning_moe.VerifyReport)
    assert report.passed, str(report)
    assert len(report.losses) == 2 and report.layout["ep"] == 2
    assert any("dropout" in note for note in report.notes)
    # The reference ran again through datamodule_factory(micro_batch_size=4).
    assert report.micro_batching is None
    assert any(
        "the one-process reference runs with the layout's micro-batch size 4: with its own (1 micro-batch of"
        " 8 samples per step, against 2 data-parallel ranks x 1 micro-batch of 4 samples)" in note
        for note in report.notes
    ), report.notes
    assert json.loads((tmp_path / "verify.json").read_text())["passed"] is True


@pytest.mark.slow
def test_verify_layout_takes_every_layout_the_strategy_takes(tmp_path):
    """A folded layout (tp2 and ep2 over the same 2 processes) and HSDP, resolved as the strategy
    resolves them; the folded one with noise control (the reference again with another thread count)."""
    import lightning_moe
    from lightning_moe.data import ByteTextDataModule
    from lightning_moe.models import MoEGPT

    model = partial(
        MoEGPT,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        max_seq_len=32,
        moe={"num_experts": 4, "ffn_hidden_size": 32},
    )
    data = partial(ByteTextDataModule, seq_len=32, global_batch_size=8, max_corpus_bytes=200000)
    common = {
        "devices": 2,
        "steps": 2,
        "cache_dir": tmp_path / "cache",
        "trainer_kwargs": {"accelerator": "cpu"},
        "verbose": False,
    }
    folded = lightning_moe.verify_layout(
        model, data, {"tp": 2, "ep": 2, "fold_ep": "tp"}, out_dir=tmp_path / "folded", noise_control=True, **common
    )
    assert folded.passed and not folded.within_noise_floor, str(folded)
    assert folded.layout == {"tp": 2, "cp": 1, "ep": 2, "dp": 1, "pp": 1, "etp": 1, "fold_ep": "tp"}
    assert folded.model == "MoEGPT"
    saved = json.loads((tmp_path / "folded" / "verify.json").read_text())
    control = saved["noise_control"]
    assert control["control"] == "every initial parameter one rounding unit higher"
    assert len(control["losses"]) == 2 and all(rel <= 1e-5 for rel in control["loss_rel"])
    assert any(rel > 0 for rel in control["final_rel"].values())  # the nudge reaches the parameters
    assert all("control_rel" in row for row in saved["losses"])
    assert any(note.startswith("noise control: one process with every initial parameter") for note in folded.notes)
    # HSDP: 2 replica groups of 1 rank; the reference (FSDP on one process) is the folded one's, from the cache.
    hsdp = lightning_moe.verify_layout(
        model, data, {"data_parallel": "hsdp", "dp_replicate": 2}, out_dir=tmp_path / "hsdp", **common
    )
    assert hsdp.passed, str(hsdp)
    assert hsdp.layout == {"tp": 1, "cp": 1, "ep": 1, "dp": 2, "pp": 1, "etp": 1}
    assert hsdp.noise_control is None and "control_rel" not in hsdp.losses[0]


def test_layouts_are_resolved_as_the_strategy_resolves_them(tmp_path):
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    import lightning_moe
    from lightning_moe.conf import CONF_DIR
    from lightning_moe.verify.__main__ import job_from_config
    from lightning_moe.verify.localise import layout_dependent_statistics
    from lightning_moe.verify.runner import VerifyConfigError, one_process_options

    def job(preset: str):
        cfg = compose(
            "verify", overrides=[*DATA, *MOEGPT, "model.num_layers=4", f"parallel={preset}"], return_hydra_config=True
        )
        HydraConfig.instance().set_config(cfg)
        with open_dict(cfg):
            del cfg["hydra"]
        return job_from_config(cfg, tmp_path)

    expected = {
        "tp2_ep2_folded": (2, {"tp": 2, "cp": 1, "ep": 2, "dp": 1, "pp": 1, "etp": 1, "fold_ep": "tp"}),
        "dp2_ep2_hsdp": (4, {"tp": 1, "cp": 1, "ep": 2, "dp": 2, "pp": 1, "etp": 1}),
        "ep2_overlap": (2, {"tp": 1, "cp": 1, "ep": 2, "dp": 1, "pp": 1, "etp": 1}),
        "pp2_ep2_dualpipev": (4, {"tp": 1, "cp": 1, "ep": 2, "dp": 1, "pp": 2, "etp": 1}),
    }
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        jobs = {preset: job(preset) for preset in expected}
    for preset, (devices, layout) in expected.items():
        assert (jobs[preset].layout_devices, jobs[preset].layout) == (devices, layout), preset
        # The reference runs on one process without the layout's own options, which one process refuses.
        single = jobs[preset].single_body["config"]["parallel"]
        assert {k: single[k] for k in ("tp", "ep", "dp", "pp", "fold_ep", "dp_replicate", "overlap_ep_comm")} == {
            "tp": 1,
            "ep": 1,
            "dp": 1,
            "pp": 1,
            "fold_ep": None,
            "dp_replicate": None,
            "overlap_ep_comm": False,
        }
        assert single["data_parallel"] == "fsdp" and jobs[preset].single_body["config"]["trainer"]["devices"] == 1
    # Every layout of a module from Python shares one reference.
    assert one_process_options({"tp": 2, "ep": 2, "fold_ep": "tp"}, complete=True) == one_process_options(
        {"ep": 2, "data_parallel": "hsdp", "dp_replicate": 2, "overlap_ep_comm": True}, complete=True
    )
    # A layout that does not fit: the strategy's message, before any process starts.
    with pytest.raises(VerifyConfigError, match=r"^devices=3: world_size 3 is not divisible by tp\*cp\*ep\*pp"):
        lightning_moe.verify_layout(partial(torch.nn.Linear, 2, 2), dict, {"ep": 2}, devices=3)
    with pytest.raises(VerifyConfigError, match=r"^devices=2: .*dp_replicate"):
        lightning_moe.verify_layout(
            partial(torch.nn.Linear, 2, 2), dict, {"dp_replicate": 2, "data_parallel": "ddp"}, devices=2
        )
    # Folded over tp, ep's ranks hold the same samples: one micro-batch per micro-step, as on one process.
    routing = {"layers.0.feed_forward": {"load_balancing": "global_aux_loss", "aux_loss_coeff": 0.01}}
    assert layout_dependent_statistics(routing, expected["tp2_ep2_folded"][1]) == []
    assert "dp x ep = 4 micro-batches" in layout_dependent_statistics(routing, expected["dp2_ep2_hsdp"][1])[0]


# -- noise control (no processes: synthetic runs) ----------------------------------------------------
def _run(losses: list[float], final: dict[str, torch.Tensor], grad_scale: float = 1.0):
    """A one-rank RunData with these losses and final parameters (initial zeros, step-1 gradients ones)."""
    from lightning_moe.layout import MESH_DIMS as MESH
    from lightning_moe.verify.runs import RunData

    rank = {
        "rank": 0,
        "coords": dict.fromkeys(MESH, 0),
        "sizes": dict.fromkeys(MESH, 1),
        "start_order": ["", "w"],
        "types": {"": "Model", "w": "Linear"},
        "losses": losses,
        "initial": {n: torch.zeros_like(t) for n, t in final.items()},
        "grads": {n: torch.full_like(t, grad_scale) for n, t in final.items()},
        "final": final,
    }
    return RunData(Path("."), [rank], [])


def _drifting_losses(start: int, rel: float, steps: int = 6) -> list[float]:
    """Losses of 5.0 that differ by ``rel`` (relative) from step ``start`` on (1-based)."""
    return [5.0 * (1 + rel) if step >= start else 5.0 for step in range(1, steps + 1)]


def test_noise_control_passes_a_drift_within_the_noise_floor_and_fails_beyond_it():
    from lightning_moe.verify.numerics import NOISE_FLOOR_FACTOR, compare_runs, loss_noise_floors

    assert loss_noise_floors([0.0, 2e-4, 1e-4], factor=4.0) == [0.0, 8e-4, 8e-4]  # the drift so far
    weights = {"w.weight": torch.ones(4, 4)}
    single = _run(_drifting_losses(99, 0.0), weights)
    control = _run(_drifting_losses(4, 1e-3), {"w.weight": torch.ones(4, 4) * (1 + 1e-3)})
    # The layout drifts as the control does, from the same step: PASS within the noise floor.
    layout = _run(_drifting_losses(4, 2e-3), {"w.weight": torch.ones(4, 4) * (1 + 2e-3)})
    plain = compare_runs(single, layout, 1e-5)
    assert not plain.passed and plain.noise_control is None  # without the control: FAIL, as before
    report = compare_runs(single, layout, 1e-5, control)
    assert report.passed and report.within_noise_floor, str(report)
    assert [row["within_noise_floor"] for row in report.losses] == [False] * 3 + [True] * 3
    assert report.parameters[0].noise_floor == pytest.approx(NOISE_FLOOR_FACTOR * 1e-3, rel=1e-4)
    text = str(report)
    assert (
        "within the noise floor (one process vs itself with every initial parameter one rounding unit higher: rel 1.0e-03)"
        in text
    )
    assert (
        "PASS within the noise floor: 1 step-1 gradients within rtol 1e-05; 3 losses (steps 4-6) and 1 final"
        " parameter differ by more, by at most 2.0x what one process differs from itself with every initial"
        " parameter one rounding unit higher (the noise floor: 4x)"
    ) in text
    assert report.noise_control["control"] == "every initial parameter one rounding unit higher"
    assert report.noise_control["losses"] == pytest.approx(control.losses)
    assert report.noise_control["loss_floor"] == pytest.approx([0.0] * 3 + [NOISE_FLOOR_FACTOR * 1e-3] * 3)
    # Beyond the factor, or before the control drifts at all: FAIL, and the note says what is more than noise.
    far = compare_runs(single, _run(_drifting_losses(4, 1e-2), weights), 1e-5, control)
    assert not far.passed and not far.within_noise_floor
    assert far.notes[-1] == (
        "noise control: one process with every initial parameter one rounding unit higher differs"
        " from itself by loss rel"
        " 1.0e-03 at most, beyond rtol from step 4; the losses at steps 4, 5, 6 differ beyond 4x"
        " the control's difference: more than the noise it measured"
    )
    assert "<-- differs beyond the noise floor 4.0e-03" in str(far)
    early = compare_runs(single, _run(_drifting_losses(2, 1e-3), weights), 1e-5, control)
    assert not early.passed and [r["within_noise_floor"] for r in early.losses][:3] == [False] * 3
    # A final parameter beyond 4x the control's: FAIL.
    moved = compare_runs(single, _run(_drifting_losses(4, 1e-3), {"w.weight": torch.ones(4, 4) * 1.01}), 1e-5, control)
    assert not moved.passed and moved.parameters[0].noise_floor is None
    # A control that computes the same numbers bit for bit gives no floor, and says so.
    same = compare_runs(single, layout, 1e-5, _run(_drifting_losses(99, 0.0), weights))
    assert not same.passed and "computed the same losses and parameters bit for bit" in same.notes[-1]
    # Step-1 gradients get no floor, however far the control drifts later.
    grads = compare_runs(single, _run(_drifting_losses(4, 1e-3), weights, grad_scale=1.01), 1e-5, control)
    assert not grads.passed and grads.parameters[0].diverges(1e-5) == 0


# -- bad input -------------------------------------------------------------------------------------
@pytest.mark.slow
def test_nondeterministic_configure_model_is_refused(tmp_path, cache):
    code, out, _ = run_verify(
        tmp_path / "unseeded", cache, *MOEGPT, "parallel=ep2", "model._target_=tests.scripts.verify_models.UnseededGPT"
    )
    assert code == 2, out[-3000:]
    assert "is not deterministic under a fixed seed: output.weight differs between two builds" in out
    assert not (tmp_path / "unseeded" / "layout").exists()


@pytest.mark.slow
def test_too_many_processes_is_refused(tmp_path, cache):
    # Through the CLI process itself: a configuration that cannot be verified is exit code 2.
    code, out, _ = run_verify(
        tmp_path / "big", cache, *MOEGPT, "parallel=pp2_cp2_tp2_ep2", "verify.max_processes=8", cli=True
    )
    assert code == 2, out[-3000:]
    assert "the layout needs 16 processes, more than verify.max_processes=8" in out


# -- the comparison itself (no processes) ----------------------------------------------------------
def test_uniform_ratio_and_its_explanation():
    from lightning_moe.verify.numerics import describe_ratio, rel_diff, uniform_ratio

    b = torch.randn(64, 8)
    assert uniform_ratio(2 * b, b) == pytest.approx(2.0)
    assert uniform_ratio(b + 0.1 * torch.randn_like(b), b) is None
    assert describe_ratio(0.5).startswith("ratio 0.500 on all elements: a reduction divides by the wrong group size")
    assert "scale factor" in describe_ratio(1.37)
    assert rel_diff(b, b) == 0.0 and rel_diff(b[:3], b) == float("inf")
    # Below the floor (a fraction of the model's largest gradient), noise is measured against the floor.
    assert rel_diff(torch.tensor([2e-9]), torch.tensor([1e-9]), floor=1e-3) < 1e-5


def test_the_reference_gets_the_layouts_micro_batch_size_where_the_data_module_takes_one(tmp_path):
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import DictConfig, open_dict

    from lightning_moe.conf import CONF_DIR
    from lightning_moe.verify.__main__ import job_from_config
    from lightning_moe.verify.runner import accepts_micro_batch_size, pinned_single_body
    from tests.scripts.verify_models import LayoutBatchDataModule, UnsizedLayoutBatchDataModule

    assert accepts_micro_batch_size(partial(LayoutBatchDataModule, seq_len=32))
    assert not accepts_micro_batch_size(UnsizedLayoutBatchDataModule)

    def composed(*overrides: str) -> DictConfig:
        cfg = compose("verify", overrides=[*MOEGPT, "parallel=ep2", *overrides], return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)  # the config's ${hydra:...} paths resolve against it
        with open_dict(cfg):
            del cfg["hydra"]
        return cfg

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = composed(*DATA)
        unsized = composed(
            "logger=none",
            "~data",
            "+data.seq_len=32",
            "+data._target_=tests.scripts.verify_models.UnsizedLayoutBatchDataModule",
        )
    job = job_from_config(cfg, tmp_path)
    assert job.micro_batch_pin == "config" and job.single_body["config"]["data"]["micro_batch_size"] is None
    pinned = pinned_single_body(job, 8)
    assert pinned["config"]["data"]["micro_batch_size"] == 8
    assert job.single_body["config"]["data"]["micro_batch_size"] is None  # a copy: the job's body is unchanged
    assert {k: v for k, v in pinned["config"].items() if k != "data"} == {
        k: v for k, v in job.single_body["config"].items() if k != "data"
    }
    assert job_from_config(unsized, tmp_path).micro_batch_pin is None


def test_optimizer_noise_explains_only_near_zero_gradients():
    from lightning_moe.verify.numerics import optimizer_noise

    torch.manual_seed(0)
    initial = torch.randn(64)
    grad = torch.randn(64)
    grad[0] = 1e-8  # near zero: rounding is a large part of it
    noise = torch.full((64,), 1e-7)
    final = initial - 0.03 * grad.sign()  # Adam-like: every element travels by lr per step
    moved = final.clone()
    moved[0] += 0.01  # the near-zero element went elsewhere: explained
    assert optimizer_noise(moved, final, initial, grad + noise, grad) == 0.0
    moved[5] += 1e-4  # an ordinary element: not explained
    assert optimizer_noise(moved, final, initial, grad + noise, grad) == pytest.approx(
        1e-4 / float(final.abs().max()), rel=1e-3
    )
    # Exactly equal gradients explain nothing.
    assert optimizer_noise(moved, final, initial, grad, grad) is None


def test_micro_batching_explanation_names_the_statistics_and_the_fix():
    from lightning_moe.verify.localise import explain_micro_batching
    from lightning_moe.verify.report import VerifyReport

    mismatch = {
        "step": 1,
        "single": "1 micro-batch of 16 samples",
        "layout": "2 data-parallel ranks x 1 micro-batch of 8 samples",
        "single_micro_batch_size": 16,
        "layout_micro_batch_size": 8,
    }
    routing = {"blocks.0.moe": {"load_balancing": "aux_loss", "aux_loss_coeff": 0.01, "routing": "topk"}}
    report = VerifyReport(
        passed=False,
        layout={},
        steps=3,
        rtol=1e-5,
        micro_batching=dict(mismatch),
        first_difference="gradient of embed.weight (Embedding) at step 1, rel 2.0e-05",
        localisation={"kind": "gradient"},
    )
    explain_micro_batching(report, routing, pin="config")
    assert report.first_difference.startswith(
        "gradient of embed.weight (Embedding) at step 1, rel 2.0e-05; explained by"
        " micro-batching: the one-process run cut step 1 into 1 micro-batch of 16"
    )
    assert "(load_balancing='aux_loss', routing='topk' in blocks.0.moe)" in report.first_difference
    assert "Fix: set data.micro_batch_size to 8 (the same micro-batch size on both runs)" in report.first_difference
    # A module output that differs outside the MoE layers is not something micro-batching explains.
    report = VerifyReport(
        passed=False,
        layout={},
        steps=3,
        rtol=1e-5,
        micro_batching=dict(mismatch),
        localisation={"kind": "module_output", "module": "blocks.0.attn"},
    )
    explain_micro_batching(report, routing, pin=None)
    assert report.first_difference.startswith("micro-batching differs as well (fix it first)")
    assert report.localisation["explained_by"] is None
    # Same sizes, other samples in each micro-batch: the sampler is the fix.
    report = VerifyReport(
        passed=False,
        layout={},
        steps=3,
        rtol=1e-5,
        localisation={"kind": "gradient"},
        micro_batching={**mismatch, "single_micro_batch_size": 8},
    )
    explain_micro_batching(report, routing, pin="config")
    assert "micro-batch j of a step on data-parallel rank j % (dp*ep)" in report.first_difference
    passed = VerifyReport(passed=True, layout={}, steps=3, rtol=1e-5, micro_batching=dict(mismatch))
    explain_micro_batching(passed, routing, pin=None)
    assert passed.first_difference is None and "the results agree all the same" in passed.notes[0]


def test_statistics_over_several_ranks_explain_the_fail_by_design():
    from lightning_moe.verify.localise import explain_batch_statistics
    from lightning_moe.verify.report import VerifyReport

    routing = {
        f"layers.{i}.feed_forward": {"load_balancing": "global_aux_loss", "aux_loss_coeff": 0.01, "routing": "topk"}
        for i in range(2)
    }
    layout = {"tp": 1, "cp": 1, "ep": 2, "dp": 2, "pp": 1}
    report = VerifyReport(
        passed=False,
        layout=layout,
        steps=3,
        rtol=1e-5,
        localisation={"kind": "gradient"},
        first_difference="gradient of x",
    )
    explain_batch_statistics(report, routing)
    assert report.first_difference.startswith(
        "gradient of x; explained by batch-level statistics that span several ranks on this layout, by design:"
        " load_balancing='global_aux_loss' counts the dp x ep = 4 micro-batches of one micro-step at once (one on one"
        " process) in layers.0.feed_forward, layers.1.feed_forward. Fix: verify with per-micro-batch statistics"
    )
    assert report.localisation["explained_by"] == "batch_statistics"
    # Under tp alone the same setting spans one micro-batch: nothing to explain, the FAIL stays as it is.
    report = VerifyReport(
        passed=False,
        layout={**layout, "ep": 1, "dp": 1, "tp": 2},
        steps=3,
        rtol=1e-5,
        localisation={"kind": "gradient"},
        first_difference="gradient of x",
    )
    explain_batch_statistics(report, routing)
    assert report.first_difference == "gradient of x"


def test_tensor_parallel_pieces_are_reassembled_on_the_sharded_dim():
    from lightning_moe.verify.assembly import merge_tp

    full = torch.randn(2, 8, 6)  # [batch, seq, hidden]
    seq_shards = list(full.chunk(2, dim=1))
    merged, _, _ = merge_tp(seq_shards, (8, 6))
    torch.testing.assert_close(merged, full)
    hidden_shards = list(full.chunk(2, dim=2))
    merged, _, _ = merge_tp(hidden_shards, (8, 6))
    torch.testing.assert_close(merged, full)
    _, disagreement, _ = merge_tp([full, full + 1.0], (8, 6))  # "replicated" values that differ: a partial sum
    assert disagreement > 0.1
    merged, _, why = merge_tp([full[:, :, :4], full[:, :, :4]], (8, 6))
    assert merged is None and "expected [8, 6]" in why

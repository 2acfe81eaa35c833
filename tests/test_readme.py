"""README.md as typed: every shell command and Python block of its fenced code blocks runs here.

The blocks are read from README.md itself, so an edit to the README is what gets tested; the
Python blocks of the docs pages in ``DOC_PAGES`` (those cheap to run) run too, once each. Each command is shrunk where it would be slow — Hydra
overrides for a tiny model and 3 steps, or a few listed text substitutions in a Python block —
and its output is checked against what the README says it prints. A block or command that is
deliberately not run is named in ``NOT_RUN`` with the reason; any other command without a
handler here fails, so a new README command cannot go untested.

Multi-process Trainer runs always start in a subprocess: Lightning's launcher re-executes
``sys.argv``, which must never be pytest's.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.cli import TINY_MODEL
from tests.dist_pool import trim_pools

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# Docs pages whose blocks are cheap enough to run as well (blocks equal to a README block run once).
DOC_PAGES = ("docs/moe-layer.md",)

# Commands (by their first words) and Python blocks (by a line they contain) that are not run.
NOT_RUN: dict[str, str] = {
    "make test": "it is the whole suite (about 35 min on 2 cores), this module included",
}

# A tiny model and 3 steps. Unlike tests/cli.py's TINY_RUN, no data.micro_batch_size: the README
# promises the single-process losses with the default micro-batch.
SHRINK_MODEL = TINY_MODEL
STEPS = 3
SHRINK_TRAIN = [
    "logger=none",
    f"trainer.max_steps={STEPS}",
    "trainer.val_check_interval=null",
    "trainer.limit_val_batches=0",
    *SHRINK_MODEL,
]
# What README says summary.json holds: layout, per-step losses, tokens/s, expert load,
# communication per dimension, final loss.
SUMMARY_KEYS = {"layout", "losses", "tokens_per_second", "expert_load", "comm", "final_loss"}
TIMEOUT = 420


@dataclass(frozen=True)
class Block:
    source: str  # file relative to ROOT
    line: int  # first line of the block's contents
    lang: str
    text: str


def fenced_blocks(path: Path) -> list[Block]:
    """Every fenced code block of a Markdown file, in order."""
    blocks, lines = [], path.read_text().splitlines()
    i = 0
    while i < len(lines):
        match = re.match(r"^```(\w*)\s*$", lines[i])
        if match:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            blocks.append(
                Block(str(path.relative_to(ROOT)), i + 2, match.group(1), "\n".join(lines[i + 1 : end]) + "\n")
            )
            i = end
        i += 1
    return blocks


def shell_commands(block: Block) -> list[tuple[str, str]]:
    """The commands of a bash block, one a line, each with its trailing comment (what it claims)."""
    commands = []
    for raw in block.text.splitlines():
        command, _, comment = raw.partition(" #")
        if command.strip() and not command.strip().startswith("#"):
            commands.append((command.strip(), comment.strip()))
    return commands


README_BLOCKS = fenced_blocks(README)
DOC_BLOCKS = [
    b for page in DOC_PAGES for b in fenced_blocks(ROOT / page) if b.text not in {r.text for r in README_BLOCKS}
]
COMMANDS = [(b, c, note) for b in README_BLOCKS if b.lang in ("bash", "sh", "shell") for c, note in shell_commands(b)]
PYTHON_BLOCKS = [b for b in README_BLOCKS + DOC_BLOCKS if b.lang == "python"]


def _run(cmd: list[str], cwd: Path, timeout: int = TIMEOUT, env: dict | None = None) -> subprocess.CompletedProcess:
    trim_pools()  # the launched processes get the cores but for a few idle pool ranks
    full_env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", **(env or {}))
    proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(
            f"{shlex.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def _layout_line(output: str) -> dict[str, int]:
    """The sizes of the CLI's ``layout: tp=1 cp=1 ep=2 ...`` line."""
    match = re.search(r"^\s*layout: ((?:\w+=\d+ ?)+)$", output, re.M)
    assert match, f"no 'layout: ...' line in the output:\n{output[-3000:]}"
    return {k: int(v) for k, v in (item.split("=") for item in match.group(1).split())}


def _preset_sizes(preset: str) -> dict[str, int]:
    """``dp2_ep2`` -> {dp: 2, ep: 2}; ``single`` -> {}."""
    return {name: int(size) for name, size in re.findall(r"([a-z]+)(\d+)", preset)}


def _check_train_run(output: str, run_dir: Path, overrides: list[str]) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert SUMMARY_KEYS <= summary.keys(), f"summary.json lacks {SUMMARY_KEYS - summary.keys()}"
    assert _layout_line(output) == summary["layout"]
    preset = next((o.split("=", 1)[1] for o in overrides if o.startswith("parallel=")), "single")
    for dim in ("tp", "cp", "ep", "dp", "pp"):
        assert summary["layout"][dim] == _preset_sizes(preset).get(dim, 1), (preset, summary["layout"])
    return summary


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


# --- shell commands -------------------------------------------------------------------------------


# One run serves every test that reads it: tests/test_first_impressions.py reads `make train` and the
# README's first Python example too. Keyed by what ran; a session runs each once.
_RUNS: dict[str, tuple[Any, Path]] = {}


def make_train_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """`make train` as a user runs it (W&B offline by default), shrunk through ARGS (the Makefile's own
    hook): (stdout and stderr in one unbuffered pipe, in the order printed; the run directory)."""
    if "make train" not in _RUNS:
        stale = subprocess.run(["make", "-q", ".venv/.installed"], cwd=ROOT, capture_output=True)
        if stale.returncode != 0:
            pytest.skip("make train would pip-install first (.venv/.installed is stale); run `make install`")
        run_dir = tmp_path_factory.mktemp("make_train") / "run"
        args = [arg for arg in SHRINK_TRAIN if arg != "logger=none"] + [f"hydra.run.dir={run_dir}"]
        trim_pools()  # the launched processes get the cores but for a few idle pool ranks
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env.pop("WANDB_MODE", None)  # the default must be offline
        for name in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES"):
            env.pop(name, None)  # under `make test` the inner make would print "Entering directory" lines
        proc = subprocess.run(
            ["make", "train", f"ARGS={' '.join(args)}"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=TIMEOUT,
        )
        assert proc.returncode == 0, f"make train failed ({proc.returncode}):\n{proc.stdout[-6000:]}"
        _RUNS["make train"] = (proc.stdout, run_dir)
    return _RUNS["make train"]


def python_block_run(
    block: Block, tmp_path_factory: pytest.TempPathFactory
) -> tuple[subprocess.CompletedProcess, Path]:
    """The block, shrunk by its ``PYTHON_CHECKS`` substitutions, run as a script: (the process, its directory)."""
    key = f"{block.source}:{block.line}"
    if key not in _RUNS:
        check = _python_check(block)
        text = block.text
        for typed, shrunk in check.substitutions:
            assert typed in text, f"{key}: `{typed}` is gone; update PYTHON_CHECKS in tests/test_readme.py"
            text = text.replace(typed, shrunk)
        cwd = tmp_path_factory.mktemp("block")
        script = cwd / "block.py"
        script.write_text(text)
        _RUNS[key] = (_run([sys.executable, str(script)], cwd), cwd)
    return _RUNS[key]


def run_make_train(command: str, comment: str, tmp_path: Path, state: dict) -> None:
    """`make train`: the default experiment under ep2, shrunk through ARGS."""
    out, run_dir = make_train_run(state["tmp_path_factory"])
    summary = _check_train_run(out, run_dir, ["parallel=ep2"])  # the README: ep2 unless ARGS picks a layout
    assert _layout_line(out) == {"tp": 1, "cp": 1, "ep": 2, "dp": 1, "pp": 1, "etp": 1}
    assert len(summary["losses"]) == STEPS
    # The final loss and tokens/s (the run summary's wording is the first-impressions test's business).
    assert re.search(r"final loss\D+\d+\.\d+.*\btokens/s", out), out[-2000:]
    # The bytes each rank sent per optimizer step: ep for the all-to-all, dp for FSDP.
    assert re.search(r"^\s*communication per optimizer step and rank: .*\bep [\d.]+ MB.*\bdp [\d.]+ MB", out, re.M), (
        out[-2000:]
    )
    assert str(run_dir / "summary.json") in out


def run_train(command: str, comment: str, tmp_path: Path, state: dict) -> None:
    """`python -m lightning_moe.train ...`: tiny model, 3 steps; the checks the comment names."""
    words = shlex.split(command.replace("<run dir>", str(state.get("<run dir>", "<run dir>"))))
    overrides = words[3:]
    resume = any(o.startswith("ckpt_path=") for o in overrides)
    if resume and "<run dir>" not in state:
        pytest.fail("resuming needs the checkpoint of the README's `callbacks=checkpoint` command, which did not run")
    run_dir = tmp_path / "run"
    shrink = [o.replace(f"max_steps={STEPS}", f"max_steps={STEPS + 2}") if resume else o for o in SHRINK_TRAIN]
    if "data=tokens" in overrides:
        # The corpus the README's prepare command wrote, at the relative path it names.
        if "prepared" not in state:
            pytest.fail("data=tokens needs the corpus of the README's prepare command, which did not run")
        tmp_path = state["prepared"]
        run_dir = tmp_path / "run_tokens"
        shrink = [o for o in shrink if not o.startswith("data.max_corpus_bytes")]
    proc = _run([sys.executable, *words[1:], *shrink, f"hydra.run.dir={run_dir}"], tmp_path)
    summary = _check_train_run(proc.stdout + proc.stderr, run_dir, overrides)
    if "callbacks=checkpoint" in overrides:
        assert (run_dir / "checkpoints" / "last.ckpt").is_dir(), "no <run dir>/checkpoints/last.ckpt"
        state["<run dir>"] = run_dir
    if resume:
        # Steps 4-5 on the new layout, after the checkpoint's 3: the uninterrupted run's steps 4-5
        # (docs/checkpoints.md: any valid layout resumes on the same curve).
        assert len(summary["losses"]) == 2, summary["losses"]
        straight_dir = tmp_path / "uninterrupted"
        _run([sys.executable, "-m", "lightning_moe.train", *shrink, f"hydra.run.dir={straight_dir}"], tmp_path)
        straight = json.loads((straight_dir / "summary.json").read_text())["losses"][STEPS:]
        # The last.ckpt of a run that max_steps ends mid-epoch once recorded the next epoch, and the
        # resumed run then read another sample order.
        assert _rel(summary["losses"], straight) < 1e-5, (summary["losses"], straight)
    if "losses of parallel=single" in comment:
        # With the default micro-batch: nothing but the layout differs from the reference run.
        single_dir = tmp_path / "single"
        same_data = [o for o in overrides if not o.startswith("parallel")]
        _run(
            [sys.executable, "-m", "lightning_moe.train", *same_data, *shrink, f"hydra.run.dir={single_dir}"], tmp_path
        )
        single = json.loads((single_dir / "summary.json").read_text())
        assert _rel(summary["losses"], single["losses"]) < 1e-5, (summary["losses"], single["losses"])


def run_prepare(command: str, comment: str, tmp_path: Path, state: dict) -> None:
    """`python -m lightning_moe.data.prepare input=docs ...`: from a folder holding the repository's docs,
    a Megatron pair holding one document per page, byte for byte; the next command trains on it."""
    from lightning_moe.data import IndexedTokens

    (tmp_path / "docs").symlink_to(ROOT / "docs")
    words = shlex.split(command)
    _run([sys.executable, *words[1:]], tmp_path)
    output = next(w.split("=", 1)[1] for w in words if w.startswith("output="))
    corpus = IndexedTokens(tmp_path / output)
    assert corpus.num_documents == len(list((ROOT / "docs").glob("*.md")))
    np_tokens = corpus.read(0, corpus.num_tokens)
    assert (
        bytes(np_tokens[: corpus.document_offsets[1]].tolist()) == sorted((ROOT / "docs").glob("*.md"))[0].read_bytes()
    )
    state["prepared"] = tmp_path


def run_checkpoint_inspect(command: str, comment: str, tmp_path: Path, state: dict) -> None:
    """`python -m lightning_moe.checkpoint inspect <ckpt>`: layout, step, tensors with global shapes."""
    if "<run dir>" not in state:
        pytest.fail("inspect needs the checkpoint of the README's `callbacks=checkpoint` command, which did not run")
    words = shlex.split(command.replace("<run dir>", str(state["<run dir>"])))
    out = _run([sys.executable, *words[1:]], tmp_path).stdout
    assert re.search(r"^\s*layout: tp=1 cp=1 ep=2", out, re.M), out[:2000]
    assert re.search(rf"global step: {STEPS}\b", out), out[:2000]
    assert "global shape" in out and "tok_embeddings.weight" in out


def run_verify(command: str, comment: str, tmp_path: Path, state: dict) -> None:
    """`python -m lightning_moe.verify parallel=...`: PASS (exit 0) for MoEGPT with the default data config."""
    run_dir = tmp_path / "verify"
    words = shlex.split(command)
    proc = _run([sys.executable, *words[1:], *SHRINK_MODEL, "verify.steps=2", f"hydra.run.dir={run_dir}"], tmp_path)
    out = proc.stdout + proc.stderr
    assert re.search(r"^\s*PASS\b", out, re.M), out[-4000:]
    report = json.loads(next(run_dir.rglob("verify.json")).read_text())
    assert report, "empty verify.json"


def run_plan(command: str, comment: str, tmp_path: Path, state: dict) -> None:
    """`python -m lightning_moe.plan ...`: the ranked table, plan.json with every layout's sizes."""
    run_dir = tmp_path / "plan"
    out = _run([sys.executable, *shlex.split(command)[1:], f"hydra.run.dir={run_dir}"], tmp_path).stdout
    assert re.search(r"layouts fit", out), out[:3000]
    plan = json.loads((run_dir / "plan.json").read_text())
    assert "tp·" in out or "ep" in out
    text = json.dumps(plan)
    for dim in ("tp", "cp", "ep", "dp", "pp"):
        assert f'"{dim}"' in text, f"plan.json has no {dim!r} key"


HANDLERS: list[tuple[str, Callable[[str, str, Path, dict], None]]] = [
    (r"^make train\b", run_make_train),
    (r"^python -m lightning_moe\.train\b", run_train),
    (r"^python -m lightning_moe\.data\.prepare\b", run_prepare),
    (r"^python -m lightning_moe\.checkpoint inspect\b", run_checkpoint_inspect),
    (r"^python -m lightning_moe\.verify\b", run_verify),
    (r"^python -m lightning_moe\.plan\b", run_plan),
]


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """What one README command leaves for a later one (the run dir with a checkpoint)."""
    return {"tmp_path_factory": tmp_path_factory}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("block", "command", "comment"), COMMANDS, ids=[f"{b.source}:{b.line}:{c[:60]}" for b, c, _ in COMMANDS]
)
def test_readme_command(
    block: Block, command: str, comment: str, tmp_path_factory: pytest.TempPathFactory, state: dict
) -> None:
    for prefix, reason in NOT_RUN.items():
        if command.startswith(prefix):
            pytest.skip(f"not run: {reason}")
    handler = next((h for pattern, h in HANDLERS if re.match(pattern, command)), None)
    assert handler is not None, (
        f"{block.source}:{block.line}: `{command}` has no handler in tests/test_readme.py: add one or a NOT_RUN entry"
    )
    handler(command, comment, tmp_path_factory.mktemp("cmd"), state)


# --- Python blocks --------------------------------------------------------------------------------


@dataclass(frozen=True)
class PythonCheck:
    marker: str  # a line fragment that identifies the block
    substitutions: tuple[tuple[str, str], ...]  # (as typed, shrunk); each must occur in the block
    check: Callable[[subprocess.CompletedProcess, Path], None]


def _check_strategy_example(proc: subprocess.CompletedProcess, cwd: Path) -> None:
    # The README promises no output; the run ended (exit 0, checked by _run) without an error on any rank.
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]


def _check_own_module(proc: subprocess.CompletedProcess, cwd: Path) -> None:
    match = re.search(r"^final loss (\d+\.\d+)$", proc.stdout, re.M)
    assert match, proc.stdout[-2000:]
    assert 0 < float(match.group(1)) < 7  # about ln(256) = 5.5 after 3 steps


def _check_hf_example(proc: subprocess.CompletedProcess, cwd: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    out = cwd / "out" / "hf"
    assert (out / "config.json").is_file() and list(out.glob("*.safetensors")), sorted(out.iterdir())
    model = AutoModelForCausalLM.from_pretrained(out)  # "loads with from_pretrained"
    logits = model(torch.arange(16).view(1, 16)).logits
    assert logits.shape == (1, 16, 256) and torch.isfinite(logits).all()


def _check_moe_layer(proc: subprocess.CompletedProcess, cwd: Path) -> None:
    # tokens_per_expert of 2 x 16 tokens, top-2: 64 routed slots over 8 experts.
    counts = [float(x) for x in re.findall(r"\d+\.?", proc.stdout.split("tensor(")[-1])]
    assert len(counts) == 8 and sum(counts) == 64, proc.stdout


def _check_replay_and_upcycle(proc: subprocess.CompletedProcess, cwd: Path) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (cwd / "routing.safetensors").is_file()
    assert proc.stdout.strip().splitlines()[-1] == "True", proc.stdout  # the upcycled logits equal the dense ones


PYTHON_CHECKS = [
    PythonCheck(
        "trainer.fit(MoEGPT(",
        (
            ("max_steps=100", f"max_steps={STEPS}"),
            ("MoEGPT(moe=", "MoEGPT(hidden_size=32, num_layers=2, num_heads=4, moe="),
            (
                "ByteTextDataModule(global_batch_size=16)",
                "ByteTextDataModule(global_batch_size=16, seq_len=32, max_corpus_bytes=200000)",
            ),
        ),
        _check_strategy_example,
    ),
    PythonCheck(
        "class TinyMoELM(L.LightningModule):",
        (("max_steps=20", f"max_steps={STEPS}"), ("seq_len=64,", "seq_len=64, max_corpus_bytes=200000,")),
        _check_own_module,
    ),
    PythonCheck(
        "module = hf.HFMoEModule(",
        (("max_steps=10", f"max_steps={STEPS}"), ("seq_len=128", "seq_len=32, max_corpus_bytes=200000")),
        _check_hf_example,
    ),
    PythonCheck("layer = MoELayer(hidden_size=256", (), _check_moe_layer),
    PythonCheck('with replay_routing(model, "routing.safetensors"):', (), _check_replay_and_upcycle),
]


def _python_check(block: Block) -> PythonCheck:
    found = [c for c in PYTHON_CHECKS if c.marker in block.text]
    assert len(found) == 1, (
        f"{block.source}:{block.line}: no (or several) PYTHON_CHECKS entries match this block: add one"
    )
    return found[0]


@pytest.mark.slow
@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[f"{b.source}:{b.line}" for b in PYTHON_BLOCKS])
def test_readme_python_block(block: Block, tmp_path_factory: pytest.TempPathFactory) -> None:
    proc, cwd = python_block_run(block, tmp_path_factory)
    _python_check(block).check(proc, cwd)


def test_readme_is_a_front_door() -> None:
    """At most 15 KB; every docs/ page it links to exists. (No page cites a file outside the repository:
    tests/test_structure.py checks every project file for that.)"""
    text = README.read_text()
    assert len(text.encode()) <= 15_000, f"README.md is {len(text.encode())} bytes"
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), f"README links to {target}, which does not exist"


def test_every_block_has_a_runner() -> None:
    """Fast: each README command has a handler or a NOT_RUN reason, each Python block a check."""
    assert COMMANDS and PYTHON_BLOCKS
    for block, command, _ in COMMANDS:
        if not any(command.startswith(p) for p in NOT_RUN):
            assert any(re.match(p, command) for p, _ in HANDLERS), (
                f"{block.source}:{block.line}: `{command}` has no handler"
            )
    for block in PYTHON_BLOCKS:
        check = _python_check(block)
        for typed, _ in check.substitutions:
            assert typed in block.text, f"{block.source}:{block.line}: `{typed}` is gone; update PYTHON_CHECKS"
    for block in README_BLOCKS:
        assert block.lang in ("bash", "python"), f"README.md:{block.line}: a ```{block.lang} block this test cannot run"

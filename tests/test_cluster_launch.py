"""Cluster launches: SLURM's task variables (2 nodes x 2 tasks, on the loopback) train the one-process
losses; a launcher's job id gives every rank and every restart of a job one output directory and one
W&B run; under ``torchrun --max-restarts=1`` a job whose rank is killed resumes by itself from its newest
periodic checkpoint and ends with the losses of the uninterrupted run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_moe.conf import launcher_run_id
from tests.cli import ROOT, TINY_RUN, train_in_pool
from tests.dist_pool import close_pools
from tests.faults import samples_per_step
from tests.test_observability import _wandb_records

REL = 1e-5
KILL_STEP = 5  # after the checkpoints of steps 2 and 4: the restart redoes step 5 from step 4's


RECORD_SAMPLES = "+callbacks.samples._target_=tests.faults.RecordSamples"


@pytest.fixture(scope="module")
def single_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("single") / "run"
    train_in_pool(run_dir, "parallel=single", RECORD_SAMPLES)
    return run_dir


@pytest.fixture(scope="module")
def single_losses(single_run) -> list[float]:
    return json.loads((single_run / "summary.json").read_text())["losses"]


def _outside_any_launcher() -> dict[str, str]:
    """This process's environment without the variables of a SLURM job or a torchrun worker."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}


# srun for a test: start SLURM_NNODES x SLURM_NTASKS_PER_NODE tasks of the command on this machine, each
# with the variables srun gives a task; exit with the first non-zero exit code.
FAKE_SRUN = """#!{python}
import os, subprocess, sys
nodes, per_node = int(os.environ["SLURM_NNODES"]), int(os.environ["SLURM_NTASKS_PER_NODE"])
command = sys.argv[1:]
while command[0].startswith("-"):  # srun's own options
    command = command[1:]
tasks = [
    subprocess.Popen(command, env=dict(os.environ, SLURM_NTASKS=str(nodes * per_node), SLURM_PROCID=str(rank),
                                       SLURM_LOCALID=str(rank % per_node), SLURM_NODEID=str(rank // per_node)))
    for rank in range(nodes * per_node)
]
sys.exit(next((code for code in (task.wait() for task in tasks) if code), 0))
"""


def _fake_slurm_commands(bin_dir: Path) -> Path:
    """``srun``, ``scontrol show hostnames`` (every node is localhost) and ``python`` (this interpreter)."""
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN.format(python=sys.executable))
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho localhost\necho localhost\n")
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')  # a link would leave the venv
    for name in ("srun", "scontrol", "python"):
        (bin_dir / name).chmod(0o755)
    return bin_dir


def _job_id_with_free_port() -> str:
    """A SLURM job id whose port (15000 + id % 10000, Lightning's rule and the script's) is free here."""
    for job_id in range(700_000, 710_000, 7):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", 15000 + job_id % 10000))
            except OSError:
                continue
        return str(job_id)
    raise RuntimeError("no free port in 15000-24999")


@pytest.mark.slow
def test_the_sbatch_script_on_two_nodes_trains_the_one_process_losses_in_the_job_directory(tmp_path, single_losses):
    """experiments/slurm/train.sbatch as sbatch runs it on 2 nodes x 2 tasks (here all on the loopback,
    srun and scontrol stand-ins): each task finds its rank, the master address and the job's directory."""
    close_pools()
    job_id = _job_id_with_free_port()
    bin_dir = _fake_slurm_commands(tmp_path / "bin")
    env = dict(
        _outside_any_launcher(),
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        ACCELERATOR="cpu",
        SLURM_JOB_ID=job_id,
        SLURM_JOB_NAME="lightning-moe",
        SLURM_JOB_NODELIST="node[1-2]",
        SLURM_NNODES="2",
        SLURM_NTASKS_PER_NODE="2",
        SLURM_CPUS_PER_TASK="1",
        PYTHONPATH=str(ROOT),
        WANDB_MODE="offline",
    )
    script = ROOT / "experiments" / "slurm" / "train.sbatch"
    proc = subprocess.run(
        ["bash", str(script), *TINY_RUN, "parallel=dp2_ep2", "logger=wandb"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-6000:])

    # No hydra.run.dir: every task found outputs/slurm-<job id> by itself, and nothing else.
    assert [p.name for p in (tmp_path / "outputs").iterdir()] == [f"slurm-{job_id}"]
    run_dir = tmp_path / "outputs" / f"slurm-{job_id}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["layout"]["dp"] == 2 and summary["layout"]["ep"] == 2
    torch.testing.assert_close(torch.tensor(summary["losses"]), torch.tensor(single_losses), rtol=REL, atol=0.0)
    # One W&B run, with the job's id; a run that did not hang leaves no stack files.
    assert [p.name.rsplit("-", 2)[-2:] for p in (run_dir / "wandb").glob("offline-run-*")] == [["slurm", job_id]]
    assert not (run_dir / "stacks").exists()


@pytest.mark.slow
def test_a_killed_rank_restarts_the_job_from_its_checkpoint_with_the_same_losses(tmp_path, single_run, single_losses):
    close_pools()
    env = _outside_any_launcher()
    # torchrun's agent shares one TCP store across attempts by default (torch 2.13), and the restarted
    # ranks read the first attempt's gloo addresses from it; docs/cluster.md.
    env.update(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1", WANDB_MODE="offline", PYTHONPATH=str(ROOT))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc-per-node=4",
        "--max-restarts=1",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=localhost:0",
        "--rdzv-id=killed",
        "-m",
        "lightning_moe.train",
        *TINY_RUN,
        "parallel=dp2_ep2",
        "logger=wandb",
        "trainer.log_every_n_steps=1",
        "callbacks=checkpoint",
        "callbacks.checkpoint.every_n_train_steps=2",
        "ckpt_path=auto",
        "+callbacks.fault._target_=tests.faults.KillRank",
        "+callbacks.fault.rank=1",
        f"+callbacks.fault.step={KILL_STEP}",
        RECORD_SAMPLES,
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-6000:])
    assert "exitcode: -9) local_rank: 1" in proc.stderr  # the kill happened, and the job still succeeded

    # One directory for both attempts (no hydra.run.dir given): the restart found its checkpoints there.
    assert [p.name for p in (tmp_path / "outputs").iterdir()] == ["torchrun-killed"]
    run_dir = tmp_path / "outputs" / "torchrun-killed"
    losses = json.loads((run_dir / "summary.json").read_text())["losses"]
    # The resumed attempt records the steps after its checkpoint: those of the uninterrupted run.
    assert len(losses) == len(single_losses) - 4
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(single_losses[-len(losses) :]), rtol=REL, atol=0.0)
    # No sample repeated or skipped: the first attempt's steps up to the checkpoint and the restart's
    # after it trained on exactly the samples of the uninterrupted run, step by step.
    resumed_from = KILL_STEP - 1
    trained = samples_per_step(run_dir, attempt_of_step=lambda step: int(step >= resumed_from))
    assert trained == samples_per_step(single_run), (trained, samples_per_step(single_run))
    # Both attempts logged to one W&B run id, the second from the step it resumed at.
    segments = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(segments) == 2 and {s.name.split("-", 3)[-1] for s in segments} == {"torchrun-killed"}
    first, second = (_logged_steps(next(segment.glob("run-*.wandb"))) for segment in segments)
    assert first[0] == 0 and second[0] == 4 and second[-1] == len(single_losses) - 1, (first, second)


def _logged_steps(wandb_file: Path) -> list[int]:
    """The ``trainer/global_step`` of each history row of an offline W&B run file."""
    steps = []
    for record in _wandb_records(wandb_file):
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
            if "trainer/global_step" in items:
                steps.append(int(json.loads(items["trainer/global_step"])))
    return steps


def test_launcher_run_id_names_the_job(monkeypatch):
    for name in ("SLURM_JOB_ID", "SLURM_JOB_NAME", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    assert launcher_run_id("2026-12-03/21-40-00") == "2026-12-03/21-40-00"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun without --rdzv-id
    assert launcher_run_id(None) is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    assert launcher_run_id(None) == "torchrun-abc"
    monkeypatch.setenv("SLURM_JOB_ID", "42")  # torchrun inside a SLURM job: the job's id
    assert launcher_run_id(None) == "slurm-42"
    monkeypatch.setenv("SLURM_JOB_NAME", "interactive")  # an allocation that holds many runs
    assert launcher_run_id("t") == "torchrun-abc"


def test_sweep_jobs_of_one_launcher_job_get_their_own_run_id(monkeypatch):
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import open_dict

    from lightning_moe.conf import CONF_DIR

    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.delenv("SLURM_JOB_NAME", raising=False)
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", return_hydra_config=True, overrides=["trainer.default_root_dir=/unused", "logger=wandb"])
    with open_dict(cfg):
        cfg.hydra.mode, cfg.hydra.job.num = RunMode.MULTIRUN, 3
    HydraConfig.instance().set_config(cfg)
    try:
        assert cfg.logger.wandb.id == "slurm-42-3"
    finally:
        HydraConfig.instance().cfg = None  # the next tests run outside Hydra

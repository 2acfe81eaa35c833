"""Run the single-process and the layout run in their own processes, compare, localise, report."""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import math
import os
import pickle
import shutil
import signal
import subprocess
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_moe.layout import LAYOUT_KEYS, ResolvedLayout, layout_request, resolve_layout
from lightning_moe.verify.localise import (
    check_same_samples,
    compare_micro_batching,
    compare_module_outputs,
    describe_error,
    explain_batch_statistics,
    explain_micro_batching,
    first_gradient_difference,
    localise,
)
from lightning_moe.verify.numerics import compare_runs
from lightning_moe.verify.report import VerifyReport
from lightning_moe.verify.runs import RunData
from lightning_moe.verify.worker import SPEC_ENV, disable_dropout, dump_spec

LOCALIZE_MODES = ("on_failure", "always", "never")
# Set by launchers (torchrun, Lightning, SLURM); a worker that inherits them would wait for ranks that never come.
_LAUNCHER_ENV = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "NODE_RANK",
    "LOCAL_RANK",
    "RANK",
    "WORLD_SIZE",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
    "TORCHELASTIC_RUN_ID",
    "SLURM_NTASKS",
    "SLURM_JOB_ID",
)


class VerifyConfigError(ValueError):
    """A configuration verification cannot run (raised before any process starts)."""


@dataclass
class Job:
    """Everything both runs need, whatever the entry (Hydra config or Python factories)."""

    single_body: dict[str, Any]
    layout_body: dict[str, Any]
    layout_devices: int
    layout: dict[str, Any]
    seed: int
    steps: int
    rtol: float
    localize: str
    out_dir: Path
    cache_dir: Path | None = None
    timeout_s: float = 1800.0
    main_file: str | None = None
    model_name: str = ""
    notes: list[str] = field(default_factory=list)
    fingerprint: str = ""
    # How the single run's micro-batch size is set to the layout's: "config" (data.micro_batch_size),
    # "factory" (datamodule_factory(micro_batch_size=...)) or None (the data module has no such argument).
    micro_batch_pin: str | None = None
    data_setting: str = "data.micro_batch_size"  # how the user sets the micro-batch size (named in fixes)
    # Run the one-process reference again with every initial parameter one rounding unit higher, and
    # count differences within the noise floor it gives as agreeing (numerics.apply_noise_floor).
    noise_control: bool = False


# -- the layout -------------------------------------------------------------------------------------
def resolved_layout(devices: int, options: Mapping[str, Any]) -> ResolvedLayout:
    """The layout that ``options`` (a strategy's keyword arguments or a ``parallel`` config) request on
    ``devices`` processes, as the strategy resolves it (:func:`~lightning_moe.layout.resolve_layout`:
    inferred dp, folding, HSDP); :class:`VerifyConfigError` naming the fix when it does not fit."""
    try:
        return resolve_layout(devices, **layout_request(options))
    except ValueError as err:
        raise VerifyConfigError(f"devices={devices}: {err}") from None


def layout_record(layout: ResolvedLayout) -> dict[str, Any]:
    """The layout as a report records it, as ``summary.json`` does: the sizes of
    :data:`~lightning_moe.layout.LAYOUT_KEYS` (``ep`` the whole expert-parallel size), and ``fold_ep``
    (``"cp,tp"``) when ep folds over attention dims."""
    record: dict[str, Any] = layout.as_dict()
    if layout.fold_ep:
        record["fold_ep"] = ",".join(layout.fold_ep)
    return record


# Strategy arguments that only shape a layout, and the value each takes in the one-process reference
# (ep folded over nothing, no HSDP split, no expert all-to-all to overlap, no pipeline schedule).
ONE_PROCESS_OPTIONS: dict[str, Any] = {
    **dict.fromkeys(LAYOUT_KEYS, 1),
    "etp": None,
    "fold_ep": None,
    "dp_replicate": None,
    "dp_shard": None,
    "overlap_ep_comm": False,
    "pp_schedule": "1F1B",
    "pp_microbatches": None,
    "pp_stages_per_rank": 1,
    "pp_stage_layers": None,
}


def one_process_options(options: Mapping[str, Any], *, complete: bool = False) -> dict[str, Any]:
    """``options`` (a strategy's keyword arguments or a ``parallel`` config) for the one-process
    reference: every layout option set as :data:`ONE_PROCESS_OPTIONS` says, HSDP turned into FSDP.
    ``complete`` sets the options that ``options`` leaves out as well, so that every layout of one
    model shares one (cacheable) reference; otherwise only those present change (a config whose
    strategy class may not take the others)."""
    out = dict(options)
    for key, value in ONE_PROCESS_OPTIONS.items():
        if complete or key in out:
            out[key] = value
    if out.get("data_parallel") == "hsdp" or (complete and "data_parallel" not in out):
        out["data_parallel"] = "fsdp"
    return out


# -- checks before any process starts --------------------------------------------------------------
def check_processes(world_size: int, max_processes: int, num_nodes: int = 1) -> None:
    if num_nodes != 1:
        raise VerifyConfigError(
            f"trainer.num_nodes={num_nodes}: verification runs its processes on this machine; use num_nodes=1"
            " and a layout that fits one machine"
        )
    if world_size > max_processes:
        raise VerifyConfigError(
            f"the layout needs {world_size} processes, more than verify.max_processes={max_processes}: verify a"
            " smaller layout with the same kinds of parallelism (e.g. every size 2), or raise verify.max_processes"
        )


def check_deterministic_build(build: Callable[[], nn.Module], seed: int, what: str) -> list[str]:
    """Build the module twice under ``seed`` (``configure_model()`` included) and compare every tensor.

    Raises :class:`VerifyConfigError` naming the first tensor that differs; returns the dropout
    settings that verification turns off (the caller warns).
    """
    import lightning.pytorch as pl

    states = []
    skipped = None
    dropout: list[str] = []
    for _ in range(2):
        pl.seed_everything(seed, verbose=False)
        module = build()
        configure = getattr(module, "configure_model", None)
        if callable(configure):
            try:
                configure()
            except Exception as err:  # it may need a trainer or a device mesh
                skipped = f"{type(err).__name__}: {err}"
        states.append({k: v.detach().clone() for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)})
        dropout = disable_dropout(module)
    first, second = states
    if set(first) != set(second):
        raise VerifyConfigError(
            f"{what} is not deterministic: two builds under seed {seed} have different tensors"
            f" ({sorted(set(first) ^ set(second))[:5]})"
        )
    for name in first:
        a, b = first[name], second[name]
        if a.device.type == "meta":
            continue
        if a.shape != b.shape or not torch.equal(a, b):
            diff = float((a.double() - b.double()).abs().max()) if a.shape == b.shape else math.inf
            raise VerifyConfigError(
                f"{what} is not deterministic under a fixed seed: {name} differs between two builds with seed {seed}"
                f" (max abs difference {diff:.3g}); initialise from torch's global RNG (seeded by the run) in"
                " __init__/configure_model, not from an unseeded generator, time or os.urandom"
            )
    if skipped:
        warnings.warn(
            f"verify: configure_model() could not run outside a trainer ({skipped}); checked the constructor only",
            stacklevel=2,
        )
    return dropout


# -- running ---------------------------------------------------------------------------------------
def _worker_env(devices: int) -> dict[str, str]:
    """The environment of a run's processes: the caller's ``OMP_NUM_THREADS``, else the cores shared
    out among the processes."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
    env[SPEC_ENV] = "1"
    if "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // max(1, devices)))
    paths = [p for p in sys.path if p and os.path.isdir(p)]
    if os.getcwd() not in paths:
        paths.insert(0, os.getcwd())
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _launch(
    job: Job, body: dict[str, Any], devices: int, run_dir: Path, steps: int, record: bool, perturb_initial: bool = False
) -> RunData:
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    header = {
        "out_dir": str(run_dir),
        "seed": job.seed,
        "steps": steps,
        "record_forward": record,
        "devices": devices,
        "main_file": job.main_file,
        "perturb_initial": perturb_initial,
    }
    spec_path = run_dir / "spec.pkl"
    dump_spec(spec_path, header, body)
    returncode = run_worker(spec_path, devices, job.timeout_s)
    data = RunData.load(run_dir)
    data.returncode = returncode  # type: ignore[attr-defined]
    return data


def run_worker(spec_path: Path, devices: int, timeout_s: float) -> int:
    """Start ``python -m lightning_moe.verify.worker spec_path`` (it starts the other ``devices - 1`` ranks
    itself), its output into ``log.txt`` beside the spec; returns its exit code. Stopped after ``timeout_s``."""
    run_dir = spec_path.parent
    cmd = [sys.executable, "-m", "lightning_moe.verify.worker", str(spec_path)]
    with open(run_dir / "log.txt", "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=_worker_env(devices), start_new_session=True
        )
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise VerifyConfigError(
                f"the run in {run_dir} took longer than verify.timeout_s={timeout_s:g} s"
                f" (stopped); its output: {run_dir / 'log.txt'}"
            ) from None


def _log_tail(run_dir: Path, chars: int = 3000) -> str:
    path = run_dir / "log.txt"
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def _single(job: Job, steps: int, record: bool, control: bool = False) -> RunData:
    """The single-process run, from the cache when an identical one is there; ``control``: the noise
    control's run (every initial parameter one rounding unit higher)."""
    what = "single-process control" if control else "single-process"
    if job.cache_dir is None:
        main_run = steps == job.steps and record == (job.localize == "always")
        name = ("single" if main_run else "single_step1") + ("_control" if control else "")
        return _checked(_launch(job, job.single_body, 1, job.out_dir / name, steps, record, control), what)
    inputs = (job.fingerprint, job.seed, steps, record, job.main_file) + (("control",) if control else ())
    key = hashlib.sha256(pickle.dumps(inputs) + pickle.dumps(job.single_body)).hexdigest()[:20]
    run_dir = job.cache_dir / f"single-{key}"
    if (run_dir / "complete").exists():
        return RunData.load(run_dir)
    data = _checked(_launch(job, job.single_body, 1, run_dir, steps, record, control), what)
    (run_dir / "complete").write_text("")
    return data


def accepts_micro_batch_size(factory: Any) -> bool:
    """Whether ``factory`` (a data module class, function or partial) takes a ``micro_batch_size`` argument."""
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
    param = parameters.get("micro_batch_size")
    return param is not None and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)


def pinned_single_body(job: Job, micro_batch_size: int) -> dict[str, Any]:
    """The single run's body with the layout's micro-batch size (see ``Job.micro_batch_pin``)."""
    body = dict(job.single_body)
    if job.micro_batch_pin == "config":
        config = dict(body["config"])
        config["data"] = {**config["data"], "micro_batch_size": micro_batch_size}
        body["config"] = config
    elif job.micro_batch_pin == "factory":
        body["datamodule_kwargs"] = {"micro_batch_size": micro_batch_size}
    else:
        raise ValueError("this job's data module has no micro_batch_size argument to pin")
    return body


def _checked(data: RunData, what: str) -> RunData:
    returncode = getattr(data, "returncode", 0)
    if data.errors or returncode != 0 or not data.ranks:
        detail = describe_error(data.errors)["summary"] if data.errors else _log_tail(data.path)
        raise VerifyConfigError(f"the {what} run failed (see {data.path / 'log.txt'}): {detail}")
    return data


def run_job(job: Job) -> VerifyReport:
    """Both runs, the comparison and, on failure, the localisation; writes ``verify.json``."""
    job.out_dir.mkdir(parents=True, exist_ok=True)
    record = job.localize == "always"
    single = _single(job, job.steps, record)
    layout = _launch(job, job.layout_body, job.layout_devices, job.out_dir / "layout", job.steps, record)
    single = _same_micro_batching(job, single, layout, record)
    control = None
    if job.noise_control and not layout.errors and layout.ranks:
        control = _single(job, job.steps, False, control=True)
    report = _report(job, single, layout, control)
    if not report.passed and job.localize != "never" and report.error is None and report.first_difference is None:
        if not record:
            single = _single(job, 1, True)
            layout = _launch(job, job.layout_body, job.layout_devices, job.out_dir / "layout_step1", 1, True)
            if layout.errors:
                report.error = describe_error(layout.errors)
                report.first_difference = report.error["summary"]
        if report.first_difference is None:
            localise(single, layout, report)
    if not report.passed and report.first_difference is None:
        report.first_difference = first_gradient_difference(report)
    routing = single.routing or layout.routing
    explain_micro_batching(report, routing, job.micro_batch_pin, job.data_setting)
    explain_batch_statistics(report, routing)
    report.write_json(job.out_dir / "verify.json")
    return report


def _same_micro_batching(job: Job, single: RunData, layout: RunData, record: bool) -> RunData:
    """The single run again with the layout's micro-batch size when the two runs' differ.

    Batch-level statistics (the load-balancing loss, capacity, ...) are taken per micro-batch, so
    the reference must cut each step into the same micro-batches as the layout. With the library's
    data modules they already agree (their default micro-batch does not depend on the layout); a
    data module whose micro-batch follows the layout gets its ``micro_batch_size`` argument set on
    the single run. Changes ``job.single_body`` so that a localisation re-run uses it too.
    """
    if layout.errors or not layout.ranks:
        return single
    mismatch = compare_micro_batching(single, layout)
    if mismatch is None or job.micro_batch_pin is None:
        return single
    size = mismatch["layout_micro_batch_size"]
    if size is None or size == mismatch["single_micro_batch_size"]:
        return single  # the same size grouped otherwise: setting the size cannot help (reported)
    job.single_body = pinned_single_body(job, size)
    job.notes.append(
        f"the one-process reference runs with the layout's micro-batch size {size}: with its own"
        f" ({mismatch['single']} per step, against {mismatch['layout']}) batch-level statistics would differ"
    )
    return _single(job, job.steps, record)


def _report(job: Job, single: RunData, layout: RunData, control: RunData | None = None) -> VerifyReport:
    run_dirs = {"single": str(single.path), "layout": str(layout.path)}
    if control is not None:
        run_dirs["control"] = str(control.path)
    if layout.errors or getattr(layout, "returncode", 0) != 0 or len(layout.ranks) < job.layout_devices:
        report = VerifyReport(
            passed=False,
            layout=job.layout,
            steps=job.steps,
            rtol=job.rtol,
            run_dirs=run_dirs,
            model=job.model_name,
            notes=list(job.notes),
        )
        if layout.errors:
            report.error = describe_error(layout.errors)
        else:
            report.error = {
                "summary": f"the layout run failed without a Python error (exit code"
                f" {getattr(layout, 'returncode', '?')}); the end of its output:\n"
                f"{_log_tail(layout.path)}"
            }
        report.first_difference = report.error["summary"]
        return report
    report = compare_runs(single, layout, job.rtol, control)
    report.layout = job.layout
    report.model = job.model_name
    report.run_dirs = run_dirs
    report.notes = list(job.notes) + report.notes
    samples = check_same_samples(single, layout)
    if samples:
        report.passed = False
        report.notes.append(samples)
        report.first_difference = samples
        return report
    if single.ranks[0].get("forward") and layout.ranks[0].get("forward") is not None:
        if report.passed:
            report.modules = compare_module_outputs(single, layout, job.rtol)
        else:
            localise(single, layout, report)
    report.micro_batching = compare_micro_batching(single, layout)
    return report


def fingerprint(*objects: Any) -> str:
    """Sources that the cached single run depends on: lightning_moe and the model's module (mtime, size)."""
    files = sorted(Path(__file__).resolve().parents[1].rglob("*.py"))
    for obj in objects:
        try:
            files.append(Path(inspect.getfile(obj)))
        except (TypeError, OSError):
            pass
    stats = [(str(f), f.stat().st_mtime_ns, f.stat().st_size) for f in files if f.exists()]
    return hashlib.sha256(json.dumps(stats).encode() + torch.__version__.encode()).hexdigest()


# -- the Python API ---------------------------------------------------------------------------------
def _factory_name(factory: Any) -> str:
    """A factory's name for the report: a class's or function's qualified name, a partial's function's."""
    while isinstance(factory, functools.partial):
        factory = factory.func
    return getattr(factory, "__qualname__", type(factory).__name__)


def verify_layout(
    module_factory: Callable[[], Any],
    datamodule_factory: Callable[[], Any],
    strategy_kwargs: dict[str, Any],
    devices: int,
    steps: int = 3,
    rtol: float = 1e-5,
    *,
    seed: int = 1234,
    trainer_kwargs: dict[str, Any] | None = None,
    localize: str = "on_failure",
    max_processes: int = 16,
    out_dir: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    timeout_s: float = 1800.0,
    verbose: bool = True,
    noise_control: bool = False,
) -> VerifyReport:
    """Train ``module_factory()`` for ``steps`` optimizer steps on one process and on
    ``MoE5DStrategy(**strategy_kwargs)`` over ``devices`` processes, and compare them in fp32.

    ``strategy_kwargs`` takes every layout the strategy takes (folded ep, HSDP, ``overlap_ep_comm``,
    the V pipeline schedules, ...), resolved as the strategy resolves it; the one-process reference
    runs the same arguments less the layout's own (:data:`ONE_PROCESS_OPTIONS`; HSDP becomes FSDP).
    ``noise_control=True`` also runs the reference with every initial parameter one rounding unit
    higher (a control of rounding noise, as a layout's other summation order has) and counts a
    loss or final parameter beyond ``rtol`` but within the noise floor that gives as agreeing
    (``report.within_noise_floor``).

    Both runs start in their own processes (Lightning re-executes the command line of each, so
    notebooks and pytest work). The factories must be picklable: classes, module-level functions
    or ``functools.partial`` of them; factories defined in your script are found by loading the
    script again in the workers, so keep the call under ``if __name__ == "__main__":``.

    The one-process reference cuts every step into the layout's micro-batches: when they differ
    (a data module whose micro-batch follows the layout), it runs again with
    ``datamodule_factory(micro_batch_size=<the layout's>)``; a factory without that argument gets
    a FAIL that says micro-batching explains it, and the fix.

    Returns a :class:`VerifyReport`: ``report.passed``, ``print(report)`` for the table,
    ``report.first_difference`` on failure. ``out_dir`` (default: a fresh temporary folder) gets the
    runs and ``verify.json``; ``cache_dir`` reuses a single-process run with identical inputs.

    Example::

        from functools import partial
        from lightning_moe import verify_layout
        from lightning_moe.data import ByteTextDataModule
        from mypkg import MyMoEModule

        report = verify_layout(MyMoEModule, partial(ByteTextDataModule, global_batch_size=8, seq_len=64),
                               {"ep": 2, "tp": 2}, devices=4)
        assert report.passed, report
    """
    import tempfile

    if os.environ.get(SPEC_ENV):
        raise RuntimeError(
            "verify_layout() was called while a verification worker loaded your script: put the call under"
            " `if __name__ == '__main__':`"
        )
    if localize not in LOCALIZE_MODES:
        raise VerifyConfigError(f"localize={localize!r} must be one of {LOCALIZE_MODES}")
    if steps < 1:
        raise VerifyConfigError(f"steps={steps} must be >= 1")
    resolved = resolved_layout(devices, strategy_kwargs)
    check_processes(devices, max_processes)
    for name, obj in (("module_factory", module_factory), ("datamodule_factory", datamodule_factory)):
        try:
            pickle.dumps(obj)
        except Exception as err:
            raise VerifyConfigError(
                f"{name} cannot reach the worker processes ({type(err).__name__}: {err}): pass a class, a"
                " module-level function or functools.partial of one (not a lambda or a local function)"
            ) from err
    dropout = check_deterministic_build(module_factory, seed, "module_factory()")
    notes = []
    if dropout:
        message = f"dropout is not disabled ({', '.join(dropout)}): verification turns it off in both runs"
        warnings.warn(f"verify: {message}", stacklevel=2)
        notes.append(message)
    trainer_kwargs = dict(trainer_kwargs or {})
    trainer_kwargs.setdefault("accelerator", "auto")
    trainer_kwargs.setdefault("use_distributed_sampler", False)
    single_kwargs = one_process_options(strategy_kwargs, complete=True)
    main_file = None
    if any(
        getattr(f, "__module__", None) == "__main__"
        or getattr(getattr(f, "func", None), "__module__", None) == "__main__"
        for f in (module_factory, datamodule_factory)
    ):
        main = sys.modules["__main__"]
        main_file = getattr(main, "__file__", None)
        if main_file is None:
            raise VerifyConfigError(
                "the factories are defined in an interactive session: define them in an importable module"
            )
    common = {
        "kind": "factories",
        "module_factory": module_factory,
        "datamodule_factory": datamodule_factory,
        "trainer_kwargs": trainer_kwargs,
    }
    job = Job(
        single_body={**common, "strategy_kwargs": single_kwargs, "devices": 1},
        layout_body={**common, "strategy_kwargs": dict(strategy_kwargs), "devices": devices},
        layout_devices=devices,
        layout=layout_record(resolved),
        seed=seed,
        steps=steps,
        rtol=rtol,
        localize=localize,
        out_dir=Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="lightning_moe_verify_")),
        cache_dir=Path(cache_dir) if cache_dir is not None else None,
        timeout_s=timeout_s,
        main_file=main_file,
        model_name=_factory_name(module_factory),
        notes=notes,
        fingerprint=fingerprint(module_factory),
        micro_batch_pin="factory" if accepts_micro_batch_size(datamodule_factory) else None,
        data_setting="micro_batch_size of datamodule_factory",
        noise_control=noise_control,
    )
    report = run_job(job)
    if verbose:
        print(report)
    return report


__all__ = [
    "LOCALIZE_MODES",
    "ONE_PROCESS_OPTIONS",
    "VerifyConfigError",
    "accepts_micro_batch_size",
    "check_deterministic_build",
    "check_processes",
    "layout_record",
    "one_process_options",
    "pinned_single_body",
    "resolved_layout",
    "run_job",
    "verify_layout",
]

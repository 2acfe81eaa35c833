"""``python -m lightning_moe.verify [overrides]``: the train config, run twice and compared.

Same config groups as ``python -m lightning_moe.train`` (``conf/verify.yaml`` extends ``train.yaml``),
plus ``verify.*``. Prints the comparison table and PASS/FAIL, writes ``verify.json`` in the Hydra
output directory; exit code 0 on PASS, 1 on FAIL, 2 when the configuration cannot be verified.

Examples::

    python -m lightning_moe.verify parallel=tp2_ep2
    python -m lightning_moe.verify parallel=cp2 model.num_layers=2 verify.steps=2
    python -m lightning_moe.verify ~model +model._target_=mypkg.MyModule parallel=ep2   # a class with other keys
    python -m lightning_moe.verify -m parallel=ep2,tp2,cp2 verify.cache_dir=/tmp/verify-cache
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

import lightning_moe.conf  # noqa: F401  (registers the lmoe.devices resolver)
from lightning_moe.verify.report import VerifyReport
from lightning_moe.verify.runner import (
    LOCALIZE_MODES,
    Job,
    VerifyConfigError,
    accepts_micro_batch_size,
    check_deterministic_build,
    check_processes,
    fingerprint,
    layout_record,
    one_process_options,
    resolved_layout,
    run_job,
)


def _as_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise VerifyConfigError(f"{what}={value!r}: verification needs a number of processes (an integer)")
    return value


def job_from_config(cfg: DictConfig, out_dir: Path) -> Job:
    """Resolve ``cfg`` and derive the two runs; checks the process count, determinism and dropout."""
    verify = cfg.verify
    if verify.localize not in LOCALIZE_MODES:
        raise VerifyConfigError(f"verify.localize={verify.localize!r} must be one of {LOCALIZE_MODES}")
    config = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(config, dict)
    trainer, parallel = config["trainer"], config["parallel"]
    # Each run writes into its own folder; the job's output dir must not make cached single runs differ.
    trainer["default_root_dir"] = None
    devices = _as_int(trainer.get("devices", 1), "trainer.devices")
    num_nodes = _as_int(trainer.get("num_nodes", 1), "trainer.num_nodes")
    check_processes(devices * num_nodes, int(verify.max_processes), num_nodes)
    layout = layout_record(resolved_layout(devices * num_nodes, parallel))
    if int(verify.steps) < 1:
        raise VerifyConfigError(f"verify.steps={verify.steps} must be >= 1")
    notes = []
    if str(trainer.get("precision", "32-true")) not in ("32-true", "32", "32-true"):
        notes.append(f"trainer.precision={trainer['precision']} replaced by 32-true: verification compares in fp32")
    model_cfg = OmegaConf.create(config["model"])
    target = model_cfg.get("_target_")
    dropout = check_deterministic_build(
        lambda: hydra.utils.instantiate(model_cfg), int(config["seed"]), f"the model ({target})"
    )
    if dropout:
        message = f"dropout is not disabled ({', '.join(dropout)}): verification turns it off in both runs"
        print(f"verify: warning: {message}", file=sys.stderr)
        notes.append(message)
    single = copy.deepcopy(config)
    single["parallel"] = one_process_options(single["parallel"])
    single["trainer"].update(devices=1, num_nodes=1)
    try:
        model_class = hydra.utils.get_class(target) if target else None
    except Exception:
        model_class = None
    try:
        data_target = config["data"].get("_target_")
        data_class = hydra.utils.get_class(data_target) if data_target else None
    except Exception:
        data_class = None
    return Job(
        single_body={"kind": "config", "config": single},
        layout_body={"kind": "config", "config": config},
        layout_devices=devices,
        layout=layout,
        seed=int(config["seed"]),
        steps=int(verify.steps),
        rtol=float(verify.rtol),
        localize=str(verify.localize),
        out_dir=out_dir,
        cache_dir=Path(verify.cache_dir) if verify.get("cache_dir") else None,
        timeout_s=float(verify.timeout_s),
        model_name=str(target),
        notes=notes,
        fingerprint=fingerprint(model_class),
        micro_batch_pin="config" if data_class is not None and accepts_micro_batch_size(data_class) else None,
        data_setting="data.micro_batch_size",
        noise_control=bool(verify.get("noise_control", False)),
    )


def verify_config(cfg: DictConfig, out_dir: Path) -> VerifyReport:
    report = run_job(job_from_config(cfg, out_dir))
    print(report)
    print(f"verify.json: {out_dir / 'verify.json'}")
    return report


@hydra.main(version_base="1.3", config_path="../conf", config_name="verify")
def main(cfg: DictConfig) -> bool:
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    try:
        report = verify_config(cfg, out_dir)
    except VerifyConfigError as err:
        print(f"verify: error: {err}", file=sys.stderr)
        if multirun:
            return False
        sys.exit(2)
    if not multirun:
        sys.exit(0 if report.passed else 1)
    return report.passed


if __name__ == "__main__":
    main()

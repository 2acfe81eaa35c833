"""The Hydra config groups of the entry points (``train.yaml``, ``plan.yaml``, ``verify.yaml`` and their
groups), and the ``lmoe.devices`` and ``lmoe.launcher_run_id`` resolvers they use."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_moe.layout import layout_request, resolve_layout

CONF_DIR = Path(__file__).resolve().parent


def devices_per_node(parallel: DictConfig, num_nodes: int = 1) -> int:
    """Processes per node implied by the parallel sizes; ``dp="auto"`` counts as 1, and ep only its
    part not folded over tp/cp (``fold_ep``).

    Registered as the ``lmoe.devices`` resolver, which ``conf/trainer/default.yaml`` uses for
    ``trainer.devices``. Example::

        devices_per_node(OmegaConf.create({"ep": 2, "dp": 2}))  # 4
    """
    # dp="auto" counts as 1; HSDP's split of dp changes no process count.
    request = {k: v for k, v in layout_request(parallel).items() if k in ("fold_ep", "etp") or isinstance(v, int)}
    request.setdefault("dp", 1)
    request.pop("dp_replicate", None), request.pop("dp_shard", None)
    world_size = resolve_layout(None, **request).world_size
    if world_size % num_nodes:
        raise ValueError(
            f"the parallel sizes give {world_size} processes, not divisible by trainer.num_nodes={num_nodes}: "
            "set trainer.devices (processes per node) yourself or change the sizes"
        )
    return world_size // num_nodes


def launcher_run_id(default: Any = None) -> Any:
    """The id of the job a launcher started, as a run name, else ``default``: ``slurm-<SLURM_JOB_ID>``
    (a requeued job keeps its id; not in an interactive allocation), ``torchrun-<TORCHELASTIC_RUN_ID>``
    (torchrun's ``--rdzv-id``, the same for every rank and every ``--max-restarts`` restart; a random
    one under ``--standalone``), with ``-<job number>`` added in a Hydra sweep so that its jobs stay
    apart.

    Registered as the ``lmoe.launcher_run_id`` resolver: ``train.yaml``'s ``hydra.run.dir`` (every rank
    and every restart of a job writes to one directory) and the W&B run id (a restart continues the
    run). Example::

        os.environ["SLURM_JOB_ID"] = "4242"
        launcher_run_id("2026-12-03/21-40-00")  # 'slurm-4242'
    """
    slurm_job, torchrun_run = os.environ.get("SLURM_JOB_ID"), os.environ.get("TORCHELASTIC_RUN_ID")
    # An interactive allocation (job name "bash" or "interactive", as Lightning's SLURM detection has
    # it) holds many runs, each of which wants its own directory.
    if slurm_job and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        run_id = f"slurm-{slurm_job}"
    elif torchrun_run and torchrun_run != "none":  # "none": torchrun's --rdzv-id when not given
        run_id = f"torchrun-{torchrun_run}"
    else:
        return default
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        run_id += f"-{HydraConfig.get().job.num}"
    return run_id


# Registered at import (every entry point and CONF_DIR's user imports this) so that configs composed
# elsewhere (tests, notebooks) resolve too.
OmegaConf.register_new_resolver("lmoe.devices", devices_per_node, replace=True)
OmegaConf.register_new_resolver("lmoe.launcher_run_id", launcher_run_id, replace=True)

"""The Hydra config groups of the entry points (``train.yaml``, ``plan.yaml``, ``verify.yaml`` and their
groups), and the ``lmoe.devices`` resolver they use."""

from __future__ import annotations

from pathlib import Path

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


# Registered at import (every entry point and CONF_DIR's user imports this) so that configs composed
# elsewhere (tests, notebooks) resolve too.
OmegaConf.register_new_resolver("lmoe.devices", devices_per_node, replace=True)

import os

import pytest
import torch
import yaml

from tests.dist_pool import DistributedPool

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")

_POOLS: dict[int, DistributedPool] = {}


def get_pool(world_size: int) -> DistributedPool:
    """One live pool per world size for the whole session (restarted if a test broke it)."""
    pool = _POOLS.get(world_size)
    if pool is None or not pool.alive:
        pool = _POOLS[world_size] = DistributedPool(world_size)
    return pool


def close_pools(keep: int | None = None) -> None:
    """Stop the idle pools but the one of world size ``keep`` (the next ``get_pool`` starts a fresh one).

    Every process group keeps a gloo loop thread that wakes up even when idle; after the layouts
    of many tests, an idle pool's hundreds of them take a large share of 2 cores from the
    processes a CLI test starts, or from another pool.
    """
    for world_size in [size for size in _POOLS if size != keep]:
        _POOLS.pop(world_size).close()


# The V pipeline schedules need torch >= 2.13 (lightning_moe._compat.V_SCHEDULE_MIN_TORCH): on the floor
# torch their presets are refused before any work, which tests that build every preset must skip.
TORCH_RELEASE = tuple(int(v) for v in torch.__version__.split(".")[:2])
NEEDS_V_SCHEDULE_TORCH = pytest.mark.skipif(TORCH_RELEASE < (2, 13), reason="the V schedules need torch >= 2.13")


def presets_this_torch_builds(options: list[str]) -> list:
    """Config options (``name`` or ``group=name``) as pytest params, a parallel preset that runs a V
    schedule marked to skip where this torch refuses it."""
    from lightning_moe.layout import V_SCHEDULES
    from lightning_moe.train import CONF_DIR

    def runs_v_schedule(option: str) -> bool:
        path = CONF_DIR / "parallel" / f"{option.split('=')[-1]}.yaml"
        if not (option.startswith("parallel=") or "=" not in option) or not path.exists():
            return False
        return (yaml.safe_load(path.read_text()) or {}).get("pp_schedule") in V_SCHEDULES

    return [pytest.param(o, marks=NEEDS_V_SCHEDULE_TORCH) if runs_v_schedule(o) else o for o in options]


@pytest.fixture
def pool4() -> DistributedPool:
    return get_pool(4)


def pytest_sessionfinish(session, exitstatus):
    close_pools()

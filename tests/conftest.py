import os

import pytest

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


@pytest.fixture
def pool4() -> DistributedPool:
    return get_pool(4)


def pytest_sessionfinish(session, exitstatus):
    close_pools()

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


@pytest.fixture
def pool4() -> DistributedPool:
    return get_pool(4)


def pytest_sessionfinish(session, exitstatus):
    for pool in _POOLS.values():
        pool.close()

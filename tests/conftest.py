import os

import pytest

from tests.dist_pool import DistributedPool, close_pools, get_pool

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")


@pytest.fixture
def pool4() -> DistributedPool:
    return get_pool(4)


def pytest_sessionfinish(session, exitstatus):
    close_pools()

import os
from pathlib import Path

import pytest

from tests.dist_pool import DistributedPool, close_pools, get_pool

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")


def pytest_addoption(parser):
    parser.addoption(
        "--cost-report",
        metavar="FILE",
        default=None,
        help="write each test's time, split into new processes, the worker pool and the test process (tests/cost_report.py)",
    )


def pytest_configure(config):
    path = config.getoption("--cost-report")
    if path:
        from tests.cost_report import CostRecorder

        recorder = CostRecorder(Path(path).resolve())
        recorder.install()
        config.pluginmanager.register(recorder, "cost_report")


@pytest.fixture
def pool4() -> DistributedPool:
    return get_pool(4)


def pytest_sessionfinish(session, exitstatus):
    close_pools()

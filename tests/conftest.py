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


@pytest.fixture(scope="session")
def one_process_losses(tmp_path_factory):
    """``losses(*overrides, base=TINY_RUN)``: the per-step losses of ``parallel=single`` with ``overrides``
    on ``base`` (the reference of the layout tests), trained once per distinct config in the session."""
    from tests.cli import TINY_RUN, train_in_pool

    cache: dict[tuple[tuple[str, ...], tuple[str, ...]], list[float]] = {}

    def losses(*overrides: str, base=TINY_RUN) -> list[float]:
        key = (tuple(base), overrides)
        if key not in cache:
            run_dir = tmp_path_factory.mktemp("one_process") / "run"
            cache[key] = train_in_pool(run_dir, "parallel=single", *overrides, base=base)["losses"]
        return cache[key]

    return losses


def pytest_sessionfinish(session, exitstatus):
    close_pools()

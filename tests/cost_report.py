"""Where the suite's time goes: ``pytest --cost-report=FILE`` writes each test's wall time split into
the seconds it spent in new processes (``subprocess``: CLI launches, scripts, torchrun), in the worker
pool's ranks (``pool``: multi-process runs without a launch) and in the test process itself, with the
test's family, as JSON (under pytest-xdist one file per worker, ``FILE.gw0`` ...); ``python -m
tests.cost_report FILE...`` prints the table docs/testing.md shows.

The split is measured by wrapping ``subprocess.run``/``Popen.wait``/``communicate`` and
``DistributedPool.run`` for the session; a test's family is read from its file and id.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

# The first matching rule names a test's family (file name, then parameter id).
FAMILIES = (
    ("hf", ("test_hf_",)),
    ("planner", ("test_planner", "test_plan")),
    ("bf16", ("bf16",)),
    ("readme and docs", ("test_readme", "test_first_impressions")),
    ("data", ("test_data",)),
    ("checkpoints and restarts", ("test_checkpoint", "test_cluster_launch", "test_hangs")),
)


def family(nodeid: str) -> str:
    for name, needles in FAMILIES:
        if any(needle in nodeid for needle in needles):
            return name
    return "other"


class CostRecorder:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.current: dict[str, float] | None = None
        self.records: list[dict] = []
        self._patches: list[tuple[object, str, object]] = []

    def _timed(self, owner: object, name: str, bucket: str) -> None:
        original = getattr(owner, name)
        recorder = self

        def wrapper(*args, **kwargs):
            if recorder.current is None or recorder.current.get("_inside"):
                return original(*args, **kwargs)
            recorder.current["_inside"] = 1.0
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                recorder.current[bucket] += time.perf_counter() - start
                recorder.current.pop("_inside")

        setattr(owner, name, wrapper)
        self._patches.append((owner, name, original))

    def install(self) -> None:
        from tests.dist_pool import DistributedPool

        self._timed(subprocess, "run", "subprocess")
        self._timed(subprocess.Popen, "wait", "subprocess")
        self._timed(subprocess.Popen, "communicate", "subprocess")
        self._timed(DistributedPool, "run", "pool")

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._patches):
            setattr(owner, name, original)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self.current = {"subprocess": 0.0, "pool": 0.0}
        start = time.perf_counter()
        yield
        total = time.perf_counter() - start
        spent = self.current
        self.current = None
        self.records.append(
            {
                "test": item.nodeid,
                "family": family(item.nodeid),
                "seconds": round(total, 3),
                "subprocess": round(spent["subprocess"], 3),
                "pool": round(spent["pool"], 3),
                "slow": item.get_closest_marker("slow") is not None,
            }
        )

    def pytest_sessionfinish(self, session, exitstatus):
        self.uninstall()
        if not self.records:  # xdist's controller runs no test
            return
        worker = getattr(session.config, "workerinput", {}).get("workerid")
        path = self.path.with_name(f"{self.path.name}.{worker}") if worker else self.path
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.records, indent=1))
        tmp.replace(path)


def table(records: list[dict]) -> str:
    """A Markdown table: per family, tests, seconds, and the shares in new processes and in the pool."""
    rows: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for record in records:
        for key in (record["family"], "all"):
            row = rows[key]
            row[0] += 1
            row[1] += record["seconds"]
            row[2] += record["subprocess"]
            row[3] += record["pool"]
    lines = [
        "| family | tests | s | in new processes (s) | in the worker pool (s) | in the test process (s) |",
        "|---|---|---|---|---|---|",
    ]
    for name, (count, seconds, launched, pooled) in sorted(rows.items(), key=lambda kv: (kv[0] == "all", -kv[1][1])):
        lines.append(
            f"| {name} | {count} | {seconds:.0f} | {launched:.0f} | {pooled:.0f} | {seconds - launched - pooled:.0f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    records = [record for name in sys.argv[1:] for record in json.loads(Path(name).read_text())]
    print(table(records))
    print()
    print("slowest:")
    for record in sorted(records, key=lambda r: -r["seconds"])[:30]:
        print(f"{record['seconds']:7.1f}  {record['test']}")

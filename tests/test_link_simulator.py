"""The link simulator: units, the model's semantics and its calibration (timed, sleep-dominated).

The delays are sleeps of 0.2-0.3 s, far above what a tiny gloo call costs here, so the timings
hold on a loaded 2-core machine; the calibration takes the median of three runs.
"""

from __future__ import annotations

import statistics
import time

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist

from lightning_moe.comm.link_simulator import LinkSimulator, parse_bandwidth, parse_duration
from tests.dist_pool import get_pool

WORLD = 2
SENT = 1_000_000  # bytes each rank sends to its peer in one all-to-all
BANDWIDTH = 4e6  # bytes/s: the all-to-all takes 0.25 s
T = SENT / BANDWIDTH
TOLERANCE = 0.10


# -- units and settings (no process group) ---------------------------------------------------------
@pytest.mark.parametrize(
    "text, value",
    [
        ("50GB/s", 50e9),
        ("400Gb/s", 50e9),
        ("200MB/s", 200e6),
        ("1GiB/s", 2**30),
        ("8b/s", 1.0),
        (1e6, 1e6),
        ("inf", None),
        (None, None),
    ],
)
def test_bandwidth_units(text, value):
    assert parse_bandwidth(text) == pytest.approx(value) if value else parse_bandwidth(text) is None


@pytest.mark.parametrize(
    "text, value", [("10us", 1e-5), ("1.5ms", 1.5e-3), ("2s", 2.0), ("500ns", 5e-7), (0.25, 0.25), (None, 0.0)]
)
def test_duration_units(text, value):
    assert parse_duration(text) == pytest.approx(value)


@pytest.mark.parametrize("bad", ["fast", "50GB", "-1MB/s", "0GB/s"])
def test_bad_bandwidth_is_an_error(bad):
    with pytest.raises(ValueError, match="bandwidth"):
        parse_bandwidth(bad)


def test_most_specific_setting_wins():
    sim = LinkSimulator(ep_inter="50GB/s", inter="25GB/s", bandwidth="1GB/s", latency="10us", ep_latency="2us")
    assert sim.link("ep", inter=True) == (pytest.approx(2e-6), 50e9)
    assert sim.link("ep", inter=False) == (pytest.approx(2e-6), 1e9)
    assert sim.link("dp", inter=True) == (pytest.approx(1e-5), 25e9)
    assert sim.transfer_time("ep", 50_000, inter=True) == pytest.approx(2e-6 + 1e-6)
    assert LinkSimulator(ep="1MB/s").link("tp") is None  # unset: not simulated
    assert LinkSimulator().transfer_time("ep", 10**9) == 0.0


def test_unknown_setting_is_an_error():
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['ep_internode'\]"):
        LinkSimulator(ep_internode="50GB/s")


# -- the model, on 2 gloo processes ----------------------------------------------------------------
def _ep_dims(ranks_per_node: int | None = None):
    from lightning_moe import ParallelDims

    dims = ParallelDims(ep=WORLD, ranks_per_node=ranks_per_node)
    dims.build_mesh("cpu")
    return dims


def _a2a(group, async_op=False):
    x = torch.ones(2 * SENT // 4)  # fp32: half of it goes to the peer
    return dist.all_to_all_single(torch.empty_like(x), x, group=group, async_op=async_op)


def _timed(fn):
    dist.barrier()
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def calibration_case() -> dict:
    dims = _ep_dims()
    group = dims.ep_group
    sim = LinkSimulator(ep=BANDWIDTH)
    out: dict = {}
    with sim.simulate(dims):
        out["sync"] = [_timed(lambda: _a2a(group))[0] for _ in range(3)]
        out["stats"] = dict(sim.stats["ep"])
        # async: returns at once; wait() completes at the deadline
        dist.barrier()
        start = time.perf_counter()
        work = _a2a(group, async_op=True)
        out["async_issue"] = time.perf_counter() - start
        work.wait()
        out["async_done"] = time.perf_counter() - start
        out["is_work"] = isinstance(work, dist.distributed_c10d.Work)
        # compute longer than the transfer, then wait: no further delay
        dist.barrier()
        work = _a2a(group, async_op=True)
        time.sleep(1.2 * T)
        out["late_wait"] = _timed(work.wait)[0]
        # a sync call after that compute: its own transfer time only
        work = _a2a(group, async_op=True)
        time.sleep(1.2 * T)
        start = time.perf_counter()
        _a2a(group)
        out["sync_after_compute"] = time.perf_counter() - start
        # two calls issued back to back share the link: the second completes at 2T
        dist.barrier()
        start = time.perf_counter()
        first, second = _a2a(group, async_op=True), _a2a(group, async_op=True)
        first.wait()
        out["queued_first"] = time.perf_counter() - start
        second.wait()
        out["queued_second"] = time.perf_counter() - start
    out["unwrapped"] = _timed(lambda: _a2a(group))[0]  # after the block: real speed
    return out


@pytest.mark.slow
def test_calibration_and_async_semantics():
    for rank, out in enumerate(get_pool(WORLD).run(calibration_case)):
        median = statistics.median(out["sync"])
        if rank == 0:  # the figures docs/link-simulator.md quotes (pytest -s)
            print(
                f"\ncalibration (T = {T:.3f} s): sync {[round(t, 4) for t in out['sync']]}, async issue {out['async_issue']:.4f},"
                f" async wait done {out['async_done']:.4f}, wait after compute {out['late_wait']:.4f}, sync after compute"
                f" {out['sync_after_compute']:.4f}, queued {out['queued_first']:.4f} / {out['queued_second']:.4f}"
            )
        assert median == pytest.approx(T, rel=TOLERANCE), (rank, out["sync"])
        assert out["stats"] == {
            "calls": 3,
            "bytes": 3 * SENT,
            "seconds": pytest.approx(3 * T),
            "exposed": pytest.approx(3 * T, rel=TOLERANCE),
            "blocked": pytest.approx(3 * T, rel=TOLERANCE),
        }
        assert out["is_work"]
        assert out["async_issue"] < 0.1 * T, out
        assert out["async_done"] == pytest.approx(T, rel=TOLERANCE), out
        assert out["late_wait"] < 0.1 * T, out
        assert out["sync_after_compute"] == pytest.approx(T, rel=TOLERANCE), out
        assert out["queued_first"] == pytest.approx(T, rel=TOLERANCE), out
        assert out["queued_second"] == pytest.approx(2 * T, rel=TOLERANCE), out
        assert out["unwrapped"] < 0.1 * T, out


def functional_and_nodes_case() -> dict:
    from lightning_moe import comm
    from lightning_moe._compat import funcol
    from lightning_moe.callbacks import count_collectives, group_dims

    out: dict = {}
    dims = _ep_dims(ranks_per_node=1)  # one rank per node: the ep group crosses nodes
    group = dims.ep_group
    x = torch.ones(2 * SENT // 4)
    with LinkSimulator(ep_inter=BANDWIDTH).simulate(dims):
        dist.barrier()
        start = time.perf_counter()
        y = funcol.all_to_all_single(x, None, None, group)  # DTensor's kind: waited at first use
        out["funcol_issue"] = time.perf_counter() - start
        y = y + 1  # first use
        out["funcol_first_use"] = time.perf_counter() - start
        out["dp_untouched"] = _timed(lambda: dist.all_reduce(torch.ones(SENT // 4), group=dims.dense_grad_group))[0]
    # lightning_moe.comm's differentiable wrapper (waits at once), with the comm accounting installed
    # first: its caller check sees through the simulator's wrapper, so the call is counted once.
    comm.reset()
    with count_collectives(group_dims(dims)), LinkSimulator(ep_inter=BANDWIDTH).simulate(dims):
        elapsed, _ = _timed(
            lambda: comm.all_to_all_autograd(x, [x.numel() // 2] * 2, [x.numel() // 2] * 2, group, "ep")
        )
    out["comm_wrapper"] = elapsed
    out["counted"] = comm.snapshot()
    with LinkSimulator(ep_intra=BANDWIDTH).simulate(dims):
        out["intra_setting_on_inter_group"] = _timed(lambda: _a2a(group))[0]
    return out


@pytest.mark.slow
def test_functional_collectives_wait_at_first_use_and_nodes_split_links():
    for rank, out in enumerate(get_pool(WORLD).run(functional_and_nodes_case)):
        assert out["funcol_issue"] < 0.1 * T, out
        assert out["funcol_first_use"] == pytest.approx(T, rel=TOLERANCE), out
        assert out["comm_wrapper"] == pytest.approx(T, rel=TOLERANCE), out
        assert out["counted"] == {"ep": {"bytes": SENT, "calls": 1}}, out  # once, behind the simulator's wrapper
        assert out["dp_untouched"] < 0.1 * T, out
        assert out["intra_setting_on_inter_group"] < 0.1 * T, out


# -- Hydra ------------------------------------------------------------------------------------------
def test_link_config_group(tmp_path):
    from hydra import compose, initialize_config_dir

    from lightning_moe.comm.link_simulator import LinkSimulatorCallback
    from lightning_moe.conf import CONF_DIR
    from lightning_moe.train import build

    def callbacks(*overrides: str) -> list:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("train", overrides=[f"trainer.default_root_dir={tmp_path}", "logger=none", *overrides])
        return [c for c in build(cfg).trainer.callbacks if isinstance(c, LinkSimulatorCallback)]

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        default = build(compose("train", overrides=[f"trainer.default_root_dir={tmp_path}", "logger=none"]))
    assert all(isinstance(c, pl.Callback) for c in default.trainer.callbacks)  # nothing added by link=none
    assert callbacks() == []  # the default is no simulation
    assert callbacks("link=none") == []
    (sim,) = callbacks("link=ib_50", "link.ep_inter=25GB/s")
    assert sim.simulator.link("ep", inter=True)[1] == 25e9
    assert sim.simulator.link("ep", inter=True)[0] > 0

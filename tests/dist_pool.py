"""A pool of gloo worker processes kept alive across tests, so process groups are reused.

Tests send a module-level function by reference; every rank runs it and the results come back
in rank order. Workers are forked from a fork server that imported torch, Lightning and the
library once for the whole session: a spawned worker imports them itself (about 5 s of CPU each,
20 s for a pool of 4 on 2 loaded cores), a forked one starts in a tenth of a second.

The session keeps one live pool per world size (:func:`get_pool`). :func:`pool_of` and :func:`trim_pools`
stop idle pools past :data:`IDLE_RANKS` processes, :func:`close_pools` all of them when a test needs the cores
to itself (a timed failure, a memory measure), and the session's end (tests/conftest.py) stops them all.
"""

from __future__ import annotations

import importlib
import os
import tempfile
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

TASK_TIMEOUT_S = 600  # a 16-rank fit on 2 loaded cores takes minutes; a hang still ends

# Imported once by the fork server, before it forks any worker. The server is a fresh process
# (not a fork of pytest), so no thread of the test process is duplicated into a worker.
_PRELOAD = ["torch", "torch.distributed", "lightning.pytorch", "hydra", "lightning_moe.train", "tests.dist_pool"]
_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(_PRELOAD)


def _worker(rank: int, world_size: int, store_file: str, tasks: Any, results: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world_size)
    while True:
        task = tasks.get()
        if task is None:
            break
        module_name, fn_name, kwargs = task
        try:
            fn = getattr(importlib.import_module(module_name), fn_name)
            results.put((rank, True, fn(**kwargs)))
        except BaseException:  # noqa: BLE001 - the parent re-raises with the traceback
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class DistributedPool:
    """``world_size`` gloo processes that run test functions on demand.

    Example::

        pool = DistributedPool(4)
        outputs = pool.run(my_module_level_fn, seed=0)   # list, one entry per rank
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        ctx = _CONTEXT
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        # A file store, not a TCP port that another process could take before the workers bind it.
        self._store_dir = tempfile.TemporaryDirectory()
        store_file = f"{self._store_dir.name}/store"
        self._procs = [
            ctx.Process(
                target=_worker, args=(rank, world_size, store_file, self._tasks[rank], self._results), daemon=True
            )
            for rank in range(world_size)
        ]
        for proc in self._procs:
            proc.start()

    def run(self, fn: Callable[..., Any], **kwargs: Any) -> list[Any]:
        for queue in self._tasks:
            queue.put((fn.__module__, fn.__name__, kwargs))
        outputs: list[Any] = [None] * self.world_size
        failures = []
        for _ in range(self.world_size):
            try:
                rank, ok, value = self._results.get(timeout=TASK_TIMEOUT_S)
            except Exception as err:  # queue.Empty: a rank hung, most likely after another failed
                self.close()
                raise RuntimeError(
                    f"{fn.__name__}: no result within {TASK_TIMEOUT_S}s; failures so far: {failures}"
                ) from err
            if ok:
                outputs[rank] = value
            else:
                failures.append(f"rank {rank}:\n{value}")
                if len(failures) == 1:
                    # The other ranks may be stuck in a collective with the failed one.
                    self.close()
                    raise AssertionError(f"{fn.__name__} failed on rank {rank}:\n{value}")
        return outputs

    @property
    def alive(self) -> bool:
        return all(proc.is_alive() for proc in self._procs)

    def close(self) -> None:
        for queue in self._tasks:
            try:
                queue.put(None)
            except (OSError, ValueError):
                pass
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
        self._store_dir.cleanup()


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


# Idle pools kept alive beside the one in use, up to this many processes: the pools of 1 and 2 ranks that
# most comparisons take turns on. An idle rank takes about 1% of a core (its gloo threads wake up), while a
# pool's restart costs more than a second per run that follows it (its ranks fork, join a new world and pay
# the first fit's one-time costs again). Keeping 8-rank pools as well made the 8-rank runs slower, not faster.
IDLE_RANKS = 3


def trim_pools(keep: int | None = None) -> None:
    """Stop idle pools, largest first, until those other than the one of world size ``keep`` hold at most
    :data:`IDLE_RANKS` processes."""
    idle = sorted((size for size in _POOLS if size != keep), reverse=True)
    while idle and sum(idle) > IDLE_RANKS:
        _POOLS.pop(idle.pop(0)).close()


def pool_of(world_size: int) -> DistributedPool:
    """The pool of ``world_size`` processes, with no more than :data:`IDLE_RANKS` idle processes beside it."""
    trim_pools(keep=world_size)
    return get_pool(world_size)


def layout(**sizes: int) -> Any:
    """This worker's ``ParallelDims`` for ``sizes``, its mesh built (a later call for the same sizes takes the
    same process groups: ``ParallelDims.build_mesh`` reuses them, so tests do not pile up gloo threads)."""
    import torch.distributed as dist

    from lightning_moe import ParallelDims

    dims = ParallelDims(**sizes)
    dims.validate(dist.get_world_size())
    dims.build_mesh("cpu")
    return dims

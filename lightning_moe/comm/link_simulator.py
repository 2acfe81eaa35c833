"""A link simulator: collectives on a parallel dimension take the time a slower link would take.

On one host a gloo all-to-all costs almost nothing, so whether communication hides behind
compute cannot be measured there. Under :class:`LinkSimulator` every collective on a named dim
completes no earlier than ``latency + bytes / bandwidth`` after it was issued, so that overlap
(``MoELayer(dispatch_chunks=n)``, FSDP prefetching, pipeline P2P) shows in step time on a CPU.

This is a **model**, a benchmark and test tool, off by default; not a measurement of real links.
The model, per rank:

- A *link* is a (dim, span) pair: ``ep`` inside a node (``intra``) or across nodes (``inter``);
  a group spans nodes when its ranks sit on more than one node of
  ``ParallelDims(ranks_per_node=...)`` (``node_size``). Each link has a bandwidth (bytes/s;
  unset: infinite) and a latency (s; unset: 0).
- ``bytes`` is what this rank sends in the call, as the comm accounting counts it
  (:mod:`lightning_moe.comm.traffic`: an all-to-all's splits to other ranks, an all-gather's
  input once per peer, the ``2(n-1)/n`` of a ring all-reduce, ...).
- Calls on one link are served in issue order (FIFO, as one NCCL communicator runs its
  collectives in order): a call starts when it is issued or when the link has finished the
  previous call's bytes, whichever is later; it completes at ``start + latency + bytes / bandwidth``.
  Latency does not occupy the link.
- A synchronous call returns at the later of the real call's return and its completion time.
  An asynchronous call (``async_op=True``) returns at once; its work's ``wait()`` sleeps only for
  what remains of the completion time when waited on. A functional collective (DTensor, the
  ``lightning_moe.comm`` wrappers) returns at once too; the wait at the first use of its result
  (``wait_tensor``) sleeps for what remains.
- P2P (``batch_isend_irecv`` and the pipeline schedules' batches): one batch counts
  ``max(bytes sent, bytes received)`` on the link of its group.

What it does not model: bandwidth shared by concurrent links of one rank (NVLink and the NIC are
independent here; two groups on the same dim serialize), skew between ranks (time counts from
this rank's issue; the real collective still waits for every peer), congestion, the backward of
functional ``*_autograd`` collectives (issued by autograd in C++; the expert dispatch's backward is
a plain ``all_to_all_single`` and is delayed), calls under ``torch.compile``, and whatever the real
gloo transfer costs beyond the model (it overlaps the simulated time; keep simulated times above
it).

Example::

    sim = LinkSimulator(ep_inter="50GB/s", latency="10us")
    with sim.simulate(parallel_dims):       # the mesh must be built
        loss = model(batch).sum(); loss.backward()
    sim.stats["ep"]                          # {"calls": ..., "bytes": ..., "seconds": ...}

In a Lightning run use :class:`LinkSimulatorCallback` (Hydra: ``python -m lightning_moe.train
link=ib_50``).
"""

from __future__ import annotations

import functools
import inspect
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_moe._compat import wrap_distributed_functions
from lightning_moe.comm.traffic import (
    C10D_SENT_BYTES,
    FUNCOL_SENT_BYTES,
    GroupDims,
    SentBytes,
    group_dims,
    resolve_group,
    tensor_bytes,
)
from lightning_moe.layout import PARALLEL_DIMS

__all__ = ["LinkSimulator", "LinkSimulatorCallback", "parse_bandwidth", "parse_duration"]

SPANS = ("intra", "inter")

_BANDWIDTH_UNITS = {
    "B/s": 1.0, "KB/s": 1e3, "kB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9, "TB/s": 1e12,  # bytes
    "KiB/s": 2**10, "MiB/s": 2**20, "GiB/s": 2**30, "TiB/s": 2**40,
    "b/s": 1 / 8, "Kb/s": 1e3 / 8, "kb/s": 1e3 / 8, "Mb/s": 1e6 / 8, "Gb/s": 1e9 / 8, "Tb/s": 1e12 / 8,  # bits
}  # fmt: skip
_DURATION_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-zµ/]*)\s*$")


def parse_bandwidth(value: str | float | int | None) -> float | None:
    """Bytes per second from ``"50GB/s"``, ``"400Gb/s"`` (bits), ``"200MB/s"``, ``"1GiB/s"`` or a number
    (bytes/s). ``None``, ``"inf"`` or ``"none"``: infinite (no delay).

    Example::

        parse_bandwidth("400Gb/s")  # 5e10
    """
    if value is None or (isinstance(value, str) and value.strip().lower() in ("inf", "none", "")):
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number, unit = float(value), "B/s"
    else:
        match = _QUANTITY.match(str(value))
        if match is None:
            raise ValueError(f"bandwidth {value!r}: write a number and a unit, e.g. '50GB/s', '400Gb/s', '200MB/s'")
        number, unit = float(match.group(1)), match.group(2) or "B/s"
    if unit not in _BANDWIDTH_UNITS:
        raise ValueError(
            f"bandwidth {value!r}: unknown unit {unit!r}; use one of {sorted(_BANDWIDTH_UNITS)} (B: bytes, b: bits)"
        )
    if number == float("inf"):
        return None
    if number <= 0:
        raise ValueError(f"bandwidth {value!r} must be positive (leave it unset for an infinite one)")
    return number * _BANDWIDTH_UNITS[unit]


def parse_duration(value: str | float | int | None) -> float:
    """Seconds from ``"10us"``, ``"1.5ms"``, ``"2s"``, ``"500ns"`` or a number (seconds); ``None``: 0.

    Example::

        parse_duration("10us")  # 1e-05
    """
    if value is None:
        return 0.0
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        match = _QUANTITY.match(str(value))
        unit = match.group(2) if match else None
        if match is None or (unit or "s") not in _DURATION_UNITS:
            raise ValueError(
                f"latency {value!r}: write a number and a unit, one of {list(_DURATION_UNITS)} (e.g. '10us')"
            )
        seconds = float(match.group(1)) * _DURATION_UNITS[unit or "s"]
    if seconds < 0:
        raise ValueError(f"latency {value!r} must be >= 0")
    return seconds


def _sleep_until(deadline: float, exposed: dict[str, float] | None = None, blocked_since: float | None = None) -> None:
    """Sleep until ``deadline``; add the seconds slept to ``exposed["exposed"]`` (a dim's stats) and,
    given ``blocked_since`` (when the caller started waiting on the real call), the seconds from
    then to the end of the sleep to ``exposed["blocked"]``."""
    remaining = deadline - time.perf_counter()
    if remaining > 0:
        time.sleep(remaining)
        if exposed is not None:
            exposed["exposed"] += remaining
    if exposed is not None and blocked_since is not None:
        exposed["blocked"] += time.perf_counter() - blocked_since


class _DelayedWork(dist.distributed_c10d.Work):
    """An asynchronous ``Work`` that completes no earlier than its simulated completion time.

    A ``Work`` subclass (FSDP2 checks ``isinstance(work, Work)`` before waiting). ``wait()`` and
    ``synchronize()`` wait for the real work, then sleep for what remains; the rest is the real
    work's (``get_future()`` included: its future completes with the real transfer).
    """

    def __init__(self, work: Any, deadline: float, stats: dict[str, float] | None = None) -> None:
        super().__init__()
        self._work = work
        self._deadline = deadline
        self._stats = stats

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        waiting = time.perf_counter()
        result = self._work.wait(*args, **kwargs)
        _sleep_until(self._deadline, self._stats, waiting)
        return result

    def synchronize(self) -> None:
        self.wait()

    def is_completed(self) -> bool:
        return time.perf_counter() >= self._deadline and self._work.is_completed()

    def is_success(self) -> bool:
        return self._work.is_success()

    def exception(self) -> Any:
        return self._work.exception()

    def result(self) -> Any:
        return self._work.result()

    def source_rank(self) -> int:
        return self._work.source_rank()

    def get_future(self) -> Any:
        return self._work.get_future()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class LinkSimulator:
    """Bandwidth and latency for each parallel dim's links (see the module docstring for the model).

    Keyword arguments (bandwidths: ``"50GB/s"``, ``"400Gb/s"``, ``"200MB/s"`` or bytes/s; latencies:
    ``"10us"``, ``"2ms"`` or seconds), the most specific set one wins:

    - ``<dim>_<span>``, ``<dim>``, ``<span>``, ``bandwidth``: the bandwidth of dim (``tp``, ``cp``,
      ``ep``, ``dp``, ``pp``) inside a node (span ``intra``) or across nodes (``inter``);
    - ``<dim>_<span>_latency``, ``<dim>_latency``, ``<span>_latency``, ``latency``: the latency.

    A link with neither is not simulated; unset bandwidth is infinite, unset latency 0. Collectives
    on groups of none of the dims (a user's own group) are not delayed. ``stats[dim]`` sums, over the
    calls of the simulated block, ``calls``, ``bytes``, ``seconds`` (the simulated link time,
    ``latency + bytes / bandwidth`` per call), ``exposed`` (the seconds this rank slept waiting
    for simulated completions: the part of ``seconds`` nothing hid, up to the real calls' own time)
    and ``blocked`` (the seconds this rank's thread spent blocked on the calls: a synchronous call
    from its issue, an asynchronous one from its ``wait()``, real call and sleep together).

    Example::

        LinkSimulator(ep_inter="50GB/s", ep_intra="450GB/s", latency="10us")
        LinkSimulator(ep="40MB/s")             # every ep collective, wherever its ranks sit
    """

    def __init__(self, **links: str | float | int | None) -> None:
        allowed = {"bandwidth", "latency"}
        for scope in (*PARALLEL_DIMS, *SPANS, *(f"{d}_{s}" for d in PARALLEL_DIMS for s in SPANS)):
            allowed |= {scope, f"{scope}_latency"}
        unknown = sorted(set(links) - allowed)
        if unknown:
            raise ValueError(
                f"LinkSimulator: unknown setting(s) {unknown}; use <dim>, <dim>_intra, <dim>_inter, intra, inter or"
                f" bandwidth for a bandwidth and the same followed by _latency (or latency) for a latency,"
                f" dim in {list(PARALLEL_DIMS)}"
            )
        self.settings = {k: v for k, v in links.items() if v is not None}
        self._links: dict[tuple[str, str], tuple[float, float | None] | None] = {}
        for dim in PARALLEL_DIMS:
            for span in SPANS:
                self._links[(dim, span)] = self._resolve(dim, span)
        self.stats: dict[str, dict[str, float]] = {}
        self._groups = GroupDims()
        self._node_size: int | None = None
        self._link_free: dict[tuple[str, str], float] = {}
        self._group_cache: dict[tuple[str, bool, bool], tuple[int, int, tuple[str, str] | None]] = {}
        # storage address of a functional result -> (completion time, its dim's stats)
        self._pending: dict[int, tuple[float, dict[str, float]]] = {}
        self._local = threading.local()
        self._restore: Callable[[], None] | None = None

    def _resolve(self, dim: str, span: str) -> tuple[float, float | None] | None:
        def first(*keys: str) -> Any:
            return next((self.settings[k] for k in keys if k in self.settings), None)

        bandwidth = first(f"{dim}_{span}", dim, span, "bandwidth")
        latency = first(f"{dim}_{span}_latency", f"{dim}_latency", f"{span}_latency", "latency")
        if bandwidth is None and latency is None:
            return None
        return parse_duration(latency), parse_bandwidth(bandwidth)

    def link(self, dim: str, inter: bool = False) -> tuple[float, float | None] | None:
        """``(latency in s, bandwidth in bytes/s or None for infinite)`` of a link; None when not simulated."""
        return self._links.get((dim, "inter" if inter else "intra"))

    def transfer_time(self, dim: str, nbytes: int, inter: bool = False) -> float:
        """Seconds a call sending ``nbytes`` on an idle link takes: ``latency + nbytes / bandwidth``."""
        link = self.link(dim, inter)
        if link is None:
            return 0.0
        latency, bandwidth = link
        return latency + (nbytes / bandwidth if bandwidth else 0.0)

    # -- installing ---------------------------------------------------------------------------------
    @contextmanager
    def simulate(self, parallel_dims: Any = None, groups: GroupDims | None = None) -> Iterator[LinkSimulator]:
        """Delay every collective issued inside the block (all threads), then put torch's functions back.

        ``parallel_dims``: a :class:`~lightning_moe.ParallelDims` with its mesh built (its groups name
        the dims, ``node_size`` places ranks on nodes); or ``groups`` (a
        :class:`~lightning_moe.callbacks.GroupDims`; then every rank is on one node). Resets
        :attr:`stats`.
        """
        self.start(parallel_dims, groups)
        try:
            yield self
        finally:
            self.stop()

    def start(self, parallel_dims: Any = None, groups: GroupDims | None = None) -> None:
        """Install the simulator (see :meth:`simulate`); :meth:`stop` removes it."""
        if self._restore is not None:
            raise RuntimeError("LinkSimulator.start: this simulator is already installed; stop() it first")
        if groups is None:
            groups = group_dims(parallel_dims) if parallel_dims is not None else GroupDims()
        self._groups = groups
        self._node_size = parallel_dims.node_size if parallel_dims is not None else None
        self._link_free.clear()
        self._group_cache.clear()
        self._pending.clear()
        self.stats = {}
        c10d = {name: functools.partial(self._wrap_c10d, sent_bytes=fn) for name, fn in C10D_SENT_BYTES.items()}
        c10d["batch_isend_irecv"] = self._wrap_p2p_batch
        functional = {
            name: functools.partial(self._wrap_functional, sent_bytes=fn) for name, fn in FUNCOL_SENT_BYTES.items()
        }
        functional["wait_tensor"] = self._wrap_wait_tensor
        self._restore = wrap_distributed_functions(
            c10d=c10d, functional=functional, pipeline_batch=self._wrap_p2p_batch
        )

    def stop(self) -> None:
        """Put torch's functions back (a no-op when not installed)."""
        restore, self._restore = self._restore, None
        if restore is not None:
            restore()
        self._pending.clear()

    # -- the model ----------------------------------------------------------------------------------
    def _link_of(
        self, group: Any, functional: bool, all_to_all: bool = False
    ) -> tuple[int, int, tuple[str, str] | None]:
        """``(size, rank, link)`` of a call's group; link None: not simulated.

        The dim is the comm accounting's (:class:`~lightning_moe.callbacks.GroupDims`), except that an
        all-to-all on a rank set ep shares with the data-parallel groups (ep alone on every rank
        reuses the default group) is ep traffic: gradient reductions never use all-to-all.
        """
        pg = resolve_group(group)
        key = (pg.group_name, functional, all_to_all)
        info = self._group_cache.get(key)
        if info is None:
            ranks = dist.get_process_group_ranks(pg)
            dim = self._groups.dim_of(pg, functional)
            if all_to_all and "ep" in self._groups.by_ranks.get(frozenset(ranks), ()):
                dim = "ep"
            nodes = {r // self._node_size for r in ranks} if self._node_size else {0}
            span = "inter" if len(nodes) > 1 else "intra"
            link = (dim, span) if self._links.get((dim, span)) is not None else None
            info = (len(ranks), dist.get_rank(pg), link)
            self._group_cache[key] = info
        return info

    def _schedule(self, link: tuple[str, str], nbytes: int, issued: float) -> float:
        """Book ``nbytes`` on ``link`` for a call issued at ``issued``; return its completion time."""
        latency, bandwidth = self._links[link]  # type: ignore[misc]
        busy = nbytes / bandwidth if bandwidth else 0.0
        start = max(issued, self._link_free.get(link, 0.0))
        self._link_free[link] = start + busy
        entry = self.stats.setdefault(link[0], {"calls": 0, "bytes": 0, "seconds": 0.0, "exposed": 0.0, "blocked": 0.0})
        entry["calls"] += 1
        entry["bytes"] += nbytes
        entry["seconds"] += latency + busy
        return start + busy + latency

    @contextmanager
    def _outermost(self) -> Iterator[bool]:
        """True for the outermost simulated call of this thread (torch's functions call one another)."""
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        try:
            yield depth == 0
        finally:
            self._local.depth = depth

    def _issue(
        self,
        fn: Callable[..., Any],
        signature: inspect.Signature,
        sent_bytes: SentBytes,
        functional: bool,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[Any, float | None, tuple[str, str] | None, bool]:
        """Run ``fn`` and schedule its transfer on its link: ``(result, deadline, link, async_op)``;
        no deadline when the call is nested in another simulated one, off every simulated link or on one rank."""
        issued = time.perf_counter()
        with self._outermost() as outermost:
            if not outermost:
                return fn(*args, **kwargs), None, None, False
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            size, rank, link = self._link_of(
                bound.arguments.get("group"), functional, fn.__name__.startswith("all_to_all")
            )
            if link is None or size < 2:
                return fn(*args, **kwargs), None, None, False
            deadline = self._schedule(link, sent_bytes(bound.arguments, size, rank), issued)
            return fn(*args, **kwargs), deadline, link, bool(bound.arguments.get("async_op"))

    def _wrap_c10d(self, fn: Callable[..., Any], sent_bytes: SentBytes) -> Callable[..., Any]:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calling = time.perf_counter()
            result, deadline, link, async_op = self._issue(fn, signature, sent_bytes, False, args, kwargs)
            if deadline is None or link is None:
                return result
            if async_op and result is not None:
                return _DelayedWork(result, deadline, self.stats[link[0]])
            _sleep_until(deadline, self.stats[link[0]], calling)
            return result

        return wrapper

    def _wrap_p2p_batch(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(p2p_ops: list[Any], *args: Any, **kwargs: Any) -> Any:
            issued = time.perf_counter()
            with self._outermost() as outermost:
                if not outermost:
                    return fn(p2p_ops, *args, **kwargs)
                per_link: dict[tuple[str, str], list[int]] = {}
                for op in p2p_ops:
                    size, _, link = self._link_of(op.group, False)
                    if link is not None and size > 1:
                        sent_received = per_link.setdefault(link, [0, 0])
                        sent_received[0 if getattr(op.op, "__name__", "") == "isend" else 1] += tensor_bytes(op.tensor)
                deadline = max((self._schedule(link, max(sr), issued) for link, sr in per_link.items()), default=0.0)
                works = fn(p2p_ops, *args, **kwargs)
            if not per_link:
                return works
            stats = self.stats[next(iter(per_link))[0]]
            if isinstance(works, list):
                return [_DelayedWork(w, deadline, stats) for w in works]
            return _DelayedWork(works, deadline, stats) if works is not None else works

        return wrapper

    def _wrap_functional(self, fn: Callable[..., Any], sent_bytes: SentBytes) -> Callable[..., Any]:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            result, deadline, link, _ = self._issue(fn, signature, sent_bytes, True, args, kwargs)
            if deadline is not None and link is not None:
                self._await_at_first_use(result, deadline, self.stats[link[0]])
            return result

        return wrapper

    def _await_at_first_use(self, result: Any, deadline: float, stats: dict[str, float]) -> None:
        """Remember ``deadline`` for the storage of a functional collective's result; its
        ``wait_tensor`` (explicit, or at the first use of an ``AsyncCollectiveTensor``) sleeps for it.
        A result already waited on (under tracing) waits here."""
        inner = getattr(result, "elem", None)
        if not isinstance(result, torch.Tensor) or inner is None or getattr(result, "completed", True):
            _sleep_until(deadline, stats)
            return
        key = inner.untyped_storage().data_ptr()
        if key == 0:  # nothing allocated: no storage to find it by
            _sleep_until(deadline, stats)
            return
        entry = (deadline, stats)
        self._pending[key] = entry
        pending = self._pending
        weakref.finalize(inner, lambda: pending.get(key) is entry and pending.pop(key, None))

    def _wrap_wait_tensor(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            waiting = time.perf_counter()
            out = fn(tensor, *args, **kwargs)
            if self._pending:
                inner = getattr(tensor, "elem", tensor)
                entry = self._pending.pop(inner.untyped_storage().data_ptr(), None)
                if entry is not None:
                    _sleep_until(*entry, waiting)
            return out

        return wrapper


class LinkSimulatorCallback(pl.Callback):
    """Run training under a :class:`LinkSimulator` (its keyword arguments), from the start of fit to
    its end, and print the simulated link time per dim and step at the end (rank 0).

    Example (Hydra: ``python -m lightning_moe.train link=ib_50 parallel=ep2 ++parallel.ranks_per_node=1``)::

        Trainer(strategy=MoE5DStrategy(ep=2), callbacks=[LinkSimulatorCallback(ep_inter="50GB/s", latency="10us")])
    """

    def __init__(self, **links: str | float | int | None) -> None:
        self.simulator = LinkSimulator(**links)
        self._steps = 0

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_moe.parallel.dims import parallel_dims_of  # parallel/ sits above comm/

        dims = parallel_dims_of(trainer)
        if not dist.is_initialized():
            return
        if dims is not None and getattr(dims, "mesh", None) is not None:
            self.simulator.start(dims)
        else:
            self.simulator.start()
        self._steps = 0

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._steps += 1

    def _stop(self, trainer: pl.Trainer) -> None:
        if self.simulator._restore is None:
            return
        self.simulator.stop()
        if trainer.is_global_zero and self.simulator.stats:
            steps = max(self._steps, 1)
            parts = ", ".join(
                f"{d} {s['seconds'] / steps * 1e3:.1f} ms" for d, s in sorted(self.simulator.stats.items())
            )
            print(f"link simulator ({self.simulator.settings}): simulated link time per batch, rank 0: {parts}")

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop(trainer)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop(trainer)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop(trainer)

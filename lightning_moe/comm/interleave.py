"""Two computations interleaved at their token all-to-alls: what micro-batch overlap of the expert-parallel
all-to-alls runs (``MoE5DStrategy(overlap_ep_comm=True)``,
:class:`lightning_moe.parallel.engines.accumulation.OverlapEngine`; DualPipeV's paired forward and backward).

One micro-batch's backward and the next micro-batch's forward run interleaved, as Megatron's
``--overlap-moe-expert-parallel-comm`` does: each time one of them issues a token all-to-all
(:mod:`lightning_moe.moe.exchange`: the forward's dispatch and combine, the backward's reverse
exchanges), it hands over to the other, which computes until it issues one of its own. So the
backward's expert GEMMs run while the forward's dispatch is in flight, the forward's attention
while the backward's combine gradient is, and so on.

The two run in two threads of which exactly one runs at any time (a baton passes between them at
those points): every rank issues its collectives in the same order, and the numbers are those of
running the two one after the other. The backward accumulates the same gradients in the same order
and draws no random numbers, so the forward draws the same ones.

Example::

    loss_0 = model(batch_0).sum()
    loss_1 = run_interleaved(backward=loss_0.backward, forward=lambda: model(batch_1).sum())
    loss_1.backward()
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["hand_off", "run_interleaved"]

T = TypeVar("T")

_BACKWARD, _FORWARD = "backward", "forward"
_baton: _Baton | None = None


class _Baton:
    """Which of the two parties runs; the other waits for it to hand over or to finish."""

    def __init__(self, forward_thread: threading.Thread) -> None:
        self._forward_thread = forward_thread
        self._turn = threading.Condition()
        self._holder = _BACKWARD
        self._finished: set[str] = set()

    def _party(self) -> str:
        return _FORWARD if threading.current_thread() is self._forward_thread else _BACKWARD

    @staticmethod
    def _other(party: str) -> str:
        return _FORWARD if party == _BACKWARD else _BACKWARD

    def wait_turn(self, party: str) -> None:
        with self._turn:
            self._turn.wait_for(lambda: self._holder == party)

    def pass_on(self) -> None:
        me = self._party()
        other = self._other(me)
        with self._turn:
            if other in self._finished:
                return
            self._holder = other
            self._turn.notify_all()
            self._turn.wait_for(lambda: self._holder == me)

    def finish(self, party: str) -> None:
        with self._turn:
            self._finished.add(party)
            self._holder = self._other(party)
            self._turn.notify_all()


def hand_off() -> None:
    """Called right after an all-to-all is issued: the other micro-batch runs until it issues one
    (or ends). Nothing happens outside :func:`run_interleaved`."""
    if _baton is not None:
        _baton.pass_on()


def run_interleaved(backward: Callable[[], None], forward: Callable[[], T]) -> T:
    """Run ``backward()`` (this thread) and ``forward()`` (a second thread) interleaved at the
    all-to-alls; return what ``forward`` returns. The backward starts; an exception of either is
    raised here once both have ended."""
    global _baton
    if _baton is not None:
        raise RuntimeError("run_interleaved is already running: micro-batch overlap does not nest")
    outcome: dict[str, object] = {}

    def forward_party() -> None:
        baton.wait_turn(_FORWARD)
        try:
            outcome["value"] = forward()
        except BaseException as err:  # noqa: BLE001 - raised in the calling thread
            outcome["error"] = err
        finally:
            baton.finish(_FORWARD)

    thread = threading.Thread(target=forward_party, name="moe-forward-micro-batch", daemon=True)
    baton = _baton = _Baton(thread)
    thread.start()
    try:
        backward()
    finally:
        baton.finish(_BACKWARD)  # the forward runs on to its end
        thread.join()
        _baton = None
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]

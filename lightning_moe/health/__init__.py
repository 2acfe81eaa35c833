"""Runs that stay healthy: non-finite steps re-run and attributed, loss spikes, silent data
corruption, stragglers and starving experts (docs/health.md).

Example::

    from lightning_moe.health import HealthCallback, SpikeDetection

    trainer = Trainer(strategy="moe5d", callbacks=[HealthCallback(spike=SpikeDetection(action="skip"))])
"""

from lightning_moe.health.attribution import NonFiniteEvent, NonFiniteWatch
from lightning_moe.health.callback import NONFINITE_ACTIONS, HealthCallback
from lightning_moe.health.errors import (
    EXIT_PERSISTENT,
    EXIT_RESTART,
    FAULT_MARKER,
    PersistentFaultError,
    RestartRequestedError,
    RunHealthError,
)
from lightning_moe.health.experts import ExpertStarvation
from lightning_moe.health.injection import FAULT_KINDS, FaultInjection
from lightning_moe.health.spike import SPIKE_ACTIONS, SpikeDetection
from lightning_moe.health.stragglers import CollectiveWaitClock, StragglerDetection

__all__ = [
    "EXIT_PERSISTENT",
    "EXIT_RESTART",
    "FAULT_KINDS",
    "FAULT_MARKER",
    "NONFINITE_ACTIONS",
    "SPIKE_ACTIONS",
    "CollectiveWaitClock",
    "ExpertStarvation",
    "FaultInjection",
    "HealthCallback",
    "NonFiniteEvent",
    "NonFiniteWatch",
    "PersistentFaultError",
    "RestartRequestedError",
    "RunHealthError",
    "SpikeDetection",
    "StragglerDetection",
]

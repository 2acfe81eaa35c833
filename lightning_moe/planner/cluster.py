"""The machine: node size, memory, peak FLOP/s, link bandwidths and efficiency factors."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

@dataclass(frozen=True)
class Cluster:
    """A machine type: node size, memory, peak FLOP/s, link bandwidths and efficiency factors.

    Built from ``conf/cluster/<name>.yaml`` (each figure's source is in the file). Bandwidths are
    per GPU and per direction, in bytes/s; efficiencies are the fraction of the peak an op kind
    reaches; ``collective_latency`` is paid per collective call and ``ring_step_overhead`` per ring
    attention shift. ``concurrent_ranks``: how many ranks compute at once (CPU cores; None: all).

    Example::

        Cluster(name="toy", gpus_per_node=8, memory_bytes=80e9, peak_flops=989e12,
                hbm_bandwidth=3.35e12, intra_node_bandwidth=450e9, inter_node_bandwidth=50e9)
    """

    name: str
    gpus_per_node: int
    memory_bytes: float
    peak_flops: float
    hbm_bandwidth: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    gemm_efficiency: float = 0.7
    grouped_gemm_efficiency: float = 0.55
    attention_efficiency: float = 0.5
    comm_efficiency: float = 0.8
    collective_latency: float = 20e-6
    ring_step_overhead: float = 0.0
    memory_reserve_bytes: float = 0.0
    concurrent_ranks: int | None = None
    fsdp_overlap: bool = True

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> Cluster:
        if not isinstance(cfg, Mapping):
            raise ValueError(f"cluster config must be a mapping, got {type(cfg).__name__}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(cfg) - known)
        if unknown:
            raise ValueError(f"cluster config has unknown keys {unknown}: the keys are {sorted(known)}")
        values = {k: v for k, v in cfg.items()}
        floats = ("memory_bytes", "peak_flops", "hbm_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth",
                  "gemm_efficiency", "grouped_gemm_efficiency", "attention_efficiency", "comm_efficiency",
                  "collective_latency", "ring_step_overhead", "memory_reserve_bytes")  # fmt: skip
        for key in floats:
            if key in values:
                try:
                    values[key] = float(values[key])
                except (TypeError, ValueError) as err:
                    raise ValueError(f"cluster.{key}={values[key]!r} must be a number") from err
        cluster = cls(**values)
        for key in ("gpus_per_node", "memory_bytes", "peak_flops", "hbm_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth"):
            if not getattr(cluster, key) > 0:
                raise ValueError(f"cluster.{key}={getattr(cluster, key)} must be > 0")
        return cluster

    @property
    def memory_budget(self) -> float:
        """Bytes per GPU a layout may use: the memory less the reserve."""
        return self.memory_bytes - self.memory_reserve_bytes


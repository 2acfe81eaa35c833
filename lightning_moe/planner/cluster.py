"""The machine: node size, memory, peak FLOP/s, link bandwidths and efficiency factors."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The cost model's efficiency and per-call constants: what a datasheet does not give and a run on the
# machine can measure. A cluster names those it measured (``measured``); the others are assumptions.
MODEL_CONSTANTS: tuple[str, ...] = (
    "gemm_efficiency", "grouped_gemm_efficiency", "attention_efficiency", "comm_efficiency", "collective_latency",
    "ring_step_overhead", "overlap_slowdown", "elementwise_efficiency", "fp8_gemm_efficiency",
)  # fmt: skip


@dataclass(frozen=True)
class Cluster:
    """A machine type: node size, memory, peak FLOP/s, link bandwidths and efficiency factors.

    Built from ``conf/cluster/<name>.yaml`` (each figure's source is in the file). Bandwidths are
    per GPU and per direction, in bytes/s; efficiencies are the fraction of the peak an op kind
    reaches; ``collective_latency`` is paid per collective call and ``ring_step_overhead`` per ring
    attention shift. ``concurrent_ranks``: how many ranks compute at once (CPU cores; None: all).

    What the GEMM peak leaves out: ``overlap_slowdown``, the fraction by which compute slows while a
    collective runs beside it (NCCL's kernels take SMs and HBM bandwidth from the GEMMs: each second
    of hidden communication costs that many seconds of compute); ``elementwise_efficiency``, the
    fraction of ``hbm_bandwidth`` the memory-bound ops (norms, activation, permutation, loss) reach
    (None: those ops are not charged, as on the tests' toy machines); ``fp8_peak_flops`` and
    ``fp8_gemm_efficiency``, the GEMMs of a run with FP8 GEMMs (None: the machine has no FP8 path).

    Provenance: ``measured`` pairs each of :data:`MODEL_CONSTANTS` measured on the machine with its
    source (file, date, device, how it was derived; the YAML's ``measured:`` mapping, written by
    ``python -m lightning_moe.planner.calibrate``); every other one is an assumption
    (:meth:`constants`). ``device_name``: the word the GPU's name contains (``H200``), which
    calibration checks a benchmark's device against (None: nothing to calibrate from).

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
    overlap_slowdown: float = 0.0
    elementwise_efficiency: float | None = None
    fp8_peak_flops: float | None = None
    fp8_gemm_efficiency: float | None = None
    device_name: str | None = None
    measured: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> Cluster:
        if not isinstance(cfg, Mapping):
            raise ValueError(f"cluster config must be a mapping, got {type(cfg).__name__}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(cfg) - known)
        if unknown:
            raise ValueError(f"cluster config has unknown keys {unknown}: the keys are {sorted(known)}")
        values = {k: v for k, v in cfg.items()}
        values["measured"] = _measured_pairs(values.get("measured"))
        floats = ("memory_bytes", "peak_flops", "hbm_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth",
                  "gemm_efficiency", "grouped_gemm_efficiency", "attention_efficiency", "comm_efficiency",
                  "collective_latency", "ring_step_overhead", "memory_reserve_bytes", "overlap_slowdown",
                  "elementwise_efficiency", "fp8_peak_flops", "fp8_gemm_efficiency")  # fmt: skip
        for key in floats:
            if key in values and values[key] is not None:
                try:
                    values[key] = float(values[key])
                except (TypeError, ValueError) as err:
                    raise ValueError(f"cluster.{key}={values[key]!r} must be a number") from err
        cluster = cls(**values)
        for key in (
            "gpus_per_node",
            "memory_bytes",
            "peak_flops",
            "hbm_bandwidth",
            "intra_node_bandwidth",
            "inter_node_bandwidth",
        ):
            if not getattr(cluster, key) > 0:
                raise ValueError(f"cluster.{key}={getattr(cluster, key)} must be > 0")
        if not 0 <= cluster.overlap_slowdown < 1:
            raise ValueError(
                f"cluster.overlap_slowdown={cluster.overlap_slowdown} must be in [0, 1): the fraction compute slows while a collective overlaps it"
            )
        for key in ("elementwise_efficiency", "fp8_gemm_efficiency"):
            value = getattr(cluster, key)
            if value is not None and not 0 < value <= 1:
                raise ValueError(f"cluster.{key}={value} must be in (0, 1] (or null)")
        return cluster

    def constants(self) -> dict[str, dict[str, Any]]:
        """``{"measured": {name: {"value", "source"}}, "assumed": {name: value}}`` over
        :data:`MODEL_CONSTANTS`: which the cost model takes from a measurement on the machine, and
        which are assumptions (their reasoning in the cluster's YAML)."""
        sources = dict(self.measured)
        return {
            "measured": {k: {"value": getattr(self, k), "source": sources[k]} for k in MODEL_CONSTANTS if k in sources},
            "assumed": {k: getattr(self, k) for k in MODEL_CONSTANTS if k not in sources},
        }

    def gemm_peak(self, fp8: bool) -> tuple[float, float | None]:
        """``(peak FLOP/s, efficiency override)`` of the GEMMs: bf16's peak with the op kinds' own
        efficiencies, or with ``fp8`` the FP8 peak at ``fp8_gemm_efficiency``. ``ValueError`` if the
        machine gives no FP8 figures."""
        if not fp8:
            return self.peak_flops, None
        if self.fp8_peak_flops is None or self.fp8_gemm_efficiency is None:
            raise ValueError(
                f"fp8_gemms=true needs cluster.fp8_peak_flops and cluster.fp8_gemm_efficiency, which {self.name} does not"
                " set: add them to the cluster config, or plan with fp8_gemms=false"
            )
        return self.fp8_peak_flops, self.fp8_gemm_efficiency

    @property
    def memory_budget(self) -> float:
        """Bytes per GPU a layout may use: the memory less the reserve."""
        return self.memory_bytes - self.memory_reserve_bytes


def _measured_pairs(measured: Any) -> tuple[tuple[str, str], ...]:
    """The ``measured:`` mapping of a cluster config (constant -> source) as sorted pairs, checked."""
    if measured is None or isinstance(measured, tuple):
        return measured or ()
    if not isinstance(measured, Mapping):
        raise ValueError(f"cluster.measured must map constants to their source, got {type(measured).__name__}")
    unknown = sorted(set(measured) - set(MODEL_CONSTANTS))
    if unknown:
        raise ValueError(
            f"cluster.measured names {unknown}, which are not measurable constants: use {list(MODEL_CONSTANTS)}"
        )
    return tuple(sorted((str(k), str(v)) for k, v in measured.items()))

"""Parallelism over one (pp, dp, ep, cp, tp) DeviceMesh: the plans ``parallelize`` applies, the step
engines and the runtime helpers of a step (docs/architecture.md, "Inside parallel/")."""

from lightning_moe.parallel.dims import MESH_DIM_NAMES, ParallelDims
from lightning_moe.parallel.parallelize import is_parallelized, parallelize

__all__ = ["MESH_DIM_NAMES", "ParallelDims", "is_parallelized", "parallelize"]

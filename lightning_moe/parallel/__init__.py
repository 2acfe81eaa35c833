"""Parallel plans over one (pp, dp, ep, cp, tp) DeviceMesh, one file per dimension."""

from lightning_moe.parallel.dims import MESH_DIM_NAMES, ParallelDims
from lightning_moe.parallel.parallelize import is_parallelized, parallelize

__all__ = ["MESH_DIM_NAMES", "ParallelDims", "is_parallelized", "parallelize"]

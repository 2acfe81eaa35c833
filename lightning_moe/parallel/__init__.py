"""Parallelism over one (pp, dp, ep, cp, tp) DeviceMesh for any ``nn.Module``, by kind:

- ``plans/``: what is applied to a module: the plan of each dimension, which ``parallelize`` applies,
  and those applied after it (precision, activation checkpointing, ``torch.compile``, meta-device init);
- ``engines/``: the step engines, how a global batch becomes work on this rank (gradient accumulation,
  micro-batch overlap, the pipeline schedule), one chosen per layout;
- ``runtime/``: the helpers a running step or process calls (packed documents, gradient clipping over
  both meshes, cp outputs, host memory, the hang watchdog);
- ``config/``: what a user sets: the strategy's options (``ParallelConfig``) and their checks, a
  module's optional hooks (``ParallelHooks``).

``dims.py`` (``ParallelDims``: the meshes and groups of the dense and expert views) is the ground all
four stand on. Imports point one way: ``config/`` -> ``plans/``; ``engines/`` -> ``plans/``,
``runtime/``; all -> ``dims.py`` (docs/architecture.md, "Inside parallel/")."""

from lightning_moe.parallel.dims import MESH_DIM_NAMES, ParallelDims
from lightning_moe.parallel.plans.parallelize import is_parallelized, parallelize

__all__ = ["MESH_DIM_NAMES", "ParallelDims", "is_parallelized", "parallelize"]

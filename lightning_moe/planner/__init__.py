"""Layout planner: a cost model that ranks every valid (tp, cp, ep, dp, pp) layout for a cluster.

Pure Python (no process group, no tensors): everything is computed from the model's shape (the
keyword arguments of :class:`lightning_moe.models.MoEGPT`), a cluster preset and the batch.

- **Inputs** (:mod:`.model_shape`, :mod:`.cluster`, :mod:`.layout`): the model's shape and parameter
  counts, the machine, and a candidate layout with the layers each pipeline rank holds.
- **Parameters** (:mod:`.parameters`, :mod:`.rank_shards`): the rank's parameter shards exactly as
  ``lightning_moe.parallelize`` lays them out, and the FSDP2 units they are gathered in.
- **FLOPs** (:mod:`.flops`) per token: attention projections, the attention core with its sequence
  term (causal: half the score/value products), dense and expert SwiGLU GEMMs, the router and the
  output layer; training = forward + 2 x forward (backward), plus the recomputed forward of the
  chosen activation-checkpointing mode.
- **Memory** (:mod:`.memory`) per rank: parameters, fp32 gradients and Adam states, FSDP2's unsharded
  parameter and gradient buffers, and activations under each activation-checkpointing mode (``none``,
  ``selective``, ``full``). HSDP (``Layout.dp_replicate``) shards within a replica group only.
- **Communication** (:mod:`.comm`, one module per dimension, and :mod:`.groups`) bytes per optimizer
  step and rank for every dimension, from the same collectives the code issues, each split into
  intra-node and inter-node bytes by where the group's ranks sit (rank order tp-cp-ep-dp-pp). Dim names, group
  spans and the size rules come from :mod:`lightning_moe.layout`, as ``ParallelDims``' meshes do.
  :func:`accounted_comm_bytes` (:mod:`.accounting`) maps them onto the dims under which
  :class:`~lightning_moe.callbacks.CommAccountingCallback` records them, for checks against runs.
- **Time** (:mod:`.step_time`) per step: compute (GEMMs, FP8 ones at their own peak; the memory-bound
  ops of :mod:`.elementwise`; the busiest ep rank's experts), the communication the code does not
  overlap or its phase's compute cannot cover (one budget per phase for every overlapped collective,
  each hidden second slowing the compute; the reduction after the pipeline's last backward
  exposed), the pipeline bubble and the optimizer update; :func:`estimate` gathers one layout's
  figures with their range (:class:`~.step_time.StepTimeBounds`: no, modelled, perfect overlap).
  The expert token all-to-alls hide behind the expert GEMMs (``moe.dispatch_chunks``), the shared
  expert, and the paired micro-batch's compute (``Layout.overlap_ep_comm``), each as far as its
  compute reaches (:func:`~lightning_moe.planner.step_time.hidden_ep_seconds`).
- **Multi-token prediction** (:mod:`.mtp`): the last stage's MTP depths in its FLOPs, memory-bound
  traffic, parameters, FSDP2 units, activations and logits, with the last stage's embedding copy
  under pp > 1.
- **Calibration** (:mod:`.calibrate`, ``python -m lightning_moe.planner.calibrate bench_gpu.json
  --cluster h200_sxm``): the efficiencies ``make bench-gpu`` measures, written into
  ``conf/cluster/<cluster>_calibrated.yaml`` with their sources; :meth:`Cluster.constants` says which
  constants are measured and which assumed, and the plan prints it.
- **Search** (:mod:`.search`): :func:`plan` estimates every valid layout, parallel folding included
  (``Layout.fold_ep``: the expert ep group spans tp and/or cp ranks too) and HSDP where dp spans
  nodes (a replica group per node: gathers and reduce-scatters inside it, the gradient shards'
  all-reduce across), ``overlap_ep_comm`` where the strategy takes it, ring and all-to-all context
  parallelism (``Layout.cp_comm``, the faster kept per layout: :func:`~.search.estimate_cp_comm`;
  bytes per attention call: :func:`ulysses_attention_bytes`), and ranks those that fit;
  :func:`resolve_auto_layout` serves ``MoE5DStrategy(layout="auto")``.

Example::

    from lightning_moe.planner import ModelShape, Cluster, plan
    model = ModelShape.from_config({"hidden_size": 4096, "num_layers": 32, ...})
    result = plan(256, model, Cluster.from_config(h100), seq_len=4096, global_batch_size=1024)
    result.ranked[0].layout   # the fastest layout that fits
"""

from lightning_moe.layout import PARALLEL_DIMS
from lightning_moe.planner.accounting import accounted_comm_bytes
from lightning_moe.planner.candidate import Layout
from lightning_moe.planner.cluster import Cluster
from lightning_moe.planner.comm import comm_records
from lightning_moe.planner.comm.cp import ulysses_attention_bytes
from lightning_moe.planner.comm.record import CommRecord, comm_bytes_by_dim
from lightning_moe.planner.dtypes import PRECISIONS
from lightning_moe.planner.flops import flops_per_microbatch
from lightning_moe.planner.groups import group_ranks, peer_split, ring_split
from lightning_moe.planner.memory import CHECKPOINT_MODES, Memory, memory_per_rank
from lightning_moe.planner.model_shape import ModelShape
from lightning_moe.planner.parameters import chunk_size, local_shape, parameter_specs
from lightning_moe.planner.rank_shards import fsdp_units, parameter_bytes_per_rank, rank_parameters
from lightning_moe.planner.search import (
    Plan,
    cp_comm_options,
    enumerate_layouts,
    estimate_cp_comm,
    layout_problems,
    plan,
    resolve_auto_layout,
)
from lightning_moe.planner.step_time import Estimate, StepTimeBounds, estimate

__all__ = [
    "CHECKPOINT_MODES", "PARALLEL_DIMS", "PRECISIONS", "Cluster", "CommRecord", "Estimate", "Layout", "Memory",
    "ModelShape", "Plan", "StepTimeBounds", "accounted_comm_bytes", "chunk_size", "comm_bytes_by_dim", "comm_records",
    "cp_comm_options", "enumerate_layouts", "estimate", "estimate_cp_comm", "flops_per_microbatch", "fsdp_units",
    "group_ranks", "layout_problems", "local_shape", "memory_per_rank", "parameter_bytes_per_rank",
    "parameter_specs", "peer_split", "plan", "rank_parameters", "resolve_auto_layout", "ring_split",
    "ulysses_attention_bytes",
]  # fmt: skip

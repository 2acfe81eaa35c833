"""Muon's optimizer-step cost: the owner gathers and scatters of sharded matrices, and Newton-Schulz FLOPs.

What ``lightning_moe.optim.Muon`` does on a layout (docs/muon.md): each matrix split over FSDP's shard
group and/or tp is gathered whole to one owner of its shard group (equal-sized buffers, the largest
block, in the Newton-Schulz dtype) and its blocks scattered back; an expert stack split on its expert
dim only (ep, or FSDP when a rank holds at least as many experts as its edp group has ranks) needs no
traffic. Owners go round-robin, so bytes and FLOPs are given as means over ranks. Matrices are
MoEGPT's (separate q/k/v/o projections, SwiGLU FFNs; a shared expert is not tensor-parallel).

Example::

    muon_comm_bytes(shape, Layout(tp=2))  # {"tp": ..., "dp": 0.0, ...}
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_moe.layout import PARALLEL_DIMS
from lightning_moe.planner.candidate import Layout
from lightning_moe.planner.cluster import Cluster
from lightning_moe.planner.comm.record import CommRecord
from lightning_moe.planner.groups import fsdp_shard_group, group_size
from lightning_moe.planner.model_shape import ModelShape
from lightning_moe.planner.parameters import expert_fsdp_dim

__all__ = [
    "MuonMatrix",
    "muon_comm_bytes",
    "muon_comm_records",
    "muon_matrices",
    "newton_schulz_flops",
    "newton_schulz_flops_per_rank",
    "newton_schulz_seconds",
]

NS_STEPS = 5  # lightning_moe.optim.Muon's default


@dataclass(frozen=True)
class MuonMatrix:
    """A parameter Muon orthogonalizes: ``count`` matrices of ``rows x cols`` (an expert stack: one per
    expert), ``tp_dim`` the dim tensor parallelism splits (None: none), ``expert`` for routed experts,
    ``per_rank`` how many such parameters a rank holds on average (pipeline stages split the layers)."""

    rows: int
    cols: int
    tp_dim: int | None = None
    expert: bool = False
    per_rank: float = 1.0


def muon_matrices(model: ModelShape, layout: Layout) -> list[MuonMatrix]:
    """The parameters Muon orthogonalizes, per rank on average over pipeline stages."""
    h = model.hidden_size
    head_dim = h // model.num_heads
    q, kv = model.num_heads * head_dim, model.num_kv_heads * head_dim
    layers = model.num_layers / layout.pp
    moe = model.num_moe_layers / layout.pp
    dense = layers - moe
    out = [
        MuonMatrix(q, h, 0, per_rank=layers), MuonMatrix(kv, h, 0, per_rank=2 * layers),
        MuonMatrix(h, q, 1, per_rank=layers),
    ]  # fmt: skip
    if dense:
        f = model.ffn_hidden_size
        out += [MuonMatrix(f, h, 0, per_rank=2 * dense), MuonMatrix(h, f, 1, per_rank=dense)]
    if moe:
        f = model.moe_ffn_hidden_size
        # Expert stacks [E, H, F] (w1, w3) and [E, F, H] (w2): etp splits F.
        out += [MuonMatrix(h, f, 1, expert=True, per_rank=2 * moe), MuonMatrix(f, h, 0, expert=True, per_rank=moe)]
        if model.shared_expert_hidden_size:
            s = model.shared_expert_hidden_size
            out += [MuonMatrix(s, h, per_rank=2 * moe), MuonMatrix(h, s, per_rank=moe)]
    return out


def _groups(layout: Layout) -> tuple[int, int]:
    """Ranks of FSDP's shard groups: the dense parameters' (dp x ep x cp, HSDP's shard part) and the
    experts' (edp)."""
    return (
        group_size(layout, fsdp_shard_group(layout, "dense")),
        group_size(layout, fsdp_shard_group(layout, "edp")),
    )


def _gather(matrix: MuonMatrix, layout: Layout) -> tuple[dict[str, int], int, int]:
    """``({dim: ranks}, wire elements per block, matrices per parameter)`` of a dense matrix's gather."""
    dense, _ = _groups(layout)
    tp = layout.tp if matrix.tp_dim is not None else 1
    rows, cols = matrix.rows, matrix.cols
    if matrix.tp_dim == 0:
        rows //= tp
    elif matrix.tp_dim == 1:
        cols //= tp
    return {"dp": dense, "tp": tp}, math.ceil(rows / dense) * cols, 1


def _expert_gather(matrix: MuonMatrix, model: ModelShape, layout: Layout) -> tuple[dict[str, int], int, int]:
    """The same for an expert stack: only FSDP's split of an expert (dim 1) and etp are gathered."""
    _, edp = _groups(layout)
    local = [model.num_experts // layout.ep, matrix.rows, matrix.cols]
    local[matrix.tp_dim + 1] //= layout.etp
    fsdp_dim = expert_fsdp_dim(local, matrix.tp_dim + 1 if layout.etp > 1 else None, edp) if edp > 1 else 0
    # Sharded on dim 0, every rank holds whole experts: nothing to gather over edp.
    if fsdp_dim:
        local[fsdp_dim] = math.ceil(local[fsdp_dim] / edp)
    return {"dp": edp if fsdp_dim else 1, "tp": layout.etp}, math.prod(local), local[0]


def muon_comm_records(model: ModelShape, layout: Layout, ns_bytes: int = 4) -> list[CommRecord]:
    """Muon's gathers and scatters of one optimizer step, bytes per rank (mean over ranks).

    A group of ``n`` ranks moves ``2 (n - 1)`` buffers of the largest block per matrix (its members'
    blocks in, the results out), ``2 (n - 1) / n`` per rank; 2 calls per matrix. A group spanning two
    dims (FSDP and tp) is charged to dp, as ``lightning_moe.comm`` records it. ``ns_bytes``: the
    Newton-Schulz dtype's size (4: fp32, the default).
    """
    records = []
    for matrix in muon_matrices(model, layout):
        dims, wire, _ = _expert_gather(matrix, model, layout) if matrix.expert else _gather(matrix, layout)
        n = math.prod(dims.values())
        if n > 1:
            dim = "dp" if dims["dp"] > 1 else "tp"
            group = ("edp" if matrix.expert else "dense") if dims["dp"] > 1 else dim
            nbytes = 2 * (n - 1) * wire * ns_bytes / n * matrix.per_rank
            records.append(CommRecord("Muon gather/scatter", dim, group, nbytes, 2 * matrix.per_rank, recorded_as=dim))
    return records


def muon_comm_bytes(model: ModelShape, layout: Layout, ns_bytes: int = 4) -> dict[str, float]:
    """:func:`muon_comm_records` summed per dim, as the comm accounting's ``comm/<dim>_bytes`` adds them."""
    out = {d: 0.0 for d in (*PARALLEL_DIMS, "other")}
    for rec in muon_comm_records(model, layout, ns_bytes):
        out[rec.dim] += rec.bytes
    return out


def newton_schulz_flops(rows: int, cols: int, steps: int = NS_STEPS) -> int:
    """FLOPs (2 per multiply-add) of ``steps`` quintic Newton-Schulz iterations on a rows x cols matrix:
    per step the Gram matrix ``X X^T`` (m x n by n x m), ``A^2`` (m^3) and ``(bA + cA^2) X`` (m x m by
    m x n), m the smaller side."""
    m, n = sorted((rows, cols))
    return steps * 2 * (2 * m * m * n + m * m * m)


def newton_schulz_flops_per_rank(model: ModelShape, layout: Layout, steps: int = NS_STEPS) -> float:
    """Newton-Schulz FLOPs of one optimizer step per rank, mean over ranks: each matrix is computed once
    per shard group (by its owner), once per replica where dims replicate it."""
    total = 0.0
    for matrix in muon_matrices(model, layout):
        dims, _, count = _expert_gather(matrix, model, layout) if matrix.expert else _gather(matrix, layout)
        n = math.prod(dims.values())
        if matrix.expert:
            # The local experts' matrices, shared by the gather group (or computed locally when n is 1).
            flops = count * newton_schulz_flops(matrix.rows, matrix.cols, steps)
        else:
            flops = newton_schulz_flops(matrix.rows, matrix.cols, steps)
        total += flops / n * matrix.per_rank
    return total


def newton_schulz_seconds(model: ModelShape, layout: Layout, cluster: Cluster) -> float:
    """Seconds of one step's Newton-Schulz on a rank: its FLOPs at the cluster's GEMM efficiency."""
    return newton_schulz_flops_per_rank(model, layout) / (cluster.peak_flops * cluster.gemm_efficiency)

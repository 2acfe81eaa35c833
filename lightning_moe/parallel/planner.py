"""Layout planner: a cost model that ranks every valid (tp, cp, ep, dp, pp) layout for a cluster.

Pure Python (no process group, no tensors): everything is computed from the model's shape (the
keyword arguments of :class:`lightning_moe.models.MoEGPT`), a cluster preset and the batch.

- **FLOPs** per token: attention projections, the attention core with its sequence term (causal:
  half the score/value products), dense and expert SwiGLU GEMMs, the router and the output layer;
  training = forward + 2 x forward (backward), plus the recomputed forward of the chosen
  activation-checkpointing mode.
- **Memory** per rank: the rank's parameter shards exactly as ``lightning_moe.parallelize`` lays
  them out (tensor-parallel plan, experts ``Shard(0)`` over ep and their FFN dim over etp, FSDP2
  ``Shard(0)`` of the local tensor over the dense/expert/token data-parallel meshes, padded as
  FSDP2 pads), fp32 gradients and Adam states, FSDP's all-gather buffers, and activations under
  each activation-checkpointing mode (``none``, ``selective``, ``full``).
- **Communication** bytes per optimizer step and rank for every dimension, from the same
  collectives the code issues and counted by the conventions of :mod:`lightning_moe.comm`
  (bytes a rank sends to its peers; an all-reduce counts ``2 (n-1)/n``), each split into
  intra-node and inter-node bytes by where the group's ranks sit (rank order tp-cp-ep-dp-pp).
  :func:`accounted_comm_bytes` maps them onto the dims under which
  :class:`~lightning_moe.callbacks.CommAccountingCallback` records them, for checks against runs.
- **Time** per step: compute / (peak x efficiency of the op kind) plus communication / bandwidth
  of the tier it crosses, minus the overlap the code implements (FSDP2 prefetches its all-gathers
  and reduce-scatters on their own stream; ring attention sends the next K/V block while the
  current one computes; expert dispatch, tensor-parallel collectives and pipeline P2P are
  exposed), times the pipeline bubble ``(p - 1) / (m + p - 1)`` (interleaved: ``(p-1)/v``).

Example::

    from lightning_moe.parallel.planner import ModelShape, Cluster, plan
    model = ModelShape.from_config({"hidden_size": 4096, "num_layers": 32, ...})
    result = plan(256, model, Cluster.from_config(h100), seq_len=4096, global_batch_size=1024)
    result.ranked[0].layout   # the fastest layout that fits
"""

from __future__ import annotations

import math
from functools import lru_cache
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

PARALLEL_DIMS: tuple[str, ...] = ("tp", "cp", "ep", "dp", "pp")
MESH_ORDER: tuple[str, ...] = ("pp", "dp", "ep", "cp", "tp")  # lightning_moe.parallel.dims.MESH_DIM_NAMES
CHECKPOINT_MODES: tuple[str, ...] = ("none", "selective", "full")
SCHEDULES: tuple[str, ...] = ("GPipe", "1F1B", "Interleaved1F1B")
PRECISIONS: tuple[str, ...] = ("32-true", "bf16-mixed")

# -- constants (each with its source) ---------------------------------------------------------------
# Bytes per element. fp32 master weights, fp32 gradients and two fp32 Adam moments: what the code
# keeps (torch.optim.AdamW on FSDP2's fp32 sharded parameters).
FP32_BYTES = 4  # IEEE 754 single
BF16_BYTES = 2  # bfloat16
INT64_BYTES = 8  # token counts exchanged by the dispatchers (torch.bincount gives int64)
ADAM_STATE_BYTES = 2 * FP32_BYTES  # exp_avg and exp_avg_sq (torch.optim.AdamW)
# Activation bytes per element that cross the network or are stored, by training precision.
# "bf16-mixed" is torch.autocast: GEMM outputs are bf16; ring attention's dK/dV accumulators and the
# router's logits stay fp32 (lightning_moe.cp.ring_attention, lightning_moe.moe.router).
ACTIVATION_BYTES = {"32-true": FP32_BYTES, "bf16-mixed": BF16_BYTES}
# FSDP2 all-gathers parameters in the MixedPrecisionPolicy's param_dtype (bf16 under "bf16-mixed",
# none under "32-true") and reduce-scatters gradients in its reduce_dtype, fp32 under both
# (lightning_moe.parallel.precision.mixed_precision_policy).
FSDP_GATHER_BYTES = {"32-true": FP32_BYTES, "bf16-mixed": BF16_BYTES}
FSDP_REDUCE_BYTES = FP32_BYTES
# Lightning broadcasts an int64 "sigterm" flag from rank 0 at every training batch but the first of
# an optimizer step (lightning.pytorch.loops.training_epoch_loop._broadcast_sigterm_tensor).
SIGTERM_FLAG_BYTES = INT64_BYTES
# The pipeline's mean loss is one fp32 broadcast from the last stage per pipeline step
# (lightning_moe.parallel.pipeline.PipelineRunner.broadcast_mean).
PIPELINE_LOSS_BYTES = FP32_BYTES
# Activation checkpointing cost in forward passes recomputed during backward: "full" recomputes the
# whole layer forward (Chen et al. 2016, arXiv 1604.06174); "selective" recomputes the SwiGLU/expert
# activation functions and the attention core only, Korthikanti et al. 2022 (arXiv 2205.05198, §5:
# selective recompute costs ~2.7% of FLOPs for GPT-3): modelled as that fraction of one forward.
RECOMPUTE_FORWARDS = {"none": 0.0, "selective": 0.08, "full": 1.0}
# Korthikanti et al. 2022 §4.2.3: under the interleaved schedule the first stage holds
# (1 + (p - 1) / (p * v)) times the 1F1B activations.
# Adam's update reads and writes each parameter's fp32 weight, gradient and two moments:
# (4 + 4 + 8) bytes read and (4 + 8) written (torch.optim.AdamW foreach kernel, memory-bound).
OPTIMIZER_HBM_BYTES_PER_PARAM = (FP32_BYTES + FP32_BYTES + ADAM_STATE_BYTES) + (FP32_BYTES + ADAM_STATE_BYTES)
# Largest micro-batch the planner tries (samples); larger ones rarely fit at real sizes.
MAX_MICRO_BATCH = 16


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def chunk_size(length: int, parts: int, index: int) -> int:
    """Length of chunk ``index`` of ``torch.chunk(range(length), parts)`` (empty past the end).

    FSDP2 and DTensor ``Shard`` both split by these semantics. Example: ``chunk_size(10, 4, 3) == 1``.
    """
    size = _ceil_div(length, parts)
    return max(0, min(size, length - index * size))


# -- inputs --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    """The shape of an :class:`~lightning_moe.models.MoEGPT` (its constructor's keyword arguments).

    Example::

        shape = ModelShape.from_config({"hidden_size": 64, "num_layers": 2, "moe": {"num_experts": 8}})
        shape.total_parameters()
    """

    vocab_size: int = 256
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 4
    ffn_hidden_size: int = 384
    moe_layer_freq: int = 1
    num_experts: int = 8
    top_k: int = 2
    moe_ffn_hidden_size: int = 384
    shared_expert_hidden_size: int | None = None
    dispatcher: str = "alltoall"
    load_balancing: str = "aux_loss"
    expert_bias: bool = False
    capacity_factor: float | None = None
    name: str = "model"

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], name: str | None = None) -> ModelShape:
        """From an MoEGPT config (``conf/model/*.yaml`` or ``MoEGPT.hparams``), with MoEGPT's defaults."""
        if not isinstance(cfg, Mapping):
            raise ValueError(f"model config must be a mapping of MoEGPT arguments, got {type(cfg).__name__}")
        hidden = int(cfg.get("hidden_size", 128))
        heads = int(cfg.get("num_heads", 4))
        kv = cfg.get("num_kv_heads")
        ffn = cfg.get("ffn_hidden_size")
        ffn = 64 * math.ceil(8 * hidden / 3 / 64) if ffn is None else int(ffn)
        moe = dict(cfg.get("moe") or {})
        shared = moe.get("shared_expert_hidden_size")
        cf = moe.get("capacity_factor")
        shape = cls(
            vocab_size=int(cfg.get("vocab_size", 256)),
            hidden_size=hidden,
            num_layers=int(cfg.get("num_layers", 4)),
            num_heads=heads,
            num_kv_heads=heads if kv is None else int(kv),
            ffn_hidden_size=ffn,
            moe_layer_freq=int(cfg.get("moe_layer_freq", 1)),
            num_experts=int(moe.get("num_experts", 8)),
            top_k=int(moe.get("top_k", 2)),
            moe_ffn_hidden_size=int(moe.get("ffn_hidden_size", ffn)),
            shared_expert_hidden_size=None if shared is None else int(shared),
            dispatcher=str(moe.get("dispatcher", "alltoall")),
            load_balancing=str(moe.get("load_balancing", "aux_loss")),
            expert_bias=bool(moe.get("expert_bias", False)),
            capacity_factor=None if cf is None else float(cf),
            name=name or str(cfg.get("name", "model")),
        )
        shape.check()
        return shape

    def check(self) -> None:
        for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"model.{key}={getattr(self, key)} must be >= 1")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}:"
                " hidden_size must be divisible by num_heads and num_heads by num_kv_heads"
            )
        if self.num_moe_layers and not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"model.moe.top_k={self.top_k} must be between 1 and num_experts={self.num_experts}")

    # shape helpers
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def is_moe(self, layer: int) -> bool:
        """Same rule as :func:`lightning_moe.models.moe_gpt.is_moe_layer`."""
        return self.moe_layer_freq > 0 and (layer + 1) % self.moe_layer_freq == 0

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe(i) for i in range(self.num_layers))

    # parameter counts (global)
    def attention_parameters(self) -> int:
        h = self.hidden_size
        return h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h + 2 * h  # + the two norms

    def expert_parameters(self) -> int:
        return 3 * self.num_experts * self.hidden_size * self.moe_ffn_hidden_size

    def moe_dense_parameters(self) -> int:
        """Router and shared expert of one MoE layer."""
        shared = 3 * self.hidden_size * self.shared_expert_hidden_size if self.shared_expert_hidden_size else 0
        return self.num_experts * self.hidden_size + shared

    def total_parameters(self) -> int:
        h = self.hidden_size
        total = 2 * self.vocab_size * h + h
        for i in range(self.num_layers):
            total += self.attention_parameters()
            total += self.expert_parameters() + self.moe_dense_parameters() if self.is_moe(i) else 3 * h * self.ffn_hidden_size
        return total

    def active_parameters(self) -> float:
        """As :func:`lightning_moe.callbacks.throughput.active_parameters`: no embedding, experts x top_k/E."""
        h = self.hidden_size
        total = float(self.vocab_size * h + h)
        for i in range(self.num_layers):
            total += self.attention_parameters()
            if self.is_moe(i):
                total += self.expert_parameters() * self.top_k / self.num_experts + self.moe_dense_parameters()
            else:
                total += 3 * h * self.ffn_hidden_size
        return total

    def model_flops_per_token(self, seq_len: int) -> float:
        """MFU numerator, as :func:`lightning_moe.callbacks.throughput.model_flops_per_token`:
        ``6 x active parameters + 12 x layers x heads x head_dim x seq_len`` (PaLM, appendix B)."""
        return 6.0 * self.active_parameters() + 12.0 * self.num_layers * self.q_dim * seq_len


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


@dataclass(frozen=True)
class Layout:
    """One candidate: the five sizes, expert tensor parallel, micro-batch and pipeline schedule.

    ``microbatches``: micro-batches per optimizer step on each data-parallel rank; under pp > 1 each
    pipeline step runs ``pp_microbatches`` of them (0: all, one pipeline step per optimizer step).
    ``strategy_kwargs()`` gives the :class:`~lightning_moe.MoE5DStrategy` arguments.
    """

    tp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1
    pp: int = 1
    etp: int = 1
    micro_batch_size: int = 1
    microbatches: int = 1
    pp_schedule: str = "1F1B"
    pp_stages_per_rank: int = 1
    pp_microbatches: int = 0

    @property
    def pipeline_microbatches(self) -> int:
        """Micro-batches of one pipeline step (all of the optimizer step's unless set)."""
        return self.pp_microbatches or self.microbatches

    @property
    def pipeline_steps(self) -> int:
        """Pipeline steps (Lightning batches) per optimizer step under pp > 1."""
        return max(1, self.microbatches // self.pipeline_microbatches)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.ep * self.dp * self.pp

    def size(self, dim: str) -> int:
        if dim == "edp":
            return self.dp * self.cp * (self.tp if self.etp == 1 else 1)
        return getattr(self, dim)

    def label(self) -> str:
        """Everything the estimate depends on besides the model and cluster, e.g.
        ``tp8·ep8·dp2·pp8 mb1 1F1B pp_microbatches=32``: the sizes, ``etp1`` when experts are not
        tensor-parallel, the micro-batch size and, under pp > 1, the schedule (``v2``: stages per
        rank) and the micro-batches of one pipeline step (they set the bubble), so that two layouts
        with different estimates never share a label."""
        parts = [f"{d}{self.size(d)}" for d in PARALLEL_DIMS if self.size(d) > 1] or ["single"]
        if self.tp > 1 and self.etp == 1:
            parts.append("etp1")
        text = "·".join(parts) + f" mb{self.micro_batch_size}"
        if self.pp > 1:
            text += f" {self.pp_schedule}" + (f"v{self.pp_stages_per_rank}" if self.pp_stages_per_rank > 1 else "")
            text += f" pp_microbatches={self.pipeline_microbatches}"
        return text

    def strategy_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {d: self.size(d) for d in PARALLEL_DIMS}
        kwargs["etp"] = self.etp
        if self.pp > 1:
            kwargs.update(pp_schedule=self.pp_schedule, pp_microbatches=self.pipeline_microbatches, pp_stages_per_rank=self.pp_stages_per_rank)
        return kwargs

    def coordinates(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of ``rank`` in the ``(pp, dp, ep, cp, tp)`` row-major mesh."""
        coords: dict[str, int] = {}
        for dim in reversed(MESH_ORDER):
            size = self.size(dim)
            coords[dim] = rank % size
            rank //= size
        return coords


# -- group geometry ------------------------------------------------------------------------------------
# Mesh groups the code communicates on, as the mesh dims they span (lightning_moe.parallel.dims).
GROUP_SPANS: dict[str, tuple[str, ...]] = {
    "tp": ("tp",), "cp": ("cp",), "ep": ("ep",), "pp": ("pp",),
    "dense": ("dp", "ep", "cp"),          # dense_grad_mesh: FSDP of dense parameters
    "token": ("dp", "ep", "cp", "tp"),    # token_mesh: router/shared expert under tp, expert-bias loads
    "sequence": ("cp", "tp"),             # sequence_mesh: MoE statistics
    "world": MESH_ORDER,
}  # fmt: skip


def _spans(layout: Layout, group: str) -> tuple[str, ...]:
    if group == "edp":
        return ("dp", "cp", "tp") if layout.etp == 1 else ("dp", "cp")
    return GROUP_SPANS[group]


def group_ranks(layout: Layout, group: str, rank: int = 0) -> list[int]:
    """Global ranks of ``rank``'s group ``group`` (a key of :data:`GROUP_SPANS` or ``"edp"``)."""
    spanned = set(_spans(layout, group))
    coords = layout.coordinates(rank)
    ranks = [0]
    for dim in MESH_ORDER:
        size = layout.size(dim) if dim != "edp" else 1
        ranks = [r * size + c for r in ranks for c in (range(size) if dim in spanned else [coords[dim]])]
    return ranks


def group_size(layout: Layout, group: str) -> int:
    return math.prod(layout.size(d) for d in _spans(layout, group))


def peer_split(layout: Layout, group: str, gpus_per_node: int) -> tuple[float, float]:
    """``(intra, inter)`` fractions of the bytes a rank sends to its group peers (see :func:`_peer_split`)."""
    return _peer_split(_mesh_only(layout), group, gpus_per_node)


def _mesh_only(layout: Layout) -> Layout:
    """The layout's mesh (sizes and etp), for caching what depends on nothing else."""
    return Layout(layout.tp, layout.cp, layout.ep, layout.dp, layout.pp, layout.etp)


@lru_cache(maxsize=4096)
def _peer_split(layout: Layout, group: str, gpus_per_node: int) -> tuple[float, float]:
    """``(intra, inter)`` fractions of the bytes a rank sends to its group peers, traffic spread evenly
    over the peers (all-to-all, ring all-gather/reduce-scatter payload), averaged over the group."""
    ranks = group_ranks(layout, group)
    n = len(ranks)
    if n == 1:
        return 1.0, 0.0
    nodes: dict[int, int] = {}
    for r in ranks:
        nodes[r // gpus_per_node] = nodes.get(r // gpus_per_node, 0) + 1
    same = sum(c * (c - 1) for c in nodes.values()) / (n * (n - 1))
    return same, 1.0 - same


def ring_split(layout: Layout, group: str, gpus_per_node: int, wrap: bool = True) -> tuple[float, float]:
    """``(intra, inter)`` fractions of point-to-point hops (see :func:`_ring_split`)."""
    return _ring_split(_mesh_only(layout), group, gpus_per_node, wrap)


@lru_cache(maxsize=4096)
def _ring_split(layout: Layout, group: str, gpus_per_node: int, wrap: bool = True) -> tuple[float, float]:
    """``(intra, inter)`` fractions of point-to-point hops ``rank -> next rank`` of a group (a ring when
    ``wrap``, a pipeline chain otherwise) that stay inside a node."""
    ranks = group_ranks(layout, group)
    pairs = list(zip(ranks, ranks[1:] + (ranks[:1] if wrap else [])))
    if not pairs:
        return 1.0, 0.0
    same = sum(a // gpus_per_node == b // gpus_per_node for a, b in pairs) / len(pairs)
    return same, 1.0 - same


# -- communication records -----------------------------------------------------------------------------
@dataclass
class CommRecord:
    """Bytes one rank sends per optimizer step (mean over all ranks) for one kind of collective.

    ``dim``: the parallel dimension it serves; ``group``: the group it runs on (:data:`GROUP_SPANS`);
    ``recorded_as``: the dim :mod:`lightning_moe.comm`'s wrapper names (None: a ``torch.distributed``
    or functional collective, attributed by its group); ``functional``: a DTensor (functional)
    collective; ``pattern``: ``"spread"`` (to all peers) or ``"ring"``/``"chain"`` (to the next rank);
    ``overlapped``: the code overlaps it with compute.
    """

    what: str
    dim: str
    group: str
    bytes: float
    calls: float
    recorded_as: str | None = None
    functional: bool = False
    pattern: str = "spread"
    overlapped: bool = False
    routing_dependent: bool = False


def _stage_layers(model: ModelShape, layout: Layout) -> tuple[tuple[int, ...], ...]:
    return _split_layers(model.num_layers, layout.pp * layout.pp_stages_per_rank)


@lru_cache(maxsize=1024)
def _split_layers(num_layers: int, stages: int) -> tuple[tuple[int, ...], ...]:
    per = num_layers // stages
    return tuple(tuple(range(s * per, (s + 1) * per)) for s in range(stages))


def _rank_layers(model: ModelShape, layout: Layout, pp_rank: int) -> frozenset[int]:
    stages = _stage_layers(model, layout)
    return frozenset(i for st in _rank_stages(layout, pp_rank) for i in stages[st])


def _rank_stages(layout: Layout, pp_rank: int) -> list[int]:
    """Stages of pipeline rank ``pp_rank`` (loop placement, lightning_moe.parallel.pipeline.stage_ids)."""
    return [pp_rank + k * layout.pp for k in range(layout.pp_stages_per_rank)]


def _batches_per_step(layout: Layout) -> int:
    """Lightning training batches per optimizer step (pp > 1: one grouped batch per pipeline step)."""
    return layout.pipeline_steps if layout.pp > 1 else layout.microbatches


def comm_records(model: ModelShape, layout: Layout, seq_len: int, precision: str = "32-true") -> list[CommRecord]:
    """Every collective of one optimizer step, bytes per rank averaged over all ranks.

    Expert dispatch bytes assume balanced routing: each token slot lands on any ep rank with equal
    probability, so ``(ep - 1) / ep`` of a rank's slots leave it (and as many arrive); dropless.
    Everything else is deterministic. Sequence parallelism is on (the strategy's default).
    """
    a = ACTIVATION_BYTES[precision]
    w = FSDP_GATHER_BYTES[precision]  # unsharded parameters (and their gradients) in FSDP's param dtype
    h, s, b = model.hidden_size, seq_len, layout.micro_batch_size
    tp, cp, ep, pp = layout.tp, layout.cp, layout.ep, layout.pp
    m = layout.microbatches
    records: list[CommRecord] = []
    stages = _stage_layers(model, layout)
    # Fractions of ranks holding the embedding / the output: pipeline ranks hold 1/pp of the world each.
    first = 1.0 / pp
    last = 1.0 / pp
    layers_per_rank = model.num_layers / pp  # averaged over pipeline ranks
    moe_per_rank = model.num_moe_layers / pp
    dense_per_rank = (model.num_layers - model.num_moe_layers) / pp

    def add(*args: Any, **kwargs: Any) -> None:
        rec = CommRecord(*args, **kwargs)
        if rec.bytes or rec.calls:
            records.append(rec)

    # Tokens of one micro-batch on a rank: sequence over cp, then sequence-parallel shard over tp.
    seq_local = s // cp
    act_full = b * seq_local * h * a  # one micro-batch's hidden states on a cp rank
    # ---- tensor parallel (DTensor plan with sequence parallelism) ----
    if tp > 1:
        u = act_full * (tp - 1) // tp  # an all-gather or reduce-scatter of the hidden states
        # embedding: reduce-scatter forward, all-gather backward (first stage)
        add("embedding RS/AG", "tp", "tp", 2 * u * m * first, 2 * m * first, functional=True)
        # attention input all-gather + wo reduce-scatter, and their backward
        add("attention AG/RS", "tp", "tp", 4 * u * m * layers_per_rank, 4 * m * layers_per_rank, functional=True)
        add("dense FFN AG/RS", "tp", "tp", 4 * u * m * dense_per_rank, 4 * m * dense_per_rank, functional=True)
        # norm weights: Replicate DTensors whose Partial gradient is all-reduced (2 norms per layer, final norm)
        norm = 2 * h * w * (tp - 1) // tp
        add("norm weight grad all-reduce", "tp", "tp", norm * m * (2 * layers_per_rank + last), m * (2 * layers_per_rank + last), functional=True)
        # output: input all-gather (+ backward reduce-scatter), logits all-gather to Replicate
        logits = b * seq_local * (model.vocab_size // tp) * a * (tp - 1)
        add("output AG/RS + logits AG", "tp", "tp", (2 * u + logits) * m * last, 3 * m * last, functional=True)
        if layout.etp == tp and moe_per_rank:
            # ExpertTensorParallelDispatcher: rows that reached this rank's experts are all-gathered over
            # tp and the partial outputs reduce-scattered back (uneven all-to-alls), forward and backward;
            # plus one all-gather of the int64 counts per local expert.
            rows = b * seq_local // tp * model.top_k  # slots of this rank's tokens (balanced: as many arrive)
            add("expert-TP row all-gather/reduce-scatter", "tp", "tp", 4 * rows * h * a * (tp - 1) * m * moe_per_rank,
                4 * m * moe_per_rank, recorded_as="tp", routing_dependent=ep > 1)
            counts = (model.num_experts // ep) * INT64_BYTES * (tp - 1)
            add("expert-TP counts all-gather", "tp", "tp", counts * m * moe_per_rank, m * moe_per_rank)
    # ---- MoE statistics over the sequence group (cp x tp), recorded as "cp" ----
    n_seq = cp * tp
    if n_seq > 1 and moe_per_rank:
        totals = 2 * (2 * model.num_experts + 4) * FP32_BYTES * (n_seq - 1) // n_seq
        add("MoE statistics all-reduce", "cp", "sequence", totals * m * moe_per_rank, m * moe_per_rank, recorded_as="cp")
        if model.load_balancing == "seq_aux_loss":
            seq_totals = 2 * (b * (2 * model.num_experts + 1)) * FP32_BYTES * (n_seq - 1) // n_seq
            add("sequence aux-loss all-reduce", "cp", "sequence", seq_totals * m * moe_per_rank, m * moe_per_rank, recorded_as="cp")
    # ---- context parallel: ring attention ----
    if cp > 1:
        kv_block = b * (model.num_kv_heads // tp) * seq_local * model.head_dim
        # forward: cp-1 shifts of (K, V); backward: cp-1 shifts of (K, V) and cp shifts of fp32 (dK, dV)
        per_attention = (2 * (cp - 1) * 2 * kv_block * a) + cp * 2 * kv_block * FP32_BYTES
        add("ring attention K/V and dK/dV", "cp", "cp", per_attention * m * layers_per_rank,
            (3 * cp - 2) * m * layers_per_rank, pattern="ring", overlapped=True)
        if pp > 1:
            # pipeline_batch all-reduces each sample's loss-token count (float64) over cp per pipeline step
            samples = b * layout.pipeline_microbatches
            add("loss-token count all-reduce", "cp", "cp", 2 * samples * 8 * (cp - 1) // cp * layout.pipeline_steps, layout.pipeline_steps)
    # ---- expert parallel ----
    if ep > 1 and moe_per_rank:
        tokens = b * seq_local // tp  # each tp rank dispatches its sequence shard
        slots = tokens * model.top_k
        if model.dispatcher == "alltoall":
            counts = model.num_experts * INT64_BYTES * (ep - 1) // ep
            add("dispatch counts all-to-all", "ep", "ep", counts * m * moe_per_rank, m * moe_per_rank, recorded_as="ep")
            leave = slots * (ep - 1) / ep
            add("token dispatch/combine all-to-all", "ep", "ep", 4 * leave * h * a * m * moe_per_rank,
                4 * m * moe_per_rank, recorded_as="ep", routing_dependent=True)
        else:
            gathered = tokens * (h * a) * (ep - 1)
            idx = slots * INT64_BYTES * (ep - 1)
            weights = slots * FP32_BYTES * (ep - 1)
            rs = tokens * h * a * (ep - 1)
            per_layer = 2 * gathered + idx + 2 * weights + 2 * rs
            add("all-gather dispatcher", "ep", "ep", per_layer * m * moe_per_rank, 7 * m * moe_per_rank, recorded_as="ep")
    # ---- data parallel: FSDP2 all-gathers (forward, and again in backward for non-root units) and
    # reduce-scatters, once per micro-batch ----
    for unit in fsdp_units(model, layout):
        n = group_size(layout, unit.group)
        if n == 1:
            continue
        shard = unit.padded_shard_numel * (n - 1)
        gathers = (1 if unit.root else 2) * m
        # pp = 1: gradients reduce-scatter after every micro-batch's backward; pp > 1: only in the
        # last backward of the step (lightning_moe.parallel.pipeline's backward_maybe_with_nosync)
        scatters = m if layout.pp == 1 else layout.pipeline_steps
        frac = unit.ranks_fraction * unit.count
        nbytes = (gathers * FSDP_GATHER_BYTES[precision] + scatters * FSDP_REDUCE_BYTES) * shard
        add(f"FSDP {unit.name}", "dp", unit.group, nbytes * frac, (gathers + scatters) * frac, overlapped=True)
    if moe_per_rank and group_size(layout, "token") > 1:
        if model.load_balancing == "global_aux_loss":
            n = group_size(layout, "token")
            add("global aux-loss counts", "dp", "token", 2 * (model.num_experts + 1) * FP32_BYTES * (n - 1) // n * m * moe_per_rank,
                m * moe_per_rank, recorded_as="dp")
        if model.expert_bias:
            n = group_size(layout, "token")
            add("expert-bias loads", "dp", "token", 2 * model.num_experts * FP32_BYTES * (n - 1) // n * moe_per_rank,
                moe_per_rank, recorded_as="dp")
    # ---- pipeline ----
    if pp > 1:
        v = layout.pp_stages_per_rank
        boundary = b * seq_local // tp * h * a  # sequence-parallel shard of the hidden states
        sends = 2 * (pp * v - 1) * m  # forward activations and backward gradients over every stage boundary
        add("stage activations/gradients", "pp", "pp", boundary * sends / pp, sends / pp, pattern="chain")
        steps = layout.pipeline_steps
        add("mean-loss broadcast", "pp", "pp", PIPELINE_LOSS_BYTES * (pp - 1) / pp * steps, steps / pp)
    # ---- Lightning's per-batch sigterm flag, broadcast from rank 0 over the world ----
    world = layout.world_size
    batches = _batches_per_step(layout)
    if world > 1 and batches > 1:
        add("Lightning sigterm flag", "dp", "world", (batches - 1) * SIGTERM_FLAG_BYTES * (world - 1) / world, (batches - 1) / world)
    return records


# -- parameters ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParamSpec:
    """One parameter: global shape, tensor-parallel split (dim or None), expert split, FSDP unit."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None  # dim sharded over tp (DTensor Shard), None: replicated over tp
    expert: bool  # Shard(0) over ep (and tp_dim over etp when etp = tp)
    unit: str  # FSDP unit name
    group: str  # FSDP mesh: "dense", "edp" or "token"
    stage_part: str  # "layer:<i>", "first" or "last"


@dataclass
class FsdpUnit:
    name: str
    group: str
    root: bool
    padded_shard_numel: float  # per rank, summed over the unit's parameters
    ranks_fraction: float  # fraction of all ranks holding one such unit (pipeline stages)
    count: int = 1  # units of this kind in the model


def parameter_specs(model: ModelShape, layout: Layout) -> list[ParamSpec]:
    """Every parameter of the model with how ``lightning_moe.parallelize`` shards it."""
    return list(_parameter_specs(model, layout.tp > 1, layout.etp == layout.tp))


@lru_cache(maxsize=64)
def _parameter_specs(model: ModelShape, tp_on: bool, etp_is_tp: bool) -> tuple[ParamSpec, ...]:
    h, v = model.hidden_size, model.vocab_size
    specs = [
        ParamSpec("tok_embeddings.weight", (v, h), 0 if tp_on else None, False, "first", "dense", "first"),
        ParamSpec("norm.weight", (h,), None, False, "last", "dense", "last"),
        ParamSpec("output.weight", (v, h), 0 if tp_on else None, False, "last", "dense", "last"),
    ]
    etp = etp_is_tp and tp_on
    for i in range(model.num_layers):
        p, part = f"layers.{i}.", f"layer:{i}"
        block = f"layer{i}"
        specs += [
            ParamSpec(p + "attention_norm.weight", (h,), None, False, block, "dense", part),
            ParamSpec(p + "ffn_norm.weight", (h,), None, False, block, "dense", part),
            ParamSpec(p + "attention.wq.weight", (model.q_dim, h), 0 if tp_on else None, False, block, "dense", part),
            ParamSpec(p + "attention.wk.weight", (model.kv_dim, h), 0 if tp_on else None, False, block, "dense", part),
            ParamSpec(p + "attention.wv.weight", (model.kv_dim, h), 0 if tp_on else None, False, block, "dense", part),
            ParamSpec(p + "attention.wo.weight", (h, model.q_dim), 1 if tp_on else None, False, block, "dense", part),
        ]
        if model.is_moe(i):
            e, f = model.num_experts, model.moe_ffn_hidden_size
            side_unit, side_group = (f"layer{i}.router", "token") if tp_on else (block, "dense")
            specs.append(ParamSpec(p + "feed_forward.router.weight", (e, h), None, False, side_unit, side_group, part))
            if model.shared_expert_hidden_size:
                fs = model.shared_expert_hidden_size
                for name, shape in (("w1", (fs, h)), ("w3", (fs, h)), ("w2", (h, fs))):
                    specs.append(ParamSpec(p + f"feed_forward.shared_expert.{name}.weight", shape, None, False, side_unit, side_group, part))
            for name, shape, ffn_dim in (("w1", (e, h, f), 2), ("w3", (e, h, f), 2), ("w2", (e, f, h), 1)):
                specs.append(ParamSpec(p + f"feed_forward.experts.{name}", shape, ffn_dim if etp else None, True, f"layer{i}.experts", "edp", part))
        else:
            f = model.ffn_hidden_size
            for name, shape, dim in (("w1", (f, h), 0), ("w3", (f, h), 0), ("w2", (h, f), 1)):
                specs.append(ParamSpec(p + f"feed_forward.{name}.weight", shape, dim if tp_on else None, False, block, "dense", part))
    return tuple(specs)


def _fsdp_index(layout: Layout, group: str, coords: Mapping[str, int]) -> int:
    """This rank's index in an FSDP mesh (lightning_moe.parallel.dims: flattened row-major)."""
    if group == "edp":
        dims = ("dp", "cp", "tp") if layout.etp == 1 else ("dp", "cp")
    else:
        dims = GROUP_SPANS[group]
    index = 0
    for d in dims:
        index = index * layout.size(d) + coords[d]
    return index


def local_shape(spec: ParamSpec, layout: Layout, rank: int, *, fsdp: bool = True, padded: bool = False) -> tuple[int, ...]:
    """The shape of ``spec`` on ``rank``: ep and tp splits (DTensor chunks), then FSDP2's dim-0 chunk.

    ``padded``: FSDP2's allocation (every rank holds ``ceil(dim0 / n)`` rows) instead of the chunk.
    """
    coords = layout.coordinates(rank)
    shape = list(spec.shape)
    if spec.expert:
        shape[0] = chunk_size(shape[0], layout.ep, coords["ep"])
    if spec.tp_dim is not None:
        shape[spec.tp_dim] = chunk_size(shape[spec.tp_dim], layout.tp, coords["tp"])
    if fsdp:
        n = group_size(layout, spec.group)
        if n > 1:
            shape[0] = _ceil_div(shape[0], n) if padded else chunk_size(shape[0], n, _fsdp_index(layout, spec.group, coords))
    return tuple(shape)


def _rank_holds(spec: ParamSpec, model: ModelShape, layout: Layout, pp_rank: int) -> bool:
    stages = _rank_stages(layout, pp_rank)
    if spec.stage_part == "first":
        return 0 in stages
    if spec.stage_part == "last":
        return layout.pp * layout.pp_stages_per_rank - 1 in stages
    return int(spec.stage_part.split(":")[1]) in _rank_layers(model, layout, pp_rank)


def _representatives(model: ModelShape, layout: Layout) -> list[ParamSpec]:
    """The embedding/norm/output specs and those of one MoE and one dense layer (all layers of a kind
    shard alike): with :func:`_kind_of` and counts, per-rank sums need no loop over every layer."""
    moe = next((i for i in range(model.num_layers) if model.is_moe(i)), None)
    dense = next((i for i in range(model.num_layers) if not model.is_moe(i)), None)
    keep = {"first", "last", f"layer:{moe}", f"layer:{dense}"}
    return [s for s in parameter_specs(model, layout) if s.stage_part in keep]


def _kind_of(model: ModelShape, spec: ParamSpec) -> str:
    if not spec.stage_part.startswith("layer:"):
        return spec.stage_part
    return "moe" if model.is_moe(int(spec.stage_part.split(":")[1])) else "dense"


def _kind_counts(model: ModelShape, layout: Layout, pp_rank: int) -> dict[str, int]:
    stages = _rank_stages(layout, pp_rank)
    layers = _rank_layers(model, layout, pp_rank)
    return {
        "first": int(0 in stages),
        "last": int(layout.pp * layout.pp_stages_per_rank - 1 in stages),
        "moe": sum(model.is_moe(i) for i in layers),
        "dense": sum(not model.is_moe(i) for i in layers),
    }


def rank_parameters(model: ModelShape, layout: Layout, rank: int, *, padded: bool = False) -> dict[str, tuple[int, ...]]:
    """``{name: local shape}`` of every parameter ``rank`` holds (FSDP shards included).

    Example::

        rank_parameters(shape, Layout(tp=2, dp=2), rank=3)["layers.0.attention.wq.weight"]
    """
    pp_rank = layout.coordinates(rank)["pp"]
    return {
        spec.name: local_shape(spec, layout, rank, padded=padded)
        for spec in parameter_specs(model, layout)
        if _rank_holds(spec, model, layout, pp_rank)
    }


def parameter_bytes_per_rank(model: ModelShape, layout: Layout, rank: int, *, padded: bool = False, dtype_bytes: int = FP32_BYTES) -> int:
    """Bytes of the parameter shards ``rank`` holds (exact chunks, or FSDP2's padded allocation)."""
    return dtype_bytes * sum(math.prod(shape) for shape in rank_parameters(model, layout, rank, padded=padded).values())


def fsdp_units(model: ModelShape, layout: Layout) -> list[FsdpUnit]:
    """FSDP2 units as ``apply_data_parallel`` wraps them: per block, experts, router (tp > 1), the root.

    Under pp = 1 the whole module is the root unit (embedding, final norm, output), which FSDP does
    not reshard after forward; under pp > 1 each of those children is a unit of its own and every
    top-level unit (embedding, norm, output, each block) is first called on its own and becomes a
    root. Experts and router units nest inside a block and never are. ``count``: units of that
    kind in the whole model.
    """
    totals: dict[tuple[str, str], float] = {}
    groups: dict[tuple[str, str], str] = {}
    for spec in _representatives(model, layout):
        kind = _kind_of(model, spec)
        if kind in ("first", "last"):
            name = spec.name if layout.pp > 1 else "root"
        else:
            name = spec.unit.split(".", 1)[1] if "." in spec.unit else "block"
        key = (kind, name)
        totals[key] = totals.get(key, 0) + math.prod(local_shape(spec, layout, rank=0, padded=True))
        groups[key] = spec.group
    counts = {"first": 1, "last": 1, "moe": model.num_moe_layers, "dense": model.num_layers - model.num_moe_layers}
    units = []
    for (kind, name), numel in totals.items():
        if kind in ("first", "last") and name == "root" and any(u.name == "root" for u in units):
            units[[u.name for u in units].index("root")].padded_shard_numel += numel  # type: ignore[misc]
            continue
        root = kind in ("first", "last") or (layout.pp > 1 and name == "block")
        units.append(FsdpUnit(name, groups[(kind, name)], root, numel, 1.0 / layout.pp, counts[kind]))
    return units


# -- FLOPs ---------------------------------------------------------------------------------------------
def flops_per_microbatch(model: ModelShape, layout: Layout, seq_len: int, layers: Iterable[int], first: bool, last: bool) -> dict[str, float]:
    """Forward FLOPs one rank runs for one micro-batch, by op kind (``dense``, ``expert``, ``attention``).

    GEMMs are ``2 x m x n x k``; the causal attention core computes half of ``QK^T`` and ``PV``
    (``2 x 2 x s^2 x q_dim / 2`` per sample); expert tokens are balanced over ep ranks.
    """
    tp, cp = layout.tp, layout.cp
    h = model.hidden_size
    tokens = layout.micro_batch_size * seq_len / cp  # tokens on this cp rank (all tp ranks compute them)
    out = {"dense": 0.0, "expert": 0.0, "attention": 0.0}
    for i in layers:
        out["dense"] += 2 * tokens * (h * model.q_dim + 2 * h * model.kv_dim + model.q_dim * h) / tp
        # causal attention per sample: 2 (QK^T, PV) x 2 FLOP x s^2/2 x q_dim; cp ranks split it evenly (zigzag)
        out["attention"] += 2 * layout.micro_batch_size * seq_len * seq_len * model.q_dim / tp / cp
        if model.is_moe(i):
            out["dense"] += 2 * tokens * h * model.num_experts / tp  # router on this rank's sequence shard
            if model.shared_expert_hidden_size:
                out["dense"] += 2 * tokens * 3 * h * model.shared_expert_hidden_size / tp
            out["expert"] += 2 * tokens * model.top_k * 3 * h * model.moe_ffn_hidden_size / tp
        else:
            out["dense"] += 2 * tokens * 3 * h * model.ffn_hidden_size / tp
    if last:
        out["dense"] += 2 * tokens * h * model.vocab_size / tp
    del first
    return out


# -- memory --------------------------------------------------------------------------------------------
def activation_bytes_per_layer(model: ModelShape, layout: Layout, seq_len: int, layer: int, mode: str, precision: str) -> float:
    """Activations one layer keeps for backward, for one micro-batch, on one rank.

    Counted tensor by tensor for this model (Korthikanti et al. 2022, arXiv 2205.05198, §4, for the
    method): ``none`` keeps the norms' inputs and outputs, q/k/v, the attention output (flash-style
    attention keeps only its fp32 log-sum-exp, no ``s^2`` term), SwiGLU's gate/up/product and, for
    MoE, the router logits, the dispatched rows and their expert intermediates; ``selective`` drops
    the SwiGLU intermediates and the attention internals (recomputed); ``full`` keeps only the layer
    input. Sequence parallelism shards everything over tp.
    """
    a = ACTIVATION_BYTES[precision]
    h = model.hidden_size
    tokens = layout.micro_batch_size * seq_len / layout.cp / layout.tp  # this rank's token shard
    if mode == "full":
        return tokens * h * a
    heads_local = model.num_heads / layout.tp
    attention = tokens * a * (2 * h) + tokens * layout.tp * a * (h + (model.q_dim + 2 * model.kv_dim) / layout.tp + model.q_dim / layout.tp)
    attention += tokens * layout.tp * heads_local * FP32_BYTES  # log-sum-exp
    if mode == "selective":
        attention = tokens * a * (2 * h) + tokens * layout.tp * a * (h + (model.q_dim + 2 * model.kv_dim) / layout.tp)
    if model.is_moe(layer):
        k, f = model.top_k, model.moe_ffn_hidden_size
        rows = tokens * k  # dispatched rows per rank (balanced routing), before expert-TP gathering
        expert_tp = layout.etp == layout.tp and layout.tp > 1
        f_local = f / layout.tp if expert_tp else f
        rows_local = rows * layout.tp if expert_tp else rows
        ffn = tokens * a * 2 * h + tokens * FP32_BYTES * model.num_experts  # norm in/out, router logits
        ffn += rows_local * a * 2 * h  # expert input and output rows
        if mode == "none":
            ffn += rows_local * a * 3 * f_local  # gate, up, product
        if model.shared_expert_hidden_size:
            ffn += tokens * a * (3 * model.shared_expert_hidden_size if mode == "none" else 0)
    else:
        ffn = tokens * a * 2 * h + tokens * layout.tp * a * h
        if mode == "none":
            ffn += tokens * layout.tp * a * 3 * model.ffn_hidden_size / layout.tp
    return attention + ffn


@dataclass
class Memory:
    """Bytes per rank on the busiest pipeline rank."""

    parameters: float
    gradients: float
    optimizer: float
    fsdp_buffers: float
    activations: dict[str, float]  # per checkpointing mode
    logits: float

    def total(self, mode: str) -> float:
        return self.parameters + self.gradients + self.optimizer + self.fsdp_buffers + self.activations[mode] + self.logits


def memory_per_rank(model: ModelShape, layout: Layout, seq_len: int, precision: str = "32-true") -> tuple[Memory, int]:
    """Memory of the pipeline rank that needs the most (``(memory, pp_rank)``)."""
    best: tuple[Memory, int] | None = None
    reps = _representatives(model, layout)
    stages = _stage_layers(model, layout)
    # The busiest rank is the first (embedding, most micro-batches in flight) or the last (output, logits).
    for pp_rank in sorted({0, layout.pp - 1}):
        rank = pp_rank * (layout.world_size // layout.pp)
        counts = _kind_counts(model, layout, pp_rank)
        params = 0.0
        unit_sizes: dict[str, float] = {}
        for spec in reps:
            n = counts[_kind_of(model, spec)]
            if not n:
                continue
            params += n * math.prod(local_shape(spec, layout, rank, padded=True))
            # FSDP2 unshards one unit and prefetches the next: two of the largest units, in the all-gather dtype.
            if group_size(layout, spec.group) > 1:
                unit_sizes[spec.unit] = unit_sizes.get(spec.unit, 0) + math.prod(local_shape(spec, layout, rank, fsdp=False))
        buffers = 2 * max(unit_sizes.values(), default=0) * FSDP_GATHER_BYTES[precision]
        layers = [i for st in _rank_stages(layout, pp_rank) for i in stages[st]]
        # micro-batches in flight on this rank: GPipe all of them, 1F1B up to pp - pp_rank,
        # interleaved the 1F1B figure times (1 + (p-1)/(p v)) (Korthikanti et al. 2022, §4.2.3)
        m, p, v = layout.pipeline_microbatches, layout.pp, layout.pp_stages_per_rank
        if p == 1:
            in_flight = 1.0
        elif layout.pp_schedule == "GPipe":
            in_flight = float(m)
        else:
            in_flight = float(min(m, p - pp_rank))
            if layout.pp_schedule == "Interleaved1F1B":
                in_flight *= 1 + (p - 1) / (p * v)
        examples = {"moe": next((i for i in layers if model.is_moe(i)), None), "dense": next((i for i in layers if not model.is_moe(i)), None)}
        per_layer = {
            (kind, mode): activation_bytes_per_layer(model, layout, seq_len, i, mode, precision)
            for kind, i in examples.items() if i is not None for mode in CHECKPOINT_MODES
        }  # fmt: skip
        acts = {
            mode: in_flight * sum(counts[kind] * per_layer[(kind, mode)] for kind, i in examples.items() if i is not None)
            for mode in CHECKPOINT_MODES
        }
        if layers:  # full recompute rebuilds one layer's activations at a time
            acts["full"] += max(per_layer[(kind, "none")] for kind, i in examples.items() if i is not None)
        logits = 0.0
        if p * v - 1 in _rank_stages(layout, pp_rank):
            # logits in the compute dtype, their fp32 copy for the loss and its gradient
            tokens = layout.micro_batch_size * seq_len / layout.cp
            logits = tokens * model.vocab_size / layout.tp * (ACTIVATION_BYTES[precision] + 2 * FP32_BYTES)
        mem = Memory(params * FP32_BYTES, params * FP32_BYTES, params * ADAM_STATE_BYTES, buffers, acts, logits)
        if best is None or mem.total("none") > best[0].total("none"):
            best = (mem, pp_rank)
    assert best is not None
    return best


# -- the estimate --------------------------------------------------------------------------------------
@dataclass
class Estimate:
    """The cost model's figures for one layout (per optimizer step; bytes per rank)."""

    layout: Layout
    step_time: float
    compute_time: float
    exposed_comm_time: float
    overlapped_comm_time: float
    bubble_fraction: float
    optimizer_time: float
    mfu: float
    tokens_per_second: float
    memory: Memory
    memory_pp_rank: int
    checkpointing: str | None  # mode used (the requested one) when it fits, else None
    fits: bool
    reason: str
    comm: dict[str, dict[str, float]]  # dim -> {"intra": bytes, "inter": bytes}
    ep_internode_bytes: float
    records: list[CommRecord] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict[str, Any]:
        out = {
            **{d: self.layout.size(d) for d in PARALLEL_DIMS},
            "etp": self.layout.etp,
            "micro_batch_size": self.layout.micro_batch_size,
            "microbatches": self.layout.microbatches,
            "pp_schedule": self.layout.pp_schedule if self.layout.pp > 1 else None,
            "pp_stages_per_rank": self.layout.pp_stages_per_rank,
            "pp_microbatches": self.layout.pipeline_microbatches if self.layout.pp > 1 else None,
            "label": self.layout.label(),
            "step_time_s": self.step_time,
            "compute_time_s": self.compute_time,
            "exposed_comm_time_s": self.exposed_comm_time,
            "overlapped_comm_time_s": self.overlapped_comm_time,
            "bubble_fraction": self.bubble_fraction,
            "optimizer_time_s": self.optimizer_time,
            "mfu": self.mfu,
            "tokens_per_second": self.tokens_per_second,
            "checkpointing": self.checkpointing,
            "fits": self.fits,
            "reason": self.reason,
            "memory_bytes": {
                "parameters": self.memory.parameters,
                "gradients": self.memory.gradients,
                "optimizer": self.memory.optimizer,
                "fsdp_buffers": self.memory.fsdp_buffers,
                "logits": self.memory.logits,
                "activations": dict(self.memory.activations),
                "total": {mode: self.memory.total(mode) for mode in CHECKPOINT_MODES},
                "pp_rank": self.memory_pp_rank,
            },
            "comm_bytes": self.comm,
            "ep_internode_bytes": self.ep_internode_bytes,
            "strategy": self.layout.strategy_kwargs(),
        }
        return out


def _record_split(rec: CommRecord, layout: Layout, cluster: Cluster) -> tuple[float, float]:
    if rec.pattern == "spread":
        return peer_split(layout, rec.group, cluster.gpus_per_node)
    return ring_split(layout, rec.group, cluster.gpus_per_node, wrap=rec.pattern == "ring")


def comm_bytes_by_dim(records: Iterable[CommRecord], layout: Layout, cluster: Cluster) -> dict[str, dict[str, float]]:
    """``{dim: {"intra": bytes, "inter": bytes}}`` per optimizer step and rank."""
    out = {d: {"intra": 0.0, "inter": 0.0} for d in PARALLEL_DIMS}
    for rec in records:
        intra, inter = _record_split(rec, layout, cluster)
        out[rec.dim]["intra"] += rec.bytes * intra
        out[rec.dim]["inter"] += rec.bytes * inter
    return out


def estimate(
    model: ModelShape,
    layout: Layout,
    cluster: Cluster,
    seq_len: int,
    global_batch_size: int,
    *,
    precision: str = "bf16-mixed",
    checkpointing: str = "none",
    memory_budget: float | None = None,
) -> Estimate:
    """Step time, MFU, memory and communication of one layout (see the module docstring).

    Example::

        est = estimate(shape, Layout(tp=2, ep=2, dp=2, microbatches=4), cluster, seq_len=4096, global_batch_size=16)
        est.step_time, est.memory.total("none"), est.comm["ep"]
    """
    peak = cluster.peak_flops
    stages = _stage_layers(model, layout)
    n_stages = len(stages)
    # compute per micro-batch on the busiest pipeline rank
    worst = 0.0
    for pp_rank in sorted({0, layout.pp - 1}):  # middle ranks hold as many layers and no embedding/output
        own = _rank_stages(layout, pp_rank)
        layers = [i for st in own for i in stages[st]]
        f = flops_per_microbatch(model, layout, seq_len, layers, 0 in own, n_stages - 1 in own)
        passes = 3.0 + RECOMPUTE_FORWARDS[checkpointing]  # forward + backward (2x) + recompute
        t = passes * (
            f["dense"] / (peak * cluster.gemm_efficiency)
            + f["expert"] / (peak * cluster.grouped_gemm_efficiency)
            + f["attention"] / (peak * cluster.attention_efficiency)
        )
        worst = max(worst, t)
    slowdown = 1.0
    if cluster.concurrent_ranks:
        slowdown = max(1.0, layout.world_size / cluster.concurrent_ranks)
    t_compute_mb = worst * slowdown
    m, p, v = layout.pipeline_microbatches, layout.pp, layout.pp_stages_per_rank
    records = comm_records(model, layout, seq_len, precision)
    exposed = overlapped = 0.0
    for rec in records:
        intra, inter = _record_split(rec, layout, cluster)
        bw_intra = cluster.intra_node_bandwidth * cluster.comm_efficiency
        bw_inter = cluster.inter_node_bandwidth * cluster.comm_efficiency
        if rec.pattern == "spread" and inter > 0 and rec.dim != "ep":
            # ring collectives over a group that spans nodes run at the slowest link's pace
            seconds = rec.bytes / bw_inter
        else:
            # all-to-all and point-to-point use both tiers at once
            seconds = max(rec.bytes * intra / bw_intra, rec.bytes * inter / bw_inter)
        seconds += rec.calls * cluster.collective_latency
        if rec.pattern == "ring":  # ring attention's per-block work around each shift
            seconds += rec.calls * cluster.ring_step_overhead
        if rec.overlapped:
            overlapped += seconds
        else:
            exposed += seconds
    compute = t_compute_mb * layout.microbatches
    # FSDP and ring traffic hide behind compute (where the backend runs them asynchronously);
    # what does not fit is exposed
    hidden_capacity = compute if cluster.fsdp_overlap else 0.0
    exposed_total = exposed + max(0.0, overlapped - hidden_capacity)
    if p > 1:
        bubble_units = (p - 1) / v if layout.pp_schedule == "Interleaved1F1B" else (p - 1)
        bubble = bubble_units / (m + bubble_units)
    else:
        bubble = 0.0
    busy = compute + exposed_total
    step_core = busy / (1.0 - bubble) if bubble < 1 else float("inf")
    mem, pp_rank = memory_per_rank(model, layout, seq_len, precision)
    params_local = mem.parameters / FP32_BYTES
    optimizer_time = params_local * OPTIMIZER_HBM_BYTES_PER_PARAM / cluster.hbm_bandwidth
    step = step_core + optimizer_time
    tokens = global_batch_size * seq_len
    mfu = model.model_flops_per_token(seq_len) * tokens / step / (peak * layout.world_size)
    budget = cluster.memory_bytes - cluster.memory_reserve_bytes if memory_budget is None else memory_budget
    total = mem.total(checkpointing)
    fits = total <= budget
    reason = "" if fits else (
        f"needs {total / 2**30:.1f} GiB per rank with checkpointing={checkpointing} "
        f"(parameters+gradients+optimizer {(mem.parameters + mem.gradients + mem.optimizer) / 2**30:.1f} GiB, "
        f"activations {mem.activations[checkpointing] / 2**30:.1f} GiB, FSDP all-gather buffers"
        f" {mem.fsdp_buffers / 2**30:.1f} GiB, logits {mem.logits / 2**30:.1f} GiB), budget {budget / 2**30:.1f} GiB"
    )
    comm = comm_bytes_by_dim(records, layout, cluster)
    ep_inter = comm["ep"]["inter"]
    return Estimate(
        layout=layout,
        step_time=step,
        compute_time=compute,
        exposed_comm_time=exposed_total,
        overlapped_comm_time=overlapped,
        bubble_fraction=bubble,
        optimizer_time=optimizer_time,
        mfu=mfu,
        tokens_per_second=tokens / step,
        memory=mem,
        memory_pp_rank=pp_rank,
        checkpointing=checkpointing if fits else None,
        fits=fits,
        reason=reason,
        comm=comm,
        ep_internode_bytes=ep_inter,
        records=records,
    )


# -- enumeration ---------------------------------------------------------------------------------------
def layout_problems(model: ModelShape, layout: Layout, seq_len: int, global_batch_size: int) -> list[str]:
    """Why the code would refuse ``layout`` (empty: valid). Mirrors the checks of the strategy,
    ``parallelize``, the dispatchers, ring attention and the pipeline."""
    problems = []
    tp, cp, ep, dp, pp = (layout.size(d) for d in PARALLEL_DIMS)
    if model.num_heads % tp or model.num_kv_heads % tp:
        problems.append(f"tp={tp} does not divide num_heads={model.num_heads} and num_kv_heads={model.num_kv_heads}")
    if model.num_moe_layers and model.num_experts % ep:
        problems.append(f"ep={ep} does not divide num_experts={model.num_experts}")
    if not model.num_moe_layers and ep > 1:
        problems.append("ep > 1 without MoE layers")
    if layout.etp == tp and tp > 1 and model.moe_ffn_hidden_size % tp:
        problems.append(f"etp={tp} does not divide the expert ffn_hidden_size={model.moe_ffn_hidden_size}")
    if seq_len % (2 * cp) if cp > 1 else False:
        problems.append(f"seq_len={seq_len} is not divisible by 2*cp={2 * cp} (zigzag)")
    if (seq_len // cp) % tp:
        problems.append(f"seq_len/cp={seq_len // cp} is not divisible by tp={tp} (sequence parallelism)")
    if global_batch_size % (dp * ep * layout.micro_batch_size):
        problems.append(f"global_batch_size={global_batch_size} is not divisible by dp*ep*micro_batch_size")
    stages = pp * layout.pp_stages_per_rank
    if model.num_layers % stages:
        problems.append(f"num_layers={model.num_layers} is not divisible by pp*stages_per_rank={stages}")
    mp = layout.pipeline_microbatches
    if pp > 1 and layout.pp_schedule in ("1F1B", "Interleaved1F1B") and mp < pp:
        problems.append(f"{layout.pp_schedule} needs at least pp={pp} micro-batches per pipeline step, got {mp}")
    if pp > 1 and layout.microbatches % mp:
        problems.append(f"micro-batches per step {layout.microbatches} are not a multiple of pp_microbatches={mp}")
    if layout.pp_schedule == "Interleaved1F1B" and pp > 1 and (layout.pp_stages_per_rank < 2 or mp % pp):
        problems.append("Interleaved1F1B needs pp_stages_per_rank >= 2 and micro-batches divisible by pp")
    return problems


def enumerate_layouts(
    world_size: int,
    model: ModelShape,
    seq_len: int,
    global_batch_size: int,
    *,
    max_tp: int | None = None,
    micro_batch_sizes: Iterable[int] | None = None,
    schedules: Iterable[str] = ("1F1B", "Interleaved1F1B"),
) -> Iterator[Layout]:
    """Every layout the code accepts for ``world_size`` ranks (tp at most ``max_tp``, a node).

    Under pp > 1 one pipeline step runs all micro-batches of the optimizer step.
    """
    for tp in _divisors(world_size):
        if max_tp is not None and tp > max_tp:
            continue
        for cp in _divisors(world_size // tp):
            for ep in _divisors(world_size // (tp * cp)):
                for pp in _divisors(world_size // (tp * cp * ep)):
                    dp = world_size // (tp * cp * ep * pp)
                    if global_batch_size % (dp * ep):
                        continue
                    per_rank = global_batch_size // (dp * ep)
                    sizes = [x for x in _divisors(per_rank) if x <= MAX_MICRO_BATCH] if micro_batch_sizes is None else [x for x in micro_batch_sizes if per_rank % x == 0]
                    for etp in sorted({1, tp}):
                        for mb in sizes:
                            m = per_rank // mb
                            options = [("1F1B", 1)] if pp == 1 else [(sch, 2 if sch == "Interleaved1F1B" else 1) for sch in schedules]
                            for schedule, v in options:
                                layout = Layout(tp, cp, ep, dp, pp, etp, mb, m, schedule, v)
                                if not layout_problems(model, layout, seq_len, global_batch_size):
                                    yield layout


@dataclass
class Plan:
    """Ranked layouts that fit (fastest first) and the ones that do not (with the reason)."""

    world_size: int
    model: ModelShape
    cluster: Cluster
    seq_len: int
    global_batch_size: int
    ranked: list[Estimate]
    rejected: list[Estimate]

    @property
    def best(self) -> Estimate:
        return self.ranked[0]


def _check_positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")


def plan(
    world_size: int,
    model: ModelShape,
    cluster: Cluster,
    *,
    seq_len: int,
    global_batch_size: int,
    precision: str = "bf16-mixed",
    checkpointing: str = "none",
    memory_budget: float | None = None,
    max_tp: int | None = None,
    micro_batch_sizes: Iterable[int] | None = None,
) -> Plan:
    """Estimate every valid layout and rank those that fit by step time.

    Raises ``ValueError`` (before any work) for bad arguments, when no layout is valid for
    ``world_size``, and when ``memory_budget`` cannot hold the parameters, gradients and optimizer
    states even fully sharded.

    Example::

        result = plan(256, shape, cluster, seq_len=4096, global_batch_size=1024)
        print(result.best.layout.label(), result.best.step_time)
    """
    _check_positive("world_size", world_size)
    _check_positive("seq_len", seq_len)
    _check_positive("global_batch_size", global_batch_size)
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is unknown: choose one of {PRECISIONS}")
    if checkpointing not in CHECKPOINT_MODES:
        raise ValueError(f"checkpointing={checkpointing!r} is unknown: choose one of {CHECKPOINT_MODES}")
    budget = cluster.memory_bytes - cluster.memory_reserve_bytes if memory_budget is None else float(memory_budget)
    state_bytes = model.total_parameters() * (2 * FP32_BYTES + ADAM_STATE_BYTES) / world_size
    if budget < state_bytes:
        raise ValueError(
            f"memory_budget {budget / 2**30:.2f} GiB per rank is smaller than the parameters, gradients and Adam"
            f" states alone ({model.total_parameters() / 1e9:.2f}B parameters x 16 bytes / {world_size} ranks ="
            f" {state_bytes / 2**30:.2f} GiB): raise memory_budget or world_size, or pick a smaller model"
        )
    max_tp = cluster.gpus_per_node if max_tp is None else max_tp
    layouts = list(enumerate_layouts(world_size, model, seq_len, global_batch_size, max_tp=max_tp, micro_batch_sizes=micro_batch_sizes))
    if not layouts:
        raise ValueError(
            f"no layout of world_size={world_size} is valid for {model.name} with seq_len={seq_len} and"
            f" global_batch_size={global_batch_size}: world_size must factor into tp (dividing num_heads={model.num_heads}"
            f" and num_kv_heads={model.num_kv_heads}, at most {max_tp}), ep (dividing num_experts={model.num_experts}),"
            f" pp (dividing num_layers={model.num_layers}) and dp*ep dividing global_batch_size; change world_size"
            " or global_batch_size"
        )
    estimates = [
        estimate(model, layout, cluster, seq_len, global_batch_size, precision=precision, checkpointing=checkpointing, memory_budget=budget)
        for layout in layouts
    ]
    ranked = sorted((e for e in estimates if e.fits), key=lambda e: (e.step_time, e.memory.total(checkpointing)))
    rejected = sorted((e for e in estimates if not e.fits), key=lambda e: e.memory.total(checkpointing))
    return Plan(world_size, model, cluster, seq_len, global_batch_size, ranked, rejected)


# -- as the comm accounting records it -----------------------------------------------------------------
# lightning_moe.callbacks.comm_accounting._GROUP_DIMS: (mesh dims a group spans, dim it counts for).
_ACCOUNTING_GROUP_DIMS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("dp", "ep", "cp"), "dp"), (("dp", "cp"), "dp"), (("dp", "ep"), "dp"), (("dp", "ep", "cp", "tp"), "dp"),
    (("dp", "cp", "tp"), "dp"), (("dp",), "dp"), (("tp",), "tp"), (("cp", "tp"), "cp"), (("cp",), "cp"),
    (("ep",), "ep"), (("ep", "tp"), "ep"), (("pp",), "pp"),
)  # fmt: skip


def _accounted_dim(rec: CommRecord, layout: Layout) -> str:
    """The dim :class:`~lightning_moe.callbacks.comm_accounting.GroupDims` gives ``rec``'s traffic.

    A mesh group that spans every rank is torch's default group: it is looked up by its ranks
    (the first matching entry of the accounting's table; a functional collective takes the first
    that is not dp). Any other mesh group counts for dp when it includes dp, else for its first dim
    of size > 1.
    """
    if rec.recorded_as is not None:
        return rec.recorded_as
    spans = _spans(layout, rec.group)
    busy = {d for d in MESH_ORDER if layout.size(d) > 1}
    if busy and busy <= set(spans):  # the default group
        matches = []
        for spanned, dim in _ACCOUNTING_GROUP_DIMS:
            if busy <= set(spanned) and dim not in matches:
                matches.append(dim)
        if not matches:
            return "other"
        if rec.functional:
            return next((d for d in matches if d != "dp"), matches[0])
        return matches[0]
    names = ["dp" if d == "edp" else d for d in spans]
    if "dp" in names or rec.group == "edp":
        return "dp"
    return next((d for d in names if layout.size(d) > 1), names[0])


def accounted_comm_bytes(model: ModelShape, layout: Layout, seq_len: int, precision: str = "32-true") -> dict[str, float]:
    """Bytes per optimizer step and rank, per dim, as ``comm/<dim>_bytes`` of
    :class:`~lightning_moe.callbacks.CommAccountingCallback` records them (mean over ranks).

    Example::

        accounted_comm_bytes(shape, Layout(ep=2, microbatches=2), seq_len=32)["ep"]
    """
    out = {d: 0.0 for d in (*PARALLEL_DIMS, "other")}
    for rec in comm_records(model, layout, seq_len, precision):
        out[_accounted_dim(rec, layout)] += rec.bytes
    return out


# -- automatic layout ----------------------------------------------------------------------------------
def auto_layout(
    world_size: int,
    model: ModelShape,
    cluster: Cluster,
    *,
    seq_len: int,
    global_batch_size: int,
    precision: str = "bf16-mixed",
) -> tuple[Estimate, Estimate | None]:
    """The best layout for ``world_size`` and the runner-up (None if there is only one).

    Used by ``MoE5DStrategy(layout="auto")``. Example::

        best, runner_up = auto_layout(8, shape, cluster, seq_len=2048, global_batch_size=64)
        MoE5DStrategy(**best.layout.strategy_kwargs())
    """
    result = plan(world_size, model, cluster, seq_len=seq_len, global_batch_size=global_batch_size, precision=precision)
    if not result.ranked:
        worst = result.rejected[0]
        raise ValueError(
            f"no layout of world_size={world_size} fits in memory for {model.name}: the smallest needs"
            f" {worst.memory.total('none') / 2**30:.1f} GiB per rank ({worst.reason}); add ranks or shrink the batch"
        )
    return result.ranked[0], (result.ranked[1] if len(result.ranked) > 1 else None)


__all__ = [
    "CHECKPOINT_MODES", "Cluster", "CommRecord", "Estimate", "Layout", "Memory", "ModelShape", "Plan",
    "accounted_comm_bytes", "auto_layout", "chunk_size", "resolve_auto_layout", "comm_bytes_by_dim", "comm_records", "enumerate_layouts",
    "estimate", "flops_per_microbatch", "fsdp_units", "group_ranks", "layout_problems", "local_shape",
    "memory_per_rank", "parameter_bytes_per_rank", "parameter_specs", "plan", "rank_parameters",
]  # fmt: skip



def _precision_of(precision: str | None) -> str:
    """The planner's precision for a Lightning ``precision`` string (bf16 variants: ``bf16-mixed``)."""
    return "bf16-mixed" if str(precision or "32-true").startswith("bf16") else "32-true"


def resolve_auto_layout(
    world_size: int,
    *,
    model: Mapping[str, Any] | ModelShape | None = None,
    cluster: Mapping[str, Any] | Cluster | None = None,
    seq_len: int | None = None,
    global_batch_size: int | None = None,
    micro_batch_size: int | None = None,
    precision: str | None = None,
) -> tuple[Estimate, Estimate | None]:
    """``MoE5DStrategy(layout="auto", layout_options={...})``: the best layout and the runner-up.

    ``layout_options`` are this function's keyword arguments: ``model`` (MoEGPT arguments or a
    :class:`ModelShape`), ``cluster`` (a cluster preset's keys or a :class:`Cluster`), ``seq_len``,
    ``global_batch_size``, ``micro_batch_size`` (the data module's; None stands for what the data
    modules make of None, :func:`~lightning_moe.data.sampler.default_micro_batch_size`, so that
    layouts are ranked with the micro-batch that will run) and ``precision`` (Lightning's string).
    ``conf/parallel/auto.yaml`` fills them from the run's config.

    Example::

        best, runner_up = resolve_auto_layout(4, model=cfg.model, cluster=cpu_local, seq_len=128, global_batch_size=16)
        best.layout.strategy_kwargs()   # {"tp": 1, "cp": 1, "ep": 2, "dp": 2, "pp": 1, "etp": 1}
    """
    missing = [k for k, v in (("model", model), ("cluster", cluster), ("seq_len", seq_len), ("global_batch_size", global_batch_size)) if v is None]
    if missing:
        raise ValueError(
            f"layout='auto' needs layout_options {missing}: pass layout_options=dict(model=<MoEGPT arguments>,"
            " cluster=<cluster preset keys>, seq_len=..., global_batch_size=...) or use parallel=auto with the CLI"
        )
    shape = model if isinstance(model, ModelShape) else ModelShape.from_config(model, name="model")  # type: ignore[arg-type]
    machine = cluster if isinstance(cluster, Cluster) else Cluster.from_config(cluster)  # type: ignore[arg-type]
    if micro_batch_size is None:
        # Imported here: the cost model stays free of the data modules' Lightning imports.
        from lightning_moe.data.sampler import default_micro_batch_size

        micro_batch_size = default_micro_batch_size(int(global_batch_size))  # type: ignore[arg-type]
    result = plan(
        world_size, shape, machine, seq_len=int(seq_len), global_batch_size=int(global_batch_size),  # type: ignore[arg-type]
        precision=_precision_of(precision), micro_batch_sizes=[int(micro_batch_size)],
    )  # fmt: skip
    if not result.ranked:
        smallest = result.rejected[0]
        raise ValueError(
            f"layout='auto': no layout of world_size={world_size} fits in memory ({smallest.layout.label()}: {smallest.reason});"
            " add devices, shrink the batch or the model"
        )
    return result.ranked[0], (result.ranked[1] if len(result.ranked) > 1 else None)

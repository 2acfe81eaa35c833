"""Search: every layout the code accepts for a world size, estimated and ranked by step time;
``layout="auto"`` takes the first."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from lightning_moe.cp.comm import CP_COMM_KINDS, CpComm
from lightning_moe.layout import (
    V_SCHEDULES,
    default_micro_batch_size,
    fold_size,
    mesh_factorizations,
    sequence_split_problem,
    size_problems,
    stage_layers_problem,
    ulysses_heads_problem,
)
from lightning_moe.moe.dispatchers import dispatcher_kind
from lightning_moe.planner.candidate import Layout
from lightning_moe.planner.cluster import Cluster
from lightning_moe.planner.dtypes import ADAM_STATE_BYTES, FP32_BYTES, PRECISIONS
from lightning_moe.planner.groups import nodes_spanned
from lightning_moe.planner.memory import CHECKPOINT_MODES
from lightning_moe.planner.model_shape import ModelShape
from lightning_moe.planner.step_time import Estimate, estimate

# Largest micro-batch the planner tries (samples); larger ones rarely fit at real sizes.
MAX_MICRO_BATCH = 16


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_problems(
    model: ModelShape, layout: Layout, seq_len: int, global_batch_size: int, checkpointing: str = "none"
) -> list[str]:
    """Why the code would refuse ``layout`` (empty: valid): the layout rules
    (:func:`lightning_moe.layout.size_problems`) for this model and batch, then what only a shape
    tells (sequence parallel shards, experts without MoE layers, the heads all-to-all context
    parallelism splits), the pipeline's own checks and the strategy's for ``overlap_ep_comm``
    (under activation checkpointing ``checkpointing``)."""
    tp, cp, ep, dp, pp = layout.parallel_sizes().values()
    mp = layout.pipeline_microbatches
    problems = size_problems(
        tp, cp, ep, dp, pp, layout.etp,
        num_heads=model.num_heads, num_kv_heads=model.num_kv_heads,
        num_experts=model.num_experts if model.num_moe_layers else None,
        expert_ffn_hidden_size=model.moe_ffn_hidden_size,
        seq_len=seq_len, global_batch_size=global_batch_size,
        micro_batch_size=layout.micro_batch_size, pp_microbatches=mp, fold_ep=layout.fold_ep,
    )  # fmt: skip
    if not model.num_moe_layers and ep > 1:
        problems.append("ep > 1 without MoE layers")
    if layout.overlap_ep_comm:
        problems.extend(overlap_ep_comm_problems(model, layout, checkpointing))
    split = sequence_split_problem(seq_len // cp, tp)
    if split:
        problems.append(split)
    if layout.cp_comm == CpComm.A2A:
        heads = a2a_heads_problem(model, layout)
        if heads:
            problems.append(heads)
    stages = pp * layout.pp_stages_per_rank
    if layout.pp_stage_layers:
        uneven = stage_layers_problem(layout.pp_stage_layers, stages, model.num_layers)
        if uneven:
            problems.append(uneven)
    elif model.num_layers % stages:
        problems.append(f"num_layers={model.num_layers} is not divisible by pp*stages_per_rank={stages}")
    if pp > 1 and layout.pp_schedule in ("1F1B", "Interleaved1F1B") and mp < pp:
        problems.append(f"{layout.pp_schedule} needs at least pp={pp} micro-batches per pipeline step, got {mp}")
    if layout.v_schedule and (layout.pp_stages_per_rank != 2 or mp < 2 * pp):
        problems.append(
            f"{layout.pp_schedule} needs pp_stages_per_rank=2 and at least 2*pp={2 * pp} micro-batches per pipeline step"
        )
    if layout.pp_schedule == "Interleaved1F1B" and pp > 1 and (layout.pp_stages_per_rank < 2 or mp % pp):
        problems.append("Interleaved1F1B needs pp_stages_per_rank >= 2 and micro-batches divisible by pp")
    return problems


def overlap_ep_comm_problems(model: ModelShape, layout: Layout, checkpointing: str) -> list[str]:
    """Why ``MoE5DStrategy`` would refuse ``overlap_ep_comm=True`` for ``layout``
    (``lightning_moe.ParallelConfig``'s checks), or why it would have nothing to overlap: the
    handover happens at the token all-to-alls, which only the all-to-all dispatchers issue."""
    problems = []
    if layout.ep == 1:
        problems.append("overlap_ep_comm=True needs ep > 1")
    if layout.pp > 1 and layout.pp_schedule != "DualPipeV":
        problems.append(
            f"overlap_ep_comm=True with pp={layout.pp} needs pp_schedule='DualPipeV' (got {layout.pp_schedule!r}) or use pp=1"
        )
    # DualPipeV pairs passes of the rank's two stages, never of one FSDP unit: any data parallelism does
    if layout.pp == 1 and not layout.gather_once_per_step:
        problems.append("overlap_ep_comm=True needs gather_once_per_step=True")
    if checkpointing != "none":
        problems.append(f"overlap_ep_comm=True needs activation_checkpointing='none', got {checkpointing!r}")
    kind = dispatcher_kind(model.dispatcher)
    if not kind.capabilities.token_all_to_all:
        problems.append(
            f"overlap_ep_comm=True hands over at token all-to-alls, which dispatcher={kind.value!r} does not issue"
        )
    return problems


def a2a_heads_problem(model: ModelShape, layout: Layout) -> str | None:
    """Why all-to-all context parallelism (``cp_comm="a2a"``) cannot run ``layout``'s cp for ``model``,
    or None: the query heads per tp rank must divide by cp (:func:`~lightning_moe.layout.ulysses_heads_problem`,
    which ``lightning_moe.cp.ulysses`` checks too).
    None for cp = 1 and where tp does not divide the heads (the layout rules say so already)."""
    tp, cp = layout.tp, layout.cp
    if cp == 1 or model.num_heads % tp or model.num_kv_heads % tp:
        return None
    return ulysses_heads_problem(model.num_heads // tp, model.num_kv_heads // tp, cp)


def hierarchical_dispatch_problem(model: ModelShape, layout: Layout, gpus_per_node: int) -> str | None:
    """Why ``dispatcher="hierarchical"`` cannot run ``layout``'s ep group, or None: its two stages need
    the group on more than one node (``lightning_moe.moe.hierarchical`` refuses one node)."""
    kind = dispatcher_kind(model.dispatcher)
    if not kind.capabilities.node_stages or layout.ep == 1 or not model.num_moe_layers:
        return None
    if nodes_spanned(layout, "ep", gpus_per_node) < 2:
        return f"dispatcher={kind.value!r} needs the ep group on more than one node of {gpus_per_node} ranks"
    return None


def cp_comm_options(model: ModelShape, layout: Layout, kinds: Iterable[str] = CP_COMM_KINDS) -> tuple[str, ...]:
    """The ``cp_comm`` values of ``kinds`` that ``layout``'s sizes can run: under cp > 1 ring attention
    always, all-to-all attention (``"a2a"``) where the query heads per tp rank divide by cp
    (:func:`a2a_heads_problem`); cp = 1 (or nothing of ``kinds`` runnable) only ``("ring",)``.

    Example: heads 8 per tp rank: cp2, cp4 and cp8 take ``("ring", "a2a")``; 12 heads at cp8: ``("ring",)``.
    """
    ring = (CpComm.RING.value,)
    if layout.cp == 1:
        return ring
    wanted = set(kinds)
    options = tuple(
        k for k in CP_COMM_KINDS if k in wanted and (k == CpComm.RING or a2a_heads_problem(model, layout) is None)
    )
    return options or ring


def estimate_cp_comm(
    model: ModelShape,
    layout: Layout,
    cluster: Cluster,
    seq_len: int,
    global_batch_size: int,
    *,
    cp_comms: Iterable[str] = CP_COMM_KINDS,
    **options: Any,
) -> Estimate:
    """:func:`~lightning_moe.planner.step_time.estimate` of ``layout`` with the fastest of its
    :func:`cp_comm_options` (``options``: the estimate's keyword arguments): under cp > 1 ring and,
    where the heads divide, all-to-all attention are both estimated and the faster kept (ring on a
    tie). Memory is modelled the same under both, so which one fits never depends on the choice.

    Example::

        est = estimate_cp_comm(shape, Layout(cp=4, dp=2), cluster, seq_len=1024, global_batch_size=8)
        est.layout.cp_comm   # "ring" or "a2a"
    """
    best: Estimate | None = None
    for kind in cp_comm_options(model, layout, cp_comms):
        variant = layout if kind == layout.cp_comm else replace(layout, cp_comm=kind)
        est = estimate(model, variant, cluster, seq_len, global_batch_size, **options)
        if best is None or est.step_time < best.step_time:
            best = est
    assert best is not None
    return best


def fold_options(tp: int, cp: int) -> list[tuple[str, ...]]:
    """The ways ep can fold over the attention dims of a mesh: not at all, over tp, over cp, over
    both (a dim of size 1 adds nothing to fold)."""
    dims = [d for d, n in (("cp", cp), ("tp", tp)) if n > 1]
    return [(), *((d,) for d in dims), *([tuple(dims)] if len(dims) == 2 else [])]


def hsdp_options(dp: int, stride: int, gpus_per_node: int | None) -> list[int]:
    """``dp_replicate`` values tried for a dp group whose ranks lie ``stride`` apart: 1 (FSDP over the
    whole group) and, when the group spans several nodes of ``gpus_per_node`` ranks, one replica
    group per node (HSDP: parameters sharded inside a node, only the gradient all-reduce crosses
    nodes). One HSDP choice per mesh keeps the search as fast as before on one node.

    Example: ``hsdp_options(32, 8, 8) == [1, 32]`` (tp8: one dp rank per node); ``hsdp_options(4, 2, 8) == [1]``.
    """
    if gpus_per_node is None or dp == 1:
        return [1]
    nodes = len({d * stride // gpus_per_node for d in range(dp)})
    return [1, nodes] if 1 < nodes and dp % nodes == 0 else [1]


def enumerate_layouts(
    world_size: int,
    model: ModelShape,
    seq_len: int,
    global_batch_size: int,
    *,
    max_tp: int | None = None,
    micro_batch_sizes: Iterable[int] | None = None,
    schedules: Iterable[str] = ("1F1B", "Interleaved1F1B", *V_SCHEDULES),
    folding: bool = True,
    gpus_per_node: int | None = None,
    checkpointing: str = "none",
) -> Iterator[Layout]:
    """Every layout the code accepts for ``world_size`` ranks (tp at most ``max_tp``, a node).

    The mesh's ep dim (``mesh_ep``) and dp share the samples; with ``folding`` each mesh is also
    tried with ep folded over its tp and/or cp ranks (:func:`fold_options`): ``ep = mesh_ep x`` the
    folded product, validated by the layout rules like any other. With ``gpus_per_node``, a dp
    group spanning nodes is also tried as HSDP, a replica group per node (:func:`hsdp_options`).
    Under pp > 1 one pipeline step runs all micro-batches of the optimizer step, and the interleaved
    and V schedules run two stages per rank. Where the strategy takes it (ep > 1, no activation
    checkpointing under ``checkpointing``, and pp = 1 with accumulation and ``gather_once_per_step``
    or ``DualPipeV``), each layout is also tried with ``overlap_ep_comm``. With several micro-batches
    per optimizer step, each is also tried with ``gather_once_per_step`` (memory decides), but for
    the V schedules, which gather once per pipeline step already. Layouts
    come with ring attention (``cp_comm="ring"``); :func:`plan` tries the all-to-all on each
    (:func:`estimate_cp_comm`).
    """
    for sizes_of_mesh in mesh_factorizations(world_size):
        tp, cp, mesh_ep, pp, dp = (sizes_of_mesh[d] for d in ("tp", "cp", "ep", "pp", "dp"))
        if max_tp is not None and tp > max_tp:
            continue
        if global_batch_size % (dp * mesh_ep):
            continue
        per_rank = global_batch_size // (dp * mesh_ep)
        sizes = (
            [x for x in _divisors(per_rank) if x <= MAX_MICRO_BATCH]
            if micro_batch_sizes is None
            else [x for x in micro_batch_sizes if per_rank % x == 0]
        )
        for fold in fold_options(tp, cp) if folding else [()]:
            ep = mesh_ep * fold_size(fold, tp, cp)
            if fold and model.num_moe_layers and model.num_experts % ep:
                continue  # the layout rules would refuse every variant below
            for etp in [1] if "tp" in fold else sorted({1, tp}):
                for replicas in hsdp_options(dp, tp * cp * mesh_ep, gpus_per_node):
                    mesh = (tp, cp, ep, dp, pp, etp, fold, replicas)
                    yield from _schedules(
                        model, seq_len, global_batch_size, mesh, per_rank, sizes, schedules, checkpointing
                    )


def _schedules(
    model: ModelShape,
    seq_len: int,
    global_batch_size: int,
    mesh: tuple[Any, ...],
    per_rank: int,
    sizes: list[int],
    schedules: Iterable[str],
    checkpointing: str,
) -> Iterator[Layout]:
    """The valid micro-batch and pipeline variants of one mesh ``(tp, cp, ep, dp, pp, etp, fold_ep, dp_replicate)``."""
    tp, cp, ep, dp, pp, etp, fold, replicas = mesh
    for mb in sizes:
        m = per_rank // mb
        options = (
            [("1F1B", 1)]
            if pp == 1
            else [(sch, 2 if sch in ("Interleaved1F1B", *V_SCHEDULES) else 1) for sch in schedules]
        )
        for schedule, v in options:
            # several micro-batches per optimizer step: FSDP may gather once per step (more memory); the V
            # schedules gather once per pipeline step already, and here one pipeline step is the optimizer step
            for once in (False, True) if m > 1 and schedule not in V_SCHEDULES else (False,):
                # micro-batch overlap needs the blocks kept gathered: FSDP2 would reshard one after the next
                # forward while the previous backward still needs it (DualPipeV pairs two stages instead)
                pairs = once if pp == 1 else schedule == "DualPipeV"
                for overlap in (False, True) if pairs and ep > 1 else (False,):
                    layout = Layout(
                        tp,
                        cp,
                        ep,
                        dp,
                        pp,
                        etp,
                        mb,
                        m,
                        schedule,
                        v,
                        gather_once_per_step=once,
                        fold_ep=fold,
                        dp_replicate=replicas,
                        overlap_ep_comm=overlap,
                    )
                    if not layout_problems(model, layout, seq_len, global_batch_size, checkpointing):
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
    folding: bool = True,
    cp_comms: Iterable[str] = CP_COMM_KINDS,
    fp8_gemms: bool = False,
    load_imbalance: float | None = None,
) -> Plan:
    """Estimate every valid layout and rank those that fit by step time.

    ``folding``: also try ep folded over tp and/or cp (parallel folding, :func:`enumerate_layouts`).
    A dp group spanning several of the cluster's nodes is also tried as HSDP (one replica group per node).
    ``cp_comms``: how attention may cross the cp ranks; each layout with cp > 1 is estimated under
    each of them it can run (all-to-all: query heads per tp rank divisible by cp) and ranked with
    the fastest (:func:`estimate_cp_comm`; ``("ring",)``: ring attention only). ``fp8_gemms`` and
    ``load_imbalance``: as :func:`~lightning_moe.planner.step_time.estimate` takes them.

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
    if load_imbalance is not None and not load_imbalance >= 1:
        raise ValueError(
            f"expert_load_imbalance={load_imbalance} must be >= 1 (the busiest ep rank's expert tokens over the mean;"
            " 1: perfectly balanced routing), or null for the default"
        )
    cluster.gemm_peak(fp8_gemms)  # refuses fp8_gemms on a cluster without FP8 figures, before any work
    cp_comms = tuple(cp_comms)
    if not cp_comms or any(k not in CP_COMM_KINDS for k in cp_comms):
        raise ValueError(f"cp_comms={cp_comms!r} must name one or more of {CP_COMM_KINDS}")
    budget = cluster.memory_budget if memory_budget is None else float(memory_budget)
    state_bytes = model.total_parameters() * (2 * FP32_BYTES + ADAM_STATE_BYTES) / world_size
    if budget < state_bytes:
        raise ValueError(
            f"memory_budget {budget / 2**30:.2f} GiB per rank is smaller than the parameters, gradients and Adam"
            f" states alone ({model.total_parameters() / 1e9:.2f}B parameters x 16 bytes / {world_size} ranks ="
            f" {state_bytes / 2**30:.2f} GiB): raise memory_budget or world_size, or pick a smaller model"
        )
    max_tp = cluster.gpus_per_node if max_tp is None else max_tp
    layouts = [
        lay for lay in enumerate_layouts(world_size, model, seq_len, global_batch_size, max_tp=max_tp, micro_batch_sizes=micro_batch_sizes,
                                         folding=folding, gpus_per_node=cluster.gpus_per_node, checkpointing=checkpointing)
        if not hierarchical_dispatch_problem(model, lay, cluster.gpus_per_node)
    ]  # fmt: skip
    if not layouts:
        raise ValueError(
            f"no layout of world_size={world_size} is valid for {model.name} with seq_len={seq_len} and"
            f" global_batch_size={global_batch_size}: world_size must factor into tp (dividing num_heads={model.num_heads}"
            f" and num_kv_heads={model.num_kv_heads}, at most {max_tp}), ep (dividing num_experts={model.num_experts}),"
            f" pp (dividing num_layers={model.num_layers}) and dp*ep dividing global_batch_size; change world_size"
            " or global_batch_size"
        )
    estimates = [
        estimate_cp_comm(
            model,
            layout,
            cluster,
            seq_len,
            global_batch_size,
            cp_comms=cp_comms,
            precision=precision,
            checkpointing=checkpointing,
            memory_budget=budget,
            fp8_gemms=fp8_gemms,
            load_imbalance=load_imbalance,
        )
        for layout in layouts
    ]
    ranked = sorted((e for e in estimates if e.fits), key=lambda e: (e.step_time, e.memory.total(checkpointing)))
    rejected = sorted((e for e in estimates if not e.fits), key=lambda e: e.memory.total(checkpointing))
    return Plan(world_size, model, cluster, seq_len, global_batch_size, ranked, rejected)


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
    checkpointing: str = "none",
    load_imbalance: float | None = None,
) -> tuple[Estimate, Estimate | None]:
    """``MoE5DStrategy(layout="auto", layout_options={...})``: the best layout and the runner-up.

    Folded layouts compete too: the strategy takes ``fold_ep`` from ``strategy_kwargs()``, and so
    does each cp layout's faster ``cp_comm`` (``"a2a"`` appears there when chosen).
    ``layout_options`` are this function's keyword arguments: ``model`` (MoEGPT arguments or a
    :class:`ModelShape`), ``cluster`` (a cluster preset's keys or a :class:`Cluster`), ``seq_len``,
    ``global_batch_size``, ``micro_batch_size`` (the data module's; None stands for what the data
    modules make of None, :func:`~lightning_moe.layout.default_micro_batch_size`, so that
    layouts are ranked with the micro-batch that will run), ``precision`` (Lightning's string) and
    ``checkpointing`` (the run's activation checkpointing: the memory mode layouts must fit with, and
    ``overlap_ep_comm`` is offered only without it, as the strategy refuses it otherwise) and
    ``load_imbalance`` (the busiest ep rank's expert tokens over the mean; None: the planner's default).
    ``conf/parallel/auto.yaml`` fills them from the run's config.

    Example::

        best, runner_up = resolve_auto_layout(4, model=cfg.model, cluster=cpu_local, seq_len=128, global_batch_size=16)
        best.layout.strategy_kwargs()   # {"tp": 1, "cp": 1, "ep": 2, "dp": 2, "pp": 1, "etp": 1}
    """
    missing = [
        k
        for k, v in (
            ("model", model),
            ("cluster", cluster),
            ("seq_len", seq_len),
            ("global_batch_size", global_batch_size),
        )
        if v is None
    ]
    if missing:
        raise ValueError(
            f"layout='auto' needs layout_options {missing}: pass layout_options=dict(model=<MoEGPT arguments>,"
            " cluster=<cluster preset keys>, seq_len=..., global_batch_size=...) or use parallel=auto with the CLI"
        )
    shape = model if isinstance(model, ModelShape) else ModelShape.from_config(model, name="model")  # type: ignore[arg-type]
    machine = cluster if isinstance(cluster, Cluster) else Cluster.from_config(cluster)  # type: ignore[arg-type]
    if micro_batch_size is None:
        micro_batch_size = default_micro_batch_size(int(global_batch_size))  # type: ignore[arg-type]
    result = plan(
        world_size, shape, machine, seq_len=int(seq_len), global_batch_size=int(global_batch_size),  # type: ignore[arg-type]
        precision=_precision_of(precision), micro_batch_sizes=[int(micro_batch_size)], checkpointing=checkpointing,
        load_imbalance=load_imbalance,
    )  # fmt: skip
    if not result.ranked:
        smallest = result.rejected[0]
        raise ValueError(
            f"layout='auto': no layout of world_size={world_size} fits in memory ({smallest.layout.label()}: {smallest.reason});"
            " add devices, shrink the batch or the model"
        )
    return result.ranked[0], (result.ranked[1] if len(result.ranked) > 1 else None)

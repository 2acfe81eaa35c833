"""Layout truth, torch-free: the dim names, the groups of each view and the rules a layout's sizes obey.

Everything that reasons about a layout (``ParallelDims``, the strategy, the planner, comm
accounting, ``train.check_config``) reads it from here, so that a new dim or view is taught once.

Ranks vary fastest in tp and slowest in pp (Megatron's ``tp-cp-ep-dp-pp``: tp stays on a node's
fast links, pp crosses nodes); as a row-major mesh that is ``(pp, dp, ep, cp, tp)``. One mesh is
seen two ways: the dense view (attention, norms, embeddings) and the expert view (routed experts),
whose data-parallel group mixes dims on both sides of ep.

Parallel folding (Megatron's MoE Parallel Folding): the expert view's ep group may also span the
attention view's cp and tp ranks (``fold_ep``), so ep does not multiply the world size by all of
itself: 8 ranks run attention at tp8 and experts at ep8, the all-to-all inside tp's node.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

# The full mesh's dims, slowest-varying first (row-major DeviceMesh order).
MESH_DIMS: tuple[str, ...] = ("pp", "dp", "ep", "cp", "tp")
# The same dims fastest-varying first: the order sizes are written in (``tp*cp*ep*dp*pp``).
PARALLEL_DIMS: tuple[str, ...] = tuple(reversed(MESH_DIMS))
# A layout as a strategy takes it and summary.json records it: the five sizes and expert tensor parallel.
LAYOUT_KEYS: tuple[str, ...] = (*PARALLEL_DIMS, "etp")
# The dims whose sizes a layout states; dp takes the rest of the world (``world_size / tp*cp*ep*pp``).
NON_DP_DIMS: tuple[str, ...] = tuple(d for d in PARALLEL_DIMS if d != "dp")

# Dense-view groups beyond the single dims, as the mesh dims each spans (in mesh order).
DENSE_GROUPS: dict[str, tuple[str, ...]] = {
    "dp_ep": ("dp", "ep"),                # ranks that load different samples
    "dense_grad": ("dp", "ep", "cp"),     # gradient reduction of dense parameters
    "sequence": ("cp", "tp"),             # ranks that split the tokens of one micro-batch
    "token": ("dp", "ep", "cp", "tp"),    # every rank holding different tokens of one step
}  # fmt: skip

# The expert view as a mesh of its own, slowest first: expert data parallel, ep, expert tensor parallel.
EXPERT_MESH_DIMS: tuple[str, ...] = ("pp", "edp", "ep", "etp")
# HSDP (``data_parallel="hsdp"``): dp splits into replica groups (slower) of ``dp_shard`` ranks each,
# so the full mesh comes from a root with dp split in two; the expert view splits edp alike.
HSDP_MESH_DIMS: tuple[str, ...] = tuple(
    n for d in MESH_DIMS for n in (("dp_replicate", "dp_shard") if d == "dp" else (d,))
)
EXPERT_HSDP_MESH_DIMS: tuple[str, ...] = ("pp", "edp_replicate", "edp_shard", "ep", "etp")
# The full mesh with ep split by node, for two-stage dispatch: the ep ranks sharing a position in
# their nodes (one per node), then those of one node.
EP_NODE_MESH_DIMS: tuple[str, ...] = tuple(
    n for d in MESH_DIMS for n in (("ep_node", "ep_local") if d == "ep" else (d,))
)

# Pipeline schedules of two stages per rank placed in a V: rank r runs stages r and 2 pp - 1 - r, so
# the first and the last stage share rank 0 (DeepSeek's DualPipeV; zero-bubble ZB-V splits backward).
V_SCHEDULES: tuple[str, ...] = ("DualPipeV", "ZBVZeroBubble")

# Attention-view dims the expert ep group can fold over (ep already acts as dp for the dense view).
FOLDABLE_DIMS: tuple[str, ...] = ("cp", "tp")


def normalize_fold_ep(fold_ep: str | Sequence[str] | None) -> tuple[str, ...]:
    """``fold_ep`` as a tuple of mesh dims in mesh order: ``"tp"``, ``"cp,tp"``, ``["cp", "tp"]``;
    None, ``""`` or ``()`` for no folding. ``ValueError`` naming the fix for any other dim."""
    if fold_ep is None:
        return ()
    names = [n.strip() for n in fold_ep.split(",")] if isinstance(fold_ep, str) else [str(n) for n in fold_ep]
    names = [n for n in names if n]
    wrong = [n for n in names if n not in FOLDABLE_DIMS]
    if wrong or len(set(names)) != len(names):
        raise ValueError(
            f"fold_ep={fold_ep!r}: ep folds over the attention dims {list(FOLDABLE_DIMS)}, each once"
            " (dp ranks are ep's data-parallel peers already: raise ep instead of folding dp)"
        )
    return tuple(d for d in MESH_DIMS if d in names)


def fold_size(fold_ep: Sequence[str], tp: int = 1, cp: int = 1) -> int:
    """How many ranks of the attention view each ep group takes in: the product of the folded dims."""
    return math.prod({"tp": tp, "cp": cp}[d] for d in fold_ep)


def unfolded_ep(ep: int, fold_ep: Sequence[str] = (), tp: int = 1, cp: int = 1) -> int:
    """The part of ``ep`` on ranks of its own: the size of the mesh's ``ep`` dim (``ep`` when unfolded)."""
    return ep // fold_size(fold_ep, tp, cp)


def default_etp(tp: int, etp: int | None, fold_ep: Sequence[str] = ()) -> int:
    """``etp`` as given, else ``tp`` (experts split like attention), or 1 when ep folds over tp."""
    if etp is not None:
        return etp
    return 1 if "tp" in fold_ep else tp


def expert_tensor_parallel(tp: int, etp: int | None) -> bool:
    """Whether experts are split over the tp ranks (``etp`` left unset means ``etp = tp``)."""
    return etp is None or etp == tp


def experts_split_over_tp(tp: int, etp: int | None) -> bool:
    """Whether each expert's FFN dim is sharded over tp ranks: expert tensor parallel with tp > 1."""
    return expert_tensor_parallel(tp, etp) and tp > 1


def expert_group_spans(tp: int, etp: int | None, fold_ep: Sequence[str] = ()) -> dict[str, tuple[str, ...]]:
    """The expert view's groups as the full mesh's dims they span.

    ``ep`` spans the mesh's ep dim and the folded ones (``fold_ep``). ``edp`` takes in every other
    dim the experts are replicated over: dp and cp, and tp as well when the experts are not
    tensor-parallel (``etp = 1``), in which case ``etp`` spans no dim; nor does it when ep folds
    over tp.
    """
    fold = tuple(fold_ep)
    etp_spans = ("tp",) if expert_tensor_parallel(tp, etp) and "tp" not in fold else ()
    edp = tuple(d for d in ("dp", "cp", "tp") if d not in fold and d not in etp_spans)
    return {"edp": edp, "ep": tuple(d for d in MESH_DIMS if d == "ep" or d in fold), "etp": etp_spans}


def expert_view_order(tp: int, etp: int | None, fold_ep: Sequence[str] = ()) -> tuple[str, ...]:
    """The full mesh's dims reordered so that, read row-major, they give the ranks of
    ``(pp, edp, ep, etp)``: edp's dims, then ep's, then etp's."""
    spans = expert_group_spans(tp, etp, fold_ep)
    return ("pp", *spans["edp"], *spans["ep"], *spans["etp"])


def rank_coordinates(sizes: Mapping[str, int], rank: int) -> dict[str, int]:
    """``rank``'s coordinate on each mesh dim (``sizes``: each mesh dim's size), the mesh row-major."""
    coords: dict[str, int] = {}
    for dim in reversed(MESH_DIMS):
        coords[dim], rank = rank % sizes[dim], rank // sizes[dim]
    return coords


def spanned_ranks(sizes: Mapping[str, int], spans: Sequence[str], rank: int) -> list[int]:
    """Global ranks of ``rank``'s group over the mesh dims ``spans``, in the group's order (its dims
    row-major in mesh order, as a flattened DeviceMesh dim holds them)."""
    coords = rank_coordinates(sizes, rank)
    ranks = [0]
    for dim in MESH_DIMS:
        ranks = [r * sizes[dim] + c for r in ranks for c in (range(sizes[dim]) if dim in spans else [coords[dim]])]
    return ranks


# Groups whose traffic comm accounting charges to a dim: (mesh dims the group spans, the dim).
# Data-parallel gradient groups come first: a group that is also another dim's (ep alone makes
# dp x ep the ep ranks) carries FSDP's gradient reduction, which is dp traffic.
ACCOUNTED_GROUPS: tuple[tuple[tuple[str, ...], str], ...] = (
    (DENSE_GROUPS["dense_grad"], "dp"), (("dp", "cp"), "dp"), (DENSE_GROUPS["dp_ep"], "dp"),
    (DENSE_GROUPS["token"], "dp"), (("dp", "cp", "tp"), "dp"), (("dp",), "dp"), (("tp",), "tp"),
    (DENSE_GROUPS["sequence"], "cp"), (("cp",), "cp"), (("ep",), "ep"), (("ep", "tp"), "ep"), (("pp",), "pp"),
)  # fmt: skip
# Expert-view mesh dims and the dim their traffic is charged to; HSDP's qualifiers (``dp_shard``,
# ``edp_replicate``, as a group name splits into parts) stay with their dp.
ACCOUNTED_EXPERT_DIMS: dict[str, str] = {"edp": "dp", "etp": "tp", "replicate": "dp", "shard": "dp"}


def accounted_dim(spans: Sequence[str], sizes: Mapping[str, int]) -> str | None:
    """The dim comm accounting charges a mesh group's traffic to, from the dims it spans (either view's):
    ``dp`` when it includes dp or edp (gradient reduction), else its first dim of size > 1 (its first
    when all are 1). None when a name is none of the dims (a mesh of the user's own)."""
    dims = [ACCOUNTED_EXPERT_DIMS.get(d, d) for d in spans]
    if not all(d in PARALLEL_DIMS for d in dims):
        return None
    if "dp" in dims:
        return "dp"
    return next((d for d in dims if sizes.get(d, 1) > 1), dims[0])


def accounted_shared_dim(dims: Sequence[str], functional: bool) -> str:
    """The dim charged for a rank set that several :data:`ACCOUNTED_GROUPS` share (``dims`` in table
    order), as when a mesh dim spans every rank and reuses the default group: the first, which is
    FSDP's gradient reduction when dp is among them; a functional collective (DTensor's, which FSDP
    never issues) takes the first other than dp."""
    return next((d for d in dims if d != "dp"), dims[0]) if functional else dims[0]


def size_problems(
    tp: int = 1,
    cp: int = 1,
    ep: int = 1,
    dp: int = -1,
    pp: int = 1,
    etp: int | None = None,
    *,
    world_size: int | None = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    num_experts: int | None = None,
    expert_ffn_hidden_size: int | None = None,
    seq_len: int | None = None,
    global_batch_size: int | None = None,
    micro_batch_size: int = 1,
    pp_microbatches: int = 1,
    fold_ep: Sequence[str] = (),
) -> list[str]:
    """Why a layout's sizes do not fit (empty: they do), each problem naming its fix.

    ``dp=-1`` is inferred from ``world_size``; facts left at None are not checked.
    ``pp_microbatches`` counts only under pp > 1 (micro-batches one pipeline step runs).
    ``fold_ep``: the attention dims ep folds over (:func:`normalize_fold_ep`).

    Example::

        size_problems(ep=4, dp=1, world_size=4, num_experts=6)
        # ['num_experts 6 is not divisible by ep 4: choose ep dividing num_experts']
    """
    problems: list[str | None] = []
    etp = default_etp(tp, etp, fold_ep)
    if not expert_tensor_parallel(tp, etp) and etp != 1:
        problems.append(f"etp={etp} must be 1 or equal to tp={tp} (expert tensor parallel size)")
    problems.append(fold_problem(ep, fold_ep, tp, cp, etp))
    if problems[-1] is not None:
        return [problems[-1]]  # the other rules need the mesh's ep
    if world_size is not None:
        problems.append(world_size_problem(world_size, tp, cp, ep, dp, pp, fold_ep=fold_ep))
    for name, count in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if count is not None:
            problems.append(heads_problem(name, count, tp))
    if num_experts is not None:
        problems.append(experts_problem(num_experts, ep))
    if expert_ffn_hidden_size is not None:
        problems.append(expert_ffn_problem(expert_ffn_hidden_size, tp, etp))
    if seq_len is not None and cp > 1:
        problems.append(seq_len_problem(seq_len, cp))
    if global_batch_size is not None and dp != -1:
        dp_ep = dp * unfolded_ep(ep, fold_ep, tp, cp)
        problems.append(batch_problem(global_batch_size, micro_batch_size, dp_ep, pp_microbatches if pp > 1 else 1))
    return [problem for problem in problems if problem is not None]


# -- the one resolution of a requested layout ------------------------------------------------------------
# The arguments a layout is requested with, as the strategy, presets and verify take them.
LAYOUT_REQUEST_KEYS: tuple[str, ...] = (*LAYOUT_KEYS, "fold_ep", "data_parallel", "dp_replicate", "dp_shard")


class ResolvedLayout(NamedTuple):
    """Every size of a layout, resolved once by :func:`resolve_layout`: nothing left to infer (immutable).

    ``ep`` is the expert-parallel size (folded or not) and :attr:`mesh_ep` the mesh's ep dim;
    ``dp_replicate`` x ``dp_shard`` split dp under HSDP (``dp_replicate == 1`` otherwise).
    """

    tp: int
    cp: int
    ep: int
    dp: int
    pp: int
    etp: int
    fold_ep: tuple[str, ...] = ()
    dp_replicate: int = 1

    @property
    def mesh_ep(self) -> int:
        """The size of the mesh's ``ep`` dim: ``ep`` over the folded dims' product."""
        return unfolded_ep(self.ep, self.fold_ep, self.tp, self.cp)

    @property
    def dp_shard(self) -> int:
        """The dp ranks of one HSDP replica group (dp itself without HSDP)."""
        return self.dp // self.dp_replicate

    @property
    def hsdp(self) -> bool:
        return self.dp_replicate > 1

    @property
    def world_size(self) -> int:
        return math.prod(self.mesh_sizes.values())

    @property
    def dp_ep(self) -> int:
        """Ranks that load different samples: dp x the mesh's ep."""
        return self.dp * self.mesh_ep

    @property
    def mesh_sizes(self) -> dict[str, int]:
        """Each dim of the full ``(pp, dp, ep, cp, tp)`` mesh (``ep``: :attr:`mesh_ep`)."""
        sizes = {"tp": self.tp, "cp": self.cp, "ep": self.mesh_ep, "dp": self.dp, "pp": self.pp}
        return {d: sizes[d] for d in MESH_DIMS}

    def group_size(self, name: str) -> int:
        """A mesh dim's size, a dense group's (:data:`DENSE_GROUPS`) or an expert-view group's
        (``edp``, ``ep``, ``etp``): the product of the mesh dims it spans."""
        groups = {**expert_group_spans(self.tp, self.etp, self.fold_ep), **DENSE_GROUPS}
        sizes = self.mesh_sizes
        return sizes[name] if name in sizes else math.prod(sizes[d] for d in groups[name])

    def as_dict(self) -> dict[str, int]:
        """The layout as a strategy takes it and ``summary.json`` records it (:data:`LAYOUT_KEYS`)."""
        return {k: int(getattr(self, k)) for k in LAYOUT_KEYS}


def layout_request(arguments: Mapping[str, object]) -> dict[str, object]:
    """The entries of ``arguments`` (a strategy's keyword arguments, a ``parallel`` preset) that
    :func:`resolve_layout` takes."""
    return {k: arguments[k] for k in LAYOUT_REQUEST_KEYS if k in arguments}


def resolve_layout(
    world_size: int | None,
    *,
    tp: int = 1,
    cp: int = 1,
    ep: int = 1,
    dp: int | str | None = "auto",
    pp: int = 1,
    etp: int | None = None,
    fold_ep: str | Sequence[str] | None = None,
    data_parallel: str | None = None,
    dp_replicate: int | None = None,
    dp_shard: int | None = None,
) -> ResolvedLayout:
    """The one resolution of a requested layout: inferred dp, unfolded ep, default etp, folding and
    HSDP checked. ``ValueError`` naming the argument and the fix for sizes that do not fit.

    ``dp="auto"`` (or None, -1) takes the rest of ``world_size``; ``world_size=None`` needs dp
    given and returns the world the sizes make. ``data_parallel="hsdp"`` needs ``dp_replicate``
    and/or ``dp_shard``; another ``data_parallel`` refuses a split of dp; None takes the split as
    given.

    Example::

        resolve_layout(2, tp=2, ep=2, fold_ep="tp")     # tp2, ep2 over the same 2 ranks: dp 1, etp 1
        resolve_layout(8, ep=2, data_parallel="hsdp", dp_replicate=2).dp_shard   # 2
        resolve_layout(6, ep=4)   # ValueError: world_size 6 is not divisible by tp*cp*ep*pp = 1*1*4*1 = 4: ...
    """
    for name, value in (("tp", tp), ("cp", cp), ("ep", ep), ("pp", pp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an integer >= 1")
    if dp in ("auto", None, -1):
        dp = -1
    elif isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp={dp!r} must be an integer >= 1, or 'auto' to infer it from the world size")
    if etp is not None and (isinstance(etp, bool) or not isinstance(etp, int) or etp < 1):
        raise ValueError(f"etp={etp!r} must be an integer >= 1 (1 or tp), or None for its default")
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1):
        raise ValueError(f"world_size={world_size!r} must be an integer >= 1 (devices*num_nodes)")
    if world_size is None and dp == -1:
        raise ValueError("dp='auto' takes the rest of the world size: give the world size (devices*num_nodes) or dp")
    fold = normalize_fold_ep(fold_ep)
    problems = size_problems(tp, cp, ep, dp, pp, etp, world_size=world_size, fold_ep=fold)
    if problems:
        raise ValueError(problems[0])
    mesh_ep = unfolded_ep(ep, fold, tp, cp)
    if dp == -1:
        dp = world_size // (tp * cp * mesh_ep * pp)  # type: ignore[operator]
    replicate = _resolve_hsdp(int(dp), data_parallel, dp_replicate, dp_shard)
    return ResolvedLayout(
        tp=tp, cp=cp, ep=ep, dp=int(dp), pp=pp, etp=default_etp(tp, etp, fold), fold_ep=fold, dp_replicate=replicate
    )


def mesh_factorizations(world_size: int) -> list[dict[str, int]]:
    """Every full mesh of ``world_size`` ranks: each ``{tp, cp, ep, pp, dp}`` of mesh dim sizes
    (``ep``: the mesh's ep dim) whose product is ``world_size``, dp taking the rest; tp varies
    slowest in the list, then cp, ep and pp."""
    meshes = []
    for tp in _divisors(world_size):
        for cp in _divisors(world_size // tp):
            for ep in _divisors(world_size // (tp * cp)):
                for pp in _divisors(world_size // (tp * cp * ep)):
                    meshes.append({"tp": tp, "cp": cp, "ep": ep, "pp": pp, "dp": world_size // (tp * cp * ep * pp)})
    return meshes


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _resolve_hsdp(dp: int, data_parallel: str | None, dp_replicate: int | None, dp_shard: int | None) -> int:
    """HSDP's replica groups for ``dp`` ranks (1 without HSDP); ``ValueError`` naming the fix."""
    split = dp_replicate is not None or dp_shard is not None
    if data_parallel == "hsdp" or (data_parallel is None and split):
        problem = hsdp_problem(dp, dp_replicate, dp_shard)
        if problem:
            raise ValueError(problem)
        return hsdp_sizes(dp, dp_replicate, dp_shard)[0]
    if split and ((dp_replicate or 1) != 1 or (dp_shard is not None and dp_shard != dp)):
        raise ValueError(
            f"dp_replicate/dp_shard split dp for HSDP, but data_parallel={data_parallel!r} (dp_replicate={dp_replicate!r},"
            f" dp_shard={dp_shard!r}): set data_parallel='hsdp' or leave both unset"
        )
    return 1


# -- the rules, one a function: the problem naming its fix, None when the sizes obey it ------------------
# size_problems applies them all; runtime checks (on tensors, modules, loaders) apply one and raise it.


def world_size_problem(
    world_size: int, tp: int = 1, cp: int = 1, ep: int = 1, dp: int = -1, pp: int = 1, *, fold_ep: Sequence[str] = ()
) -> str | None:
    """``world_size = tp*cp*ep*dp*pp`` (``dp=-1``: inferred, so the other sizes must divide it); ep
    counts only its unfolded part (``ep/(tp*cp)`` for ``fold_ep=("cp", "tp")``)."""
    sizes = {"tp": tp, "cp": cp, "ep": unfolded_ep(ep, fold_ep, tp, cp), "dp": dp, "pp": pp}
    names = {"ep": f"(ep/{'*'.join(fold_ep)})"} if fold_ep else {}
    non_dp = math.prod(sizes[d] for d in NON_DP_DIMS)
    if dp == -1:
        if world_size % non_dp == 0:
            return None
        return (
            f"world_size {world_size} is not divisible by {_product(NON_DP_DIMS, sizes, names)} = {non_dp}:"
            " change devices/num_nodes or the parallel sizes"
        )
    product = non_dp * dp
    if product == world_size:
        return None
    return (
        f"world_size {world_size} != {_product(PARALLEL_DIMS, sizes, names)} = {product}:"
        f" set devices*num_nodes to {product} or change the parallel sizes"
    )


def _product(dims: Sequence[str], sizes: Mapping[str, int], names: Mapping[str, str] | None = None) -> str:
    """``tp*cp*ep*pp = 1*1*2*1``: the names of a product (``names`` replaces some) and its factors."""
    names = names or {}
    return f"{'*'.join(names.get(d, d) for d in dims)} = {'*'.join(str(sizes[d]) for d in dims)}"


def hsdp_problem(dp: int, dp_replicate: int | None = None, dp_shard: int | None = None) -> str | None:
    """HSDP splits dp into ``dp_replicate`` replica groups of ``dp_shard`` ranks (either may be left
    out and follows from dp): the two multiply to dp."""
    for name, value in (("dp_replicate", dp_replicate), ("dp_shard", dp_shard)):
        if value is not None and (not isinstance(value, int) or value < 1):
            return f"{name}={value!r} must be a positive integer (HSDP: dp = dp_replicate*dp_shard)"
    if dp_replicate is None and dp_shard is None:
        return "data_parallel='hsdp' needs dp_replicate or dp_shard (dp = dp_replicate*dp_shard), e.g. dp_replicate=2"
    replicate = dp_replicate if dp_replicate is not None else dp // dp_shard
    shard = dp_shard if dp_shard is not None else dp // replicate
    if replicate * shard != dp:
        return (
            f"dp_replicate*dp_shard = {dp_replicate}*{dp_shard} != dp = {dp}: HSDP splits dp into replica groups;"
            " choose sizes whose product is dp"
        )
    return None


def hsdp_sizes(dp: int, dp_replicate: int | None = None, dp_shard: int | None = None) -> tuple[int, int]:
    """``(dp_replicate, dp_shard)`` with the one left out filled in (:func:`hsdp_problem` must pass)."""
    replicate = dp_replicate if dp_replicate is not None else dp // dp_shard  # type: ignore[operator]
    return replicate, dp // replicate


def fold_problem(ep: int, fold_ep: Sequence[str], tp: int = 1, cp: int = 1, etp: int | None = None) -> str | None:
    """Folding ep over attention dims: each ep group takes in whole groups of the folded dims (their
    product divides ep), and folded tp ranks hold different experts, so none is split over tp."""
    if not fold_ep:
        return None
    folded = fold_size(fold_ep, tp, cp)
    if ep % folded:
        sizes = {"tp": tp, "cp": cp}
        return (
            f"ep={ep} is not divisible by the folded {_product(fold_ep, sizes)} = {folded} (fold_ep={list(fold_ep)}):"
            f" choose ep as a multiple of {folded} or fold fewer dims"
        )
    if "tp" in fold_ep and tp > 1 and default_etp(tp, etp, fold_ep) != 1:
        return (
            f"etp={etp} with ep folded over tp: the tp ranks hold different experts, so set etp=1 (or leave it unset)"
        )
    return None


def heads_problem(name: str, count: int, tp: int, *, owner: str | None = None) -> str | None:
    """Attention heads (``name``: ``num_heads``, ``num_kv_heads``) split evenly over tp; ``owner``,
    the module holding the count, prefixes the message (``owner.num_heads=...``)."""
    if count % tp == 0:
        return None
    label = name if owner is None else f"{owner}.{name}"
    return f"{label}={count} is not divisible by tp={tp}: choose tp dividing {name}"


def stage_layers_problem(
    stage_layers: Sequence[int] | None, num_stages: int, num_layers: int | None = None
) -> str | None:
    """What is wrong with ``stage_layers`` (``pp_stage_layers``: blocks per stage, in stage order) for
    ``num_stages`` (``pp * pp_stages_per_rank``) stages and, when given, ``num_layers`` blocks, with the
    fix; None when nothing is (or when it is None: an even split). Every stage runs at least one block."""
    if stage_layers is None:
        return None
    counts = list(stage_layers)
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in counts):
        return f"pp_stage_layers={counts} must list whole numbers of layers, one per pipeline stage"
    if len(counts) != num_stages:
        return (
            f"pp_stage_layers={counts} lists {len(counts)} stages, the pipeline has pp*pp_stages_per_rank ="
            f" {num_stages}: give one layer count per stage, in stage order"
        )
    if min(counts) < 1:
        return (
            f"pp_stage_layers={counts} leaves a stage without layers: every stage of the schedule runs at least one"
            " layer; move a layer to it"
        )
    if num_layers is not None and sum(counts) != num_layers:
        return (
            f"pp_stage_layers={counts} adds up to {sum(counts)} layers, the model has {num_layers}: make the counts"
            f" add up to {num_layers}"
        )
    return None


def stage_slices(stage_layers: Sequence[int]) -> list[slice]:
    """The blocks of each stage as slices of the block list: ``[1, 3]`` gives ``[0:1]`` and ``[1:4]``."""
    ends = [sum(stage_layers[: s + 1]) for s in range(len(stage_layers))]
    return [slice(end - count, end) for end, count in zip(ends, stage_layers)]


def ulysses_heads_problem(heads: int, kv_heads: int, cp: int) -> str | None:
    """All-to-all (Ulysses) context parallelism (``cp_comm="a2a"``) gives each of the ``cp`` ranks
    ``heads / cp`` whole query heads of the ``heads`` (and ``kv_heads`` key/value heads) one tp rank
    holds: the query heads are a multiple of the key/value heads, and cp divides them."""
    if heads < 1 or kv_heads < 1 or heads % kv_heads:
        return f"{heads} query heads are not a multiple of {kv_heads} key/value heads"
    if heads % cp:
        return (
            f"all-to-all (Ulysses) context parallelism splits the {heads} query heads of a tp rank over"
            f" cp = {cp} ranks, and {cp} does not divide {heads}: use cp dividing the heads, or cp_comm='ring'"
        )
    return None


def ulysses_kv_heads(heads: int, kv_heads: int, cp: int) -> int:
    """The key/value heads whose K and V travel under all-to-all context parallelism: ``kv_heads``
    repeated ``cp / gcd(kv_heads, cp)`` times, a multiple of cp (fewer K/V heads than cp ranks are
    repeated up to whole heads per rank); ``ValueError`` where :func:`ulysses_heads_problem` objects.

    Example::

        ulysses_kv_heads(8, 2, 4)   # 4: each K/V head twice, one per rank
        ulysses_kv_heads(8, 8, 4)   # 8: nothing repeated
    """
    problem = ulysses_heads_problem(heads, kv_heads, cp)
    if problem:
        raise ValueError(problem)
    return kv_heads * (cp // math.gcd(kv_heads, cp))


def ulysses_bytes_per_rank(
    batch: int, heads_q: int, heads_kv: int, seq_len: int, head_dim: int, cp: int, dtype_bytes: int
) -> int:
    """Bytes one rank sends to its cp peers in the forward of one attention call.

    Q, K and V go in (K/V after the repeat of :func:`ulysses_kv_heads`) and the output comes back:
    of each local ``[batch, heads, seq_len / cp, head_dim]`` tensor the ``(cp - 1) / cp`` addressed
    to other ranks. The backward sends as much again (dO in, dQ, dK, dV back). ``seq_len`` is the
    full sequence; 0 for cp = 1.

    Example::

        ulysses_bytes_per_rank(1, 8, 2, 4096, 128, cp=4, dtype_bytes=2)   # 3/4 of (8+4+4+8) * 1024 * 128 * 2
    """
    if cp <= 1:
        return 0
    if seq_len % cp:
        raise ValueError(f"seq_len {seq_len} is not divisible by cp = {cp}")
    kv = ulysses_kv_heads(heads_q, heads_kv, cp)
    per_peer = batch * (2 * heads_q + 2 * kv) // cp * (seq_len // cp) * head_dim * dtype_bytes
    return per_peer * (cp - 1)


def experts_problem(num_experts: int, ep: int) -> str | None:
    """Each ep rank holds ``num_experts / ep`` experts."""
    if num_experts % ep == 0:
        return None
    return f"num_experts {num_experts} is not divisible by ep {ep}: choose ep dividing num_experts"


def expert_ffn_problem(ffn_hidden_size: int, tp: int, etp: int | None) -> str | None:
    """Under expert tensor parallel (``etp = tp > 1``) each expert's FFN dim splits over tp."""
    if not experts_split_over_tp(tp, etp) or ffn_hidden_size % tp == 0:
        return None
    return f"expert ffn_hidden_size {ffn_hidden_size} is not divisible by etp={tp}: choose etp=1 or a divisible size"


def cp_chunks(cp: int, cp_layout: str = "zigzag") -> int:
    """How many equal chunks context parallelism cuts a sequence into: ``2*cp`` under zigzag (each
    rank takes one from either end, balancing causal attention's work), ``cp`` when contiguous."""
    return 2 * cp if cp_layout == "zigzag" else cp


def seq_len_problem(seq_len: int, cp: int, cp_layout: str = "zigzag") -> str | None:
    """The sequence splits into :func:`cp_chunks` equal chunks."""
    chunks = cp_chunks(cp, cp_layout)
    if seq_len % chunks == 0:
        return None
    factor = "2*cp" if cp_layout == "zigzag" else "cp"
    return (
        f"seq_len {seq_len} not divisible by {factor} = {chunks}: {cp_layout} context parallelism with "
        f"cp = {cp} needs seq_len % {chunks} == 0; pad or crop the sequence"
    )


def sequence_split_problem(local_seq_len: int, tp: int) -> str | None:
    """The tokens of one cp rank (``seq_len / cp``) split over tp: sequence parallelism shards them,
    and MoE layers give each tp rank 1/tp of tokens replicated over tp (no token dispatched twice)."""
    if local_seq_len % tp == 0:
        return None
    return (
        f"seq_len/cp={local_seq_len} is not divisible by tp={tp} (sequence parallelism and the MoE layers split"
        " a cp rank's tokens over tp): choose seq_len divisible by cp*tp"
    )


def batch_problem(
    global_batch_size: int, micro_batch_size: int, dp_ep: int, pp_microbatches: int = 1, *, default: bool = False
) -> str | None:
    """An optimizer step's samples fill whole micro-batches on every data-parallel rank (``dp_ep``:
    dp x ep) and, when one pipeline step runs ``pp_microbatches`` > 1 of them, whole pipeline steps.
    ``default``: ``micro_batch_size`` is the default, not the user's (the message says so)."""
    factors = {"micro_batch_size": micro_batch_size, "dp_ep": dp_ep}
    if pp_microbatches > 1:
        factors["pp_microbatches"] = pp_microbatches
    per_step = math.prod(factors.values())
    if global_batch_size % per_step == 0:
        return None
    which = f" (the default, {micro_batch_size} on every layout)" if default else ""
    return (
        f"global_batch_size {global_batch_size} not divisible by {_product(list(factors), factors)} = {per_step}"
        f"{which}: make global_batch_size a multiple of {per_step} or change micro_batch_size"
    )


# -- batches ---------------------------------------------------------------------------------------------
DEFAULT_MICRO_BATCH_SIZE = 2


def default_micro_batch_size(global_batch_size: int) -> int:
    """The micro-batch `micro_batch_size=None` stands for: 2 samples per rank (1 if the global batch is odd).

    It depends on the global batch alone, never on the layout: batch-level router statistics
    (the Switch aux loss, capacity, sinkhorn, expert choice) are computed per micro-batch, so a
    layout-dependent default would change the losses with the layout.
    """
    return math.gcd(global_batch_size, DEFAULT_MICRO_BATCH_SIZE)


def resolve_batch_layout(
    global_batch_size: int, micro_batch_size: int | None, num_replicas: int, microbatches_per_step: int = 1
) -> tuple[int, int]:
    """Check a batch layout and return `(micro_batch_size, accumulate_grad_batches)`.

    `num_replicas` is the data-parallel size `dp_ep` (dp x ep). `microbatches_per_step` is the
    number of loader batches one training step consumes together (`pp_microbatches` under pipeline
    parallelism, the step engine's `loader_batches_per_step`): the accumulation count must be a
    multiple of it. `micro_batch_size=None` means `default_micro_batch_size(global_batch_size)`,
    the same on every layout.

    >>> resolve_batch_layout(16, 4, 2)
    (4, 2)
    >>> resolve_batch_layout(16, None, 2, microbatches_per_step=2)
    (2, 4)
    """
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if microbatches_per_step < 1:
        raise ValueError(f"microbatches_per_step must be >= 1, got {microbatches_per_step}")
    default = micro_batch_size is None
    if default:
        micro_batch_size = default_micro_batch_size(global_batch_size)
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1 or None, got {micro_batch_size}")
    problem = batch_problem(global_batch_size, micro_batch_size, num_replicas, microbatches_per_step, default=default)
    if problem:
        raise ValueError(problem)
    return micro_batch_size, global_batch_size // (micro_batch_size * num_replicas)

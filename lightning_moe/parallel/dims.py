"""The five parallel dimensions and the two views (dense, expert) of one DeviceMesh."""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightning_moe._compat import flatten_mesh, slice_flattened
from lightning_moe.layout import (
    DENSE_GROUPS,
    EP_NODE_MESH_DIMS,
    EXPERT_HSDP_MESH_DIMS,
    EXPERT_MESH_DIMS,
    HSDP_MESH_DIMS,
    LAYOUT_KEYS,
    MESH_DIMS,
    NON_DP_DIMS,
    ResolvedLayout,
    default_etp,
    expert_group_spans,
    expert_view_order,
    normalize_fold_ep,
    resolve_layout,
    size_problems,
    unfolded_ep,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

MESH_DIM_NAMES: tuple[str, ...] = MESH_DIMS  # the public name (lightning_moe.parallel) of the full mesh's dims

# The meshes this process built, by layout, with the default process group they were built in. A later
# Trainer or fit of the same layout in the same process (a notebook, fit then test, a sweep's jobs in one
# process) takes them again: every new process group keeps gloo threads for the life of the process, and a
# layout creates about thirty.
_BUILT_MESHES: dict[str, tuple[Any, dict[str, Any]]] = {}
# What build_mesh leaves on a ParallelDims: the full mesh, the HSDP root, the flattened sub-meshes (cached).
_MESH_STATE = ("_mesh", "_hsdp_root")
_SUB_MESHES = (
    "dp_ep_mesh",
    "dense_grad_mesh",
    "token_mesh",
    "sequence_mesh",
    "expert_root_mesh",
    "ep_node_mesh",
    "edp_mesh",
    "dense_fsdp_mesh",
    "token_fsdp_mesh",
)


@dataclass
class ParallelDims:
    """Sizes of the tensor, context, expert, data and pipeline parallel dimensions.

    ``world_size = tp * cp * ep * dp * pp``; ranks vary fastest in tp and slowest in pp (Megatron's
    ``tp-cp-ep-dp-pp`` order), so the mesh is ``(pp, dp, ep, cp, tp)``. ``dp=-1`` is inferred from
    the world size; ``etp=None`` means expert tensor parallel equals ``tp``.

    Example::

        dims = ParallelDims(ep=2)
        dims.validate(world_size=4)          # dp becomes 2
        mesh = dims.build_mesh("cpu")        # after torch.distributed.init_process_group
        dims.dp_ep_mesh.size()               # 4: ranks that load different samples

    Nodes (``ranks_per_node``, default: ``$LOCAL_WORLD_SIZE`` when a launcher sets it, else every
    rank on one node): global ranks ``[n * ranks_per_node, (n + 1) * ranks_per_node)`` share node
    ``n``. Setting it smaller simulates several nodes on one machine: ``ParallelDims(ep=4,
    ranks_per_node=2)`` puts ep ranks 0-1 on one node and 2-3 on another. Because tp and then cp
    vary fastest, they stay inside a node where they fit (a warning says when tp crosses one).
    ``ep_node_ids`` (no process group needed) gives each ep rank's node, ``ep_num_nodes`` their
    number and ``ep_ranks_per_node`` the ep ranks sharing one; ``ep_node_mesh`` splits ``ep`` into
    ``("ep_node", "ep_local")`` for two-stage dispatch.

    Parallel folding: ``fold_ep=("tp",)`` (or ``"cp,tp"``) lets the expert view's ep group span the
    attention view's tp (and cp) ranks as well, so ``ParallelDims(tp=2, ep=2, fold_ep="tp")`` runs
    on 2 ranks: attention at tp2, experts at ep2 over the same ranks. ``ep`` is the expert-parallel
    size either way; the mesh's ``ep`` dim holds its unfolded part (:attr:`mesh_ep`), and the
    world size is ``tp*cp*mesh_ep*dp*pp``. Folded tp ranks hold different experts (``etp = 1``).

    HSDP: ``dp_replicate > 1`` splits dp into that many replica groups of ``dp / dp_replicate``
    ranks (replicas vary slower, so a shard group stays on a node). :attr:`dense_fsdp_mesh`,
    :attr:`token_fsdp_mesh` and :attr:`edp_fsdp_mesh` are then 2-D ``(replicate, shard)`` meshes,
    FSDP2's HSDP form, with one root shared with the tp mesh.
    """

    tp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = -1
    pp: int = 1
    etp: int | None = None
    ranks_per_node: int | None = None
    fold_ep: tuple[str, ...] | str | None = ()
    dp_replicate: int = 1
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)
    _hsdp_root: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in NON_DP_DIMS:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if not isinstance(self.dp, int) or (self.dp < 1 and self.dp != -1):
            raise ValueError(f"dp={self.dp!r} must be an integer >= 1, or -1 to infer it from the world size")
        if not isinstance(self.dp_replicate, int) or self.dp_replicate < 1:
            raise ValueError(f"dp_replicate={self.dp_replicate!r} must be an integer >= 1 (HSDP replica groups)")
        self.fold_ep = normalize_fold_ep(self.fold_ep)
        self.etp = default_etp(self.tp, self.etp, self.fold_ep)
        self._raise_size_problems()
        if self.ranks_per_node is not None and (not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1):
            raise ValueError(
                f"ranks_per_node={self.ranks_per_node!r} must be an integer >= 1 (or None: devices per node)"
            )

    @property
    def mesh_ep(self) -> int:
        """The size of the mesh's ``ep`` dim: ``ep`` over the folded dims' product (``ep`` when unfolded).
        With dp, it splits the samples of a step."""
        return unfolded_ep(self.ep, self.fold_ep, self.tp, self.cp)

    def mesh_size(self, dim: str) -> int:
        """The size of one dim of the full ``(pp, dp, ep, cp, tp)`` mesh, or of HSDP's ``dp_replicate``/``dp_shard``."""
        return self.mesh_ep if dim == "ep" else getattr(self, dim)

    @property
    def non_dp_size(self) -> int:
        return self.tp * self.cp * self.mesh_ep * self.pp

    def _raise_size_problems(self, world_size: int | None = None) -> None:
        """``ValueError`` with the first of :func:`lightning_moe.layout.size_problems` for these sizes."""
        problems = size_problems(
            self.tp, self.cp, self.ep, self.dp, self.pp, self.etp, world_size=world_size, fold_ep=self.fold_ep
        )
        if problems:
            raise ValueError(problems[0])

    def validate(self, world_size: int) -> None:
        """Infer ``dp`` if needed and check that the product of the sizes equals ``world_size``
        (:func:`lightning_moe.layout.resolve_layout`)."""
        if self.dp_replicate > 1 and self.dp != -1 and self.dp % self.dp_replicate:
            raise ValueError(
                f"dp_replicate={self.dp_replicate} does not divide dp={self.dp}: HSDP splits dp into replica groups"
                " of equal size; choose a divisor of dp"
            )
        self.apply(resolve_layout(world_size, **self.requested()))

    def requested(self) -> dict[str, Any]:
        """These sizes as :func:`~lightning_moe.layout.resolve_layout` takes them."""
        replicate = {"dp_replicate": self.dp_replicate} if self.dp_replicate > 1 else {}
        return {
            "tp": self.tp,
            "cp": self.cp,
            "ep": self.ep,
            "dp": self.dp,
            "pp": self.pp,
            "etp": self.etp,
            "fold_ep": self.fold_ep,
            **replicate,
        }

    def apply(self, layout: ResolvedLayout) -> None:
        """Take the sizes of a resolved layout (dp inferred, HSDP's replica groups)."""
        self.tp, self.cp, self.ep, self.dp, self.pp = layout.tp, layout.cp, layout.ep, layout.dp, layout.pp
        self.etp, self.fold_ep, self.dp_replicate = layout.etp, layout.fold_ep, layout.dp_replicate
        self._check_nodes()

    @property
    def world_size(self) -> int:
        return self.non_dp_size * self.dp

    @property
    def dp_shard(self) -> int:
        """Ranks of one HSDP shard group along dp (dp itself without HSDP)."""
        return self.dp // self.dp_replicate

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.mesh_size(d) for d in MESH_DIMS)

    def _ranks_in_order(self, order: tuple[str, ...]) -> torch.Tensor:
        """Global ranks in the full mesh, its dims permuted to ``order`` (a permutation of the mesh dims)."""
        ranks = torch.arange(self.world_size).view(self.shape)
        return ranks.permute(*(MESH_DIMS.index(d) for d in order))

    # -- nodes ------------------------------------------------------------------------------------
    @property
    def node_size(self) -> int:
        """Ranks per node: ``ranks_per_node``, else ``$LOCAL_WORLD_SIZE``, else the whole world (one node)."""
        if self.ranks_per_node is not None:
            return self.ranks_per_node
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if local and local.isdigit() and int(local) > 0 and self.dp != -1 and self.world_size % int(local) == 0:
            return int(local)
        return self.world_size if self.dp != -1 else self.non_dp_size

    def _ep_group_ranks(self) -> torch.Tensor:
        """``[groups, ep]``: the global ranks of every ep group, one row per coordinate of the dims
        outside it (all but ep, and the folded dims)."""
        spans = expert_group_spans(self.tp, self.etp, self.fold_ep)["ep"]
        return self._ranks_in_order((*(d for d in MESH_DIMS if d not in spans), *spans)).reshape(-1, self.ep)

    def _check_nodes(self) -> None:
        """``ranks_per_node`` divides the world size, every ep group splits into equal node blocks, and
        a warning when tp crosses a node boundary (its collectives then leave the fast links)."""
        if self.ranks_per_node is None:
            return
        size = self.ranks_per_node
        if self.world_size % size:
            raise ValueError(
                f"ranks_per_node={size} does not divide the world size {self.world_size}: choose a divisor of it "
                "(the devices per node of a real cluster)"
            )
        if self.tp > 1 and (self.tp > size or size % self.tp):
            warnings.warn(
                f"tp={self.tp} crosses a node boundary (ranks_per_node={size}): tensor-parallel collectives leave the"
                " node; choose tp dividing ranks_per_node",
                stacklevel=3,
            )

    @property
    def ep_rank_nodes(self) -> list[int]:
        """This rank's ep group: the node of each ep rank, numbered 0, 1, ... in ep order (any split).

        What inter-node byte counting needs; :attr:`ep_node_ids` also checks the split is even.
        """
        if self.dp == -1:
            raise RuntimeError("ParallelDims.validate(world_size) must run before the node layout is known")
        rows = self._ep_group_ranks()
        row = rows[0]
        if dist.is_available() and dist.is_initialized() and self.world_size == dist.get_world_size():
            me = dist.get_rank()
            row = next(r for r in rows if me in r.tolist())
        nodes = (row // self.node_size).tolist()
        relabel = {node: i for i, node in enumerate(dict.fromkeys(nodes))}
        return [relabel[n] for n in nodes]

    @property
    def ep_node_ids(self) -> list[int]:
        """Node of each ep rank (0, 1, ... in ep order), the same for every ep group. No process group needed.

        Raises ``ValueError`` when the ep ranks do not split into equal contiguous blocks per node
        (node-limited routing and the hierarchical dispatcher need that).
        """
        if self.dp == -1:
            raise RuntimeError("ParallelDims.validate(world_size) must run before the node layout is known")
        size = self.node_size
        patterns = set()
        for row in self._ep_group_ranks():
            nodes = (row // size).tolist()
            relabel = {node: i for i, node in enumerate(dict.fromkeys(nodes))}
            patterns.add(tuple(relabel[n] for n in nodes))
        ids = patterns.pop()
        num = max(ids) + 1
        per = self.ep // num
        if patterns or self.ep % num or list(ids) != [i // per for i in range(self.ep)]:
            raise ValueError(
                f"ep={self.ep} ranks do not split evenly over nodes of {size} ranks (tp*cp={self.tp * self.cp}): "
                "choose ranks_per_node as a multiple of tp*cp that divides tp*cp*ep, or a divisor of tp*cp"
            )
        return list(ids)

    @property
    def ep_num_nodes(self) -> int:
        """Nodes one ep group spans (1: every ep rank shares a node)."""
        return max(self.ep_node_ids) + 1

    @property
    def ep_ranks_per_node(self) -> int:
        """Ep ranks of one group on each node."""
        return self.ep // self.ep_num_nodes

    # -- mesh -------------------------------------------------------------------------------------
    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Build the full ``(pp, dp, ep, cp, tp)`` DeviceMesh (process group must be initialised). A second
        build of the same sizes in the same process and default group takes the first one's meshes."""
        from torch.distributed.device_mesh import init_device_mesh

        if self.dp == -1:
            self.validate(dist.get_world_size())
        sizes = tuple(getattr(self, f.name) for f in fields(self) if f.compare)
        key = repr((device_type, dist.get_world_size(), self.node_size, normalize_fold_ep(self.fold_ep), sizes))
        built = _BUILT_MESHES.get(key)
        if built is not None and built[0] is dist.group.WORLD:
            self.__dict__.update(built[1])
            return self.mesh
        if self.dp_replicate > 1:
            # One root for the full mesh and the HSDP meshes: FSDP2 needs it with tensor parallelism.
            shape = tuple(self.mesh_size(d) for d in HSDP_MESH_DIMS)
            root = init_device_mesh(device_type, shape, mesh_dim_names=HSDP_MESH_DIMS)
            flatten_mesh(root[("dp_replicate", "dp_shard")], "dp")
            mesh = slice_flattened(root, MESH_DIM_NAMES)
        else:
            root, mesh = None, init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_DIM_NAMES)
        self.attach(mesh)
        self._hsdp_root = root
        # Every rank creates every sub-mesh now, in one order: a pipeline stage without MoE layers
        # would otherwise skip the expert groups, and the groups created later would pair up wrong
        # ranks (a hang in the next new_group, e.g. in a second trainer.fit/validate).
        names = ["dp_ep_mesh", "dense_grad_mesh", "sequence_mesh", "token_mesh", "expert_root_mesh", "edp_mesh"]
        if self.dp_replicate > 1:
            names += ["dense_fsdp_mesh", "token_fsdp_mesh"]
        for name in names + (["ep_node_mesh"] if self.ep_num_nodes > 1 else []):
            getattr(self, name)
        meshes = {name: value for name, value in self.__dict__.items() if name in (*_MESH_STATE, *_SUB_MESHES)}
        _BUILT_MESHES[key] = (dist.group.WORLD, meshes)
        return mesh

    def attach(self, mesh: DeviceMesh) -> None:
        """Use an existing full mesh (its shape must match these sizes)."""
        if tuple(mesh.mesh_dim_names or ()) != MESH_DIM_NAMES or tuple(mesh.shape) != self.shape:
            raise ValueError(
                f"mesh {tuple(mesh.mesh_dim_names or ())} of shape {tuple(mesh.shape)} does not match "
                f"ParallelDims {MESH_DIM_NAMES} = {self.shape}"
            )
        self._mesh = mesh
        for name in _SUB_MESHES:
            self.__dict__.pop(name, None)
        self._hsdp_root = None

    @property
    def mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("ParallelDims.build_mesh(device_type) must run before the meshes are used")
        return self._mesh

    def _dense_group_mesh(self, group: str) -> DeviceMesh:
        """The dense view's ``group`` (:data:`lightning_moe.layout.DENSE_GROUPS`) as one flattened mesh dim,
        named after the dims it spans (comm accounting reads the name)."""
        spans = DENSE_GROUPS[group]
        return flatten_mesh(self.mesh[spans], "_".join(spans))

    # Dense view -----------------------------------------------------------------------------------
    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def cp_mesh(self) -> DeviceMesh:
        return self.mesh["cp"]

    @property
    def pp_mesh(self) -> DeviceMesh:
        return self.mesh["pp"]

    @cached_property
    def dp_ep_mesh(self) -> DeviceMesh:
        """Ranks that load different samples (dp x ep)."""
        return self._dense_group_mesh("dp_ep")

    @cached_property
    def dense_grad_mesh(self) -> DeviceMesh:
        """Gradient reduction of dense parameters: dp x ep x cp."""
        return self._dense_group_mesh("dense_grad")

    def _fsdp_mesh(self, group: str) -> DeviceMesh:
        """The dense view's ``group`` as FSDP2 wraps it: the flat group, or under HSDP the 2-D
        ``(dp_replicate, dp_shard x the group's other dims)`` mesh."""
        if self.dp_replicate == 1:
            return self._dense_group_mesh(group)
        if self._hsdp_root is None:
            raise RuntimeError("HSDP meshes need the mesh of ParallelDims.build_mesh (dp_replicate > 1)")
        spans = ("dp_shard", *(d for d in DENSE_GROUPS[group] if d != "dp"))
        shard = spans[0] if len(spans) == 1 else "_".join(spans)
        if len(spans) > 1:
            flatten_mesh(self._hsdp_root[spans], shard)
        return slice_flattened(self._hsdp_root, ("dp_replicate", shard))

    @cached_property
    def dense_fsdp_mesh(self) -> DeviceMesh:
        """The mesh FSDP2 wraps dense parameters with: :attr:`dense_grad_mesh`, 2-D under HSDP."""
        return self._fsdp_mesh("dense_grad")

    @cached_property
    def token_fsdp_mesh(self) -> DeviceMesh:
        """The mesh FSDP2 wraps the router and shared expert with under tp: :attr:`token_mesh`, 2-D under HSDP."""
        return self._fsdp_mesh("token")

    @cached_property
    def sequence_mesh(self) -> DeviceMesh:
        """Ranks that split the tokens of one micro-batch: cp x tp (tp ranks hold sequence shards)."""
        return self._dense_group_mesh("sequence")

    @cached_property
    def token_mesh(self) -> DeviceMesh:
        """Every rank holding different tokens of one optimizer step: dp x ep x cp x tp.

        Parameters replicated over tp that see only their rank's tokens (the router) reduce here.
        """
        return self._dense_group_mesh("token")

    # Expert view ----------------------------------------------------------------------------------
    @property
    def ep_mesh(self) -> DeviceMesh:
        """The ranks sharing a token all-to-all: the mesh's ep dim, or the expert view's when ep is folded."""
        return self.expert_root_mesh["ep"] if self.fold_ep else self.mesh["ep"]

    @cached_property
    def expert_root_mesh(self) -> DeviceMesh:
        """The same ranks as ``(pp, edp, ep, etp)``: the expert view as a mesh of its own (collective).

        Expert data parallel mixes dims on both sides of ``ep`` in the full mesh (cp, and tp when
        etp = 1), which no slice of it can express; FSDP needs the expert weights' mesh and its
        data-parallel mesh to be dims of one root in ascending order, so the view gets its own root.
        """
        from torch.distributed.device_mesh import DeviceMesh

        spans = expert_group_spans(self.tp, self.etp, self.fold_ep)  # pp, not among them, is a dim of both views
        shape = [math.prod(self.mesh_size(d) for d in spans.get(name, (name,))) for name in EXPERT_MESH_DIMS]
        names = EXPERT_MESH_DIMS
        if self.dp_replicate > 1:
            # dp is edp's slowest dim, so its replica groups split edp the same way.
            shape[1:2] = [self.dp_replicate, shape[1] // self.dp_replicate]
            names = EXPERT_HSDP_MESH_DIMS
        ranks = self._ranks_in_order(expert_view_order(self.tp, self.etp, self.fold_ep)).reshape(shape)
        return DeviceMesh(self.mesh.device_type, ranks, mesh_dim_names=names)

    @property
    def expert_mesh(self) -> DeviceMesh:
        """The mesh expert weights are DTensors on: ``(ep, etp)``."""
        return self.expert_root_mesh["ep", "etp"]

    @property
    def etp_mesh(self) -> DeviceMesh:
        """Expert tensor parallel: the tp ranks when ``etp == tp``, else one rank."""
        return self.expert_root_mesh["etp"]

    @cached_property
    def edp_mesh(self) -> DeviceMesh:
        """Expert data parallel: dp x cp, and tp too when experts are not tensor-parallel (etp=1)."""
        if self.dp_replicate > 1:
            return flatten_mesh(self.expert_root_mesh[("edp_replicate", "edp_shard")], "edp")
        return self.expert_root_mesh["edp"]

    @property
    def edp_fsdp_mesh(self) -> DeviceMesh:
        """The mesh FSDP2 wraps expert parameters with: :attr:`edp_mesh`, 2-D ``(edp_replicate, edp_shard)`` under HSDP."""
        if self.dp_replicate > 1:
            return self.expert_root_mesh[("edp_replicate", "edp_shard")]
        return self.edp_mesh

    @cached_property
    def ep_node_mesh(self) -> DeviceMesh:
        """``(pp, dp, ep_node, ep_local, cp, tp)`` over the same ranks (collective: every rank builds it).

        ``ep_node``: the ep ranks with the same position inside their node, one per node (stage 1 of
        the hierarchical dispatch); ``ep_local``: the ep ranks of this rank's node (stage 2).
        """
        from torch.distributed.device_mesh import DeviceMesh

        nodes, local = self.ep_num_nodes, self.ep_ranks_per_node
        sizes = {"ep_node": nodes, "ep_local": local}
        ranks = torch.arange(self.world_size).view(*(sizes.get(d) or self.mesh_size(d) for d in EP_NODE_MESH_DIMS))
        return DeviceMesh(self.mesh.device_type, ranks, mesh_dim_names=EP_NODE_MESH_DIMS)

    # Process groups -------------------------------------------------------------------------------
    @property
    def dp_ep_group(self) -> dist.ProcessGroup:
        return self.dp_ep_mesh.get_group()

    @property
    def dense_grad_group(self) -> dist.ProcessGroup:
        return self.dense_grad_mesh.get_group()

    @property
    def ep_group(self) -> dist.ProcessGroup:
        return self.ep_mesh.get_group()

    @property
    def etp_group(self) -> dist.ProcessGroup:
        return self.etp_mesh.get_group()

    @property
    def edp_group(self) -> dist.ProcessGroup:
        return self.edp_mesh.get_group()

    @property
    def sequence_group(self) -> dist.ProcessGroup:
        return self.sequence_mesh.get_group()

    @property
    def token_group(self) -> dist.ProcessGroup:
        return self.token_mesh.get_group()

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.tp_mesh.get_group()

    @property
    def cp_group(self) -> dist.ProcessGroup:
        return self.cp_mesh.get_group()

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.pp_mesh.get_group()

    def as_dict(self) -> dict[str, int]:
        """The layout as written to ``summary.json``."""
        return {d: int(getattr(self, d)) for d in LAYOUT_KEYS}


def parallel_dims_of(trainer: Any) -> ParallelDims | None:
    """The layout ``trainer`` trains under: its strategy's :class:`ParallelDims` (``MoE5DStrategy``,
    complete with dp and the mesh once the strategy is set up), or None for any other strategy, a
    trainer without one, or no trainer (``None``). Callbacks and modules that adapt to the layout
    read it here rather than probing the strategy.

    Example::

        dims = lightning_moe.parallel_dims_of(trainer)
        ep = dims.ep if dims is not None else 1
    """
    dims = getattr(getattr(trainer, "strategy", None), "parallel_dims", None)
    return dims if isinstance(dims, ParallelDims) else None

"""Whole matrices for Newton-Schulz: gather a sharded matrix to one owner rank, scatter the result back.

Newton-Schulz needs the whole matrix (its Gram products mix every row with every column), while FSDP,
tensor and expert parallelism leave each rank a block of it. Each sharded matrix therefore has a
*shard group*, the ranks that hold its other blocks, and an *owner* in that group: the members send
their blocks to the owner (``gather``), the owner orthogonalizes and sends every member its block of
the result (``scatter``). Owners go round-robin over each group's matrices, so every rank of a group
does its share of Newton-Schulz. Replicated mesh dims (DDP, HSDP's replicas) are not crossed: each
replica group computes the same result on its own.

A routed-expert stack ``[num_experts, in, out]`` sharded on dim 0 (ep, or FSDP's Shard(0)) holds whole
experts locally: only the mesh dims that split an expert's matrix (etp, FSDP's Shard(1)) are gathered.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_moe import comm
from lightning_moe._compat import local_shard_index
from lightning_moe.layout import accounted_dim

__all__ = ["MatrixShards", "OwnerAssignment", "gather_dims"]

# Process groups of several mesh dims, created once per rank set (process groups are never freed).
_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def gather_dims(param: DTensor, expert_stack: bool) -> list[int]:
    """Mesh dims over which ``param``'s matrices are split: its sharded dims, except the expert dim 0
    of an expert stack (a shard of whole experts is already whole matrices)."""
    # Every placement that is neither replicated nor partial splits a tensor dim: Shard and FSDP's
    # strided shard alike (the latter answers False to is_shard()).
    return [
        i for i, placement in enumerate(param.placements)
        if not (placement.is_replicate() or placement.is_partial()) and param.device_mesh.size(i) > 1
        and not (expert_stack and placement.dim == 0)
    ]  # fmt: skip


def _shard_group(param: DTensor, dims: list[int]) -> dist.ProcessGroup:
    mesh = param.device_mesh
    if len(dims) == 1:
        return mesh.get_group(dims[0])
    coordinate = mesh.get_coordinate()
    index = tuple(slice(None) if i in dims else c for i, c in enumerate(coordinate))
    ranks = tuple(sorted(mesh.mesh[index].flatten().tolist()))
    if ranks not in _GROUPS:
        # Only the members create it: under pipeline parallelism other stages hold other matrices.
        _GROUPS[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
    return _GROUPS[ranks]


class OwnerAssignment:
    """Round-robin owners per shard group: the ``i``-th matrix of a group goes to its ``i % size``-th rank.

    Every member walks the same matrices in the same order (the optimizer's groups), so all agree.

    Example::

        owners = OwnerAssignment()
        owners.next_owner([0, 1]), owners.next_owner([0, 1])  # (0, 1)
    """

    def __init__(self) -> None:
        self._counts: Counter[tuple[int, ...]] = Counter()

    def next_owner(self, ranks: list[int]) -> int:
        key = tuple(ranks)
        owner = ranks[self._counts[key] % len(ranks)]
        self._counts[key] += 1
        return owner


@dataclass
class MatrixShards:
    """One sharded parameter's shard group, owner and blocks: moves its update to the owner and back.

    ``blocks[i]``: the global slices rank ``ranks[i]`` (group order) holds; the owner assembles the
    bounding box of all blocks (the whole matrix, or this rank's experts whole).

    Example::

        shards = MatrixShards.of(param, expert_stack=False, owners=OwnerAssignment())
        local_result = shards.apply(local_update, newton_schulz)  # newton_schulz runs on the owner only
    """

    group: dist.ProcessGroup
    ranks: list[int]
    owner: int
    blocks: list[tuple[slice, ...]]
    dim: str  # the parallel dim comm accounting charges the traffic to
    region_start: tuple[int, ...] = field(init=False)
    region_shape: tuple[int, ...] = field(init=False)
    wire_numel: int = field(init=False)

    def __post_init__(self) -> None:
        starts = [min(block[d].start for block in self.blocks) for d in range(len(self.blocks[0]))]
        stops = [max(block[d].stop for block in self.blocks) for d in range(len(self.blocks[0]))]
        self.region_start = tuple(starts)
        self.region_shape = tuple(b - a for a, b in zip(starts, stops))
        if sum(_numel(block) for block in self.blocks) != torch.Size(self.region_shape).numel():
            raise RuntimeError(
                f"the blocks {self.blocks} of ranks {self.ranks} do not tile one region: a placement Muon cannot gather"
            )
        # gather and scatter move equal-sized buffers: uneven blocks are padded to the largest.
        self.wire_numel = max(_numel(block) for block in self.blocks)

    @classmethod
    def of(cls, param: DTensor, expert_stack: bool, owners: OwnerAssignment) -> MatrixShards | None:
        """The shards of ``param`` (a collective over its shard group, once), or None when this rank
        holds its matrices whole."""
        dims = gather_dims(param, expert_stack)
        if not dims:
            return None
        group = _shard_group(param, dims)
        ranks = dist.get_process_group_ranks(group)
        blocks: list = [None] * len(ranks)
        dist.all_gather_object(blocks, local_shard_index(param), group=group)
        mesh = param.device_mesh
        # FSDP's shard group (dp_ep_cp, edp) counts as dp, also when tp joins it; else tp or etp: tp.
        spans = [part for i in dims for part in mesh.mesh_dim_names[i].split("_")]
        dim = accounted_dim(spans, {name: mesh.size(i) for i, name in enumerate(mesh.mesh_dim_names)}) or "other"
        return cls(group, ranks, owners.next_owner(ranks), blocks, dim)

    @property
    def is_owner(self) -> bool:
        return dist.get_rank() == self.owner

    def _in_region(self, block: tuple[slice, ...]) -> tuple[slice, ...]:
        return tuple(slice(s.start - a, s.stop - a) for s, a in zip(block, self.region_start))

    def _padded(self, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        flat = values.reshape(-1).to(dtype)
        return torch.nn.functional.pad(flat, (0, self.wire_numel - flat.numel()))

    def apply(
        self, local_update: torch.Tensor, transform: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype
    ) -> torch.Tensor:
        """``transform`` of the whole region on the owner, each rank's block of it returned. Blocks travel
        in ``dtype``, the one Newton-Schulz computes in: the owner gets what a single process computes."""
        sent = self._padded(local_update, dtype)
        received = [torch.empty_like(sent) for _ in self.ranks] if self.is_owner else None
        comm.gather_to(sent, received, self.owner, self.group, self.dim)
        pieces = None
        if self.is_owner:
            region = torch.empty(self.region_shape, dtype=dtype)
            for block, values in zip(self.blocks, received):
                shape = [s.stop - s.start for s in block]
                region[self._in_region(block)] = values[: _numel(block)].view(shape)
            result = transform(region)
            pieces = [self._padded(result[self._in_region(block)], dtype) for block in self.blocks]
        mine = torch.empty_like(sent)
        comm.scatter_from(mine, pieces, self.owner, self.group, self.dim)
        return mine[: local_update.numel()].view(local_update.shape)


def _numel(block: tuple[slice, ...]) -> int:
    return int(torch.Size(s.stop - s.start for s in block).numel())

"""Meta-device initialisation: each rank materialises only its own shards, with single-process values.

A module built on the meta device (``trainer.init_module(empty_init=True)``, or
``with torch.device("meta")``) is parallelized first; then :func:`materialize_sharded` allocates
each rank's shards and fills them from ``initial_value(name, tensor)``, the module's deterministic
recipe for any block of the initial value of each parameter and buffer. Every rank asks for its
own block (no communication), so the shards equal the slices of the model a single process
builds eagerly from the same recipe, under any layout. A seeded recipe draws one whole tensor at a
time and cuts it; a pretrained loader reads only the block (never the full model either way).
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_moe._compat import local_shard_index, materialize_distributed_module

# initial_value(name, tensor, index) -> the block `index` (slices of the global shape) of the full
# initial value of parameter or buffer `name`.
InitialValue = Callable[[str, torch.Tensor, tuple[slice, ...]], torch.Tensor]


def seeded_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator for tensor ``name``: the same stream on every rank and layout for one ``seed``."""
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


def materialize(module: nn.Module, device: torch.device, initial_value: InitialValue | None = None) -> None:
    """Allocate a meta-device ``module``'s shards (nothing to do without meta tensors): with
    ``initial_value(name, tensor, index)`` (single-process values on every layout,
    :func:`materialize_sharded`) when given, else Lightning's convention (``to_empty`` and each
    submodule's ``reset_parameters()``)."""
    if not has_meta_tensors(module):
        return
    if callable(initial_value):
        materialize_sharded(module, device, initial_value)
    else:
        materialize_distributed_module(module, device)


@torch.no_grad()
def materialize_sharded(module: nn.Module, device: torch.device, initial_value: InitialValue) -> None:
    """Allocate ``module``'s parameters and buffers on ``device`` and fill each rank's shards.

    ``initial_value(name, tensor, index)`` returns the block ``index`` (a tuple of slices of the
    global shape) of the initial value of the parameter or buffer ``name`` (its name in the whole
    model: pipeline stages keep global names). A recipe that can only draw whole tensors returns
    ``whole[index]``; a pretrained loader reads just that block.

    Example::

        with torch.device("meta"):
            model = MoEGPT()
        parallelize(model, dims)
        materialize_sharded(model, torch.device("cpu"), model.initial_value)
    """
    module.to_empty(device=device)
    for name, tensor in itertools.chain(module.named_parameters(), module.named_buffers()):
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        index = local_shard_index(tensor) if isinstance(tensor, DTensor) else tuple(slice(0, n) for n in tensor.shape)
        block = initial_value(name, tensor, index).to(dtype=tensor.dtype)
        if tuple(block.shape) != tuple(local.shape):
            raise ValueError(
                f"initial_value({name!r}) gave a block of shape {tuple(block.shape)} for a local shard of {tuple(local.shape)}"
            )
        local.copy_(block)

"""Meta-device initialisation: each rank materialises only its own shards, with single-process values.

A module built on the meta device (``trainer.init_module(empty_init=True)``, or
``with torch.device("meta")``) is parallelized first; then :func:`materialize_sharded` allocates
each rank's shards and fills them from ``initial_value(name, tensor)``, the module's deterministic
recipe for the *full* initial tensor of each parameter and buffer. Every rank cuts its own shard
out of that tensor (``distribute_tensor`` with ``src_data_rank=None``: no communication), so the
shards equal the slices of the model a single process builds eagerly from the same recipe, under
any layout. At most one full tensor exists at a time, never the full model.
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

InitialValue = Callable[[str, torch.Tensor], torch.Tensor]


def seeded_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator for tensor ``name``: the same stream on every rank and layout for one ``seed``."""
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


@torch.no_grad()
def materialize_sharded(module: nn.Module, device: torch.device, initial_value: InitialValue) -> None:
    """Allocate ``module``'s parameters and buffers on ``device`` and fill each rank's shards.

    ``initial_value(name, tensor)`` returns the full initial value (global shape, CPU) of the
    parameter or buffer ``name`` (its name in the whole model: pipeline stages keep global names).

    Example::

        with torch.device("meta"):
            model = MoEGPT()
        parallelize(model, mesh)
        materialize_sharded(model, torch.device("cpu"), model.initial_value)
    """
    module.to_empty(device=device)
    for name, tensor in itertools.chain(module.named_parameters(), module.named_buffers()):
        full = initial_value(name, tensor).to(dtype=tensor.dtype)
        if tuple(full.shape) != tuple(tensor.shape):
            raise ValueError(f"initial_value({name!r}) has shape {tuple(full.shape)}, the tensor {tuple(tensor.shape)}")
        if isinstance(tensor, DTensor):
            local = distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None).to_local()
            tensor.to_local().copy_(local)
        else:
            tensor.copy_(full)

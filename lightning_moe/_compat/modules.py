"""torch.nn internals: ``nn.Module``'s child, parameter and buffer tables, its ``_apply``, the
dropout base class, the autograd view base of a tensor, and switching torch-function handling off.

Floors: torch >= 2.11.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class Fp32BuffersModule(nn.Module):
    """An ``nn.Module`` whose float32 buffers stay float32 when the module is cast: ``module.to(dtype)``,
    ``.half()``, ``.bfloat16()``, ``.double()`` change its parameters and other buffers, and move
    these to the new device only. Overrides ``nn.Module._apply`` (through which all of ``to``,
    ``cuda``, ``cpu``, ``type`` and the dtype casts go) and reads/writes its own ``_buffers``.
    Checked on: torch 2.11-2.13."""

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Fp32BuffersModule:
        fp32_buffers = {
            name: buf for name, buf in self._buffers.items() if buf is not None and buf.dtype == torch.float32
        }
        super()._apply(fn, recurse)
        for name, old in fp32_buffers.items():
            new = self._buffers[name]
            if new is not None and new.dtype != torch.float32:
                self._buffers[name] = old.to(new.device)
        return self


# nn.Module and Tensor internals: the child, parameter and buffer tables and the autograd view base.
def module_child_table(module: nn.Module) -> dict[str, nn.Module | None]:
    """The live ``nn.Module._modules`` dict of ``module``: its child slots in registration order,
    None-valued slots and one module under several names included (``named_children`` skips both).
    Writing to it replaces a slot without ``__setattr__``'s checks; a copy of it gives a shallow
    copy of a module its own child table. Checked on: torch 2.11-2.13."""
    return module._modules


def shallow_copy_module(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` with its own child table (a copy of ``_modules``): it shares every
    attribute, parameter, buffer and submodule, and replacing a child of the copy leaves ``module`` as
    it is. Not ``copy.copy``: a LightningModule's ``__getstate__`` drops its trainer.
    Checked on: torch 2.11-2.13."""
    clone = object.__new__(type(module))
    clone.__dict__.update(module.__dict__)
    clone._modules = dict(module._modules)
    return clone


def module_parameter_table(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """The live ``nn.Module._parameters`` dict of ``module`` (its own parameters, not its children's).
    Unlike ``register_parameter``, writing to it accepts a plain tensor (a parameter's local view
    for the duration of a forward) and runs no registration hooks. Checked on: torch 2.11-2.13."""
    return module._parameters


def non_persistent_buffer_names(module: nn.Module) -> set[str]:
    """Names of ``module``'s own buffers registered with ``persistent=False`` (left out of its
    ``state_dict``): ``nn.Module._non_persistent_buffers_set``. Checked on: torch 2.11-2.13."""
    return module._non_persistent_buffers_set


def is_dropout_module(module: nn.Module) -> bool:
    """Whether ``module`` is a torch dropout module with a probability ``p``: an instance of
    ``torch.nn.modules.dropout._DropoutNd``, the base of ``Dropout``, ``Dropout1d/2d/3d``,
    ``AlphaDropout`` and ``FeatureAlphaDropout``. Checked on: torch 2.11-2.13."""
    return isinstance(module, nn.modules.dropout._DropoutNd)


def tensor_is_view(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is an autograd view of another tensor: ``tensor._base is not None``.
    Checked on: torch 2.11-2.13."""
    return tensor._base is not None


def torch_function_disabled() -> Any:
    """``torch._C.DisableTorchFunction()``: a context in which no torch-function mode (nor subclass
    ``__torch_function__``) sees the calls made. Checked on: torch 2.11-2.13."""
    return torch._C.DisableTorchFunction()

"""The transformer-block list of a module: what pipeline stages split and FSDP wraps unit by unit."""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

DEFAULT_BLOCKS_ATTR = "layers"


def blocks_attr(module: nn.Module) -> str:
    """Name of ``module``'s block container: ``module.pipeline_layers_attr`` if set, else ``"layers"``."""
    return getattr(module, "pipeline_layers_attr", DEFAULT_BLOCKS_ATTR)


def block_container(module: nn.Module) -> nn.ModuleDict | nn.ModuleList | None:
    """``module``'s blocks (an ``nn.ModuleDict`` or ``nn.ModuleList``), or None if it has none.

    Example::

        class MyLM(L.LightningModule):
            pipeline_layers_attr = "blocks"      # self.blocks = nn.ModuleList([...])
        block_container(MyLM())                  # the ModuleList
    """
    blocks = getattr(module, blocks_attr(module), None)
    return blocks if isinstance(blocks, (nn.ModuleDict, nn.ModuleList)) else None


def require_block_container(module: nn.Module, feature: str) -> nn.ModuleDict | nn.ModuleList:
    """:func:`block_container`, or a ``ValueError`` saying that ``feature`` needs one and how to name it."""
    blocks = block_container(module)
    if blocks is None:
        raise ValueError(
            f"{feature} needs the module's block list: {type(module).__name__} has no nn.ModuleList/ModuleDict"
            f" under `{blocks_attr(module)}` (set `pipeline_layers_attr` to its name)"
        )
    return blocks


def iter_blocks(container: nn.ModuleDict | nn.ModuleList) -> Iterator[nn.Module]:
    """The blocks of ``container`` in order, under whatever keys they have (after :func:`remove_block`
    too): ``ModuleDict.values()``, or iteration over the ``ModuleList``."""
    return iter(container.values()) if isinstance(container, nn.ModuleDict) else iter(container)


def _block(container: nn.ModuleDict | nn.ModuleList, key: str) -> nn.Module:
    """The block under ``key``: ``container[key]`` of a ModuleDict; of a ModuleList by attribute (its
    keys are digits), since ``container[i]`` counts positions, which :func:`remove_block` shifts."""
    return container[key] if isinstance(container, nn.ModuleDict) else getattr(container, key)


def remove_block(container: nn.ModuleDict | nn.ModuleList, key: str) -> None:
    """Remove one block, keeping the others' keys (``blocks.3`` stays ``blocks.3`` on its stage).

    ``nn.ModuleList.__delitem__`` renumbers the blocks that follow, which would rename their
    parameters; iteration over the list still yields the remaining blocks in order.
    ``delattr`` removes the child under its key in both kinds of container.
    """
    delattr(container, key)


def subset(container: nn.ModuleDict | nn.ModuleList, keys: list[str]) -> nn.ModuleDict | nn.ModuleList:
    """A container of the same kind holding the blocks ``keys`` under their original keys."""
    part = type(container)()
    for key in keys:
        part.add_module(key, _block(container, key))
    return part

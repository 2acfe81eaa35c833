"""Optimizers for MoE models on any layout of the moe5d strategy.

- :class:`Muon`: Muon on matrices and on each routed expert's matrices, AdamW on the rest; sharded
  matrices are orthogonalized whole on one owner rank of their shard group (docs/muon.md).
- :func:`muon_parameter_groups`: the default Muon/AdamW split, for users who adjust it.
"""

from lightning_moe.optim.muon import Muon
from lightning_moe.optim.param_split import muon_parameter_groups

__all__ = ["Muon", "muon_parameter_groups"]

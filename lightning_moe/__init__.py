"""lightning-moe: Mixture-of-Experts training in PyTorch Lightning with 5D parallelism.

``import lightning_moe`` registers the ``"moe5d"`` strategy, so ``Trainer(strategy="moe5d")`` works.
"""

from lightning_moe import optim  # noqa: F401 - lightning_moe.optim.Muon without an import of its own
from lightning_moe.parallel.config import ParallelConfig, ParallelHooks
from lightning_moe.parallel.dims import ParallelDims, parallel_dims_of
from lightning_moe.parallel.plans.parallelize import parallelize
from lightning_moe.strategy import MoE5DStrategy, register
from lightning_moe.verify import VerifyReport, verify_layout

register()

__all__ = [
    "MoE5DStrategy",
    "ParallelConfig",
    "ParallelDims",
    "ParallelHooks",
    "VerifyReport",
    "parallel_dims_of",
    "parallelize",
    "verify_layout",
]
__version__ = "0.1.0"

"""Configuration: what a user of ``parallel/`` sets, checked before any work.

``options.py``: :class:`ParallelConfig`, the strategy's layout and parallel options, checked on
construction (each plan's options by the plan's own check); ``world_size.py``: the checks that need
the world size, at launch; ``hooks.py``: :class:`ParallelHooks`, the optional hooks of a user's module.

What belongs here: an option, its check, and the names a user's module may define. It sits above
``plans/``, whose checks it asks, and below the strategy (``layout="auto"`` is the strategy's: it asks
the planner).
"""

from lightning_moe.parallel.config.hooks import ParallelHooks
from lightning_moe.parallel.config.options import ParallelConfig

__all__ = ["ParallelConfig", "ParallelHooks"]

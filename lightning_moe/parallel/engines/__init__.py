"""Step engines: how a global batch becomes work on this rank, one engine chosen per layout.

``step_engine.py`` is the interface; ``choice.py`` chooses the engine (``choose_step_engine``) and
finds a trainer's (``step_engine_of``). ``accumulation.py`` holds the gradient-accumulation engines
(pp = 1; ``fsdp_accumulation.py``: FSDP2's one gather per optimizer step) and ``lightning_pipeline.py``
the pipeline's (pp > 1), which runs the schedule of ``pipeline_runner.py``.

What belongs here: what runs a Lightning batch on the parallelized module (forward, backward, the
batch plan that sets the accumulation). Engines use the plans and the runtime helpers; nothing else
of ``parallel/`` imports them.
"""

from lightning_moe.parallel.engines.choice import choose_step_engine, step_engine_of

__all__ = ["choose_step_engine", "step_engine_of"]

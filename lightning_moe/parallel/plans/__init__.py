"""Plans: what is applied to a module (any ``nn.Module`` with a block list) before its first step.

``parallelize.py`` applies the plan of each dimension, in this order: ``pipeline.py`` (the stage
split; also the loader grouping and micro-batch helpers the pipeline engine runs on),
``expert_parallel.py``, ``tensor_parallel.py``, ``data_parallel.py`` (FSDP2, HSDP, ``replicate``).
``context_parallel.py`` is cp's plan, which shards each batch rather than the module. ``blocks.py``
is the block list that pp splits and FSDP wraps. After ``parallelize``: ``training_plans.py`` (their
order), ``precision.py``, ``activation_checkpoint.py``, ``compile.py``; and ``init.py``, which
materialises a meta-device module shard by shard.

What belongs here: a transform of a module (or of its batches) by the layout, with the checks of its
own options (``ParallelConfig`` asks them). A plan imports ``parallel/dims.py`` and other plans, and
nothing else of ``parallel/``.
"""

"""Runtime helpers: what a running step or process calls, on any layout.

Per step: ``documents.py`` (a batch's ``document_ids`` to the attention and the MoE layers),
``grad_norm.py`` (gradient clipping over the dense and expert meshes), ``cp_outputs.py``
(``predict_step`` outputs back whole under cp). Per process: ``host_memory.py`` (large blocks go back
to the system), ``watchdog.py`` (a rank that stopped making collective progress ends, leaving its
stacks).

What belongs here: a helper the strategy or an engine calls while training runs, which neither
transforms a module nor chooses an engine. It imports nothing else of ``parallel/``.
"""

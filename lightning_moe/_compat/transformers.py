"""transformers internals: a config's attention implementation and a model's tied weights.
transformers (the optional ``hf`` extra) is never imported here: these read and write attributes
of objects it made.

No floor is stated here: pyproject.toml's ``hf`` extra asks for transformers >= 5, and the names
below were checked on 5.24 and 5.25 only.
"""

from __future__ import annotations

from typing import Any


def attention_implementation(config: Any) -> str | None:
    """The attention implementation a transformers config selects (``"sdpa"``, ``"eager"``, a name
    registered with ``AttentionInterface``): its private ``_attn_implementation``; None for an
    object without one. Checked on: transformers 5.24-5.25."""
    return getattr(config, "_attn_implementation", None)


def set_attention_implementation(config: Any, name: str) -> None:
    """Make a transformers config select attention implementation ``name`` without the model-level
    checks of ``PreTrainedModel.set_attn_implementation``: the setter of the private
    ``_attn_implementation`` (which also sets its sub-configs'). Checked on: transformers 5.24-5.25."""
    config._attn_implementation = name


def tied_weights_keys(model: Any) -> Any:
    """The parameter names a transformers model ties to others (its output embedding, say), which its
    ``state_dict`` may lack: the private ``PreTrainedModel._tied_weights_keys`` (in transformers 5 a
    dict from each tied parameter to the one it shares, iterated for the tied names; a list before);
    ``[]`` for a model without one or with None.
    Checked on: transformers 5.24-5.25."""
    return getattr(model, "_tied_weights_keys", None) or []


def initialize_module_weights(model: Any, module: Any) -> None:
    """Initialize ``module`` (a layer built outside ``model``) the way ``model`` initializes its own: the
    private ``PreTrainedModel._init_weights``. Checked on: transformers 5.24-5.25."""
    model._init_weights(module)

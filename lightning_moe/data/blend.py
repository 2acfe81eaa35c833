"""Blends of token sources: which source each sample of the mix comes from.

Sample ``i`` of a blend is taken from the source furthest below its share: the source ``d`` with
the largest ``weight[d] * max(i, 1) - count[d]`` in float64 (``count[d]``: the samples taken from
``d`` before ``i``; ties go to the first source). This is megatron-core's
``build_blending_indices``, and ``tests/test_data_tokens.py`` checks it against that function
sample for sample. It depends on ``i`` alone, never on the layout. After ``n`` samples no source is
a full sample ahead of ``weight[d] * n`` (a source is taken only while at or below its share), but
one can fall more than a sample behind: 1.2 samples for weights [0.05, 0.9, 0.05], and up to 1.3
measured for random weights of 2 to 32 sources over 200,000 samples.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["blend_schedule", "parse_blend"]


def parse_blend(blend: Any) -> list[tuple[float, str]]:
    """``[(weight, source)]`` with weights normalised to sum to 1, from what a user writes.

    Accepted: one source (``"data/wiki"``), a flat list of weights and sources (``[0.7, "wiki",
    0.3, "code"]``, Megatron's ``--data-path`` style), a list of sources (equal weights) or a
    mapping ``{source: weight}``. A weight <= 0 or a malformed list is refused with the fix.
    """
    if isinstance(blend, (str, os.PathLike)):
        pairs: list[tuple[Any, Any]] = [(1.0, blend)]
    elif isinstance(blend, Mapping):
        pairs = [(weight, source) for source, weight in blend.items()]
    elif isinstance(blend, Sequence) and len(blend) > 0:
        items = list(blend)
        if all(isinstance(item, (str, os.PathLike)) for item in items):
            pairs = [(1.0, item) for item in items]
        elif len(items) % 2 == 0 and all(isinstance(items[k + 1], (str, os.PathLike)) for k in range(0, len(items), 2)):
            pairs = [(items[k], items[k + 1]) for k in range(0, len(items), 2)]
        else:
            raise ValueError(
                f"blend={items!r}: expected weights and sources alternating, e.g. [0.7, data/wiki, 0.3, data/code],"
                " a list of sources, or a mapping {source: weight}"
            )
    else:
        raise ValueError(f"blend={blend!r}: give a source path, [weight, source, ...] or {{source: weight}}")
    result = []
    for weight, source in pairs:
        try:
            value = float(weight)
        except (TypeError, ValueError):
            raise ValueError(
                f"blend weight {weight!r} of {source}: not a number; write e.g. [0.7, {source}, ...]"
            ) from None
        if not value > 0 or not np.isfinite(value):
            raise ValueError(
                f"blend weight {weight!r} of {source} must be > 0: give every source a positive weight, or drop it"
            )
        result.append((value, os.fspath(source)))
    total = sum(weight for weight, _ in result)
    return [(weight / total, source) for weight, source in result]


def blend_schedule(weights: Sequence[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """``(source, index_in_source)`` of the blend's samples ``0 .. num_samples - 1`` (int16, int64).

    ``weights`` are normalised. Equal, sample for sample, to megatron-core's
    ``build_blending_indices`` with the same float64 weights (its ``dataset_index`` and
    ``dataset_sample_index``): one pass, about a microsecond per sample for a few sources; the
    result is what a layout-invariant sampler then permutes.
    """
    w = np.asarray(weights, dtype=np.float64)
    num_sources = len(w)
    if num_sources == 1:
        return np.zeros(num_samples, dtype=np.int16), np.arange(num_samples, dtype=np.int64)
    source = np.empty(num_samples, dtype=np.int16)
    if num_sources > 10:  # from about 10 sources one numpy pass per sample beats a Python loop
        counts = np.zeros(num_sources, dtype=np.float64)
        for i in range(num_samples):
            best = int((w * float(max(i, 1)) - counts).argmax())
            source[i] = best
            counts[best] += 1.0
    else:
        wl = w.tolist()
        c = [0] * num_sources
        others = range(1, num_sources)
        for i in range(num_samples):
            scale = float(max(i, 1))
            best, best_error = 0, wl[0] * scale - c[0]
            for d in others:  # strictly larger: ties go to the first source, as in Megatron
                error = wl[d] * scale - c[d]
                if error > best_error:
                    best, best_error = d, error
            source[i] = best
            c[best] += 1
    index = np.empty(num_samples, dtype=np.int64)
    order = np.argsort(source, kind="stable")
    starts = np.concatenate([[0], np.cumsum(np.bincount(source, minlength=num_sources))[:-1]])
    index[order] = np.arange(num_samples, dtype=np.int64) - starts[source[order]]
    return source, index

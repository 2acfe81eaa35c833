"""PNG plots of expert load and training curves (matplotlib's Agg canvas: no display, no pyplot state)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure


def expert_load_shares(counts: Sequence[Sequence[float]]) -> np.ndarray:
    """``[layers, max_experts]`` share of each layer's tokens per expert (rows sum to 1; NaN pads
    layers with fewer experts, 0 for a layer that saw no token)."""
    width = max((len(row) for row in counts), default=0)
    shares = np.full((len(counts), width), np.nan)
    for i, row in enumerate(counts):
        values = np.asarray(row, dtype=float)
        total = values.sum()
        shares[i, : len(values)] = values / total if total > 0 else 0.0
    return shares


def plot_expert_load(counts: Sequence[Sequence[float]], path: str | os.PathLike[str], title: str = "") -> np.ndarray:
    """Save a heatmap of the share of tokens per expert (rows: MoE layers, columns: experts) to ``path``.

    The colour scale is centred on the balanced share ``1 / num_experts``: white is balanced, red an
    overloaded expert, blue an under-used one. Returns the plotted matrix ``[layers, experts]``.

    Example::

        shares = plot_expert_load([[10, 2, 2, 2], [4, 4, 4, 4]], "plots/expert_load.png", "step 100")
        shares.shape  # (2, 4)
    """
    shares = expert_load_shares(counts)
    layers, experts = shares.shape
    balanced = 1.0 / max(experts, 1)
    fig = Figure(figsize=(min(3 + 0.45 * experts, 24), min(2.5 + 0.4 * layers, 24)), layout="constrained")
    ax = fig.add_subplot()
    vmax = max(2 * balanced, float(np.nanmax(shares)) if shares.size else 0.0)
    norm = TwoSlopeNorm(vcenter=balanced, vmin=0.0, vmax=vmax)
    image = ax.imshow(shares, cmap="RdBu_r", norm=norm, aspect="auto", interpolation="nearest")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_xticks(range(experts))
    ax.set_yticks(range(layers))
    ax.set_title(title or "share of tokens per expert")
    fig.colorbar(image, ax=ax, label=f"share (balanced {balanced:.3g})")
    _save(fig, path)
    return shares


def plot_curves(
    series: Mapping[str, Sequence[float]],
    path: str | os.PathLike[str],
    *,
    title: str,
    ylabel: str,
    xlabel: str = "optimizer step",
    hline: float | None = None,
) -> None:
    """Save one line per entry of ``series`` (x = 1, 2, ...) to ``path``; ``hline`` marks a reference level.

    Example::

        plot_curves({"layer0": [1.8, 1.4, 1.2]}, "plots/load_imbalance.png",
                    title="load imbalance", ylabel="max / mean tokens per expert", hline=1.0)
    """
    # Room for the legend beside the axes.
    legend_width = 0.07 * max((len(label) for label in series), default=0)
    fig = Figure(figsize=(7 + legend_width, 4.5), layout="constrained")
    ax = fig.add_subplot()
    if len(series) > 10:  # the default cycle repeats its 10 colours
        ax.set_prop_cycle(color=colormaps["tab20"](np.arange(len(series)) % 20))
    for label, values in series.items():
        ys = np.asarray(values, dtype=float)
        ax.plot(np.arange(1, len(ys) + 1), ys, label=label, marker="." if len(ys) < 30 else None)
    if hline is not None:
        ax.axhline(hline, color="grey", linestyle=":", linewidth=1)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if series:
        # Many jobs: a legend beside the axes rather than over the curves.
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), ncols=math.ceil(len(series) / 20))
    _save(fig, path)


def _save(fig: Figure, path: str | os.PathLike[str]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=100)

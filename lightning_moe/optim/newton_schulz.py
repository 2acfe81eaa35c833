"""Newton-Schulz orthogonalization: Muon's ``U V^T``-like image of a matrix, and its cost.

The iteration and its defaults are torch.optim.Muon's (Keller Jordan's quintic coefficients); with
``dtype=torch.bfloat16`` the result is bit for bit torch's, which computes in bf16. The dtype is a choice
here because bf16 rounding turns the last-bit differences between layouts (reduction orders) into
differences of 1e-5 in the loss within 20 steps; in fp32 the layouts stay together.
"""

from __future__ import annotations

import torch

__all__ = ["NS_COEFFICIENTS", "NS_EPS", "NS_STEPS", "newton_schulz"]

# torch.optim.Muon's defaults.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7


def newton_schulz(
    matrix: torch.Tensor,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    steps: int = NS_STEPS,
    eps: float = NS_EPS,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``steps`` quintic Newton-Schulz iterations on a 2-D ``matrix`` in ``dtype``: singular values pushed
    towards 1 (roughly uniform in [0.5, 1.5]) with the singular vectors kept.

    Example::

        newton_schulz(torch.randn(64, 32)).shape  # torch.Size([64, 32]), orthogonal-ish columns
    """
    a, b, c = coefficients
    tall = matrix.size(0) > matrix.size(1)
    x = matrix.to(dtype)
    if tall:  # iterate on the wide orientation: the Gram matrix is the smaller side squared
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm at most 1 (out of place: x may be the input)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x

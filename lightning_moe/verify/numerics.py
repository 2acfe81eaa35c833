"""The numbers of a comparison: normwise relative differences, uniform ratios, the part of a final
parameter's difference that optimizer rounding noise explains, and :func:`compare_runs`, which
measures a layout run's losses, step-1 gradients and final parameters against the one-process run's.

Relative differences are normwise: ``max|layout - single| / max|single|`` over a tensor.
"""

from __future__ import annotations

import math

import torch

from lightning_moe.verify.report import ParameterRow, VerifyReport, fmt_rel
from lightning_moe.verify.runs import RunData


def rel_diff(a: torch.Tensor | None, b: torch.Tensor | None, floor: float = 0.0) -> float:
    """``max|a - b| / max(max|b|, floor)`` (0 when both are None or all zero; inf for a shape mismatch or one None)."""
    if a is None or b is None:
        return 0.0 if a is None and b is None else math.inf
    if a.shape != b.shape:
        return math.inf
    if not a.is_floating_point():
        return 0.0 if torch.equal(a, b) else math.inf
    a, b = a.double(), b.double()
    if a.numel() == 0:
        return 0.0
    diff = float((a - b).abs().max())
    scale = max(float(b.abs().max()), floor)
    if not math.isfinite(diff):
        return math.inf
    if scale == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / scale


def uniform_ratio(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """``layout / single`` when it is the same number on every element (to 1e-3), else None."""
    if a.shape != b.shape or not a.is_floating_point():
        return None
    a, b = a.double().flatten(), b.double().flatten()
    scale = float(b.abs().max()) if b.numel() else 0.0
    if scale == 0.0:
        return None
    mask = b.abs() > 1e-3 * scale
    ratio = a[mask] / b[mask]
    if ratio.numel() == 0:
        return None
    median = float(ratio.median())
    if median == 0.0 or float((ratio - median).abs().max()) > 1e-3 * abs(median):
        return None
    # Elements too small for a ratio must follow the same scale.
    if float((a - median * b).abs().max()) > 1e-3 * abs(median) * scale:
        return None
    return median


def describe_ratio(ratio: float) -> str:
    for k in range(2, 65):
        if abs(ratio - k) < 1e-3 * k or abs(ratio - 1.0 / k) < 1e-3 / k:
            return f"ratio {ratio:.3f} on all elements: a reduction divides by the wrong group size"
    if abs(ratio + 1.0) < 1e-3:
        return "ratio -1.000 on all elements: the gradient has the wrong sign"
    return f"ratio {ratio:.3f} on all elements: a loss or gradient scale factor is wrong"


# Gradients are compared against at least this fraction of the model's largest gradient element.
GRAD_FLOOR = 1e-3
# A relative gradient perturbation r changes an Adam update m/sqrt(v) by up to about 2r (m and v
# both move); the final-parameter comparison allows each element that much of its tensor's travel.
NOISE_GAIN = 2.0


def optimizer_noise(
    final_layout: torch.Tensor,
    final_single: torch.Tensor,
    initial: torch.Tensor | None,
    grad_layout: torch.Tensor | None,
    grad_single: torch.Tensor | None,
) -> float | None:
    """The final-parameter difference that step-1 gradient rounding does not explain (normwise rel).

    Both runs sum the same gradients in another order, so each gradient carries rounding noise
    ``delta = max|grad_layout - grad_single|``. An optimizer that normalises its update by the
    gradient's magnitude (Adam) turns an element's relative noise ``r = delta / |grad|`` into a
    relative difference of about ``2 r`` in its update: elements whose gradient is near zero move
    by noise. Each element is allowed ``NOISE_GAIN * min(r, 1) * travel`` (``travel``: the largest
    distance an element of the tensor moved in the single run) and the rest is returned; None when
    there is nothing to explain it with (no initial value or no gradients).
    """
    if initial is None or grad_layout is None or grad_single is None:
        return None
    if not (
        final_single.is_floating_point()
        and final_single.shape == final_layout.shape == initial.shape
        and grad_single.shape == grad_layout.shape == final_single.shape
    ):
        return None
    single, layout = final_single.double(), final_layout.double()
    grad = grad_single.double()
    delta = float((grad_layout.double() - grad).abs().max()) if grad.numel() else 0.0
    scale = float(single.abs().max()) if single.numel() else 0.0
    if scale == 0.0 or delta == 0.0:
        return None
    travel = float((single - initial.double()).abs().max())
    relative = (delta / grad.abs()).clamp(max=1.0)  # a zero gradient: pure noise (1)
    excess = ((layout - single).abs() - NOISE_GAIN * relative * travel).clamp(min=0.0)
    return float(excess.max()) / scale


def compare_runs(single: RunData, layout: RunData, rtol: float, control: RunData | None = None) -> VerifyReport:
    """Losses, gradients and final parameters of ``layout`` against ``single``.

    ``control``: the one-process run again with another intra-op thread count (noise control): a loss
    or final parameter that differs beyond ``rtol`` but within the noise floor it gives counts as
    agreeing (:func:`apply_noise_floor`).
    """
    report = VerifyReport(passed=True, layout=dict(layout.sizes), steps=len(single.losses), rtol=rtol)
    ref_losses, lay_losses = single.losses, layout.losses
    for step, (a, b) in enumerate(zip(lay_losses, ref_losses), start=1):
        report.losses.append({"step": step, "single": b, "layout": a, "rel": abs(a - b) / max(abs(b), 1e-30)})
    problems: list[str] = []
    if len(lay_losses) != len(ref_losses):
        problems.append(f"the layout run logged {len(lay_losses)} losses, the single run {len(ref_losses)}")
    types = {**layout.types, **single.types}
    order = {name: i for i, name in enumerate(single.order())}
    ref_grads, lay_grads = single.grads, layout.grads
    ref_final, lay_final = single.final, layout.final
    ref_initial = single.initial
    missing = sorted(set(ref_final) - set(lay_final))
    extra = sorted(set(lay_final) - set(ref_final))
    if missing:
        problems.append(f"{len(missing)} parameters of the single run are missing from the layout run: {missing[:5]}")
    if extra:
        problems.append(f"the layout run has {len(extra)} parameters the single run lacks: {extra[:5]}")
    # A tensor's difference is measured against at least GRAD_FLOOR of the model's largest gradient:
    # gradients that are zero in exact arithmetic (e.g. an attention key bias) hold only rounding noise.
    largest = max(
        (float(g.abs().max()) for g in ref_grads.values() if g is not None and g.numel() and g.is_floating_point()),
        default=0.0,
    )
    floor = GRAD_FLOOR * largest
    rows = []
    for name in ref_final:
        module = name.rsplit(".", 1)[0] if "." in name else ""
        a, b = lay_grads.get(name), ref_grads.get(name)
        grad_rel = rel_diff(a, b, floor) if name in ref_grads or name in lay_grads else 0.0
        row = ParameterRow(
            name, module, types.get(module, "?"), grad_rel, rel_diff(lay_final.get(name), ref_final[name])
        )
        if b is not None and b.is_floating_point() and float(b.abs().max() if b.numel() else 0.0) < floor:
            row.zero_grad = grad_rel <= rtol
            if row.zero_grad and not row.final_rel <= rtol:
                row.note = "gradient ~0 (below the floor): its update is optimizer noise, not counted"
        elif (
            grad_rel <= rtol
            and not row.final_rel <= rtol
            and lay_final.get(name) is not None
            and ref_final[name] is not None
        ):
            # Only when the step-1 gradients agree is their difference rounding noise.
            row.final_excess = optimizer_noise(lay_final[name], ref_final[name], ref_initial.get(name), a, b)
            if row.final_excess is not None and row.final_excess <= rtol:
                row.note = (
                    f"elements with ~0 step-1 gradient move by optimizer noise; the rest agree to"
                    f" rel {fmt_rel(row.final_excess)}"
                )
        if not grad_rel <= rtol and a is not None and b is not None:
            row.grad_ratio = uniform_ratio(a, b)
        rows.append(row)

    def module_rank(row: ParameterRow) -> int:
        parts = row.module.split(".")
        for i in range(len(parts), -1, -1):
            key = ".".join(parts[:i])
            if key in order:
                return order[key]
        return len(order)

    report.parameters = rows
    if control is not None:
        apply_noise_floor(report, compare_runs(single, control, rtol))
    rows.sort(key=lambda r: (r.diverges(rtol), module_rank(r)))
    bad_losses = [r for r in report.losses if not r["rel"] <= rtol and not r.get("within_noise_floor")]
    bad_params = [r for r in rows if r.diverges(rtol) < 2]
    if bad_losses or bad_params or problems:
        report.passed = False
    report.within_noise_floor = (
        report.passed
        and control is not None
        and (any(r.get("within_noise_floor") for r in report.losses) or any(r.noise_floor is not None for r in rows))
    )
    report.notes.extend(problems)
    if control is not None:
        report.notes.append(noise_control_note(report))
    return report


# -- noise control ------------------------------------------------------------------------------------
# One process against itself with every initial parameter one rounding unit higher carries rounding
# noise of the size a layout's other summation order gives, and drifts apart as a layout does once a
# near-tie in routing flips. A layout's loss or final parameter beyond rtol counts as noise while its
# difference is at most this many times that control's.
NOISE_FLOOR_FACTOR = 4.0
# What the control run changes, as the report names it.
NOISE_CONTROL = "every initial parameter one rounding unit higher"


def loss_noise_floors(control_rel: list[float], factor: float = NOISE_FLOOR_FACTOR) -> list[float]:
    """The noise floor of each step's loss: ``factor`` x the control's largest difference up to that
    step (the drift so far; a control that happens to agree again at one step does not lower it)."""
    floors, worst = [], 0.0
    for rel in control_rel:
        worst = max(worst, rel)
        floors.append(factor * worst)
    return floors


def apply_noise_floor(report: VerifyReport, control: VerifyReport, factor: float = NOISE_FLOOR_FACTOR) -> None:
    """Mark in ``report`` (layout vs one process) what differs beyond rtol but within the noise floor
    that ``control`` (one process vs itself with :data:`NOISE_CONTROL`) gives, and record the control
    in ``report.noise_control``.

    A loss at step s lies within the floor when its difference is at most ``factor`` x the control's
    largest up to s (:func:`loss_noise_floors`); a final parameter when it is at most ``factor`` x the
    control's final difference of that parameter. Step-1 gradients get no floor: the runs have not
    drifted apart yet.
    """
    rtol = report.rtol
    control_rel = [row["rel"] for row in control.losses]
    floors = loss_noise_floors(control_rel, factor)
    for row, control_row, floor in zip(report.losses, control.losses, floors):
        row.update(
            control=control_row["layout"],
            control_rel=control_row["rel"],
            noise_floor=floor,
            within_noise_floor=not row["rel"] <= rtol and row["rel"] <= floor,
        )
    control_final = {p.name: p.final_rel for p in control.parameters}
    for row in report.parameters:
        floor = factor * control_final.get(row.name, 0.0)
        if row.diverges(rtol) == 1 and row.final_counted <= floor:
            row.noise_floor = floor
            note = f"within the noise floor (one process vs itself with {NOISE_CONTROL}: rel {fmt_rel(floor / factor)})"
            row.note = f"{row.note}; {note}" if row.note else note
    report.noise_control = {
        "control": NOISE_CONTROL,
        "factor": factor,
        "losses": [row["layout"] for row in control.losses],
        "loss_rel": control_rel,
        "loss_floor": floors,
        "final_rel": control_final,
        "gradient_rel": {p.name: p.grad_rel for p in control.parameters},
    }


def noise_control_note(report: VerifyReport) -> str:
    """What the control measured, and what of the layout's differences lies beyond its floor."""
    control = report.noise_control or {}
    loss_rel = control.get("loss_rel") or [0.0]
    other = f"one process with {control.get('control', NOISE_CONTROL)}"
    if max(loss_rel) == 0.0 and not any((control.get("final_rel") or {}).values()):
        text = (
            f"noise control: {other} computed the same losses and parameters bit for bit, so the noise floor is 0"
            " and nothing beyond rtol counts as noise"
        )
    else:
        first = next((i + 1 for i, rel in enumerate(loss_rel) if not rel <= report.rtol), None)
        text = f"noise control: {other} differs from itself by loss rel {fmt_rel(max(loss_rel))} at most" + (
            f", beyond rtol from step {first}" if first else ", within rtol at every step"
        )
    beyond = [
        row["step"] for row in report.losses if not row["rel"] <= report.rtol and not row.get("within_noise_floor")
    ]
    finals = [p.name for p in report.parameters if p.diverges(report.rtol) == 1]
    what = []
    if beyond:
        steps = ", ".join(map(str, beyond[:8])) + (", ..." if len(beyond) > 8 else "")
        what.append(f"the loss{'es' if len(beyond) > 1 else ''} at step{'s' if len(beyond) > 1 else ''} {steps}")
    if finals:
        names = ", ".join(finals[:3]) + (", ..." if len(finals) > 3 else "")
        what.append(f"{len(finals)} final parameter{'s' if len(finals) > 1 else ''} ({names})")
    if what:
        text += f"; {' and '.join(what)} differ beyond {control.get('factor'):g}x the control's difference: more than the noise it measured"
    return text

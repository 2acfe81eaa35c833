"""The outcome of a verification: :class:`VerifyReport` (what ``verify.json`` holds) and the table the
CLI prints."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class ParameterRow:
    name: str
    module: str
    module_type: str
    grad_rel: float
    final_rel: float
    grad_ratio: float | None = None
    note: str = ""
    zero_grad: bool = False  # step-1 gradient below the floor: the optimizer turns its rounding noise into updates
    # The part of final_rel that the step-1 gradient rounding does not explain (see optimizer_noise).
    final_excess: float | None = None
    # With noise control: the noise floor that a final difference beyond rtol lies within (None otherwise).
    noise_floor: float | None = None

    @property
    def final_counted(self) -> float:
        """The final difference that counts against rtol (0 for a gradient below the floor)."""
        if self.zero_grad:
            return 0.0
        return self.final_rel if self.final_excess is None else min(self.final_rel, self.final_excess)

    def diverges(self, rtol: float) -> int:
        """0: the step-1 gradient differs, 1: only the final value, 2: neither."""
        if not self.grad_rel <= rtol:
            return 0
        if not self.final_counted <= rtol and self.noise_floor is None:
            return 1
        return 2


@dataclass
class VerifyReport:
    """The outcome of a verification: ``passed``, the per-step losses, one row per parameter, and
    on failure where the difference first appears (``first_difference``, ``localisation``).

    ``str(report)`` is the table the CLI prints; ``to_dict()`` is what ``verify.json`` holds.
    """

    passed: bool
    layout: dict[str, Any]
    steps: int
    rtol: float
    # One row per step: ``step``, ``single``, ``layout``, ``rel``; with noise control also ``control``
    # (the loss of the one-process control run), ``control_rel``, ``noise_floor`` and ``within_noise_floor``.
    losses: list[dict[str, Any]] = field(default_factory=list)
    parameters: list[ParameterRow] = field(default_factory=list)
    first_difference: str | None = None
    localisation: dict[str, Any] | None = None
    modules: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: dict[str, Any] | None = None
    run_dirs: dict[str, str] = field(default_factory=dict)
    model: str = ""
    # Set when the runs cut their steps into different micro-batches (see compare_micro_batching).
    micro_batching: dict[str, Any] | None = None
    # Noise control (see numerics.apply_noise_floor): the control run's thread counts, losses and floors.
    noise_control: dict[str, Any] | None = None
    # A PASS that counts differences beyond rtol as noise, as they lie within the noise floor.
    within_noise_floor: bool = False

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        return json.loads(json.dumps(data, default=str, allow_nan=True).replace("Infinity", '"inf"'))

    def write_json(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=1))

    def __str__(self) -> str:
        return format_report(self)


def fmt_rel(x: float | None) -> str:
    if x is None:
        return "-"
    return "inf" if not math.isfinite(x) else f"{x:.1e}"


def format_report(report: VerifyReport) -> str:
    lines = [
        f"verify: {report.model} on {layout_str(report.layout)} vs one process, {report.steps} steps,"
        f" rtol {report.rtol:g}"
    ]
    lines += [f"  note: {note}" for note in report.notes]
    if report.losses:
        control = report.noise_control is not None and all("control_rel" in row for row in report.losses)
        lines.append("step  loss (one process)  loss (layout)    rel" + ("  control rel" if control else ""))
        for row in report.losses:
            line = f"{row['step']:>4}  {row['single']:>18.7f}  {row['layout']:>13.7f}  {fmt_rel(row['rel']):>7}"
            if control:
                line += f"  {fmt_rel(row['control_rel']):>11}"
                if row["within_noise_floor"]:
                    line += f"  {noise_floor_note(report, row['noise_floor'])}"
                elif not row["rel"] <= report.rtol:
                    line += f"  <-- differs beyond the noise floor {fmt_rel(row['noise_floor'])}"
            lines.append(line)
    if report.parameters:
        width = max(len("parameter"), *(len(p.name) for p in report.parameters))
        twidth = max(len("module type"), *(len(p.module_type) for p in report.parameters))
        lines.append(f"{'parameter':<{width}}  {'module type':<{twidth}}  grad@1 rel  final rel")
        for p in report.parameters:
            flag = "" if p.diverges(report.rtol) == 2 else "  <-- differs"
            if p.note:
                flag += f"  ({p.note})"
            ratio = f"  (ratio {p.grad_ratio:.3f})" if p.grad_ratio is not None else ""
            lines.append(
                f"{p.name:<{width}}  {p.module_type:<{twidth}}  {fmt_rel(p.grad_rel):>10}  {fmt_rel(p.final_rel):>9}{flag}{ratio}"
            )
    if report.error is not None and report.error.get("summary") != report.first_difference:
        lines.append(f"error: {report.error.get('summary', '')}")
    if report.first_difference:
        lines.append(f"first difference: {report.first_difference}")
    if report.passed and report.within_noise_floor:
        lines.append(pass_within_noise_floor(report))
    elif report.passed:
        worst = max(
            [p.grad_rel for p in report.parameters]
            + [p.final_counted for p in report.parameters]
            + [r["rel"] for r in report.losses]
            + [0.0]
        )
        lines.append(
            f"PASS: {len(report.losses)} losses, {len(report.parameters)} gradients and final parameters within"
            f" rtol {report.rtol:g} (worst {worst:.1e})"
        )
    else:
        lines.append("FAIL")
    return "\n".join(lines)


def layout_str(layout: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in layout.items() if v is not None) or "?"


def noise_floor_note(report: VerifyReport, floor: float) -> str:
    """``within the noise floor (one process vs itself with every initial parameter one rounding unit
    higher: rel 3.1e-04)``: the control's difference that the floor ``floor`` allows a multiple of."""
    control = report.noise_control or {}
    factor = float(control.get("factor", 1.0))
    return f"within the noise floor (one process vs itself with {control.get('control', '?')}: rel {fmt_rel(floor / factor)})"


def pass_within_noise_floor(report: VerifyReport) -> str:
    """The PASS line of a verification whose differences beyond rtol lie within the noise floor."""
    control = report.noise_control or {}
    factor = float(control.get("factor", 1.0))
    steps = [row["step"] for row in report.losses if row.get("within_noise_floor")]
    finals = [p for p in report.parameters if p.noise_floor is not None]
    ratios = [row["rel"] * factor / row["noise_floor"] for row in report.losses if row.get("within_noise_floor")]
    ratios += [p.final_counted * factor / p.noise_floor for p in finals if p.noise_floor]
    beyond = []
    if steps:
        beyond.append(f"{len(steps)} loss{'es' if len(steps) > 1 else ''} (steps {_steps_str(steps)})")
    if finals:
        beyond.append(f"{len(finals)} final parameter{'s' if len(finals) > 1 else ''}")
    return (
        f"PASS within the noise floor: {len(report.parameters)} step-1 gradients within rtol {report.rtol:g};"
        f" {' and '.join(beyond)} differ by more, by at most {max(ratios, default=0.0):.1f}x what one process"
        f" differs from itself with {control.get('control', '?')} (the noise floor: {factor:g}x)"
    )


def _steps_str(steps: list[int]) -> str:
    """``3, 5-9, 12``: step numbers, runs of consecutive ones as ranges."""
    parts: list[str] = []
    start = prev = steps[0]
    for step in [*steps[1:], None]:
        if step is not None and step == prev + 1:
            prev = step
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if step is not None:
            start = prev = step
    return ", ".join(parts)

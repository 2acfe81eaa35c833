"""Compare a layout run with the single-process run: losses, step-1 gradients, final parameters, and
(localisation) every module's output at step 1, reassembled to full tensors from the ranks' pieces.

Relative differences are normwise: ``max|layout - single| / max|single|`` over a tensor. Both runs
must cut each step into the same micro-batches (``compare_micro_batching``): batch-level routing
statistics are taken per micro-batch.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_moe.layout import PARALLEL_DIMS

# -- loading a run ---------------------------------------------------------------------------------


@dataclass
class RunData:
    """What one run's ranks wrote (see :mod:`lightning_moe.verify.worker`)."""

    path: Path
    ranks: list[dict[str, Any]]
    errors: list[dict[str, Any]]

    @classmethod
    def load(cls, path: Path) -> RunData:
        ranks = [torch.load(p, weights_only=False) for p in sorted(path.glob("rank*.pt"))]
        errors = [json.loads(p.read_text()) for p in sorted(path.glob("error_rank*.json"))]
        return cls(path, sorted(ranks, key=lambda r: r["rank"]), errors)

    @property
    def losses(self) -> list[float]:
        for rank in self.ranks:
            if rank["losses"] is not None:
                return [float(x) for x in rank["losses"]]
        return []

    def _merged(self, key: str) -> dict[str, torch.Tensor | None]:
        merged: dict[str, torch.Tensor | None] = {}
        for rank in self.ranks:
            merged.update(rank.get(key) or {})
        return merged

    @property
    def grads(self) -> dict[str, torch.Tensor | None]:
        return self._merged("grads")

    @property
    def final(self) -> dict[str, torch.Tensor | None]:
        return self._merged("final")

    @property
    def initial(self) -> dict[str, torch.Tensor | None]:
        return self._merged("initial")

    @property
    def routing(self) -> dict[str, dict[str, Any]]:
        """Routing settings of the MoE layers (``load_balancing``, ...), by module name."""
        found: dict[str, dict[str, Any]] = {}
        for rank in self.ranks:
            found.update(rank.get("routing") or {})
        return found

    @property
    def types(self) -> dict[str, str]:
        types: dict[str, str] = {}
        for rank in self.ranks:
            types.update(rank["types"])
        return types

    @property
    def sizes(self) -> dict[str, int]:
        return self.ranks[0]["sizes"] if self.ranks else {}

    def order(self, key: str = "start_order") -> list[str]:
        """Module names in execution order at step 1 (``start_order``: forward start, ``end_order``: completion)."""
        if not self.ranks:
            return []
        by_stage: dict[int, list[str]] = {}
        for rank in self.ranks:
            by_stage.setdefault(rank["coords"]["pp"], rank[key])
        seen: dict[str, None] = {}
        for stage in sorted(by_stage):
            for name in by_stage[stage]:
                seen.setdefault(name, None)
        return list(seen)

    def dropout(self) -> list[str]:
        return self.ranks[0]["dropout"] if self.ranks else []


# -- metrics ---------------------------------------------------------------------------------------
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
    final_layout: torch.Tensor, final_single: torch.Tensor, initial: torch.Tensor | None,
    grad_layout: torch.Tensor | None, grad_single: torch.Tensor | None,
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
    if not (final_single.is_floating_point() and final_single.shape == final_layout.shape == initial.shape
            and grad_single.shape == grad_layout.shape == final_single.shape):
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


# -- the report -------------------------------------------------------------------------------------
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
        if not self.final_counted <= rtol:
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
    losses: list[dict[str, float]] = field(default_factory=list)
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

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        return json.loads(json.dumps(data, default=str, allow_nan=True).replace("Infinity", '"inf"'))

    def write_json(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=1))

    def __str__(self) -> str:
        return format_report(self)


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    return "inf" if not math.isfinite(x) else f"{x:.1e}"


def format_report(report: VerifyReport) -> str:
    lines = [
        f"verify: {report.model} on {_layout_str(report.layout)} vs one process, {report.steps} steps,"
        f" rtol {report.rtol:g}"
    ]
    lines += [f"  note: {note}" for note in report.notes]
    if report.losses:
        lines.append("step  loss (one process)  loss (layout)    rel")
        for row in report.losses:
            lines.append(f"{row['step']:>4}  {row['single']:>18.7f}  {row['layout']:>13.7f}  {_fmt(row['rel']):>7}")
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
                f"{p.name:<{width}}  {p.module_type:<{twidth}}  {_fmt(p.grad_rel):>10}  {_fmt(p.final_rel):>9}{flag}{ratio}"
            )
    if report.error is not None and report.error.get("summary") != report.first_difference:
        lines.append(f"error: {report.error.get('summary', '')}")
    if report.first_difference:
        lines.append(f"first difference: {report.first_difference}")
    if report.passed:
        worst = max([p.grad_rel for p in report.parameters] + [p.final_counted for p in report.parameters]
                    + [r["rel"] for r in report.losses] + [0.0])
        lines.append(
            f"PASS: {len(report.losses)} losses, {len(report.parameters)} gradients and final parameters within"
            f" rtol {report.rtol:g} (worst {worst:.1e})"
        )
    else:
        lines.append("FAIL")
    return "\n".join(lines)


def _layout_str(layout: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in layout.items() if v is not None) or "?"


# -- comparison ------------------------------------------------------------------------------------
def compare_runs(single: RunData, layout: RunData, rtol: float) -> VerifyReport:
    """Losses, gradients and final parameters of ``layout`` against ``single``."""
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
    largest = max((float(g.abs().max()) for g in ref_grads.values() if g is not None and g.numel() and g.is_floating_point()),
                  default=0.0)
    floor = GRAD_FLOOR * largest
    rows = []
    for name in ref_final:
        module = name.rsplit(".", 1)[0] if "." in name else ""
        a, b = lay_grads.get(name), ref_grads.get(name)
        grad_rel = rel_diff(a, b, floor) if name in ref_grads or name in lay_grads else 0.0
        row = ParameterRow(name, module, types.get(module, "?"), grad_rel, rel_diff(lay_final.get(name), ref_final[name]))
        if b is not None and b.is_floating_point() and float(b.abs().max() if b.numel() else 0.0) < floor:
            row.zero_grad = grad_rel <= rtol
            if row.zero_grad and not row.final_rel <= rtol:
                row.note = "gradient ~0 (below the floor): its update is optimizer noise, not counted"
        elif grad_rel <= rtol and not row.final_rel <= rtol and lay_final.get(name) is not None and ref_final[name] is not None:
            # Only when the step-1 gradients agree is their difference rounding noise.
            row.final_excess = optimizer_noise(lay_final[name], ref_final[name], ref_initial.get(name), a, b)
            if row.final_excess is not None and row.final_excess <= rtol:
                row.note = (f"elements with ~0 step-1 gradient move by optimizer noise; the rest agree to"
                            f" rel {_fmt(row.final_excess)}")
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

    rows.sort(key=lambda r: (r.diverges(rtol), module_rank(r)))
    report.parameters = rows
    bad_losses = [r for r in report.losses if not r["rel"] <= rtol]
    bad_params = [r for r in rows if r.diverges(rtol) < 2]
    if bad_losses or bad_params or problems:
        report.passed = False
    report.notes.extend(problems)
    return report


def first_gradient_difference(report: VerifyReport) -> str | None:
    rows = [p for p in report.parameters if p.diverges(report.rtol) == 0]
    if not rows:
        return None
    first = rows[0]
    text = f"gradient of {first.name} ({first.module_type}) at step 1, rel {_fmt(first.grad_rel)}"
    if first.grad_ratio is not None:
        text += f"; {describe_ratio(first.grad_ratio)}"
    others = [p.name for p in rows[1:]]
    if others:
        text += f" (and {len(others)} more: {', '.join(others[:4])}{', ...' if len(others) > 4 else ''})"
    return text


# -- checks on the data ----------------------------------------------------------------------------
def _keys(ids: torch.Tensor) -> list[bytes]:
    return [row.numpy().tobytes() for row in ids]


def step_micro_batches(run: RunData, step: int) -> list[list[torch.Tensor]] | None:
    """The micro-batches of one optimizer step (0-based), per data-parallel rank (dp x ep, in order):
    full input_ids ``[b, S]`` (context-parallel shards unsharded, pipeline chunks split); None
    when the batches hold no input_ids."""
    from lightning_moe.cp import zigzag_unshard

    sizes = run.sizes
    groups: dict[tuple[int, int], dict[int, dict[str, Any]]] = defaultdict(dict)
    for rank in run.ranks:
        c = rank["coords"]
        if c["pp"] == 0 and c["tp"] == 0:
            groups[(c["dp"], c["ep"])][c["cp"]] = rank
    replicas: list[list[torch.Tensor]] = []
    for key in sorted(groups):
        group = groups[key]
        per_cp = [group[c]["batches"].get(step, []) for c in sorted(group)]
        if not per_cp or not per_cp[0]:
            return None
        chunks = group[min(group)].get("chunks", 1)
        micro: list[torch.Tensor] = []
        for batch_parts in zip(*per_cp):
            full = zigzag_unshard(list(batch_parts), dim=1) if sizes.get("cp", 1) > 1 else batch_parts[0]
            micro.extend(full.chunk(chunks, dim=0) if chunks > 1 else [full])
        replicas.append(micro)
    return replicas


def _step_rows(run: RunData, step: int) -> list[torch.Tensor] | None:
    """Every full input_ids row of one optimizer step over the data-parallel ranks (None: no input_ids)."""
    replicas = step_micro_batches(run, step)
    if replicas is None:
        return None
    return [row for micro in replicas for ids in micro for row in ids]


def describe_micro_batching(replicas: list[list[torch.Tensor]]) -> str:
    """``8 micro-batches of 2 samples`` or ``2 data-parallel ranks x 4 micro-batches of 8 samples``."""
    counts = sorted({len(m) for m in replicas})
    sizes = sorted({int(ids.shape[0]) for m in replicas for ids in m})
    count = "/".join(map(str, counts))
    size = "/".join(map(str, sizes))
    text = f"{count} micro-batch{'es' if counts != [1] else ''} of {size} sample{'s' if sizes != [1] else ''}"
    return text if len(replicas) == 1 else f"{len(replicas)} data-parallel ranks x {text}"


def micro_batch_size_of(run: RunData) -> int | None:
    """The one micro-batch size of a run (None: mixed sizes or no input_ids)."""
    replicas = step_micro_batches(run, 0)
    sizes = {int(ids.shape[0]) for m in replicas or [] for ids in m}
    return sizes.pop() if len(sizes) == 1 else None


def compare_micro_batching(single: RunData, layout: RunData) -> dict[str, Any] | None:
    """None when every optimizer step of both runs groups the same samples into the same
    micro-batches (the unit over which batch-level statistics such as the load-balancing loss are
    taken); else where and how they differ."""
    for step in range(len(single.losses)):
        a, b = step_micro_batches(single, step), step_micro_batches(layout, step)
        if a is None or b is None:
            return None
        groups_a = sorted(tuple(sorted(_keys(ids))) for m in a for ids in m)
        groups_b = sorted(tuple(sorted(_keys(ids))) for m in b for ids in m)
        if groups_a != groups_b:
            return {"step": step + 1, "single": describe_micro_batching(a), "layout": describe_micro_batching(b),
                    "single_micro_batch_size": micro_batch_size_of(single),
                    "layout_micro_batch_size": micro_batch_size_of(layout)}
    return None


def _batch_statistics(routing: dict[str, dict[str, Any]]) -> str:
    """``load_balancing='aux_loss' in layers.0.feed_forward, layers.1.feed_forward`` (by setting)."""
    if not routing:
        return "the model's batch-level statistics"
    by_setting: dict[str, list[str]] = defaultdict(list)
    for module, settings in routing.items():
        shown = {k: v for k, v in settings.items() if v is not None and k != "aux_loss_coeff"}
        by_setting[", ".join(f"{k}={v!r}" for k, v in shown.items())].append(module or "the root module")
    parts = []
    for setting, modules in by_setting.items():
        where = ", ".join(modules[:3]) + (f" and {len(modules) - 3} more" if len(modules) > 3 else "")
        parts.append(f"{setting} in {where}")
    return "; ".join(parts)


def explain_micro_batching(
    report: VerifyReport, routing: dict[str, dict[str, Any]], pin: str | None, setting: str = "data.micro_batch_size"
) -> None:
    """Say in ``report`` when the runs' micro-batches differ, whether that explains a FAIL, and the fix.

    ``pin``: how verification could set the single run's micro-batch size (None: the data module
    has no ``micro_batch_size`` argument); ``setting``: how the user sets it (named in the fix).
    """
    mismatch = report.micro_batching
    if mismatch is None:
        return
    what = (f"the one-process run cut step {mismatch['step']} into {mismatch['single']}, the layout into"
            f" {mismatch['layout']}")
    if report.passed:
        report.notes.append(f"micro-batching differs ({what}); the results agree all the same")
        return
    single_size, size = mismatch["single_micro_batch_size"], mismatch["layout_micro_batch_size"]
    if single_size != size and pin is None:
        fix = ("give the data module a micro_batch_size argument (verification then runs the reference with the"
               f" layout's, {size}) or a micro-batch size that does not depend on the layout")
    elif single_size != size:
        fix = f"set {setting} to {size} (the same micro-batch size on both runs)"
    else:
        fix = ("put the same samples in each micro-batch on every layout: micro-batch j of a step on data-parallel"
               " rank j % (dp*ep), as lightning_moe.data.LayoutInvariantSampler does")
    fix += "; or take the load-balancing statistics per sequence (load_balancing='seq_aux_loss'), which micro-batching does not change"
    loc = report.localisation or {}
    # Micro-batching changes only what is computed over the micro-batch: the routing statistics
    # (whose aux-loss gradient reaches the routers in backward) and batch-dependent routing.
    explained = loc.get("kind") in (None, "gradient", "loss", "optimizer") or (
        loc.get("kind") == "module_output" and loc.get("module") in routing)
    lead = "explained by micro-batching" if explained else "micro-batching differs as well (fix it first)"
    explanation = (f"{lead}: {what}, and statistics of the micro-batch ({_batch_statistics(routing)}) are taken over"
                   f" other samples. Fix: {fix}")
    report.first_difference = f"{report.first_difference}; {explanation}" if report.first_difference else explanation
    if report.localisation is not None:
        report.localisation["explained_by"] = "micro_batching" if explained else None
    else:
        report.localisation = {"kind": "micro_batching", "explained_by": "micro_batching"}


def layout_dependent_statistics(routing: dict[str, dict[str, Any]], layout: dict[str, Any]) -> list[str]:
    """The MoE settings whose statistics are taken over more tokens than one micro-batch on ``layout``
    (so no one-process run can reproduce them), each with what it spans."""
    size = {k: int(layout.get(k) or 1) for k in PARALLEL_DIMS}
    dp_ep, shard = size["dp"] * size["ep"], size["cp"] * size["tp"]
    by_reason: dict[str, list[str]] = defaultdict(list)
    for module, settings in routing.items():
        if settings.get("load_balancing") == "global_aux_loss" and settings.get("aux_loss_coeff", 1) and dp_ep > 1:
            by_reason[f"load_balancing='global_aux_loss' counts the dp x ep = {dp_ep} micro-batches of one micro-step"
                      " at once (one on one process)"].append(module)
        if settings.get("routing") == "expert_choice" and size["ep"] > 1:
            by_reason[f"routing='expert_choice' lets each expert pick among the tokens of the ep = {size['ep']} ranks"
                      " (of one micro-batch on one process)"].append(module)
        if settings.get("load_balancing") == "sinkhorn" and shard > 1:
            by_reason[f"load_balancing='sinkhorn' balances each of the cp x tp = {shard} sequence shards, not the"
                      " micro-batch"].append(module)
    return [f"{reason} in {', '.join(m[:3])}{f' and {len(m) - 3} more' if len(m) > 3 else ''}"
            for reason, m in by_reason.items()]


def explain_batch_statistics(report: VerifyReport, routing: dict[str, dict[str, Any]]) -> None:
    """On a FAIL that the routing statistics can explain (equal forward, or a difference starting in
    an MoE layer), name the settings whose statistics span several ranks on this layout, and the fix."""
    if report.passed or report.micro_batching is not None:
        return
    reasons = layout_dependent_statistics(routing, report.layout)
    loc = report.localisation or {}
    if not reasons or not (loc.get("kind") in ("gradient", "loss", "optimizer")
                           or (loc.get("kind") == "module_output" and loc.get("module") in routing)):
        return
    explanation = ("explained by batch-level statistics that span several ranks on this layout, by design: "
                   + "; ".join(reasons) + ". Fix: verify with per-micro-batch statistics (load_balancing='aux_loss'"
                   " or 'seq_aux_loss', routing='topk'), which one process reproduces; keep these settings only if their"
                   " layout dependence is wanted")
    report.first_difference = f"{report.first_difference}; {explanation}" if report.first_difference else explanation
    if report.localisation is not None:
        report.localisation["explained_by"] = "batch_statistics"


def check_same_samples(single: RunData, layout: RunData) -> str | None:
    """A message when the two runs did not train on the same samples at some step."""
    for step in range(len(single.losses)):
        a, b = _step_rows(single, step), _step_rows(layout, step)
        if a is None or b is None:
            return None
        if sorted(_keys(torch.stack(a)) if a else []) != sorted(_keys(torch.stack(b)) if b else []):
            return (
                f"the layout run trained on other samples than the single run at step {step + 1}: the data module"
                " must give every data-parallel rank its share of the same global batch (build the sampler from"
                " the strategy's dp x ep rank, as ByteTextDataModule does, and keep Trainer(use_distributed_sampler=False))"
            )
    return None


# -- localisation: module outputs at step 1 ----------------------------------------------------------
def _micro_batches(rank: dict[str, Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for ids in rank["batches"].get(0, []):
        out.extend(ids.chunk(rank["chunks"], dim=0) if rank["chunks"] > 1 else [ids])
    return out


def _merge_tp(pieces: list[torch.Tensor], expected: tuple[int, ...]) -> tuple[torch.Tensor | None, float, str]:
    """Pieces of the tp ranks ``[b, *local]`` -> ``[b, *expected]``; returns (tensor, tp disagreement, note)."""
    tp = len(pieces)
    local = tuple(pieces[0].shape[1:])
    if tp == 1 or local == expected:
        disagreement = max((rel_diff(p, pieces[0]) for p in pieces[1:]), default=0.0)
        return pieces[0], disagreement, ""
    if len(local) == len(expected):
        for dim in range(len(local)):
            others_equal = all(local[i] == expected[i] for i in range(len(local)) if i != dim)
            if others_equal and local[dim] * tp == expected[dim]:
                return torch.cat(pieces, dim=dim + 1), 0.0, ""
    return None, 0.0, f"per-sample shape {list(local)} on each of {tp} tp ranks, expected {list(expected)} or a 1/{tp} shard of it"


def _assemble(run: RunData, module: str, which: int, expected: dict[str, tuple[int, ...]] | None) -> tuple[dict[tuple[bytes, int, int], torch.Tensor], float, str]:
    """Per-sample full tensors ``{(sample key, occurrence, call in micro-batch): [S, ...]}`` of a module's
    output (``which=0``) or input (``which=1``) at step 1, from every rank's pieces."""
    from lightning_moe.cp import zigzag_unshard

    sizes = run.sizes
    cp = sizes.get("cp", 1)
    groups: dict[tuple[int, int], dict[tuple[int, int], dict[str, Any]]] = defaultdict(dict)
    for rank in run.ranks:
        if rank.get("forward") and module in rank["forward"]:
            c = rank["coords"]
            groups[(c["dp"], c["ep"])][(c["cp"], c["tp"])] = rank
    result: dict[tuple[bytes, int, int], torch.Tensor] = {}
    seen: dict[bytes, int] = defaultdict(int)
    disagreement, note = 0.0, ""
    for key in sorted(groups):
        grid = groups[key]
        cps = sorted({c for c, _ in grid})
        tps = sorted({t for _, t in grid})
        micro = [_micro_batches(grid[(c, tps[0])]) for c in cps]
        n_micro = len(micro[0])
        if n_micro == 0:
            return {}, 0.0, "no input_ids recorded (localisation needs dict batches with 'input_ids')"
        calls = {pos: rank["forward"][module] for pos, rank in grid.items()}
        n_calls = len(next(iter(calls.values())))
        if n_calls % n_micro:
            return {}, 0.0, f"{n_calls} calls in {n_micro} micro-batches"
        per_micro = n_calls // n_micro
        for j in range(n_micro):
            ids = zigzag_unshard([m[j] for m in micro], dim=1) if cp > 1 else micro[0][j]
            keys = []
            for k in _keys(ids):
                keys.append((k, seen[k]))
                seen[k] += 1
            for i in range(per_micro):
                cp_pieces = []
                for c in cps:
                    pieces = [calls[(c, t)][j * per_micro + i][which] for t in tps]
                    if any(p is None or p.dim() < 2 or p.shape[0] != ids.shape[0] for p in pieces):
                        return {}, 0.0, "not [batch, seq, ...]"
                    if expected is None:
                        merged, dis, why = pieces[0], 0.0, ""
                    else:
                        shape = expected.get("shape")
                        assert shape is not None
                        cp_shape = (shape[0] // cp, *shape[1:])
                        merged, dis, why = _merge_tp(pieces, cp_shape)
                    if merged is None:
                        return {}, 0.0, why
                    disagreement = max(disagreement, dis)
                    cp_pieces.append(merged)
                full = zigzag_unshard(cp_pieces, dim=1) if cp > 1 else cp_pieces[0]
                if expected is None and full.shape[1] != ids.shape[1]:
                    return {}, 0.0, "not [batch, seq, ...]"
                for (k, occ), sample in zip(keys, full):
                    result[(k, occ, i)] = sample
    return result, disagreement, note


def compare_module_outputs(single: RunData, layout: RunData, rtol: float) -> list[dict[str, Any]]:
    """One entry per module, in completion order at step 1: output and input rel differences."""
    types = {**layout.types, **single.types}
    entries = []
    for module in single.order("end_order"):
        entry: dict[str, Any] = {"module": module, "type": types.get(module, "?")}
        for which, label in ((0, "output"), (1, "input")):
            ref, _, why = _assemble(single, module, which, None)
            if not ref:
                entry[label] = None
                entry[f"{label}_note"] = why or "not compared"
                continue
            shape = tuple(next(iter(ref.values())).shape)
            if not any(rank.get("forward") and module in rank["forward"] for rank in layout.ranks):
                entry[label] = None  # e.g. the root module, which pipeline stages do not run as a whole
                entry[f"{label}_note"] = "not run as a module in the layout run"
                continue
            lay, disagreement, why = _assemble(layout, module, which, {"shape": shape})
            if not lay:
                entry[label] = math.inf
                entry[f"{label}_note"] = why or "missing in the layout run"
                continue
            common = [k for k in ref if k in lay]
            if not common:
                entry[label] = math.inf
                entry[f"{label}_note"] = "no sample in common"
                continue
            rel = rel_diff(torch.stack([lay[k] for k in common]), torch.stack([ref[k] for k in common]))
            entry[label] = rel
            if disagreement > rtol:
                entry[label] = max(rel, disagreement)
                entry[f"{label}_note"] = f"the tp ranks hold different values (rel {disagreement:.1e}): a partial result not reduced?"
        entries.append(entry)
    return entries


def _parent(module: str, known: set[str]) -> str | None:
    parts = module.split(".")
    for i in range(len(parts) - 1, -1, -1):
        name = ".".join(parts[:i])
        if name in known:
            return name
    return None


def localise(single: RunData, layout: RunData, report: VerifyReport) -> None:
    """Fill ``report.modules``, ``report.first_difference`` and ``report.localisation``."""
    rtol = report.rtol
    entries = compare_module_outputs(single, layout, rtol)
    report.modules = entries
    by_name = {e["module"]: e for e in entries}
    types = {e["module"]: e["type"] for e in entries}
    first = next((e for e in entries if e.get("output") is not None and not e["output"] <= rtol), None)
    if first is not None:
        name, rel = first["module"], first["output"]
        note = f" ({first['output_note']})" if first.get("output_note") else ""
        inp = first.get("input")
        if inp is None or inp <= rtol:
            inputs = "inputs equal" if inp is not None else "inputs not compared"
            report.first_difference = f"{name} ({first['type']}) output, rel {_fmt(rel)}{note}; {inputs}"
            report.localisation = {"kind": "module_output", "module": name, "type": first["type"], "rel": rel}
            return
        parent = _parent(name, set(by_name))
        where = parent if parent is not None else ""
        p_in = by_name.get(where, {}).get("input")
        report.first_difference = (
            f"inside {where or 'the root module'} ({types.get(where, '?')}), in its own forward code: the input of"
            f" its submodule {name} ({first['type']}) differs (rel {_fmt(inp)}) while every earlier module output"
            + (" and its own inputs are equal" if p_in is not None and p_in <= rtol else " is equal")
        )
        report.localisation = {"kind": "forward_code", "module": where, "type": types.get(where, "?"),
                               "rel": inp, "child": name}
        return
    compared = [e for e in entries if e.get("output") is not None]
    grads = first_gradient_difference(report)
    prefix = f"all {len(compared)} compared module outputs match at step 1"
    if grads is not None:
        report.first_difference = f"{grads} ({prefix})"
        row = next(p for p in report.parameters if p.diverges(rtol) == 0)
        report.localisation = {"kind": "gradient", "parameter": row.name, "module": row.module,
                               "type": row.module_type, "rel": row.grad_rel, "ratio": row.grad_ratio}
        return
    if report.losses and not report.losses[0]["rel"] <= rtol:
        report.first_difference = (
            f"the loss at step 1 (rel {_fmt(report.losses[0]['rel'])}), while {prefix}: the loss computation"
            " (training_step / loss_from_logits) or its reduction over ranks differs"
        )
        report.localisation = {"kind": "loss", "rel": report.losses[0]["rel"]}
        return
    finals = [p for p in report.parameters if p.diverges(rtol) == 1]
    if finals:
        report.first_difference = (
            f"parameter {finals[0].name} after the optimizer steps (rel {_fmt(finals[0].final_rel)}), while the"
            f" step-1 gradients and {prefix}: the optimizer step or a later step differs"
        )
        report.localisation = {"kind": "optimizer", "parameter": finals[0].name, "rel": finals[0].final_rel}


def describe_error(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """The root failure among the ranks' errors (peers of a failed rank fail later, in communication)."""
    def secondary(e: dict[str, Any]) -> bool:
        text = e["message"].lower()
        return any(s in text for s in ("connection closed", "connection reset", "broken pipe", "timed out", "gloo"))

    first = sorted(errors, key=lambda e: (secondary(e), e["time"]))[0]
    modules = first.get("modules") or []
    types = first.get("types") or {}
    where = ""
    if modules:
        inner = modules[-1]
        where = f" in {inner or 'the root module'} ({types.get(inner, '?')})"
        if len(modules) > 1:
            outer = modules[-2]
            where += f" inside {outer or 'the root module'} ({types.get(outer, '?')})"
    message = first["message"].splitlines()[0] if first["message"] else ""
    summary = f"rank {first['rank']} raised {first['type']} at step {first['step']}{where}: {message}"
    return {"summary": summary, "module": modules[-1] if modules else None, **first}

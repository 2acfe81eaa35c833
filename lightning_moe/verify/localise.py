"""Where the runs first differ, and why: the first module output (or its parent's code) at step 1,
the first gradient, a crash's module; whether micro-batching or statistics spanning several ranks
explain a FAIL, with the fix; whether both runs trained on the same samples.

Both runs must cut each step into the same micro-batches (:func:`compare_micro_batching`): batch-level
routing statistics are taken per micro-batch.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch

from lightning_moe.layout import layout_request, resolve_layout
from lightning_moe.verify.assembly import assemble_module_tensors, sample_keys, step_micro_batches
from lightning_moe.verify.numerics import describe_ratio, rel_diff
from lightning_moe.verify.report import VerifyReport, fmt_rel
from lightning_moe.verify.runs import RunData


# -- the first difference ----------------------------------------------------------------------------
def first_gradient_difference(report: VerifyReport) -> str | None:
    rows = [p for p in report.parameters if p.diverges(report.rtol) == 0]
    if not rows:
        return None
    first = rows[0]
    text = f"gradient of {first.name} ({first.module_type}) at step 1, rel {fmt_rel(first.grad_rel)}"
    if first.grad_ratio is not None:
        text += f"; {describe_ratio(first.grad_ratio)}"
    others = [p.name for p in rows[1:]]
    if others:
        text += f" (and {len(others)} more: {', '.join(others[:4])}{', ...' if len(others) > 4 else ''})"
    return text


def compare_module_outputs(single: RunData, layout: RunData, rtol: float) -> list[dict[str, Any]]:
    """One entry per module, in completion order at step 1: output and input rel differences."""
    types = {**layout.types, **single.types}
    entries = []
    for module in single.order("end_order"):
        entry: dict[str, Any] = {"module": module, "type": types.get(module, "?")}
        for which, label in ((0, "output"), (1, "input")):
            ref, _, why = assemble_module_tensors(single, module, which, None)
            if not ref:
                entry[label] = None
                entry[f"{label}_note"] = why or "not compared"
                continue
            shape = tuple(next(iter(ref.values())).shape)
            if not any(rank.get("forward") and module in rank["forward"] for rank in layout.ranks):
                entry[label] = None  # e.g. the root module, which pipeline stages do not run as a whole
                entry[f"{label}_note"] = "not run as a module in the layout run"
                continue
            lay, disagreement, why = assemble_module_tensors(layout, module, which, {"shape": shape})
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
                entry[f"{label}_note"] = (
                    f"the tp ranks hold different values (rel {disagreement:.1e}): a partial result not reduced?"
                )
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
            report.first_difference = f"{name} ({first['type']}) output, rel {fmt_rel(rel)}{note}; {inputs}"
            report.localisation = {"kind": "module_output", "module": name, "type": first["type"], "rel": rel}
            return
        parent = _parent(name, set(by_name))
        where = parent if parent is not None else ""
        p_in = by_name.get(where, {}).get("input")
        report.first_difference = (
            f"inside {where or 'the root module'} ({types.get(where, '?')}), in its own forward code: the input of"
            f" its submodule {name} ({first['type']}) differs (rel {fmt_rel(inp)}) while every earlier module output"
            + (" and its own inputs are equal" if p_in is not None and p_in <= rtol else " is equal")
        )
        report.localisation = {
            "kind": "forward_code",
            "module": where,
            "type": types.get(where, "?"),
            "rel": inp,
            "child": name,
        }
        return
    compared = [e for e in entries if e.get("output") is not None]
    grads = first_gradient_difference(report)
    prefix = f"all {len(compared)} compared module outputs match at step 1"
    if grads is not None:
        report.first_difference = f"{grads} ({prefix})"
        row = next(p for p in report.parameters if p.diverges(rtol) == 0)
        report.localisation = {
            "kind": "gradient",
            "parameter": row.name,
            "module": row.module,
            "type": row.module_type,
            "rel": row.grad_rel,
            "ratio": row.grad_ratio,
        }
        return
    if report.losses and not report.losses[0]["rel"] <= rtol:
        report.first_difference = (
            f"the loss at step 1 (rel {fmt_rel(report.losses[0]['rel'])}), while {prefix}: the loss computation"
            " (training_step / loss_from_logits) or its reduction over ranks differs"
        )
        report.localisation = {"kind": "loss", "rel": report.losses[0]["rel"]}
        return
    finals = [p for p in report.parameters if p.diverges(rtol) == 1]
    if finals:
        report.first_difference = (
            f"parameter {finals[0].name} after the optimizer steps (rel {fmt_rel(finals[0].final_rel)}), while the"
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


# -- the data: the same samples, the same micro-batches ----------------------------------------------
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
        groups_a = sorted(tuple(sorted(sample_keys(ids))) for m in a for ids in m)
        groups_b = sorted(tuple(sorted(sample_keys(ids))) for m in b for ids in m)
        if groups_a != groups_b:
            return {
                "step": step + 1,
                "single": describe_micro_batching(a),
                "layout": describe_micro_batching(b),
                "single_micro_batch_size": micro_batch_size_of(single),
                "layout_micro_batch_size": micro_batch_size_of(layout),
            }
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
    what = (
        f"the one-process run cut step {mismatch['step']} into {mismatch['single']}, the layout into"
        f" {mismatch['layout']}"
    )
    if report.passed:
        report.notes.append(f"micro-batching differs ({what}); the results agree all the same")
        return
    single_size, size = mismatch["single_micro_batch_size"], mismatch["layout_micro_batch_size"]
    if single_size != size and pin is None:
        fix = (
            "give the data module a micro_batch_size argument (verification then runs the reference with the"
            f" layout's, {size}) or a micro-batch size that does not depend on the layout"
        )
    elif single_size != size:
        fix = f"set {setting} to {size} (the same micro-batch size on both runs)"
    else:
        fix = (
            "put the same samples in each micro-batch on every layout: micro-batch j of a step on data-parallel"
            " rank j % (dp*ep), as lightning_moe.data.LayoutInvariantSampler does"
        )
    fix += "; or take the load-balancing statistics per sequence (load_balancing='seq_aux_loss'), which micro-batching does not change"
    loc = report.localisation or {}
    # Micro-batching changes only what is computed over the micro-batch: the routing statistics
    # (whose aux-loss gradient reaches the routers in backward) and batch-dependent routing.
    explained = loc.get("kind") in (None, "gradient", "loss", "optimizer") or (
        loc.get("kind") == "module_output" and loc.get("module") in routing
    )
    lead = "explained by micro-batching" if explained else "micro-batching differs as well (fix it first)"
    explanation = (
        f"{lead}: {what}, and statistics of the micro-batch ({_batch_statistics(routing)}) are taken over"
        f" other samples. Fix: {fix}"
    )
    report.first_difference = f"{report.first_difference}; {explanation}" if report.first_difference else explanation
    if report.localisation is not None:
        report.localisation["explained_by"] = "micro_batching" if explained else None
    else:
        report.localisation = {"kind": "micro_batching", "explained_by": "micro_batching"}


def layout_dependent_statistics(routing: dict[str, dict[str, Any]], layout: dict[str, Any]) -> list[str]:
    """The MoE settings whose statistics are taken over more tokens than one micro-batch on ``layout``
    (so no one-process run can reproduce them), each with what it spans."""
    try:
        resolved = resolve_layout(None, **{"dp": 1, **layout_request(layout)})
    except ValueError:
        return []  # not a layout this library resolves: nothing it can explain
    dp_ep, shard, ep = resolved.dp_ep, resolved.group_size("sequence"), resolved.ep
    by_reason: dict[str, list[str]] = defaultdict(list)
    for module, settings in routing.items():
        if settings.get("load_balancing") == "global_aux_loss" and settings.get("aux_loss_coeff", 1) and dp_ep > 1:
            by_reason[
                f"load_balancing='global_aux_loss' counts the dp x ep = {dp_ep} micro-batches of one micro-step"
                " at once (one on one process)"
            ].append(module)
        if settings.get("routing") == "expert_choice" and ep > 1:
            by_reason[
                f"routing='expert_choice' lets each expert pick among the tokens of the ep = {ep} ranks"
                " (of one micro-batch on one process)"
            ].append(module)
        if settings.get("load_balancing") == "sinkhorn" and shard > 1:
            by_reason[
                f"load_balancing='sinkhorn' balances each of the cp x tp = {shard} sequence shards, not the micro-batch"
            ].append(module)
    return [
        f"{reason} in {', '.join(m[:3])}{f' and {len(m) - 3} more' if len(m) > 3 else ''}"
        for reason, m in by_reason.items()
    ]


def explain_batch_statistics(report: VerifyReport, routing: dict[str, dict[str, Any]]) -> None:
    """On a FAIL that the routing statistics can explain (equal forward, or a difference starting in
    an MoE layer), name the settings whose statistics span several ranks on this layout, and the fix."""
    if report.passed or report.micro_batching is not None:
        return
    reasons = layout_dependent_statistics(routing, report.layout)
    loc = report.localisation or {}
    if not reasons or not (
        loc.get("kind") in ("gradient", "loss", "optimizer")
        or (loc.get("kind") == "module_output" and loc.get("module") in routing)
    ):
        return
    explanation = (
        "explained by batch-level statistics that span several ranks on this layout, by design: "
        + "; ".join(reasons)
        + ". Fix: verify with per-micro-batch statistics (load_balancing='aux_loss'"
        " or 'seq_aux_loss', routing='topk'), which one process reproduces; keep these settings only if their"
        " layout dependence is wanted"
    )
    report.first_difference = f"{report.first_difference}; {explanation}" if report.first_difference else explanation
    if report.localisation is not None:
        report.localisation["explained_by"] = "batch_statistics"


def check_same_samples(single: RunData, layout: RunData) -> str | None:
    """A message when the two runs did not train on the same samples at some step."""
    for step in range(len(single.losses)):
        a, b = _step_rows(single, step), _step_rows(layout, step)
        if a is None or b is None:
            return None
        if sorted(sample_keys(torch.stack(a)) if a else []) != sorted(sample_keys(torch.stack(b)) if b else []):
            return (
                f"the layout run trained on other samples than the single run at step {step + 1}: the data module"
                " must give every data-parallel rank its share of the same global batch (build the sampler from"
                " the strategy's dp x ep rank, as ByteTextDataModule does, and keep Trainer(use_distributed_sampler=False))"
            )
    return None

"""Full tensors from the ranks' pieces: the samples of each step over the data-parallel ranks
(context-parallel zigzag shards unsharded, pipeline chunks split) and, for localisation, each
module's output and input at step 1 (tensor-parallel shards concatenated, context-parallel shards
unsharded, data-parallel ranks and pipeline stages matched by their samples)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from lightning_moe.verify.numerics import rel_diff
from lightning_moe.verify.runs import RunData


def sample_keys(ids: torch.Tensor) -> list[bytes]:
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


def _micro_batches(rank: dict[str, Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for ids in rank["batches"].get(0, []):
        out.extend(ids.chunk(rank["chunks"], dim=0) if rank["chunks"] > 1 else [ids])
    return out


def merge_tp(pieces: list[torch.Tensor], expected: tuple[int, ...]) -> tuple[torch.Tensor | None, float, str]:
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
    return (
        None,
        0.0,
        f"per-sample shape {list(local)} on each of {tp} tp ranks, expected {list(expected)} or a 1/{tp} shard of it",
    )


def assemble_module_tensors(
    run: RunData, module: str, which: int, expected: dict[str, tuple[int, ...]] | None
) -> tuple[dict[tuple[bytes, int, int], torch.Tensor], float, str]:
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
            for k in sample_keys(ids):
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
                        merged, dis, why = merge_tp(pieces, cp_shape)
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

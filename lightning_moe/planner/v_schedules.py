"""The V schedules (``ZBVZeroBubble``, ``DualPipeV``: two stages per rank placed in a V) played out
from torch's own per-rank action lists, for their bubble, activations in flight and paired passes.

Each rank runs its actions in torch's order (``_calculate_single_rank_operations`` of
``ScheduleZBVZeroBubble`` / ``ScheduleDualPipeV``), an action starting once the rank is free and its
inputs have arrived: a stage's forward needs the previous stage's forward of that micro-batch, a
stage's backward (full ``B`` or input-gradient ``I``) the next stage's (the last stage its own
forward: the loss). Point-to-point transfers take no time here (the estimate counts them apart).
Costs are in forwards of one stage: ``F = 1``, ``B = 2`` (backward computes twice the forward's
FLOPs, :data:`~lightning_moe.planner.flops.RECOMPUTE_FORWARDS`' convention), split ``I = W = 1`` as
the zero-bubble paper assumes (Qi et al. 2024, arXiv 2401.10241, §2); ``OVERLAP_F_B`` runs its
forward and full backward one after the other on the device (``F + B``), their communication
interleaved.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from types import SimpleNamespace

from lightning_moe.layout import V_SCHEDULES

STAGES_PER_RANK = 2
# Seconds of each computation kind of torch's action lists, in one stage's forwards
ACTION_COST = {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}


@dataclass(frozen=True)
class Action:
    """One computation of a rank's list: ``kind`` (``F``, ``I``, ``W``, ``B``) of ``stage`` on ``microbatch``."""

    kind: str
    stage: int
    microbatch: int


@dataclass(frozen=True)
class VScheduleTimeline:
    """A V schedule played out on ``pp`` ranks over ``microbatches`` micro-batches (unit costs).

    ``makespan``: the pipeline step, in one stage's forwards. ``busy``: each rank's compute in the
    same unit (every rank computes ``2 x microbatches x (F + B)``). ``in_flight``: per rank, the most
    (stage, micro-batch) activation sets held at once, from a stage's forward to its weight
    gradient (``W``, or the full ``B``), which still reads the saved inputs. ``overlapped_pairs``:
    per rank, the ``OVERLAP_F_B`` actions (a forward run with another micro-batch's full backward)."""

    makespan: float
    busy: float
    in_flight: tuple[int, ...]
    overlapped_pairs: tuple[int, ...]

    @property
    def bubble_fraction(self) -> float:
        return 1.0 - self.busy / self.makespan


def rank_actions(schedule: str, pp: int, microbatches: int, pp_rank: int) -> list[tuple[Action, ...]]:
    """Rank ``pp_rank``'s computations in torch's order, each a tuple of the actions run as one step
    (two for ``OVERLAP_F_B``, else one); torch's empty slots (``None``) dropped."""
    if schedule not in V_SCHEDULES:
        raise ValueError(f"pp_schedule={schedule!r} is not a V schedule {V_SCHEDULES}")
    # Imported here: the rest of the cost model needs no torch. The schedules' action lists depend
    # only on these three numbers, so they are computed without building stages.
    from torch.distributed.pipelining import schedules

    cls = schedules.ScheduleZBVZeroBubble if schedule == "ZBVZeroBubble" else schedules.ScheduleDualPipeV
    sizes = SimpleNamespace(pp_group_size=pp, _n_microbatches=microbatches, num_stages=STAGES_PER_RANK * pp)
    steps = []
    for action in cls._calculate_single_rank_operations(sizes, pp_rank):
        if action is None:
            continue
        parts = action.sub_actions or (action,)
        steps.append(tuple(Action(_kind(a.computation_type), a.stage_index, a.microbatch_index) for a in parts))
    return steps


def _kind(computation_type: object) -> str:
    """``F``, ``I``, ``W`` or ``B`` (full backward) for one of torch's computation types."""
    return {"FORWARD": "F", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W", "FULL_BACKWARD": "B"}[computation_type.name]  # type: ignore[attr-defined]


@lru_cache(maxsize=256)
def v_schedule_timeline(schedule: str, pp: int, microbatches: int) -> VScheduleTimeline:
    """Play out ``schedule`` (see the module docstring); ``ValueError`` if it would deadlock."""
    last_stage = STAGES_PER_RANK * pp - 1
    lists = [rank_actions(schedule, pp, microbatches, r) for r in range(pp)]
    done: dict[tuple[str, int, int], float] = {}  # (F or G for the input gradient, stage, micro-batch) -> finish
    clock = [0.0] * pp
    position = [0] * pp
    while any(position[r] < len(lists[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while position[r] < len(lists[r]):
                step = lists[r][position[r]]
                needs = [need for action in step for need in _inputs(action, last_stage)]
                if any(need not in done for need in needs):
                    break
                start = max([clock[r], *(done[need] for need in needs)])
                clock[r] = start + sum(ACTION_COST[a.kind] for a in step)
                for action in step:
                    if action.kind == "F":
                        done[("F", action.stage, action.microbatch)] = clock[r]
                    elif action.kind in ("I", "B"):
                        done[("G", action.stage, action.microbatch)] = clock[r]
                position[r] += 1
                progressed = True
        if not progressed:
            raise ValueError(f"{schedule} with pp={pp}, microbatches={microbatches} deadlocks in the simulation")
    busy = STAGES_PER_RANK * microbatches * (ACTION_COST["F"] + ACTION_COST["B"])
    return VScheduleTimeline(
        makespan=max(clock),
        busy=busy,
        in_flight=tuple(_peak_in_flight(steps) for steps in lists),
        overlapped_pairs=tuple(sum(len(step) == 2 for step in steps) for steps in lists),
    )


def _inputs(action: Action, last_stage: int) -> list[tuple[str, int, int]]:
    """What ``action`` waits for: forward from the previous stage, gradient from the next one."""
    if action.kind == "F":
        return [("F", action.stage - 1, action.microbatch)] if action.stage > 0 else []
    if action.kind == "W":
        return [("G", action.stage, action.microbatch)]
    own_forward = ("F", action.stage, action.microbatch)
    return [own_forward] if action.stage == last_stage else [own_forward, ("G", action.stage + 1, action.microbatch)]


def _peak_in_flight(steps: list[tuple[Action, ...]]) -> int:
    """The most activation sets one rank holds at once: a forward adds one, the pass that computes
    the weight gradient (``W`` or the full ``B``) frees it."""
    held = peak = 0
    for step in steps:
        for action in step:
            held += {"F": 1, "W": -1, "B": -1}.get(action.kind, 0)
            peak = max(peak, held)
    return peak

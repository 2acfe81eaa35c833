"""The ``cp_comm`` kinds: how attention crosses the cp ranks (``MoE5DStrategy(cp_comm=...)``, the planner's
``Layout.cp_comm``).

- ``"ring"``: ring attention, K/V blocks passed around the cp ranks behind the block compute
  (:func:`~lightning_moe.cp.ring_attention`);
- ``"a2a"``: all-to-all (Ulysses) attention, sequence shards exchanged for head shards
  (:mod:`lightning_moe.cp.ulysses`; the query heads per tp rank must divide by cp).

Plain strings to users and Hydra: ``CpComm.RING == "ring"``.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["CP_COMM_KINDS", "CpComm", "check_cp_comm"]


class CpComm(str, Enum):
    """A ``cp_comm`` kind; a ``str`` equal to its value (``enum.StrEnum`` is Python >= 3.11, the floor 3.10)."""

    RING = "ring"
    A2A = "a2a"

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__  # f"{kind}" is its value on every Python


# The kinds as plain strings, in order (what error messages list: ('ring', 'a2a')).
CP_COMM_KINDS: tuple[str, ...] = tuple(k.value for k in CpComm)


def check_cp_comm(cp_comm: object) -> None:
    """``ValueError`` naming the kinds for a ``cp_comm`` that is none of them (the strategy's config and the
    planner's layouts both ask here)."""
    if cp_comm not in CP_COMM_KINDS:
        raise ValueError(
            f"cp_comm={cp_comm!r} must be one of {CP_COMM_KINDS}: 'ring' passes K/V blocks around the cp ranks,"
            " 'a2a' exchanges sequence shards for head shards"
        )

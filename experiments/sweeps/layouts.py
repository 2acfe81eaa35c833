"""Print every valid parallel layout of a world size, as the override that sweeps them.

``conf/experiment/layout_sweep.yaml`` lists the layouts of 4 processes; for another world size or
expert count, print the list and pass it on the command line (it replaces the config's list):

    python -m experiments.sweeps.layouts --world-size 8 --num-experts 16
    # parallel={dp:8,ep:1},{dp:4,ep:2},{dp:2,ep:4},{dp:1,ep:8}
    python -m lightning_moe.train -m experiment=layout_sweep 'parallel={dp:8,ep:1},{dp:4,ep:2},...'

Only dp and ep vary: ``MoE5DStrategy`` rejects tp, cp and pp above 1 so far. Add them to
``SWEPT_DIMS`` as they land (with their own constraints, e.g. tp dividing the head count).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence

SWEPT_DIMS: tuple[str, ...] = ("dp", "ep")


def _factorizations(n: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every ordered tuple of ``parts`` positive integers whose product is ``n``."""
    if parts == 1:
        yield (n,)
        return
    for first in range(n, 0, -1):
        if n % first == 0:
            for rest in _factorizations(n // first, parts - 1):
                yield (first, *rest)


def valid_layouts(world_size: int, num_experts: int) -> list[dict[str, int]]:
    """Layouts of ``world_size`` processes over :data:`SWEPT_DIMS` with ep dividing ``num_experts``.

    Example::

        valid_layouts(4, num_experts=8)  # [{"dp": 4, "ep": 1}, {"dp": 2, "ep": 2}, {"dp": 1, "ep": 4}]
    """
    layouts = [dict(zip(SWEPT_DIMS, sizes)) for sizes in _factorizations(world_size, len(SWEPT_DIMS))]
    return [layout for layout in layouts if num_experts % layout["ep"] == 0]


def sweep_override(layouts: Sequence[dict[str, int]]) -> str:
    """``parallel={dp:4,ep:1},{dp:2,ep:2}``: Hydra's sweep over the given layouts."""
    return "parallel=" + ",".join("{" + ",".join(f"{k}:{v}" for k, v in layout.items()) + "}" for layout in layouts)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.sweeps.layouts", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, required=True, help="processes in all (devices x nodes)")
    parser.add_argument("--num-experts", type=int, default=8, help="model.moe.num_experts (ep must divide it)")
    args = parser.parse_args(argv)
    print(sweep_override(valid_layouts(args.world_size, args.num_experts)))


if __name__ == "__main__":
    main()

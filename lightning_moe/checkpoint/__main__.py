"""``python -m lightning_moe.checkpoint inspect|consolidate|to-hf``: DCP checkpoints on a laptop, no process group.

Examples::

    python -m lightning_moe.checkpoint inspect outputs/run/checkpoints/last.ckpt
    python -m lightning_moe.checkpoint consolidate outputs/run/checkpoints/last.ckpt model.pt
    python -m lightning_moe.checkpoint to-hf outputs/run/checkpoints/last.ckpt hf_out/
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lightning_moe.checkpoint.consolidate import consolidate, describe, save_atomic


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_moe.checkpoint", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser("inspect", help="layout, step, samples seen, tensor names, global shapes and bytes")
    inspect.add_argument("checkpoint", type=Path)
    merge = commands.add_parser("consolidate", help="one full, unsharded state dict (torch.save file)")
    merge.add_argument("checkpoint", type=Path)
    merge.add_argument("output", type=Path)
    merge.add_argument("--with-optimizer", action="store_true", help="also the optimizer state (flat, per parameter)")
    to_hf = commands.add_parser("to-hf", help="a Hugging Face folder (safetensors + config) from a checkpoint")
    to_hf.add_argument("checkpoint", type=Path)
    to_hf.add_argument("output", type=Path)
    to_hf.add_argument(
        "--model",
        choices=("moegpt", "hf"),
        default=None,
        help="which module wrote the checkpoint (default: told by its hyper-parameters)",
    )
    args = parser.parse_args(argv)
    try:
        if args.command == "inspect":
            print(describe(args.checkpoint))
        elif args.command == "consolidate":
            state = consolidate(args.checkpoint, with_optimizer=args.with_optimizer)
            save_atomic(state, args.output)
            print(f"{len(state)} tensors -> {args.output}")
        else:
            from lightning_moe.checkpoint.to_hf import checkpoint_to_hf

            checkpoint_to_hf(args.checkpoint, args.output, model=args.model)
            print(f"Hugging Face folder: {args.output}")
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

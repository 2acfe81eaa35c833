"""Parallel folding on 2 simulated nodes: where the expert all-to-all goes, folded vs unfolded.

Two training runs of the same tiny MoEGPT on 8 CPU processes as 2 nodes of 4
(``ranks_per_node=4``), both with attention at tp2 and experts at ep4, so each moves the same
tokens to the same number of expert ranks:

- unfolded ``tp2·ep4``: ep is a mesh dim of its own, outside tp, so an ep group takes ranks
  ``{t, t+2, t+4, t+6}``, two of them on the other node;
- folded ``tp2·ep4 fold_ep=tp, dp2``: the ep group spans the tp ranks and the mesh's ep dim (2),
  ranks ``{0, 1, 2, 3}``: one node.

Both split the samples over 4 ranks (dp x the mesh's ep). The comm accounting's ``comm/ep_bytes``
and ``comm/ep_internode_bytes`` (the part sent to ranks on another node) of the last optimizer
step, per rank, come from each run's CSV log.

    python -m experiments.bench.ep_folding
"""

from __future__ import annotations

import csv
import tempfile
from pathlib import Path

from experiments.bench.cli import run_training

RUN = [
    "logger=csv", "trainer.max_steps=2", "trainer.log_every_n_steps=1", "~callbacks.progress_bar",
    "~callbacks.expert_load_plots", "trainer.limit_val_batches=0", "trainer.val_check_interval=null",
    "data.seq_len=64", "data.global_batch_size=8", "data.micro_batch_size=2", "data.max_corpus_bytes=200000",
    "model.hidden_size=64", "model.num_layers=2", "model.num_heads=4", "model.moe.num_experts=8",
    "model.moe.ffn_hidden_size=64", "parallel.ranks_per_node=4",
]  # fmt: skip

LAYOUTS = {
    "unfolded tp2·ep4": ["parallel.tp=2", "parallel.ep=4", "parallel.dp=1"],
    "folded tp2·ep4 (fold_ep=tp), dp2": ["parallel.tp=2", "parallel.ep=4", "parallel.fold_ep=tp", "parallel.dp=2"],
}


def _last_step_bytes(run_dir: Path, overrides: list[str]) -> tuple[float, float]:
    """``(ep bytes, inter-node ep bytes)`` per rank in the run's last optimizer step."""
    run_training([*RUN, *overrides], run_dir)
    rows = [r for r in csv.DictReader((run_dir / "csv" / "metrics.csv").open()) if r.get("comm/ep_bytes")]
    last = rows[-1]
    return float(last["comm/ep_bytes"]), float(last.get("comm/ep_internode_bytes") or 0.0)


def run_ep_folding_bench() -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, overrides) in enumerate(LAYOUTS.items()):
            ep_bytes, internode = _last_step_bytes(Path(tmp) / f"run{i}", overrides)
            rows.append({
                "layout (8 ranks, 2 nodes x 4)": label,
                "ep bytes/step/rank": ep_bytes,
                "inter-node bytes/step/rank": internode,
                "share across nodes": internode / ep_bytes if ep_bytes else 0.0,
            })  # fmt: skip
    return rows


def main() -> None:
    from experiments.bench.table import print_table

    print("Parallel folding: expert all-to-all bytes inside vs across simulated nodes (tiny MoEGPT, fp32, last step)")
    print_table(run_ep_folding_bench())


if __name__ == "__main__":
    main()

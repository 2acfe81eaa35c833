"""A user's own MoE LightningModule, unlike MoEGPT, trained under MoE5DStrategy (docs/own-module.md's tested example).

Its own attention (biased q/k/v/out projections through ``F.scaled_dot_product_attention``),
LayerNorms, learned positions, a ``blocks`` ModuleList, ``MoELayer`` FFNs with DeepSeek-V3-style
expert bias, and the two hooks a module may provide:

- ``tensor_parallel_plan(self)`` (``UserMoELM``: attention projections only, no sequence-parallel
  styles; the LayerNorms, embeddings and head stay replicated) or
  ``tensor_parallel_plan(self, sequence_parallel: bool)`` (``UserMoELMWithSP``: a DTensor residual
  stream sharded on the sequence);
- the pipeline split convention: ``pipeline_layers_attr = "blocks"`` plus the modules of the first
  and last stages; on other stages those are None and ``forward`` passes hidden states through.

Run as a script (Lightning's launcher re-executes it per process)::

    python tests/scripts/user_moe_module.py OUT_DIR --tp 2 --ep 2 [--cp N --pp N --etp N --no-sp --sp-plan]

or call :func:`train` in processes that exist already (``train_on_this_rank`` on every rank of a
test pool, as ``tests/test_user_modules.py`` does). Rank 0 writes OUT_DIR/summary.json (per-step
losses); every rank writes OUT_DIR/bias_rank<r>.json (its MoE layers' expert biases by parameter name).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from lightning_moe import MoE5DStrategy
from lightning_moe.callbacks import SummaryCallback
from lightning_moe.data import ByteTextDataModule
from lightning_moe.moe import MoELayer

VOCAB, HIDDEN, HEADS, SEQ, LAYERS = 256, 32, 4, 32, 2
BIAS_UPDATE_RATE = 0.05


class SelfAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads  # global count: the strategy checks that tp divides it
        self.head_dim = hidden // num_heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq = x.shape[0], x.shape[1]
        # -1 heads: under tensor parallelism each rank holds num_heads / tp of them.
        q, k, v = (
            proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(HIDDEN)
        self.attn = SelfAttention(HIDDEN, HEADS)
        self.ln2 = nn.LayerNorm(HIDDEN)
        self.moe = MoELayer(
            HIDDEN,
            48,
            num_experts=4,
            top_k=2,
            score_func="sigmoid",
            expert_bias=True,
            bias_update_rate=BIAS_UPDATE_RATE,
            shared_expert_hidden_size=32,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


class UserMoELM(L.LightningModule):
    pipeline_layers_attr = "blocks"
    pipeline_first_stage_modules = ("embed", "pos")
    pipeline_last_stage_modules = ("ln_f", "head")

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Embedding(SEQ, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(HIDDEN)
        # No bias, like most LM heads: nn.Linear with a bias returns a view for 3D inputs, on which
        # FSDP warns (an in-place op on the root module's output would skip its backward hook).
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if self.embed is None:  # a later pipeline stage: hidden states in
            h = input_ids
        else:
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
            h = self.embed(input_ids) + self.pos(position_ids)
        for block in self.blocks:
            h = block(h)
        return h if self.head is None else self.head(self.ln_f(h))

    def loss_from_logits(self, logits, labels, loss_mask=None, loss_token_count=None) -> torch.Tensor:  # noqa: ANN001
        per_token = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
        # Under context parallelism the strategy passes the micro-batch's loss tokens per cp rank.
        count = per_token.numel() if loss_token_count is None else loss_token_count
        return per_token.sum() / count

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        logits = self(batch["input_ids"], batch.get("position_ids"))
        return self.loss_from_logits(logits, batch["labels"], loss_token_count=batch.get("loss_token_count"))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def tensor_parallel_plan(self) -> dict[str, ParallelStyle]:
        """Heads split over tp; everything else (norms, embeddings, head, MoE tokens) replicated."""
        plan: dict[str, ParallelStyle] = {
            f"blocks.*.attn.{name}": ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")
        }
        plan["blocks.*.attn.out_proj"] = RowwiseParallel()
        return plan


class UserMoELMWithSP(UserMoELM):
    """The same model with a sequence-parallel plan: the residual stream is a DTensor sharded on the sequence."""

    def tensor_parallel_plan(self, sequence_parallel: bool = True) -> dict[str, ParallelStyle]:
        if not sequence_parallel:
            return super().tensor_parallel_plan()
        plan: dict[str, ParallelStyle] = {
            "blocks.0": PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=False
            ),
            "blocks.*.ln1": SequenceParallel(use_local_output=False),
            "blocks.*.ln2": SequenceParallel(use_local_output=False),  # the MoE layer receives sequence shards
            "blocks.*.attn": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=False
            ),
            "blocks.*.attn.out_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            "ln_f": SequenceParallel(use_local_output=False),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        }
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"blocks.*.attn.{name}"] = ColwiseParallel()
        return plan


class ExpertBiasRecorder(L.Callback):
    """Every rank writes its MoE layers' expert biases at the end of training."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        biases = {name: buf.tolist() for name, buf in pl_module.named_buffers() if name.endswith("expert_bias")}
        (self.out_dir / f"bias_rank{trainer.global_rank}.json").write_text(json.dumps(biases))


def train(
    out_dir: str | Path,
    steps: int = 6,
    tp: int = 1,
    cp: int = 1,
    ep: int = 1,
    pp: int = 1,
    etp: int | None = None,
    sequence_parallel: bool = True,
    sp_plan: bool = False,
) -> None:
    """Train the user module on ``tp*cp*ep*pp`` CPU processes (Lightning launches the missing ones,
    or finds them started: ``LOCAL_RANK`` set and the process group initialised)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    L.seed_everything(0)
    strategy = MoE5DStrategy(tp=tp, cp=cp, ep=ep, pp=pp, etp=etp, sequence_parallel=sequence_parallel)
    devices = tp * cp * ep * pp
    # 8 samples per step in micro-batches of 2: gradient accumulation on every layout.
    data = ByteTextDataModule(seq_len=SEQ, global_batch_size=8, micro_batch_size=2, max_corpus_bytes=200_000)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        gradient_clip_val=0.5,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        limit_val_batches=0,
        default_root_dir=str(out_dir),
        callbacks=[SummaryCallback(), ExpertBiasRecorder(out_dir)],
    )
    model = UserMoELMWithSP() if sp_plan else UserMoELM()
    trainer.fit(model, datamodule=data)


def train_on_this_rank(out_dir: str, **kwargs: object) -> str:
    """:func:`train` on one rank of processes that exist already (a test pool: the gloo group of
    ``tp*cp*ep*pp`` processes initialised), Lightning told so as under torchrun; returns what it
    warned, logged and printed (every warning, also one an earlier task of the process emitted)."""
    from tests.launched_rank import launched_rank  # a test pool's rank: the tests package is importable

    with launched_rank(capture=True) as output:
        train(out_dir, **kwargs)
    return output.text


def parse_args(argv: list[str] | None = None) -> dict:
    """The command line (``sys.argv[1:]`` by default) as keyword arguments of :func:`train`."""
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", type=Path)
    for name in ("tp", "cp", "ep", "pp"):
        parser.add_argument(f"--{name}", type=int, default=1)
    parser.add_argument("--etp", type=int, default=None)
    parser.add_argument("--no-sp", action="store_true", help="MoE5DStrategy(sequence_parallel=False)")
    parser.add_argument("--sp-plan", action="store_true", help="UserMoELMWithSP instead of UserMoELM")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args(argv)
    return {
        "out_dir": str(args.out_dir),
        "steps": args.steps,
        "tp": args.tp,
        "cp": args.cp,
        "ep": args.ep,
        "pp": args.pp,
        "etp": args.etp,
        "sequence_parallel": not args.no_sp,
        "sp_plan": args.sp_plan,
    }


def main() -> None:
    train(**parse_args())


if __name__ == "__main__":
    main()

"""One run of a user's MoE module under MoE5DStrategy exercising the Lightning features of issue 14.

    python tests/scripts/lightning_features_run.py OUT_DIR [--tp N --cp N --ep N --pp N --dp N]
        [--precision bf16-mixed] [--steps 2] [--activation-checkpointing full|selective] [--compile] [--callbacks]
        [--fail forward|backward|optimizer|sigkill --fail-rank R --timeout 30]

fit (``--steps`` optimizer steps), then ``trainer.validate``, ``trainer.test`` and ``trainer.predict``
with the module's own ``validation_step``/``test_step``/``predict_step`` on a fixed set of
``NUM_SAMPLES`` sequences split over the dp x ep replicas. Each rank writes
``OUT_DIR/rank<r>.json``: its dp x ep rank, the train losses (rank 0 via SummaryCallback's
summary.json), the validate/test metrics and its predictions ``{sample index: logits}`` (as lists).
With ``--fail`` one rank fails at the second training step in that phase (or SIGKILLs itself).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_moe import MoE5DStrategy  # noqa: E402
from lightning_moe.callbacks import CommAccountingCallback, SummaryCallback  # noqa: E402
from lightning_moe.data import ByteTextDataModule  # noqa: E402
from tests.scripts.user_moe_module import SEQ, VOCAB, UserMoELM  # noqa: E402

NUM_SAMPLES, EVAL_BATCH = 8, 2
GLOBAL_BATCH, MICRO_BATCH = 8, 2
FAIL_STEP = 1


class FeatureLM(UserMoELM):
    def __init__(self, fail: str | None = None, fail_rank: int = 0, out_dir: Path | None = None) -> None:
        super().__init__()
        self.fail, self.fail_rank, self.out_dir = fail, fail_rank, out_dir

    def _failing_now(self) -> bool:
        failing = self.fail is not None and self.global_rank == self.fail_rank and self.global_step == FAIL_STEP
        if failing and self.out_dir is not None:  # when the failure happens, for the time it takes to end
            (self.out_dir / "failing_at.json").write_text(json.dumps(time.time()))
        return failing

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        if self._failing_now() and self.fail == "forward":
            raise RuntimeError("injected failure in forward")
        if self._failing_now() and self.fail == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        loss = super().training_step(batch, batch_idx)
        if self._failing_now() and self.fail == "backward":

            def fail_in_backward(grad: torch.Tensor) -> torch.Tensor:
                raise RuntimeError("injected failure in backward")

            loss.register_hook(fail_in_backward)
        return loss

    def optimizer_step(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        if self._failing_now() and self.fail == "optimizer":
            raise RuntimeError("injected failure in the optimizer step")
        super().optimizer_step(*args, **kwargs)

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.8**step)  # an LR that moves
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def _eval_loss(self, batch: dict) -> torch.Tensor:
        logits = self(batch["input_ids"], batch.get("position_ids"))
        return self.loss_from_logits(logits, batch["labels"], loss_token_count=batch.get("loss_token_count"))

    def validation_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self._eval_loss(batch)
        self.log("val/loss", loss, sync_dist=True, batch_size=batch["input_ids"].shape[0])
        return loss

    def test_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self._eval_loss(batch)
        self.log("test/loss", loss, sync_dist=True, batch_size=batch["input_ids"].shape[0])
        return loss

    def predict_step(self, batch: dict, batch_idx: int) -> dict:
        return {"index": batch["index"], "logits": self(batch["input_ids"], batch.get("position_ids"))}


class StopRecorder(L.Callback):
    """Every rank writes the step it stopped at."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        (self.out_dir / f"stop_rank{trainer.global_rank}.json").write_text(json.dumps({"step": trainer.global_step}))


def eval_loader(trainer: L.Trainer) -> DataLoader:
    """The fixed evaluation samples of this dp x ep replica (strided: each sample on one replica)."""
    tokens = torch.randint(0, VOCAB, (NUM_SAMPLES, SEQ + 1), generator=torch.Generator().manual_seed(7))
    kwargs = trainer.strategy.distributed_sampler_kwargs
    mine = range(kwargs["rank"], NUM_SAMPLES, kwargs["num_replicas"])
    samples = [{"input_ids": tokens[i, :-1], "labels": tokens[i, 1:], "index": torch.tensor(i)} for i in mine]
    return DataLoader(samples, batch_size=EVAL_BATCH, shuffle=False)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", type=Path)
    for name in ("tp", "cp", "ep", "pp", "dp"):
        parser.add_argument(f"--{name}", type=int, default=1)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--fail", choices=("forward", "backward", "optimizer", "sigkill"), default=None)
    parser.add_argument("--fail-rank", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=None, help="process-group timeout, seconds")
    parser.add_argument("--no-eval", action="store_true")
    parser.add_argument("--activation-checkpointing", default="none")
    parser.add_argument("--compile", action="store_true", help="MoE5DStrategy(compile=True)")
    parser.add_argument("--deterministic", action="store_true", help="MoE5DStrategy(deterministic=True)")
    parser.add_argument(
        "--callbacks",
        action="store_true",
        help="validate every step; ModelCheckpoint top-2, EarlyStopping, LearningRateMonitor, CSV logs",
    )
    return parser.parse_args(argv)


def devices_of(args: argparse.Namespace) -> int:
    return args.tp * args.cp * args.ep * args.pp * args.dp


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)

    L.seed_everything(0)
    extra = {} if args.timeout is None else {"timeout": timedelta(seconds=args.timeout)}
    strategy = MoE5DStrategy(
        tp=args.tp,
        cp=args.cp,
        ep=args.ep,
        pp=args.pp,
        dp=args.dp,
        activation_checkpointing=args.activation_checkpointing,
        compile=args.compile,
        deterministic=args.deterministic,
        **extra,
    )
    devices = devices_of(args)
    data = ByteTextDataModule(
        seq_len=SEQ, global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH, max_corpus_bytes=200_000
    )
    callbacks: list[L.Callback] = [CommAccountingCallback(), SummaryCallback()]
    validation: dict = dict(val_check_interval=10**6)
    logger: object = False
    if args.callbacks:
        # Validation losses fall step by step: EarlyStopping in "max" mode with patience 2 stops at
        # the third validation; ModelCheckpoint keeps the two lowest of the three by then.
        callbacks += [
            ModelCheckpoint(
                dirpath=args.out_dir / "checkpoints",
                filename="step{step}",
                monitor="val/loss",
                mode="min",
                save_top_k=2,
                auto_insert_metric_name=False,
            ),
            EarlyStopping(monitor="val/loss", mode="max", patience=2),
            LearningRateMonitor(logging_interval="step"),
            StopRecorder(args.out_dir),
        ]
        # Once per optimizer step: val_check_interval counts Lightning batches (micro-batches).
        batches_per_step = GLOBAL_BATCH // (MICRO_BATCH * args.dp * args.ep) // (args.pp if args.pp > 1 else 1)
        validation = dict(val_check_interval=batches_per_step, limit_val_batches=2)
        logger = CSVLogger(args.out_dir, name="csv", version=0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=args.steps,
        logger=logger,
        precision=args.precision,
        enable_checkpointing=args.callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        check_val_every_n_epoch=None,
        log_every_n_steps=1,
        default_root_dir=str(args.out_dir),
        callbacks=callbacks,
        **validation,
    )
    model = FeatureLM(args.fail, args.fail_rank, args.out_dir)
    trainer.fit(model, datamodule=data)
    if args.no_eval:
        return
    loader = eval_loader(trainer)
    val = trainer.validate(model, dataloaders=loader, verbose=False)
    test = trainer.test(model, dataloaders=loader, verbose=False)
    predictions = trainer.predict(model, dataloaders=loader)
    by_index = {int(i): row.tolist() for out in predictions for i, row in zip(out["index"], out["logits"].float())}
    result = {
        "dp_ep_rank": trainer.strategy.distributed_sampler_kwargs["rank"],
        "validate": val,
        "test": test,
        "predictions": by_index,
    }
    (args.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()

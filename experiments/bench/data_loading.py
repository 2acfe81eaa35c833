"""Prepared token corpora at scale: index build, resident memory, first batch, loading and prepare speed.

Measured side by side in one run (figures, never timed assertions):

1. Two synthetic Megatron corpora (uint16, vocab 32000, lognormal document lengths around 1.2k
   tokens, documents sliced from one random buffer) written through ``IndexedCorpusWriter``: about
   1 GB and 10 MB of tokens. Their write time is informative.
2. For each corpus and seq_len, a fresh process: import, then build ``TokenDataModule`` (open the
   map, split the documents, cumulative offsets: the *index build*), take the first batch of one
   rank's loader (``LayoutInvariantSampler`` + ``DataLoader``, global batch 16, micro-batch 2) and
   read ``RSS_SAMPLES`` random samples. The resident-set growth (``VmRSS``), its anonymous part
   (``RssAnon``: heap, arrays, Python objects) and its file-backed part (``RssFile``: pages of the
   memory-mapped ``.bin``/``.idx`` touched), and the growth of the peak (``VmHWM``).
3. One rank's loading rate (``num_workers=0``, seq_len 128, micro-batch 2, rank 0 of 2 as under
   ``make train``'s ep2; ``document_mask`` off and on) against the rate the default model trains
   at here: ``MoEGPT`` of ``conf/model/tiny.yaml`` composed with ``data=bytes`` (seq_len 128,
   global batch 16 of micro-batches of 2), fp32, AdamW, one process and one thread (``make train``
   gives each rank one), on random tokens; and the same model with the corpus's 32000-token vocab.
4. ``python -m lightning_moe.data.prepare``'s tokens/s (``prepare(..., workers=1)`` and ``2``) on a
   few MB of JSON lines cut from the standard library's sources, with a byte-level BPE (vocab 2000)
   trained on some of them, against ``tokenizers``' own ``encode_batch`` over the same texts.

Every file goes to a temporary folder under ``$TMPDIR`` (else /tmp), removed at the end whatever
happens. The corpora were just written, so their pages are in the page cache: the index build and
first batch are warm-cache figures (a cold read adds the disk's latency).

    python -m experiments.bench.data_loading            # about a minute on 2 CPU cores
    python -m experiments.bench.data_loading --smoke    # tiny sizes: checks the script in seconds
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from experiments.bench.cli import ROOT
from experiments.bench.table import print_table

VOCAB = 32000
EOS = "<|endoftext|>"
MAX_DOCUMENT = 16384  # tokens; lognormal lengths are clipped to [16, MAX_DOCUMENT]
RSS_SAMPLES = 2000
GLOBAL_BATCH = 16
MICRO_BATCH = 2

FULL = dict(
    big_bytes=1 << 30,
    small_bytes=10_000_000,
    rss_samples=RSS_SAMPLES,
    rss_seq_lens=(128, 1024),
    load_seconds=2.0,
    train_steps=3,
    text_bytes=8_000_000,
    tokenizer_train_bytes=1_500_000,
    tokenizer_vocab=2000,
    prepare_batch_size=200,
)
SMOKE = dict(
    big_bytes=4 << 20,
    small_bytes=1 << 20,
    rss_samples=100,
    rss_seq_lens=(128,),
    load_seconds=0.2,
    train_steps=1,
    text_bytes=200_000,
    tokenizer_train_bytes=50_000,
    tokenizer_vocab=400,
    prepare_batch_size=50,
)


# --- corpora ---------------------------------------------------------------------------------------


def write_corpus(prefix: Path, num_bytes: int, seed: int = 0) -> dict[str, Any]:
    """A synthetic corpus of ``num_bytes`` of uint16 tokens at ``prefix``; its counts and write seconds.

    Documents are slices of one random buffer (at random offsets, lognormal lengths), so writing
    costs the writer's work and the disk's, not the random number generator's.
    """
    from lightning_moe.data.indexed import IndexedCorpusWriter

    rng = np.random.default_rng(seed)
    needed = num_bytes // 2
    buffer = rng.integers(0, VOCAB, size=min(needed, 1 << 25) + MAX_DOCUMENT, dtype=np.uint16)
    started = time.perf_counter()
    written = 0
    with IndexedCorpusWriter(prefix, vocab_size=VOCAB) as writer:
        while written < needed:
            lengths = np.clip(rng.lognormal(np.log(1200), 0.8, 4096), 16, MAX_DOCUMENT).astype(np.int64)
            offsets = rng.integers(0, len(buffer) - MAX_DOCUMENT, 4096)
            for length, offset in zip(lengths.tolist(), offsets.tolist()):
                length = min(length, needed - written)
                if length <= 0:
                    break
                writer.add_document(buffer[offset : offset + length])
                written += length
        writer.close(metadata={"tokenizer": "synthetic"})
    seconds = time.perf_counter() - started
    return {
        "tokens": writer.num_tokens,
        "documents": writer.num_documents,
        "bytes": writer.num_tokens * 2,
        "seconds": seconds,
    }


def _label(num_bytes: int) -> str:
    return f"{num_bytes / 1e9:.2f} GB" if num_bytes >= 1e9 else f"{num_bytes / 1e6:.0f} MB"


def rank_loader(dataset: Any, seed: int, *, num_replicas: int = 1, rank: int = 0) -> Any:
    """What one rank of a dp/ep layout iterates (as ``LayoutInvariantDataModule`` builds it, ``num_workers=0``)."""
    from torch.utils.data import DataLoader

    from lightning_moe.data.sampler import LayoutInvariantSampler

    sampler = LayoutInvariantSampler(
        dataset,
        global_batch_size=GLOBAL_BATCH,
        micro_batch_size=MICRO_BATCH,
        num_replicas=num_replicas,
        rank=rank,
        shuffle=True,
        seed=seed,
    )
    return DataLoader(dataset, batch_size=MICRO_BATCH, sampler=sampler, drop_last=True, num_workers=0)


# --- a fresh process per measurement ---------------------------------------------------------------


def _status() -> dict[str, int]:
    """VmRSS, RssAnon, RssFile, RssShmem and VmHWM of this process, in bytes."""
    keys = ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM")
    found: dict[str, int] = {}
    with open("/proc/self/status") as status:
        for line in status:
            key = line.split(":")[0]
            if key in keys:
                found[key] = int(line.split()[1]) * 1024
    return found


def _child_memory(prefix: str, seq_len: int, samples: int) -> dict[str, Any]:
    """In a fresh process: index build, first batch and the resident-set growth of reading ``samples``."""
    import torch

    torch.set_num_threads(1)
    from lightning_moe.data.tokens import TokenDataModule

    # One batch of a throwaway loader first: what its first use imports is not counted.
    next(iter(rank_loader([{"input_ids": torch.zeros(4, dtype=torch.int64)}] * GLOBAL_BATCH, 0)))
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # reset VmHWM to the current resident set
    before = _status()
    started = time.perf_counter()
    dm = TokenDataModule(blend=prefix, seq_len=seq_len, global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH)
    index_seconds = time.perf_counter() - started
    at_index = _status()
    batches = iter(rank_loader(dm.train_dataset, dm.seed))
    next(batches)
    first_batch_seconds = time.perf_counter() - started
    at_first_batch = _status()
    read = MICRO_BATCH
    for _ in batches:
        read += MICRO_BATCH
        if read >= samples:
            break
    after = _status()
    return {
        "index_seconds": index_seconds,
        "first_batch_seconds": first_batch_seconds,
        "samples_read": read,
        "train_samples": len(dm.train_dataset),
        "growth": {k: after[k] - before[k] for k in after},
        "growth_at_index": {k: at_index[k] - before[k] for k in after},
        "growth_at_first_batch": {k: at_first_batch[k] - before[k] for k in after},
    }


def _child_train_tokenizer(folder: str, text_file: str, vocab_size: int) -> dict[str, Any]:
    """A byte-level BPE with ``EOS`` as its special token, and a tokenizer_config.json naming it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[EOS],
        show_progress=False,
    )
    tok.train_from_iterator(Path(text_file).read_text().splitlines(keepends=True), trainer=trainer)
    tok.save(str(Path(folder) / "tokenizer.json"))
    (Path(folder) / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    return {"vocab_size": tok.get_vocab_size(with_added_tokens=True)}


def _child_encode(tokenizer_folder: str, jsonl: str) -> dict[str, Any]:
    """``encode_batch`` over every text of ``jsonl`` in one call (the JSON is parsed before the clock starts)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tokenizer_folder) / "tokenizer.json"))
    with open(jsonl) as fh:
        texts = [json.loads(line)["text"] for line in fh]
    started = time.perf_counter()
    encodings = tok.encode_batch(texts, add_special_tokens=False)
    seconds = time.perf_counter() - started
    return {"tokens": sum(len(e.ids) for e in encodings), "seconds": seconds}


_CHILDREN = {"memory": _child_memory, "train_tokenizer": _child_train_tokenizer, "encode": _child_encode}


def run_child(kind: str, env: dict[str, str] | None = None, **kwargs: Any) -> dict[str, Any]:
    """``_CHILDREN[kind](**kwargs)`` in a fresh ``python -m experiments.bench.data_loading --child`` process."""
    cmd = [sys.executable, "-m", "experiments.bench.data_loading", "--child", json.dumps({"kind": kind, **kwargs})]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- loading and training rates --------------------------------------------------------------------


def loading_rate(prefix: Path, document_mask: bool, seconds: float) -> float:
    """Samples/s one rank's loader yields (rank 0 of 2, seq_len 128, micro-batch 2, ``num_workers=0``),
    after its first batch."""
    from lightning_moe.data.tokens import TokenDataModule

    dm = TokenDataModule(
        blend=str(prefix),
        seq_len=128,
        global_batch_size=GLOBAL_BATCH,
        micro_batch_size=MICRO_BATCH,
        document_mask=document_mask,
    )
    loader = rank_loader(dm.train_dataset, dm.seed, num_replicas=2, rank=0)
    batches = iter(loader)
    next(batches)
    count, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds:
        try:
            next(batches)
        except StopIteration:  # a small corpus's epoch ends: the next one
            batches = iter(loader)
            continue
        count += 1
    return count * MICRO_BATCH / elapsed


def default_model_config() -> Any:
    """The ``model`` and ``data`` of ``python -m lightning_moe.train``'s defaults (model=tiny, data=bytes)."""
    from hydra import compose, initialize_config_dir

    from lightning_moe.conf import CONF_DIR

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=["trainer.default_root_dir=/tmp/unused", "logger=none"])


def training_rate(vocab_size: int | None, steps: int) -> tuple[float, dict[str, Any]]:
    """Samples/s of the default model, fp32 AdamW optimizer steps of global batch 16 in micro-batches
    (gradient accumulation, one process), on random tokens; and the shape it ran."""
    import torch
    from hydra.utils import instantiate

    from lightning_moe.layout import default_micro_batch_size

    cfg = default_model_config()
    seq_len, global_batch = int(cfg.data.seq_len), int(cfg.data.global_batch_size)
    micro = int(cfg.data.micro_batch_size or default_micro_batch_size(global_batch))
    torch.manual_seed(0)
    overrides = {} if vocab_size is None else {"vocab_size": vocab_size}
    model = instantiate(cfg.model, **overrides).train()
    vocab = int(model.hparams.vocab_size)
    optimizer = model.configure_optimizers()["optimizer"]
    generator = torch.Generator().manual_seed(0)

    def step() -> None:
        for _ in range(global_batch // micro):
            tokens = torch.randint(0, vocab, (micro, seq_len + 1), generator=generator)
            loss = model.loss({"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}) / (global_batch // micro)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up
    started = time.perf_counter()
    for _ in range(steps):
        step()
    rate = steps * global_batch / (time.perf_counter() - started)
    return rate, {
        "vocab_size": vocab,
        "seq_len": seq_len,
        "global_batch": global_batch,
        "micro_batch": micro,
        "parameters": sum(p.numel() for p in model.parameters()),
    }


# --- prepare ---------------------------------------------------------------------------------------


def stdlib_records(num_chars: int, record_chars: int = 4000) -> list[str]:
    """About ``num_chars`` of the standard library's ``.py`` sources, cut at line ends into records of
    about ``record_chars`` characters (documents of a web-like corpus, not whole files)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    records: list[str] = []
    total = 0
    for path in sorted(stdlib.glob("*.py")) + sorted(stdlib.glob("*/*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        piece: list[str] = []
        size = 0
        for line in text.splitlines(keepends=True):
            piece.append(line)
            size += len(line)
            if size >= record_chars:
                records.append("".join(piece))
                piece, size = [], 0
        if piece:
            records.append("".join(piece))
        total += len(text)
        if total >= num_chars:
            break
    return records


def tokenization_rows(tmp: Path, sizes: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """prepare(workers=1, 2) against ``encode_batch`` (with tokenizers' threads, and on one thread)."""
    records = stdlib_records(sizes["text_bytes"])
    jsonl = tmp / "texts.jsonl"
    with open(jsonl, "w") as fh:
        for text in records:
            fh.write(json.dumps({"text": text}) + "\n")
    train_text = tmp / "tokenizer_train.txt"
    train_text.write_text("".join(stdlib_records(sizes["tokenizer_train_bytes"])))
    folder = tmp / "tokenizer"
    folder.mkdir()
    # Children: this process must not start tokenizers' thread pool before prepare forks its workers.
    run_child("train_tokenizer", folder=str(folder), text_file=str(train_text), vocab_size=sizes["tokenizer_vocab"])
    threaded = run_child("encode", tokenizer_folder=str(folder), jsonl=str(jsonl))
    single = run_child(
        "encode", env={"TOKENIZERS_PARALLELISM": "false"}, tokenizer_folder=str(folder), jsonl=str(jsonl)
    )
    threaded_rate, single_rate = threaded["tokens"] / threaded["seconds"], single["tokens"] / single["seconds"]

    from lightning_moe.data.prepare import prepare

    runs = {}
    for workers in (2, 1):  # 2 first: its workers fork before this process uses the tokenizer itself
        started = time.perf_counter()
        summary = prepare(
            str(jsonl),
            str(folder),
            str(tmp / f"prepared_w{workers}"),
            workers=workers,
            batch_size=sizes["prepare_batch_size"],
            progress=False,
        )
        seconds = time.perf_counter() - started
        runs[workers] = (summary["tokens"] - summary["documents"], seconds)  # one EOS per document left out
    threads = os.cpu_count() or 1
    rows = [
        {
            "run": "encode_batch, 1 process",
            "threads": f"tokenizers' ({threads})",
            "tokens": f"{threaded['tokens']:,}",
            "seconds": threaded["seconds"],
            "tokens/s": threaded_rate,
            "tokens/s per worker": threaded_rate,
            "per worker / encode_batch 1 thread": threaded_rate / single_rate,
        },
        {
            "run": "encode_batch, 1 process",
            "threads": "1 (TOKENIZERS_PARALLELISM=false)",
            "tokens": f"{single['tokens']:,}",
            "seconds": single["seconds"],
            "tokens/s": single_rate,
            "tokens/s per worker": single_rate,
            "per worker / encode_batch 1 thread": 1.0,
        },
    ]
    for workers in (1, 2):
        tokens, seconds = runs[workers]
        rate = tokens / seconds
        rows.append(
            {
                "run": f"prepare workers={workers}",
                "threads": f"tokenizers' ({threads})" if workers == 1 else f"{workers} processes x 1",
                "tokens": f"{tokens:,}",
                "seconds": seconds,
                "tokens/s": rate,
                "tokens/s per worker": rate / workers,
                "per worker / encode_batch 1 thread": rate / workers / single_rate,
            }
        )
    info = {"records": len(records), "chars": sum(map(len, records)), "threaded_rate": threaded_rate}
    return rows, info


# --- the benchmark ---------------------------------------------------------------------------------


def run(smoke: bool = False) -> dict[str, Any]:
    """Every measurement, printed as tables; returns them (``smoke``: tiny sizes, seconds)."""
    import torch

    sizes = SMOKE if smoke else FULL
    torch.set_num_threads(1)  # one thread per rank, as make train runs them
    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="lmoe_bench_data_"))
    result: dict[str, Any] = {}
    try:
        corpora = {}
        for name, num_bytes in (("big", sizes["big_bytes"]), ("small", sizes["small_bytes"])):
            corpora[name] = {"prefix": tmp / name, **write_corpus(tmp / name, num_bytes, seed=len(name))}
        big, small = corpora["big"], corpora["small"]
        print(
            f"Synthetic token corpora (uint16, vocab {VOCAB}, lognormal document lengths, written through"
            " IndexedCorpusWriter)"
        )
        print_table(
            [
                {
                    "corpus": _label(c["bytes"]),
                    "tokens": f"{c['tokens']:,}",
                    "documents": f"{c['documents']:,}",
                    "mean tokens/document": c["tokens"] / c["documents"],
                    "write s": c["seconds"],
                    "write MB/s": c["bytes"] / 1e6 / c["seconds"],
                }
                for c in corpora.values()
            ]
        )
        result["corpora"] = {k: {key: v for key, v in c.items() if key != "prefix"} for k, c in corpora.items()}

        memory_rows, memory = [], {}
        for seq_len in sizes["rss_seq_lens"]:
            for name in ("big", "small"):
                corpus = corpora[name]
                m = run_child("memory", prefix=str(corpus["prefix"]), seq_len=seq_len, samples=sizes["rss_samples"])
                memory[(name, seq_len)] = m
                g = m["growth"]
                memory_rows.append(
                    {
                        "corpus": _label(corpus["bytes"]),
                        "seq_len": seq_len,
                        "train samples": f"{m['train_samples']:,}",
                        "index build s": m["index_seconds"],
                        "first batch s": m["first_batch_seconds"],
                        "RssAnon: index MB": m["growth_at_index"]["RssAnon"] / 1e6,
                        "first batch MB": m["growth_at_first_batch"]["RssAnon"] / 1e6,
                        "end MB": g["RssAnon"] / 1e6,
                        "RssFile MB": g["RssFile"] / 1e6,
                        "VmRSS MB": g["VmRSS"] / 1e6,
                        "peak (VmHWM) MB": g["VmHWM"] / 1e6,
                    }
                )
        print()
        print(
            f"A fresh process per corpus and seq_len: index build (TokenDataModule), first batch of one rank's loader,"
            f" then growth of the resident set after reading {sizes['rss_samples']} random samples (global batch"
            f" {GLOBAL_BATCH}, micro-batch {MICRO_BATCH}); RssAnon growth after the index build, after the first"
            " batch (the sampler's epoch order\nincluded: one index per sample of the rank) and at the end"
        )
        print_table(memory_rows)
        diff_rows = []
        for seq_len in sizes["rss_seq_lens"]:
            b, s = memory[("big", seq_len)]["growth"], memory[("small", seq_len)]["growth"]
            diff_rows.append(
                {
                    "seq_len": seq_len,
                    "RssAnon MB": (b["RssAnon"] - s["RssAnon"]) / 1e6,
                    "RssFile MB": (b["RssFile"] - s["RssFile"]) / 1e6,
                    "VmRSS MB": (b["VmRSS"] - s["VmRSS"]) / 1e6,
                    "peak (VmHWM) MB": (b["VmHWM"] - s["VmHWM"]) / 1e6,
                }
            )
        print()
        print(
            f"Growth with the {_label(big['bytes'])} corpus minus growth with the {_label(small['bytes'])} one"
            " (the bound: < 100 MB)"
        )
        print_table(diff_rows)
        print(
            "RssAnon is what the process allocates (index arrays, sampler order, Python objects); RssFile is pages of"
            " the memory-mapped .bin/.idx\nthat reads touched (the kernel maps up to 16 cached pages around each"
            " fault), which the kernel reclaims under pressure and which\nare shared with the page cache; VmRSS ="
            " RssAnon + RssFile + RssShmem."
        )
        result["memory"] = {f"{name}/{seq_len}": m for (name, seq_len), m in memory.items()}
        result["memory_difference"] = diff_rows

        train_small, shape = training_rate(None, sizes["train_steps"])
        train_big, shape_big = training_rate(VOCAB, sizes["train_steps"])
        load_rows = []
        for name in ("big", "small"):
            for mask in (False, True):
                rate = loading_rate(corpora[name]["prefix"], mask, sizes["load_seconds"])
                load_rows.append(
                    {
                        "corpus": _label(corpora[name]["bytes"]),
                        "document_mask": mask,
                        "loaded samples/s": rate,
                        f"/ train vocab {shape['vocab_size']}": rate / train_small,
                        f"/ train vocab {VOCAB}": rate / train_big,
                    }
                )
        print()
        print(
            f"One rank's loading rate (rank 0 of 2, num_workers=0, seq_len 128, micro-batch {MICRO_BATCH}) vs the default"
            f" model's training rate here: MoEGPT tiny, fp32 AdamW, global batch {shape['global_batch']} of"
            f" {shape['micro_batch']} x {shape['seq_len']}, 1 process, 1 thread"
        )
        print_table(
            [
                {
                    "model": f"tiny, vocab {s['vocab_size']}",
                    "parameters": f"{s['parameters']:,}",
                    "trained samples/s": r,
                }
                for s, r in ((shape, train_small), (shape_big, train_big))
            ]
        )
        print_table(load_rows)
        print(
            "Ratio = loaded samples/s / trained samples/s: > 1 means the loader keeps up (with num_workers=0 it loads"
            " in the training thread,\ntaking about 1/ratio of the step time)."
        )
        result["training"] = {
            "default": {"samples_per_s": train_small, **shape},
            "vocab32000": {"samples_per_s": train_big, **shape_big},
        }
        result["loading"] = load_rows

        token_rows, info = tokenization_rows(tmp, sizes)
        print()
        print(
            f"prepare (JSON lines -> .bin/.idx, batch_size={sizes['prepare_batch_size']}) vs tokenizers' encode_batch,"
            f" {info['records']:,} records of the standard library's sources ({info['chars'] / 1e6:.1f} M characters),"
            f" byte-level BPE vocab {sizes['tokenizer_vocab']}"
        )
        print_table(token_rows)
        print(
            "Ratio = prepare's tokens/s per worker / encode_batch's tokens/s on one thread: 1 means prepare costs no more"
            " per core than the\ntokenizer alone (reading JSON, appending EOS and writing included); workers=1 runs"
            " the tokenizer's own threads in-process."
        )
        result["tokenization"] = token_rows
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result["seconds"] = time.perf_counter() - started
    print(f"\n(data_loading: {result['seconds']:.0f} s)")
    return result


def main(smoke: bool = False) -> None:
    run(smoke=smoke)


def _cli(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks the script in seconds")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # a measurement in a fresh process (run_child)
    args = parser.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        print(json.dumps(_CHILDREN[spec.pop("kind")](**spec)))
        return
    main(smoke=args.smoke)


if __name__ == "__main__":
    _cli()

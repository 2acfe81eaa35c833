"""Building a model per rank: peak memory (meta-device init vs eager) and bytes read when loading, at ep 1, 2, 4.

Each case runs in fresh gloo processes (world = ep, data_parallel="fsdp" over edp = 1). A rank
resets its resident-set high-water mark (``/proc/self/clear_refs``) after imports and the mesh,
builds MoEGPT (eagerly, or on the meta device then ``parallelize`` + ``materialize_sharded``), and
reports the growth of the high-water mark (``VmHWM``) and the parameter bytes it holds, both as a
ratio to the whole model's parameter bytes. Linux only.

The second table loads a saved Hugging Face Qwen3-MoE folder (safetensors) into ``HFMoEModule`` built
on the meta device: each rank reads only its block of every tensor (``safe_open(...).get_slice``).

    python -m experiments.bench.meta_init
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from experiments.bench.table import print_table

# ~360 MB of fp32 parameters, 95% of them in experts: large next to the allocator's noise.
MODEL = dict(
    vocab_size=256, hidden_size=512, num_layers=4, num_heads=8, moe={"num_experts": 16, "ffn_hidden_size": 1024}
)


def _high_water_kb() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))


def _worker(rank: int, world: int, store_file: str, meta: bool, out: dict) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    from lightning_moe import ParallelDims, parallelize
    from lightning_moe.models import MoEGPT
    from lightning_moe.parallel.plans.init import materialize_sharded

    dims = ParallelDims(ep=world)
    dims.validate(world)
    dims.build_mesh("cpu")
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # reset VmHWM to the current resident set
    start = _high_water_kb()
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            model = MoEGPT(**MODEL)
        parallelize(model, dims)
        materialize_sharded(model, torch.device("cpu"), model.initial_value)
    else:
        model = MoEGPT(**MODEL)
        parallelize(model, dims)
    held = sum(p.to_local().nbytes if hasattr(p, "to_local") else p.nbytes for p in model.parameters())
    out[rank] = ((_high_water_kb() - start) * 1024, held)
    dist.barrier()
    dist.destroy_process_group()


QWEN3 = {
    "model_type": "qwen3_moe",
    "vocab_size": 1024,
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": False,
    "intermediate_size": 512,
    "moe_intermediate_size": 256,
    "num_experts": 16,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "head_dim": 64,
    "max_position_embeddings": 128,
}


def _load_worker(rank: int, world: int, store_file: str, folder: str, out: dict) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    from lightning_moe import ParallelDims, parallelize
    from lightning_moe.hf import HFMoEModule
    from lightning_moe.parallel.plans.init import materialize_sharded

    dims = ParallelDims(ep=world)
    dims.validate(world)
    with torch.device("meta"):
        module = HFMoEModule(pretrained=folder)
    dims.build_mesh("cpu")
    parallelize(module, dims)
    materialize_sharded(module, torch.device("cpu"), module.initial_value)
    files = module._pretrained_shards.folder
    out[rank] = (files.bytes_read, files.expert_bytes_read)
    dist.barrier()
    dist.destroy_process_group()


def measure_loading(folder: str, ep: int) -> tuple[int, int]:
    """(max over ranks of the bytes read, of the expert bytes read) loading ``folder`` at ``ep``."""
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_load_worker, args=(ep, f"{tmp}/store", folder, out), nprocs=ep, join=True)
        return max(v[0] for v in out.values()), max(v[1] for v in out.values())


def main_loading() -> None:
    from lightning_moe.hf import HFMoEModule

    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        model = HFMoEModule(dict(QWEN3))
        model.save_hf(folder)
        total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        experts = sum(t.numel() * t.element_size() for n, t in model.state_dict().items() if ".experts." in n)
        rows = []
        for ep in (1, 2, 4):
            read, expert_read = measure_loading(folder, ep)
            rows.append(
                {"ep": ep, "bytes read / model": read / total, "expert bytes read / experts": expert_read / experts}
            )
    print(
        f"Bytes read per rank loading a Qwen3-MoE folder ({total / 1e6:.1f} MB, {experts / total:.0%} experts) on the meta device"
    )
    print_table(rows)


def measure(meta: bool, ep: int) -> tuple[float, float]:
    """(max over ranks of the build's peak memory growth, parameter bytes held), in bytes."""
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(ep, f"{tmp}/store", meta, out), nprocs=ep, join=True)
        return max(v[0] for v in out.values()), max(v[1] for v in out.values())


def main() -> None:
    from lightning_moe.models import MoEGPT

    with torch.device("meta"):
        full = sum(p.numel() * 4 for p in MoEGPT(**MODEL).parameters())
    rows = []
    for ep in (1, 2, 4):
        for meta in (False, True):
            peak, held = measure(meta, ep)
            rows.append(
                {
                    "ep": ep,
                    "init": "meta" if meta else "eager",
                    "peak growth / model": peak / full,
                    "parameters held / model": held / full,
                }
            )
    print(
        f"Peak memory per rank while building MoEGPT ({full / 1e6:.0f} MB of fp32 parameters), as a ratio to the whole model"
    )
    print_table(rows)
    print()
    main_loading()


if __name__ == "__main__":
    main()

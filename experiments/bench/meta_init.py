"""Peak memory per rank while building the model: meta-device init vs eager, at ep 1, 2 and 4.

Each case runs in fresh gloo processes (world = ep, data_parallel="fsdp" over edp = 1). A rank
resets its resident-set high-water mark (``/proc/self/clear_refs``) after imports and the mesh,
builds MoEGPT (eagerly, or on the meta device then ``parallelize`` + ``materialize_sharded``), and
reports the growth of the high-water mark (``VmHWM``) and the parameter bytes it holds, both as a
ratio to the whole model's parameter bytes. Linux only.

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
MODEL = dict(vocab_size=256, hidden_size=512, num_layers=4, num_heads=8, moe={"num_experts": 16, "ffn_hidden_size": 1024})


def _high_water_kb() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))


def _worker(rank: int, world: int, store_file: str, meta: bool, out: dict) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    from lightning_moe import ParallelDims, parallelize
    from lightning_moe.models import MoEGPT
    from lightning_moe.parallel.init import materialize_sharded

    dims = ParallelDims(ep=world)
    dims.validate(world)
    mesh = dims.build_mesh("cpu")
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # reset VmHWM to the current resident set
    start = _high_water_kb()
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            model = MoEGPT(**MODEL)
        parallelize(model, mesh)
        materialize_sharded(model, torch.device("cpu"), model.initial_value)
    else:
        model = MoEGPT(**MODEL)
        parallelize(model, mesh)
    held = sum(p.to_local().nbytes if hasattr(p, "to_local") else p.nbytes for p in model.parameters())
    out[rank] = ((_high_water_kb() - start) * 1024, held)
    dist.barrier()
    dist.destroy_process_group()


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
            rows.append({"ep": ep, "init": "meta" if meta else "eager", "peak growth / model": peak / full,
                         "parameters held / model": held / full})
    print(f"Peak memory per rank while building MoEGPT ({full / 1e6:.0f} MB of fp32 parameters), as a ratio to the whole model")
    print_table(rows)


if __name__ == "__main__":
    main()

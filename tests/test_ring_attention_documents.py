"""Document-masked ring attention equals one-process SDPA with the document-causal mask.

Every rank of the 4-process gloo pool builds the same full Q, K, V, upstream gradient and
``document_ids`` (same seed), computes the one-process reference
``F.scaled_dot_product_attention(Q, K, V, attn_mask=document_causal_mask(ids, ids))`` and compares
its zigzag shard with what ring attention produced from the sharded inputs and ids. cp = 2 runs in
the groups {0, 1} and {2, 3} side by side, cp = 4 on all ranks, cp = 1 in four groups of one. The
trace of computed blocks is checked against the ideal: the number of visible (query, key) pairs
(``document_causal_mask(ids, ids).sum()``), each computed exactly once; the masked tiles that pack
short documents are the only pairs computed beyond it.

Also: no leak between documents (bitwise), the SDPA mode with ids per micro-batch (gathered once),
bad input refused before any communication, and the CUDA kernel wrappers on a ring of threads with
CPU ops that follow the CUDA ops' contracts (tests/test_cuda.py); on a GPU the same with the real
kernels (not yet run on one).
"""

from __future__ import annotations

import importlib
import queue
import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.dist_pool import get_pool
from tests.test_cuda import _Ctx, _cuda_test, _ThreadRing, fake_cuda_attention_ops  # noqa: F401 (a fixture)
from tests.test_ring_attention import TinyAttention, _cp_group

# The module (``lightning_moe.cp.ring_attention`` the attribute is the function the package exports).
ra = importlib.import_module("lightning_moe.cp.ring_attention")

WORLD = 4
BATCH, HEAD_DIM = 2, 8
ATOL = {"float32": 1e-5, "float64": 1e-10}


def _document_ids(lengths_per_row: list[list[int]]) -> torch.Tensor:
    """``[rows, sum(lengths)]`` ids: document ``i`` of a row repeated ``lengths[i]`` times."""
    rows = [torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)) for lengths in lengths_per_row]
    return torch.stack(rows)


def _random_lengths(seq: int, low: int, high: int, seed: int) -> list[int]:
    """Document lengths drawn from ``[low, high]`` until they fill ``seq`` tokens (the last one cut)."""
    gen = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < seq:
        lengths.append(min(int(torch.randint(low, high + 1, (1,), generator=gen)), seq - sum(lengths)))
    return lengths


def _log_uniform_lengths(seq: int, low: int, high: int, seed: int) -> list[int]:
    """Like :func:`_random_lengths` with log-uniform lengths: short documents are common, as in corpora."""
    gen = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    log_low, log_high = torch.tensor(float(low)).log(), torch.tensor(high + 1.0).log()
    while sum(lengths) < seq:
        length = int((log_low + (log_high - log_low) * torch.rand((), generator=gen)).exp())
        lengths.append(min(length, seq - sum(lengths)))
    return lengths


# Two rows of 64 tokens each (chunks of 8 tokens under cp = 4, 16 under cp = 2); the rows differ.
MIXES = {
    # documents across chunk and rank borders, a one-token document among them
    "spanning": [[5, 30, 29], [20, 1, 43]],
    "single_tokens": [[1] * 64, [1] * 10 + [20] + [1] * 34],
    "one_document": [[64], [64]],  # == plain causal attention
    "many_short": [_random_lengths(64, 1, 6, seed=1), _random_lengths(64, 1, 6, seed=2)],
}


def _full_inputs(seq: int, heads: int, kv_heads: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    heads_of = (heads, kv_heads, kv_heads, heads)  # q, k, v, upstream grad
    return [torch.randn(BATCH, h, seq, HEAD_DIM, generator=gen, dtype=torch.float64).to(dtype) for h in heads_of]


def documents_case(
    cp: int, mix: str, dtype: str, tiles: tuple[int, ...], kernels: tuple[str, ...], layout: str = "zigzag"
) -> dict:
    from lightning_moe.cp import ring_attention, shard_sequence, trace_ring_attention
    from lightning_moe.cp.documents import document_causal_mask

    heads, kv_heads = 4, 2  # grouped-query attention
    group = _cp_group(cp)
    rank = dist.get_rank(group)
    ids = _document_ids(MIXES[mix])
    full_q, full_k, full_v, full_grad = _full_inputs(ids.shape[1], heads, kv_heads, getattr(torch, dtype))
    refs = [t.clone().requires_grad_(True) for t in (full_q, full_k, full_v)]
    mask = document_causal_mask(ids, ids)
    F.scaled_dot_product_attention(*refs, attn_mask=mask, enable_gqa=True).backward(full_grad)
    ref_out = F.scaled_dot_product_attention(full_q, full_k, full_v, attn_mask=mask, enable_gqa=True)

    def shard(t: torch.Tensor) -> torch.Tensor:
        return shard_sequence(t, rank, cp, dim=2, layout=layout)

    local_ids = shard_sequence(ids, rank, cp, dim=1, layout=layout)
    errors, pairs = {}, {}
    for kernel in kernels:
        for tile in tiles:
            for head_chunks in (1, 2):
                name = f"{kernel}/tile{tile}/chunks{head_chunks}"
                local = [shard(t).requires_grad_(True) for t in (full_q, full_k, full_v)]
                with trace_ring_attention() as trace:
                    out = ring_attention(
                        *local,
                        group,
                        layout=layout,
                        kernel=kernel,
                        head_chunks=head_chunks,
                        document_ids=local_ids,
                        document_tile=tile,
                    )
                    out.backward(shard(full_grad))
                errors[f"{name}/out"] = (out - shard(ref_out)).abs().max().item()
                for grad_name, mine, ref in zip("qkv", local, refs):
                    errors[f"{name}/d{grad_name}"] = (mine.grad - shard(ref.grad)).abs().max().item()
                pairs[name] = {
                    phase: (trace.pairs(phase), trace.visible_pairs(phase)) for phase in ("forward", "backward")
                }
    return {"errors": errors, "pairs": pairs, "ideal": int(mask.sum()) * heads, "dtype": str(out.dtype)}


def _check_documents(results: list[dict], cp: int, dtype: str) -> None:
    for rank, result in enumerate(results):
        assert result["dtype"] == f"torch.{dtype}"
        for name, err in result["errors"].items():
            assert err < ATOL[dtype], f"rank {rank}: {name} differs by {err:.2e}"
    for start in range(0, WORLD, cp):  # each cp group
        group = results[start : start + cp]
        for name in group[0]["pairs"]:
            computed = {phase: sum(r["pairs"][name][phase][0] for r in group) for phase in ("forward", "backward")}
            visible = {phase: sum(r["pairs"][name][phase][1] for r in group) for phase in ("forward", "backward")}
            # every visible pair exactly once, in the forward and again in the backward
            assert visible == {"forward": group[0]["ideal"], "backward": group[0]["ideal"]}, name
            assert computed["forward"] == computed["backward"] >= visible["forward"], name


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_documents_match_masked_sdpa(cp: int, mix: str) -> None:
    """Outputs and dq, dk, dv equal one-process SDPA with the document-causal mask (fp32, GQA, head chunks)."""
    case = dict(cp=cp, mix=mix, dtype="float32", tiles=(4, 128), kernels=("auto", "torch"))
    _check_documents(get_pool(WORLD).run(documents_case, **case), cp, "float32")


@pytest.mark.parametrize("mix", ["spanning", "many_short"])
def test_documents_match_masked_sdpa_fp64(mix: str) -> None:
    case = dict(cp=4, mix=mix, dtype="float64", tiles=(4,), kernels=("auto",))
    _check_documents(get_pool(WORLD).run(documents_case, **case), 4, "float64")


@pytest.mark.parametrize("mix", ["spanning", "many_short"])
def test_documents_contiguous_layout(mix: str) -> None:
    """The plan follows any layout's global positions: the contiguous layout too."""
    case = dict(cp=4, mix=mix, dtype="float32", tiles=(4,), kernels=("auto",), layout="contiguous")
    _check_documents(get_pool(WORLD).run(documents_case, **case), 4, "float32")


def bf16_case(autocast: bool) -> dict:
    from lightning_moe.cp import ring_attention, zigzag_shard
    from lightning_moe.cp.documents import document_causal_mask

    group = _cp_group(2)
    rank = dist.get_rank(group)
    ids = _document_ids(MIXES["spanning"])
    full = _full_inputs(64, 4, 2, torch.float32)
    ref = F.scaled_dot_product_attention(*full[:3], attn_mask=document_causal_mask(ids, ids), enable_gqa=True)
    local = [zigzag_shard(t, rank, 2, dim=2) for t in full[:3]]
    if not autocast:
        local = [t.bfloat16() for t in local]
    local = [t.requires_grad_(True) for t in local]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = ring_attention(*local, group, document_ids=zigzag_shard(ids, rank, 2), document_tile=4)
    out.backward(zigzag_shard(full[3], rank, 2, dim=2).to(out.dtype))
    return {
        "dtype": str(out.dtype),
        "grad_dtype": str(local[1].grad.dtype),
        "err": (out.float() - zigzag_shard(ref, rank, 2, dim=2)).abs().max().item(),
    }


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "autocast"])
def test_documents_bf16(autocast: bool) -> None:
    """bf16 inputs (fused kernel in bf16, masked tiles in fp32), statistics fp32, as without documents."""
    for result in get_pool(WORLD).run(bf16_case, autocast=autocast):
        assert result["dtype"] == "torch.bfloat16"
        assert result["grad_dtype"] == ("torch.float32" if autocast else "torch.bfloat16")
        assert result["err"] < 3e-2


def one_document_case(cp: int) -> dict:
    """One document per row is plain causal attention: the same outputs as the ring without documents."""
    from lightning_moe.cp import ring_attention, zigzag_shard

    group = _cp_group(cp)
    rank = dist.get_rank(group)
    full_q, full_k, full_v, _ = _full_inputs(64, 4, 2, torch.float32)
    local = [zigzag_shard(t, rank, cp, dim=2) for t in (full_q, full_k, full_v)]
    ids = zigzag_shard(torch.zeros(BATCH, 64, dtype=torch.long), rank, cp, dim=1)
    plain = ring_attention(*local, group)
    documents = ring_attention(*local, group, document_ids=ids)
    return {"err": (plain - documents).abs().max().item()}


@pytest.mark.parametrize("cp", [2, 4])
def test_one_document_is_plain_causal(cp: int) -> None:
    for result in get_pool(WORLD).run(one_document_case, cp=cp):
        assert result["err"] < 1e-6


def leak_case(cp: int, tile: int) -> dict:
    """Replace the tokens of one document: no output or gradient of another document may change."""
    from lightning_moe.cp import ring_attention, zigzag_shard

    group = _cp_group(cp)
    rank = dist.get_rank(group)
    ids = _document_ids([[5, 30, 29], [3, 2, 2, 40, 17]])
    target = torch.zeros_like(ids, dtype=torch.bool)
    target[0] = ids[0] == 1  # 30 tokens over several chunks and ranks
    target[1] = ids[1] == 1  # a short document, packed with its neighbours into one masked tile
    base = _full_inputs(64, 4, 2, torch.float32)
    gen = torch.Generator().manual_seed(7)
    changed = [t.clone() for t in base]
    for t in changed[:3]:
        noise = 10 * torch.randn(t.shape, generator=gen)
        t.copy_(torch.where(target[:, None, :, None], noise, t))

    def run(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        local = [zigzag_shard(t, rank, cp, dim=2).requires_grad_(True) for t in inputs[:3]]
        out = ring_attention(*local, group, document_ids=zigzag_shard(ids, rank, cp, dim=1), document_tile=tile)
        out.backward(zigzag_shard(inputs[3], rank, cp, dim=2))
        return [out.detach()] + [t.grad for t in local]

    others = ~zigzag_shard(target, rank, cp, dim=1)[:, None, :, None]
    before, after = run(base), run(changed)
    leaks = {
        name: (b - a).abs().masked_select(others).max().item()
        for name, b, a in zip(["out", "dq", "dk", "dv"], before, after)
    }
    moved = (before[0] - after[0]).abs().masked_select(~others).max().item() if bool((~others).any()) else None
    return {"leaks": leaks, "moved": moved}


@pytest.mark.parametrize("tile", [4, 128])
@pytest.mark.parametrize("cp", [2, 4])
def test_no_leak_between_documents(cp: int, tile: int) -> None:
    results = get_pool(WORLD).run(leak_case, cp=cp, tile=tile)
    for rank, result in enumerate(results):
        for name, leak in result["leaks"].items():
            assert leak == 0.0, f"rank {rank}: {name} of other documents changed by {leak:.2e}"
    assert max(r["moved"] or 0.0 for r in results) > 1e-3  # the document itself did change


def pairs_case(rows: list[list[int]], tile: int) -> dict:
    """Computed and visible pairs of one forward (and backward) over rows of these document lengths, one head."""
    from lightning_moe.cp import ring_attention, trace_ring_attention, zigzag_shard
    from lightning_moe.cp.documents import document_causal_mask

    cp = dist.get_world_size()
    group = _cp_group(cp)
    rank = dist.get_rank(group)
    ids = _document_ids(rows)
    batch, seq = ids.shape
    gen = torch.Generator().manual_seed(0)
    local = [
        zigzag_shard(torch.randn(batch, 1, seq, HEAD_DIM, generator=gen), rank, cp, dim=2).requires_grad_(True)
        for _ in range(3)
    ]
    with trace_ring_attention() as trace:
        out = ring_attention(*local, group, document_ids=zigzag_shard(ids, rank, cp, dim=1), document_tile=tile)
        out.sum().backward()
    return {
        "computed": trace.pairs("forward"),
        "visible": trace.visible_pairs("forward"),
        "backward": trace.pairs("backward"),
        "calls": sum(b.phase == "forward" for b in trace.blocks),
        "ideal": int(document_causal_mask(ids, ids).sum()),
        "causal": batch * seq * (seq + 1) // 2,
    }


def _pairs(rows: list[list[int]], tile: int) -> dict:
    results = get_pool(WORLD).run(pairs_case, rows=rows, tile=tile)
    total = {key: sum(r[key] for r in results) for key in ("computed", "visible", "backward", "calls")}
    ideal, causal = results[0]["ideal"], results[0]["causal"]
    assert total["visible"] == ideal  # every visible pair, each once
    assert total["backward"] == total["computed"] >= ideal
    return {**total, "ideal": ideal, "causal": causal, "ratio": total["computed"] / ideal}


def test_long_documents_cost_their_visible_pairs() -> None:
    """Documents of at least a tile: exactly the visible pairs are computed (cp = 4, S = 1024, tile 128)."""
    result = _pairs([[300, 130, 200, 394]], tile=128)
    assert result["computed"] == result["ideal"], result
    assert result["computed"] < 0.35 * result["causal"]  # vs plain causal attention


def test_mixed_documents_cost_bounded() -> None:
    """Four rows of log-uniform documents of 16 to 512 tokens at S = 2048, cp = 4: the documents shorter
    than the tile, packed into masked tiles, cost little over the visible pairs (measured: 1.000 at
    tile 32, 1.014 at tile 64, 1.135 at tile 128), about a tenth of plain causal attention."""
    rows = [_log_uniform_lengths(2048, 16, 512, seed) for seed in range(4)]
    for tile, bound in ((32, 1.01), (64, 1.05), (128, 1.2)):
        result = _pairs(rows, tile)
        assert 1.0 <= result["ratio"] <= bound, (tile, result)
        assert result["computed"] < 0.15 * result["causal"], (tile, result)


def test_short_documents_cost_bounded_by_tile() -> None:
    """Only documents of 16 tokens: a masked tile of ``tile`` rows holds ``tile / 16`` of them, so the
    cost over the visible pairs is at most ``tile**2 / (tile/16 * 16*17/2)`` (about 2 * tile / 17)."""
    for tile in (16, 32, 64):
        result = _pairs([[16] * 128], tile)
        assert result["ratio"] <= tile * tile / ((tile // 16) * 16 * 17 / 2) + 1e-9, (tile, result)


# --------------------------------------------------------------------------------------------------
# The CUDA kernel wrappers in the document path: a ring of threads in one process (tests/test_cuda.py)


def _documents_on_threads(q, k, v, dout, ids, cp: int, kernel, tile: int):  # noqa: ANN001, ANN202
    """``(out, dq, dk, dv)`` on the full sequence from ``cp`` zigzag ranks run as threads, with documents."""
    from lightning_moe.cp import zigzag_shard, zigzag_unshard

    boxes = [{tag: queue.Queue() for tag in (ra._KV_TAG, ra._DKV_TAG)} for _ in range(cp)]
    results: list = [None] * cp
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            local = [zigzag_shard(t, rank, cp, dim=2).contiguous() for t in (q, k, v)]
            items = ra._plan_documents(ids, rank, cp, "zigzag", tile, q.device)
            plan = ra.DocumentPlan((q.shape[0], local[0].shape[2]), "zigzag", rank, cp, tile, items)
            cfg = ra._Config(
                ring=_ThreadRing(rank, cp, boxes),
                causal=True,
                scale=1.0 / q.shape[-1] ** 0.5,
                layout="zigzag",
                kernel=ra._select_kernel(kernel, local[0]) if isinstance(kernel, str) else kernel,
                groups=q.shape[1] // k.shape[1],
                head_chunks=1,
                documents=plan,
            )
            ctx = _Ctx()
            with torch.no_grad():  # forward and backward called directly (see tests/test_cuda.py)
                out = ra._RingAttention.forward(ctx, *local, cfg)
                dq, dk, dv, _ = ra._RingAttention.backward(ctx, zigzag_shard(dout, rank, cp, dim=2).contiguous())
            results[rank] = (out, dq, dk, dv)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
            for tag_boxes in boxes:  # unblock the others
                for box in tag_boxes.values():
                    box.put([])

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(cp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return tuple(zigzag_unshard([results[r][i] for r in range(cp)], dim=2) for i in range(4))


def _documents_reference(q, k, v, dout, ids):  # noqa: ANN001, ANN202
    from lightning_moe.cp.documents import document_causal_mask

    leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    mask = document_causal_mask(ids, ids).to(q.device)
    out = F.scaled_dot_product_attention(*leaves, attn_mask=mask, enable_gqa=True)
    out.backward(dout.float())
    return (out.detach(), *(t.grad for t in leaves))


def _thread_case(device: str, dtype: torch.dtype, cp: int, dim: int = 16):  # noqa: ANN202
    seq = 40 * cp  # pieces of many lengths, none a multiple of 32
    ids = _document_ids([_random_lengths(seq, 1, 2 * seq // 3, seed=cp), _random_lengths(seq, 1, 9, seed=cp + 10)])
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, h, seq, dim, generator=gen) for h in (4, 2, 2, 4))
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, dout)] + [ids.to(device)]


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("name", ["_CUDA_FLASH", "_CUDA_EFFICIENT"])
def test_cuda_kernel_wrappers_with_documents_on_cpu(fake_cuda_attention_ops, name: str, cp: int) -> None:  # noqa: F811
    """The document path with the CUDA kernel wrappers, on CPU ops that follow the CUDA ops' contracts."""
    q, k, v, dout, ids = _thread_case("cpu", torch.float32, cp)
    got = _documents_on_threads(q, k, v, dout, ids, cp, getattr(ra, name), tile=8)
    for label, a, b in zip(("out", "dq", "dk", "dv"), got, _documents_reference(q, k, v, dout, ids)):
        torch.testing.assert_close(a.float(), b, atol=1e-5, rtol=1e-5, msg=f"{name} cp={cp}: {label}")


@_cuda_test
@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize(
    "kernel,dtype,tol",
    [("flash", torch.bfloat16, 3e-2), ("efficient", torch.float32, 1e-4), ("auto", torch.float16, 1e-2)],
)
def test_document_ring_cuda_kernels_match_masked_attention(
    cp: int, kernel: str, dtype: torch.dtype, tol: float
) -> None:
    """Not yet run on a GPU in this project."""
    if kernel == "flash" and ra._flash_kernel(torch.zeros(1, 1, 8, 64, device="cuda", dtype=dtype)) is None:
        pytest.skip("no flash attention kernel on this GPU")
    q, k, v, dout, ids = _thread_case("cuda", dtype, cp, dim=64)
    got = _documents_on_threads(q, k, v, dout, ids, cp, kernel, tile=16)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, _documents_reference(q, k, v, dout, ids)):
        torch.testing.assert_close(a.float(), b, atol=tol, rtol=tol, msg=f"{kernel} {dtype} cp={cp}: {name}")


# --------------------------------------------------------------------------------------------------
# Bad input


def test_bad_document_ids_raise_before_any_communication() -> None:
    """No process group exists in the test process: communication would fail differently."""
    from lightning_moe.cp import ring_attention

    q = torch.zeros(2, 4, 8, 8)
    good = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r"document_ids of shape \(2, 6\) do not match this rank's queries"):
        ring_attention(q, q, q, None, document_ids=torch.zeros(2, 6, dtype=torch.long))
    with pytest.raises(ValueError, match="must not decrease"):
        ring_attention(q, q, q, None, document_ids=torch.tensor([[0, 0, 1, 1, 0, 0, 2, 2]] * 2))
    with pytest.raises(ValueError, match="integer"):
        ring_attention(q, q, q, None, document_ids=good.float())
    with pytest.raises(ValueError, match="causal=True"):
        ring_attention(q, q, q, None, causal=False, document_ids=good)
    with pytest.raises(ValueError, match="document_tile"):
        ring_attention(q, q, q, None, document_ids=good, document_tile=0)


def bad_input_case() -> dict:
    from lightning_moe.cp import RingAttentionMode, ring_attention, zigzag_shard

    group = _cp_group(2)
    rank = dist.get_rank(group)
    messages = {}
    # Non-decreasing on each rank, decreasing over the row (chunks 0 1 5 2): every rank refuses after the gather.
    full = torch.tensor([[0] * 4 + [1] * 4 + [5] * 4 + [2] * 4])
    q = torch.randn(1, 2, 8, 4)
    try:
        ring_attention(q, q, q, group, document_ids=zigzag_shard(full, rank, 2))
    except ValueError as err:
        messages["across_shards"] = str(err)
    ids = torch.zeros(1, 8, dtype=torch.long)
    with RingAttentionMode(group, document_ids=ids) as mode:
        try:
            F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool))
        except ValueError as err:
            messages["mask"] = str(err)
        try:
            F.scaled_dot_product_attention(q[:, :, :4], q[:, :, :4], q[:, :, :4], is_causal=True)
        except ValueError as err:
            messages["shape"] = str(err)
        try:
            mode.set_document_ids(torch.tensor([[1, 0, 0, 0, 0, 0, 0, 0]]))
        except ValueError as err:
            messages["set_decreasing"] = str(err)
        # non-causal calls pass the documents by: full ring attention
        full_attention = F.scaled_dot_product_attention(q, q, q)
    messages["non_causal_equal"] = torch.allclose(full_attention, ring_attention(q, q, q, group, causal=False))
    return messages


def test_mode_and_ring_refuse_bad_input() -> None:
    for messages in get_pool(WORLD).run(bad_input_case):
        assert "must not decrease" in messages["across_shards"]
        assert "explicit attn_mask" in messages["mask"] and "is_causal=True" in messages["mask"]
        assert "do not match this rank's queries" in messages["shape"]
        assert "must not decrease" in messages["set_decreasing"]
        assert messages["non_causal_equal"]


# --------------------------------------------------------------------------------------------------
# The SDPA mode: a model unaware of context parallelism, documents per micro-batch


def mode_case(cp: int, head_chunks: int) -> dict:
    from lightning_moe.cp import context_parallel_attention, zigzag_shard
    from lightning_moe.cp.documents import document_attention, set_document_ids

    group = _cp_group(cp)
    rank = dist.get_rank(group)
    torch.manual_seed(0)
    model = TinyAttention()
    gen = torch.Generator().manual_seed(1)
    micro_batches = [
        (torch.randn(BATCH, 32, 16, generator=gen), _document_ids([[7, 20, 5], [1, 1, 30]])),
        (torch.randn(BATCH, 32, 16, generator=gen), _document_ids([[2, 2, 2, 26], [32]])),
    ]
    refs = []
    for x, ids in micro_batches:
        with torch.no_grad(), document_attention(ids):  # one process, dense document-causal mask
            refs.append(model(x))
    errors = {}
    with context_parallel_attention(group, head_chunks=head_chunks, document_tile=4) as mode:
        for step, ((x, ids), ref) in enumerate(zip(micro_batches, refs)):
            local_ids = zigzag_shard(ids, rank, cp)
            if step == 0:
                mode.set_document_ids(local_ids)  # a new micro-batch, the same mode
            else:
                assert set_document_ids(local_ids)  # or through the innermost active mode
            gathers = []
            all_gather = dist.all_gather
            dist.all_gather = lambda *a, **k: gathers.append(1) or all_gather(*a, **k)  # count the calls
            try:
                with torch.no_grad():
                    out = model(zigzag_shard(x, rank, cp))
                    again = model(zigzag_shard(x, rank, cp))  # a second layer over the same documents
            finally:
                dist.all_gather = all_gather
            errors[f"out{step}"] = (out - zigzag_shard(ref, rank, cp)).abs().max().item()
            errors[f"again{step}"] = (again - out).abs().max().item()
            errors[f"gathers{step}"] = abs(len(gathers) - 1.0)  # the ids are gathered once per micro-batch
    return errors


@pytest.mark.parametrize("head_chunks", [1, 2])
@pytest.mark.parametrize("cp", [2, 4])
def test_sdpa_mode_masks_documents_per_micro_batch(cp: int, head_chunks: int) -> None:
    for rank, errors in enumerate(get_pool(WORLD).run(mode_case, cp=cp, head_chunks=head_chunks)):
        for name, err in errors.items():
            assert err < 1e-5, f"rank {rank}: {name} differs by {err:.2e}"

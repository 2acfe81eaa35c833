"""All-to-all (Ulysses) context parallel attention equals full attention on the unsharded sequence.

Every rank of the 4-process gloo pool builds the same full Q, K, V, upstream gradient and document
ids (same seed), computes the one-process reference with ``F.scaled_dot_product_attention``, and
compares its own shard of it with what :func:`ulysses_attention` produced from the sharded inputs.
cp = 2 runs in the groups {0, 1} and {2, 3} side by side; cp = 4 uses all ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tests.dist_pool import get_pool

WORLD = 4
BATCH, SEQ, HEAD_DIM = 2, 32, 8
ATOL = 1e-5

_GROUPS: dict[int, dist.ProcessGroup] = {}


def _cp_group(cp: int) -> dist.ProcessGroup:
    """This rank's group of ``cp`` consecutive ranks (every rank creates every group, in one order)."""
    if cp not in _GROUPS:
        rank = dist.get_rank()
        for start in range(0, dist.get_world_size(), cp):
            group = dist.new_group(list(range(start, start + cp)))
            if start <= rank < start + cp:
                _GROUPS[cp] = group
    return _GROUPS[cp]


def _full_inputs(heads: int, kv_heads: int, v_dim: int = HEAD_DIM) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    shapes = ((heads, HEAD_DIM), (kv_heads, HEAD_DIM), (kv_heads, v_dim), (heads, v_dim))  # q, k, v, upstream grad
    return [torch.randn(BATCH, h, SEQ, d, generator=gen) for h, d in shapes]


def _documents() -> torch.Tensor:
    """``[BATCH, SEQ]`` ids: documents spanning shards (and the zigzag chunks), single-token documents."""
    starts = torch.zeros(BATCH, SEQ, dtype=torch.int64)
    starts[0, [3, 4, 5, 17, 30, 31]] = 1  # documents [0, 3) [3] [4] [5, 17) [17, 30) [30] [31]
    gen = torch.Generator().manual_seed(7)
    starts[1, torch.randperm(SEQ - 1, generator=gen)[:6] + 1] = 1
    starts[1, [10, 11, 12]] = 1  # single-token documents 10 and 11
    return starts.cumsum(1)


def _reference(full: list[torch.Tensor], causal: bool, documents: torch.Tensor | None) -> tuple[torch.Tensor, list]:
    from lightning_moe.cp.documents import document_causal_mask

    refs = [t.clone().requires_grad_(True) for t in full[:3]]
    if documents is None:
        out = F.scaled_dot_product_attention(*refs, is_causal=causal, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(
            *refs, attn_mask=document_causal_mask(documents, documents), enable_gqa=True
        )
    out.backward(full[3])
    return out.detach(), [t.grad for t in refs]


def attention_case(
    cp: int,
    causal: bool,
    heads: int,
    kv_heads: int,
    layout: str = "zigzag",
    documents: bool = False,
    v_dim: int = HEAD_DIM,
) -> dict:
    from lightning_moe.cp import shard_sequence
    from lightning_moe.cp.ulysses import ulysses_attention

    group = _cp_group(cp)
    rank = dist.get_rank(group)
    full = _full_inputs(heads, kv_heads, v_dim)
    doc_ids = _documents() if documents else None
    ref_out, ref_grads = _reference(full, causal, doc_ids)

    def shard(t: torch.Tensor, dim: int = 2) -> torch.Tensor:
        return shard_sequence(t, rank, cp, dim=dim, layout=layout)

    local = [shard(t).requires_grad_(True) for t in full[:3]]
    local_docs = None if doc_ids is None else shard(doc_ids, dim=1)
    out = ulysses_attention(
        *local, group, causal=causal, layout=layout, enable_gqa=heads != kv_heads, document_ids=local_docs
    )
    out.backward(shard(full[3]))
    errors = {"out": (out - shard(ref_out)).abs().max().item()}
    for name, mine, ref in zip("qkv", local, ref_grads):
        errors[f"d{name}"] = (mine.grad - shard(ref)).abs().max().item()
    return {"errors": errors, "shape": tuple(out.shape)}


def _assert_close(results: list[dict]) -> None:
    for rank, result in enumerate(results):
        for name, err in result["errors"].items():
            assert err < ATOL, f"rank {rank}: {name} differs by {err:.2e}"


@pytest.mark.parametrize(
    "cp,heads,kv_heads",
    [(2, 4, 4), (4, 4, 4), (4, 8, 2), (2, 4, 1), (2, 6, 3), (4, 8, 8)],
    ids=["cp2-mha", "cp4-mha", "cp4-gqa8x2", "cp2-gqa4x1", "cp2-gqa6x3", "cp4-mha8"],
)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_matches_full_attention(cp: int, heads: int, kv_heads: int, causal: bool) -> None:
    """Outputs and dq/dk/dv equal one-process SDPA; K/V heads fewer than (or not a multiple of) cp are repeated."""
    results = get_pool(WORLD).run(attention_case, cp=cp, causal=causal, heads=heads, kv_heads=kv_heads)
    _assert_close(results)
    assert results[0]["shape"] == (BATCH, heads, SEQ // cp, HEAD_DIM)


def test_value_head_dim_of_its_own() -> None:
    """V with another head_dim than Q and K (MLA-style) travels in the same exchange."""
    results = get_pool(WORLD).run(attention_case, cp=2, causal=True, heads=4, kv_heads=2, v_dim=12)
    _assert_close(results)
    assert results[0]["shape"] == (BATCH, 4, SEQ // 2, 12)


@pytest.mark.parametrize("cp", [2, 4])
def test_contiguous_layout(cp: int) -> None:
    _assert_close(get_pool(WORLD).run(attention_case, cp=cp, causal=True, heads=8, kv_heads=2, layout="contiguous"))


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("cp,heads,kv_heads", [(2, 4, 4), (4, 8, 2), (2, 4, 1)], ids=["cp2-mha", "cp4-gqa", "cp2-mqa"])
def test_documents_match_masked_attention(cp: int, heads: int, kv_heads: int, layout: str) -> None:
    """Document-causal attention over documents spanning shards, single-token ones included."""
    case = dict(cp=cp, causal=True, heads=heads, kv_heads=kv_heads, layout=layout, documents=True)
    _assert_close(get_pool(WORLD).run(attention_case, **case))


def flex_forward_case(cp: int, heads: int, kv_heads: int) -> dict:
    """The CUDA branch of the full-sequence document mask (flex attention's block mask) on CPU tensors,
    forward only (flex attention has no backward on CPU)."""
    from lightning_moe.cp import document_causal_mask, zigzag_shard
    from lightning_moe.cp.ulysses import ulysses_attention
    from tests.test_packed_documents import flex_attention_on_cpu

    group = _cp_group(cp)
    rank = dist.get_rank(group)
    q, k, v, _ = _full_inputs(heads, kv_heads)
    doc_ids = _documents()
    with torch.no_grad(), flex_attention_on_cpu() as flex_calls:
        out = ulysses_attention(
            *(zigzag_shard(t, rank, cp, dim=2) for t in (q, k, v)),
            group,
            enable_gqa=heads != kv_heads,
            document_ids=zigzag_shard(doc_ids, rank, cp),
        )
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=document_causal_mask(doc_ids, doc_ids), enable_gqa=True)
    return {
        "errors": {"out": (out - zigzag_shard(dense, rank, cp, dim=2)).abs().max().item()},
        "flex_calls": flex_calls,
    }


@pytest.mark.parametrize("cp,heads,kv_heads", [(2, 4, 4), (4, 8, 2), (2, 4, 1)], ids=["cp2-mha", "cp4-gqa", "cp2-mqa"])
def test_documents_by_the_flex_block_mask_forward(cp: int, heads: int, kv_heads: int) -> None:
    """Each rank's heads over the whole sequence go through the block mask once (K/V heads repeated to cp)."""
    results = get_pool(WORLD).run(flex_forward_case, cp=cp, heads=heads, kv_heads=kv_heads)
    _assert_close(results)
    from lightning_moe.cp.ulysses import ulysses_kv_heads

    kv_local = ulysses_kv_heads(heads, kv_heads, cp) // cp
    for result in results:
        assert result["flex_calls"] == [
            ((BATCH, heads // cp, SEQ, HEAD_DIM), (BATCH, kv_local, SEQ, HEAD_DIM), (BATCH, kv_local, SEQ, HEAD_DIM))
        ]


def leak_case(cp: int) -> dict:
    """Change the tokens of document 3 (row 0, positions [5, 17), on every rank's shard) and see who notices."""
    from lightning_moe.cp import zigzag_shard
    from lightning_moe.cp.ulysses import ulysses_attention

    group = _cp_group(cp)
    rank = dist.get_rank(group)
    q, k, v, _ = _full_inputs(8, 2)
    doc_ids = _documents()
    changed = doc_ids == doc_ids[0, 5]
    changed[1] = False
    gen = torch.Generator().manual_seed(99)
    altered = []
    for t in (q, k, v):
        t2 = t.clone()
        t2[0, :, changed[0]] = torch.randn(t2[0, :, changed[0]].shape, generator=gen)
        altered.append(t2)

    def run(tensors: list[torch.Tensor]) -> torch.Tensor:
        local = [zigzag_shard(t, rank, cp, dim=2) for t in tensors]
        return ulysses_attention(*local, group, enable_gqa=True, document_ids=zigzag_shard(doc_ids, rank, cp))

    before, after = run([q, k, v]), run(altered)
    diff = (before - after).abs().amax(dim=(1, 3))  # [B, S_local]
    mine = zigzag_shard(changed, rank, cp)
    return {"others": diff[~mine].max().item(), "changed": diff[mine].min().item() if mine.any() else None}


@pytest.mark.parametrize("cp", [2, 4])
def test_documents_do_not_leak(cp: int) -> None:
    results = get_pool(WORLD).run(leak_case, cp=cp)
    for rank, result in enumerate(results):
        assert result["others"] == 0.0, f"rank {rank}: a token of another document changed by {result['others']:.2e}"
    assert any(r["changed"] is not None and r["changed"] > 0 for r in results)  # the altered document did change


def refusal_case() -> dict:
    """Heads not divisible by cp: ValueError on every rank before any collective (they would all raise)."""
    from lightning_moe.cp.ulysses import UlyssesAttentionMode, ulysses_attention

    group = _cp_group(4)
    issued = []
    originals = {name: getattr(dist, name) for name in ("all_to_all_single", "all_gather", "all_gather_into_tensor")}
    for name in originals:
        setattr(dist, name, lambda *a, _name=name, **kw: issued.append(_name))
    messages = []
    try:
        q, kv = torch.randn(1, 6, 4, 8), torch.randn(1, 2, 4, 8)
        docs = torch.zeros(1, 4, dtype=torch.int64)
        for call in (
            lambda: ulysses_attention(q, kv, kv, group, enable_gqa=True, document_ids=docs),
            lambda: ulysses_attention(q, q, q, group, causal=False),
        ):
            try:
                call()
            except ValueError as err:
                messages.append(str(err))
        with UlyssesAttentionMode(group, document_ids=docs):
            try:
                F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
            except ValueError as err:
                messages.append(str(err))
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return {"messages": messages, "issued": issued}


def test_heads_not_divisible_refused_before_communication() -> None:
    for result in get_pool(WORLD).run(refusal_case):
        assert result["issued"] == []
        assert len(result["messages"]) == 3
        for message in result["messages"]:
            assert "cp = 4" in message and "6 query heads" in message
            assert "use cp dividing the heads, or cp_comm='ring'" in message


class TinyAttention(nn.Module):
    """A user's attention block: knows nothing of context parallelism, calls SDPA."""

    def __init__(self, dim: int = 32, heads: int = 8, kv_heads: int = 2) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.o = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x).unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)
        k, v = self.kv(x).unflatten(-1, (2 * self.kv_heads, self.head_dim)).transpose(1, 2).chunk(2, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return self.o(y.transpose(1, 2).flatten(2))


def mode_case(cp: int, heads: int, kv_heads: int, documents: bool) -> dict:
    from lightning_moe.cp import zigzag_shard
    from lightning_moe.cp.documents import document_attention
    from lightning_moe.cp.ulysses import all_to_all_attention

    group = _cp_group(cp)
    rank = dist.get_rank(group)
    torch.manual_seed(0)
    model = TinyAttention(heads=heads, kv_heads=kv_heads)
    gen = torch.Generator().manual_seed(1)
    x, probe = torch.randn(BATCH, SEQ, 32, generator=gen), torch.randn(BATCH, SEQ, 32, generator=gen)
    doc_ids = _documents()

    x_ref = x.clone().requires_grad_(True)
    if documents:
        with document_attention(doc_ids):
            ref_out = model(x_ref)
    else:
        ref_out = model(x_ref)
    (ref_out * probe).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    x_local = zigzag_shard(x, rank, cp).requires_grad_(True)
    with all_to_all_attention(group) as mode:
        if documents:
            mode.set_document_ids(zigzag_shard(doc_ids, rank, cp))
        out = model(x_local)
    (out * zigzag_shard(probe, rank, cp)).sum().backward()
    errors = {
        "out": (out - zigzag_shard(ref_out, rank, cp)).abs().max().item(),
        "dx": (x_local.grad - zigzag_shard(x_ref.grad, rank, cp)).abs().max().item(),
    }
    for name, param in model.named_parameters():
        dist.all_reduce(param.grad, group=group)  # each cp rank holds the gradient of its own tokens
        errors[name] = (param.grad - ref_grads[name]).abs().max().item()
    return {"errors": errors}


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("cp,heads,kv_heads", [(2, 4, 1), (4, 8, 2), (2, 4, 4)], ids=["cp2-mqa", "cp4-gqa", "cp2-mha"])
def test_sdpa_mode_gives_cp_without_model_changes(cp: int, heads: int, kv_heads: int, documents: bool) -> None:
    _assert_close(get_pool(WORLD).run(mode_case, cp=cp, heads=heads, kv_heads=kv_heads, documents=documents))


def mode_errors_case() -> dict:
    from lightning_moe.cp.ulysses import UlyssesAttentionMode

    q = torch.randn(1, 2, 8, 4)
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    messages = {}
    with UlyssesAttentionMode(_cp_group(2)):
        for name, kwargs in {"mask": {"attn_mask": mask}, "dropout": {"dropout_p": 0.1}}.items():
            try:
                F.scaled_dot_product_attention(q, q, q, **kwargs)
            except NotImplementedError as err:
                messages[name] = str(err)
    with UlyssesAttentionMode(_cp_group(1)):  # cp = 1: plain SDPA, masks included
        plain = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    messages["cp1_equal"] = torch.equal(plain, F.scaled_dot_product_attention(q, q, q, attn_mask=mask))
    return messages


def test_sdpa_mode_rejects_unsupported_arguments() -> None:
    for messages in get_pool(WORLD).run(mode_errors_case):
        assert "attn_mask" in messages["mask"] and "cp = 2" in messages["mask"]
        assert "dropout_p=0.1" in messages["dropout"]
        assert messages["cp1_equal"]


def accounting_case(heads: int, kv_heads: int) -> dict:
    """One attention call's bytes, counted by the comm accounting on the strategy's cp mesh group."""
    from lightning_moe import comm
    from lightning_moe.callbacks import count_collectives, group_dims
    from lightning_moe.cp import zigzag_shard
    from lightning_moe.cp.ulysses import ulysses_attention
    from tests.dist_pool import layout

    dims = layout(cp=2)  # dp = 2; a cp group spanning every rank would be the default group, not "mesh_cp"
    group, cp = dims.cp_group, 2
    rank = dist.get_rank(group)
    full = _full_inputs(heads, kv_heads)
    counted = {}
    for name, autocast in (("fp32", False), ("bf16", True)):
        local = [zigzag_shard(t, rank, cp, dim=2).requires_grad_(True) for t in full[:3]]
        comm.reset()
        with count_collectives(group_dims(dims)):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = ulysses_attention(*local, group, enable_gqa=True)
            counted[f"{name}_forward"] = comm.snapshot()
            out.float().sum().backward()
            counted[f"{name}_step"] = comm.snapshot()
    comm.reset()
    return counted


def test_bytes_accounting_equals_ulysses_bytes_per_rank() -> None:
    from lightning_moe.cp.ulysses import ulysses_bytes_per_rank

    heads, kv_heads = 4, 1  # K/V repeated to 2 heads: what travels is accounted
    for counted in get_pool(WORLD).run(accounting_case, heads=heads, kv_heads=kv_heads):
        for name, dtype_bytes in (("fp32", 4), ("bf16", 2)):
            expected = ulysses_bytes_per_rank(BATCH, heads, kv_heads, SEQ, HEAD_DIM, cp=2, dtype_bytes=dtype_bytes)
            assert counted[f"{name}_forward"] == {"cp": {"bytes": expected, "calls": 2}}
            assert counted[f"{name}_step"] == {"cp": {"bytes": 2 * expected, "calls": 4}}


def test_bytes_per_rank_formula() -> None:
    from lightning_moe.cp.ulysses import ulysses_bytes_per_rank, ulysses_kv_heads

    # 3/4 of each local tensor leaves: q and out (8 heads), k and v (2 heads repeated to 4)
    local = 1 * 1024 * 128 * 2  # batch * seq/cp * head_dim * bf16 bytes per head
    assert ulysses_bytes_per_rank(1, 8, 2, 4096, 128, cp=4, dtype_bytes=2) == (8 + 4 + 4 + 8) * local * 3 // 4
    assert ulysses_bytes_per_rank(2, 8, 8, 64, 16, cp=1, dtype_bytes=4) == 0
    assert [ulysses_kv_heads(8, kv, 4) for kv in (1, 2, 4, 8)] == [4, 4, 4, 8]
    assert ulysses_kv_heads(6, 3, 2) == 6 and ulysses_kv_heads(12, 6, 4) == 12
    with pytest.raises(ValueError, match="use cp dividing the heads, or cp_comm='ring'"):
        ulysses_bytes_per_rank(1, 6, 2, 64, 8, cp=4, dtype_bytes=2)
    with pytest.raises(ValueError, match="not a multiple"):
        ulysses_kv_heads(8, 3, 2)


def test_the_planners_all_to_all_bytes_are_the_runtimes():
    """The planner's estimate of a2a traffic (planner/comm/cp.py) counts what the runtime sends."""
    from lightning_moe.cp.ulysses import ulysses_bytes_per_rank
    from lightning_moe.planner.comm.cp import ulysses_attention_bytes

    for heads, kv_heads, cp in [(8, 8, 2), (8, 2, 4), (4, 1, 2), (6, 3, 2), (12, 6, 4), (16, 2, 8)]:
        for batch, seq_len, head_dim, dtype_bytes in [(1, 64, 16, 4), (2, 4096, 128, 2)]:
            runtime = ulysses_bytes_per_rank(batch, heads, kv_heads, seq_len, head_dim, cp, dtype_bytes)
            assert (
                ulysses_attention_bytes(batch, heads, kv_heads, seq_len, head_dim, cp, dtype_bytes, backward=False)
                == runtime
            )
            assert ulysses_attention_bytes(batch, heads, kv_heads, seq_len, head_dim, cp, dtype_bytes) == 2 * runtime

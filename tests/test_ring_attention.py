"""Ring attention equals full attention on the unsharded sequence, forward and backward.

Every rank of the 4-process gloo pool builds the same full Q, K, V and upstream gradient (same seed),
computes the single-process reference with ``F.scaled_dot_product_attention``, and compares its own
shard of the reference with what ring attention produced from the sharded inputs. cp = 2 runs in the
two groups {0, 1} and {2, 3} side by side; cp = 4 uses all ranks; cp = 1 is the ring of one.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tests.dist_pool import get_pool

WORLD = 4
BATCH, HEAD_DIM = 2, 8
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


def _full_inputs(seq: int, heads: int, kv_heads: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seq * 100 + heads * 10 + kv_heads)
    heads_of = (heads, kv_heads, kv_heads, heads)  # q, k, v, upstream grad
    return [torch.randn(BATCH, h, seq, HEAD_DIM, generator=gen).to(dtype) for h in heads_of]


def ring_case(
    cp: int, causal: bool, heads: int, kv_heads: int, kernel: str, layout: str, seq: int = 32, head_chunks: int = 1
) -> dict:
    from lightning_moe.cp import ring_attention, shard_sequence, trace_ring_attention

    group = _cp_group(cp)
    rank = dist.get_rank(group)
    full_q, full_k, full_v, full_grad = _full_inputs(seq, heads, kv_heads)
    refs = [t.clone().requires_grad_(True) for t in (full_q, full_k, full_v)]
    ref_out = F.scaled_dot_product_attention(*refs, is_causal=causal, enable_gqa=True)
    ref_out.backward(full_grad)

    def shard(t: torch.Tensor) -> torch.Tensor:
        return shard_sequence(t, rank, cp, dim=2, layout=layout)

    local = [shard(t).requires_grad_(True) for t in (full_q, full_k, full_v)]
    with trace_ring_attention() as trace:
        out = ring_attention(*local, group, causal, layout, kernel=kernel, head_chunks=head_chunks)
        out.backward(shard(full_grad))
    errors = {"out": (out - shard(ref_out)).abs().max().item()}
    for name, mine, ref in zip("qkv", local, refs):
        errors[f"d{name}"] = (mine.grad - shard(ref.grad)).abs().max().item()
    forward_blocks = [b for b in trace.blocks if b.phase == "forward"]
    return {"errors": errors, "pairs": trace.pairs("forward"), "blocks": len(forward_blocks)}


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("kernel", ["flash", "torch"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_ring_attention_matches_full_attention(
    cp: int, causal: bool, heads: int, kv_heads: int, kernel: str, layout: str
) -> None:
    case = dict(cp=cp, causal=causal, heads=heads, kv_heads=kv_heads, kernel=kernel, layout=layout)
    results = get_pool(WORLD).run(ring_case, **case)
    for rank, result in enumerate(results):
        for name, err in result["errors"].items():
            assert err < ATOL, f"rank {rank}: {name} differs by {err:.2e}"


@pytest.mark.parametrize("heads,kv_heads,head_chunks", [(4, 4, 4), (4, 2, 2), (4, 4, 2)], ids=["mha4", "gqa2", "mha2"])
@pytest.mark.parametrize("cp", [2, 4])
def test_head_chunks_match_full_attention(cp: int, heads: int, kv_heads: int, head_chunks: int) -> None:
    """One ring pass per share of the heads gives the same outputs and gradients as one pass over all."""
    case = dict(cp=cp, causal=True, heads=heads, kv_heads=kv_heads, kernel="flash", layout="zigzag")
    for rank, result in enumerate(get_pool(WORLD).run(ring_case, head_chunks=head_chunks, **case)):
        for name, err in result["errors"].items():
            assert err < ATOL, f"rank {rank}: {name} differs by {err:.2e}"
        assert result["blocks"] == cp * head_chunks  # each pass visits every rank's block once


def test_zigzag_balances_causal_work() -> None:
    """Causal zigzag: every rank attends the same number of pairs; contiguous puts it on the last rank."""
    seq, heads = 64, 4
    full_causal_pairs = BATCH * heads * seq * (seq + 1) // 2
    case = dict(cp=4, causal=True, heads=heads, kv_heads=heads, kernel="flash", seq=seq)
    zigzag = get_pool(WORLD).run(ring_case, layout="zigzag", **case)
    contiguous = get_pool(WORLD).run(ring_case, layout="contiguous", **case)
    for results in (zigzag, contiguous):
        assert sum(r["pairs"] for r in results) == full_causal_pairs  # nothing masked computed, nothing visible missed
    assert len({r["pairs"] for r in zigzag}) == 1
    assert [r["blocks"] for r in zigzag] == [4, 4, 4, 4]  # the diagonal plus one half block per other rank
    assert [r["blocks"] for r in contiguous] == [1, 2, 3, 4]  # fully masked blocks skipped
    contiguous_pairs = [r["pairs"] for r in contiguous]
    assert max(contiguous_pairs) / (sum(contiguous_pairs) / 4) > 1.5


class _LargestSeqDim(TorchDispatchMode):
    """Records the largest dimension of every tensor an op creates (the sequence dims dominate here)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(t, torch.Tensor) and t.dim():
                self.largest = max(self.largest, max(t.shape))
        return result


def materialisation_case(cp: int, kernel: str) -> dict:
    from lightning_moe.cp import ring_attention, zigzag_shard

    seq, heads = 64, 4
    group = _cp_group(cp)
    rank = dist.get_rank(group)
    full_q, full_k, full_v, full_grad = _full_inputs(seq, heads, heads)
    local = [zigzag_shard(t, rank, cp, dim=2).requires_grad_(True) for t in (full_q, full_k, full_v)]
    local_grad = zigzag_shard(full_grad, rank, cp, dim=2)
    with _LargestSeqDim() as ring_seen:
        ring_attention(*local, group, kernel=kernel).backward(local_grad)
    refs = [t.clone().requires_grad_(True) for t in (full_q, full_k, full_v)]
    with _LargestSeqDim() as full_seen:  # the control: full attention does create full-length tensors
        F.scaled_dot_product_attention(*refs, is_causal=True).backward(full_grad)
    return {"ring": ring_seen.largest, "full": full_seen.largest}


@pytest.mark.parametrize("kernel", ["flash", "torch"])
@pytest.mark.parametrize("cp", [2, 4])
def test_no_tensor_spans_the_full_sequence(cp: int, kernel: str) -> None:
    for result in get_pool(WORLD).run(materialisation_case, cp=cp, kernel=kernel):
        assert result["full"] == 64
        assert result["ring"] <= 64 // cp, result  # forward and backward only ever see local-length blocks


def bf16_case(autocast: bool) -> dict:
    from lightning_moe.cp import ring_attention, zigzag_shard

    group = _cp_group(2)
    rank = dist.get_rank(group)
    full = _full_inputs(32, 4, 2)
    ref = F.scaled_dot_product_attention(*full[:3], is_causal=True, enable_gqa=True)
    local = [zigzag_shard(t, rank, 2, dim=2) for t in full[:3]]
    if not autocast:
        local = [t.bfloat16() for t in local]
    local = [t.requires_grad_(True) for t in local]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = ring_attention(*local, group)
    out.backward(zigzag_shard(full[3], rank, 2, dim=2).to(out.dtype))
    return {
        "dtype": str(out.dtype),
        "grad_dtype": str(local[1].grad.dtype),
        "err": (out.float() - zigzag_shard(ref, rank, 2, dim=2)).abs().max().item(),
    }


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "autocast"])
def test_bf16(autocast: bool) -> None:
    for result in get_pool(WORLD).run(bf16_case, autocast=autocast):
        assert result["dtype"] == "torch.bfloat16"  # like SDPA: bf16 inputs, or autocast, give bf16
        assert result["grad_dtype"] == ("torch.float32" if autocast else "torch.bfloat16")
        assert result["err"] < 3e-2  # bf16 rounding of inputs and output; statistics stay fp32


class TinyAttention(nn.Module):
    """A user's attention block: knows nothing of context parallelism, calls SDPA."""

    def __init__(self, dim: int = 16, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.o = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x).unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)
        k, v = self.kv(x).unflatten(-1, (2 * self.kv_heads, self.head_dim)).transpose(1, 2).chunk(2, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).flatten(2))


def mode_case(cp: int) -> dict:
    from lightning_moe.cp import context_parallel_attention, zigzag_shard

    group = _cp_group(cp)
    rank = dist.get_rank(group)
    torch.manual_seed(0)
    model = TinyAttention()
    gen = torch.Generator().manual_seed(1)
    x, probe = torch.randn(BATCH, 32, 16, generator=gen), torch.randn(BATCH, 32, 16, generator=gen)

    x_ref = x.clone().requires_grad_(True)
    ref_out = model(x_ref)
    (ref_out * probe).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    x_local = zigzag_shard(x, rank, cp).requires_grad_(True)
    with context_parallel_attention(group):
        out = model(x_local)
    (out * zigzag_shard(probe, rank, cp)).sum().backward()
    errors = {
        "out": (out - zigzag_shard(ref_out, rank, cp)).abs().max().item(),
        "dx": (x_local.grad - zigzag_shard(x_ref.grad, rank, cp)).abs().max().item(),
    }
    for name, param in model.named_parameters():
        dist.all_reduce(param.grad, group=group)  # each cp rank holds the gradient of its own tokens
        errors[name] = (param.grad - ref_grads[name]).abs().max().item()
    return errors


@pytest.mark.parametrize("cp", [2, 4])
def test_sdpa_mode_gives_cp_without_model_changes(cp: int) -> None:
    for rank, errors in enumerate(get_pool(WORLD).run(mode_case, cp=cp)):
        for name, err in errors.items():
            assert err < ATOL, f"rank {rank}: {name} differs by {err:.2e}"


def mode_errors_case() -> dict:
    from lightning_moe.cp import RingAttentionMode

    q = torch.randn(1, 2, 8, 4)
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    messages = {}
    with RingAttentionMode(_cp_group(2)):
        for name, kwargs in {"mask": {"attn_mask": mask}, "dropout": {"dropout_p": 0.1}}.items():
            try:
                F.scaled_dot_product_attention(q, q, q, **kwargs)
            except NotImplementedError as err:
                messages[name] = str(err)
    with RingAttentionMode(_cp_group(1)):  # cp = 1: plain SDPA, masks included
        plain = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    messages["cp1_equal"] = torch.equal(plain, F.scaled_dot_product_attention(q, q, q, attn_mask=mask))
    return messages


def test_sdpa_mode_rejects_unsupported_arguments() -> None:
    for messages in get_pool(WORLD).run(mode_errors_case):
        assert "attn_mask" in messages["mask"] and "cp = 2" in messages["mask"]
        assert "dropout_p=0.1" in messages["dropout"]
        assert messages["cp1_equal"]


def test_argument_errors() -> None:
    from lightning_moe.cp import ring_attention

    q = torch.zeros(1, 4, 6, 8)
    with pytest.raises(ValueError, match="not a multiple"):
        ring_attention(q, torch.zeros(1, 3, 6, 8), torch.zeros(1, 3, 6, 8), None)
    with pytest.raises(ValueError, match="must agree"):
        ring_attention(q, torch.zeros(1, 4, 4, 8), torch.zeros(1, 4, 4, 8), None)
    with pytest.raises(ValueError, match="odd"):
        ring_attention(torch.zeros(1, 4, 5, 8), torch.zeros(1, 4, 5, 8), torch.zeros(1, 4, 5, 8), None)
    with pytest.raises(ValueError, match="head_chunks=3 must divide the 4 key/value heads"):
        ring_attention(q, q, q, None, head_chunks=3)
    with pytest.raises(ValueError, match="unknown ring attention kernel"):
        ring_attention(q, q, q, None, kernel="cudnn")

"""Packed documents: a row of several documents under their mask gives each document's own logits, on one
process and under context parallel (ring and all-to-all), tp x cp and pp x cp; nothing leaks between them.
The CUDA branch of the mask (flex attention's block mask) runs forward on CPU tensors too."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from lightning_moe.cp import document_attention
from lightning_moe.models import MoEGPT
from tests.dist_pool import close_pools, get_pool
from tests.presets import TORCH_RELEASE
from tests.test_cuda import _cuda_test

SEQ = 32
LENGTHS = [(5, 11, 16), (20, 3, 1, 8)]  # documents per row, tokens each (sum SEQ)
TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def packed_batch(perturb_document: int | None = None) -> dict[str, torch.Tensor]:
    """Two rows of packed documents: ``input_ids``, ``labels``, restarted ``position_ids`` and ``document_ids``;
    ``perturb_document``: that document of every row gets other tokens."""
    tokens = torch.randint(0, 256, (len(LENGTHS), SEQ + 1), generator=torch.Generator().manual_seed(3))
    documents = torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in LENGTHS])
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in LENGTHS])
    inputs = tokens[:, :-1].clone()
    if perturb_document is not None:
        inputs[documents == perturb_document] = (inputs[documents == perturb_document] + 17) % 256
    return {"input_ids": inputs, "labels": tokens[:, 1:], "position_ids": positions, "document_ids": documents}


class PackedGPT(MoEGPT):
    """MoEGPT whose predict step returns the logits of a packed batch."""

    def predict_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self(batch["input_ids"], batch["position_ids"])


def tiny_model() -> PackedGPT:
    torch.manual_seed(0)
    return PackedGPT(
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        moe={"num_experts": 4, "top_k": 2, "ffn_hidden_size": 32},
    ).eval()


def tiny_hf_model() -> torch.nn.Module:
    from lightning_moe.hf import TINY_CONFIGS, HFMoEModule

    class PackedHF(HFMoEModule):
        def predict_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            return self(batch["input_ids"], batch["position_ids"])

    torch.manual_seed(0)
    return PackedHF({"model_type": "qwen3_moe", **TINY_CONFIGS["qwen3_moe"]}).eval()


def one_process_logits(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    with torch.no_grad(), document_attention(batch["document_ids"]):
        return model(batch["input_ids"], batch["position_ids"])


def test_a_packed_row_gives_each_document_its_own_logits():
    model = tiny_model()
    batch = packed_batch()
    packed = one_process_logits(model, batch)
    for row, lengths in enumerate(LENGTHS):
        start = 0
        for length in lengths:
            alone = model(batch["input_ids"][row : row + 1, start : start + length])  # positions from 0
            torch.testing.assert_close(packed[row : row + 1, start : start + length], alone, **TOLERANCE)
            start += length


def test_a_hugging_face_family_packed_equals_separate():
    pytest.importorskip("transformers")
    module = tiny_hf_model()
    batch = packed_batch()
    with torch.no_grad():
        packed = one_process_logits(module, batch)
        row, start, length = 1, 20, 3
        alone = module(batch["input_ids"][row : row + 1, start : start + length])
    torch.testing.assert_close(packed[row : row + 1, start : start + length], alone, **TOLERANCE)


def test_nothing_leaks_between_documents_on_one_process():
    model = tiny_model()
    base, changed = (
        one_process_logits(model, packed_batch()),
        one_process_logits(model, packed_batch(perturb_document=1)),
    )
    others = packed_batch()["document_ids"] != 1
    torch.testing.assert_close(changed[others], base[others], rtol=0, atol=1e-6)  # expert GEMMs of other sizes
    assert not torch.allclose(changed[~others], base[~others])


def test_bad_document_ids_are_refused():
    from lightning_moe.cp import check_document_ids
    from lightning_moe.parallel.runtime.documents import batch_document_ids

    batch = packed_batch()
    with pytest.raises(ValueError, match=r"do not match the inputs' \[batch, seq\] = \(2, 32\)"):
        batch_document_ids({**batch, "document_ids": batch["document_ids"][:, :-1]})
    with pytest.raises(ValueError, match=r"must not decrease along a row.*not contiguous"):
        check_document_ids(torch.tensor([[0, 0, 1, 0]]))
    q = torch.randn(1, 2, 4, 8)
    with document_attention(torch.tensor([[0, 0, 1, 1]])), pytest.raises(ValueError, match=r"explicit attn_mask"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool))


def test_selective_checkpointing_recomputes_under_the_same_mask():
    """The attention core recomputed in backward (outside the step) is masked as in forward."""
    from lightning_moe.parallel.plans.activation_checkpoint import apply_activation_checkpointing

    batch = packed_batch()
    grads = []
    for mode in ("none", "selective", "full"):
        model = tiny_model().train()
        apply_activation_checkpointing(model, mode)
        with document_attention(batch["document_ids"]):
            loss = model.loss(batch)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    for other in grads[1:]:
        for name, grad in grads[0].items():
            torch.testing.assert_close(other[name], grad, rtol=1e-5, atol=1e-7, msg=name)


# --- the CUDA branch (flex attention's block mask), forward on CPU -------------------------------------


@contextlib.contextmanager
def flex_attention_on_cpu() -> Iterator[list[tuple]]:
    """Within the block, document masks take the CUDA branch (flex attention's block mask) on CPU tensors too;
    flex attention has no backward on CPU, so forward only. Yields the q, k, v shapes of every flex call."""
    from lightning_moe.cp import documents

    flex, calls = documents._flex_attention, []

    def counted(q, k, v, *args):  # noqa: ANN001, ANN202
        calls.append((tuple(q.shape), tuple(k.shape), tuple(v.shape)))
        return flex(q, k, v, *args)

    with (
        mock.patch.object(documents, "_masks_by_blocks", lambda q: True),
        mock.patch.object(documents, "_flex_attention", counted),
    ):
        yield calls


def _long_documents(batch: int, seq: int) -> torch.Tensor:
    """Documents longer and shorter than flex attention's 128-token blocks (so blocks are skipped, partial
    and full), single-token ones included."""
    starts = torch.zeros(batch, seq, dtype=torch.int64)
    starts[0, [1, 2, 130, 131, 300]] = 1
    starts[1, torch.randperm(seq - 1, generator=torch.Generator().manual_seed(5))[:9] + 1] = 1
    return starts.cumsum(1)


@pytest.mark.parametrize(
    "heads,kv_heads,scale,compiled",
    [
        (4, 4, None, False),
        (8, 2, 0.3, False),
        (6, 1, None, False),
        pytest.param(
            8,
            2,
            0.3,
            True,
            marks=pytest.mark.skipif(
                TORCH_RELEASE < (2, 13),
                reason="torch 2.11's CPU inductor flex kernel corrupts the heap with a scale and"
                " these documents (glibc malloc assertion, the process aborts); production compiles on CUDA only",
            ),
        ),
    ],
    ids=["mha", "gqa-scale", "mqa", "gqa-scale-compiled"],
)
def test_the_flex_block_mask_equals_the_dense_mask_forward(heads, kv_heads, scale, compiled):
    """`compiled`: the kernel CUDA runs (compiled flex attention, which skips masked blocks), compiled for CPU."""
    from lightning_moe.cp import documents

    if compiled:
        stack = mock.patch.object(documents, "_flex_kernel", lambda q: documents._compiled_flex_attention())
    else:
        stack = contextlib.nullcontext()
    seq, dim = 320, 8
    gen = torch.Generator().manual_seed(heads)
    q = torch.randn(2, heads, seq, dim, generator=gen)
    k, v = (torch.randn(2, kv_heads, seq, dim, generator=gen) for _ in range(2))
    ids = _long_documents(2, seq)
    gqa = heads != kv_heads
    with torch.no_grad(), stack, flex_attention_on_cpu() as flex_calls, document_attention(ids):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    assert flex_calls == [(tuple(q.shape), tuple(k.shape), tuple(v.shape))]
    from lightning_moe.cp import document_causal_mask

    dense = F.scaled_dot_product_attention(
        q, k, v, attn_mask=document_causal_mask(ids, ids), scale=scale, enable_gqa=gqa
    )
    torch.testing.assert_close(out, dense, **TOLERANCE)
    causal = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    assert not torch.allclose(out, causal, **TOLERANCE)  # the documents do mask


@_cuda_test
def test_the_flex_block_mask_on_cuda_forward_and_backward():
    """On a GPU the branch runs for real, backward included."""
    seq, ids = 320, _long_documents(2, 320).cuda()
    gen = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(2, h, seq, 8, generator=gen).cuda() for h in (8, 2, 2, 8))
    outputs = []
    for flex in (True, False):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        with mock.patch("lightning_moe.cp.documents._masks_by_blocks", lambda q: flex), document_attention(ids):
            out = F.scaled_dot_product_attention(*leaves, is_causal=True, scale=0.3, enable_gqa=True)
        out.backward(grad)
        outputs.append([out.detach(), *(t.grad for t in leaves)])
    for flex, dense in zip(*outputs):
        torch.testing.assert_close(flex, dense, **TOLERANCE)


def test_the_flex_block_mask_gives_the_models_packed_logits():
    """MoEGPT (grouped-query attention, RoPE at the documents' positions) through the block mask."""
    model, batch = tiny_model(), packed_batch()
    with flex_attention_on_cpu() as flex_calls:
        flex = one_process_logits(model, batch)
    assert len(flex_calls) == 2  # one call per layer
    torch.testing.assert_close(flex, one_process_logits(model, batch), **TOLERANCE)


# --- under the strategy -------------------------------------------------------------------------------


def _predict_packed(strategy: dict, hf: bool = False) -> list[torch.Tensor] | None:
    """Rank 0's predictions (whole logits) of the packed batch and of it with document 1 changed."""
    import lightning as L
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from lightning_moe import MoE5DStrategy
    from tests.launched_rank import launched_rank

    with launched_rank(env={"HF_HUB_OFFLINE": "1"}):
        model = tiny_hf_model() if hf else tiny_model()
        trainer = L.Trainer(
            accelerator="cpu",
            devices=dist.get_world_size(),
            strategy=MoE5DStrategy(**strategy),
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            use_distributed_sampler=False,
        )
        loader = DataLoader([packed_batch(), packed_batch(perturb_document=1)], batch_size=None)
        predictions = trainer.predict(model, dataloaders=loader)
    # Under pp a Lightning batch holds pp_microbatches loader batches: here both, one after the other.
    logits = torch.cat([p.detach() for p in predictions])
    return list(logits.chunk(2)) if dist.get_rank() == 0 else None


STRATEGIES = [
    ({"cp": 2}, 2, False),
    ({"cp": 2, "cp_comm": "a2a"}, 2, False),
    ({"cp": 2}, 2, True),
    ({"cp": 2, "cp_comm": "a2a"}, 2, True),
    ({"tp": 2, "cp": 2}, 4, False),
    ({"tp": 2, "cp": 2, "cp_comm": "a2a"}, 4, False),
    ({"pp": 2, "cp": 2}, 4, False),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy,world,hf",
    STRATEGIES,
    ids=["cp2_ring", "cp2_a2a", "qwen3_moe_cp2_ring", "qwen3_moe_cp2_a2a", "tp2_cp2_ring", "tp2_cp2_a2a", "pp2_cp2"],
)
def test_packed_logits_under_the_strategy_equal_one_process_and_do_not_leak(strategy, world, hf):
    if hf:
        pytest.importorskip("transformers")
    try:
        base, changed = get_pool(world).run(_predict_packed, strategy=strategy, hf=hf)[0]
    finally:
        if strategy.get("pp", 1) > 1:
            close_pools()  # a pipeline leaves the stages' groups different: a later fit in these processes would hang
    model = tiny_hf_model() if hf else tiny_model()
    torch.testing.assert_close(base, one_process_logits(model, packed_batch()), **TOLERANCE)
    others = packed_batch()["document_ids"] != 1
    torch.testing.assert_close(changed[others], base[others], rtol=0, atol=1e-6)  # expert GEMMs of other sizes
    assert not torch.allclose(changed[~others], base[~others])

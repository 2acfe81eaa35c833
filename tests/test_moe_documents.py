"""Packed documents in the MoE layer: seq_aux_loss per document, routing-replay keys (one process, fast)."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_moe.models import MoEGPT
from lightning_moe.moe import (
    DOCUMENT_KEY_BOUND,
    MoEAuxLossAutoScaler,
    MoELayer,
    current_routing_documents,
    document_sample_key,
    recompute_with_routing_documents,
    record_routing,
    replay_routing,
    routing_documents,
    seq_aux_loss,
    seq_aux_loss_per_document,
    set_aux_loss_scale,
    set_routing_documents,
)
from lightning_moe.moe.documents import document_balance_loss, document_balance_statistics

H, E, K, S = 16, 4, 2, 16
# Two packed rows: documents of 5, 3 and 8 tokens; of 4 and 12 tokens.
LENGTHS = ([5, 3, 8], [4, 12])


def _ids(lengths=LENGTHS) -> torch.Tensor:
    return torch.stack([torch.cat([torch.full((n,), d) for d, n in enumerate(row)]) for row in lengths])


def _positions(lengths=LENGTHS) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])


@pytest.fixture(autouse=True)
def _unit_aux_scale():
    previous = MoEAuxLossAutoScaler.main_loss_backward_scale
    set_aux_loss_scale(1.0)
    yield
    set_aux_loss_scale(previous)


def _layer(seed: int = 0, **options) -> MoELayer:
    torch.manual_seed(seed)
    return MoELayer(H, 32, E, top_k=K, load_balancing="seq_aux_loss", aux_loss_coeff=1.0, **options)


def _aux(layer: MoELayer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's reported aux loss and the gradient of the aux loss alone on ``router.weight``."""
    layer.zero_grad(set_to_none=True)
    (layer(x) * 0).sum().backward()  # zero task gradient: the router gets the aux loss's gradient only
    return layer.stats["aux_loss"].clone(), layer.router.weight.grad.clone()


def _reference(layer: MoELayer, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """seq_aux_loss_per_document on the router's own probabilities, and its router-weight gradient."""
    routing = layer.router(x.reshape(-1, H))
    loss = seq_aux_loss_per_document(
        routing.probs.view(*x.shape[:2], E), routing.topk_idx.view(*x.shape[:2], K), ids, layer.aux_loss_coeff
    )
    (grad,) = torch.autograd.grad(loss, layer.router.weight)
    return loss.detach(), grad


# ------------------------------------------------------------------------------------------- seq_aux_loss
def test_seq_aux_loss_takes_each_packed_document_as_a_sequence():
    layer, ids = _layer(), _ids()
    x = torch.randn(2, S, H, generator=torch.Generator().manual_seed(1))
    with routing_documents(ids):
        loss, grad = _aux(layer, x)
    expected_loss, expected_grad = _reference(layer, x, ids)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-6, atol=1e-6)

    # The same as running every document alone (each one row) and averaging its seq_aux_loss.
    losses, grads = [], []
    for row, lengths in enumerate(LENGTHS):
        start = 0
        for n in lengths:
            one_loss, one_grad = _aux(layer, x[row : row + 1, start : start + n])
            losses.append(one_loss)
            grads.append(one_grad)
            start += n
    torch.testing.assert_close(loss, torch.stack(losses).mean(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, torch.stack(grads).mean(0), rtol=1e-6, atol=1e-6)

    # It differs from the loss of the rows as sequences (what the layer computes without documents).
    row_loss, _ = _aux(layer, x)
    assert abs(row_loss.item() - loss.item()) > 1e-4


def test_one_document_per_row_is_the_row_loss_and_empty_ids_do_not_count():
    layer = _layer()
    x = torch.randn(2, S, H, generator=torch.Generator().manual_seed(2))
    row_loss, row_grad = _aux(layer, x)
    with routing_documents(torch.zeros(2, S, dtype=torch.int64)):
        loss, grad = _aux(layer, x)
    torch.testing.assert_close(loss, row_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, row_grad, rtol=1e-6, atol=1e-7)
    # Ids with gaps (0, 2, 5) are still three documents: unused ids hold no token and are not averaged.
    gaps = torch.tensor([[0] * 6 + [2] * 6 + [5] * 4, [0] * 16])
    dense = torch.tensor([[0] * 6 + [1] * 6 + [2] * 4, [0] * 16])
    with routing_documents(gaps):
        gap_loss, gap_grad = _aux(layer, x)
    with routing_documents(dense):
        dense_loss, dense_grad = _aux(layer, x)
    torch.testing.assert_close(gap_loss, dense_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(gap_grad, dense_grad, rtol=1e-6, atol=1e-7)


def test_shard_statistics_add_up_to_the_whole_row():
    """What the layer does under cp x tp: global counts and token totals, each shard's own prob sums;
    the shards' losses (and gradients) add up to the loss of the whole rows."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, S, E, generator=gen, requires_grad=True)
    probs = logits.softmax(-1)
    topk_idx = probs.topk(K, dim=-1).indices
    ids = _ids()
    whole = seq_aux_loss_per_document(probs, topk_idx, ids, 0.5)
    (whole_grad,) = torch.autograd.grad(whole, logits, retain_graph=True)
    # Zigzag halves: chunks 0 and 3 on one rank, 1 and 2 on the other.
    chunks = [slice(0, 4), slice(4, 8), slice(8, 12), slice(12, 16)]
    shards = [[chunks[0], chunks[3]], [chunks[1], chunks[2]]]
    documents_per_row = int(ids.max()) + 1  # the MAX over the shards
    stats = []
    for parts in shards:
        take = lambda t: torch.cat([t[:, p] for p in parts], dim=1)  # noqa: E731
        stats.append(document_balance_statistics(take(probs), take(topk_idx), take(ids), documents_per_row))
    counts = sum(s[1] for s in stats)
    tokens = sum(s[2] for s in stats)
    local = [document_balance_loss(s[0], counts, tokens, K, 0.5) for s in stats]
    torch.testing.assert_close(sum(local), whole, rtol=1e-6, atol=1e-7)
    (grad,) = torch.autograd.grad(sum(local), logits)
    torch.testing.assert_close(grad, whole_grad, rtol=1e-6, atol=1e-7)


def test_without_documents_nothing_changes():
    layer = _layer()
    x = torch.randn(2, S, H, generator=torch.Generator().manual_seed(4))
    routing = layer.router(x.reshape(-1, H))
    expected = seq_aux_loss(routing.probs.view(2, S, E), routing.topk_idx.view(2, S, K), 1.0)
    (expected_grad,) = torch.autograd.grad(expected, layer.router.weight)
    loss, grad = _aux(layer, x)
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-6, atol=1e-7)
    # routing_documents(None) (also inside a block with documents) is the same code path: bit-identical.
    with routing_documents(_ids()), routing_documents(None):
        assert current_routing_documents() is None
        none_loss, none_grad = _aux(layer, x)
    assert torch.equal(none_loss, loss) and torch.equal(none_grad, grad)


def test_ids_of_another_shape_are_refused_naming_both_shapes():
    layer = _layer()
    x = torch.randn(2, S, H)
    with routing_documents(_ids()[:, :-1]), pytest.raises(ValueError, match=r"\(2, 15\).*\(2, 16\)"):
        layer(x)
    with pytest.raises(ValueError, match="integer"):
        with routing_documents(torch.zeros(2, S)):
            pass
    with routing_documents(torch.full((2, S), -1)), pytest.raises(ValueError, match=">= 0"):
        layer(x)
    with routing_documents(torch.arange(2 * S).view(2, S)), pytest.raises(ValueError, match="from 0"):
        layer(x)  # ids numbered across the batch, not per row
    with pytest.raises(ValueError, match=r"\(2, 15\).*\(2, 16\)"):
        seq_aux_loss_per_document(torch.rand(2, S, E), torch.zeros(2, S, K, dtype=torch.int64), _ids()[:, :-1], 1.0)


def test_the_context_set_and_recompute():
    a, b = _ids(), torch.zeros(2, S, dtype=torch.int64)
    assert current_routing_documents() is None and set_routing_documents(a) is False
    with routing_documents(a):
        assert current_routing_documents() is a
        replay = recompute_with_routing_documents()
        with routing_documents(None):
            assert set_routing_documents(b) is True  # the innermost block
            assert current_routing_documents() is b
        assert current_routing_documents() is a
        assert set_routing_documents(b) is True
        assert current_routing_documents() is b
    assert current_routing_documents() is None
    with replay:  # what was active when it was made
        assert current_routing_documents() is a
    none = recompute_with_routing_documents()
    with routing_documents(b), none:  # none then: none in the recomputation either
        assert current_routing_documents() is None


# ------------------------------------------------------------------------------------------- replay keys
SAMPLES = (3, 8)


def _model(seed: int = 0) -> MoEGPT:
    torch.manual_seed(seed)
    return MoEGPT(hidden_size=32, num_layers=2, num_heads=2, moe={"num_experts": E, "top_k": K, "ffn_hidden_size": 32})


def _batch(packed: bool = True) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 256, (2, S + 1), generator=torch.Generator().manual_seed(5))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "sample_index": torch.tensor(SAMPLES)}
    if packed:
        batch["position_ids"] = _positions()
    return batch


def _record(model: MoEGPT, batch: dict, documents: torch.Tensor | None):
    with routing_documents(documents), record_routing(model, weights=True) as recorder:
        model.loss(batch)
    return recorder.trace()


def test_replay_keys_packed_documents_by_sample_document_and_position():
    model, batch, ids = _model(), _batch(), _ids()
    # Restarted positions alone collide: fewer recorded tokens than the batch holds.
    collided = _record(model, batch, None)
    assert int((collided.experts[..., 0, 0] >= 0).sum()) < 2 * S
    trace = _record(model, batch, ids)
    keys = [
        document_sample_key(torch.tensor(s), torch.tensor(d)).item()
        for s, row in zip(SAMPLES, LENGTHS)
        for d in range(len(row))
    ]
    assert trace.sample_index.tolist() == keys  # one trace sample per document
    assert trace.seq_len == max(max(row) for row in LENGTHS)
    # Every token has its own key: each one's slot is recorded, and exactly the batch's tokens.
    for layer_index in range(2):
        assert int((trace.experts[:, :, layer_index, 0] >= 0).sum()) == 2 * S

    # Replay with perturbed routers keeps the recorded experts.
    perturbed = copy.deepcopy(model)
    with torch.no_grad():
        for layer in perturbed.modules():
            if isinstance(layer, MoELayer):
                layer.router.weight.add_(
                    torch.randn(layer.router.weight.shape, generator=torch.Generator().manual_seed(7))
                )
    assert not torch.equal(_record(perturbed, batch, ids).experts, trace.experts)
    with routing_documents(ids), replay_routing(perturbed, trace), record_routing(perturbed) as seen:
        perturbed.loss(batch).backward()
    assert torch.equal(seen.trace().experts, trace.experts)
    assert all(m.router.weight.grad.abs().sum() > 0 for m in perturbed.modules() if isinstance(m, MoELayer))
    # Without the documents the keys are the plain samples, which the trace does not hold.
    with replay_routing(perturbed, trace), pytest.raises(ValueError, match="not in the trace"):
        perturbed.loss(batch)
    # Ids of another shape than the MoE input are refused.
    with (
        routing_documents(ids[:, :-1]),
        record_routing(model),
        pytest.raises(ValueError, match=r"\(2, 15\).*\(2, 16\)"),
    ):
        model.loss(batch)


def test_a_batch_without_documents_keeps_the_old_keys():
    model, batch = _model(), _batch(packed=False)
    trace = _record(model, batch, None)
    assert trace.sample_index.tolist() == list(SAMPLES) and trace.seq_len == S
    with routing_documents(None):
        same = _record(model, batch, None)
    assert torch.equal(same.experts, trace.experts) and torch.equal(same.sample_index, trace.sample_index)


def test_document_sample_key_bounds():
    assert document_sample_key(torch.tensor([2]), torch.tensor([3])).item() == 2 * DOCUMENT_KEY_BOUND + 3
    with pytest.raises(ValueError, match="document ids must lie in"):
        document_sample_key(torch.tensor([0]), torch.tensor([DOCUMENT_KEY_BOUND]))
    with pytest.raises(ValueError, match="sample indices must lie in"):
        document_sample_key(torch.tensor([2**39]), torch.tensor([0]))
    with pytest.raises(ValueError, match="document ids must lie in"):
        document_sample_key(torch.tensor([0]), torch.tensor([-1]))


# ------------------------------------------------------------------------------------------- two ranks
def sharded_document_loss_case(seed: int) -> list[dict]:
    """This rank's half of each row (zigzag, then contiguous), the layer's sequence group = both ranks."""
    import torch.distributed as dist

    set_aux_loss_scale(1.0)
    layer = _layer(seed)
    layer.sequence_group = dist.group.WORLD
    x = torch.randn(2, S, H, generator=torch.Generator().manual_seed(seed + 1))
    chunks = [slice(0, 4), slice(4, 8), slice(8, 12), slice(12, 16)]
    rank = dist.get_rank()
    # Contiguous halves: rank 0 sees ids up to 1 only, rank 1 up to 2 (the MAX agreement matters).
    splits = [[chunks[0], chunks[3]] if rank == 0 else [chunks[1], chunks[2]], [chunks[2 * rank], chunks[2 * rank + 1]]]
    reports = []
    for parts in splits:
        take = lambda t: torch.cat([t[:, p] for p in parts], dim=1)  # noqa: E731, B023
        with routing_documents(take(_ids())):
            loss, grad = _aux(layer, take(x))
        reports.append({"loss": loss, "grad": grad})
    return reports


@pytest.mark.slow
def test_sharded_rows_give_the_one_process_loss():
    from tests.dist_pool import get_pool

    layer, ids = _layer(0), _ids()
    x = torch.randn(2, S, H, generator=torch.Generator().manual_seed(1))
    with routing_documents(ids):
        loss, grad = _aux(layer, x)
    ranks = get_pool(2).run(sharded_document_loss_case, seed=0)
    for split in range(2):  # zigzag, contiguous
        reports = [rank[split] for rank in ranks]
        for report in reports:  # the reported value is the whole micro-batch's on every rank
            torch.testing.assert_close(report["loss"], loss, rtol=1e-6, atol=1e-6)
        # The ranks' gradients add up to the one-process gradient (what the cp gradient reduction sums).
        torch.testing.assert_close(reports[0]["grad"] + reports[1]["grad"], grad, rtol=1e-5, atol=1e-6)

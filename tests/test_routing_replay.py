"""Routing record and replay (R3): one process, the trace file, refusals, and other layouts."""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch

from lightning_moe.data import ByteWindowDataset
from lightning_moe.models import MoEGPT
from lightning_moe.moe import MoELayer, RoutingTrace, record_routing, replay_routing
from lightning_moe.moe.replay import SCHEMA_VERSION

H, E, K, S = 32, 4, 2, 16


def _model(seed: int = 0, num_layers: int = 2, **moe) -> MoEGPT:
    torch.manual_seed(seed)
    return MoEGPT(
        hidden_size=H,
        num_layers=num_layers,
        num_heads=2,
        moe={"num_experts": E, "top_k": K, "ffn_hidden_size": 32, **moe},
    )


def _batch(samples=(3, 8, 11, 20), seq: int = S, seed: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (len(samples), seq + 1), generator=gen)
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "sample_index": torch.tensor(samples)}


def _record(model: MoEGPT, batch: dict, weights: bool = False) -> RoutingTrace:
    with record_routing(model, weights=weights) as recorder:
        model.loss(batch)
    return recorder.trace()


def _perturb_routers(model: MoEGPT, scale: float = 1.0, seed: int = 7) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, MoELayer):
                layer.router.weight.add_(scale * torch.randn(layer.router.weight.shape, generator=gen))


# ------------------------------------------------------------------------------------------- one process
def test_record_holds_every_token_in_global_order():
    model, batch = _model(), _batch()
    trace = _record(model, batch, weights=True)
    assert trace.sample_index.tolist() == [3, 8, 11, 20]
    assert tuple(trace.experts.shape) == (4, S, 2, K)
    assert trace.layer_names == ["layers.0.feed_forward", "layers.1.feed_forward"]
    assert trace.num_experts == [E, E]
    assert int(trace.experts.min()) >= 0 and int(trace.experts.max()) < E
    # topk_norm: the weights of a token sum to 1; the experts of a token are distinct.
    torch.testing.assert_close(trace.weights.sum(-1), torch.ones(4, S, 2))
    assert (trace.experts[..., 0] != trace.experts[..., 1]).all()
    # Counting slots per expert gives the layer's statistics.
    layer = model.layers["1"].feed_forward
    counts = torch.bincount(trace.experts[:, :, 1].reshape(-1), minlength=E).float()
    assert torch.equal(counts, layer.stats["tokens_per_expert"])


def test_replay_of_the_same_model_changes_nothing():
    model, batch = _model(), _batch()
    loss = model.loss(batch)
    trace = _record(model, batch)
    with replay_routing(model, trace):
        replayed = model.loss(batch)
    assert replayed.item() == pytest.approx(loss.item(), rel=1e-6)


def test_replay_with_perturbed_router_keeps_the_recorded_experts_and_trains_the_router():
    model, batch = _model(), _batch()
    trace = _record(model, batch)
    _perturb_routers(model)
    assert not torch.equal(_record(model, batch).experts, trace.experts)  # the router would choose otherwise

    inputs: dict[str, torch.Tensor] = {}
    layer = model.layers["0"].feed_forward
    handle = layer.register_forward_pre_hook(lambda mod, args: inputs.__setitem__("x", args[0].detach()))
    with replay_routing(model, trace), record_routing(model, weights=True) as seen:
        loss = model.loss(batch)
        loss.backward()
    handle.remove()
    replayed = seen.trace()
    assert torch.equal(replayed.experts, trace.experts)
    # Gate weights: the router's scores at the replayed experts, normalised to sum 1 (topk_norm).
    scores = torch.softmax(inputs["x"].reshape(-1, H) @ layer.router.weight.detach().T, dim=-1)
    chosen = scores.gather(1, trace.experts[:, :, 0].reshape(-1, K))
    torch.testing.assert_close(replayed.weights[:, :, 0].reshape(-1, K), chosen / chosen.sum(-1, keepdim=True))
    # Gradients reach every router, and the statistics count the replayed experts.
    for moe in (model.layers["0"].feed_forward, model.layers["1"].feed_forward):
        grad = moe.router.weight.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
    counts = torch.bincount(trace.experts[:, :, 0].reshape(-1), minlength=E).float()
    assert torch.equal(layer.stats["tokens_per_expert"], counts)


def test_replay_gradient_equals_the_router_that_chose_the_same_experts():
    # Replaying a model's own routing gives the very gradients of its normal step (aux loss included).
    model, batch = _model(), _batch()
    reference = copy.deepcopy(model)
    reference.loss(batch).backward()
    trace = _record(model, batch)
    with replay_routing(model, trace):
        model.loss(batch).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize(
    "options",
    [
        {"load_balancing": "aux_loss", "z_loss_coeff": 1e-3},
        {"load_balancing": "seq_aux_loss"},
        {"load_balancing": "global_aux_loss"},
        {"load_balancing": "sinkhorn"},
        {"load_balancing": "none", "score_func": "sigmoid", "expert_bias": True},
        {"load_balancing": "aux_loss", "num_groups": 2, "group_topk": 1},
    ],
    ids=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "expert_bias", "group_limited"],
)
def test_balancing_types_follow_the_replayed_choice(options):
    model, batch = _model(**options), _batch()
    model.train()
    if options.get("expert_bias"):
        with torch.no_grad():
            model.layers["0"].feed_forward.router.expert_bias.copy_(torch.linspace(-0.3, 0.3, E))
    trace = _record(model, batch)
    # Unperturbed, the replay reproduces the normal step exactly (Sinkhorn's and the bias's choice included).
    reference, twin = copy.deepcopy(model), copy.deepcopy(model)
    with replay_routing(twin, trace):
        replayed = twin.loss(batch)
    assert replayed.item() == pytest.approx(reference.loss(batch).item(), rel=1e-6)
    for layer in model.modules():
        if isinstance(layer, MoELayer) and layer.router.use_expert_bias:
            layer.router.expert_load.zero_()
    _perturb_routers(model, scale=0.5)
    with replay_routing(model, trace), record_routing(model) as seen:
        model.loss(batch).backward()
    assert torch.equal(seen.trace().experts, trace.experts)
    for index, key in enumerate(("0", "1")):
        layer = model.layers[key].feed_forward
        counts = torch.bincount(trace.experts[:, :, index].reshape(-1), minlength=E).float()
        assert torch.equal(layer.stats["tokens_per_expert"], counts)
        assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0
        if options.get("expert_bias"):
            # Loads of the replayed choice accumulate for the bias update.
            assert torch.equal(layer.router.expert_load, counts)


def test_trace_file_round_trip(tmp_path):
    model, batch = _model(), _batch()
    trace = _record(model, batch, weights=True)
    path = tmp_path / "routing.safetensors"
    trace.save(path)
    loaded = RoutingTrace.load(path)
    assert torch.equal(loaded.experts, trace.experts) and torch.equal(loaded.sample_index, trace.sample_index)
    assert torch.equal(loaded.weights, trace.weights)
    assert loaded.layer_names == trace.layer_names and loaded.num_experts == trace.num_experts
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["schema_version"] == str(SCHEMA_VERSION)
        assert set(f.keys()) == {"sample_index", "experts", "weights"}
    with replay_routing(model, path):  # a path works too
        model.loss(batch)


def test_trace_file_of_another_schema_or_format_is_refused(tmp_path):
    from safetensors.torch import save_file

    model, batch = _model(), _batch()
    trace = _record(model, batch)
    path = tmp_path / "t.safetensors"
    trace.save(path)
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    save_file(tensors, str(tmp_path / "v99.safetensors"), metadata={**meta, "schema_version": "99"})
    with pytest.raises(ValueError, match="schema version 99"):
        RoutingTrace.load(tmp_path / "v99.safetensors")
    save_file({"x": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not a routing trace"):
        RoutingTrace.load(tmp_path / "other.safetensors")


# ------------------------------------------------------------------------------------------- refusals
def test_mismatched_batches_are_refused_with_the_mismatch_named():
    model, batch = _model(), _batch()
    trace = _record(model, batch)
    with replay_routing(model, trace):
        with pytest.raises(ValueError, match=r"samples \[99\] are not in the trace"):
            model.loss(_batch(samples=(3, 99, 11, 20)))
        with pytest.raises(ValueError, match=r"positions \[16, 17.*outside the trace's sequence of 16"):
            model.loss(_batch(seq=2 * S))
    partial = _record(model, {k: v[:, : S // 2] if v.dim() == 2 else v for k, v in batch.items()})
    partial.experts = torch.cat([partial.experts, partial.experts.new_full(partial.experts.shape, -1)], dim=1)
    with replay_routing(model, partial), pytest.raises(ValueError, match="holds no experts for .* sample 3 position 8"):
        model.loss(batch)
    # Without sample indices, batch rows are the samples: rows 0..3 are not samples 3, 8, 11, 20.
    with replay_routing(model, trace), pytest.raises(ValueError, match="not in the trace"):
        model.loss({k: v for k, v in batch.items() if k != "sample_index"})


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"num_layers": 3}, "no layer 'layers.2.feed_forward'"),
        ({"num_experts": 8}, "recorded 4 experts, the layer has 8"),
        ({"top_k": 1}, "recorded top_k=2, the layer has top_k=1"),
    ],
)
def test_traces_of_other_models_are_refused(kwargs, match):
    trace = _record(_model(), _batch())
    num_layers = kwargs.pop("num_layers", 2)
    other = _model(num_layers=num_layers, **kwargs)
    with pytest.raises(ValueError, match=match):
        with replay_routing(other, trace):
            pass


@pytest.mark.parametrize(
    "options,match",
    [
        ({"capacity_factor": 1.0}, "capacity_factor=1.0 cannot be recorded or replayed: which slots an expert drops"),
        ({"capacity_factor": 1.0, "routing": "expert_choice"}, "routing='expert_choice' cannot be recorded"),
    ],
)
def test_undefined_combinations_are_refused(options, match):
    model = _model(**options)
    with pytest.raises(ValueError, match=match):
        with record_routing(model):
            pass
    trace = _record(_model(), _batch())
    with pytest.raises(ValueError, match=match):
        with replay_routing(model, trace):
            pass


def test_hooks_are_removed_after_the_block():
    model, batch = _model(), _batch()
    trace = _record(model, batch)
    with replay_routing(model, trace):
        pass
    assert all(m.routing_hook is None for m in model.modules() if isinstance(m, MoELayer))
    model.loss(_batch(samples=(100, 101, 102, 103)))  # no trace lookup outside the block


def test_datasets_carry_the_global_sample_index(tmp_path):
    path = tmp_path / "c.bin"
    path.write_bytes(bytes(range(256)) * 4)
    ds = ByteWindowDataset(path, seq_len=7, first_window=10, num_windows=5)
    assert ds[0]["sample_index"].item() == 10 and ds[4]["sample_index"].item() == 14
    batch = torch.utils.data.default_collate([ds[1], ds[3]])
    assert batch["sample_index"].tolist() == [11, 13]


# ------------------------------------------------------------------------------------------- other layouts
WORLD = 4
SAMPLES = (3, 8, 11, 20)
RTOL = 1e-5


# Packed rows of SAMPLES: documents (tokens each) spanning the cp shards, single-token ones included.
PACKED = [(5, 11), (3, 1, 12), (16,), (7, 2, 7)]


def _packed_batch() -> dict[str, torch.Tensor]:
    """``_batch(SAMPLES)`` packed: ``document_ids`` and ``position_ids`` restarting at each document."""
    documents = torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in PACKED])
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in PACKED])
    return {**_batch(SAMPLES), "document_ids": documents, "position_ids": positions}


def _one_process_context(batch: dict) -> contextlib.AbstractContextManager:
    """What the strategy's step enters on one process: the document mask for attention and MoE (none unpacked)."""
    from lightning_moe.cp import document_attention
    from lightning_moe.parallel.runtime.documents import packed_documents

    documents = batch.get("document_ids")
    return contextlib.nullcontext() if documents is None else packed_documents(document_attention(documents), documents)


def _step_context(dims, batch: dict, cp_comm: str) -> contextlib.AbstractContextManager:  # noqa: ANN001
    """What the strategy's step enters on this rank (MoE5DStrategy._step_context) for this rank's ``batch``."""
    from lightning_moe.cp import all_to_all_attention, context_parallel_attention, document_attention
    from lightning_moe.parallel.runtime.documents import packed_documents

    documents = batch.get("document_ids")
    if dims.cp > 1:
        attention = (
            all_to_all_attention(dims.cp_group, document_ids=documents)
            if cp_comm == "a2a"
            else context_parallel_attention(dims.cp_group, document_ids=documents)
        )
    elif documents is not None:
        attention = document_attention(documents)
    else:
        return contextlib.nullcontext()
    return packed_documents(attention, documents, dims.tp_mesh.get_local_rank(), dims.tp)


def replay_layout_case(tp: int, cp: int, ep: int, trace_path: str, packed: bool = False, cp_comm: str = "ring") -> dict:
    """Under a layout, on this rank's share of the batch: the unperturbed model's routing recorded (gathered from
    every rank), and the one-process trace replayed by the perturbed model: its loss, the gathered chosen
    experts, the counts. ``packed``: the batch of packed documents."""
    import torch.distributed as dist

    from lightning_moe import parallelize
    from lightning_moe.parallel.plans.context_parallel import shard_batch_for_context_parallel
    from tests.dist_pool import layout

    dims = layout(tp=tp, cp=cp, ep=ep)
    batch = _packed_batch() if packed else _batch(SAMPLES)
    share = len(SAMPLES) // dims.dp_ep_mesh.size()
    rank = dims.dp_ep_mesh.get_local_rank()
    batch = {k: v[rank * share : (rank + 1) * share] for k, v in batch.items()}
    if cp > 1:
        batch = shard_batch_for_context_parallel(batch, dims)

    unperturbed = _model()
    parallelize(unperturbed, dims, data_parallel="none", sequence_parallel=True)
    with record_routing(unperturbed) as recorder, _step_context(dims, batch, cp_comm):
        unperturbed.loss(batch)
    recorded = recorder.trace(group=dist.group.WORLD)

    model = _model()
    _perturb_routers(model)
    parallelize(model, dims, data_parallel="none", sequence_parallel=True)
    with replay_routing(model, trace_path), record_routing(model) as seen, _step_context(dims, batch, cp_comm):
        loss = model.loss(batch)
        loss.backward()
    chosen = seen.trace(group=dist.group.WORLD)
    total = loss.detach().clone()
    dist.all_reduce(total)
    counts = []
    for layer in model.modules():
        if isinstance(layer, MoELayer):
            c = layer.stats["tokens_per_expert"].clone()  # reduced over cp x tp already
            dist.all_reduce(c, group=dims.dp_ep_mesh.get_group())
            counts.append(c)
    grads = [layer.router.weight.grad.abs().sum().item() for layer in model.modules() if isinstance(layer, MoELayer)]
    return {
        "loss": total.item() / dist.get_world_size(),
        "experts": chosen.experts,
        "samples": chosen.sample_index,
        "counts": torch.stack(counts),
        "router_grad": grads,
        "recorded": recorded,
    }


def _one_process_replay(path: str, packed: bool) -> dict:
    """The trace of the unperturbed model (saved at ``path``) and the one-process replay of it by the perturbed model."""
    model, batch = _model(), _packed_batch() if packed else _batch(SAMPLES)
    with _one_process_context(batch):
        trace = _record(model, batch)
    trace.save(path)
    _perturb_routers(model)
    with _one_process_context(batch):
        free = model.loss(batch).item()
    replayed = _replay_on_one_process(model, batch, path)
    assert abs(free - replayed["loss"]) > 1e-4 * abs(
        replayed["loss"]
    )  # the perturbed router alone would route otherwise
    return {"path": path, "trace": trace, **replayed}


def _replay_on_one_process(model: MoEGPT, batch: dict, trace: RoutingTrace | str) -> dict:
    with replay_routing(model, trace), record_routing(model) as seen, _one_process_context(batch):
        loss = model.loss(batch).item()
    counts = torch.stack([m.stats["tokens_per_expert"] for m in model.modules() if isinstance(m, MoELayer)])
    return {"loss": loss, "experts": seen.trace().experts, "samples": seen.trace().sample_index, "counts": counts}


@pytest.fixture(scope="module")
def one_process_replay(tmp_path_factory):
    return _one_process_replay(str(tmp_path_factory.mktemp("trace") / "routing.safetensors"), packed=False)


@pytest.fixture(scope="module")
def one_process_packed_replay(tmp_path_factory):
    return _one_process_replay(str(tmp_path_factory.mktemp("packed_trace") / "routing.safetensors"), packed=True)


def _check_layout_replay(reports: list[dict], reference: dict, packed: bool) -> None:
    """Every rank: the layout's record is the one-process trace, and the layout's replay of that trace is
    the one-process replay (experts, counts, loss); the layout's record replayed on one process too."""
    for rank, report in enumerate(reports):
        assert torch.equal(report["recorded"].sample_index, reference["trace"].sample_index), f"rank {rank}"
        assert torch.equal(report["recorded"].experts, reference["trace"].experts), (
            f"rank {rank}: recorded other experts"
        )
        assert torch.equal(report["samples"], reference["samples"]), f"rank {rank}"
        assert torch.equal(report["experts"], reference["experts"]), f"rank {rank}: other experts"
        assert torch.equal(report["counts"], reference["counts"]), f"rank {rank}: {report['counts']}"
        assert report["loss"] == pytest.approx(reference["loss"], rel=RTOL), f"rank {rank}"
        assert all(g > 0 for g in report["router_grad"])
    model = _model()
    _perturb_routers(model)
    back = _replay_on_one_process(model, _packed_batch() if packed else _batch(SAMPLES), reports[0]["recorded"])
    assert torch.equal(back["experts"], reference["experts"]) and torch.equal(back["counts"], reference["counts"])
    assert back["loss"] == pytest.approx(reference["loss"], rel=RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("tp,cp,ep", [(1, 1, 2), (2, 1, 2), (1, 2, 2)], ids=["ep2", "tp2-ep2-sp", "cp2-ep2"])
def test_trace_recorded_on_one_process_replays_on_other_layouts(one_process_replay, tp, cp, ep):
    from tests.dist_pool import get_pool

    reference = one_process_replay
    assert reference["samples"].tolist() == list(SAMPLES)
    reports = get_pool(WORLD).run(replay_layout_case, tp=tp, cp=cp, ep=ep, trace_path=reference["path"])
    _check_layout_replay(reports, reference, packed=False)
    print(f"{tp=} {cp=} {ep=}: loss rel diff {abs(reports[0]['loss'] - reference['loss']) / reference['loss']:.2e}")


@pytest.mark.slow
@pytest.mark.parametrize(
    "tp,cp,ep,cp_comm",
    [(1, 2, 2, "ring"), (1, 2, 2, "a2a"), (2, 2, 1, "ring")],
    ids=["cp2-ep2-ring", "cp2-ep2-a2a", "tp2-cp2-sp"],
)
def test_packed_documents_record_and_replay_across_layouts(one_process_packed_replay, tp, cp, ep, cp_comm):
    """Packed rows (each document keyed as a sample of its own) recorded on one process replay under the
    layout, and recorded under the layout replay on one process: the same experts, counts and loss."""
    from lightning_moe.moe import document_sample_key
    from tests.dist_pool import get_pool

    reference = one_process_packed_replay
    keys = [
        int(key)
        for sample, lengths in zip(SAMPLES, PACKED)
        for key in document_sample_key(torch.tensor(sample), torch.arange(len(lengths)))
    ]
    assert reference["samples"].tolist() == keys and reference["trace"].seq_len == max(max(row) for row in PACKED)
    reports = get_pool(WORLD).run(
        replay_layout_case, tp=tp, cp=cp, ep=ep, trace_path=reference["path"], packed=True, cp_comm=cp_comm
    )
    _check_layout_replay(reports, reference, packed=True)
    print(
        f"{tp=} {cp=} {ep=} {cp_comm}: loss rel diff {abs(reports[0]['loss'] - reference['loss']) / reference['loss']:.2e}"
    )


# ------------------------------------------------------------------------------------------- CLI
@pytest.mark.slow
def test_cli_records_in_validation_and_replays_in_training(tmp_path):
    from tests.cli import run_cli_error, train_in_pool

    recorded = tmp_path / "val_routing.safetensors"
    steps = ["~link", "trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=2"]
    train_in_pool(tmp_path / "record", *steps, f"+routing.record={recorded}")
    trace = RoutingTrace.load(recorded)
    # Validation windows are the corpus tail; 2 validation batches of 2 samples.
    assert (
        trace.num_samples == 4
        and trace.seq_len == 32
        and trace.layer_names == ["layers.0.feed_forward", "layers.1.feed_forward"]
    )
    assert int(trace.experts.min()) >= 0
    # Training samples are other windows: replaying the validation trace in training is refused by name.
    error = run_cli_error(tmp_path / "wrong", "~link", "trainer.max_steps=1", f"+routing.replay={recorded}")
    assert "are not in the trace" in error
    # A trace covering every training window (its experts made up) replays.
    num_train = int(trace.sample_index.min())
    gen = torch.Generator().manual_seed(0)
    experts = torch.rand(num_train, 32, 2, E, generator=gen).argsort(-1)[..., :K]
    made_up = tmp_path / "train_routing.safetensors"
    RoutingTrace(torch.arange(num_train), experts, trace.layer_names, trace.num_experts).save(made_up)
    summary = train_in_pool(tmp_path / "replay", "~link", "trainer.max_steps=2", f"+routing.replay={made_up}")
    assert len(summary["losses"]) == 2 and all(math.isfinite(x) for x in summary["losses"])


def replay_pipeline_case(trace_path: str) -> dict:
    """pp2 x dp2: this data rank's half of the batch replayed through a 1F1B schedule (2 micro-batches)."""
    import torch.distributed as dist

    from lightning_moe import parallelize
    from lightning_moe.parallel.engines.pipeline_runner import PipelineRunner
    from lightning_moe.parallel.plans.pipeline import pipeline_batch, pipeline_stage_modules
    from tests.dist_pool import layout

    dims = layout(pp=2)
    model = _model()
    _perturb_routers(model)
    parallelize(model, dims, data_parallel="none")
    runner = PipelineRunner(
        pipeline_stage_modules(model),
        2,
        dims.pp_group,
        torch.device("cpu"),
        "1F1B",
        2,
        lambda output, labels: model.loss_from_logits(output, labels),
    )
    share = len(SAMPLES) // dims.dp_ep_mesh.size()
    rank = dims.dp_ep_mesh.get_local_rank()
    batch = {k: v[rank * share : (rank + 1) * share] for k, v in _batch(SAMPLES).items()}
    inputs, kwargs, target = pipeline_batch(batch, 2, with_sample_index="sample_index" in runner.forward_kwargs)
    with replay_routing(model, trace_path), record_routing(model) as seen:
        loss = runner.broadcast_mean(runner.step(inputs, kwargs, target, train=False))
    total = loss.clone()
    dist.all_reduce(total, group=dims.dp_ep_mesh.get_group())
    mine = seen.trace()
    return {
        "loss": total.item() / dims.dp_ep_mesh.size(),
        "experts": mine.experts,
        "samples": mine.sample_index,
        "layers": list(mine.layer_names),
    }


@pytest.mark.slow
def test_trace_recorded_on_one_process_replays_through_the_pipeline(one_process_replay):
    """pp2: each stage replays its own layers' recorded choices for the samples of its data rank."""
    from tests.dist_pool import get_pool

    reference = one_process_replay
    reports = get_pool(WORLD).run(replay_pipeline_case, trace_path=reference["path"])
    for rank, report in enumerate(reports):
        assert report["loss"] == pytest.approx(reference["loss"], rel=RTOL), f"rank {rank}"
        rows = [SAMPLES.index(s) for s in report["samples"].tolist()]
        layers = [int(name.split(".")[1]) for name in report["layers"]]  # layers.<i>.feed_forward
        assert torch.equal(report["experts"], reference["experts"][rows][:, :, layers]), f"rank {rank}: other experts"

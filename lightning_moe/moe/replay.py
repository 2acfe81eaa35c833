"""Routing record and replay ("R3"): record each token's experts once, replay them on any layout.

RL fine-tuning of MoE models is unstable when the trainer routes a token differently from the
engine that produced the rollout. :func:`record_routing` captures, for every :class:`MoELayer` of a
module, each token's chosen experts (and optionally their gate weights) in a
:class:`RoutingTrace` indexed by *global* token keys: (sample index, position, layer).
:func:`replay_routing` makes every layer use the recorded experts; the router still computes the
gate weights of those experts from its scores (normalised as the layer normally does), so the
router gets gradients, and the aux losses and statistics follow the replayed choice.

Layout-free: a layer finds the global keys of the tokens it sees from :func:`token_keys`, which
the model's forward sets (``MoEGPT`` does, from its ``sample_index`` and ``position_ids``
arguments). ``position_ids`` already hold the global positions of a context-parallel shard; a
tensor-parallel (sequence-parallel) layer sees its tp rank's contiguous part of them. So a trace
recorded on one process replays under ep, tp, cp, dp or pp: each rank picks its own tokens.

Packed documents: inside :func:`~lightning_moe.moe.documents.routing_documents` the positions
restart at 0 in each document, so a token is keyed by (sample, document, position): the sample
key is :func:`document_sample_key` ``(sample, document) = sample * 2**24 + document``, i.e. each
document of a row is a sample of its own in the trace. Without documents the keys are unchanged.

Example::

    with record_routing(model) as recorder:
        model(input_ids, sample_index=torch.arange(len(input_ids)))
    trace = recorder.trace()
    trace.save("routing.safetensors")

    with replay_routing(model, RoutingTrace.load("routing.safetensors")):
        loss = model.loss(batch)   # the batch's sample_index and positions pick the recorded experts
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from lightning_moe.moe.documents import current_routing_documents
from lightning_moe.moe.layer import MoELayer
from lightning_moe.moe.router import RouterOutput

__all__ = [
    "DOCUMENT_KEY_BOUND",
    "SCHEMA_VERSION",
    "RoutingRecorder",
    "RoutingReplayer",
    "RoutingTrace",
    "TokenKeys",
    "current_token_keys",
    "document_sample_key",
    "record_routing",
    "replay_routing",
    "token_keys",
]

#: Version of the safetensors layout written by :meth:`RoutingTrace.save`.
SCHEMA_VERSION = 1
_FORMAT = "lightning_moe.routing_trace"
#: Packed documents (:func:`document_sample_key`): document ids per row below it, 2**24 (a row of 16 M tokens).
DOCUMENT_KEY_BOUND = 2**24
_SAMPLE_KEY_BOUND = 2**39  # so that sample * DOCUMENT_KEY_BOUND + document < 2**63


# -- token keys --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TokenKeys:
    """The global keys of the tokens a forward runs on: ``sample_index [B]`` and ``position_ids [B, S]`` or ``[S]``.

    ``sample_index`` None: the batch row is the sample index (one process, no data parallelism).
    """

    sample_index: torch.Tensor | None
    position_ids: torch.Tensor | None


_TOKEN_KEYS: ContextVar[TokenKeys | None] = ContextVar("lightning_moe_token_keys", default=None)


@contextlib.contextmanager
def token_keys(sample_index: torch.Tensor | None, position_ids: torch.Tensor | None) -> Iterator[None]:
    """Within the block, MoE layers key their tokens by these (a model's forward sets it around its layers)."""
    reset = _TOKEN_KEYS.set(TokenKeys(sample_index, position_ids))
    try:
        yield
    finally:
        _TOKEN_KEYS.reset(reset)


def current_token_keys() -> TokenKeys | None:
    """The keys set by the innermost :func:`token_keys` (None outside)."""
    return _TOKEN_KEYS.get()


def _token_keys_of(layer: MoELayer, x: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sample [T], position [T])`` (int64, on ``x``'s device) of the tokens of ``x [B, S_local, H]``.

    Inside :func:`~lightning_moe.moe.documents.routing_documents` the sample is the
    :func:`document_sample_key` of (sample, document).
    """
    if x.dim() != 3:
        raise ValueError(f"{name}: routing record/replay needs MoE inputs [batch, seq, hidden], got {tuple(x.shape)}")
    batch, seq = x.shape[0], x.shape[1]
    keys = current_token_keys()
    samples = keys.sample_index if keys is not None else None
    positions = keys.position_ids if keys is not None else None
    if samples is None:
        if layer.data_group is not None:
            raise ValueError(
                f"{name}: under data/expert parallelism each rank holds other samples, so routing record/replay needs"
                " their global sample indices: pass sample_index to the model (batches of ByteTextDataModule carry it)"
            )
        samples = torch.arange(batch, device=x.device)
    samples = samples.to(device=x.device, dtype=torch.int64).reshape(-1)
    if samples.numel() != batch:
        raise ValueError(f"{name}: sample_index holds {samples.numel()} entries for a batch of {batch} samples")
    if positions is None:
        if layer.sequence_group is not None:
            raise ValueError(
                f"{name}: under tp/cp sharding routing record/replay needs position_ids (the global positions)"
            )
        positions = torch.arange(seq, device=x.device)
    positions = positions.to(device=x.device, dtype=torch.int64)
    if positions.dim() == 1:
        positions = positions.unsqueeze(0)
    positions = positions.expand(batch, positions.shape[-1])
    full = positions.shape[1]
    if full != seq:
        # Tensor (sequence) parallelism: this rank holds the tp-th contiguous part of the sequence it
        # was given; its rank in the cp x tp sequence group is cp_rank * tp + tp_rank.
        if layer.sequence_group is None or full % seq:
            raise ValueError(f"{name}: MoE input of {seq} positions does not fit position_ids of {full} positions")
        shards = full // seq
        part = dist.get_rank(layer.sequence_group) % shards
        positions = positions[:, part * seq : (part + 1) * seq]
    samples = samples.repeat_interleave(seq)
    documents = current_routing_documents()
    if documents is not None:
        if tuple(documents.shape) != (batch, seq):
            raise ValueError(
                f"{name}: routing documents of shape {tuple(documents.shape)} do not match the MoE input's [batch, seq]"
                f" = {(batch, seq)}: give the document ids of the tokens this layer sees"
            )
        samples = document_sample_key(samples, documents.to(device=x.device).reshape(-1))
    return samples, positions.reshape(-1)


def document_sample_key(sample_index: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
    """The trace's sample key of a packed document: ``sample_index * DOCUMENT_KEY_BOUND + document_id`` (int64).

    Inside :func:`~lightning_moe.moe.documents.routing_documents` a token is keyed by (sample,
    document, position): its position restarts at 0 in each document, so each document of a packed
    row is a sample of its own in the trace (``RoutingTrace.sample_index`` holds these keys, and its
    position axis stays as long as the longest document). ``sample_index`` and ``document_ids``
    broadcast; ``ValueError`` unless ``0 <= document_id < DOCUMENT_KEY_BOUND`` (2**24) and ``0 <=
    sample_index < 2**39`` (the key stays below 2**63). None of it depends on the layout, so a trace
    recorded on one process replays on any.
    """
    sample_index = torch.as_tensor(sample_index, dtype=torch.int64)
    document_ids = torch.as_tensor(document_ids, device=sample_index.device).to(torch.int64)
    for what, values, bound in (
        ("document ids", document_ids, DOCUMENT_KEY_BOUND),
        ("sample indices", sample_index, _SAMPLE_KEY_BOUND),
    ):
        outside = (values < 0) | (values >= bound)
        if values.numel() and bool(outside.any()):
            raise ValueError(
                f"routing replay keys packed documents by (sample, document): {what} must lie in [0, {bound}),"
                f" got {values[outside][:4].tolist()}"
            )
    return sample_index * DOCUMENT_KEY_BOUND + document_ids


def _moe_layers(module: nn.Module) -> list[tuple[str, MoELayer]]:
    layers = [(name, m) for name, m in module.named_modules() if isinstance(m, MoELayer)]
    if not layers:
        raise ValueError(f"{type(module).__name__} has no MoELayer: nothing to record or replay")
    return layers


def _check_replayable(name: str, layer: MoELayer) -> None:
    """Refuse what record/replay cannot define (see docs/routing-replay.md)."""
    if layer.routing != "topk":
        raise ValueError(
            f"{name}: routing={layer.routing!r} cannot be recorded or replayed: experts pick tokens there, so a token's"
            " experts depend on every other token of the ep group; use routing='topk'"
        )
    if layer.capacity_factor is not None:
        raise ValueError(
            f"{name}: capacity_factor={layer.capacity_factor} cannot be recorded or replayed: which slots an expert drops"
            " depends on the other tokens of the micro-batch (its size and order differ between the engine and each"
            " trainer layout), so the replayed computation would not be the recorded one; use capacity_factor=None"
        )


# -- the trace ---------------------------------------------------------------------------------------
@dataclass
class RoutingTrace:
    """Recorded routing in global token order.

    - ``sample_index [N]`` int64, increasing: the samples recorded (packed documents recorded inside
      ``routing_documents``: their :func:`document_sample_key`, one per document);
    - ``experts [N, S, L, k]`` int64: the experts of sample ``n``, position ``s``, layer ``l``; ``-1``
      where a token was not recorded;
    - ``layer_names [L]``: the MoE layers' names in the module (``layers.1.feed_forward``);
    - ``num_experts [L]``: each layer's expert count;
    - ``weights [N, S, L, k]`` float32 or None: the recorded gate weights (for inspection: replay
      recomputes them).
    """

    sample_index: torch.Tensor
    experts: torch.Tensor
    layer_names: list[str]
    num_experts: list[int]
    weights: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.experts.dim() != 4:
            raise ValueError(f"experts must be [samples, positions, layers, top_k], got {tuple(self.experts.shape)}")
        n, _, num_layers, _ = self.experts.shape
        if tuple(self.sample_index.shape) != (n,):
            raise ValueError(f"sample_index of shape {tuple(self.sample_index.shape)} does not fit {n} samples")
        if len(self.layer_names) != num_layers or len(self.num_experts) != num_layers:
            raise ValueError(
                f"{len(self.layer_names)} layer names / {len(self.num_experts)} expert counts for {num_layers} layers"
            )
        if n > 1 and not bool((self.sample_index[1:] > self.sample_index[:-1]).all()):
            raise ValueError("sample_index must be strictly increasing")
        if self.weights is not None and self.weights.shape != self.experts.shape:
            raise ValueError(
                f"weights of shape {tuple(self.weights.shape)} differ from experts {tuple(self.experts.shape)}"
            )

    @property
    def num_samples(self) -> int:
        return self.experts.shape[0]

    @property
    def seq_len(self) -> int:
        return self.experts.shape[1]

    @property
    def top_k(self) -> int:
        return self.experts.shape[3]

    def layer(self, name: str) -> int:
        """The trace index of layer ``name``."""
        try:
            return self.layer_names.index(name)
        except ValueError:
            raise ValueError(f"the trace has no layer {name!r}: it recorded {self.layer_names}") from None

    def check_module(self, module: nn.Module) -> None:
        """``ValueError`` naming the first mismatch between this trace and ``module``'s MoE layers.

        Every layer of ``module`` must be in the trace (a pipeline stage holds only some of them)
        with the same expert count and ``top_k``.
        """
        for name, layer in _moe_layers(module):
            _check_replayable(name, layer)
            index = self.layer(name)
            if self.num_experts[index] != layer.num_experts:
                raise ValueError(
                    f"{name}: the trace recorded {self.num_experts[index]} experts, the layer has {layer.num_experts}"
                )
            if self.top_k != layer.top_k:
                raise ValueError(f"{name}: the trace recorded top_k={self.top_k}, the layer has top_k={layer.top_k}")

    def lookup(self, layer: str | int, samples: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The recorded experts ``[T, k]`` of the tokens ``(samples [T], positions [T])`` at ``layer``.

        ``ValueError`` naming the first token the trace does not hold.
        """
        index = self.layer(layer) if isinstance(layer, str) else layer
        name = self.layer_names[index]
        samples, positions = samples.cpu(), positions.cpu()
        rows = torch.searchsorted(self.sample_index, samples).clamp_max(max(self.num_samples - 1, 0))
        known = self.sample_index[rows] == samples if self.num_samples else torch.zeros_like(samples, dtype=torch.bool)
        if not bool(known.all()):
            missing = samples[~known].unique()[:8].tolist()
            raise ValueError(
                f"{name}: samples {missing} are not in the trace (it holds {self.num_samples} samples,"
                f" {self.sample_index[:8].tolist()}{'...' if self.num_samples > 8 else ''})"
            )
        inside = (positions >= 0) & (positions < self.seq_len)
        if not bool(inside.all()):
            bad = positions[~inside].unique()[:8].tolist()
            raise ValueError(f"{name}: positions {bad} are outside the trace's sequence of {self.seq_len} positions")
        experts = self.experts[rows, positions, index]
        absent = (experts < 0).any(-1)
        if bool(absent.any()):
            first = int(absent.nonzero()[0, 0])
            raise ValueError(
                f"{name}: the trace holds no experts for {int(absent.sum())} tokens, e.g. sample {int(samples[first])}"
                f" position {int(positions[first])} (not recorded)"
            )
        return experts

    # -- files -----------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Write a safetensors file: tensors ``sample_index``, ``experts`` (int32) and optional ``weights``;
        metadata ``format``, ``schema_version``, ``layer_names`` and ``num_experts`` (JSON)."""
        from safetensors.torch import save_file

        tensors = {
            "sample_index": self.sample_index.to(torch.int64).contiguous(),
            "experts": self.experts.to(torch.int32).contiguous(),
        }
        if self.weights is not None:
            tensors["weights"] = self.weights.to(torch.float32).contiguous()
        metadata = {
            "format": _FORMAT,
            "schema_version": str(SCHEMA_VERSION),
            "layer_names": json.dumps(self.layer_names),
            "num_experts": json.dumps(self.num_experts),
        }
        save_file(tensors, os.fspath(path), metadata=metadata)

    @classmethod
    def load(cls, path: str | os.PathLike) -> RoutingTrace:
        """Read a file written by :meth:`save`; ``ValueError`` for another format or schema version."""
        from safetensors import safe_open

        with safe_open(os.fspath(path), framework="pt") as f:
            metadata = f.metadata() or {}
            if metadata.get("format") != _FORMAT:
                raise ValueError(f"{path} is not a routing trace (metadata format={metadata.get('format')!r})")
            version = metadata.get("schema_version")
            if version != str(SCHEMA_VERSION):
                raise ValueError(
                    f"{path} has routing-trace schema version {version}; this version reads {SCHEMA_VERSION}"
                )
            tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
        return cls(
            sample_index=tensors["sample_index"].to(torch.int64),
            experts=tensors["experts"].to(torch.int64),
            layer_names=list(json.loads(metadata["layer_names"])),
            num_experts=[int(e) for e in json.loads(metadata["num_experts"])],
            weights=tensors.get("weights"),
        )


# -- recording ---------------------------------------------------------------------------------------
class _ChainedHook:
    """A hook that defers to the hook it replaced (recording inside a replay, or a replay inside a recording)."""

    def __init__(self) -> None:
        self.inner: dict[int, object] = {}

    def _inner_choice(self, layer: MoELayer, x: torch.Tensor) -> torch.Tensor | None:
        inner = self.inner.get(id(layer))
        return inner.replayed_choice(layer, x) if inner is not None else None  # type: ignore[attr-defined]

    def _inner_observe(self, layer: MoELayer, x: torch.Tensor, routing: RouterOutput) -> None:
        inner = self.inner.get(id(layer))
        if inner is not None:
            inner.observe(layer, x, routing)  # type: ignore[attr-defined]


class RoutingRecorder(_ChainedHook):
    """The routing hook of :func:`record_routing`: collects every routed token's keys and experts."""

    def __init__(self, layers: list[tuple[str, MoELayer]], weights: bool) -> None:
        super().__init__()
        self.layer_names = [name for name, _ in layers]
        self.num_experts = [layer.num_experts for _, layer in layers]
        self._index = {id(layer): i for i, (_, layer) in enumerate(layers)}
        self._names = {id(layer): name for name, layer in layers}
        top_ks = {layer.top_k for _, layer in layers}
        if len(top_ks) > 1:
            raise ValueError(f"routing traces need one top_k for all MoE layers, got {sorted(top_ks)}")
        self.top_k = top_ks.pop()
        self.with_weights = weights
        # One entry per layer call: (layer index, samples [T], positions [T], experts [T, k], weights [T, k] | None)
        self.records: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]] = []

    def replayed_choice(self, layer: MoELayer, x: torch.Tensor) -> torch.Tensor | None:
        return self._inner_choice(layer, x)

    def observe(self, layer: MoELayer, x: torch.Tensor, routing: RouterOutput) -> None:
        self._inner_observe(layer, x, routing)
        samples, positions = _token_keys_of(layer, x, self._names[id(layer)])
        weights = routing.topk_weights.detach().float().cpu() if self.with_weights else None
        self.records.append(
            (self._index[id(layer)], samples.cpu(), positions.cpu(), routing.topk_idx.detach().cpu(), weights)
        )

    def trace(self, group: dist.ProcessGroup | None = None) -> RoutingTrace:
        """The :class:`RoutingTrace` of everything recorded; with ``group`` (a collective), of every rank's records.

        A token recorded twice keeps its last record (ranks in rank order).
        """
        records = self.records
        if group is not None and dist.get_world_size(group) > 1:
            gathered: list = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, records, group=group)
            records = [r for rank_records in gathered for r in rank_records]
        if not records:
            raise ValueError("no routing was recorded: run forwards of the module inside record_routing()")
        samples = torch.cat([r[1] for r in records])
        sample_index = samples.unique()  # sorted
        seq_len = int(torch.cat([r[2] for r in records]).max()) + 1
        shape = (sample_index.numel(), seq_len, len(self.layer_names), self.top_k)
        experts = torch.full(shape, -1, dtype=torch.int64)
        weights = torch.zeros(shape, dtype=torch.float32) if self.with_weights else None
        for layer, s, p, e, w in records:
            rows = torch.searchsorted(sample_index, s)
            experts[rows, p, layer] = e
            if weights is not None and w is not None:
                weights[rows, p, layer] = w
        return RoutingTrace(sample_index, experts, list(self.layer_names), list(self.num_experts), weights)


class RoutingReplayer(_ChainedHook):
    """The routing hook of :func:`replay_routing`: hands each layer the trace's experts of its tokens."""

    def __init__(self, layers: list[tuple[str, MoELayer]], trace: RoutingTrace) -> None:
        super().__init__()
        self.trace = trace
        self._names = {id(layer): name for name, layer in layers}
        self._index = {id(layer): trace.layer(name) for name, layer in layers}

    def replayed_choice(self, layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
        samples, positions = _token_keys_of(layer, x, self._names[id(layer)])
        return self.trace.lookup(self._index[id(layer)], samples, positions).to(x.device)

    def observe(self, layer: MoELayer, x: torch.Tensor, routing: RouterOutput) -> None:
        self._inner_observe(layer, x, routing)


@contextlib.contextmanager
def _hooked(layers: list[tuple[str, MoELayer]], hook: _ChainedHook) -> Iterator[None]:
    previous = [layer.routing_hook for _, layer in layers]
    hook.inner = {id(layer): old for (_, layer), old in zip(layers, previous) if old is not None}
    for _, layer in layers:
        layer.routing_hook = hook  # type: ignore[assignment]
    try:
        yield
    finally:
        for (_, layer), old in zip(layers, previous):
            layer.routing_hook = old


@contextlib.contextmanager
def record_routing(module: nn.Module, *, weights: bool = False) -> Iterator[RoutingRecorder]:
    """Record the routing of every ``MoELayer`` of ``module`` within the block; yields the recorder.

    ``recorder.trace()`` (after or inside the block) is the :class:`RoutingTrace`; ``weights=True``
    keeps the gate weights too. Refuses ``capacity_factor`` and ``routing='expert_choice'`` layers.
    """
    layers = _moe_layers(module)
    for name, layer in layers:
        _check_replayable(name, layer)
    recorder = RoutingRecorder(layers, weights)
    with _hooked(layers, recorder):
        yield recorder


@contextlib.contextmanager
def replay_routing(module: nn.Module, trace: RoutingTrace | str | os.PathLike) -> Iterator[RoutingReplayer]:
    """Within the block every ``MoELayer`` of ``module`` routes its tokens to the trace's experts.

    ``trace``: a :class:`RoutingTrace` or the path of a saved one. The layers must be in the trace
    with its expert count and ``top_k`` (``ValueError`` naming the mismatch, before any forward);
    a token the trace does not hold is a ``ValueError`` at the forward that meets it.
    """
    if not isinstance(trace, RoutingTrace):
        trace = RoutingTrace.load(trace)
    layers = _moe_layers(module)
    trace.check_module(module)
    replayer = RoutingReplayer(layers, trace)
    with _hooked(layers, replayer):
        yield replayer

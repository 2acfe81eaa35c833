"""No host syncs in the MoE hot path, counted on CPU.

On CUDA every host read of a device tensor (``.item()``, ``.tolist()``, ``int(t)``, a boolean
mask index, ``nonzero``, ``repeat_interleave`` without ``output_size``, ...) stalls the CPU until
the GPU drains. On CPU nothing stalls, but the same calls happen, so they can be counted here:

- at the Python level, by wrapping ``Tensor.item/tolist/__int__/__float__/__bool__/__index__``;
- at the aten level, with a ``TorchDispatchMode`` that counts ``_local_scalar_dense`` (what every
  scalar read becomes) and the ops whose output size depends on tensor values.

The allowed budget: one read of the all-to-all split sizes per layer (expert parallelism only;
the single-device layer has none). The padded ``bmm`` fallback (fp32 on CUDA) reads the largest
group once, which :class:`GroupedExperts` documents; the bf16 grouped-GEMM path reads nothing.

Known remaining CUDA syncs that only show at the aten level (an xfail below lists them, strict, so
that fixing them flips it): ``torch.bincount`` (CUDA reads the input's min and max on the host) in
``router.py`` (``tokens_per_expert``) and ``dispatcher.sort_slots_by_expert``; scalar tensors built
from Python numbers in ``layer.py``'s statistics (``new_tensor``/``as_tensor``: an H2D copy that
waits for the stream). Sync-free equivalents: ``zeros(n).scatter_add_(0, ids, ones_like(ids))``
and ``new_full((), value)``. Token dropping (``capacity_factor``) reads the kept count once.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Iterator

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_moe.moe import MoELayer
from lightning_moe.moe.dispatcher import CUDA_GROUP_ALIGN

aten = torch.ops.aten
# Ops whose output shape depends on values: they sync on CUDA.
_DATA_DEPENDENT = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten.unique_consecutive.default,
    aten._unique2.default,
    aten.unique_dim.default,
}


class _SyncCounter(TorchDispatchMode):
    def __init__(self, counts: Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func in _DATA_DEPENDENT:
            self.counts[str(func)] += 1
        elif func is aten.bincount.default:
            # CUDA's bincount reads min and max on the host to size its output: two syncs.
            self.counts["bincount"] += 1
        elif func is aten.lift_fresh.default:
            # A tensor from Python data (new_tensor, torch.tensor): an H2D copy that waits for the
            # stream when the tensor is placed on the GPU.
            self.counts["tensor from Python data"] += 1
        elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            self.counts["repeat_interleave without output_size"] += 1
        elif func is aten.index.Tensor and any(
            i is not None and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else [])
        ):
            self.counts["boolean mask index"] += 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_host_syncs() -> Iterator[Counter]:
    """Count host reads of tensor values (Python and aten level) inside the context."""
    counts: Counter = Counter()
    names = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")
    originals = {name: getattr(torch.Tensor, name) for name in names}

    def wrap(name: str):  # noqa: ANN202
        original = originals[name]

        def wrapped(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            counts[f"Tensor.{name}"] += 1
            return original(self, *args, **kwargs)

        return wrapped

    try:
        for name in names:
            setattr(torch.Tensor, name, wrap(name))
        with _SyncCounter(counts):
            yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def _forward_backward(layer: MoELayer, x: torch.Tensor) -> None:
    y = layer(x)
    y.backward(torch.ones_like(y))


def test_counter_sees_host_reads():
    t = torch.tensor([1, 2, 3])
    with count_host_syncs() as counts:
        t.sum().item()
        int(t.max())
        t.tolist()
        t[t > 1]
        torch.repeat_interleave(t)
    assert counts["Tensor.item"] == 1 and counts["Tensor.tolist"] == 1 and counts["Tensor.__int__"] == 1
    assert counts["boolean mask index"] == 1 and counts["repeat_interleave without output_size"] == 1
    assert counts["aten._local_scalar_dense.default"] >= 2


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({}, id="softmax_aux_loss"),
        pytest.param({"score_func": "sigmoid", "expert_bias": True, "load_balancing": "seq_aux_loss"}, id="deepseek"),
        pytest.param({"shared_expert_hidden_size": 32, "z_loss_coeff": 1e-3}, id="shared_zloss"),
    ],
)
def test_dropless_layer_with_cuda_alignment_reads_no_value_on_the_host(kwargs):
    """The CUDA configuration (bf16 grouped GEMM, aligned groups), forced on CPU: no Python-level
    read and no data-dependent op; only the known aten-level sites (see the module docstring)."""
    counts = _hot_path_counts(kwargs)
    unexpected = {k: v for k, v in counts.items() if k not in _KNOWN_ATEN_SITES}
    assert not unexpected, f"host syncs in the MoE hot path: {dict(counts)}"
    assert counts["bincount"] <= 3 and counts["tensor from Python data"] <= 2, dict(counts)


_KNOWN_ATEN_SITES = ("bincount", "tensor from Python data")


def _hot_path_counts(kwargs: dict) -> Counter:
    torch.manual_seed(0)
    layer = MoELayer(32, 48, 8, top_k=2, **kwargs)
    layer.dispatcher.pad_rows = CUDA_GROUP_ALIGN
    layer.experts.use_grouped_mm = True
    x = torch.randn(2, 24, 32, requires_grad=True)
    _forward_backward(layer, x)  # warm-up: lazy one-time work is not the hot path
    with count_host_syncs() as counts:
        _forward_backward(layer, x)
    return counts


@pytest.mark.xfail(
    strict=True,
    reason="known CUDA syncs outside the padding code: bincount in router.py and dispatcher.sort_slots_by_expert,"
    " new_tensor/as_tensor in layer.py's statistics (fixes in the module docstring)",
)
def test_dropless_layer_has_no_host_sync_at_all():
    counts = _hot_path_counts({})
    assert not counts, dict(counts)


def test_token_dropping_reads_the_kept_count_once():
    counts = _hot_path_counts({"capacity_factor": 1.0})
    reads = {k: v for k, v in counts.items() if k not in _KNOWN_ATEN_SITES}
    assert reads == {"Tensor.__int__": 1, "aten._local_scalar_dense.default": 1}, dict(counts)


def test_bmm_fallback_reads_one_size_per_layer():
    """fp32 on CUDA takes the padded bmm: exactly one host read (the largest group), documented."""
    torch.manual_seed(0)
    layer = MoELayer(32, 48, 8, top_k=2)
    layer.dispatcher.pad_rows = False
    layer.experts.use_grouped_mm = False
    x = torch.randn(48, 32, requires_grad=True)
    with count_host_syncs() as counts:
        _forward_backward(layer, x)
    assert counts["Tensor.__int__"] == 1, dict(counts)
    assert sum(v for k, v in counts.items() if k.startswith("Tensor.")) == 1, dict(counts)

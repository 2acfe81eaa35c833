"""SwiGLU experts computed as grouped GEMMs, and the dense shared expert."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_moe._compat import grouped_mm, torch_has_grouped_mm

__all__ = [
    "ACTIVATIONS",
    "GroupedExperts",
    "SharedExpert",
    "compute_dtype",
    "expert_activation",
    "grouped_mm_available",
]

ACTIVATIONS: tuple[str, ...] = ("swiglu", "gpt_oss")


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype matmuls on ``x`` run in: the autocast dtype when autocast is on, else ``x.dtype``."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


# The dtypes ``torch._grouped_mm`` has kernels for (torch 2.13); float64 (gradcheck) takes the bmm path.
_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_mm_available(device: torch.device, dtype: torch.dtype, *row_sizes: int) -> bool:
    """Whether ``torch._grouped_mm`` can run this case (CPU: fp32/bf16/fp16; CUDA: bf16 on sm90+).

    ``row_sizes``: the inner sizes of the operands (hidden, FFN); ``_grouped_mm`` needs their rows
    to be multiples of 16 bytes, which an FFN dim sharded over etp may not be.

    On CUDA the kernels (CUTLASS, Hopper and later) take bf16 only, and the dispatchers align each
    expert's rows to :data:`~lightning_moe.moe.dispatcher.CUDA_GROUP_ALIGN` for them. fp32 (and
    fp16, and older GPUs) take the padded ``bmm`` fallback instead, which is exact but reads the
    largest group size on the host once per layer (one sync) and computes ``E x max`` rows: train
    under bf16 autocast (``precision="bf16-mixed"``) on GPUs.
    """
    if not torch_has_grouped_mm() or dtype not in _GROUPED_MM_DTYPES:
        return False
    itemsize = torch.empty((), dtype=dtype).element_size()
    if any(size * itemsize % 16 for size in row_sizes):
        return False
    if device.type == "cpu":
        return True
    if device.type != "cuda" or dtype != torch.bfloat16:
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def _local(weight: torch.Tensor) -> torch.Tensor:
    # Expert parallelism makes the weights DTensors Shard(0) over ep; the math is per rank.
    return weight.to_local() if isinstance(weight, DTensor) else weight


def _contiguous_grad(grad: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm``'s backward rejects a stride-0 gradient such as the one ``y.sum()``
    sends, also when it has no rows (``contiguous()`` keeps the strides of an empty tensor)."""
    return grad.contiguous() if grad.numel() else grad.new_zeros(grad.shape)


def expert_activation(
    gate: torch.Tensor, up: torch.Tensor, activation: str = "swiglu", alpha: float = 1.702, limit: float = 7.0
) -> torch.Tensor:
    """The gated activation of the expert FFN, elementwise over the FFN dim.

    - ``"swiglu"``: ``silu(gate) * up``;
    - ``"gpt_oss"``: ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with
      ``g = clamp(gate, max=limit)`` (GPT-OSS; transformers' ``GptOssExperts._apply_gate``).
    """
    if activation == "swiglu":
        return F.silu(gate) * up
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _row_bias(bias: torch.Tensor | None, tokens_per_expert: torch.Tensor, num_rows: int) -> torch.Tensor | None:
    """``bias[expert of row]`` for rows grouped by expert: ``[N, F]`` (None without bias)."""
    if bias is None:
        return None
    return bias.repeat_interleave(tokens_per_expert.to(bias.device), dim=0, output_size=num_rows)


def _grouped_ffn(
    x: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    b1: torch.Tensor | None = None,
    b3: torch.Tensor | None = None,
    activation: str = "swiglu",
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    # Separate gate and up GEMMs: a fused [w1 | w3] GEMM is no faster on CPU once its halves feed
    # the elementwise SwiGLU as strided views, which are much slower than contiguous ones in bf16.
    offsets = torch.cumsum(tokens_per_expert.to(x.device), 0, dtype=torch.int32)  # _grouped_mm wants int32
    gate, up = grouped_mm(x, w1, offsets), grouped_mm(x, w3, offsets)
    if b1 is not None:
        gate = gate + _row_bias(b1, tokens_per_expert, x.shape[0])
    if b3 is not None:
        up = up + _row_bias(b3, tokens_per_expert, x.shape[0])
    hidden = expert_activation(gate, up, activation, alpha, limit)
    out = grouped_mm(hidden, w2, offsets)
    if out.requires_grad:
        # A gradient hook, not an identity autograd Function: that would return a view, on which
        # FSDP (which wraps the experts) cannot place its pre-backward hook.
        out.register_hook(_contiguous_grad)
    return out


def _padded_ffn(
    x: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    b1: torch.Tensor | None = None,
    b3: torch.Tensor | None = None,
    activation: str = "swiglu",
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    """Fallback without ``_grouped_mm``: scatter rows into ``[E, max_count, H]`` and use ``bmm``.

    Three batched GEMMs instead of a Python loop over experts; the padding rows are zeros and never
    gathered back, so they add nothing to any gradient (their outputs get zero gradient).
    Sizing ``[E, max_count]`` reads ``max_count`` on the host: one device sync per call on CUDA
    (the fp32 path there; bf16 takes ``_grouped_mm`` without one).
    """
    num_experts, hidden_size = w1.shape[0], x.shape[1]
    counts = tokens_per_expert.to(x.device)
    max_count = int(counts.max())
    expert_of_row = torch.repeat_interleave(torch.arange(num_experts, device=x.device), counts, output_size=x.shape[0])
    starts = torch.cumsum(counts, 0) - counts
    rows = torch.arange(x.shape[0], device=x.device)
    slot = expert_of_row * max_count + rows - starts[expert_of_row]
    padded = x.new_zeros(num_experts * max_count, hidden_size).index_copy(0, slot, x)
    padded = padded.view(num_experts, max_count, hidden_size)
    gate, up = torch.bmm(padded, w1), torch.bmm(padded, w3)
    if b1 is not None:
        gate = gate + b1.unsqueeze(1)
    if b3 is not None:
        up = up + b3.unsqueeze(1)
    hidden = expert_activation(gate, up, activation, alpha, limit)
    out = torch.bmm(hidden, w2).view(num_experts * max_count, w2.shape[-1])
    return out.index_select(0, slot)


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts ``(silu(x @ w1[e]) * (x @ w3[e])) @ w2[e]`` as grouped GEMMs.

    Parameters ``w1 [E, H, F]`` (gate), ``w3 [E, H, F]`` (up), ``w2 [E, F, H]`` (down); with
    ``bias=True`` also ``b1 [E, F]`` and ``b3 [E, F]``, added to the gate and up projections (the
    down projection's bias lives in :class:`~lightning_moe.moe.MoELayer`, which adds it per token).
    ``activation``: ``"swiglu"`` or ``"gpt_oss"`` (:func:`expert_activation`, with ``alpha`` and
    ``limit``).
    ``forward(x [N, H], tokens_per_expert [E])`` takes rows already grouped by expert (expert 0
    first) and returns ``[N, H]`` in the compute dtype (the autocast dtype under autocast, else
    ``x.dtype``). It uses ``torch._grouped_mm`` where available and a padded ``bmm`` otherwise
    (``use_grouped_mm=False`` forces the fallback). Under expert parallelism the weights are
    DTensors and their local shards (the local experts) are used.

    Example::

        experts = GroupedExperts(num_experts=4, hidden_size=16, ffn_hidden_size=32)
        y = experts(torch.randn(10, 16), torch.tensor([3, 0, 5, 2]))   # expert 1 gets no rows
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        *,
        use_grouped_mm: bool | None = None,
        activation: str = "swiglu",
        bias: bool = False,
        alpha: float = 1.702,
        limit: float = 7.0,
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is unknown: choose one of {ACTIVATIONS}")
        self.num_experts = num_experts
        self.use_grouped_mm = use_grouped_mm
        self.activation = activation
        self.alpha = alpha
        self.limit = limit
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, hidden_size))
        if bias:
            self.b1 = nn.Parameter(torch.zeros(num_experts, ffn_hidden_size))
            self.b3 = nn.Parameter(torch.zeros(num_experts, ffn_hidden_size))
        else:
            self.register_parameter("b1", None)
            self.register_parameter("b3", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's default bound per expert: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
        for weight in (self.w1, self.w3, self.w2):
            bound = 1.0 / math.sqrt(weight.shape[1])
            nn.init.uniform_(weight, -bound, bound)
        for bias in (self.b1, self.b3):
            if bias is not None:
                nn.init.zeros_(bias)

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype(x)
        x = x.to(dtype)
        w1, w3, w2 = (_local(w).to(dtype) for w in (self.w1, self.w3, self.w2))
        b1, b3 = (_local(b).to(dtype) if b is not None else None for b in (self.b1, self.b3))
        use_grouped = self.use_grouped_mm
        if use_grouped is None:
            use_grouped = grouped_mm_available(x.device, dtype, w1.shape[1], w1.shape[2])
        ffn = _grouped_ffn if use_grouped else _padded_ffn
        return ffn(x, w1, w3, w2, tokens_per_expert, b1, b3, self.activation, self.alpha, self.limit)


class SharedExpert(nn.Module):
    """A dense SwiGLU MLP every token goes through: ``w2(silu(w1(x)) * w3(x))``, no biases.

    Example::

        shared = SharedExpert(hidden_size=16, ffn_hidden_size=32)
        y = shared(torch.randn(4, 16))
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.w3 = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.w2 = nn.Linear(ffn_hidden_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

"""`Muon`: Muon on a model's matrices and each expert's, AdamW on the rest, on any layout."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw

from lightning_moe.optim.newton_schulz import NS_COEFFICIENTS, NS_EPS, NS_STEPS, newton_schulz
from lightning_moe.optim.owner_gather import MatrixShards, OwnerAssignment
from lightning_moe.optim.param_split import expert_stacks, muon_parameter_groups

__all__ = ["Muon"]

ADJUST_LR_FNS = ("match_rms_adamw", "original")
NS_DTYPES = ("float32", "bfloat16")


def adjusted_lr(lr: float, rows: int, cols: int, adjust_lr_fn: str) -> float:
    """The step size of a rows x cols matrix's orthogonalized update (torch.optim.Muon's rules):
    ``"match_rms_adamw"`` (Moonlight): ``0.2 * sqrt(max(rows, cols)) * lr``, which gives the update the
    RMS of a typical AdamW update, so that Muon reuses AdamW's learning rate and schedule;
    ``"original"`` (Keller Jordan): ``sqrt(max(1, rows / cols)) * lr``."""
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr * math.sqrt(max(1.0, rows / cols))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's block (in-place updates on it update the DTensor)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class Muon(torch.optim.Optimizer):
    """Muon (momentum, Nesterov, Newton-Schulz orthogonalization, decoupled weight decay) on the 2-D
    matrices of attention and dense MLPs and on each routed expert's matrices; AdamW on embeddings,
    the output head, norms, routers, biases and every vector. Works on any layout of the moe5d strategy.

    ``Muon(module)`` splits ``module``'s parameters as :func:`muon_parameter_groups` describes;
    ``param_groups`` (dicts with ``"params"`` and ``"use_muon"``, optionally ``lr``, ``weight_decay``,
    ...) replaces that split. Muon groups use ``lr`` scaled by ``adjust_lr_fn`` per matrix (default
    ``"match_rms_adamw"``: Moonlight's scaling to AdamW's update RMS, so one learning rate and schedule
    serve both kinds of groups); the math is ``torch.optim.Muon``'s, which it equals bit for bit on
    one process with ``ns_dtype="bfloat16"`` (torch's Newton-Schulz dtype). The default, fp32,
    keeps every layout on the single-process losses (bf16 rounding amplifies reduction-order bits).

    Sharded matrices (FSDP, tensor and expert parallelism) are gathered to one owner rank of their
    shard group, orthogonalized there and scattered back; owners go round-robin so every rank does its
    share (``lightning_moe.optim.owner_gather``).

    Args:
        module: the module whose parameters it trains (``self`` in ``configure_optimizers``).
        lr, weight_decay: both kinds of groups (decoupled weight decay, ``p *= 1 - lr * weight_decay``).
        momentum, nesterov, ns_steps, ns_coefficients, ns_eps, adjust_lr_fn: Muon's, as torch.optim.Muon
            takes them; ``ns_dtype``: ``"float32"`` or ``"bfloat16"``, what Newton-Schulz computes in
            (and what the gathered blocks travel as).
        betas, eps: AdamW's.
        param_groups: explicit groups, each with ``"use_muon"``; they replace the default split.

    Example::

        class MyModule(pl.LightningModule):
            def configure_optimizers(self):
                return lightning_moe.optim.Muon(self, lr=1e-3, weight_decay=0.1)
    """

    def __init__(
        self,
        module: nn.Module,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = NS_STEPS,
        ns_coefficients: Sequence[float] = NS_COEFFICIENTS,
        ns_eps: float = NS_EPS,
        ns_dtype: str = "float32",
        adjust_lr_fn: str = "match_rms_adamw",
        betas: Sequence[float] = (0.9, 0.95),
        eps: float = 1e-8,
        param_groups: Iterable[dict[str, Any]] | None = None,
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"Muon takes the module whose parameters it trains (Muon(self) in configure_optimizers), "
                f"got {type(module).__name__}; pass explicit groups as Muon(module, param_groups=[...])"
            )
        if adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"adjust_lr_fn={adjust_lr_fn!r} must be one of {ADJUST_LR_FNS}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum={momentum} must be in [0, 1)")
        if ns_dtype not in NS_DTYPES:
            # A name, not a torch.dtype: param groups go into checkpoints, which store plain values.
            raise ValueError(f"ns_dtype={ns_dtype!r} must be one of {NS_DTYPES}")
        if ns_steps < 1:
            raise ValueError(f"ns_steps={ns_steps} must be a positive integer")
        groups = (
            [dict(g) for g in param_groups] if param_groups is not None else muon_parameter_groups(module, weight_decay)
        )
        names = {id(p): name for name, p in module.named_parameters()}
        self._expert_stacks = expert_stacks(module)
        for index, group in enumerate(groups):
            self._check_group(index, group, names)
        defaults = {
            "lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov,
            "ns_steps": ns_steps, "ns_coefficients": tuple(ns_coefficients), "ns_eps": ns_eps, "ns_dtype": ns_dtype,
            "adjust_lr_fn": adjust_lr_fn, "betas": tuple(betas), "eps": eps,
        }  # fmt: skip
        super().__init__(groups, defaults)
        self._shards: dict[int, MatrixShards | None] = {}
        self._owners = OwnerAssignment()
        self._ns_work: list[tuple[int, int, int]] = []

    def _check_group(self, index: int, group: dict[str, Any], names: dict[int, str]) -> None:
        if "use_muon" not in group:
            raise ValueError(
                f"param_groups[{index}] has no 'use_muon' key: set use_muon=True (Muon) or False (AdamW) in every group"
            )
        group["params"] = list(group["params"])
        if not group["use_muon"]:
            return
        for param in group["params"]:
            if param.ndim != 2 and id(param) not in self._expert_stacks:
                name = names.get(id(param), "a parameter not in the module")
                raise ValueError(
                    f"param_groups[{index}] (use_muon=True) holds {name} of shape {tuple(param.shape)}, neither "
                    "a 2-D matrix nor a routed-expert stack [num_experts, in, out]: Muon orthogonalizes "
                    "matrices only; move it to a group with use_muon=False (AdamW)"
                )

    def newton_schulz_matrices(self) -> list[tuple[int, int, int]]:
        """``(rows, cols, count)`` of the matrices this rank orthogonalized at the last step (the shard
        groups' owners do the work)."""
        return list(self._ns_work)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._ns_work = []
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _adamw_step(self, group: dict[str, Any]) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            if not state:  # the state torch.optim.AdamW keeps, so checkpoints read the same
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            params.append(param)
            grads.append(param.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        adamw(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            foreach=False,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )

    def _muon_step(self, group: dict[str, Any]) -> None:
        momentum, lr = group["momentum"], group["lr"]
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            grad, buffer = _local(param.grad), _local(state["momentum_buffer"])
            buffer.lerp_(grad, 1 - momentum)
            update = grad.lerp(buffer, momentum) if group["nesterov"] else buffer
            update = self._orthogonalized(param, update, group)
            rows, cols = param.shape[-2:]
            local = _local(param)
            local.mul_(1 - lr * group["weight_decay"])
            local.add_(update, alpha=-adjusted_lr(lr, rows, cols, group["adjust_lr_fn"]))

    def _orthogonalized(self, param: torch.Tensor, update: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """Newton-Schulz of ``param``'s local ``update``: on this rank when it holds its matrices whole,
        else on the owner of its shard group (gathered there and scattered back)."""
        expert_stack = id(param) in self._expert_stacks

        def orthogonalize(matrices: torch.Tensor) -> torch.Tensor:
            options = (group["ns_coefficients"], group["ns_steps"], group["ns_eps"], getattr(torch, group["ns_dtype"]))
            if not expert_stack:
                self._ns_work.append((*matrices.shape, 1))
                return newton_schulz(matrices, *options)
            self._ns_work.append((*matrices.shape[1:], matrices.shape[0]))
            # Each expert is its own matrix: orthogonalizing the stack as one would mix experts.
            return torch.stack([newton_schulz(m, *options) for m in matrices])

        if id(param) not in self._shards:
            self._shards[id(param)] = (
                MatrixShards.of(param, expert_stack, self._owners) if isinstance(param, DTensor) else None
            )
        shards = self._shards[id(param)]
        return (
            orthogonalize(update)
            if shards is None
            else shards.apply(update, orthogonalize, getattr(torch, group["ns_dtype"]))
        )

"""One verification run: ``python -m lightning_moe.verify.worker <spec.pkl>`` (started by the runner).

Lightning's process launcher re-executes this command line for ranks 1..N-1, so every rank reads
the same spec. Each rank writes ``rank<r>.pt`` into the run directory at the end of training: its
mesh coordinates, its intra-op thread count, the input ids of its batches, the module order of
step 1 and, on the rank that leads its pipeline stage (coordinate 0 in dp, ep, cp and tp), the
initial parameters, the step-1 gradients and the final parameters gathered to full tensors, and the
routing settings of its MoE layers. With ``record_forward`` every rank also keeps each module's
output and first input at step 1. A rank that fails writes ``error_rank<r>.json`` with the modules
it was inside.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import runpy
import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_moe._compat import is_dropout_module, non_persistent_buffer_names
from lightning_moe.layout import MESH_DIMS

SPEC_ENV = "LIGHTNING_MOE_VERIFY_WORKER"


# -- the spec ----------------------------------------------------------------------------------------
class _SpecUnpickler(pickle.Unpickler):
    """Resolve ``__main__.X`` (factories defined in the user's script) in that script, loaded as a module."""

    def __init__(self, file: Any, main_module: Any) -> None:
        super().__init__(file)
        self.main_module = main_module

    def find_class(self, module: str, name: str) -> Any:
        if module == "__main__" and self.main_module is not None:
            return getattr(self.main_module, name)
        return super().find_class(module, name)


class _Namespace:
    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)


def load_spec(path: str | Path) -> dict[str, Any]:
    raw = Path(path).read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = pickle.loads(raw[8 : 8 + size])
    main_module = None
    if header.get("main_file"):
        # As multiprocessing's spawn does: run the user's script under another name, so that its
        # `if __name__ == "__main__":` block does not run again here.
        main_module = _Namespace(runpy.run_path(header["main_file"], run_name="__mp_main__"))
    spec = _SpecUnpickler(io.BytesIO(raw[8 + size :]), main_module).load()
    spec.update(header)
    return spec


def dump_spec(path: Path, header: dict[str, Any], body: dict[str, Any]) -> None:
    """``header`` (plain data, read first) then ``body`` (may reference the user's ``__main__``)."""
    head = pickle.dumps(header)
    path.write_bytes(len(head).to_bytes(8, "little") + head + pickle.dumps(body))


# -- helpers --------------------------------------------------------------------------------------
def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for item in value:
            if isinstance(item, torch.Tensor):
                return item
    return None


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered to its full tensor (a collective over its mesh), else the tensor; detached fp32 on CPU."""
    if isinstance(t, DTensor):
        t = t.full_tensor()
    t = t.detach()
    if t.is_floating_point():
        t = t.float()
    return t.cpu().clone()


def disable_dropout(module: nn.Module) -> list[str]:
    """Set every dropout probability of ``module`` to 0; returns what was changed (``name (p=...)``)."""
    changed = []
    for name, sub in module.named_modules():
        label = name or type(module).__name__
        if is_dropout_module(sub) and sub.p > 0:
            changed.append(f"{label} ({type(sub).__name__} p={sub.p})")
            sub.p = 0.0
        for attr, value in list(vars(sub).items()):
            if "dropout" in attr.lower() and isinstance(value, float) and not isinstance(value, bool) and value > 0:
                changed.append(f"{label}.{attr}={value}")
                setattr(sub, attr, 0.0)
    return changed


def nudge_parameters(module: nn.Module) -> None:
    """Every floating-point parameter of ``module`` one rounding unit higher (the noise control's run):
    a difference of the size another summation order makes."""
    with torch.no_grad():
        for param in module.parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            if local.is_floating_point():
                local.copy_(torch.nextafter(local, torch.full_like(local, math.inf)))


def mesh_coordinates(trainer: Any) -> tuple[dict[str, int], dict[str, int]]:
    """``({pp, dp, ep, cp, tp}: coordinate, {...}: size)`` of this rank (all 0 / 1 without a 5D mesh)."""
    mesh = getattr(trainer.strategy, "device_mesh", None)
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if mesh is None or not set(MESH_DIMS) <= set(names):
        return dict.fromkeys(MESH_DIMS, 0) | {"dp": trainer.global_rank}, dict.fromkeys(MESH_DIMS, 1) | {
            "dp": trainer.world_size
        }
    coords = mesh.get_coordinate() or [0] * len(names)
    return (
        {n: int(coords[names.index(n)]) for n in MESH_DIMS},
        {n: int(mesh.shape[names.index(n)]) for n in MESH_DIMS},
    )


# -- the recording callback -------------------------------------------------------------------------
def _recorder_class() -> type:
    import lightning.pytorch as pl

    class VerifyRecorder(pl.Callback):
        """Records what verification compares; see the module docstring."""

        def __init__(self, out_dir: Path, record_forward: bool, summary: Any, perturb_initial: bool = False) -> None:
            self.out_dir = Path(out_dir)
            self.perturb_initial = perturb_initial
            self.record_forward = record_forward
            self.summary = summary
            self.batches: dict[int, list[torch.Tensor]] = defaultdict(list)
            self.grads: dict[str, torch.Tensor | None] | None = None
            self.initial: dict[str, torch.Tensor] | None = None
            self.routing: dict[str, dict[str, Any]] = {}
            self.stack: list[str] = []
            self.start_order: dict[str, None] = {}
            self.end_order: dict[str, None] = {}
            self.calls: dict[str, list[tuple[Any, Any]]] = defaultdict(list)
            self.types: dict[str, str] = {}
            self.in_step1 = True
            self.handles: list[Any] = []
            self.dropout: list[str] = []
            self.backward_depth = 0

        # hooks on every module: where are we (errors), what did they compute (step 1)
        def _pre(self, name: str) -> Any:
            def hook(module: nn.Module, args: Any) -> None:
                self.stack.append(name)
                if self.in_step1 and not self.backward_depth and not _inferring():
                    self.start_order.setdefault(name, None)

            return hook

        def _post(self, name: str, record: bool) -> Any:
            def hook(module: nn.Module, args: Any, output: Any) -> None:
                if self.stack and self.stack[-1] == name:
                    self.stack.pop()
                if not self.in_step1 or self.backward_depth or _inferring():
                    return
                self.end_order.setdefault(name, None)
                if record:
                    out, inp = _first_tensor(output), _first_tensor(args)
                    self.calls[name].append(
                        (_full(out) if out is not None else None, _full(inp) if inp is not None else None)
                    )

            return hook

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.dropout = disable_dropout(pl_module)
            self.coords, self.sizes = mesh_coordinates(trainer)
            if self.perturb_initial:
                nudge_parameters(pl_module)
            # The starting point: the comparison of the final parameters needs each element's
            # update, to tell optimizer rounding noise from a real difference (numerics.optimizer_noise).
            keep = self._leads_stage()
            initial = {}
            with torch.no_grad():
                for name, param in pl_module.named_parameters():
                    value = _full(param)  # a collective under DTensor: every rank takes part
                    if keep:
                        initial[name] = value
            self.initial = initial if keep else None
            self.routing = routing_settings(pl_module)
            pipelined = self.sizes["pp"] > 1
            for name, module in pl_module.named_modules():
                self.types[name] = _type_name(module)
                if name == "" and pipelined:
                    continue  # a pipeline stage's root returns hidden states, not the model's output
                self.handles.append(module.register_forward_pre_hook(self._pre(name), prepend=True))
                self.handles.append(module.register_forward_hook(self._post(name, self.record_forward)))

        # Activation checkpointing runs forwards again inside backward: those are not new calls.
        def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
            self.backward_depth += 1

        def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
            self.backward_depth -= 1

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            ids = batch.get("input_ids") if isinstance(batch, dict) else None
            if isinstance(ids, torch.Tensor):
                self.batches[trainer.global_step].append(ids.detach().cpu().clone())

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            if self.grads is not None:
                return
            self.in_step1 = False
            keep = self._leads_stage()
            grads = {}
            with torch.no_grad():
                for name, param in pl_module.named_parameters():
                    grad = _full(param.grad) if param.grad is not None else None
                    if keep:
                        grads[name] = grad
            self.grads = grads

        def _leads_stage(self) -> bool:
            return all(self.coords[d] == 0 for d in MESH_DIMS if d != "pp")

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            keep = self._leads_stage()
            final = {}
            with torch.no_grad():
                for name, param in pl_module.named_parameters():
                    value = _full(param)
                    if keep:
                        final[name] = value
                for module_name, module in pl_module.named_modules():
                    for buf_name, buf in module.named_buffers(recurse=False):
                        if buf_name in non_persistent_buffer_names(module):
                            continue
                        value = _full(buf)
                        if keep:
                            final[f"{module_name}.{buf_name}" if module_name else buf_name] = value
            for handle in self.handles:
                handle.remove()
            data = {
                "rank": trainer.global_rank,
                "coords": self.coords,
                "sizes": self.sizes,
                "chunks": int(getattr(trainer.strategy, "pp_microbatches", 1)) if self.sizes["pp"] > 1 else 1,
                "batches": dict(self.batches),
                "start_order": list(self.start_order),
                "end_order": list(self.end_order),
                "types": self.types,
                "dropout": self.dropout,
                "losses": list(self.summary.losses) if trainer.is_global_zero else None,
                "initial": self.initial,
                "routing": self.routing,
                "grads": self.grads if keep else None,
                "final": final if keep else None,
                "forward": dict(self.calls) if self.record_forward else None,
                "global_steps": trainer.global_step,
            }
            torch.save(data, self.out_dir / f"rank{trainer.global_rank}.pt")

        def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
            record = {
                "rank": trainer.global_rank,
                "time": time.time(),
                "type": type(exception).__name__,
                "message": str(exception).strip()[:2000],
                "modules": list(self.stack),
                "types": self.types,
                "step": trainer.global_step + 1,
                "traceback": traceback.format_exception(exception)[-6:],
            }
            (self.out_dir / f"error_rank{trainer.global_rank}.json").write_text(json.dumps(record, indent=1))

    return VerifyRecorder


# Attributes of an MoE layer that decide over which tokens its routing statistics are taken.
ROUTING_ATTRS = ("load_balancing", "aux_loss_coeff", "routing", "capacity_factor")


def routing_settings(module: nn.Module) -> dict[str, dict[str, Any]]:
    """``{module name: {attr: value}}`` for every submodule with a ``load_balancing`` setting (MoE layers).

    Verification names them when a difference comes from batch-level routing statistics.
    """
    found = {}
    for name, sub in module.named_modules():
        if isinstance(getattr(sub, "load_balancing", None), str):
            found[name] = {
                a: getattr(sub, a) for a in ROUTING_ATTRS if isinstance(getattr(sub, a, None), (str, int, float))
            }
    return found


def _type_name(module: nn.Module) -> str:
    """The module's class name, without the ``FSDP`` prefix of FSDP2's wrapper classes."""
    name = type(module).__name__
    if name.startswith("FSDP") and len(name) > 4 and name[4].isupper():
        bases = [b.__name__ for b in type(module).__mro__[1:]]
        if name[4:] in bases:
            return name[4:]
    return name


def _inferring() -> bool:
    """True while a pipeline stage runs its shape-inference forward (not a real micro-batch)."""
    from lightning_moe.parallel.engines.pipeline_runner import is_inferring_shapes

    return is_inferring_shapes()


# -- building and running ------------------------------------------------------------------------
FIXED_TRAINER_ARGS: dict[str, Any] = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
    "limit_val_batches": 0,
    "val_check_interval": None,
    "check_val_every_n_epoch": None,
    "precision": "32-true",
}


def _build(spec: dict[str, Any], callbacks: list[Any]) -> tuple[Any, Any, Any]:
    import hydra
    import lightning.pytorch as pl
    from omegaconf import OmegaConf

    out_dir = Path(spec["out_dir"])
    pl.seed_everything(spec["seed"], workers=True, verbose=False)
    trainer_args = dict(FIXED_TRAINER_ARGS, max_steps=spec["steps"], default_root_dir=str(out_dir))
    if spec["kind"] == "config":
        cfg = OmegaConf.create(spec["config"])
        datamodule = hydra.utils.instantiate(cfg.data)
        model = hydra.utils.instantiate(cfg.model)
        strategy = hydra.utils.instantiate(cfg.parallel)
        extra = [
            hydra.utils.instantiate(node) for node in (cfg.verify.get("callbacks") or {}).values() if node is not None
        ]
        trainer_cfg = OmegaConf.to_container(cfg.trainer, resolve=True)
        assert isinstance(trainer_cfg, dict)
        target = trainer_cfg.pop("_target_", "lightning.pytorch.Trainer")
        trainer_cfg.update(trainer_args)
        trainer = hydra.utils.get_method(target)(strategy=strategy, callbacks=[*extra, *callbacks], **trainer_cfg)
    else:
        from lightning_moe.strategy import MoE5DStrategy

        # The runner pins the reference's micro-batch size to the layout's through this argument.
        datamodule = spec["datamodule_factory"](**spec.get("datamodule_kwargs", {}))
        model = spec["module_factory"]()
        strategy = MoE5DStrategy(**spec["strategy_kwargs"])
        kwargs = dict(spec["trainer_kwargs"])
        extra = list(kwargs.pop("callbacks", []) or [])
        kwargs.update(trainer_args)
        kwargs["devices"] = spec["devices"]
        trainer = pl.Trainer(strategy=strategy, callbacks=[*extra, *callbacks], **kwargs)
    return trainer, model, datamodule


def main(spec_path: str) -> None:
    from lightning_moe.callbacks import SummaryCallback

    spec = load_spec(spec_path)
    out_dir = Path(spec["out_dir"])
    summary = SummaryCallback(dirpath=out_dir)
    recorder = _recorder_class()(out_dir, spec["record_forward"], summary, bool(spec.get("perturb_initial")))
    trainer, model, datamodule = _build(spec, [summary, recorder])
    trainer.fit(model, datamodule=datamodule)


if __name__ == "__main__":
    os.environ[SPEC_ENV] = "1"
    main(sys.argv[1])

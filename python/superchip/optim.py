"""Fused CPU optimizers: drop-ins for torch.optim.Adam, AdamW and SGD.

Same constructor arguments, param groups, LR schedulers and ``state_dict()`` layout as
torch.optim (a checkpoint moves between the two both ways). The step is one fused pass per
parameter chunk on the CPU (ops/cpu kernels, SIMD, a thread pool on the GPU-local NUMA
node). For superchip parameters the moments, and the fp32 master weights of bf16/fp16
parameters, live in the ``host`` tier; state tensors are on the parameter's device.
"""

from __future__ import annotations

from itertools import chain

import torch

from . import _C
from . import distributed as _dist  # DTensor (FSDP2) parameters: local shards, sharded state

__all__ = ["Adam", "AdamW", "SGD"]

_LOW_PRECISION = (torch.bfloat16, torch.float16)
_SUPPORTED = (torch.float32, torch.bfloat16, torch.float16)


def _scalar(x, what: str) -> float:
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"Tensor {what} must be 1-element")
        return float(x.item())
    return float(x)


def _reject_unsupported(cls: str, *, differentiable=False, capturable=False, fused=None) -> None:
    if differentiable:
        raise ValueError(
            f"superchip.optim.{cls} does not support differentiable=True: its step runs in fused "
            f"CPU kernels outside autograd. Use torch.optim.{cls}(..., differentiable=True)."
        )
    if capturable:
        raise ValueError(
            f"superchip.optim.{cls} does not support capturable=True (CUDA-graph capture): its "
            f"step runs on the CPU. Use torch.optim.{cls}(..., capturable=True) for graphs."
        )
    if fused is False:
        raise ValueError(
            f"superchip.optim.{cls} is always fused; fused=False asks for the unfused "
            f"implementation, which is torch.optim.{cls}."
        )


def _state_tensor(p: torch.Tensor, values: torch.Tensor | None = None) -> torch.Tensor:
    """An fp32 tensor shaped like ``p`` on p's device (host tier for superchip), zeros or ``values``."""
    if _dist.is_dtensor(p):  # FSDP2: this rank's shard, wrapped as a DTensor sharded like p
        local = None if values is None else _dist.local_values(p, values.detach())
        return _dist.state_like(p, _state_tensor(p.to_local(), local))
    if p.device.type == "superchip":
        t = _C._fp32_in_tier(p.detach(), "host", False)
        if values is not None:
            t.copy_(values.detach().reshape(p.shape))
        return t
    if values is None:
        return torch.zeros(p.shape, dtype=torch.float32, device=p.device)
    return values.detach().to(device=p.device, dtype=torch.float32, copy=True).reshape(p.shape)


def _evaluate(closure):
    """The closure's loss, computed with autograd on (step() runs under no_grad)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _check_param(cls: str, p: torch.Tensor) -> None:
    if p.dtype not in _SUPPORTED:
        raise TypeError(
            f"superchip.optim.{cls}: parameter of dtype {p.dtype} is not supported (float32, "
            f"bfloat16, float16 are). Use torch.optim.{cls} for it, or cast the model."
        )
    if p.device.type not in ("superchip", "cpu"):
        raise RuntimeError(
            f"superchip.optim.{cls}: parameter on {p.device}; it steps superchip and cpu "
            f"parameters. Move the model with .to('superchip')."
        )
    if p.grad.is_sparse:
        raise RuntimeError(f"superchip.optim.{cls} does not support sparse gradients.")
    if p.grad.device != p.device:
        raise RuntimeError(
            f"superchip.optim.{cls}: gradient on {p.grad.device} for a parameter on {p.device}."
        )
    if p.grad.shape != p.shape:
        raise RuntimeError(
            f"superchip.optim.{cls}: gradient of shape {tuple(p.grad.shape)} for a parameter of "
            f"shape {tuple(p.shape)}."
        )


def _params_with_grad(cls: str, group: dict) -> list:
    """The group's parameters that have a gradient, all checked before any state changes."""
    params = [p for p in group["params"] if p.grad is not None]
    for p in params:
        _check_param(cls, p)
    return params


class _FusedOptimizer(torch.optim.Optimizer):
    """Shared state handling: fp32 state in the host tier, torch-compatible state dicts."""

    _STATE_KEYS: tuple = ()

    def _master(self, p: torch.Tensor, state: dict):
        if p.dtype not in _LOW_PRECISION:
            return None
        if "master_param" not in state:
            state["master_param"] = _state_tensor(p, p)
        return state["master_param"]

    def load_state_dict(self, state_dict: dict) -> None:
        # torch's loader casts every state tensor to the parameter's dtype and device, which
        # would round fp32 moments of a bf16 parameter to bf16 and put them in hbm. Keep the
        # saved values aside and rebuild the state as fp32 host-tier tensors afterwards.
        saved = {
            pid: {k: v for k, v in st.items() if k != "step" and isinstance(v, torch.Tensor)}
            for pid, st in state_dict["state"].items()
        }
        super().load_state_dict(state_dict)
        ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        by_id = dict(zip(ids, params))
        for pid, tensors in saved.items():
            p = by_id[pid]
            state = self.state[p]
            for key, value in tensors.items():
                if key in self._STATE_KEYS or key == "master_param":
                    state[key] = _state_tensor(p, value)
            if p.dtype in _LOW_PRECISION and "master_param" not in state:
                state["master_param"] = _state_tensor(p, p)
            if "step" in state:
                # A fresh CPU tensor: torch's loader hands over the caller's own step tensor,
                # which step() increments in place.
                state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)


class Adam(_FusedOptimizer):
    """Fused Adam (L2 weight decay), or AdamW with ``decoupled_weight_decay=True``."""

    _STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, *, foreach=None, maximize=False, capturable=False,
                 differentiable=False, fused=None, decoupled_weight_decay=False):
        name = type(self).__name__
        _reject_unsupported(name, differentiable=differentiable, capturable=capturable, fused=fused)
        lr_v = _scalar(lr, "lr")
        if not 0.0 <= lr_v:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= _scalar(betas[0], "betas[0]") < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= _scalar(betas[1], "betas[1]") < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=foreach, capturable=capturable,
                        differentiable=differentiable, fused=fused,
                        decoupled_weight_decay=decoupled_weight_decay)
        super().__init__(params, defaults)

    def __setstate__(self, state):
        # As torch.optim.Adam: groups from older checkpoints get today's defaults.
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("foreach", None)
            group.setdefault("capturable", False)
            group.setdefault("differentiable", False)
            group.setdefault("fused", None)
            group.setdefault("decoupled_weight_decay", False)

    @torch.no_grad()
    def step(self, closure=None):
        loss = _evaluate(closure)
        name = type(self).__name__
        for group in self.param_groups:
            _reject_unsupported(name, differentiable=group.get("differentiable", False),
                                capturable=group.get("capturable", False),
                                fused=group.get("fused"))
            amsgrad = group["amsgrad"]
            params, grads, masters, m1, m2, mx, steps = [], [], [], [], [], [], []
            for p in _params_with_grad(name, group):
                state = self.state[p]
                if "step" not in state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = _state_tensor(p)
                    state["exp_avg_sq"] = _state_tensor(p)
                if amsgrad and "max_exp_avg_sq" not in state:
                    state["max_exp_avg_sq"] = _state_tensor(p)
                state["step"] += 1
                params.append(p)
                grads.append(p.grad)
                masters.append(self._master(p, state))
                m1.append(state["exp_avg"])
                m2.append(state["exp_avg_sq"])
                mx.append(state["max_exp_avg_sq"] if amsgrad else None)
                steps.append(int(state["step"].item()))
            if not params:
                continue
            beta1, beta2 = group["betas"]
            params, grads, masters, m1, m2, mx = _dist.local_shards(params, grads, masters, m1, m2, mx)
            _C._adam_step(params, grads, masters, m1, m2, mx, steps, _scalar(group["lr"], "lr"),
                          _scalar(beta1, "beta1"), _scalar(beta2, "beta2"), float(group["eps"]),
                          float(group["weight_decay"]), bool(group["decoupled_weight_decay"]),
                          bool(amsgrad), bool(group["maximize"]))
        return loss


class AdamW(Adam):
    """Fused AdamW: Adam with decoupled weight decay (default 1e-2), like torch.optim.AdamW."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True)

    def __setstate__(self, state):
        # As torch.optim.AdamW: whatever the checkpoint says, AdamW decays decoupled.
        super().__setstate__(state)
        for group in self.param_groups:
            group["decoupled_weight_decay"] = True


class SGD(_FusedOptimizer):
    """Fused SGD with momentum, dampening, Nesterov and weight decay, like torch.optim.SGD."""

    _STATE_KEYS = ("momentum_buffer",)

    def __init__(self, params, lr=1e-3, momentum=0, dampening=0, weight_decay=0, nesterov=False,
                 *, maximize=False, foreach=None, differentiable=False, fused=None):
        _reject_unsupported("SGD", differentiable=differentiable, fused=fused)
        if _scalar(lr, "lr") < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize, foreach=foreach,
                        differentiable=differentiable, fused=fused)
        super().__init__(params, defaults)

    def __setstate__(self, state):
        # As torch.optim.SGD: groups from older checkpoints get today's defaults.
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("nesterov", False)
            group.setdefault("maximize", False)
            group.setdefault("foreach", None)
            group.setdefault("differentiable", False)
            group.setdefault("fused", None)

    @torch.no_grad()
    def step(self, closure=None):
        loss = _evaluate(closure)
        for group in self.param_groups:
            momentum = float(group["momentum"])
            params, grads, masters, buffers, first = [], [], [], [], []
            for p in _params_with_grad("SGD", group):
                state = self.state[p]
                params.append(p)
                grads.append(p.grad)
                masters.append(self._master(p, state))
                if momentum != 0.0:
                    is_new = state.get("momentum_buffer") is None
                    if is_new:
                        state["momentum_buffer"] = _state_tensor(p)
                    buffers.append(state["momentum_buffer"])
                    first.append(is_new)
                else:
                    buffers.append(None)
                    first.append(False)
            if not params:
                continue
            params, grads, masters, buffers = _dist.local_shards(params, grads, masters, buffers)
            _C._sgd_step(params, grads, masters, buffers, first, _scalar(group["lr"], "lr"),
                         momentum, float(group["dampening"]), float(group["weight_decay"]),
                         bool(group["nesterov"]), bool(group["maximize"]))
        return loss

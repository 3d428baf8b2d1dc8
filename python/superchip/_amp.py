"""Autograd functions written for CUDA's autocast keep their contract under superchip's.

Contract
--------
- A ``forward`` decorated with ``torch.amp.custom_fwd(device_type="cuda", cast_inputs=...)``
  (also through ``functools.partial``, or the deprecated ``torch.cuda.amp.custom_fwd``) and
  its ``backward`` decorated with ``torch.amp.custom_bwd(device_type="cuda")`` behave inside
  ``torch.autocast("superchip")`` as they do inside ``torch.autocast("cuda")``: with
  ``cast_inputs``, superchip's floating-point inputs are cast and superchip's autocast is off
  in ``forward``; without, ``forward`` runs under the caller's autocast state and
  ``backward`` under the same state and dtype (Note [custom_fwd declared for cuda]).
- CUDA's own autocast, where it is enabled, keeps precedence: the function then does what torch
  does. Decorators for other device types are torch's, unchanged.
- Applies to functions decorated after ``import superchip``; a decorator bound before (a
  ``functools.partial(torch.amp.custom_fwd, ...)`` made by a library imported first) is
  torch's.
"""

from __future__ import annotations

import functools

import torch

from ._after_import import wrapping

# Note [custom_fwd declared for cuda]
# superchip's autocast follows CUDA's per-op policy (backend/register/Autocast.cpp). Libraries
# state the rest of that policy for their own autograd functions with torch.amp.custom_fwd /
# custom_bwd declared for "cuda": Liger Kernel (functools.partial(torch.amp.custom_fwd,
# device_type="cuda")), Unsloth and axolotl's kernels, flash-linear-attention. Under
# torch.autocast("superchip") those decorators saw CUDA's autocast off and did nothing: a
# forward meant to run in float32 (cast_inputs) ran in bfloat16, and a backward meant to run
# under the forward's autocast ran without it, so its first matmul of a bfloat16 gradient with
# a float32 weight raised "expected m1 and m2 to have the same dtype" (the Trainer's bf16=True
# autocasts on superchip). A function declared for "cuda" now also carries the same
# decorators declared for "superchip", and each call takes the one whose autocast is on.


def _superchip_autocast_only() -> bool:
    return torch.is_autocast_enabled("superchip") and not torch.is_autocast_enabled("cuda")


def install() -> None:
    from torch.amp import autocast_mode

    custom_fwd, custom_bwd = autocast_mode.custom_fwd, autocast_mode.custom_bwd
    if getattr(custom_fwd, "_superchip", False):
        return

    def custom_fwd_also_superchip(fwd=None, *, device_type, cast_inputs=None):
        if fwd is None:
            return functools.partial(custom_fwd_also_superchip, device_type=device_type,
                                     cast_inputs=cast_inputs)
        declared = custom_fwd(fwd, device_type=device_type, cast_inputs=cast_inputs)
        if device_type != "cuda":
            return declared
        superchip = custom_fwd(fwd, device_type="superchip", cast_inputs=cast_inputs)

        @functools.wraps(fwd)
        def decorate_fwd(*args, **kwargs):
            ours = _superchip_autocast_only()
            args[0]._superchip_autocast = ours  # for custom_bwd: the forward's choice
            return (superchip if ours else declared)(*args, **kwargs)

        return decorate_fwd

    def custom_bwd_also_superchip(bwd=None, *, device_type):
        if bwd is None:
            return functools.partial(custom_bwd_also_superchip, device_type=device_type)
        declared = custom_bwd(bwd, device_type=device_type)
        if device_type != "cuda":
            return declared
        superchip = custom_bwd(bwd, device_type="superchip")

        @functools.wraps(bwd)
        def decorate_bwd(*args, **kwargs):
            ours = getattr(args[0], "_superchip_autocast", False)
            return (superchip if ours else declared)(*args, **kwargs)

        return decorate_bwd

    new_fwd = wrapping(custom_fwd_also_superchip, custom_fwd)
    new_bwd = wrapping(custom_bwd_also_superchip, custom_bwd)
    autocast_mode.custom_fwd, autocast_mode.custom_bwd = new_fwd, new_bwd
    torch.amp.custom_fwd, torch.amp.custom_bwd = new_fwd, new_bwd

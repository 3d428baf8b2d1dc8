"""bitsandbytes' paged optimizers on superchip: superchip's tiers do the paging.

Contract
--------
- A bitsandbytes optimizer (``PagedAdamW``, ``PagedAdamW8bit``, ``PagedLion8bit``, ... and the
  ``Trainer``'s ``optim="paged_adamw_8bit"`` / ``"paged_adamw_32bit"``) over superchip
  parameters keeps its state as superchip tensors, placed like any other: in ``hbm`` while it
  has room, in ``host`` beyond (Note [Paged optimizer state]). Its steps are those of the
  same optimizer unpaged. Parameters on other devices are left to bitsandbytes.
- Applied when ``bitsandbytes.optim.optimizer`` is imported, before or after superchip.
"""

from __future__ import annotations

import torch

from ._after_import import wrapping

# Note [Paged optimizer state]
# bitsandbytes pages the state of a paged optimizer by allocating it (tensors of 100,000
# elements or more) in CUDA unified memory, as a CPU tensor over a managed pointer, for any
# parameter not on the CPU. For a superchip parameter that failed at the first step: on the
# CPU executor with "Method 'cget_managed_ptr' not available in CPU-only version of
# bitsandbytes" (a QLoRA Trainer with optim="paged_adamw_8bit" and LoRA matrices of 10^5
# elements or more), and on the CUDA executor the state would be a CPU tensor beside a superchip
# parameter, which superchip refuses as mixed devices. Spilling state out of GPU memory is
# what superchip's tiers do already, and without faults on the step's critical path: the state
# is made a superchip tensor, as bitsandbytes makes it for a CPU parameter (unpaged).


def _patch_paged_state() -> None:
    from bitsandbytes.optim import optimizer

    original = optimizer.Optimizer8bit.get_state_buffer
    if getattr(original, "_superchip", False):
        return

    def get_state_buffer(self, p, dtype=torch.float32):
        if p.device.type == "superchip":
            return torch.zeros_like(p, dtype=dtype, device=p.device)
        return original(self, p, dtype)

    optimizer.Optimizer8bit.get_state_buffer = wrapping(get_state_buffer, original)


def install() -> None:
    from ._after_import import after_import

    after_import("bitsandbytes.optim.optimizer", _patch_paged_state,
                 "bitsandbytes' paged optimizers could not keep their state on superchip")

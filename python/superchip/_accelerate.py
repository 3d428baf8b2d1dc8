"""Accelerate's automatic device maps place a model on superchip whole.

Contract
--------
- With superchip imported (before or after accelerate), accelerate's ``get_max_memory``
  (what ``from_pretrained(..., device_map="auto" | "balanced" | "sequential")``,
  ``infer_auto_device_map`` and ``dispatch_model`` read when no ``max_memory`` is given) counts
  for each superchip device what a placement there can still take in both tiers
  (``superchip.device._placement_room``), not ``hbm``'s free bytes alone. A model that fits
  the two tiers is therefore mapped to the superchip device whole (``hf_device_map == {"":
  0}``), placed in ``hbm`` and ``host`` and streamed as ``.to("superchip")`` does; only what
  exceeds both tiers goes to accelerate's "cpu" and "disk" offload.
- ``max_memory`` given by the user is taken as given (accelerate reads nothing then).
- Other devices, and accelerate without ``utils.modeling.get_accelerator_free_memory`` (it
  came with accelerate 1.16; the set-up installs 1.16), are left as accelerate has them.

Note [device_map="auto" on superchip]
accelerate asks each accelerator for its free memory (``torch.accelerator.get_memory_info``,
for superchip ``hbm``'s, as ``torch.cuda.mem_get_info`` gives the GPU's) and maps the layers
that do not fit there to "cpu": their parameters stay on the meta device and accelerate's
hooks copy CPU weights in at each forward. With superchip that is the wrong answer twice:
superchip already holds what hbm cannot in its host tier and streams it ahead of use, and a
layer accelerate offloads does not train: ``from_pretrained(..., device_map="auto")`` of an
8-layer Llama at 2.5x an 8 MiB hbm budget mapped 7 of the 8 layers to "cpu"; training it with
``superchip.optim.AdamW`` ran, printed falling losses and updated only the embedding and the
first layer (every other parameter was a meta tensor, and ``state_dict()`` then raised "Cannot
copy out of meta tensor"). Making ``get_memory_info`` report both tiers would fix accelerate
and break its meaning everywhere else (batch and cache sizing read it as GPU memory, as on
CUDA; ``memory_allocated`` reports hbm), so the device's own figure stays hbm's, and only
accelerate's question "how much can this device hold" gets superchip's answer.
"""

from __future__ import annotations

import torch


def _superchip_accelerator() -> bool:
    acc = torch.accelerator.current_accelerator()
    return acc is not None and acc.type == "superchip"


def _patch_free_memory() -> None:
    import accelerate.utils.modeling as modeling

    original = getattr(modeling, "get_accelerator_free_memory", None)
    if original is None or getattr(original, "_superchip", False):
        return

    def get_accelerator_free_memory(device_module, device_index: int) -> int:
        if device_module is torch.accelerator and _superchip_accelerator():
            from .device import _placement_room

            return _placement_room(device_index)
        return original(device_module, device_index)

    get_accelerator_free_memory._superchip = True
    get_accelerator_free_memory.__wrapped__ = original
    modeling.get_accelerator_free_memory = get_accelerator_free_memory


def install() -> None:
    """Patches accelerate now if it is loaded, else right after it loads."""
    from ._after_import import after_import

    after_import("accelerate.utils.modeling", _patch_free_memory,
                 "accelerate's device maps could not be given superchip's memory")

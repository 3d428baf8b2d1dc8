"""Hugging Face's device choices, answered for superchip: accelerate's automatic device maps
place a model on superchip whole, ``Trainer`` trains where ``ACCELERATE_TORCH_DEVICE`` says, and
accelerate refuses to run superchip processes apart under torchrun.

Contract
--------
Each holds whether superchip is imported before or after accelerate and transformers.

- Accelerate's ``get_max_memory``
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
- ``TrainingArguments.device`` is the superchip device ``ACCELERATE_TORCH_DEVICE`` names
  (``"superchip"``: the current one) whenever that variable names one, the process is not
  distributed and ``use_cpu`` is off, with ``n_gpu`` 1, on either executor (Note [Trainer's
  device with the CUDA executor]). Without the variable, transformers' choice stands.
- accelerate's ``PartialState`` (made by ``Accelerator()`` and by ``TrainingArguments.device``)
  raises a RuntimeError saying what to use instead when superchip is the accelerator, the
  process is one of several (``WORLD_SIZE`` above 1 and ``LOCAL_RANK`` set, as torchrun sets
  them), no process group exists yet and ``cpu`` is off; it raises before it makes a process
  group, and leaves no state behind (Note [Trainer under torchrun]). A script that made its
  own process group (and wraps DDP itself) is left alone.

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

Note [Trainer's device with the CUDA executor]
transformers' ``TrainingArguments`` picks the device of a single-process run itself, and
ignores accelerate's: its last case is ``"cuda:0" if torch.cuda.is_available() else
ACCELERATE_TORCH_DEVICE``. With the CPU executor that reads the variable the README tells
Trainer users to set; with the CUDA executor torch.cuda is available, so ``Trainer`` moved the
model to plain ``cuda:0`` (a model larger than the GPU then fails there, and
``superchip.optim`` is handed CUDA parameters), and ``n_gpu`` counted the GPUs, so a machine
with several wrapped the model in ``nn.DataParallel``. Found by reading transformers 5.25 and
checked with ``torch.cuda.is_available`` patched to say yes (no GPU here). The variable naming
superchip now wins over CUDA, as it does over the CPU; one process trains on one device, as
with the CPU executor.

Note [Trainer under torchrun]
accelerate (1.16) knows a fixed list of device types it can run distributed (its
``DistributedType`` and ``TORCH_DISTRIBUTED_BACKENDS``); superchip is not among them, and no
entry can be added from outside (an enum). Launched by torchrun with
``ACCELERATE_TORCH_DEVICE=superchip``, ``Trainer`` therefore ran each process as a single one:
measured with two processes (CPU executor), each trained on the whole dataset on its own and
both ended with the same weights, so N processes did the work of one, silently (and with the
CUDA executor every process would have taken superchip:0). Support would mean re-routing
accelerate's distributed set-up, data sharding and DDP wrapping for a device it does not know;
until then accelerate's state refuses, with what to do, before it makes a process group (it
would wait for every rank). A bare ``Accelerator()`` under torchrun is the same loop without
``Trainer`` and is refused too, unless the script made its process group itself: then it
distributes the work on its own and accelerate's single-process mode is what it asked for.
torch.distributed itself (DDP, FSDP2) runs on superchip.
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


def _patch_distributed_check() -> None:
    import os

    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    original = PartialState.__dict__.get("_prepare_backend")
    if original is None or getattr(original, "_superchip", False):
        return

    def _prepare_backend(self, cpu: bool = False, *args, **kwargs):
        backend, distributed_type = original(self, cpu, *args, **kwargs)
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if (distributed_type == DistributedType.NO and not cpu and world > 1
                and os.environ.get("LOCAL_RANK") is not None and _superchip_accelerator()
                and not torch.distributed.is_initialized()):
            PartialState._reset_state()  # nothing half-made for the next PartialState()
            raise RuntimeError(
                f"superchip: accelerate cannot train on superchip in {world} processes: it has no "
                "distributed mode for the superchip device (its distributed device types are a "
                "fixed list), so each process (Trainer's, or an Accelerator's) would train alone, "
                "on all of the data, without averaging gradients. Run one process (python "
                "train.py), or train with torch.distributed directly: DistributedDataParallel or "
                "FSDP2 (fully_shard) on superchip (README, 'Multi-GPU and multi-node'; "
                "examples/ddp_fsdp.py).")
        return backend, distributed_type

    _prepare_backend._superchip = True
    _prepare_backend.__wrapped__ = original
    PartialState._prepare_backend = _prepare_backend


def _patch_training_device() -> None:
    import os
    from functools import cached_property

    from transformers.training_args import TrainingArguments

    prop = TrainingArguments.__dict__.get("_setup_devices")
    if not isinstance(prop, cached_property) or getattr(prop.func, "_superchip", False):
        return
    original = prop.func

    def _setup_devices(self) -> torch.device:
        device = original(self)
        wanted = os.environ.get("ACCELERATE_TORCH_DEVICE", "")
        if device.type != "cuda" or not wanted.startswith("superchip"):
            return device  # use_cpu, ACCELERATE_USE_CPU, the CPU executor's own fallback
        from accelerate.utils import DistributedType

        if getattr(self.distributed_state, "distributed_type", None) != DistributedType.NO:
            return device
        from .device import _device_of

        self._n_gpu = 1
        return _device_of(wanted)

    _setup_devices._superchip = True
    _setup_devices.__wrapped__ = original
    patched = cached_property(_setup_devices)
    patched.__set_name__(TrainingArguments, "_setup_devices")
    TrainingArguments._setup_devices = patched


def install() -> None:
    """Patches accelerate and transformers now if they are loaded, else right after they load."""
    from ._after_import import after_import

    after_import("accelerate.utils.modeling", _patch_free_memory,
                 "accelerate's device maps could not be given superchip's memory")
    after_import("accelerate.state", _patch_distributed_check,
                 "accelerate could not be kept from running superchip processes apart")
    after_import("transformers.training_args", _patch_training_device,
                 "Trainer's device could not follow ACCELERATE_TORCH_DEVICE")

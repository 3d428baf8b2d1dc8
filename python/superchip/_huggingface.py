"""Hugging Face's device choices, answered for superchip: accelerate's automatic device maps
place a model on superchip whole, ``Trainer`` trains on superchip as accelerate does,
accelerate runs superchip processes under torchrun as one data-parallel job, ``from_pretrained``
allocates only the weights, offloaded KV caches and pipelines run on superchip, and safetensors
loads onto superchip.

Contract
--------
Each holds whether superchip is imported before or after accelerate, transformers and safetensors.

- Accelerate's ``get_max_memory``
  (what ``from_pretrained(..., device_map="auto" | "balanced" | "sequential")``,
  ``infer_auto_device_map`` and ``dispatch_model`` read when no ``max_memory`` is given) counts
  for each superchip device what a placement there can still take in both tiers
  (``superchip.device._placement_room``), not ``hbm``'s free bytes alone. A model that fits
  the two tiers is therefore mapped to the superchip device whole (``hf_device_map == {"":
  0}``), placed in ``hbm`` and ``host`` and streamed as ``.to("superchip")`` does; only what
  exceeds both tiers goes to accelerate's "cpu" and "disk" offload. The machine's memory, on
  which ``host`` (and an emulated ``hbm``) draws, is counted once across every superchip device
  and accelerate's "cpu" entry (Note [One machine under several devices]): "cpu" is what the
  tiers leave of it, nothing when ``host`` has no budget.
- ``max_memory`` given by the user is taken as given (accelerate reads nothing then).
- Other devices, and accelerate without ``utils.modeling.get_accelerator_free_memory`` (it
  came with accelerate 1.16; the set-up installs 1.16), are left as accelerate has them.
- In a process that is not distributed, ``TrainingArguments.device`` is a superchip device,
  with ``n_gpu`` 1, on either executor, as accelerate's own device is (Note [Trainer's
  device]): the one ``ACCELERATE_TORCH_DEVICE`` names, or the current one without it. Left to
  transformers: ``use_cpu``, ``ACCELERATE_USE_CPU``, and the variable naming another device.
  ``bf16=True`` is taken where superchip says it takes bf16 (``torch.superchip.is_bf16_supported``),
  as a GPU's answer is taken on CUDA.
- Under torchrun (``LOCAL_RANK`` set), accelerate's state (made by ``Accelerator()`` and by
  ``TrainingArguments.device``) with superchip as the accelerator is a distributed one: a
  process group ``cpu:gloo,superchip:sccl`` (unless the script made one, or named a backend),
  ``DistributedDataParallel`` around the model, data loaders sharded by rank, and the device
  ``superchip:<local rank modulo device_count()>`` (Note [accelerate's processes on
  superchip]). ``cpu=True`` / ``use_cpu`` keep accelerate's own CPU mode. Asked for FSDP (an
  FSDP plugin, ``Trainer(fsdp=...)``, ``ACCELERATE_USE_FSDP``), the state is accelerate's FSDP
  mode instead, version 1 or 2, as on CUDA; its Megatron-LM mode and context parallelism raise a
  ValueError saying so (they would silently have run DDP), leaving no state behind.
- ``from_pretrained`` onto superchip allocates only the model's tensors: transformers'
  caching-allocator warm-up (one model-sized block per accelerator before the weights load)
  skips superchip devices, as it skips MPS and Neuron (Note [No allocator warm-up]).
- ``generate(..., cache_implementation="offloaded" | "offloaded_static")`` (and a cache made
  with ``offloading=True``) on superchip offloads as on CUDA: each layer's keys and values go
  to the CPU after its update and the next layer's come back on a side stream, ordered by
  superchip's streams where transformers names CUDA's default stream (Note [Offloaded caches]).
- A transformers pipeline given a device index (``pipeline(..., device=0)``), or none for a
  model without accelerate's device map (transformers then takes index 0), runs on superchip
  device N, as ``torch.device(N)`` is (Note [No allocator warm-up]
Before it loads the weights, ``from_pretrained`` allocates and frees, on each accelerator of
the device map, one float16 block as large as the weights that go there, so that CUDA's
caching allocator then serves every weight from one cached segment. superchip's tiers do not
split a cached block for smaller requests, so the block bought nothing and cost a model's
worth of memory: loading a 485 MiB bf16 Llama with ``device_map="superchip"`` left hbm with
970 MiB reserved for 485 MiB of weights (no budget), and with a 200 MiB hbm budget the block
went to host, whose peak was the whole model (485 MiB) and which kept 811 MiB reserved for
326 MiB of weights; with the host tier pinned (the CUDA executor) the block is also pinned
page by page, seconds for a large model. For a model sized to the machine (the reason to use
superchip) the cached block was a second copy of the model in reserve until memory ran short.
transformers skips the warm-up for MPS and Neuron for like reasons; superchip devices are
taken out of the map it is given.

Note [Offloaded caches]
transformers' offloaded KV caches (``generate(..., cache_implementation="offloaded")``, the
memory saver for long generations) order their copies with ``torch.cuda.default_stream(device)``,
whatever the device: on superchip the first update raised "Torch not compiled with CUDA
enabled" (CPU executor; the CUDA executor's ``torch.cuda`` refuses a superchip device too). The
cache's side stream is already the accelerator's (``torch.Stream()``, superchip's). For a
superchip device, ``Cache.update`` runs transformers' offloading steps itself with
``torch.accelerator.current_stream(device)`` in place of CUDA's default stream: wait for the
prefetch, make the prefetch wait for the compute, prefetch the next offloaded layer, update,
offload this one (to the CPU, as asked: not to superchip's host tier). Greedy generation gives
the dynamic cache's tokens (the CPU's, on the CPU executor), with the offloaded layers' keys on
the CPU afterwards.

Note [Pipelines' device]); a model already on superchip
  stays there. ``device=-1``, device names and ``torch.device`` objects are transformers' as
  given.
- ``generate()`` on a mixture-of-experts model switches the experts from ``grouped_mm`` to
  ``batched_mm`` while decoding on any device but the CPU (and MPS): on superchip with the CPU
  executor the experts stay ``grouped_mm``, as on the CPU, so generation gives the CPU's logits
  (with the switch, Mixtral's and Qwen3-MoE's scores were 1 ulp off the CPU's; found by a
  user-flow probe). With the CUDA executor they switch, as on CUDA.
- ``attn_implementation="flex_attention"`` asks FlexAttention for the log-sum-exp on any device
  but the CPU, which has none; on superchip with the CPU executor it is asked as on the CPU
  (point 21 of Note [Why superchip patches Inductor] makes FlexAttention itself run there).
- safetensors opens files for a superchip device (Note [safetensors' device names]):
  ``safe_open(..., device=D)``, ``safetensors.torch.load_file(..., device=D)`` and what calls them
  (peft's ``load_peft_weights`` and ``PeftModel.from_pretrained(..., torch_device=D)``,
  accelerate's ``load_checkpoint_in_model``, huggingface_hub's ``load_torch_model``) give
  tensors on D, for D ``"superchip"``, ``"superchip:N"`` or such a ``torch.device``, placed as
  ``.to(D)`` places them (past hbm's budget, in host). Every other device is handed to
  safetensors as given. This holds for every module's ``safe_open`` name bound to safetensors'
  own, whenever it was bound, except a name bound after ``import superchip`` straight from
  ``safetensors._safetensors_rust``.

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

Note [One machine under several devices]
Each superchip device's ``host`` tier (and, emulated, its ``hbm``) is the machine's memory,
and so is accelerate's "cpu": counting the machine in each device's room and again as "cpu"
promised what the machine did not have. Two emulated devices with 64 MiB hbm budgets under a
1.5 GiB memory cgroup got ``{0: 1044 MiB, 1: 1044 MiB, "cpu": 20725 MiB}`` (psutil does not see
the cgroup), and ``from_pretrained(..., device_map="auto", offload_folder=...)`` of a 1.3 GB
Llama failed half-way with superchip's out-of-memory error on device 1, where disk offload
would have loaded it; without superchip's host-memory check that is the kernel's OOM killer.
With ``max_memory`` left to accelerate, the devices now share the machine's room
(``device._placement_rooms``: each takes what its budgets allow, the others an equal share of
the rest) and "cpu" gets what they leave, as accelerate gives integrated GPUs, which share the
host's memory, no "cpu" entry at all.

Note [Trainer's device]
transformers' ``TrainingArguments`` picks the device of a single-process run itself, and
ignores accelerate's (which is superchip: PrivateUse1 is torch's accelerator when registered):
its last case is ``"cuda:0" if torch.cuda.is_available() else ACCELERATE_TORCH_DEVICE or
"cpu"``, and ``Trainer`` moves the model there. So a script that moved its model to superchip
and handed it to ``Trainer`` got it moved back, silently: to the CPU with the CPU executor
(unless the README's ``ACCELERATE_TORCH_DEVICE=superchip`` was set), and to plain ``cuda:0``
with the CUDA executor even with it (a model larger than the GPU then fails there, and
``superchip.optim`` is handed CUDA parameters); ``n_gpu`` counted the GPUs, so a machine with
several wrapped the model in ``nn.DataParallel``. The CUDA case was found by reading
transformers 5.25 and checked with ``torch.cuda.is_available`` patched to say yes (no GPU
here). A process that imports superchip now trains on it, as accelerate's ``Accelerator``
already did; one process trains on one device.

Note [accelerate's processes on superchip]
accelerate (1.16) runs distributed only on device types of a fixed list (its
``DistributedType`` enum and ``TORCH_DISTRIBUTED_BACKENDS``); superchip is not among them, and
an enum takes no new member from outside. Launched by torchrun with
``ACCELERATE_TORCH_DEVICE=superchip``, ``Trainer`` therefore ran each process as a lone one:
measured with two processes (CPU executor), each trained on all of the data, without DDP, and
both ended with the weights of a one-process run, so N processes did the work of one,
silently (and with the CUDA executor every process would have taken superchip:0).
accelerate's MULTI_CPU mode is the one whose every step fits a device it does not know: it
wraps the model in DDP without ``device_ids`` (DDP on superchip parameters, as
torch.distributed runs it), shards data loaders, runs barriers and the RNG broadcast without
naming a device, and makes its process group from the launcher's variables. superchip takes
it, with two changes: the group's backend is ``cpu:gloo,superchip:sccl`` (a Gloo-only group
would refuse superchip tensors' collectives), and the device is ``superchip:<local rank>``, not
the CPU. accelerate itself makes MULTI_CPU only with ``cpu=True``, which is how a state of
superchip's is told apart (``_ours``). accelerate turns FSDP on (from the plugin or its
variable) only over its own device types' modes: MULTI_CPU ignored it, so ``Trainer(fsdp=
"full_shard")`` silently ran DDP, every rank holding the whole model. superchip makes the same
switch for its state; torch's FSDP (1 and 2) runs on superchip tensors, with a default mesh of
the accelerator's type. Measured: two ranks of ``Trainer`` (clipping on,
``torch.optim.AdamW(foreach=False)``) give the bits of the same run on CPU tensors in
accelerate's own MULTI_CPU mode, ``superchip.optim.AdamW`` with the engine gives its
``overlap=False`` bits, and FSDP2 (half of each parameter per rank) and FSDP1 give DDP's
losses to 1e-6 and FSDP2 its weights to 4e-9, the rounding of a reduce-scatter that divides
before it sums (``test_finetune_adapters.py``).

Note [Pipelines' device]
transformers' ``Pipeline`` turns a device index into a device of the first type on its list
that is available (``cuda:N`` whenever CUDA is, else npu, xpu, mps... else the CPU) and, given
no device and no accelerate device map, uses index 0; then it moves the model there. So
``pipeline("text-generation", model=model)`` with ``model`` on superchip moved it, silently,
to the CPU (CPU executor) or to plain ``cuda:0`` (CUDA executor: a model larger than the GPU
then fails there), and so did ``device=0``. torch reads an index as a device of its
accelerator, superchip; the pipeline now does as well.

Note [safetensors' device names]
safetensors' core (Rust) takes a device as one of the names it lists (cpu, cuda, mps, npu,
xpu, xla, mlu, musa, hpu, with an optional index) or as a bare index, and refuses any other
name: ``load_file(path, device="superchip")`` raised "SafetensorError: device superchip is
invalid", and so did peft's adapter loading given superchip (``load_peft_weights(path,
device="superchip")``, ``PeftModel.from_pretrained(model, path, torch_device="superchip")``)
and accelerate's ``load_checkpoint_in_model`` with a superchip device map. (safetensors'
pull requests #779, #786 and #804, open, would add a registry for such devices.) A bare index
is safetensors' "let torch choose" form: it makes each tensor on the CPU from the file and
calls ``tensor.to(index)``, and torch reads an index as a device of its accelerator, which is
superchip whenever superchip is registered (PrivateUse1 comes first in torch's choice). So a
superchip device is handed to safetensors as its index, on the path safetensors takes for
CUDA, with ``get_tensor``, ``get_slice`` and ``metadata`` as they are. ``safe_open`` is a type
of the Rust extension whose ``__new__`` cannot be wrapped (Python then refuses to call the
original as "not safe"), so the name is rebound instead: ``safetensors.safe_open`` (which
``safetensors.torch`` and later ``from safetensors import safe_open`` read) and every loaded
module's global bound to the original (transformers', accelerate's, peft's, a script's
imported before superchip). The wrapper is a function: nothing in those packages checks
``isinstance(..., safe_open)``.
"""

from __future__ import annotations

import inspect
import sys

import torch

from ._after_import import rebind, wrapping as _wrapping


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

    modeling.get_accelerator_free_memory = _wrapping(get_accelerator_free_memory, original)

    # Note [One machine under several devices]
    original_max = modeling.get_max_memory
    if getattr(original_max, "_superchip", False):
        return

    def get_max_memory(max_memory=None):
        result = original_max(max_memory)
        if max_memory is not None or not _superchip_accelerator():
            return result
        from .device import _placement_rooms

        devices = [k for k in result if isinstance(k, int)]
        rooms, left = _placement_rooms(devices)
        result.update(rooms)
        if "cpu" in result:
            result["cpu"] = min(result["cpu"], left)
        return result

    patched = _wrapping(get_max_memory, original_max)
    modeling.get_max_memory = patched
    package = sys.modules.get("accelerate.utils")  # still importing .modeling when superchip came first
    if package is not None and package.__dict__.get("get_max_memory") is original_max:
        package.get_max_memory = patched
    for name in ("get_max_memory", "accelerate_max_memory"):  # transformers' name for it
        rebind(name, original_max, patched)


# What accelerate's process group is made with for superchip: superchip tensors through sccl,
# CPU tensors (accelerate's RNG broadcast, object collectives) through Gloo; the README's
# init_process_group() default.
_PROCESS_GROUP_BACKEND = "cpu:gloo,superchip:sccl"


def _ours(state, distributed_type) -> bool:
    """A distributed state accelerate made MULTI_CPU for superchip (Note [accelerate's processes
    on superchip]): accelerate itself makes MULTI_CPU only with ``cpu=True``."""
    return (state.distributed_type == distributed_type.MULTI_CPU and not state._cpu
            and _superchip_accelerator())


def _patch_distributed() -> None:
    import os

    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    prepare = PartialState.__dict__.get("_prepare_backend")
    set_device = PartialState.__dict__.get("set_device")
    if prepare is None or set_device is None or getattr(prepare, "_superchip", False):
        return

    def _prepare_backend(self, cpu: bool = False, sagemaker_dp=False, backend=None):
        got, distributed_type = prepare(self, cpu, sagemaker_dp, backend)
        if (distributed_type == DistributedType.NO and not cpu and not sagemaker_dp
                and int(os.environ.get("LOCAL_RANK", -1)) != -1 and _superchip_accelerator()):
            return backend or _PROCESS_GROUP_BACKEND, DistributedType.MULTI_CPU
        return got, distributed_type

    def _set_device(self):
        if not _ours(self, DistributedType) or (self.device is not None and self.device.index is not None):
            return set_device(self)
        index = self.local_process_index % torch.superchip.device_count()
        self.device = torch.device("superchip", index)
        torch.superchip.set_device(index)

    from accelerate.state import AcceleratorState

    init = AcceleratorState.__init__
    init_signature = inspect.signature(init)

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if not _ours(self, DistributedType):
            return
        bound = init_signature.bind(self, *args, **kwargs).arguments
        plugin = bound.get("fsdp_plugin")
        if plugin is not None or _flag("ACCELERATE_USE_FSDP"):
            # accelerate's own switch to FSDP, which it makes for its own device types only.
            self.distributed_type = DistributedType.FSDP
            if self._mixed_precision != "no" and plugin is not None:
                plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = plugin
            PartialState._shared_state["distributed_type"] = self.distributed_type
            return
        if _flag("ACCELERATE_USE_MEGATRON_LM"):
            _refuse("Megatron-LM mode", "leave it out")
        if getattr(bound.get("parallelism_config"), "cp_enabled", False):
            _refuse("context parallelism", "leave it out")

    for cls, name, new, old in ((PartialState, "_prepare_backend", _prepare_backend, prepare),
                                (PartialState, "set_device", _set_device, set_device),
                                (AcceleratorState, "__init__", __init__, init)):
        setattr(cls, name, _wrapping(new, old))


def _refuse(what: str, instead: str) -> None:
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # nothing half-made for the next one
    raise ValueError(
        f"superchip: accelerate's {what} does not run on the superchip device (superchip's "
        f"processes would otherwise train with DDP, each rank holding the whole model): {instead}; "
        "DDP and FSDP (Trainer's fsdp=...) run.")


def _flag(name: str) -> bool:
    """An ACCELERATE_USE_* variable read as accelerate reads it: FSDP and Megatron-LM only as
    "true", the CPU as any of strtobool's yeses (transformers' and accelerate's reading)."""
    import os

    value = os.environ.get(name, "false").lower()
    if name == "ACCELERATE_USE_CPU":
        return value in ("y", "yes", "t", "true", "on", "1")
    return value == "true"


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
        wanted = os.environ.get("ACCELERATE_TORCH_DEVICE", "superchip")
        if (not wanted.startswith("superchip") or self.use_cpu or _flag("ACCELERATE_USE_CPU")
                or not _superchip_accelerator()):
            return device
        from accelerate.utils import DistributedType

        if getattr(self.distributed_state, "distributed_type", None) != DistributedType.NO:
            return device
        from .device import _device_of

        self._n_gpu = 1
        return _device_of(wanted)

    patched = cached_property(_wrapping(_setup_devices, original))
    patched.__set_name__(TrainingArguments, "_setup_devices")
    TrainingArguments._setup_devices = patched


def _patch_bf16_check() -> None:
    # bf16=True: TrainingArguments asks whether "the GPU" takes bf16, from a list of device
    # types superchip is not on, and refused it ("Your setup doesn't support bf16/gpu"); the
    # device it trains on is superchip's, so superchip answers.
    import transformers.training_args as training_args

    bf16_available = getattr(training_args, "is_torch_bf16_gpu_available", None)
    if bf16_available is not None and not getattr(bf16_available, "_superchip", False):
        def is_torch_bf16_gpu_available() -> bool:
            if _superchip_accelerator():
                return torch.superchip.is_bf16_supported()
            return bf16_available()

        training_args.is_torch_bf16_gpu_available = _wrapping(is_torch_bf16_gpu_available, bf16_available)


def _is_superchip(device) -> bool:
    try:
        return torch.device(device).type == "superchip"
    except (RuntimeError, TypeError):  # "disk" and other names of accelerate's maps
        return False


def _patch_allocator_warmup() -> None:
    import transformers.modeling_utils as modeling_utils

    original = getattr(modeling_utils, "caching_allocator_warmup", None)
    if original is None or getattr(original, "_superchip", False):
        return

    def caching_allocator_warmup(model, expanded_device_map, *args, **kwargs):
        others = {name: device for name, device in expanded_device_map.items() if not _is_superchip(device)}
        return original(model, others, *args, **kwargs)

    modeling_utils.caching_allocator_warmup = _wrapping(caching_allocator_warmup, original)


def _patch_cache_offloading() -> None:
    from transformers.cache_utils import Cache

    original = Cache.update
    if getattr(original, "_superchip", False) or not all(hasattr(Cache, m) for m in ("prefetch", "offload")):
        return

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if not (getattr(self, "offloading", False) and key_states.device.type == "superchip"):
            return original(self, key_states, value_states, layer_idx, *args, **kwargs)
        # transformers' offloading steps (Note [Offloaded caches]), with the device's streams
        # where transformers names CUDA's default stream.
        replicate = getattr(self, "layer_class_to_replicate", None)
        while replicate is not None and len(self.layers) <= layer_idx:
            self.layers.append(replicate())
        stream = torch.accelerator.current_stream(key_states.device)
        stream.wait_stream(self.prefetch_stream)
        self.prefetch_stream.wait_stream(stream)
        self.prefetch(layer_idx + 1, self.only_non_sliding)
        self.offloading = False  # the layer's own update, without transformers' CUDA calls
        try:
            keys, values = original(self, key_states, value_states, layer_idx, *args, **kwargs)
        finally:
            self.offloading = True
        self.offload(layer_idx, self.only_non_sliding)
        return keys, values

    Cache.update = _wrapping(update, original)


def _patch_pipelines() -> None:
    from transformers.pipelines.base import Pipeline

    original = Pipeline.__init__
    if getattr(original, "_superchip", False):
        return
    signature = inspect.signature(original)

    def __init__(self, *args, **kwargs):
        if _superchip_accelerator():
            bound = signature.bind(self, *args, **kwargs)
            device = bound.arguments.get("device")
            model = bound.arguments.get("model")
            if device is None and getattr(model, "hf_device_map", None) is None:
                device = 0  # transformers' own choice then
            if isinstance(device, int) and not isinstance(device, bool) and device >= 0:
                bound.arguments["device"] = torch.device("superchip", device)
                args, kwargs = bound.args[1:], bound.kwargs
        original(self, *args, **kwargs)

    Pipeline.__init__ = _wrapping(__init__, original)


def _safetensors_device(device):
    """A superchip device as safetensors can take it, its index (Note [safetensors' device
    names]); any other device as given."""
    if isinstance(device, str) and device.split(":")[0] == "superchip":
        device = torch.device(device)
    if not isinstance(device, torch.device) or device.type != "superchip" or not _superchip_accelerator():
        return device
    return device.index if device.index is not None else torch.accelerator.current_device_index()


def _patch_safetensors() -> None:
    import safetensors

    original = safetensors.safe_open
    if getattr(original, "_superchip", False):
        return

    def safe_open(filename, framework, device="cpu", *args, **kwargs):
        return original(filename, framework, _safetensors_device(device), *args, **kwargs)

    patched = _wrapping(safe_open, original)
    patched.__doc__ = original.__doc__
    # Every module's name for the original (safetensors.torch's and others' bound before now).
    rebind("safe_open", original, patched)
    safetensors.safe_open = patched


def _patch_flex_attention() -> None:
    import transformers.integrations.flex_attention as flex

    from ._inductor.patches import _rewrite_code, cpu_like_device_types

    flex._superchip_cpu_like = cpu_like_device_types()  # Dynamo traces it in a compiled model
    _rewrite_code(flex.flex_attention_forward, ('return_lse = query.device.type != "cpu"',
                                                "return_lse = query.device.type not in _superchip_cpu_like"))


def _patch_decode_experts() -> None:
    from transformers.generation.utils import GenerationMixin

    from ._inductor.patches import _rewrite_code, cpu_like_device_types

    sys.modules[GenerationMixin.__module__]._superchip_cpu_like = cpu_like_device_types()
    _rewrite_code(GenerationMixin._optimize_model_for_decode,
                  ('keep_grouped_mm = device_type == "cpu"', "keep_grouped_mm = device_type in _superchip_cpu_like"))


def install() -> None:
    """Patches accelerate, transformers and safetensors now if they are loaded, else right after they load."""
    from ._after_import import after_import

    after_import("accelerate.utils.modeling", _patch_free_memory,
                 "accelerate's device maps could not be given superchip's memory")
    after_import("accelerate.state", _patch_distributed,
                 "accelerate's processes on superchip could not be made a distributed run")
    after_import("transformers.training_args", _patch_training_device,
                 "Trainer's device could not follow ACCELERATE_TORCH_DEVICE")
    after_import("transformers.training_args", _patch_bf16_check,
                 "TrainingArguments(bf16=True) could not be allowed on superchip")
    after_import("transformers.modeling_utils", _patch_allocator_warmup,
                 "transformers' allocator warm-up could not be kept off superchip")
    after_import("transformers.cache_utils", _patch_cache_offloading,
                 "transformers' offloaded caches could not be given superchip's streams")
    after_import("transformers.pipelines.base", _patch_pipelines,
                 "transformers' pipelines could not be given superchip's device")
    after_import("transformers.generation.utils", _patch_decode_experts,
                 "generate() could not keep the CPU's experts kernel on superchip's CPU executor")
    after_import("transformers.integrations.flex_attention", _patch_flex_attention,
                 "transformers' FlexAttention could not run on superchip's CPU executor")
    after_import("safetensors", _patch_safetensors,
                 "safetensors could not be given superchip's device names")

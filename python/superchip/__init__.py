"""superchip: a PyTorch device whose tensors live in GPU memory (hbm) and host memory (host).

    import superchip
    model = build_model().to("superchip")

Importing the package registers the ``superchip`` device (PyTorch's PrivateUse1 key), its
device module ``torch.superchip`` and the generated ``Tensor.superchip()`` /
``Module.superchip()`` / storage methods. The functions below are the public memory API.
"""

from __future__ import annotations

import operator as _operator
import sys as _sys
import weakref

import torch

if torch._C._get_privateuse1_backend_name() not in ("privateuseone", "superchip"):
    raise ImportError(
        "superchip: the PrivateUse1 device is already registered as "
        f"'{torch._C._get_privateuse1_backend_name()}' by another package; only one "
        "out-of-tree device can be loaded per process."
    )

from . import _C  # noqa: E402  (registers allocator, hooks, guard and kernels)
from . import device as _device_module  # noqa: E402

if _C._executor() == "cuda":
    # The CUDA executor runs torch's CUDA kernels, whose caching allocator and generators exist
    # only after torch's lazy CUDA initialisation; a script that never touched torch.cuda got
    # "Allocator not initialized for device" at its first forwarded op.
    torch.cuda.init()
_C._init()

# Other libraries' operators (torch.library) run the executor's kernel where they also have a
# "default" one, from now on and for those registered later (_library.py).
from . import _library  # noqa: E402

_library.install()

if torch._C._get_privateuse1_backend_name() != "superchip":
    torch.utils.rename_privateuse1_backend("superchip")
    torch._register_device_module("superchip", _device_module)
    torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)

from .device import _index  # noqa: E402

# Note [Autograd worker at exit]
# Backward on superchip tensors runs on torch's autograd worker thread for the device. After
# backward() returns, that worker may still hold the last reference to the finished graph task
# for a few microseconds; if the interpreter is already finalizing when it drops it, the
# task's thread-local state decrefs a Python object without being able to take the GIL and
# the process aborts ("terminate called without an active exception"). Giving the worker a
# moment before finalization closes the window; it costs 20 ms at exit.
import atexit as _atexit  # noqa: E402
import time as _time  # noqa: E402

_atexit.register(_time.sleep, 0.02)
# Queued optimizer steps finish before the interpreter (and the optimizer's thread pool) go.
_atexit.register(_C._engine_synchronize)

# Note [Storages written to files]
# Every superchip operator waits for the optimizer's pending steps on its operands (and rolls
# back a speculation it reads). torch's legacy serializer, which pickle uses for every tensor
# (multiprocessing queues, pickle.dumps) and torch.save(..., _use_new_zipfile_serialization=False)
# uses, reads a storage's bytes through at::from_blob, past the operators: right after step()
# it saved the values from before the step, and between backward() and step() speculative
# ones (found by review). Its entry point waits for that storage first, and so does
# indexing a storage (storage[i], storage[a:b]), which reads the same way.
_write_file = torch.UntypedStorage._write_file
_getitem = torch.UntypedStorage.__getitem__


def _superchip_write_file(self, *args, **kwargs):
    if self.device.type == "superchip":
        _C._engine_wait_storage(self)
    return _write_file(self, *args, **kwargs)


def _superchip_getitem(self, *args, **kwargs):
    if self.device.type == "superchip":
        _C._engine_wait_storage(self)
    return _getitem(self, *args, **kwargs)


torch.UntypedStorage._write_file = _superchip_write_file
torch.UntypedStorage.__getitem__ = _superchip_getitem

# Note [DLPack]
# superchip moves a storage's bytes between tiers in place (move_to_tier, weight streaming's
# demotions and promotions), and every superchip operator waits for a pending optimizer step
# on its operands. A DLPack capsule is a raw pointer past both: its consumer's tensor kept
# reading the freed block after a move (and the next tensor allocated there: found by
# review). So torch.from_dlpack(t) of a superchip tensor gives the alias CUDA gives as a view
# of t's own storage (t.detach(): moves and waits apply to it), and a capsule of superchip
# memory is refused with what to do; a capsule of a copy on the CPU (dl_device=kDLCPU, as
# numpy.from_dlpack(t, device="cpu") asks) is made after the pending step. torch's
# __dlpack_device__ names PrivateUse1 only under its default name and raised for superchip:
# it answers kDLExtDev and the index.
import functools as _functools  # noqa: E402

import torch.utils.dlpack as _dlpack_utils  # noqa: E402

_dlpack = torch.Tensor.__dlpack__
_dlpack_device = torch.Tensor.__dlpack_device__
_from_dlpack = _dlpack_utils.from_dlpack
_to_dlpack = _dlpack_utils.to_dlpack


def _superchip_tensor(obj) -> bool:
    return (isinstance(obj, torch.Tensor) and obj.device.type == "superchip"
            and not torch.overrides.has_torch_function_unary(obj))


def _refuse_capsule() -> None:
    raise BufferError(
        "a DLPack capsule of a superchip tensor would alias memory that superchip moves between "
        "tiers (move_to_tier, weight streaming) and that a queued optimizer step may still "
        "write; use torch.from_dlpack(t) for an alias within torch (t.detach()), or t.cpu() "
        "(numpy.from_dlpack(t, device='cpu')) for another library.")


@_functools.wraps(_dlpack)
def _superchip_dlpack(self, *args, **kwargs):
    if _superchip_tensor(self):
        stream = kwargs.get("stream")
        if stream is not None and type(stream) is not int:  # torch's own check comes first
            raise TypeError("stream must be ``int`` or ``none``")
        dl_device = kwargs.get("dl_device")
        if dl_device is None or int(dl_device[0]) != int(_dlpack_utils.DLDeviceType.kDLCPU):
            _refuse_capsule()
        _C._engine_wait_storage(self.untyped_storage())
    return _dlpack(self, *args, **kwargs)


@_functools.wraps(_dlpack_device)
def _superchip_dlpack_device(self):
    if _superchip_tensor(self):
        return (_dlpack_utils.DLDeviceType.kDLExtDev, self.device.index if self.device.index is not None else 0)
    return _dlpack_device(self)


@_functools.wraps(_from_dlpack)
def _superchip_from_dlpack(ext_tensor, *args, **kwargs):
    if not _superchip_tensor(ext_tensor):
        return _from_dlpack(ext_tensor, *args, **kwargs)
    if ext_tensor.requires_grad:  # as __dlpack__ refuses them
        raise BufferError("Can't export tensors that require gradient, use tensor.detach()")
    if ext_tensor.is_conj():
        raise BufferError("Can't export tensors with the conjugate bit set")
    device, copy = kwargs.get("device"), kwargs.get("copy")
    out = ext_tensor.detach()
    if device is not None and torch.device(device) != out.device:
        if copy is False:
            raise BufferError(f"torch.from_dlpack: copy=False, but the tensor is on {out.device}, not {device}")
        return out.to(device)
    return out.clone() if copy else out


@_functools.wraps(_to_dlpack)
def _superchip_to_dlpack(tensor, *args, **kwargs):
    if _superchip_tensor(tensor):
        _refuse_capsule()
    return _to_dlpack(tensor, *args, **kwargs)


torch.Tensor.__dlpack__ = _superchip_dlpack
torch.Tensor.__dlpack_device__ = _superchip_dlpack_device
torch.from_dlpack = _dlpack_utils.from_dlpack = _superchip_from_dlpack
torch.to_dlpack = _dlpack_utils.to_dlpack = _superchip_to_dlpack
from . import optim  # noqa: E402,F401
from . import _inductor  # noqa: E402  (torch.compile support, registered on first use)
from . import distributed  # noqa: E402,F401  (registers the sccl c10d backend)

# Note [Tensors sent to another process]
# torch.multiprocessing pickles a tensor for a child (spawn's arguments, a Queue) by sharing
# its storage: a file descriptor for CPU memory, an IPC handle for CUDA. superchip memory has
# neither, and torch's reducer raised "_share_fd_: only available on CPU", which names no
# superchip (from a Queue's feeder thread, while the child waited for ever: found by review).
# The reducer now says what to do; anything else is torch's.
#
# One sender is different: a DataLoader worker. A dataset or collate_fn that builds superchip
# tensors (a tokenizer's `.to(device)`, data kept on the device) works in a forked worker, and
# its batch went through the same reducer, from the worker's feeder thread: the error was
# printed there and the training loop waited for that batch for ever. A batch is handed over,
# never shared back (the worker does not see it again, and torch pins or copies batches
# anyway), so a worker's tensor travels as a CPU copy through torch's shared memory and is
# moved to its superchip device on arrival, in the process that iterates the DataLoader.
# Storages, and tensors sent by anything else, still raise: a copy where torch shares (a model
# trained by several processes, Hogwild-style) would be a silent wrong result.
#
# Where the refusal is raised matters. Process arguments and SimpleQueue pickle in the
# caller, which sees the error. A multiprocessing.Queue pickles later, in its feeder thread,
# whose default error hook only prints a traceback in the sender and drops the object: the
# receiver's get() waited for ever (found by review). There the tensor travels as the refusal
# itself, and unpickling it raises the same message in the receiver's get(); the sender also
# warns. Queues with their own error hook (concurrent.futures' process pools hand the error
# to the future) still get the exception.
#
# `share_memory()` asks for what cannot be given: torch makes it a no-op for a PrivateUse1
# device and `is_shared()` answered True, so a Hogwild script (model.share_memory(), then
# forked trainers) trained a private copy per process and the parent saw none of their
# updates, without a word. `Module.share_memory()`, the Hogwild call, now raises before it
# changes anything. A tensor's or storage's `share_memory_()` stays a no-op with a warning
# (once): libraries call it on small tensors they may never send (datasets' iterable datasets
# share their epoch counter at construction, a superchip tensor under
# torch.set_default_device("superchip")), and a first version that raised there broke them.
# `is_shared()` is False for superchip storages.
def _in_dataloader_worker() -> bool:
    worker = _sys.modules.get("torch.utils.data._utils.worker")
    return worker is not None and getattr(worker, "_worker_info", None) is not None


def _rebuild_from_worker(cpu, device, parameter):
    out = cpu.detach().to(device)  # a leaf, as the worker's was
    if parameter:
        return torch.nn.Parameter(out, requires_grad=cpu.requires_grad)
    return out.requires_grad_(cpu.requires_grad)


import itertools as _itertools  # noqa: E402
import warnings as _warnings  # noqa: E402


def _not_sendable(what: str) -> str:
    return (f"a superchip {what} cannot be sent to another process: superchip memory belongs "
            f"to the process that allocated it (there is no inter-process sharing as for CUDA). "
            f"Send tensor.cpu() (or a state_dict of CPU tensors) and move it with "
            f".to('superchip') in the other process, or start the child with the 'fork' method, "
            f"which inherits a copy of its own without pickling.")


def _in_a_queue_feeder_that_only_prints() -> bool:
    # multiprocessing.Queue's feeder thread runs Queue._feed(..., onerror, queue_sem); the
    # default onerror is the staticmethod Queue._on_queue_feeder_error (prints, drops the item).
    import threading
    from multiprocessing import queues

    args = getattr(threading.current_thread(), "_args", ())
    return (threading.current_thread().name == "QueueFeederThread" and len(args) >= 2
            and args[-2] is queues.Queue._on_queue_feeder_error)


def _refused_in_transit(message):
    raise RuntimeError(f"{message} (raised where the object was received: a "
                       f"multiprocessing.Queue pickles in a background thread of the sender)")


def _wrap_reducer(reduce):
    def reducer(obj):
        device = getattr(obj, "device", None)
        if device is not None and device.type == "superchip":
            if isinstance(obj, torch.Tensor) and _in_dataloader_worker():
                if obj.requires_grad and not obj.is_leaf:
                    reduce(obj)  # torch's own refusal of a non-leaf tensor that requires grad
                cpu = obj.detach().cpu().requires_grad_(obj.requires_grad)
                return _rebuild_from_worker, (cpu, str(device), isinstance(obj, torch.nn.Parameter))
            message = _not_sendable(type(obj).__name__)
            if _in_a_queue_feeder_that_only_prints():
                _warnings.warn(f"{message} The receiver's get() raises this error.", RuntimeWarning)
                return _refused_in_transit, (message,)
            raise RuntimeError(message)
        return reduce(obj)
    return reducer


_NOT_SHARED = ("superchip memory cannot be shared between processes (a forked child gets a copy "
               "of its own, and pickling a superchip tensor for another process is refused)")
_warned_share_memory = False


def _refuse_sharing(share_memory_, is_shared, module_share_memory):
    @_functools.wraps(share_memory_)
    def share_memory_or_warn(self, *args, **kwargs):
        global _warned_share_memory
        if self.device.type != "superchip":
            return share_memory_(self, *args, **kwargs)
        if not _warned_share_memory:
            _warned_share_memory = True
            _warnings.warn(f"share_memory_() does nothing for a superchip tensor: {_NOT_SHARED}; "
                           f"other processes see none of its later changes.", RuntimeWarning, stacklevel=2)
        return self

    @_functools.wraps(is_shared)
    def truthful_is_shared(self):
        return False if self.device.type == "superchip" else is_shared(self)

    @_functools.wraps(module_share_memory)
    def refusing_module_share_memory(self):
        if any(t.device.type == "superchip" for t in _itertools.chain(self.parameters(), self.buffers())):
            raise RuntimeError(
                f"{type(self).__name__}.share_memory(): {_NOT_SHARED}, so processes training "
                f"this model Hogwild-style would each train their own copy. Share a CPU model "
                f"(model.cpu().share_memory()), or train in one process, or across processes "
                f"with torch.distributed (DDP, FSDP2).")
        return module_share_memory(self)

    return share_memory_or_warn, truthful_is_shared, refusing_module_share_memory


def _register_reducers() -> None:
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing import reductions

    tensor, storage = _wrap_reducer(reductions.reduce_tensor), _wrap_reducer(reductions.reduce_storage)
    for cls in (torch.Tensor, torch.nn.parameter.Parameter):
        ForkingPickler.register(cls, tensor)
    ForkingPickler.register(torch.UntypedStorage, storage)
    storage_class, module_class = torch.UntypedStorage, torch.nn.Module
    storage_class.share_memory_, storage_class.is_shared, module_class.share_memory = _refuse_sharing(
        storage_class.share_memory_, storage_class.is_shared, module_class.share_memory)


_register_reducers()

# Note [Hub kernels]
# transformers (5.x, with the `kernels` package it requires) "kernelizes" every model that
# from_pretrained loads, for the device the model is on, unless USE_HUB_KERNELS says no; the
# `kernels` package accepts a fixed list of device types and raised "Unsupported device type
# 'superchip'", so from_pretrained(..., device_map="superchip") failed (found by review).
# Hub kernels would bypass superchip's forwarding anyway, so they default to off in a process
# that imports superchip; USE_HUB_KERNELS=YES set by the user still turns them on (for models
# on other devices).
import os as _os  # noqa: E402

_os.environ.setdefault("USE_HUB_KERNELS", "NO")

# Hugging Face's device choices answered for superchip, when accelerate and transformers load
# (_huggingface.py): device_map="auto" maps a model larger than hbm onto superchip whole,
# Trainer trains on superchip, and torchrun's processes run as one data-parallel job.
from . import _huggingface  # noqa: E402

_huggingface.install()

# Lightning's Trainer and Fabric take accelerator="superchip" (and "auto" picks it), with
# mixed precision and DDP on it, when lightning loads (_lightning.py).
from . import _lightning  # noqa: E402

_lightning.install()

# bitsandbytes' paged optimizers keep their state on superchip, whose tiers do the paging
# (_bitsandbytes.py).
from . import _bitsandbytes  # noqa: E402

_bitsandbytes.install()

# Triton kernels launched by hand (Liger's, Unsloth's, a user's) wait for the offload engine's
# pending work on their superchip arguments, as forwarded operators do (_triton.py).
from . import _triton  # noqa: E402

_triton.install()

# Autograd functions declared for CUDA's autocast (torch.amp.custom_fwd(device_type="cuda"):
# Liger's, Unsloth's) keep their contract under torch.autocast("superchip") (_amp.py).
from . import _amp  # noqa: E402

_amp.install()

__all__ = [
    "memory_stats",
    "tier_of",
    "move_to_tier",
    "empty_cache",
    "reset_peak_memory_stats",
    "set_capacity",
    "executor",
]

_TIERS = ("hbm", "host")


def executor() -> str:
    """Where superchip kernels run: ``"cuda"`` or ``"cpu"`` (``SUPERCHIP_EXECUTOR`` overrides)."""
    return _C._executor()


def memory_stats(device=None) -> dict:
    """Exact per-tier statistics of a superchip device, as ``{"hbm.allocated_bytes": int, ...}``.

    Keys, for each tier ``hbm`` and ``host``: allocated_bytes, requested_bytes, reserved_bytes,
    peak_allocated_bytes, peak_reserved_bytes, peak_requested_bytes, peak_active_allocations,
    capacity_bytes (0 = unlimited), external_bytes, active_allocations, num_allocs, num_frees,
    num_cache_hits, num_ooms.
    ``torch.accelerator.memory_allocated()`` equals ``hbm.allocated_bytes``.
    """
    return _C._memory_stats(_index(device))


def _holder(tensor):
    """The tensor whose storage holds ``tensor``'s bytes: a DTensor's local shard (FSDP2's
    parameters, superchip.optim's sharded state), else the tensor itself. A DTensor has no
    storage of its own: move_to_tier of one crashed the process, and superchip.optim does that
    to its sharded state after load_state_dict under FSDP2 (found by review)."""
    dt = _sys.modules.get("torch.distributed.tensor")  # no DTensor exists before it is imported
    if dt is not None and isinstance(tensor, dt.DTensor):
        with torch.no_grad():
            return tensor.to_local()
    return tensor


def tier_of(tensor: torch.Tensor) -> str:
    """The tier (``"hbm"`` or ``"host"``) holding the bytes of a superchip tensor (of a
    DTensor's local shard)."""
    return _C._tier_of(_holder(tensor))


def move_to_tier(tensor: torch.Tensor, tier: str) -> torch.Tensor:
    """Moves the storage of ``tensor`` to ``tier`` in place and returns ``tensor``.

    Every view of the storage, module parameter and optimizer reference follows; the tensor
    object stays the same. On error (e.g. the tier is full) nothing changes. Of a DTensor (an
    FSDP2 parameter), this rank's local shard moves.
    """
    if isinstance(tensor, torch.Tensor) and tensor.layout != torch.strided and tensor.device.type == "superchip":
        # A sparse or nested tensor has no single storage (torch's "Cannot access storage of
        # SparseTensorImpl" was the message: found by review).
        parts = ("t.values() (the jagged nested tensor's one buffer)" if tensor.is_nested else
                 "t._indices() and t._values()" if tensor.layout == torch.sparse_coo else
                 "t.values() and its index tensors")
        raise ValueError(
            f"move_to_tier moves a strided tensor's storage; this one is {tensor.layout}. Move its "
            f"parts instead: {parts}.")
    _C._move_to_tier(_holder(tensor), tier)
    return tensor


def empty_cache() -> None:
    """Returns the cached, unused blocks of every tier to the system (staged weights too).

    A deleted model's weight-streaming plan goes too, with the staging arena it held in hbm.
    """
    _C._empty_cache()


def reset_peak_memory_stats(device=None) -> None:
    """Sets every tier's peak statistics to its current value."""
    _C._reset_peak_memory_stats(_index(device))


def set_capacity(tier: str, nbytes: int | str, device=None) -> None:
    """Changes a tier's budget (0 = unlimited); it cannot go below the bytes in use.

    ``nbytes`` is a byte count, or a string in the forms ``SUPERCHIP_HBM_BYTES`` takes
    (``"8G"``, ``"512M"``, ``"1.5G"``)."""
    if tier not in _TIERS:
        raise ValueError(f"tier must be 'hbm' or 'host', got {tier!r}")
    if isinstance(nbytes, str):
        nbytes = _C._parse_bytes(nbytes, "set_capacity's nbytes")
    whole = None
    if not isinstance(nbytes, bool):
        try:
            whole = _operator.index(nbytes)  # int, numpy's integers, a 0-dim integer tensor
        except TypeError:
            if isinstance(nbytes, float) and nbytes.is_integer():
                whole = int(nbytes)
    if whole is None:
        raise TypeError(f"set_capacity's nbytes must be a whole number of bytes or a string such "
                        f"as '8G' (0 = unlimited), got {nbytes!r}")
    nbytes = whole
    if not 0 <= int(nbytes) < 2**63:
        raise ValueError(f"set_capacity's nbytes must be from 0 (unlimited) to 2^63 - 1 bytes, got "
                         f"{int(nbytes)}")
    _C._set_capacity(_index(device), tier, int(nbytes))


def set_streaming(enabled: bool) -> None:
    """Turns weight streaming on or off (``SUPERCHIP_STREAM=0`` starts with it off).

    On, kernels read weights that live in ``host`` from copies staged in ``hbm`` ahead of use,
    following a plan learned from the first pass; off, they read them in place. Results are the
    same bits either way.
    """
    _C._stream_set_enabled(bool(enabled))


def stream_stats() -> dict:
    """Cumulative weight-streaming counters (see ``backend/stream/WeightStreamer.h``).

    Integer keys: staged_copies, staged_bytes, prefetched, hits, prefetch_waits, staged_at_use,
    in_place_reads, invalidated, mispredictions, plans, staging_bytes, staging_peak_bytes; float
    key copy_seconds. :func:`reset_stream_stats` zeroes them.
    """
    return _C._stream_stats()


def reset_stream_stats() -> None:
    """Zeroes the counters of :func:`stream_stats` (the staging peak becomes the bytes staged now)."""
    _C._stream_reset_stats()


def weights_plan(model: torch.nn.Module | None = None) -> dict:
    """The weight-streaming plan: which weights are streamed, in which order, with what budget.

    Keys: ``state`` ("off", "idle", "recording", "streaming", "unplanned"), ``mode`` ("stage":
    copied into hbm ahead of use; "in_place": kernels read host memory directly), ``version``
    (plans made so far), ``streamed_bytes`` (distinct bytes streamed per pass),
    ``hbm_capacity`` (the budget planned for; the budget now while there is no plan; 0:
    unlimited), ``activation_peak_bytes`` (what activations and
    gradients took, in both tiers, measured while recording), ``staging_budget`` (the staging
    arena reserved in hbm), ``prefetch_depth`` (upcoming reads kept
    staged from every read: the least; more where the copies are smaller), ``demoted`` and
    ``promoted`` (weights this plan moved to host, and back to hbm: Note [Promotions] in
    backend/stream/WeightStreamer.cpp), ``copy_bytes_per_s`` (measured), and ``order``: one dict per read of a pass, in
    order, with ``bytes``, ``streamed`` (in host, staged ahead of use; else stationary in hbm)
    and, when ``model`` is given, ``names`` (the parameters and buffers
    of ``model`` over that storage; tied weights list every name). ``row_reads`` lists, in the
    same form, the weights only ever read by rows (embedding tables): kernels read them in
    place, in either tier, and the plan demotes them first when hbm lacks room.
    """
    plan = dict(_C._stream_plan())
    names: dict[int, list[str]] = {}
    if model is not None:
        tensors = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
        for name, t in tensors:
            if t.device.type == "superchip":
                names.setdefault(t.untyped_storage()._cdata, []).append(name)
    for k in ("order", "row_reads"):
        plan[k] = [{"bytes": int(n), "streamed": bool(streamed),
                    **({"names": names.get(key, [])} if model is not None else {})}
                   for key, n, streamed in plan[k]]
    return plan


_demotion_hook = None


def _has_superchip_params(optimizer) -> bool:
    return any(p.device.type == "superchip" for g in optimizer.param_groups for p in g["params"])


def _apply_stream_plan(optimizer, args, kwargs) -> None:
    # Between operators: the plan's demotions, promotions and its staging arena
    # (WeightStreamer::apply). Done here, so the module hook goes too (while it is on,
    # torch.compile(module) warns about global module hooks at every call), unless a promotion
    # found no room yet: the next module call tries again.
    if torch.compiler.is_compiling() and not _has_superchip_params(optimizer):
        return None  # Note [Hooks under torch.compile]
    _apply_stream_plan_now()


@torch._disable_dynamo  # lazy: importing superchip does not import Dynamo
def _apply_stream_plan_now() -> None:
    _remove_demotion_hook()
    if _C._stream_apply():
        _apply_stream_plan_at_next_module()


def _remove_demotion_hook() -> None:
    global _demotion_hook
    handle, _demotion_hook = _demotion_hook, None
    if handle is not None:
        handle.remove()


def _apply_stream_plan_at_next_module() -> None:
    # Called by the streamer when a new plan moves weights between tiers
    # (WeightStreamer::ApplyRequest): the moves are applied between operators, before the next
    # module call, so inference-only loops get them too (training loops also reach the
    # optimizer step hook). One-shot: no hook stays on every module call.
    global _demotion_hook
    if _demotion_hook is None:
        _demotion_hook = torch.nn.modules.module.register_module_forward_pre_hook(_demote_before_module)


def _demote_before_module(module, args) -> None:
    if torch.compiler.is_compiling():
        return None  # traced code holds no bytes: the next eager module call applies
    _remove_demotion_hook()
    if _C._stream_apply():
        _apply_stream_plan_at_next_module()
    return None


def _register_parameter(module, name, param) -> None:
    # A parameter made on the device (``with torch.device("superchip")``, ``device=``) is a
    # weight, as one copied in from the CPU is: placed under hbm's weights limit, streamed.
    if torch.compiler.is_compiling():
        return None  # Note [Hooks under torch.compile]
    if param is not None and param.device.type == "superchip":
        for t in _weight_tensors(param):
            _C._register_weight(t, place=True)
    return None


def _weight_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    # A tensor subclass (torchao's NF4Tensor, int8 weight-only) has no bytes of its own: its
    # inner tensors are the weight (Note [Quantized weights] in backend/native/Native.cpp).
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(t):
        return [t]
    inner = []
    for name in t.__tensor_flatten__()[0]:
        v = getattr(t, name)
        if isinstance(v, torch.Tensor):
            inner += _weight_tensors(v)
    return inner


torch.nn.modules.module.register_module_parameter_registration_hook(_register_parameter)

_stepped_params: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _register_stepped_parameters(optimizer, args, kwargs) -> None:
    # What an optimizer steps is a weight, however it was made: also parameters made on the
    # device without a module registering them (``to_empty(device="superchip")`` after a meta
    # init replaces them in place). Marked only: mid-training, hbm holds activations too, and the
    # plan's demotions make the room. Once per optimizer and parameter count.
    if torch.compiler.is_compiling() and not _has_superchip_params(optimizer):
        return None  # Note [Hooks under torch.compile]
    _mark_stepped_parameters(optimizer)


@torch._disable_dynamo  # lazy: importing superchip does not import Dynamo
def _mark_stepped_parameters(optimizer) -> None:
    n = sum(len(g["params"]) for g in optimizer.param_groups)
    if _stepped_params.get(optimizer) == n:
        return None
    _stepped_params[optimizer] = n
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.device.type == "superchip":
                for t in _weight_tensors(p):
                    _C._register_weight(t, place=False)
    return None

# Note [Hooks under torch.compile]
# These hooks are global: every optimizer step (and module registration) in the process runs
# them, compiled ones too, where Dynamo traced into their pybind calls: each compiled
# torch.optim step of a process that imported superchip got a graph break and a "Dynamo does
# not know how to trace" warning, CPU-only models included (found by review). While compiling,
# an optimizer without superchip parameters skips them (whether it has any is known when
# tracing: no graph break); one with superchip parameters calls their work as a function
# Dynamo does not trace (torch._disable_dynamo, which unlike torch.compiler.disable does not
# import Dynamo with superchip: one graph break, run eagerly each step), so
# a compiled step still marks its parameters as weights (to_empty after a meta init makes
# parameters no module registers) and applies the streaming plan's moves. A compiled module
# registering a parameter (rare) skips it: the next eager registration or step marks it.

from torch.optim.optimizer import register_optimizer_step_post_hook as _register_step_post_hook  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_pre_hook as _register_step_pre_hook  # noqa: E402

_register_step_post_hook(_apply_stream_plan)
_register_step_pre_hook(_register_stepped_parameters)

# Last: registration reads the functions above (executor()).
_inductor.register_if_inductor_loaded()

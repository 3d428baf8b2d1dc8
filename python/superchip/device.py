"""The device module registered as ``torch.superchip`` (what torch asks of a PrivateUse1 device)."""

from __future__ import annotations

import torch

from . import _C


def _index(device=None) -> int:
    """Device index from None / int / "superchip:1" / torch.device; -1 means the current one."""
    if device is None:
        return -1
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "superchip":
        raise ValueError(f"expected a superchip device, got {device}")
    return -1 if device.index is None else device.index


def is_available() -> bool:
    return _C._device_count() > 0


def device_count() -> int:
    return _C._device_count()


def current_device() -> int:
    return _C._current_device()


def set_device(device) -> None:
    idx = _index(device)
    if idx >= 0:
        _C._set_device(idx)


class device:  # noqa: N801  (mirrors torch.cuda.device)
    """Context manager that makes ``device`` the current superchip device."""

    def __init__(self, device):
        self.idx = _index(device)
        self.prev = -1

    def __enter__(self):
        self.prev = current_device()
        if self.idx >= 0:
            _C._set_device(self.idx)

    def __exit__(self, *exc):
        _C._set_device(self.prev)
        return False


class device_of(device):  # noqa: N801  (mirrors torch.cuda.device_of)
    """Context manager that makes the device of ``obj`` (a tensor or storage) current; a no-op
    for objects not on superchip."""

    def __init__(self, obj):
        on = getattr(obj, "device", None)
        super().__init__(on.index if on is not None and on.type == "superchip" and on.index is not None else -1)


def synchronize(device=None) -> None:
    """Waits for the executor and for every queued optimizer step (the offload engine)."""
    _C._synchronize(_index(device))  # the device guard's synchronizeDevice: the engine too


def _is_in_bad_fork() -> bool:
    """Whether this is a child forked after CUDA was set up in its parent, where CUDA cannot be
    used (torch.manual_seed, which a DataLoader's forked workers call, then leaves the
    device's generators alone, as it does CUDA's). Emulated: never (Note [Fork])."""
    return _C._executor() == "cuda" and torch.cuda._is_in_bad_fork()


def _generator(device=None) -> torch.Generator:
    idx = _index(device)
    return _C._default_generator(current_device() if idx < 0 else idx)


def get_rng_state(device="superchip") -> torch.Tensor:
    return _generator(device).get_state()


def set_rng_state(new_state: torch.Tensor, device="superchip") -> None:
    _generator(device).set_state(new_state)


def get_rng_state_all() -> list:
    return [_C._default_generator(i).get_state() for i in range(device_count())]


def set_rng_state_all(new_states) -> None:
    for i, state in enumerate(new_states):
        _C._default_generator(i).set_state(state)


def manual_seed(seed: int) -> None:
    _generator().manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    for i in range(device_count()):
        _C._default_generator(i).manual_seed(int(seed))


def seed() -> None:
    _generator().seed()


def seed_all() -> None:
    s = _generator().seed()
    for i in range(device_count()):
        _C._default_generator(i).manual_seed(s)


def initial_seed() -> int:
    return _generator().initial_seed()


def get_amp_supported_dtype() -> list:
    return [torch.float16, torch.bfloat16]


def is_bf16_supported() -> bool:
    return True


def memory_allocated(device=None) -> int:
    return _C._memory_stats(_index(device))["hbm.allocated_bytes"]


def max_memory_allocated(device=None) -> int:
    return _C._memory_stats(_index(device))["hbm.peak_allocated_bytes"]


def max_memory_reserved(device=None) -> int:
    return _C._memory_stats(_index(device))["hbm.peak_reserved_bytes"]


def memory_stats(device=None) -> dict:
    """``torch.cuda.memory_stats``'s keys (``"allocated_bytes.all.peak"``, ...: the ``hbm``
    tier, as ``torch.accelerator.memory_stats``) and superchip's per-tier ones
    (``"hbm.allocated_bytes"``, ``"host.allocated_bytes"``, ...: ``superchip.memory_stats()``)."""
    stats = dict(torch.accelerator.memory_stats(_device_of(device)))
    stats.update(_C._memory_stats(_index(device)))
    return stats


def reset_peak_memory_stats(device=None) -> None:
    _C._reset_peak_memory_stats(_index(device))


def reset_max_memory_allocated(device=None) -> None:
    """As ``torch.cuda.reset_max_memory_allocated``: resets every peak (reset_peak_memory_stats)."""
    reset_peak_memory_stats(device)


reset_max_memory_cached = reset_max_memory_allocated


def reset_accumulated_memory_stats(device=None) -> None:
    """As ``torch.cuda.reset_accumulated_memory_stats``: allocation and free counts, errors."""
    torch.accelerator.reset_accumulated_memory_stats(_device_of(device))


def memory_reserved(device=None) -> int:
    return _C._memory_stats(_index(device))["hbm.reserved_bytes"]


def mem_get_info(device=None) -> tuple:
    """(free, total) bytes of ``hbm``: its budget and what it leaves free, or without a budget
    the GPU's (emulated: the machine's) memory; as ``torch.cuda.mem_get_info``."""
    return torch.accelerator.get_memory_info(_device_of(device))


def _machine_room() -> int:
    """Bytes the machine can still give superchip's host-memory blocks: what the kernel says
    this process can take (MemAvailable, its memory cgroup) less the reserve superchip leaves
    the rest of the process (Note [The machine's memory])."""
    figures = _C._host_memory_figures()
    if figures is None:  # the kernel's figures cannot be read: what sysconf says is free
        import os

        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(0, figures["headroom"] - figures["reserve"] - figures["unwritten"])


def _placement_rooms(devices) -> tuple[dict[int, int], int]:
    """What placements on ``devices`` (indices) can still take together in both tiers, per
    device, and what the machine has left beside them.

    Each tier's room is its budget less what it has allocated (its cache is given back on
    demand); a tier without a budget has the machine's room. ``host`` draws on the machine, and
    so does an emulated ``hbm``; the GPU's free memory is the room of an ``hbm`` without a budget
    on the CUDA executor, and draws on nothing else. The machine is counted once (Note [One
    machine under several devices]): its room is shared among the devices that draw on it,
    each taking at most what its tiers can hold and the others an equal share of the rest."""
    machine = _machine_room()
    cuda = _C._executor() == "cuda"
    own, draw = {}, {}
    for idx in devices:
        stats = _C._memory_stats(idx)

        def room(tier: str, unbounded: int) -> int:
            cap = stats[f"{tier}.capacity_bytes"]
            return max(0, cap - stats[f"{tier}.allocated_bytes"]) if cap else unbounded

        host = min(room("host", machine), machine)
        if cuda:
            gpu_free, _ = torch.accelerator.get_memory_info(_device_of(idx))
            own[idx], draw[idx] = room("hbm", gpu_free), host
        else:
            own[idx], draw[idx] = 0, min(room("hbm", machine) + host, machine)
    # Water-filling: the smallest claims are met whole, the rest share what is left evenly.
    rooms, left = {}, machine
    pending = sorted(draw, key=draw.get)
    while pending:
        idx = pending.pop(0)
        take = min(draw[idx], left // (len(pending) + 1))
        rooms[idx] = own[idx] + take
        left -= take
    return {idx: rooms[idx] for idx in devices}, left


def _placement_room(device=None) -> int:
    """Bytes a placement on the device can still take in both tiers (what ``.to("superchip")``
    fills before it fails), the device alone on the machine (``_placement_rooms``)."""
    idx = _index(device)
    idx = current_device() if idx < 0 else idx
    return _placement_rooms([idx])[0][idx]


class _DeviceProperties:
    """What ``get_device_properties`` gives: ``name``, ``total_memory`` (the ``hbm`` budget,
    or the device's memory without one), ``host_memory`` (the ``host`` budget, 0 = none),
    ``executor``; with the CUDA executor every attribute of the GPU's own properties too
    (``major``, ``minor``, ``multi_processor_count``, ...)."""

    def __init__(self, idx: int):
        self.executor = _C._executor()
        self._cuda = torch.cuda.get_device_properties(idx) if self.executor == "cuda" else None
        stats = _C._memory_stats(idx)
        self.total_memory = stats["hbm.capacity_bytes"] or mem_get_info(idx)[1]
        self.host_memory = stats["host.capacity_bytes"]
        self.name = get_device_name(idx)

    def __getattr__(self, name: str):
        cuda = self.__dict__.get("_cuda")
        if cuda is not None:
            return getattr(cuda, name)
        raise AttributeError(f"superchip device properties have no {name!r} with the "
                             f"{self.__dict__.get('executor')} executor")

    def __repr__(self) -> str:
        return (f"_SuperchipDeviceProperties(name={self.name!r}, executor={self.executor!r}, "
                f"total_memory={self.total_memory >> 20}MB, host_memory={self.host_memory >> 20}MB)")


def get_device_properties(device=None) -> _DeviceProperties:
    idx = _index(device)
    return _DeviceProperties(current_device() if idx < 0 else idx)


def get_device_name(device=None) -> str:
    """The device's name: "superchip (<GPU name>)" with the CUDA executor, else
    "superchip (emulated, CPU executor)"."""
    idx = _index(device)
    idx = current_device() if idx < 0 else idx
    _C._memory_stats(idx)  # an index past device_count() raises, as get_device_properties does
    if _C._executor() == "cuda":
        return f"superchip ({torch.cuda.get_device_name(idx)})"
    return "superchip (emulated, CPU executor)"


def get_device_capability(device=None) -> tuple:
    """The GPU's compute capability ``(major, minor)`` with the CUDA executor, as
    ``torch.cuda.get_device_capability``; the CPU executor has none (a RuntimeError)."""
    idx = _index(device)
    idx = current_device() if idx < 0 else idx
    _C._memory_stats(idx)  # an index past device_count() raises
    if _C._executor() != "cuda":
        raise RuntimeError("superchip with the CPU executor (emulated) has no compute capability; "
                           "check torch.superchip.get_device_properties().executor first, or "
                           "torch.superchip.is_bf16_supported() for bfloat16.")
    return torch.cuda.get_device_capability(idx)


# What torch.cuda also offers, for scripts that call them through the device module.
OutOfMemoryError = torch.OutOfMemoryError


def init() -> None:
    """Nothing to do: superchip is set up when it is imported (``torch.cuda.init``'s role)."""


def is_current_stream_capturing() -> bool:
    """Always False: superchip records no graphs (CUDA graphs are not supported)."""
    return False


def memory_cached(device=None) -> int:
    """Deprecated name of ``memory_reserved`` (as in ``torch.cuda``)."""
    return memory_reserved(device)


def max_memory_cached(device=None) -> int:
    """Deprecated name of ``max_memory_reserved`` (as in ``torch.cuda``)."""
    return max_memory_reserved(device)


def memory_summary(device=None, abbreviated: bool = False) -> str:
    """A table of both tiers' statistics (``memory_stats``), one row per figure."""
    stats = memory_stats(device)
    names = sorted({k.split(".", 1)[1] for k in stats if k.startswith(("hbm.", "host."))})
    rows = [f"{'superchip memory':<32}{'hbm':>20}{'host':>20}"]
    for name in names:
        if abbreviated and not name.endswith("bytes"):
            continue
        cells = [stats.get(f"{tier}.{name}") for tier in ("hbm", "host")]
        rows.append(f"{name:<32}" + "".join(f"{'' if c is None else c:>20}" for c in cells))
    return "\n".join(rows)


def empty_cache() -> None:
    # As superchip.empty_cache and torch.accelerator.empty_cache: staged weight copies (and a
    # deleted model's staging arena) too.
    _C._empty_cache()


# Inductor's backend for a PrivateUse1 device is found through the device module:
# torch._inductor.codegen.common.init_backend_registration asks it for "Scheduling" (then for
# "PythonWrapperCodegen", "CppWrapperCodegen" and "WrapperFxCodegen", and registers them when all
# four exist). Resolving "Scheduling" registers superchip's compile support (superchip._inductor)
# on first use, so importing superchip does not import torch._dynamo / torch._inductor. The
# other three names are deliberately absent: superchip's own registration passes its codegen
# config (the FX graph cache key), which torch's registration from the module would drop.
def __getattr__(name: str):
    if name == "Scheduling":
        from . import _inductor
        from ._inductor import codegen

        try:
            _inductor.register()
        except Exception as e:
            # Inductor asks for this inside `except RuntimeError: pass` (init_backend_registration):
            # without a warning the user would only see "unsupported device" later.
            import warnings

            warnings.warn(f"superchip: torch.compile support could not be registered: {e}", stacklevel=2)
            raise
        return codegen.Scheduling
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---- streams and events (what DeviceMesh, FSDP2 and DDP ask of a device module) ----


def is_initialized() -> bool:
    """Whether the runtime is set up; it is as soon as ``superchip`` is imported."""
    return True


def _lazy_init() -> None:
    """torch's lazy device initialization (``device_lazy_init``) calls this at the first
    superchip tensor and only then marks the device initialized; torch versions whose
    ``torch.accelerator.synchronize()`` skips a device not marked so would return at once.
    Nothing is left to set up: the runtime is ready at import."""


def _device_of(device) -> torch.device:
    idx = _index(device)
    return torch.device("superchip", current_device() if idx < 0 else idx)


class Stream(torch.Stream):
    """A superchip stream, as ``torch.cuda.Stream``: ``Stream(device=None, priority=0)``.

    With the CUDA executor it is a CUDA stream of the same index; emulated, kernels run
    synchronously and a stream is an identity (so ``wait_stream``, events and
    ``record_stream`` keep their meaning).
    """

    def __new__(cls, device=None, priority=0, **kwargs):
        if "stream_id" in kwargs:  # re-wrapping an existing stream
            return super().__new__(cls, **kwargs)
        return super().__new__(cls, device=_device_of(device), priority=priority)

    def __init__(self, *args, **kwargs):
        pass


class Event:
    """A superchip event, as ``torch.cuda.Event(enable_timing=False, blocking=False, interprocess=False)``.

    Returns a plain ``torch.Event`` of the superchip device: torch's event methods
    (``elapsed_time``) accept only that exact type, not a subclass.
    """

    def __new__(cls, enable_timing=False, blocking=False, interprocess=False, device=None):
        return torch.Event(device=_device_of(device), enable_timing=enable_timing,
                           blocking=blocking, interprocess=interprocess)


def _wrap(s: torch.Stream) -> Stream:
    return Stream(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)


def current_stream(device=None) -> Stream:
    return _wrap(torch.accelerator.current_stream(_device_of(device)))


def default_stream(device=None) -> Stream:
    d = _device_of(device)
    return Stream(stream_id=0, device_index=d.index,
                  device_type=torch.accelerator.current_stream(d).device_type)


def set_stream(stream: torch.Stream) -> None:
    if stream is not None:
        torch.accelerator.set_stream(stream)


class StreamContext:
    """``with torch.superchip.stream(s):`` makes ``s`` the current stream of its device (and its
    device current); on exit the stream of each device and the current device are back, as with
    ``torch.cuda.stream``."""

    def __init__(self, stream):
        self.stream = stream
        self.src_prev = self.dst_prev = None

    def __enter__(self):
        if self.stream is not None:
            self.src_prev = torch.accelerator.current_stream()  # the current device's
            if self.stream.device != self.src_prev.device:
                self.dst_prev = torch.accelerator.current_stream(self.stream.device)
            torch.accelerator.set_stream(self.stream)  # makes its device current
        return self.stream

    def __exit__(self, *exc):
        if self.src_prev is not None:
            if self.dst_prev is not None:
                torch.accelerator.set_stream(self.dst_prev)
            torch.accelerator.set_stream(self.src_prev)  # and the device from before
            self.src_prev = self.dst_prev = None
        return False


def stream(stream) -> StreamContext:
    if stream is not None and torch.compiler.is_compiling():
        # Dynamo traces a torch.Stream used as a context (the same switch, restored on exit)
        # into the graph's stream annotations; it cannot trace StreamContext's comparisons.
        return stream
    return StreamContext(stream)


# ---- legacy typed storages (torch.cuda.FloatStorage and its kin) ----
# TypedStorage finds a device's legacy classes as torch.<device>.<Name>Storage (storage_type(),
# isinstance(t.storage(), torch.superchip.FloatStorage), the legacy constructors) and takes the
# device from the class's module, whose last part must be the backend's name: without them
# storage_type() of a superchip tensor was None where CUDA's is torch.cuda.FloatStorage (found
# by PyTorch's test_torch on superchip). Quantized dtypes have none, as on CUDA.


class _SuperchipLegacyStorage(torch.storage._LegacyStorage):
    @classmethod
    def from_buffer(cls, *args, **kwargs):
        raise RuntimeError(
            "from_buffer: not available for superchip storage; build a CPU storage from the "
            "buffer and move it with .to('superchip')"
        )

    @classmethod
    def _new_with_weak_ptr(cls, *args, **kwargs):
        raise RuntimeError("_new_with_weak_ptr: not available for superchip storage")

    @classmethod
    def _new_shared_filename(cls, *args, **kwargs):
        raise RuntimeError("_new_shared_filename: not available for superchip storage")


def _legacy_storage_class(name: str, dtype: torch.dtype) -> type:
    from torch._utils import classproperty

    def _dtype(cls):
        return dtype

    def _public_dtype(cls):
        torch.storage._warn_typed_storage_removal()
        return dtype

    return type(
        name,
        (_SuperchipLegacyStorage,),
        {"_dtype": classproperty(_dtype), "dtype": classproperty(_public_dtype), "__module__": "torch.superchip"},
    )


_QUANTIZED = {torch.qint8, torch.qint32, torch.quint8, torch.quint4x2, torch.quint2x4}
for _dt, _name in torch.storage._dtype_to_storage_type_map().items():
    if _dt not in _QUANTIZED:
        globals()[_name] = _legacy_storage_class(_name, _dt)
del _dt, _name

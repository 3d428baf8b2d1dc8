"""superchip: a PyTorch device whose tensors live in GPU memory (hbm) and host memory (host).

    import superchip
    model = build_model().to("superchip")

Importing the package registers the ``superchip`` device (PyTorch's PrivateUse1 key), its
device module ``torch.superchip`` and the generated ``Tensor.superchip()`` /
``Module.superchip()`` / storage methods. The functions below are the public memory API.
"""

from __future__ import annotations

import torch

if torch._C._get_privateuse1_backend_name() not in ("privateuseone", "superchip"):
    raise ImportError(
        "superchip: the PrivateUse1 device is already registered as "
        f"'{torch._C._get_privateuse1_backend_name()}' by another package; only one "
        "out-of-tree device can be loaded per process."
    )

from . import _C  # noqa: E402  (registers allocator, hooks, guard and kernels)
from . import device as _device_module  # noqa: E402

_C._init()

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
from . import optim  # noqa: E402,F401
from . import _inductor  # noqa: E402  (torch.compile support, registered on first use)
from . import distributed  # noqa: E402,F401  (registers the sccl c10d backend)

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


def tier_of(tensor: torch.Tensor) -> str:
    """The tier (``"hbm"`` or ``"host"``) holding the bytes of a superchip tensor."""
    return _C._tier_of(tensor)


def move_to_tier(tensor: torch.Tensor, tier: str) -> torch.Tensor:
    """Moves the storage of ``tensor`` to ``tier`` in place and returns ``tensor``.

    Every view of the storage, module parameter and optimizer reference follows; the tensor
    object stays the same. On error (e.g. the tier is full) nothing changes.
    """
    _C._move_to_tier(tensor, tier)
    return tensor


def empty_cache() -> None:
    """Returns the cached, unused blocks of every tier to the system."""
    _C._empty_cache()


def reset_peak_memory_stats(device=None) -> None:
    """Sets every tier's peak statistics to its current value."""
    _C._reset_peak_memory_stats(_index(device))


def set_capacity(tier: str, nbytes: int, device=None) -> None:
    """Changes a tier's budget in bytes (0 = unlimited); it cannot go below the bytes in use."""
    if tier not in _TIERS:
        raise ValueError(f"tier must be 'hbm' or 'host', got {tier!r}")
    _C._set_capacity(_index(device), tier, int(nbytes))


# Last: registration reads the functions above (executor()).
_inductor.register_if_inductor_loaded()

"""torch.compile on superchip: Dynamo's device interface and Inductor's backend for the device.

Contract
--------
- ``torch.compile(model)`` (Inductor, every mode that works on the executor's own device, and
  ``fullgraph=True``) compiles graphs whose tensors are on ``superchip``. Nothing to call:
  registration happens the first time Inductor sets up its backends (torch asks the device
  module ``torch.superchip`` for ``Scheduling``; see ``superchip.device.__getattr__``), or at
  ``import superchip`` when Dynamo or Inductor was already imported. Importing superchip never
  imports ``torch._dynamo``.
- Inductor's FX graph cache is keyed on superchip's code generator too (``config.py``).
- Generated code is the executor's: with the CPU executor, Inductor's C++/OpenMP kernels
  (``CppScheduling``) read and write superchip memory directly through ``data_ptr()`` (host
  memory); with the CUDA executor, Triton kernels do the same on CUDA memory (untested: no GPU
  in CI). Ops Inductor does not generate (matmuls, attention, fallbacks) are called on
  superchip tensors and go through superchip's own dispatch, as in eager mode.
- Every buffer the compiled graph allocates is a superchip tensor allocated by superchip's
  allocator (``empty_strided(..., device="superchip:i")``), so ``superchip.memory_stats()`` counts
  compiled graphs exactly as eager ones.
- Not supported: ``cpp_wrapper=True`` / AOTInductor (an error says so), CUDA graphs
  (``mode="reduce-overhead"``/``"max-autotune"`` with the CUDA executor are untested).

Where Inductor decides code-generation semantics by ``device.type == "cpu"`` rather than by the
device's registered backend, superchip is treated as its executor: see ``patches.py``
(torch-version guarded; Note [Why superchip patches Inductor]) for the places patched and why.
The fake-tensor and tracing rules among them are patched at ``import superchip``, the rest when
Inductor registers the device; Dynamo's device interface is registered when Dynamo loads.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_registered = False


def register() -> None:
    """Registers the Dynamo device interface and the Inductor backend for ``superchip``.

    Idempotent and thread-safe; imports ``torch._dynamo`` and ``torch._inductor``.
    """
    global _registered
    with _lock:
        if _registered:
            return
        from torch._dynamo.device_interface import register_interface_for_device
        from torch._inductor.codegen.common import (
            get_device_op_overrides,
            register_backend_for_device,
            register_device_op_overrides,
        )

        from . import codegen, config, patches
        from .device_interface import SuperchipInterface

        # First: its version check raises before anything is registered (nothing half-done).
        patches.apply()
        register_interface_for_device("superchip", SuperchipInterface)
        # torch 2.11 loads its built-in device op overrides (cpu, cuda, ...) only while its table
        # is empty: registering superchip's first would leave "cuda" with the CPU's no-op ones.
        get_device_op_overrides("cpu")
        register_device_op_overrides("superchip", codegen.device_op_overrides())
        register_backend_for_device(
            "superchip",
            codegen.Scheduling,
            codegen.PythonWrapperCodegen,
            codegen.CppWrapperCodegen,
            codegen.WrapperFxCodegen,
            device_custom_config=config,
        )
        _registered = True


def register_if_inductor_loaded() -> None:
    """Registers now when Dynamo or Inductor is already imported: Inductor may have set up its
    backends already (it asks the device module only once). Otherwise the device interface is
    registered when Dynamo loads (Note [Why superchip patches Inductor], point 11), its guard
    descriptions patched when its guards load (point 15), and the rest on first use.
    Fake-tensor and tracing rules are patched now (points 5, 6, 10 and 12)."""
    import sys

    from . import patches

    patches.apply_fake_rules()
    if "torch._inductor.codegen.common" in sys.modules or "torch._dynamo" in sys.modules:
        register()
    else:
        register_interface_when_dynamo_loads()


def _register_interface() -> None:
    from torch._dynamo.device_interface import register_interface_for_device

    from .device_interface import SuperchipInterface

    register_interface_for_device("superchip", SuperchipInterface)


def _patch_guards() -> None:
    from . import patches

    patches.patch_guard_repr()


def register_interface_when_dynamo_loads() -> None:
    from .._after_import import after_import

    # Point 11: before Dynamo reads its registry (it builds its handlers of
    # ``torch.<device>.stream`` once, at its first trace).
    after_import("torch._dynamo.device_interface", _register_interface,
                 "Dynamo's device interface could not be registered")
    # Point 15: before the first guard is built, whatever the backend.
    after_import("torch._dynamo.guards", _patch_guards, "Dynamo's guard descriptions could not be patched")

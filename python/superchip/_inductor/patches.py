"""The places where Inductor chooses code-generation semantics by device *type*.

Note [Why superchip patches Inductor]
Inductor picks a device's kernels through its registered Scheduling, but a few decisions
still compare the device type with a fixed list instead of asking the registration:

1. ``torch._inductor.utils.get_current_backend(device_type)`` answers "cpp" only for
   ``"cpu"`` and ``config.cuda_backend`` ("triton") for any other type. The kernel code
   generator reads it while it generates a kernel (``CSEProxy`` propagates dtypes the C++ way
   only when it says "cpp"); a C++ kernel generated with the Triton answer loses the dtypes of
   indirect indices and fails (``assert var.dtype is not None`` in ``CppKernel``).
2. ``torch._inductor.scheduler.BaseSchedulerNode.is_cpu()`` is ``device.type == "cpu"``. The
   scheduler uses it to keep loop reordering, loop inversion and pointwise reindexing (which
   only the Triton path supports) away from C++ kernels; without it fusion of a superchip
   reduction fails (``TypeError: can't multiply sequence`` in
   ``_try_reindex_pointwise_for_reduction``).
3. (CUDA executor only, untested: no GPU in CI) ``DeviceProperties.create(device)`` records
   ``device.type`` as the target Triton compiles for (``GPUTarget``), and Triton knows no
   "superchip" target. Superchip devices get CUDA device i's properties record instead.
4. ``torch._inductor.ir.is_cpu(node)`` picks the realization thresholds (when a pointwise
   result reused by several consumers, or one with many reads or a large inner function, is
   stored instead of recomputed in each consumer): the CPU's or the GPU's. With the CPU
   executor superchip got the GPU's: rotary-embedding cos/sin recomputed inside each consumer
   kernel, other kernel groupings, so autocast-fp16 training differed from compiled CPU in the
   last bits from the first step (seen by a user-flow probe). It answers as for the executor.
   Only a heuristic: where a torch lacks the function, nothing is patched.

The first three answer about the code generator and the fourth picks a heuristic, so for
superchip they should answer as for its executor (``"cpu"`` or ``"cuda"``); the patches below
do exactly that and nothing for other devices.
``get_current_backend`` is imported by name into three modules besides its own, hence four
rebinds.

Other ``device.type == "cpu"`` checks in Inductor are heuristics, and superchip takes their
non-CPU side, which generates correct code that is not always the CPU's: reductions of at most
``config.cpp.use_two_step_variance_threshold`` elements (LayerNorm statistics) use Welford
instead of sum-then-divide, a division by a constant becomes a multiplication by its
reciprocal (CPU keeps the division, pytorch#157959), tiny-matmul decompositions follow the
GPU defaults, and max-autotune has no C++ GEMM template (ATen's mm
only). For the example GPT at the demo's size the generated code has the CPU's kernels,
extern calls and allocations; the LayerNorm kernels differ as above, so results may differ
from compiled CPU in the last bits. Matching those too would take copies of Inductor's
lowering logic, so they are left as they are.

Tested on torch 2.13; the checked range is the one superchip supports (2.11 to 2.13). Outside
it, or when a patched name is missing, ``apply()`` raises instead of guessing.
"""

from __future__ import annotations

import importlib

import torch

import superchip

_SUPPORTED = ((2, 11), (2, 13))
_applied = False


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def executor_type(device_type: str) -> str:
    """The device type whose code generation a device type gets: superchip's executor's."""
    return superchip.executor() if device_type == "superchip" else device_type


def apply() -> None:
    global _applied
    if _applied:
        return
    version = _torch_version()
    if not (_SUPPORTED[0] <= version <= _SUPPORTED[1]):
        raise RuntimeError(
            f"superchip: torch.compile support is written for torch "
            f"{_SUPPORTED[0][0]}.{_SUPPORTED[0][1]} to {_SUPPORTED[1][0]}.{_SUPPORTED[1][1]}; "
            f"torch {torch.__version__} needs the patches in superchip/_inductor/patches.py "
            "checked again."
        )
    _patch_get_current_backend()
    _patch_is_cpu()
    _patch_ir_is_cpu()
    if superchip.executor() == "cuda":
        _patch_device_properties()
    _applied = True


def _patch_get_current_backend() -> None:
    from torch._inductor import utils

    original = utils.get_current_backend

    def get_current_backend(device_type: str | None = None) -> str:
        if not device_type:
            from torch._inductor.virtualized import V

            device_type = V.graph.get_current_device_or_throw().type
        return original(executor_type(device_type))

    get_current_backend.__wrapped__ = original  # type: ignore[attr-defined]
    for name in ("torch._inductor.utils", "torch._inductor.codegen.common",
                 "torch._inductor.scheduler", "torch._inductor.kernel.mm_common"):
        module = importlib.import_module(name)
        if getattr(module, "get_current_backend", None) is not original:
            raise RuntimeError(f"superchip: {name}.get_current_backend is not the one "
                               "superchip's patch expects; check superchip/_inductor/patches.py")
        module.get_current_backend = get_current_backend


def _patch_is_cpu() -> None:
    from torch._inductor.scheduler import BaseSchedulerNode

    original = BaseSchedulerNode.is_cpu

    def is_cpu(self) -> bool:
        device = self.get_device()
        if device is not None and device.type == "superchip":
            return not superchip.executor() == "cuda"
        return original(self)

    is_cpu.__wrapped__ = original  # type: ignore[attr-defined]
    BaseSchedulerNode.is_cpu = is_cpu


def _patch_ir_is_cpu() -> None:
    from torch._inductor import ir

    original = getattr(ir, "is_cpu", None)
    get_device_type = getattr(ir, "get_device_type", None)
    if original is None or get_device_type is None:
        return  # a heuristic only (point 4 above): without it, the GPU's thresholds

    def is_cpu(x) -> bool:
        device_type = get_device_type(x)
        return executor_type(device_type) == "cpu" if device_type == "superchip" else original(x)

    is_cpu.__wrapped__ = original  # type: ignore[attr-defined]
    ir.is_cpu = is_cpu


def _patch_device_properties() -> None:
    from torch._inductor.runtime.hints import DeviceProperties

    original = DeviceProperties.create  # a cached classmethod, bound to DeviceProperties

    def create(cls, device):
        if device.type == "superchip":
            index = torch.superchip.current_device() if device.index is None else device.index
            device = torch.device("cuda", index)
        return original(device)

    DeviceProperties.create = classmethod(create)

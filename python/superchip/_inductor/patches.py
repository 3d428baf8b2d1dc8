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
5. Activation checkpointing under compile (``torch.utils.checkpoint``, HF's
   ``gradient_checkpointing_enable()``) wraps each random op of a recomputed region (dropout,
   and SDPA, whose dropout argument makes it one) in the higher-order ops
   ``run_and_save_rng_state`` / ``run_with_rng_state`` (torch/_prims/rng_prims.py), so the
   recomputation draws the same numbers. Their device choice is a fixed map (cpu, cuda, hpu,
   xpu) and anything else fails: ``AssertionError: Backend not supported for superchip``
   (seen by a user-flow probe: compiled HF Llama with gradient checkpointing). Superchip's
   default generator is its executor's (backend/runtime/SuperchipGenerator.h), so for
   superchip tensors these ops save and restore ``torch.superchip``'s RNG state, in the
   backend choice, the fake-tensor rule and a PrivateUse1 kernel; other devices keep theirs.
   Where a torch lacks these names, nothing is patched (that error stays).
6. The fake-tensor rule of convolution (torch/_subclasses/fake_impls.py) predicts the layout of
   its output from ``torch._C._select_conv_backend`` on the fake inputs: for a superchip
   device that is ``Overrideable``, whose layout is contiguous, where the executor's kernel
   (oneDNN on the CPU, cuDNN on CUDA) returns channels_last for a channels_last input or
   weight. Compiled graphs then failed their stride check (``assert_size_stride``:
   ``expected size 32==32, stride 1==256``) at every conv net Inductor's layout optimization
   made channels_last (a conv net under ``no_grad``) and at every channels_last conv net
   trained compiled (found by review). The two functions answer for superchip fake tensors as
   for the same fake tensors on the executor's device.
7. The scheduler flushes the pending kernels of a device before an extern call only for a
   node that has a device. Event and stream ops (``torch.ops.streams.record_event``, which a
   compiled region's ``torch.Event.record()`` becomes, or compiled autograd tracing a gradient
   hook that records one) have none, and the C++ backend holds its kernels until a flush: the
   event's call was written first, then the frees of the kernel's inputs, then the kernel
   (``UnboundLocalError: arg0_1``, found by review). For superchip graphs the scheduler now
   flushes before such a call too. CUDA's and CPU's graphs are untouched (Triton kernels are
   written at once, and the CPU has no events).

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
    _patch_rng_state_ops()
    _patch_conv_layout()
    _patch_flush_before_deviceless_extern()
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


def _patch_flush_before_deviceless_extern() -> None:
    from torch._inductor.scheduler import Scheduler

    original = Scheduler.codegen_extern_call

    def codegen_extern_call(self, scheduler_node) -> None:
        current = self.current_device
        if current is not None and current.type == "superchip" and scheduler_node.get_device() is None:
            self.flush()
        original(self, scheduler_node)

    codegen_extern_call.__wrapped__ = original  # type: ignore[attr-defined]
    Scheduler.codegen_extern_call = codegen_extern_call


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


def _patch_conv_layout() -> None:
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

    def on_executor(t):
        """A superchip fake tensor as the same fake tensor on the executor's device."""
        if not isinstance(t, FakeTensor) or t.fake_device.type != "superchip":
            return t
        index = t.fake_device.index
        device = torch.device("cpu") if superchip.executor() == "cpu" else torch.device("cuda", index or 0)
        with unset_fake_temporarily():
            meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        return FakeTensor(t.fake_mode, meta, device)

    def answering_for_the_executor(original):
        def wrapper(*args, **kwargs):
            return original(*[on_executor(a) for a in args], **{k: on_executor(v) for k, v in kwargs.items()})

        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        wrapper.__name__ = original.__name__
        return wrapper

    for name in ("_select_conv_backend", "_conv_determine_backend_memory_format"):
        original = getattr(torch._C, name, None)
        if original is None:
            raise RuntimeError(f"superchip: torch._C.{name} is missing; check superchip/_inductor/patches.py")
        setattr(torch._C, name, answering_for_the_executor(original))


def _superchip_device(args, kwargs):
    """The superchip device of a random op's arguments (as rng_prims.get_device finds it), or None."""
    device = kwargs.get("device")
    if device is not None:
        device = torch.device(device)
    else:
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    return device if device is not None and device.type == "superchip" else None


def _patch_rng_state_ops() -> None:
    try:
        from torch._C import DispatchKey
        from torch._higher_order_ops.utils import registered_hop_fake_fns
        from torch._prims import rng_prims

        save, replay = rng_prims.run_and_save_rng_state, rng_prims.run_with_rng_state
        kernels = (save.py_kernels, replay.py_kernels)
        if any(DispatchKey.BackendSelect not in k for k in kernels) or save not in registered_hop_fake_fns:
            return
    except (ImportError, AttributeError):
        return  # point 5 above: nothing patched

    def save_state(op, *args, **kwargs):
        device = _superchip_device(args, kwargs)
        return torch.superchip.get_rng_state(device), op(*args, **kwargs)

    def with_state(rng_state, op, *args, **kwargs):
        device = _superchip_device(args, kwargs)
        current = torch.superchip.get_rng_state(device)
        torch.superchip.set_rng_state(rng_state.cpu(), device)
        try:
            return op(*args, **kwargs)
        finally:
            torch.superchip.set_rng_state(current, device)

    def routed(original, ours, lead):
        # lead: the arguments before the random op (run_with_rng_state's state).
        def select(*args, **kwargs):
            if _superchip_device(args[lead + 1:], kwargs) is not None:
                return ours(*args, **kwargs)
            return original(*args, **kwargs)

        select.__wrapped__ = original  # type: ignore[attr-defined]
        return select

    for hop, ours, lead in ((save, save_state, 0), (replay, with_state, 1)):
        hop.py_kernels[DispatchKey.BackendSelect] = routed(hop.py_kernels[DispatchKey.BackendSelect], ours, lead)
        if DispatchKey.PrivateUse1 not in hop.py_kernels:
            hop.py_impl(DispatchKey.PrivateUse1)(ours)
        getattr(hop, "_dispatch_cache", {}).clear()
    # run_and_save_rng_state's fake rule calls the original backend choice directly.
    registered_hop_fake_fns[save] = routed(registered_hop_fake_fns[save], save_state, 0)

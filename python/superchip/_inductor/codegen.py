"""What Inductor generates for superchip: kernel scheduling, the Python wrapper, device ops.

The kernels are the executor's own (chosen once, at import, from ``superchip.executor()``,
which is fixed for the process): ``CppScheduling`` (C++/OpenMP) on the CPU executor,
``CUDACombinedScheduling`` (Triton) on the CUDA executor. The wrapper is Inductor's Python
wrapper with two differences: it calls C++ kernels on superchip buffers the way it calls them
on CPU buffers (a plain function call with the tensors, whose ``data_ptr()`` the binding
reads), and it allocates buffers with ``empty_strided(..., device="superchip:i")``, i.e.
through superchip's allocator (Inductor's generic path for a device without a fast
allocator), naming the buffer's device.
Device guards, streams and synchronisation in the wrapper are ``torch.superchip``'s (every
superchip graph runs under a device guard: Note [Why superchip patches Inductor], point 8).
"""

from __future__ import annotations

from textwrap import dedent

import torch
from torch._inductor.codegen.common import DeviceOpOverrides
from torch._inductor.codegen.wrapper import (
    PythonWrapperCodegen as _PythonWrapperCodegen,
    SubgraphPythonWrapperCodegen as _SubgraphPythonWrapperCodegen,
)
from torch._inductor.codegen.wrapper_fxir import WrapperFxCodegen  # noqa: F401  (registered as is)

import superchip

ON_CUDA = superchip.executor() == "cuda"

if ON_CUDA:
    from torch._inductor.codegen.cuda.device_op_overrides import CUDADeviceOpOverrides
    from torch._inductor.codegen.cuda_combined_scheduling import (
        CUDACombinedScheduling as Scheduling,
    )
else:
    from torch._inductor.codegen.cpp import CppScheduling as Scheduling  # noqa: F401


# ---- device ops written into the wrapper ----------------------------------------------------

class _SuperchipDeviceOps:
    """Device management through torch.superchip (its guard also sets the executor's device)."""

    def set_device(self, device_idx: int) -> str:
        return f"torch.superchip.set_device({device_idx})"

    def synchronize(self) -> str:
        return "torch.superchip.synchronize()"

    def device_guard(self, device_idx: int) -> str:
        return f"torch.superchip.device({device_idx})"

    def current_stream(self) -> str:  # a graph's default stream, beside the user's streams
        return "torch.superchip.current_stream()"


class CpuExecutorDeviceOpOverrides(_SuperchipDeviceOps, DeviceOpOverrides):
    """C++ kernels run on the calling thread: there is no stream to pass."""

    def import_get_raw_stream_as(self, name: str) -> str:
        return dedent(
            f"""
            def {name}(_):
                return 0
            """
        )

    def cpp_kernel_type(self) -> str:
        return "void*"


if ON_CUDA:

    class CudaExecutorDeviceOpOverrides(_SuperchipDeviceOps, CUDADeviceOpOverrides):
        """Triton kernels launch on the current CUDA stream of CUDA device i (superchip:i's)."""


def device_op_overrides() -> DeviceOpOverrides:
    return CudaExecutorDeviceOpOverrides() if ON_CUDA else CpuExecutorDeviceOpOverrides()


# ---- the Python wrapper -----------------------------------------------------------------------

class _SuperchipWrapper:
    """What the Python wrapper writes differently for superchip buffers.

    - C++ kernel calls are written as on CPU buffers. PythonWrapperCodegen writes a C++ kernel
      call only for ``device.type == "cpu"`` (or mps) and raises "device superchip nyi"
      otherwise; the call itself (the kernel's Python binding with the tensors as arguments) is
      the same, since the binding reads ``data_ptr()``, which is host memory on the CPU executor.
    - Allocations name the device index. Inductor's generic allocation writes
      ``device='superchip'`` (the current device) and relies on the device guard around the
      kernels of another device (which the scheduler emits for superchip only with the patch,
      point 8); naming the index keeps them where they belong without it too.
    """

    def make_allocation(self, name, device, dtype, shape, stride, allocation_shape=None,
                        is_pinned=False):
        line = super().make_allocation(name, device, dtype, shape, stride, allocation_shape,
                                       is_pinned)
        if device.type == "superchip" and device.index is not None:
            line = line.replace("device='superchip'", f"device='superchip:{device.index}'", 1)
        return line

    def write_args(self, input_names):
        super().write_args(input_names)
        # Kernels read data_ptr() directly: an optimizer step still pending on an input (the
        # offload engine, backend/engine/) must finish first, as the dispatcher ensures for
        # eager operators. One call; it returns at once when nothing is pending.
        self.prefix.writeline(f"__import__('superchip')._C._engine_wait_inputs({', '.join(input_names)})")

    def _generate_kernel_call_helper(self, kernel_name, call_args, *, device=None, triton=True,
                                     **kwargs):
        from torch._inductor.virtualized import V

        device = device or V.graph.get_current_device_or_throw()
        if not triton and device.type == "superchip" and not ON_CUDA:
            device = torch.device("cpu")
        super()._generate_kernel_call_helper(kernel_name, call_args, device=device,
                                             triton=triton, **kwargs)


class SubgraphPythonWrapperCodegen(_SuperchipWrapper, _SubgraphPythonWrapperCodegen):
    pass


class PythonWrapperCodegen(_SuperchipWrapper, _PythonWrapperCodegen):
    @staticmethod
    def create(is_subgraph, subgraph_name, parent_wrapper, partition_signatures=None):
        if is_subgraph:
            return SubgraphPythonWrapperCodegen(subgraph_name, parent_wrapper,
                                                partition_signatures)
        return PythonWrapperCodegen()


class CppWrapperCodegen(_PythonWrapperCodegen):
    """Placeholder for ``cpp_wrapper=True`` / AOTInductor, which superchip does not support."""

    @staticmethod
    def create(*args, **kwargs):
        raise NotImplementedError(
            "superchip: torch._inductor.config.cpp_wrapper and AOTInductor are not supported on "
            "the superchip device. torch.compile: use the default Python wrapper "
            "(torch._inductor.config.cpp_wrapper = False). AOTInductor "
            "(aoti_compile_and_package): export and package the model on the device it will "
            f"run on without superchip ('{superchip.executor()}': model.to('{superchip.executor()}') "
            "before torch.export)."
        )

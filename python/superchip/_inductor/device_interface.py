"""Dynamo's runtime interface for the superchip device (``torch._dynamo.device_interface``).

Inductor asks it for the current device, synchronisation, streams, the device properties it
sizes kernels with and the compute capability it keys its caches on. Device management is
superchip's own (``torch.superchip``); properties and capability are the executor's: the host
CPU's core count on the CPU executor, CUDA device ``i``'s properties on the CUDA executor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._dynamo.device_interface import CpuInterface, CudaInterface, DeviceInterface

import superchip


def _on_cuda() -> bool:
    return superchip.executor() == "cuda"


def _index(device) -> int:
    idx = superchip.device._index(device)
    return torch.superchip.current_device() if idx < 0 else idx


class SuperchipInterface(DeviceInterface):
    device = superchip.device.device

    class Event(torch.Event):  # Dynamo requires torch.Event subclasses
        pass

    class Stream(torch.Stream):
        pass

    class Worker:
        """What compile workers may ask without touching the device (recorded in this process)."""

        @staticmethod
        def set_device(device: int) -> None:
            torch.superchip.set_device(device)

        @staticmethod
        def current_device() -> int:
            return torch.superchip.current_device()

        @staticmethod
        def get_device_properties(device: torch.types.Device = None) -> Any:
            if _on_cuda():
                return torch.cuda.get_device_properties(_index(device))
            return CpuInterface.Worker.get_device_properties(device)

    @staticmethod
    def current_device() -> int:
        return torch.superchip.current_device()

    @staticmethod
    def set_device(device: torch.types.Device) -> None:
        torch.superchip.set_device(device)

    @staticmethod
    def exchange_device(device: int) -> int:
        prev = torch.superchip.current_device()
        if device >= 0 and device != prev:
            torch.superchip.set_device(device)
        return prev

    maybe_exchange_device = exchange_device

    @staticmethod
    def device_count() -> int:
        return torch.superchip.device_count()

    @staticmethod
    def is_available() -> bool:
        return torch.superchip.is_available()

    # torch.superchip.stream itself, as CudaInterface's is torch.cuda.stream: a context for a
    # stream or None (the stream itself was no context for None).
    stream = staticmethod(superchip.device.stream)

    @staticmethod
    def current_stream() -> torch.Stream:
        return torch.accelerator.current_stream()

    @staticmethod
    def set_stream(stream: torch.Stream) -> None:
        torch.accelerator.set_stream(stream)

    @staticmethod
    def get_raw_stream(device_idx: int) -> int:
        if _on_cuda():
            return torch._C._cuda_getCurrentRawStream(device_idx)
        return 0

    @staticmethod
    def synchronize(device: torch.types.Device = None) -> None:
        torch.superchip.synchronize(device)

    @staticmethod
    def get_compute_capability(device: torch.types.Device = None) -> Any:
        if _on_cuda():
            return CudaInterface.get_compute_capability(_index(device))
        return CpuInterface.get_compute_capability(device)

    @staticmethod
    def is_bf16_supported(including_emulation: bool = False) -> bool:
        return torch.superchip.is_bf16_supported()

    @staticmethod
    def memory_allocated(device: torch.types.Device = None) -> int:
        return torch.superchip.memory_allocated(device)

    @staticmethod
    def is_triton_capable(device: torch.types.Device = None) -> bool:
        return _on_cuda()

    @staticmethod
    def raise_if_triton_unavailable(device: torch.types.Device = None) -> None:
        if not _on_cuda():
            raise RuntimeError("superchip generates Triton kernels only with the CUDA executor")
        CudaInterface.raise_if_triton_unavailable(device)

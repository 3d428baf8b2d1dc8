"""Superchip's Inductor code-generation config, registered with the backend.

Inductor keys its FX graph cache on each device's registered config, not on the code of the
device's code generator; ``codegen_version`` (a hash of the ``superchip/_inductor`` sources and
of superchip's compiled extension) makes the key change with superchip's generator and with its
kernels, so a graph compiled and cached by another version of it is never reused; it also
holds the executor and the flash-entry emulation the graph was traced for. The extension
counts because AOTAutograd traces superchip's own kernels (dropout with the CPU executor: Note
[Dropout on the CPU executor]): with the Python sources alone in the key, a graph traced before
a change of those kernels was reused after it (a stale cache hid a test failure for a day).
"""

# No ``from __future__ import annotations`` here: install_config_module takes every module
# attribute that is not a module or a function for a config entry.
import hashlib
import os
import pathlib
import sys

from torch.utils._config_module import install_config_module


def _sources_hash() -> str:
    digest = hashlib.sha256()
    here = pathlib.Path(__file__).parent
    for path in sorted(here.glob("*.py")) + sorted(here.parent.glob("_C*.so")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())  # the extension: about 5 MB, 10 ms, once per process
    # And what this process's superchip traces and generates for: the executor (C++ kernels
    # over host memory, or Triton over GPU memory, for one graph of "superchip" tensors) and
    # the emulation of CUDA's flash entry (which attention ops a graph traces to). Without them
    # a graph compiled under one was reused under the other: a test of the emulated flash entry
    # got the cached math-attention graph of an earlier process (found by running the suite on
    # torch 2.11), and a graph cached under the CPU executor would have run its C++ kernels on
    # GPU memory under the CUDA executor.
    from superchip import _C

    digest.update(f"executor={_C._executor()}".encode())
    digest.update(f"emulate_cuda_flash={os.environ.get('SUPERCHIP_EMULATE_CUDA_FLASH', '')}".encode())
    return digest.hexdigest()[:16]


codegen_version: str = _sources_hash()

install_config_module(sys.modules[__name__])

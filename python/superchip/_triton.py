"""Triton kernels a user or a library launches themselves wait for superchip's pending work.

Contract
--------
- A Triton kernel launched eagerly (``kernel[grid](...)``, ``torch.library.triton_op`` or
  ``wrap_triton`` outside a compiled graph, the autotuner and heuristics around them: every
  ``triton.runtime.jit.JITFunction.run``) first waits, for each superchip tensor among its
  arguments, for the offload engine's pending jobs on that tensor, a speculation on it rolled
  back, as a forwarded operator does (Note [Triton kernels read data_ptr()]). A launch
  without superchip tensors is unchanged.
- A superchip argument with a staged copy in ``hbm`` (a streamed weight) counts as written:
  the kernel may write it in place, past the forwarding layer.
- Applied when ``triton.runtime.jit`` is imported, before or after superchip.
- Not covered: a kernel launched without ``JITFunction.run`` (a ``CompiledKernel`` run by
  hand). Graphs compiled by ``torch.compile`` wait in their generated wrapper
  (``_inductor/codegen.py``), not here.
"""

from __future__ import annotations

import torch

from . import _C
from ._after_import import wrapping

# Note [Triton kernels read data_ptr()]
# A forwarded operator waits for the offload engine's jobs on its operands (an asynchronous
# step still writing a parameter, a speculation to roll back) before the executor's kernel
# reads them (backend/engine/OffloadEngine.h). A Triton kernel launched by hand takes its
# tensors' data_ptr() and never passes the dispatcher: Liger's RMSNorm reads its weight that
# way, Unsloth's kernels too, on the CUDA executor. Right after step() such a kernel would read
# a parameter the CPU is still stepping, and between backward() and step() a speculative one:
# other bits than the plain step, silently. Compiled graphs had the same hazard and wait in
# their wrapper; eager launches now wait in JITFunction.run, through the same call.


def _patch_jit() -> None:
    from triton.runtime import jit

    run = jit.JITFunction.run
    if getattr(run, "_superchip", False):
        return

    def run_after_pending_work(self, *args, **kwargs):
        operands = [a for a in (*args, *kwargs.values())
                    if isinstance(a, torch.Tensor) and a.device.type == "superchip"]
        if operands:
            _C._engine_wait_inputs(*operands)
        return run(self, *args, **kwargs)

    jit.JITFunction.run = wrapping(run_after_pending_work, run)


def install() -> None:
    from ._after_import import after_import

    after_import("triton.runtime.jit", _patch_jit,
                 "Triton kernels launched by hand could not wait for the offload engine")

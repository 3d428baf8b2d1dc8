"""One tolerance table per dtype, used by every superchip conformance test.

With the CPU executor a superchip kernel *is* the CPU kernel over the same bytes, so most
results are bitwise equal to CPU; the table leaves room only for reductions whose order
differs (foreach vs per-tensor paths, CUDA executor vs CPU reference).
"""

from __future__ import annotations

import torch

# dtype -> (rtol, atol)
TOLERANCES = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1.3e-6, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float16: (1e-3, 1e-5),
    torch.complex64: (1.3e-6, 1e-5),
    torch.complex128: (1e-7, 1e-7),
}

# Looser table for the OpInfo sweep: it mixes every op of op_db, including iterative
# decompositions (linalg) whose CPU and superchip runs may take different code paths.
SWEEP_TOLERANCES = {
    torch.float64: (1e-6, 1e-6),
    torch.float32: (1e-4, 1e-4),
    torch.bfloat16: (1.6e-2, 1e-3),
    torch.float16: (1e-3, 1e-3),
    torch.complex64: (1e-4, 1e-4),
    torch.complex128: (1e-6, 1e-6),
}


def tol(dtype: torch.dtype, table=TOLERANCES) -> dict:
    """``rtol``/``atol`` keyword arguments for ``torch.testing.assert_close`` at ``dtype``."""
    rtol, atol = table.get(dtype, (0.0, 0.0))  # integer / bool: exact
    return {"rtol": rtol, "atol": atol}

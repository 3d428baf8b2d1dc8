"""torch.distributed on superchip tensors: the ``sccl`` backend and what builds on it.

Importing ``superchip`` registers the c10d backend ``sccl`` for the ``superchip`` device (and
cpu), so that::

    dist.init_process_group()                           # cpu:gloo,superchip:sccl
    dist.init_process_group("cpu:gloo,superchip:sccl")  # the same, spelled out
    dist.init_process_group("sccl")                     # sccl serves cpu tensors too

give groups on which every collective, DDP, FSDP2 (``fully_shard`` over a ``superchip``
DeviceMesh), DTensor and the functional collectives run on superchip tensors. ``sccl`` owns
no transport: it aliases superchip tensors as executor tensors and hands them to an inner
group that torch builds (Gloo with the CPU executor, NCCL with the CUDA executor; see
backend/distributed/ProcessGroupSccl.h).

Also here: ``ulysses_attention`` (sequence parallelism by all-to-all), and the helpers that
let ``superchip.optim`` step FSDP2's sharded (DTensor) parameters.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from . import _C

__all__ = ["BACKEND", "DEFAULT_BACKEND", "is_sccl_group", "inner_group_backend", "ulysses_attention",
           "local_shard", "host_tier_bytes"]

BACKEND = "sccl"
DEFAULT_BACKEND = "cpu:gloo,superchip:sccl"


# ---- the sccl backend ----

def _create_sccl(dist_opts, backend_options):
    """c10d creator (extended API): builds the inner group, then the sccl backend around it."""
    from torch.distributed import PrefixStore

    rank, size = dist_opts.group_rank, dist_opts.group_size
    timeout = dist_opts.timeout
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    store = PrefixStore("sccl/", dist_opts.store)
    if _C._executor() == "cuda":
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        opts.global_ranks_in_group = list(dist_opts.global_ranks_in_group)
        opts.group_name = dist_opts.group_id
        inner = ProcessGroupNCCL(store, rank, size, opts)
    else:
        if not dist.is_gloo_available():
            raise RuntimeError(
                "superchip: the sccl backend needs Gloo with the CPU executor, and this torch "
                "build has no Gloo. Install a torch build with distributed support."
            )
        inner = dist.ProcessGroupGloo(store, rank, size, timeout)
    return _C._create_sccl_backend(inner, rank, size, timeout.total_seconds())


def _default_to_sccl(init):
    """Wraps BackendConfig.__init__: no backend named + superchip accelerator -> cpu:gloo,superchip:sccl.

    torch maps an unnamed backend to the accelerator's backend alone, which would leave CPU
    tensors (barrier, object collectives, DCP metadata) without a backend.
    """

    def __init__(self, backend):
        if str(backend) == dist.Backend.UNDEFINED and torch._C._get_accelerator().type == "superchip":
            backend = DEFAULT_BACKEND
        init(self, backend)

    __init__._superchip_wrapped = True
    return __init__


def _register() -> None:
    if not dist.is_available():
        return
    from torch.distributed import distributed_c10d as c10d

    if "SCCL" not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create_sccl, extended_api=True,
                                      devices=["superchip", "cpu"])
    if not getattr(c10d.BackendConfig.__init__, "_superchip_wrapped", False):
        c10d.BackendConfig.__init__ = _default_to_sccl(c10d.BackendConfig.__init__)


def is_sccl_group(group=None) -> bool:
    """Whether ``group`` (default: the world) serves superchip tensors with sccl."""
    group = group or dist.group.WORLD
    try:
        return group._get_backend(torch.device("superchip")).name() == BACKEND
    except RuntimeError:
        return False


def inner_group_backend(group=None) -> str:
    """Name of the transport under sccl in ``group``: ``"gloo"`` or ``"nccl"``."""
    group = group or dist.group.WORLD
    return _C._sccl_inner(group._get_backend(torch.device("superchip"))).name()


_register()

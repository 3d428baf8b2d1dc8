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
           "local_shard", "state_like", "host_tier_bytes"]

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


# ---- sharded (DTensor) parameters for superchip.optim ----

def is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_shard(t):
    """The rank-local tensor of a DTensor (FSDP2 parameter, gradient or optimizer state).

    The local tensor shares the DTensor's bytes, so the fused kernels write through to it.
    Plain tensors and None pass through.
    """
    return t.to_local() if is_dtensor(t) else t


def local_shards(*lists):
    """``local_shard`` over each element of each list (the operand lists of a fused step)."""
    return tuple([local_shard(t) for t in lst] for lst in lists)


def local_values(param, values: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``values`` for DTensor ``param``: the local shard of a DTensor, or
    the slice of a full (unsharded) tensor that this rank holds. No communication."""
    if is_dtensor(values):
        return values.to_local()
    if tuple(values.shape) == tuple(param.to_local().shape) and param.shape != values.shape:
        return values
    if tuple(values.shape) != tuple(param.shape):
        raise ValueError(
            f"superchip.optim: state of shape {tuple(values.shape)} for a sharded parameter of "
            f"global shape {tuple(param.shape)} (local {tuple(param.to_local().shape)}); pass the "
            f"full tensor or a DTensor sharded like the parameter."
        )
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    index = tuple(slice(o, o + n) for o, n in zip(offset, shape))
    return values[index]


def state_like(param, local_state: torch.Tensor):
    """Wraps a rank-local optimizer state as a DTensor sharded like ``param``, so that
    ``state_dict()`` and torch.distributed.checkpoint see the global tensor."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local_state, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def host_tier_bytes(device=None) -> int:
    """Bytes this rank holds in the ``host`` tier (optimizer state, offloaded tensors)."""
    from . import memory_stats

    return int(memory_stats(device)["host.allocated_bytes"])


_register()

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

import collections
import datetime
import functools
import weakref

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
        # Gloo's split maps group ranks to global ranks through this list; torch leaves it
        # empty for the default group, which only Gloo's first group in a process tolerates.
        inner.options.global_ranks_in_group = list(dist_opts.global_ranks_in_group) or list(range(size))
        inner.options.group_name = dist_opts.group_id
    _install_rng_tracker()
    return _C._create_sccl_backend(inner, rank, size, timeout.total_seconds(), _inner_split_options)


def _inner_split_options(inner, group_name: str, group_desc: str, timeout_s: float):
    """Options for splitting sccl's inner group (called by ProcessGroupSccl::split).

    A fresh object of the inner group's own type: the inner split writes into it (ranks,
    split source), so it must never be the parent's. NCCL's options are deep-copied from the
    parent (as torch's split_group does); Gloo's cannot be copied and are built anew as
    torch builds them for a new Gloo group (default device, default threads).
    """
    if inner.name() == "nccl":
        import copy

        opts = copy.deepcopy(inner.options)
    else:
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_default_device()]
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    opts.group_name = group_name
    return opts


# ---- DTensor random ops: Note [DTensor RNG on superchip] ----
# torch's OffsetBasedRNGTracker gives each shard of a DTensor its own part of one random
# stream by moving the *offset* of a Philox generator state (16 bytes: seed, offset). With the
# CUDA executor superchip's generator is CUDA's Philox one and that tracker works unchanged.
# Emulated, superchip's generator is the CPU's Mersenne Twister (so superchip reproduces the
# CPU's random stream bit for bit, which the test suite relies on); it has no offset to move,
# and OffsetBasedRNGTracker would write into the middle of its 5056-byte state. So superchip
# registers its own tracker (torch's extension point, random._rng_tracker) for the emulated
# executor: per random op, every rank draws one 64-bit value from the shared stream (all
# ranks advance identically), and the op runs on a stream seeded from that value and the
# shard's linear index. Shards are deterministic under torch.manual_seed, distinct between
# shards, identical between ranks that hold the same shard (replicated mesh dimensions).

def _make_rng_tracker():
    import contextlib

    from torch.distributed.tensor import _random as dt_random

    class SuperchipRNGTracker(dt_random._RNGStateTracker):
        """Per-shard seeds derived from the shared superchip stream (emulated executor)."""

        def __init__(self):
            super().__init__(torch.device("superchip", torch.superchip.current_device()))
            self._synced = False

        def _sync(self) -> None:
            # As OffsetBasedRNGTracker(run_state_sync=True), at the first DTensor random op:
            # every rank takes global rank 0's state (broadcast over the default group).
            if self._synced or not dist.is_initialized():
                return
            self._synced = True
            state = torch.superchip.get_rng_state().to(self._device)
            dist.broadcast(state, 0)
            torch.superchip.set_rng_state(state.cpu())

        @contextlib.contextmanager
        def _distribute_region(self, spec, generator=None):
            if spec.mesh.device_type != "superchip" or not self.distribute_region_enabled:
                yield
                return
            self._sync()
            gen = generator if generator is not None else torch.superchip._generator(self._device)
            draw = torch.empty((), dtype=torch.int64, device=self._device)
            base = int(draw.random_(generator=gen).item())
            after = gen.get_state()
            coord = spec.mesh.get_coordinate() or [0] * spec.mesh.ndim
            shard = 0
            for d, placement in enumerate(spec.placements):
                if placement.is_shard():
                    shard = shard * spec.mesh.size(d) + coord[d]
            gen.manual_seed((base ^ ((shard + 1) * 0x9E3779B97F4A7C15)) & ((1 << 63) - 1))
            try:
                yield
            finally:
                gen.set_state(after)

    return SuperchipRNGTracker()


def _install_rng_tracker() -> None:
    if _C._executor() != "cpu":
        return  # CUDA's Philox generator: torch's OffsetBasedRNGTracker applies as is
    from torch.distributed.tensor import _random as dt_random

    if dt_random._rng_tracker is None or isinstance(dt_random._rng_tracker, dt_random.OffsetBasedRNGTracker):
        dt_random._rng_tracker = _make_rng_tracker()


def _default_to_sccl(init):
    """Wraps BackendConfig.__init__ so that, with a superchip accelerator, superchip tensors
    always have a backend: no backend named, or "gloo" alone -> cpu:gloo,superchip:sccl; any
    other backend string that names none for superchip ("nccl", "cpu:gloo,cuda:nccl", "mpi")
    keeps what it names and gets superchip:sccl added.

    torch maps an unnamed backend to the accelerator's backend alone, which would leave CPU
    tensors (barrier, object collectives, DCP metadata) without a backend. And a CPU script's
    ``init_process_group("gloo")`` left superchip tensors without one: every collective and
    DDP raised "No backend type associated with device type superchip" (found by review);
    Gloo takes no superchip tensor, so they get sccl, and CPU tensors Gloo as asked. A GPU
    script's ``init_process_group("nccl")`` (torch maps it to cuda:nccl only) failed the same
    way on the first collective of a superchip tensor (found by review): superchip tensors get
    sccl, which runs NCCL underneath with the CUDA executor, and CUDA tensors keep NCCL. A
    string that names a backend for superchip is taken as written.
    """

    def __init__(self, backend):
        superchip_accelerator = torch._C._get_accelerator().type == "superchip"
        if superchip_accelerator and (
                str(backend) == dist.Backend.UNDEFINED or str(backend).lower() == "gloo"):
            backend = DEFAULT_BACKEND
        init(self, backend)
        if superchip_accelerator and "superchip" not in self.device_backend_map:
            self.device_backend_map["superchip"] = dist.Backend(BACKEND)

    __init__._superchip_wrapped = True
    return __init__


def _split_group_on_the_bound_device() -> None:
    """Note [split_group on torch 2.11]: torch 2.11's ``split_group`` (DeviceMesh's way to make the
    groups of a mesh dimension when the world group is bound to a device and CUDA is available)
    looks up the parent's and the child's backend for ``cuda``; a superchip group has none ("No
    backend type associated with device type cuda"). torch 2.13 looks them up for the current
    accelerator; this rebinds 2.11's function to look them up for the device the world group is
    bound to (the same for a CUDA-bound group; a no-op on torch versions without the hard-coded cuda)."""
    import inspect
    import textwrap

    from torch.distributed import device_mesh
    from torch.distributed import distributed_c10d as c10d

    if getattr(c10d.split_group, "_superchip_wrapped", False):
        return
    src = textwrap.dedent(inspect.getsource(c10d.split_group))
    if 'torch.device("cuda")' not in src or "device_id = default_pg.bound_device_id" not in src:
        return
    src = src.replace('torch.device("cuda")', '(device_id or torch.device("cuda"))')
    scope: dict = {}
    exec(compile(src, c10d.__file__, "exec"), c10d.__dict__, scope)  # noqa: S102
    split_group = scope["split_group"]
    split_group._superchip_wrapped = True
    for module in (c10d, dist, device_mesh):
        if getattr(module, "split_group", None) is not None:
            module.split_group = split_group


# ---- DDP: the reduced gradients for the offload engine ----
# Note [Speculation under DDP]
# The engine speculates a bucket's step during backward from the gradients its hooks see
# (engine.py). Under DDP those are each rank's local gradients; DDP writes the average into
# .grad at the end of backward, so every speculation failed validation and was redone, and
# the CPU step overlapped only the next forward. The reduced gradients exist earlier: in DDP's
# bucket buffer once that bucket's allreduce completes, during backward. DDP hands them to a
# communication hook, its documented extension point, so superchip.optim installs one
# (attach_ddp_hook, at its first step(): DDP wants hooks registered before backward, so a
# user's is there by then; that first backward is not speculated). The hook reduces exactly
# as DDP's built-in path does: the bucket (DDP copies each gradient in when a hook is set) is
# multiplied in place by 1/world, which DDP's default does while copying (at::mul_out by the
# wrapped scalar 1/world), then summed by allreduce; same kernels, same bits, 1/3 included.
# When an allreduce completes it records the bucket's parameters and their reduced gradients
# (views of the buffer); the engine's gradient hooks speculate the buckets whose gradients are
# all reduced. The copy job reads the buffer without marking it pending: DDP's end of
# backward reads it too, and would wait behind the speculative steps queued before the copy;
# nothing writes it before the next backward, whose weights the forward reads only after
# their validation. Not installed where the equality does not hold or something is in the
# way: a hook of the user's (DDP takes one), DDP mixed precision, gradient_as_bucket_view=True
# (DDP divides instead of multiplying once a gradient lives in its bucket), a Join context with
# divide_by_initial_world_size=False (DDP divides by the ranks not joined yet, which a hook
# cannot know; one entered only after the first step() is not seen), and the CUDA
# executor (NCCL's completion is a CUDA event the engine does not order with yet; unverified
# on a GPU). Validation at step() still compares every speculated gradient with .grad bit for
# bit, so whatever a hook saw, a wrong speculation costs only a redo.
#
# Note [A user's hook after superchip's]
# torch asks for a communication hook before the first backward, yet takes one later too; DDP
# takes only one. A user's registered after superchip.optim's first step() was refused with
# "register_comm_hook ... can only be called once", naming a call the user never made (found by
# review). So DDP's register_comm_hook (and the built-in ALLREDUCE / FP16_COMPRESS) hands the
# user's hook to superchip's, which from then on only calls it: DDP lists the user's hook, and
# the engine, whose buckets no longer arrive reduced, steps them at step() as it does when a
# user's hook came first. A second registration is refused by DDP as usual.

_ddp_modules = weakref.WeakSet()
_installed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # DDP -> its DDPReduced


def _track_ddp(init):
    """Wraps DistributedDataParallel.__init__: remembers DDP modules over superchip parameters."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if any(p.device.type == "superchip" for p in self.module.parameters()):
            _ddp_modules.add(self)

    __init__._superchip_wrapped = True
    return __init__


class DDPReduced:
    """State of the communication hook: the engines that listen for reduced gradients."""

    def __init__(self, group) -> None:
        self.group = group
        self.listeners = weakref.WeakSet()  # DDPListener, one per optimizer's engine
        self.user = None         # (state, hook) of a hook the user registered after this one


class DDPListener:
    """One engine's view of the hook: which of its parameters' reduced gradients are ready.

    One per optimizer: two optimizers over parts of one DDP model shared one list, each cleared
    it at its backward and took the other's buckets, so neither speculated (found by review).
    And every engine over the model is polled from any engine's gradient hooks (poll_all): an
    optimizer over the last layers sees its last hook early in backward, before the allreduce
    of its buckets completes, and never speculated them."""

    def __init__(self, state: DDPReduced, params) -> None:
        self.state = state
        self.ids = {id(p) for p in params}
        self.ready: collections.deque = collections.deque()  # (params, reduced grads); any thread
        self.listening = False   # the engine reads `ready`: otherwise nothing is recorded
        self.poll = None         # weakref.WeakMethod: the engine's speculation of what is ready

    def poll_all(self) -> None:
        """Lets every listening engine over this DDP model speculate what is reduced (a
        gradient hook's thread, the training thread)."""
        for listener in list(self.state.listeners):
            poll = listener.poll() if listener.poll is not None and listener.listening else None
            if poll is not None:
                poll()


def _reduce_like_ddp(state: DDPReduced, bucket):
    if state.user is not None:  # Note [A user's hook after superchip's]
        user_state, hook = state.user
        return hook(user_state, bucket)
    buf = bucket.buffer()
    buf.mul_(1.0 / state.group.size())
    fut = dist.all_reduce(buf, group=state.group, async_op=True).get_future()
    if not any(listener.listening for listener in state.listeners):
        return fut.then(lambda f: f.value()[0])
    params, grads = bucket.parameters(), bucket.gradients()

    def reduced(f):
        out = f.value()[0]
        for listener in list(state.listeners):
            if listener.listening:
                mine = [(p, g) for p, g in zip(params, grads) if id(p) in listener.ids]
                if mine:
                    listener.ready.append(([p for p, _ in mine], [g for _, g in mine]))
        return out

    return fut.then(reduced)


def ddp_of(params):
    """The DDP module whose parameters include all of ``params``, or None."""
    if not _ddp_modules:
        return None
    want = {id(p) for p in params}
    for ddp in list(_ddp_modules):
        if want <= {id(p) for p in ddp.module.parameters()}:
            return ddp
    return None


def attach_ddp_hook(params) -> DDPListener | None:
    """A listener for the reduced gradients of ``params`` from the hook of the DDP module over
    them, installing the hook on first use.

    None where the engine cannot use one (Note [Speculation under DDP]).
    """
    if not dist.is_available() or _C._executor() != "cpu":
        return None
    ddp = ddp_of(params)
    if ddp is not None:
        if ddp in _installed:
            return _listen(_installed[ddp], params)
        hooks = getattr(ddp, "_comm_hooks", None)
        join = getattr(ddp, "_join_config", None)
        if (hooks or getattr(ddp, "mixed_precision", None) is not None or ddp.gradient_as_bucket_view
                or getattr(ddp, "_use_python_reducer", False) or getattr(ddp, "process_group", None) is None
                or (join is not None and join.enable and not getattr(ddp, "_divide_by_initial_world_size", True))):
            return None
        state = DDPReduced(ddp.process_group)
        try:
            ddp.register_comm_hook(state, _reduce_like_ddp)
        except (RuntimeError, AssertionError):
            # A built-in (C++) hook is registered, which DDP does not list: it takes only one.
            if ddp._comm_hooks and ddp._comm_hooks[-1][0] is _reduce_like_ddp:
                ddp._comm_hooks.pop()
            return None
        _installed[ddp] = state
        return _listen(state, params)
    return None


def _listen(state: DDPReduced, params) -> DDPListener:
    listener = DDPListener(state, params)
    state.listeners.add(listener)
    return listener


def _hand_over(register):
    """Wraps DDP.register_comm_hook: Note [A user's hook after superchip's]."""

    @functools.wraps(register)
    def register_comm_hook(self, state, hook):
        ours = _installed.get(self)
        if ours is None or ours.user is not None:
            return register(self, state, hook)
        self._check_comm_hook(hook)
        if self.logger is not None:
            self.logger._set_comm_hook_name(hook.__qualname__)
        ours.user = (state, hook)
        self._comm_hooks[:] = [(hook, state)]

    register_comm_hook._superchip_wrapped = True
    return register_comm_hook


def _hand_over_builtin(register):
    """Wraps DDP._register_builtin_comm_hook: Note [A user's hook after superchip's]."""

    @functools.wraps(register)
    def _register_builtin_comm_hook(self, comm_hook_type):
        ours = _installed.get(self)
        if ours is None or ours.user is not None:
            return register(self, comm_hook_type)
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hooks = {dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
                 dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook}
        if comm_hook_type not in hooks:
            raise RuntimeError(
                f"superchip.optim installed a DDP communication hook at its first step(), and DDP "
                f"takes one: register {comm_hook_type} before the optimizer's first step(), or "
                f"create the optimizer with overlap=False.")
        self.register_comm_hook(self.process_group, hooks[comm_hook_type])

    _register_builtin_comm_hook._superchip_wrapped = True
    return _register_builtin_comm_hook


def _register() -> None:
    if not dist.is_available():
        return
    _split_group_on_the_bound_device()
    from torch.nn.parallel import DistributedDataParallel as DDP

    if not getattr(DDP.__init__, "_superchip_wrapped", False):
        DDP.__init__ = _track_ddp(DDP.__init__)
        DDP.register_comm_hook = _hand_over(DDP.register_comm_hook)
        DDP._register_builtin_comm_hook = _hand_over_builtin(DDP._register_builtin_comm_hook)
    from torch.distributed import distributed_c10d as c10d

    if "SCCL" not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create_sccl, extended_api=True,
                                      devices=["superchip", "cpu"])
        # torch (2.13) picks a multi-device group's default backend by testing whether the
        # *first* plugin key is among the group's backend names; keys are upper case and names
        # lower case, so "cpu:gloo,superchip:sccl" would get no default backend (and warn on
        # every hook check). A lower-case alias first makes that test see "sccl".
        dist.Backend._plugins = {BACKEND: dist.Backend._plugins["SCCL"], **dist.Backend._plugins}
    if not getattr(c10d.BackendConfig.__init__, "_superchip_wrapped", False):
        c10d.BackendConfig.__init__ = _default_to_sccl(c10d.BackendConfig.__init__)
    if dist.is_initialized() and "superchip" not in str(dist.get_backend_config()):
        # Found by review: the collectives of such a group fail with torch's "No backend type
        # associated with device type superchip", which names neither cause.
        import warnings

        warnings.warn(f"superchip was imported after torch.distributed.init_process_group(): "
                      f"the default group ({dist.get_backend_config()}) has no backend for superchip "
                      f"tensors, and their collectives will fail. Import superchip before "
                      f"init_process_group(), or create the group with backend='{DEFAULT_BACKEND}'.",
                      stacklevel=3)


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


# ---- Ulysses sequence parallelism ----
# Each of P ranks holds a slice of the sequence, [s_r, H, D]. One all-to-all trades the
# sequence split for a head split, [S, h_r, D] (S = sum s_r, h_r = this rank's heads), so the
# attention function sees whole sequences for its heads; a second all-to-all trades back.
# The two exchanges are each other's inverse, which is also each one's backward. Uneven
# splits: heads are dealt as evenly as possible (the first H % P ranks get one more);
# sequence slices may differ in length between ranks.

def _even_splits(n: int, parts: int) -> list[int]:
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def _exchange(x: torch.Tensor, send_dim: int, send_splits: list[int], recv_dim: int,
              recv_splits: list[int], group) -> torch.Tensor:
    """All-to-all that splits ``x`` along ``send_dim`` (piece j to rank j) and concatenates the
    pieces received along ``recv_dim``; every other dimension is kept."""
    rank = dist.get_rank(group)
    pieces = [c.contiguous() for c in x.split(send_splits, dim=send_dim)]
    send = torch.cat([c.reshape(-1) for c in pieces]) if pieces else x.new_empty(0)
    shapes = []
    for j in range(len(recv_splits)):
        shape = list(x.shape)
        shape[send_dim] = send_splits[rank]
        shape[recv_dim] = recv_splits[j]
        shapes.append(shape)
    recv_numel = [int(torch.Size(sh).numel()) for sh in shapes]
    recv = x.new_empty(sum(recv_numel))
    dist.all_to_all_single(recv, send, recv_numel, [c.numel() for c in pieces], group=group)
    parts = [r.view(sh) for r, sh in zip(recv.split(recv_numel), shapes)]
    return torch.cat(parts, dim=recv_dim)


class _SeqToHeads(torch.autograd.Function):
    """[s_r, H, ...] -> [S, h_r, ...]; backward is the inverse exchange."""

    @staticmethod
    def forward(ctx, x, seq_splits, head_splits, group):
        ctx.args = (seq_splits, head_splits, group)
        return _exchange(x, 1, head_splits, 0, seq_splits, group)

    @staticmethod
    def backward(ctx, grad):
        seq_splits, head_splits, group = ctx.args
        return _exchange(grad.contiguous(), 0, seq_splits, 1, head_splits, group), None, None, None


class _HeadsToSeq(torch.autograd.Function):
    """[S, h_r, ...] -> [s_r, H, ...]; backward is the inverse exchange."""

    @staticmethod
    def forward(ctx, y, seq_splits, head_splits, group):
        ctx.args = (seq_splits, head_splits, group)
        return _exchange(y, 0, seq_splits, 1, head_splits, group)

    @staticmethod
    def backward(ctx, grad):
        seq_splits, head_splits, group = ctx.args
        return _exchange(grad.contiguous(), 1, head_splits, 0, seq_splits, group), None, None, None


def ulysses_attention(attn_fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args,
                      group=None, seq_lens: list[int] | None = None, **kwargs) -> torch.Tensor:
    """Ulysses sequence-parallel attention around any attention function.

    ``q``, ``k``, ``v``: this rank's slice of the sequence, ``[s_r, H, D]`` (``v`` may have
    another last dimension). ``attn_fn(q, k, v, *args, **kwargs)`` is called with whole
    sequences for this rank's heads, ``[S, h_r, D]``, and must return ``[S, h_r, D_v]``; the
    result is this rank's sequence slice of the output, ``[s_r, H, D_v]``. Differentiable:
    forward and backward equal attention on the full sequence in one process. ``H`` need not
    divide by the group size (ranks get ``H // P`` or ``H // P + 1`` heads). ``seq_lens``:
    every rank's ``s_r`` when they differ (default: gathered, one small all-gather).
    """
    group = group or dist.group.WORLD
    world = dist.get_world_size(group)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() < 3:
            raise ValueError(f"ulysses_attention: {name} must be [seq, heads, dim], got shape {tuple(t.shape)}")
    if q.shape[:2] != k.shape[:2] or q.shape[:2] != v.shape[:2]:
        raise ValueError(
            f"ulysses_attention: q, k, v must share [seq, heads]; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    heads = q.shape[1]
    if heads < world:
        raise ValueError(
            f"ulysses_attention: {heads} heads cannot be split over {world} ranks; use at most "
            f"as many ranks as heads (or a smaller group)."
        )
    if seq_lens is None:
        lens = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(lens, torch.tensor([q.shape[0]], dtype=torch.int64), group=group)
        seq_lens = [int(t.item()) for t in lens]
    if len(seq_lens) != world or seq_lens[dist.get_rank(group)] != q.shape[0]:
        raise ValueError(
            f"ulysses_attention: seq_lens {seq_lens} does not match {world} ranks with this "
            f"rank's {q.shape[0]} positions"
        )
    head_splits = _even_splits(heads, world)
    qh, kh, vh = (_SeqToHeads.apply(t, seq_lens, head_splits, group) for t in (q, k, v))
    out = attn_fn(qh, kh, vh, *args, **kwargs)
    return _HeadsToSeq.apply(out, seq_lens, head_splits, group)


# ---- sharded (DTensor) parameters for superchip.optim ----

def is_dtensor(t) -> bool:
    if not dist.is_available():  # a torch build without distributed has no DTensor
        return False
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

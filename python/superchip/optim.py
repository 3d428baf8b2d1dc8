"""Fused CPU optimizers: drop-ins for torch.optim.Adam, AdamW and SGD.

Same constructor arguments, param groups, LR schedulers and ``state_dict()`` layout as
torch.optim (a checkpoint moves between the two both ways). The step is one fused pass per
parameter chunk on the CPU (ops/cpu kernels, SIMD, a thread pool on the GPU-local NUMA
node). For superchip parameters the moments, and the fp32 master weights of bf16/fp16
parameters, live in the ``host`` tier; state tensors are on the parameter's device.
"""

from __future__ import annotations

import os
import time
from itertools import chain

import torch
from torch.utils._python_dispatch import _disable_current_modes

from . import _C
from .engine import Engine, overlap_default
from . import distributed as _dist  # DTensor (FSDP2) parameters: local shards, sharded state

__all__ = ["Adam", "AdamW", "SGD"]

_LOW_PRECISION = (torch.bfloat16, torch.float16)
_SUPPORTED = (torch.float32, torch.bfloat16, torch.float16)


def _scalar(x, what: str) -> float:
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"Tensor {what} must be 1-element")
        return float(x.item())
    return float(x)


def _reject_unsupported(cls: str, *, differentiable=False, capturable=False, fused=None) -> None:
    if differentiable:
        raise ValueError(
            f"superchip.optim.{cls} does not support differentiable=True: its step runs in fused "
            f"CPU kernels outside autograd. Use torch.optim.{cls}(..., differentiable=True)."
        )
    if capturable:
        raise ValueError(
            f"superchip.optim.{cls} does not support capturable=True (CUDA-graph capture): its "
            f"step runs on the CPU. Use torch.optim.{cls}(..., capturable=True) for graphs."
        )
    if fused is False:
        raise ValueError(
            f"superchip.optim.{cls} is always fused; fused=False asks for the unfused "
            f"implementation, which is torch.optim.{cls}."
        )


def _state_tensor(p: torch.Tensor, values: torch.Tensor | None = None, tier: str = "host") -> torch.Tensor:
    """An fp32 tensor shaped like ``p`` on p's device (``tier`` for superchip), zeros or ``values``."""
    if _dist.is_dtensor(p):  # FSDP2: this rank's shard, wrapped as a DTensor sharded like p
        local = None if values is None else _dist.local_values(p, values.detach())
        return _dist.state_like(p, _state_tensor(p.to_local(), local, tier))
    if p.device.type == "superchip":
        try:
            try:
                t = _C._fp32_in_tier(p.detach(), tier, False)
            except torch.OutOfMemoryError:
                if tier != "hbm":
                    raise
                # A tail bucket's state where hbm has no room left: host (the executor's kernel
                # reads it there too, pinned and mapped), instead of failing the step.
                t = _C._fp32_in_tier(p.detach(), "host", False)
        except torch.OutOfMemoryError as e:
            # The allocator's message names the tier, not why the optimizer wanted host memory
            # while hbm may have room (found by review).
            raise torch.OutOfMemoryError(
                f"superchip.optim: no room for a parameter's fp32 optimizer state (shape "
                f"{tuple(p.shape)}, {4 * p.numel()} bytes per state tensor): superchip.optim keeps "
                f"master weights and moments in the host tier. Raise the host budget "
                f"(superchip.set_capacity('host', nbytes) or SUPERCHIP_HOST_BYTES), or use a "
                f"torch.optim optimizer, whose state stays beside the parameters. {e}") from None
        if values is not None:
            # The backend's copy, not copy_: optimizer state is no weight to place or stream.
            _C._copy_into_state(t, values.detach().reshape(p.shape))
        return t
    if values is None:
        return torch.zeros(p.shape, dtype=torch.float32, device=p.device)
    return values.detach().to(device=p.device, dtype=torch.float32, copy=True).reshape(p.shape)


def _evaluate(closure):
    """The closure's loss, computed with autograd on (step() runs under no_grad)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _check_param(cls: str, p: torch.Tensor) -> None:
    if p.dtype not in _SUPPORTED:
        raise TypeError(
            f"superchip.optim.{cls}: parameter of dtype {p.dtype} is not supported (float32, "
            f"bfloat16, float16 are). Use torch.optim.{cls} for it, or cast the model."
        )
    if p.device.type not in ("superchip", "cpu"):
        raise RuntimeError(
            f"superchip.optim.{cls}: parameter on {p.device}; it steps superchip and cpu "
            f"parameters. Move the model with .to('superchip')."
        )
    if p.grad.layout != torch.strided:
        # Said what to do (found by review): torch.optim.SGD steps sparse gradients, and Adam
        # and AdamW users are pointed at SparseAdam.
        raise RuntimeError(
            f"superchip.optim.{cls} does not step sparse gradients ({p.grad.layout}, a parameter "
            f"of shape {tuple(p.shape)}, such as nn.Embedding(sparse=True)'s). Build that module "
            f"with sparse=False, or give its parameters to a torch.optim optimizer of their own "
            f"(torch.optim.SparseAdam, or torch.optim.SGD) and the rest to superchip.optim.{cls}."
        )
    if p.grad.device != p.device:
        raise RuntimeError(
            f"superchip.optim.{cls}: gradient on {p.grad.device} for a parameter on {p.device}."
        )
    if p.grad.shape != p.shape:
        raise RuntimeError(
            f"superchip.optim.{cls}: gradient of shape {tuple(p.grad.shape)} for a parameter of "
            f"shape {tuple(p.shape)}."
        )


def _executor_stream(params) -> int:
    """The stream a tail bucket's step is enqueued on: with the CUDA executor, the current
    stream of the parameters' device (backward's gradients are ready on it and the next forward
    reads the parameters on it); 0 with the CPU executor, which steps on the calling thread."""
    if _C._executor() != "cuda":
        return 0
    return torch.cuda.current_stream(params[0].device.index).cuda_stream


def _params_with_grad(cls: str, group: dict) -> list:
    """The group's parameters that have a gradient, all checked before any state changes."""
    params = [p for p in group["params"] if p.grad is not None]
    for p in params:
        _check_param(cls, p)
    return params


def _all_superchip(params, explicit: str | None) -> bool:
    """Whether every parameter is a superchip tensor: the engine's pending-step check lives in
    superchip's operators, so a CPU tensor read during an asynchronous step would see it
    half-done. With `explicit` (the argument that asked for the engine) that is an error."""
    for i, p in enumerate(params):
        if p.device.type != "superchip":
            if explicit:
                raise ValueError(
                    f"superchip.optim: {explicit} needs every parameter on the superchip device, "
                    f"but parameter {i} (shape {tuple(p.shape)}) is on {p.device}; move the model "
                    f"with .to('superchip') before building the optimizer, or pass overlap=False")
            return False
    return True


def _tensors(params: list) -> list:
    """The tensors of a param group's list, named parameters ((name, tensor) pairs) unpacked."""
    return [p[1] if isinstance(p, tuple) and len(p) == 2 else p for p in params]


def _refuse_duplicates(cls: str, index: int, params: list) -> None:
    """A group that lists a parameter twice is refused. torch.optim only warns ("in future,
    this will cause an error") and steps such a parameter once per listing, with bias
    corrections that differ between its fused, foreach and for-loop kernels; the offload
    engine steps each parameter once. So no behaviour of ours could match torch's: found by
    review, where the engine stepped a duplicated parameter once and overlap=False twice."""
    first = {}
    for i, p in enumerate(_tensors(params)):
        j = first.setdefault(id(p), i)
        if j != i and isinstance(p, torch.Tensor):
            raise ValueError(
                f"superchip.optim.{cls}: parameter group {index} lists one parameter (shape "
                f"{tuple(p.shape)}) twice, at positions {j} and {i}. torch.optim warns that this "
                f"will become an error, and steps it once per listing; list each parameter once "
                f"(a tied weight is one parameter: model.parameters() lists it once).")


class _FusedOptimizer(torch.optim.Optimizer):
    """Shared state handling: fp32 state in the host tier, torch-compatible state dicts."""

    _STATE_KEYS: tuple = ()
    _CAN_SPECULATE = False

    # Note [An optimizer built before the model moved]
    # Accelerate's prepare() and HF Trainer build or receive the optimizer over the model's
    # parameters while the model is still on the CPU, and move the model afterwards: the same
    # Parameter objects, superchip tensors by the first step(). A default-on engine decided at
    # construction, found CPU parameters and stayed off for good, silently: every step plain,
    # exposed time equal to optimizer time (found by a user-flow review of the README's Trainer
    # path). So the default waits: after each plain step() it looks again, and once every
    # parameter is on superchip the engine starts (hooks on the parameters), from the next
    # backward on. Not after SUPERCHIP_OVERLAP=0, overlap=False, or a stop (a parameter that
    # left the device, a CPU group added: Engine.stop() is for good). overlap=True asks for the
    # engine at once, so it still refuses CPU parameters at construction.
    def _start_engine(self, overlap, bucket_bytes, tail_buckets) -> None:
        self._engine_args = (overlap, bucket_bytes, tail_buckets)  # Note [A pickled optimizer]
        explicit = overlap is not None
        overlap = bool(overlap) if explicit else overlap_default()
        params = [p for g in self.param_groups for p in g["params"]]
        self._engine_later = None
        if overlap and not _all_superchip(params, "overlap=True" if explicit else None):
            overlap = False  # the default on a model not on superchip yet: the plain step
            self._engine_later = (bucket_bytes, tail_buckets)
        self._overlap_explicit = explicit
        self._state_tiers: dict = {}
        self._engine = Engine(self, overlap=overlap, bucket_bytes=bucket_bytes,
                              tail_buckets=tail_buckets, can_speculate=self._CAN_SPECULATE)

    def _start_engine_later(self) -> None:
        """After a plain step(): the default-on engine starts once every parameter is on
        superchip (Note [An optimizer built before the model moved])."""
        later = self._engine_later
        if later is None or not _all_superchip([p for g in self.param_groups for p in g["params"]], None):
            return
        self._engine_later = None
        old = self._engine
        engine = Engine(self, overlap=True, bucket_bytes=later[0], tail_buckets=later[1],
                        can_speculate=self._CAN_SPECULATE)
        engine.counts, engine.inline_seconds = old.counts, old.inline_seconds  # cumulative stats
        self._engine = engine

    def _tier(self, p) -> str:
        tiers = getattr(self, "_state_tiers", None)
        return tiers.get(p, "host") if tiers else "host"

    def _new_state(self, p, values=None):
        return _state_tensor(p, values, self._tier(p))

    # Note [A written parameter is its master's new value]
    # A bf16/fp16 parameter is stepped through its fp32 master: each step writes
    # round(master) into the parameter. A write to the parameter between steps (re-initialising
    # a layer, model.load_state_dict to undo a loss spike, clamping) left the master as it was,
    # and the next step wrote round(master) back over it, undoing the write (found by review);
    # a superchip checkpoint trained further by torch.optim (which keeps master_param as an
    # opaque state entry) and loaded back reverted torch's steps the same way. torch.optim,
    # with no master, steps the parameter as written. So when a parameter's version or storage
    # changed since the optimizer last built its step (the optimizer's own writes move neither:
    # Note [Kernel results keep the version]), its bits are compared with round(master)
    # element by element, and the elements that differ take the written values (a write to a
    # few elements keeps the others' low bits). An exact resume (parameter and master from the
    # same checkpoint) compares equal and keeps the master. These are the optimizer's own
    # operators: a user's TorchDispatchMode does not see them. A write through .data (a tensor
    # with a version counter of its own: WGAN's p.data.clamp_, a zeroed padding row) moves no
    # version the optimizer can read, so superchip's operators and collectives count writes to
    # the parameter's storage (backend/runtime/WriteWatch.h; a count, so parameters that share
    # one flat buffer each see a write to it); before, the next step silently undid them (found
    # by review). Not seen: kernels of a compiled graph that write a parameter through .data,
    # and .data writes to CPU parameters (an optimizer over CPU parameters). FSDP2's sharded
    # parameters are checked shard by shard (set_model_state_dict after some steps was undone
    # by the next step: found by review).
    def _master(self, p: torch.Tensor, state: dict):
        if p.dtype not in _LOW_PRECISION:
            return None
        if "master_param" not in state:
            state["master_param"] = self._new_state(p, p)
        master = state["master_param"]
        if isinstance(master, torch.Tensor):
            seen = self.__dict__.setdefault("_master_seen", {})
            with torch.no_grad():  # FSDP2: the local shards themselves
                local, local_master = _dist.local_shard(p), _dist.local_shard(master)
            # A write to a DTensor counts in its own version (its shard's is below autograd).
            # .data writes: the count of writes superchip's operators noted on its storage.
            key = (p._version, local._version, local.data_ptr(), _C._writes_noted(local))
            if seen.get(p) != key:
                _C._watch_writes(local)
                # Element by element: a write to some elements (a pruning mask, clamp_, a
                # zeroed row, Embedding(max_norm=)) keeps the low bits of all the others.
                # Compared on the parameter's device (a model moved to the CPU mid-run).
                with _disable_current_modes():
                    now = local.detach()
                    was = local_master.to(device=now.device, dtype=p.dtype)
                    same = was.view(torch.int16) == now.view(torch.int16)
                    if not bool(same.all()):
                        merged = torch.where(same, local_master.to(now.device), now.float())
                        if local_master.device.type == "superchip":
                            _C._copy_into_state(local_master, merged.to(local_master.device))
                        else:  # an optimizer over CPU parameters keeps CPU state
                            local_master.copy_(merged)
                seen[p] = key
        return master

    # Note [State and out of memory]
    # A parameter's state (moments, its fp32 master, a momentum buffer: 4 bytes per element
    # each, in the host tier) is created at its first step. Created one tensor at a time inside
    # the step, an OutOfMemoryError part way through left a parameter with "step" and no
    # moments (every later step raised KeyError: 'exp_avg'), step counts advanced for
    # parameters never stepped (a retried step would correct its bias with the wrong count),
    # SGD buffers that a retry took for old ones, and, under the engine, some buckets
    # submitted and others not. So a step first creates all the state it will need, for every
    # parameter it steps, or none of it: on an error what this call created is removed again
    # and the error raised with parameters, state and counts as they were; the step, or a
    # retry once memory is free, then goes on as if the error had not happened. The
    # speculation of a bucket whose state finds no room is not made (the bucket is stepped
    # at step(), which raises if there is still none). load_state_dict is all or nothing too.

    def _missing_state(self, group: dict, p, state: dict) -> list:
        """(key, make) for each state tensor ``p`` lacks before its next step."""
        if p.dtype in _LOW_PRECISION and "master_param" not in state:
            return [("master_param", lambda: self._new_state(p, p))]
        return []

    def _prepare_state(self, params) -> None:
        """Creates the state ``params`` lack, all of it or none (Note [State and out of memory])."""
        index = self._group_index()
        made, fresh = [], []
        try:
            for p in params:
                if p not in self.state:
                    fresh.append(p)
                state = self.state[p]
                for key, make in self._missing_state(self.param_groups[index[p]], p, state):
                    state[key] = make()
                    made.append((p, key))
        except BaseException:
            for p, key in reversed(made):
                del self.state[p][key]
            for p in fresh:
                if not self.state.get(p):
                    self.state.pop(p, None)
            raise
        self._state_made(made)

    def _state_made(self, made: list) -> None:
        """What _prepare_state created, once all of it was (SGD notes its new buffers)."""

    def _state_loaded(self) -> None:
        """After load_state_dict replaced the state (SGD forgets which buffers were new)."""

    def _stepped(self, params) -> None:
        """After a step of ``params`` was run or queued (SGD: their buffers are not new)."""

    def _engine_token(self, params):
        """What _engine_unstep needs to undo the bookkeeping of a queued step of ``params``."""
        return None

    def _engine_can_speculate(self) -> bool:
        """Whether the groups as they are now allow a speculative step (asked at each backward)."""
        return True

    def _engine_guard(self, groups) -> None:
        """Before an engine step: a parameter that left the device since (model.to("cpu") mid-run)
        is not guarded by superchip's operators, so an asynchronous step of it would race the
        CPU's reads (and its backward hooks raised). The engine stops and the step is the plain
        one; asked for with overlap=True, the step raises, having changed nothing."""
        if self._engine.overlap and not _all_superchip(
                [p for params in groups for p in params], "overlap=True" if self._overlap_explicit else None):
            self._engine.stop()

    def _engine_unstep(self, params, token) -> None:
        """A queued step of ``params`` failed on the worker, changing nothing: its bookkeeping
        goes back (Note [A job of the asynchronous step that fails], EngineModule.cpp)."""

    # ---- the engine's hooks into the optimizer (engine.py) ----

    def _group_index(self) -> dict:
        return {p: i for i, g in enumerate(self.param_groups) for p in g["params"]}

    def _engine_parts(self, params, step_increment: int, grads: dict | None = None):
        """Kernel arguments for `params`, one tuple per param group they belong to; `grads`
        replaces parameters' .grad (the reduced gradients under DDP: engine.py)."""
        index = self._group_index()
        by_group: dict = {}
        for p in params:
            by_group.setdefault(index[p], []).append(p)
        return [self._group_args(self.param_groups[gi], ps, step_increment, grads)
                for gi, ps in sorted(by_group.items())]

    def _engine_place_state(self, buckets, tail: int) -> int:
        """Tail buckets keep their state in hbm (stepped by the executor), the rest in host.
        Returns the tail kept: where hbm cannot hold a tail bucket's existing state, that
        bucket and the later ones are not tail buckets (their state goes back to host)."""
        from . import move_to_tier, tier_of

        def place(bucket, tier):
            for p in bucket:
                self._state_tiers[p] = tier
                for v in self.state.get(p, {}).values():
                    if isinstance(v, torch.Tensor) and v.device.type == "superchip" and tier_of(v) != tier:
                        move_to_tier(v, tier)

        for b, bucket in enumerate(buckets):
            if b < tail:
                try:
                    place(bucket, "hbm")
                    continue
                except torch.OutOfMemoryError:
                    tail = b
            place(bucket, "host")
        return tail

    def _cast_grads_fp32(self, params) -> bool:
        # Only low-precision gradients have a cast to place: the link model (measured once per
        # process, with about 200 MiB of buffers, inside the first speculated backward) is not
        # measured for fp32 models, nor where SUPERCHIP_CAST_ON decides (found by review).
        if not any(p.dtype in _LOW_PRECISION for p in params):
            return False
        forced = _cast_on_env()
        if forced in ("executor", "cpu"):
            return forced == "executor"
        return link_model()["cast_on"] == "executor"

    def offload_stats(self) -> dict:
        """Counters of the offload engine since construction (see README, "Offload engine")."""
        return self._engine.stats()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if hasattr(self, "_engine"):
            self._engine.rollback_unstepped(skipped=True)
        super().zero_grad(set_to_none)

    def state_dict(self):
        if hasattr(self, "_engine"):
            self._engine.rollback_unstepped(skipped=False)
            self._engine.synchronize()
        return super().state_dict()

    # Note [A pickled optimizer]
    # torch.optim pickles an optimizer (torch.save of the object, copy.deepcopy) as its
    # defaults, state and groups; the copy of a superchip optimizer had no engine, and its
    # first step() raised "'AdamW' object has no attribute '_engine'" where torch.optim's copy
    # steps on (found by review). The constructor's engine arguments travel with the state, and
    # the copy starts an engine of its own over its own parameters (after the state is what
    # state_dict() would give: no speculation, no queued step). load_state_dict, which calls
    # __setstate__ too, keeps the engine it has.
    def __getstate__(self):
        if hasattr(self, "_engine"):
            self._engine.rollback_unstepped(skipped=False)
            self._engine.synchronize()
        state = super().__getstate__()
        state["_superchip_engine_args"] = getattr(self, "_engine_args", (None, None, None))
        return state

    def __setstate__(self, state):
        state = dict(state)
        args = state.pop("_superchip_engine_args", (None, None, None))
        super().__setstate__(state)
        if "_engine" not in self.__dict__:  # unpickled: not load_state_dict
            from . import move_to_tier, tier_of
            # torch.load and deepcopy made the state where any new tensor goes (hbm first):
            # it goes back to the state's tier (host; the engine places tail buckets again).
            for st in self.state.values():
                for v in st.values():
                    if isinstance(v, torch.Tensor) and v.device.type == "superchip" and tier_of(v) != "host":
                        move_to_tier(v, "host")
            overlap, bucket_bytes, tail_buckets = args
            if overlap and not _all_superchip([p for g in self.param_groups for p in g["params"]], None):
                overlap = None  # overlap=True, loaded with map_location="cpu": as the default does
            self._start_engine(overlap, bucket_bytes, tail_buckets)

    def add_param_group(self, param_group: dict) -> None:
        engine = getattr(self, "_engine", None)
        stop = False
        params = param_group.get("params") if isinstance(param_group, dict) else None
        if params is not None and not isinstance(params, set):  # torch's own checks refuse the rest
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            param_group["params"] = params  # in the caller's dict, as torch does
            _refuse_duplicates(type(self).__name__, len(self.param_groups), params)
        if engine is not None and engine.overlap and params is not None:
            # Checked before the group is added, so an error changes nothing.
            stop = not _all_superchip(_tensors(params), "overlap=True" if self._overlap_explicit else None)
        super().add_param_group(param_group)
        if stop:
            engine.stop()  # a CPU parameter joined a default-on engine: the plain step
            self._engine_later = None
        if engine is not None and engine.overlap:
            engine.add_hooks(self.param_groups[-1]["params"])
            engine.forget_buckets()

    def load_state_dict(self, state_dict: dict) -> None:
        if hasattr(self, "_engine"):
            self._engine.rollback_unstepped(skipped=False)
            self._engine.synchronize()
        # torch's loader casts every state tensor to the parameter's dtype and device, which
        # would round fp32 moments of a bf16 parameter to bf16 and put them in hbm (and hold a
        # copy of the whole state meanwhile). It gets the state without them; they are loaded
        # afterwards as fp32 tensors in the state's tier.
        keys = set(self._STATE_KEYS) | {"master_param"}
        saved = {
            pid: {k: v for k, v in st.items() if k in keys and isinstance(v, torch.Tensor)}
            for pid, st in state_dict["state"].items()
        }
        rest = dict(state_dict)
        rest["state"] = {pid: {k: v for k, v in st.items() if k not in saved[pid]}
                         for pid, st in state_dict["state"].items()}
        # All or nothing (Note [State and out of memory]): an error part way (no room in the
        # host tier) puts the state and groups back as they were.
        before = {"state": self.state, "param_groups": self.param_groups}
        try:
            self._load_state(rest, saved, self.state)
        except BaseException:
            self.__setstate__(before)
            raise
        # A torch checkpoint's choice of implementation (foreach=, fused=False, capturable=,
        # differentiable=) is torch's: loaded, fused=False made every later step() raise for
        # an argument the user never passed (found by review). The groups keep this
        # optimizer's own.
        for group, old in zip(self.param_groups, before["param_groups"]):
            for key in ("foreach", "fused", "capturable", "differentiable"):
                if key in old:
                    group[key] = old[key]
        self._state_loaded()

    def _load_state(self, state_dict: dict, saved: dict, old: dict) -> None:
        # Note [Loading state in place]: holding the old state until the load succeeded (all
        # or nothing) must not double the state's memory for a reload in the same process (a
        # rollback after a loss spike): a loaded value goes into the parameter's old tensor of
        # that key where it can (fp32, its shape, its tier, read by no other value of this
        # load), else into a new one. Every tensor is allocated first, and nothing is written
        # before all of them exist; the copies then cannot fail (shapes checked first).
        from . import tier_of

        super().load_state_dict(state_dict)
        ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        by_id = dict(zip(ids, params))
        sources = {}  # storage of each superchip value loaded -> how many values read it
        for tensors in saved.values():
            for value in tensors.values():
                if value.device.type == "superchip" and not _dist.is_dtensor(value):
                    ptr = value.untyped_storage().data_ptr()
                    sources[ptr] = sources.get(ptr, 0) + 1

        def same(value, t):  # value is t's own bytes (a reload of this optimizer's state_dict())
            return (value.device == t.device and not _dist.is_dtensor(value) and value.dtype == t.dtype
                    and value.is_contiguous() and value.numel() == t.numel()
                    and value.data_ptr() == t.data_ptr()
                    and value.untyped_storage().data_ptr() == t.untyped_storage().data_ptr())

        def target(p, key, value):
            t = old.get(p, {}).get(key)
            if (isinstance(t, torch.Tensor) and p.device.type == "superchip" and not _dist.is_dtensor(p)
                    and t.device == p.device and t.dtype == torch.float32 and t.shape == p.shape
                    and t.is_contiguous() and tier_of(t) == self._tier(p)):
                reads = sources.get(t.untyped_storage().data_ptr(), 0)
                if reads == int(value is not None and same(value, t)):  # no other value reads it
                    return t
            return None

        copies = []  # (state, key, p, the tensor, value): allocation first, copies after
        for pid, tensors in saved.items():
            p = by_id[pid]
            state = self.state[p]
            for key, value in tensors.items():
                if value.numel() != p.numel():
                    raise ValueError(
                        f"{type(self).__name__}.load_state_dict: state '{key}' of parameter {pid} "
                        f"has {value.numel()} elements but the parameter has shape "
                        f"{tuple(p.shape)}: the checkpoint is of another model. Load the optimizer state saved "
                        "with this model; nothing was changed.")
                copies.append((state, key, p, target(p, key, value), value))
            if p.dtype in _LOW_PRECISION and "master_param" not in tensors:
                copies.append((state, "master_param", p, target(p, "master_param", None), p))
        for i, (state, key, p, t, value) in enumerate(copies):
            if t is None:
                copies[i] = (state, key, p, self._new_state(p, value), None)
        for state, key, p, t, value in copies:
            if value is not None and not same(value, t):
                _C._copy_into_state(t, value.detach().reshape(p.shape))
            state[key] = t
        for state in self.state.values():
            if "step" in state:
                # A fresh CPU tensor: torch's loader hands over the caller's own step tensor,
                # which step() increments in place.
                state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)


class Adam(_FusedOptimizer):
    """Fused Adam (L2 weight decay), or AdamW with ``decoupled_weight_decay=True``."""

    _STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    _CAN_SPECULATE = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, *, foreach=None, maximize=False, capturable=False,
                 differentiable=False, fused=None, decoupled_weight_decay=False,
                 overlap=None, bucket_bytes=None, tail_buckets=None):
        name = type(self).__name__
        _reject_unsupported(name, differentiable=differentiable, capturable=capturable, fused=fused)
        lr_v = _scalar(lr, "lr")
        if not 0.0 <= lr_v:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= _scalar(betas[0], "betas[0]") < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= _scalar(betas[1], "betas[1]") < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=foreach, capturable=capturable,
                        differentiable=differentiable, fused=fused,
                        decoupled_weight_decay=decoupled_weight_decay)
        super().__init__(params, defaults)
        self._start_engine(overlap, bucket_bytes, tail_buckets)

    def _engine_can_speculate(self) -> bool:
        # The amsgrad max is not invertible. Asked at every backward: amsgrad can arrive after
        # construction (add_param_group, a loaded torch checkpoint, a hand edit), and a
        # speculation then raised an internal error from inside backward (found by review).
        return not any(g["amsgrad"] for g in self.param_groups)

    def __setstate__(self, state):
        # As torch.optim.Adam: groups from older checkpoints get today's defaults.
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("foreach", None)
            group.setdefault("capturable", False)
            group.setdefault("differentiable", False)
            group.setdefault("fused", None)
            group.setdefault("decoupled_weight_decay", False)

    def _missing_state(self, group: dict, p, state: dict) -> list:
        missing = []
        if "step" not in state:
            missing += [("step", lambda: torch.tensor(0.0, dtype=torch.float32)),
                        ("exp_avg", lambda: self._new_state(p)),
                        ("exp_avg_sq", lambda: self._new_state(p))]
        if group["amsgrad"] and "max_exp_avg_sq" not in state:
            missing.append(("max_exp_avg_sq", lambda: self._new_state(p)))
        return missing + super()._missing_state(group, p, state)

    def _init_state(self, group: dict, p) -> dict:
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = self._new_state(p)
            state["exp_avg_sq"] = self._new_state(p)
        if group["amsgrad"] and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = self._new_state(p)
        return state

    def _group_args(self, group: dict, params: list, step_increment: int, given: dict | None = None) -> tuple:
        """The fused kernel's arguments for `params` of `group` (state created on first use)."""
        amsgrad = group["amsgrad"]
        grads, masters, m1, m2, mx, steps = [], [], [], [], [], []
        for p in params:
            state = self._init_state(group, p)
            grads.append(p.grad if given is None else given[p])
            masters.append(self._master(p, state))
            m1.append(state["exp_avg"])
            m2.append(state["exp_avg_sq"])
            mx.append(state["max_exp_avg_sq"] if amsgrad else None)
            steps.append(int(state["step"].item()) + step_increment)
        beta1, beta2 = group["betas"]
        params, grads, masters, m1, m2, mx = _dist.local_shards(list(params), grads, masters, m1, m2, mx)
        return (params, grads, masters, m1, m2, mx, steps, _scalar(group["lr"], "lr"),
                _scalar(beta1, "beta1"), _scalar(beta2, "beta2"), float(group["eps"]),
                float(group["weight_decay"]), bool(group["decoupled_weight_decay"]),
                bool(amsgrad), bool(group["maximize"]))

    def _engine_advance_steps(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._init_state(group, p)["step"] += 1

    def _engine_unstep(self, params, token) -> None:
        for p in params:
            self.state[p]["step"] -= 1

    def _engine_submit(self, parts) -> int:
        return _C._engine_adam_step(self._engine.owner, parts)

    def _engine_prepare_inline(self, parts):
        return _C._prepare_adam_step(parts, _executor_stream(parts[0][0]))

    @torch.no_grad()
    def step(self, closure=None):
        loss = _evaluate(closure)
        name = type(self).__name__
        groups = []
        for group in self.param_groups:
            _reject_unsupported(name, differentiable=group.get("differentiable", False),
                                capturable=group.get("capturable", False),
                                fused=group.get("fused"))
            groups.append(_params_with_grad(name, group))
        self._engine_guard(groups)
        if self._engine.overlap:
            self._engine.step()
            return loss
        self._engine.raise_failure()  # of a queued step before the engine stopped
        self._prepare_state([p for params in groups for p in params])
        t0 = time.perf_counter()
        parts = [self._group_args(group, params, 1) for group, params in zip(self.param_groups, groups) if params]
        if parts:
            # Every group in one call, all or nothing, and the counts advance once it returned:
            # it may still raise before it changed anything (no room to stage an operand), and
            # a retry must see the same (Note [A step is all or nothing] in optim/FusedStep.h).
            _C._adam_step(parts)
        for params in groups:
            for p in params:
                self.state[p]["step"] += 1
        self._engine.inline_seconds += time.perf_counter() - t0
        self._engine.counts["steps"] += 1
        self._start_engine_later()
        return loss


class AdamW(Adam):
    """Fused AdamW: Adam with decoupled weight decay (default 1e-2), like torch.optim.AdamW."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, overlap=None, bucket_bytes=None,
                 tail_buckets=None):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True, overlap=overlap,
                         bucket_bytes=bucket_bytes, tail_buckets=tail_buckets)

    def __setstate__(self, state):
        # As torch.optim.AdamW: whatever the checkpoint says, AdamW decays decoupled.
        super().__setstate__(state)
        for group in self.param_groups:
            group["decoupled_weight_decay"] = True


class SGD(_FusedOptimizer):
    """Fused SGD with momentum, dampening, Nesterov and weight decay, like torch.optim.SGD."""

    _STATE_KEYS = ("momentum_buffer",)

    def __init__(self, params, lr=1e-3, momentum=0, dampening=0, weight_decay=0, nesterov=False,
                 *, maximize=False, foreach=None, differentiable=False, fused=None, overlap=None,
                 bucket_bytes=None, tail_buckets=None):
        _reject_unsupported("SGD", differentiable=differentiable, fused=fused)
        if _scalar(lr, "lr") < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize, foreach=foreach,
                        differentiable=differentiable, fused=fused)
        super().__init__(params, defaults)
        # SGD steps asynchronously but never speculates (its undo log is not written yet).
        self._start_engine(overlap, bucket_bytes, tail_buckets)

    def __setstate__(self, state):
        # As torch.optim.SGD: groups from older checkpoints get today's defaults.
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("nesterov", False)
            group.setdefault("maximize", False)
            group.setdefault("foreach", None)
            group.setdefault("differentiable", False)
            group.setdefault("fused", None)

    def _group_args(self, group: dict, params: list, step_increment: int, given: dict | None = None) -> tuple:
        momentum = float(group["momentum"])
        grads, masters, buffers, first = [], [], [], []
        for p in params:
            state = self.state[p]
            grads.append(p.grad if given is None else given[p])
            masters.append(self._master(p, state))
            if momentum != 0.0:
                # A buffer _prepare_state made for this step is new too: torch's first step
                # copies the gradient into it (no dampening).
                is_new = state.get("momentum_buffer") is None or p in self._new_buffers
                if state.get("momentum_buffer") is None:
                    state["momentum_buffer"] = self._new_state(p)
                buffers.append(state["momentum_buffer"])
                first.append(is_new)
            else:
                buffers.append(None)
                first.append(False)
        params, grads, masters, buffers = _dist.local_shards(list(params), grads, masters, buffers)
        return (params, grads, masters, buffers, first, _scalar(group["lr"], "lr"),
                momentum, float(group["dampening"]), float(group["weight_decay"]),
                bool(group["nesterov"]), bool(group["maximize"]))

    @property
    def _new_buffers(self) -> set:
        """Parameters whose momentum buffer was made by _prepare_state and not stepped yet."""
        return self.__dict__.setdefault("_new_buffers_set", set())

    def _missing_state(self, group: dict, p, state: dict) -> list:
        missing = super()._missing_state(group, p, state)
        if float(group["momentum"]) != 0.0 and state.get("momentum_buffer") is None:
            missing.append(("momentum_buffer", lambda: self._new_state(p)))
        return missing

    def _state_made(self, made: list) -> None:
        self._new_buffers.update(p for p, key in made if key == "momentum_buffer")

    def _state_loaded(self) -> None:
        self._new_buffers.clear()  # the buffers now are the loaded ones, or none

    def _stepped(self, params) -> None:
        self._new_buffers.difference_update(params)  # their buffers hold a step now

    def _engine_advance_steps(self) -> None:
        pass

    def _engine_token(self, params):
        return self._new_buffers.intersection(params)  # their first step, if it does not run

    def _engine_unstep(self, params, token) -> None:
        self._new_buffers.update(token)

    def _engine_submit(self, parts) -> int:
        return _C._engine_sgd_step(self._engine.owner, parts)

    def _engine_prepare_inline(self, parts):
        return _C._prepare_sgd_step(parts, _executor_stream(parts[0][0]))

    @torch.no_grad()
    def step(self, closure=None):
        loss = _evaluate(closure)
        groups = [_params_with_grad("SGD", group) for group in self.param_groups]
        self._engine_guard(groups)
        if self._engine.overlap:
            self._engine.step()
            return loss
        self._engine.raise_failure()  # of a queued step before the engine stopped
        self._prepare_state([p for params in groups for p in params])
        t0 = time.perf_counter()
        parts = [self._group_args(group, params, 0) for group, params in zip(self.param_groups, groups) if params]
        if parts:
            _C._sgd_step(parts)  # all groups or none (see Adam.step)
        self._stepped([p for params in groups for p in params])
        self._engine.inline_seconds += time.perf_counter() - t0
        self._engine.counts["steps"] += 1
        self._start_engine_later()
        return loss


_LINK_MODEL: dict | None = None


def cast_side(link: float, exec_cast: float, step_fp32: float, step_bf16: float) -> tuple[float, float, str]:
    """Seconds per bf16 gradient element with the cast on the executor and on the CPU, and the
    cheaper side (see link_model). link and exec_cast: bytes of bf16 input per second;
    step_*: elements per second of the fused step reading fp32 or bf16 gradients."""
    t_exec = 2 / exec_cast + 4 / link + 1 / step_fp32
    t_cpu = 2 / link + 1 / step_bf16
    return t_exec, t_cpu, "executor" if t_exec < t_cpu else "cpu"


def _cast_on_env() -> str:
    """``SUPERCHIP_CAST_ON``, any case, spaces around it dropped; "" when unset."""
    return os.environ.get("SUPERCHIP_CAST_ON", "").strip().lower()


def link_model() -> dict:
    """The measured link-cost model that decides where a gradient bucket's cast runs.

    A bf16 gradient bucket reaches the CPU step one of two ways: cast to fp32 on the executor
    and moved (``executor``), or moved as it is and stepped by the fused CPU kernel, which
    converts while it reads (``cpu``: there is no cast pass of its own). Per element of
    gradient: ``executor`` costs 2/exec_cast + 4/link + the fused step reading fp32
    gradients; ``cpu`` costs 2/link + the fused step reading bf16 gradients. Measured once per
    process, past the caches: the link (a copy of 32 Mi bf16 elements from ``hbm`` into
    ``host``), the executor's bf16->fp32 cast of them, and the fused AdamW step on the
    optimizer's threads over 8 Mi elements (bf16 parameters, fp32 master and moments) with
    each gradient dtype. ``cast_on`` names the cheaper side; ``SUPERCHIP_CAST_ON``
    (``executor`` or ``cpu``) overrides it. Rates are bytes of bf16 input per second; the
    step's are elements per second. Either way the snapshot a speculated bucket keeps in
    ``host`` (until step() validates it) is the cast's output: 4 bytes per parameter
    (``executor``) or 2.

    The link's buffers (6 bytes per element in ``hbm``, 2 in ``host``) are sized to at most
    half of what each tier's budget has free, down to 1 Mi elements (``link_elements`` says how
    many); where even that does not fit (a model filling ``hbm``, a tight
    ``SUPERCHIP_HOST_BYTES``), the link is not measured (``link_bytes_per_s`` and
    ``executor_cast_bytes_per_s`` are None, ``link_not_measured`` says why) and the CPU casts,
    which needs no executor memory and half the host bytes.
    """
    global _LINK_MODEL
    if _LINK_MODEL is not None:
        return _LINK_MODEL
    from torch.utils._python_dispatch import _disable_current_modes

    forced = _cast_on_env()
    if forced and forced not in ("executor", "cpu"):
        raise ValueError(f"SUPERCHIP_CAST_ON must be 'executor' or 'cpu', got {forced!r}: "
                         "unset it to let the measured link model choose")
    # It runs at the first speculation, inside the user's backward: under their dispatch and
    # function modes (a FlopCounterMode, a logging mode) its tensors and copies are ours, not
    # theirs to see.
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        (link, exec_cast, n, why), (step_fp32, step_bf16) = _measure_link(), _measure_steps()
    per_gi = (1 << 30) / 2  # bf16 elements in a GiB
    if link is None:
        t_exec = t_cpu = None
        cast_on = "cpu"
    else:
        t_exec, t_cpu, cast_on = cast_side(link, exec_cast, step_fp32, step_bf16)
        t_exec, t_cpu = t_exec * per_gi, t_cpu * per_gi
    if forced:
        cast_on = forced
    _LINK_MODEL = dict(link_bytes_per_s=link, executor_cast_bytes_per_s=exec_cast, link_elements=n,
                       link_not_measured=why,
                       step_fp32_grads_per_s=step_fp32, step_bf16_grads_per_s=step_bf16,
                       seconds_per_gi_cast_on_executor=t_exec,
                       seconds_per_gi_cast_on_cpu=t_cpu, cast_on=cast_on)
    return _LINK_MODEL


def _best(fn, reps=3) -> float:
    """The fastest of `reps` timed calls of fn (after one untimed), each synchronized."""
    fn()
    t = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.superchip.synchronize()
        t = min(t, time.perf_counter() - t0)
    return t


_LINK_MAX_ELEMENTS = 1 << 25  # 64 MiB of bf16: past any CPU's or GPU's caches
_LINK_MIN_ELEMENTS = 1 << 20


def _measure_link() -> tuple:
    """link_model's link and executor-cast rates: (link, exec_cast, elements, why not).

    It runs inside the user's first speculating backward, beside their activations and
    weights: with fixed 64 MiB buffers it raised OutOfMemoryError where the host tier's budget
    was tight (a run that trained with overlap=False failed with the engine), and where hbm was
    full the source landed in host and the "link" was a host-to-host copy. So the buffers fit
    in half of what each tier's budget has free, and their tiers are checked."""
    from . import memory_stats, move_to_tier, tier_of

    st = memory_stats()
    n = _LINK_MAX_ELEMENTS
    for tier, per_element in (("hbm", 6), ("host", 2)):  # hbm: the bf16 source and its fp32 cast
        cap = st[f"{tier}.capacity_bytes"]
        if cap:
            free = max(cap - st[f"{tier}.allocated_bytes"], 0)
            while n >= _LINK_MIN_ELEMENTS and per_element * n > free // 2:
                n //= 2
    if n < _LINK_MIN_ELEMENTS:
        return None, None, 0, ("the tiers' budgets have no room for its buffers (it needs 12 MiB free in "
                               "hbm and 4 MiB in host)")
    try:
        # Private generators: the measurement runs at the first speculation, inside the user's
        # training, and drawing from the default ones shifted every later dropout mask (the
        # engine then differed from overlap=False).
        src = torch.empty(n, dtype=torch.bfloat16, device="superchip")
        if tier_of(src) != "hbm":
            return None, None, 0, "hbm has no room for its source buffer"
        src.uniform_(generator=torch.Generator(device=src.device).manual_seed(0))
        dst = torch.empty(n, dtype=torch.bfloat16, device="superchip")
        move_to_tier(dst, "host")
        link = 2 * n / _best(lambda: dst.copy_(src))
        exec_cast = 2 * n / _best(lambda: src.float())
    except torch.OutOfMemoryError as e:
        return None, None, 0, f"out of memory: {str(e).splitlines()[0]}"
    return link, exec_cast, n, None


def _measure_steps() -> tuple:
    """link_model's fused-step rates: (step_fp32, step_bf16), elements per second."""
    from . import _C

    # The fused step as the engine runs it on a bucket of a bf16 model, fed each way.
    m = 1 << 23
    gen = torch.Generator().manual_seed(0)
    g32 = torch.empty(m).uniform_(-1e-3, 1e-3, generator=gen)
    g16 = g32.bfloat16()
    param = torch.empty(m).uniform_(-1.0, 1.0, generator=gen).bfloat16()
    master, exp_avg, exp_avg_sq = param.float(), torch.zeros(m), torch.zeros(m)

    def fused_step(grad):
        _C._adam_step([([param], [grad], [master], [exp_avg], [exp_avg_sq], [None], [1], 1e-6, 0.9,
                        0.999, 1e-8, 0.0, True, False, False)])

    step_fp32 = m / _best(lambda: fused_step(g32))
    step_bf16 = m / _best(lambda: fused_step(g16))
    return step_fp32, step_bf16

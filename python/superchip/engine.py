"""The offload engine behind ``superchip.optim``: an asynchronous, speculative optimizer step.

Contract (DESIGN.md, "Offload engine"): with ``overlap=True`` every result is bit for bit the
result of the plain step (``overlap=False``); only the timing changes.

* Buckets: parameters are grouped, in the order backward finishes their gradients
  (post-accumulate-grad hooks), into buckets of about ``bucket_bytes``.
* Speculation: when the predictor expects the step to be valid, a finished bucket's gradients
  are cast-then-moved to ``host`` snapshots and the bucket is stepped on the engine worker
  during backward, with an undo log (exact rollback, ops/cpu/AdamUndo.h), if that work is
  expected to end before ``step()`` (Note [Speculation budget]; the others wait for step()).
  At ``step()`` the worker validates it: the gradients must be bit for bit the snapshots (a ``clip_grad_norm_``
  that scaled them, a ``GradScaler.unscale_``, a hook, or a second ``backward()`` fails that)
  and the hyper-parameters unchanged; a failed bucket is rolled back and redone. A parameter
  or state read before ``step()`` (or ``zero_grad()`` / a new forward without ``step()``) rolls
  its bucket back first, so it shows the old values.
* Asynchronous step: ``step()`` queues the buckets in forward order and returns; an operator
  touching a tensor a queued job uses waits for that job only (backend/engine/).
* Tail buckets: the last ``tail_buckets`` buckets of backward keep their fp32 state in ``hbm``
  and are stepped inline by the executor at ``step()``.
The engine's C++ half lives in backend/engine/; this module is its bookkeeping.
"""

from __future__ import annotations

import math
import numbers
import os
import time
import weakref

import torch

from . import _C

# Status codes of _C._AdamSpeculation (backend/engine/AdamBucket.h).
_QUEUED, _SPECULATED, _ROLLED_BACK, _COMMITTED, _REDONE, _PROBE_VALID, _PROBE_INVALID, _ABANDONED = range(8)
_MAX_BACKOFF = 64
_LEAN_EXPOSED = 0.1  # Note [Speculation budget]: the wait a lean step may leave, per worker second
# Note [Speculation and host memory]: a speculation's undo log, in bytes per element, until one
# was measured (measured: 1.4 at the first speculated step of the demo GPT, 5.1 when clipping
# changed the gradients; 0.8 from the eighth step).
_UNDO_BYTES_FIRST = 6.0


def speculation_policy() -> str:
    """``SUPERCHIP_SPECULATION``: ``auto`` (default: Note [Speculation budget]), ``always``, ``never``."""
    v = os.environ.get("SUPERCHIP_SPECULATION", "").strip().lower() or "auto"  # empty: unset
    if v not in ("auto", "always", "never"):
        raise ValueError(f"SUPERCHIP_SPECULATION must be auto, always or never, got {v!r}")
    return v


# Note [Compiled autograd]
# With compiled autograd (torch._dynamo.config.compiled_autograd, or compiled_autograd._enable)
# Dynamo traces the backward's gradient hooks into the compiled backward. The engine's hook is
# bookkeeping and calls into the worker: traced, its timing event became a stream op in the
# graph (which crashed Inductor's C++ wrapper: Note [Why superchip patches Inductor], 7) and
# its calls into the worker 43 graph breaks in a 3-layer MLP, 10 of 14 speculations rolled
# back (found by review; every result was still bitwise equal). So the hook does nothing while
# Dynamo traces: a compiled backward runs no speculation, and step() queues every bucket as
# after a backward it did not see (the asynchronous step still overlaps the next forward).

# Note [Speculation budget]
# A speculative step costs the worker far more than the plain step: recording the undo log
# (ops/cpu/AdamUndo.cpp) takes 2.4-3.4x the plain step's CPU time on one core (2-core Xeon
# VM; 4.6-5x before the recording became one pass, 6.7x on a 2-core EPYC VM with an earlier
# build). That is free while the
# worker would idle through backward anyway, and a loss once it is not: speculative work still
# queued at step() runs before the steps the next forward needs first (the first layers, which
# backward finishes last), and the optimizer is the bottleneck whenever backward is short next
# to the CPU step (a large model on a fast GPU, or few tokens per step). bench/offload.py's
# optimizer-bound model: speculating every bucket made the step 1.28x the plain step's time on
# a 2-core EPYC VM (1.75x on a 2-core Xeon one); with the budget below 0.93x (0.78x).
# So a bucket is speculated only when its speculation is expected to end before step().
# Times are counted backwards from step() ("slack"): bucket b's gradients are all in `lead_b`
# seconds before step() (measured in recent backwards), the worker runs the speculations in
# the order they are queued, and each costs rate * elements (rate: worker seconds per element,
# measured from finished speculations, AdamSpeculation::seconds). With S the slack at which the
# speculations already queued this backward end (infinite while the worker is idle):
#   start = min(lead_b, S)            (the later of b's readiness and the queue's end)
#   end   = start - rate * elements_b
#   speculate when end >= 0, and then S = end.
# The rest are stepped at step(), in forward order, by the plain step. Until a rate and a lead
# are known the bucket is speculated (that measures them). A backward in which nothing could be
# measured lowers the rate by 10%, so an estimate inflated by one slow step is retried soon.
# Exactness does not depend on the choice: step() validates the buckets that were speculated
# and steps the others, each bucket bit for bit as the plain step does.
# Before any of that: speculation only pays where the asynchronous step alone would leave the
# next forward waiting. Where the forward is long next to the plain step (compute-bound
# training), stepping every bucket at step() hides it all, and speculating would spend 2.4-3.4x
# the CPU time for nothing (bench/offload.py, demo GPT, 2-core Xeon VM: speculating, the worker
# spent 33 ms a step and 86% of the plain step's 5.6 ms was hidden; lean, 4.6 ms and 97%; on
# a GPU machine that CPU time is the data loader's and the host copies'). So `auto` starts
# lean: no bucket is speculated, and each step's plain jobs are measured from step() to the
# next backward (by then the forward has read every parameter it steps): the time the
# training thread waited for them, against the worker time they took. While the wait stays
# within _LEAN_EXPOSED of the work, the engine stays lean; past it twice in a row (once can be
# the worker descheduled for a moment: measured, a lone 5 ms wait then cost a whole model's
# speculation and rollback), it speculates within the budget below, and tries a lean step
# again after 1, 2, 4, ... 64 steps (doubling with each trial that fails, reset by one that
# holds).
# The leads are read from device events, recorded on the current stream when a bucket's last
# gradient is in and at step(), and read once the step()'s event has completed (at the next
# backward, or at once where they already have). On the CPU executor an event is the host's
# clock at record(); on the CUDA executor it is the GPU's: there the hooks and step() run when
# backward's kernels are queued, well before they have run, so host clocks saw leads far
# shorter than the GPU's (before the events, `auto` speculated every bucket on CUDA). The
# worker's own start is the GPU's too: it waits for a bucket's gradients before copying them.
# Less the time the training thread waited for the engine between a bucket's readiness and
# step() (a clip_grad_norm_ reading gradients whose snapshots are queued behind speculative
# steps): counted in, a speculation that overran would lengthen the lead that lets the next
# one overrun more.


def _machine_figures() -> dict | None:
    """What the machine leaves superchip (Note [Speculation and host memory]); None where the
    check is off or the kernel's figures cannot be read."""
    if os.environ.get("SUPERCHIP_HOST_MEMORY_CHECK", "1") == "0":
        return None
    return _C._host_memory_figures()


def _timing_event(device) -> torch.Event:
    """An event on ``device`` whose elapsed_time() is its device's (Note [Speculation budget])."""
    return torch.Event(device=device, enable_timing=True)


def overlap_default() -> bool:
    """The engine is on unless ``SUPERCHIP_OVERLAP=0`` (for optimizers built without ``overlap=``).

    Default-on optimizers whose parameters are not all on superchip take the plain step: the
    engine's pending-step check lives in superchip's operators (see optim._all_superchip).
    """
    v = os.environ.get("SUPERCHIP_OVERLAP", "").strip().lower() or "1"  # empty: unset
    if v not in ("0", "1", "false", "true", "off", "on"):
        raise ValueError(f"SUPERCHIP_OVERLAP must be 0 or 1, got {v!r}")
    return v in ("1", "true", "on")


def _whole(v) -> bool:
    """An int (numpy's too) or a float with no fraction (25e6), not a bool or a string."""
    if isinstance(v, bool):
        return False
    return isinstance(v, numbers.Integral) or (isinstance(v, float) and v.is_integer())


class _Speculation:
    __slots__ = ("spec", "stepped", "probe")

    def __init__(self, spec, probe):
        self.spec = spec
        self.stepped = False      # step() has queued its validation
        self.probe = probe        # only snapshotted: tells the predictor, never rolled back


class Engine:
    """Bookkeeping for one optimizer: hooks, buckets, speculation and its predictor, stats."""

    def __init__(self, opt, *, overlap: bool, bucket_bytes: int | None, tail_buckets: int | None,
                 can_speculate: bool):
        # Whole numbers only: int() took tail_buckets=1.5 as 1 without a word (found by review).
        if bucket_bytes is not None and (not _whole(bucket_bytes) or int(bucket_bytes) <= 0):
            raise ValueError(f"bucket_bytes must be a positive whole number of bytes, got {bucket_bytes!r}")
        if tail_buckets is not None and (not _whole(tail_buckets) or int(tail_buckets) < 0):
            raise ValueError(f"tail_buckets must be a whole number >= 0, got {tail_buckets!r}")
        # Weak both ways out of the engine: the optimizer owns the engine and the parameters
        # own the hooks, so `del model, opt` frees their memory at once, with no cycle for
        # the garbage collector to find later.
        self._opt = weakref.ref(opt)
        self.owner = id(opt)
        self.overlap = overlap
        self.bucket_bytes_arg = bucket_bytes
        self.tail_arg = tail_buckets
        self.can_speculate = can_speculate
        self.buckets: list[list] = []        # backward order
        self.bucket_of: dict = {}
        self.tail = 0
        self.order: list = []                # this backward's finishing order
        self.fired: dict = {}                # param -> hook firings since the last step()
        self.grad_versions: dict = {}        # param -> its gradient's version at its first firing
        self.ready: dict = {}                # bucket -> firings
        self.specs: dict = {}                # bucket -> _Speculation (this step)
        self.outstanding: list = []          # speculations whose outcome is not counted yet
        self.outcomes = (False, False, False, False)  # harvested, for the next backward (_harvest)
        self.speculating = False
        self.multi_backward = False
        self.task = None                     # autograd graph task of the last gradient hook
        # Note [Speculation budget]
        self.policy = speculation_policy()
        if self.policy == "never":
            self.can_speculate = False
        self.ready_ev: dict = {}             # bucket -> event recorded when its gradients were all in
        self.ready_ok: set = set()           # buckets whose ready_ev holds this backward's time
        self.exposed_at: dict = {}           # bucket -> the exposed seconds at that moment
        self.step_ev = None                  # recorded at step(): the leads end there
        self.leads_due = None                # (buckets, exposed at step()) to read at step_ev
        self.lead: dict = {}                 # bucket -> seconds from ready to step(), recently
        self.rate = None                     # worker seconds per element of a speculation
        self.samples = 0                     # speculations whose cost was measured
        self.samples_seen = 0                # ... at the last backward's start
        self.slack = math.inf                # seconds before step() the queued speculations end
        self.lean = self.policy == "auto"    # this backward speculates nothing
        self.lean_mark = None                # (exposed, optimizer seconds) at a lean step()
        self.lean_wait = 0                   # speculating backwards before the next lean one
        self.lean_backoff = 1
        self.lean_misses = 0                 # lean steps in a row that left the forward waiting
        self.lean_trial = False              # this lean step is a trial after speculating
        self.last_spec = None
        self.bucket_elements: list = []
        self.bucket_staged: list = []        # bytes its CPU step stages (_staged_bytes)
        self.backoff = 1
        self.cooldown = 0
        self.probing = False
        self.probe_bucket = None
        self.counts = dict(steps=0, skipped_steps=0, speculated_buckets=0, rolled_back_buckets=0,
                           probed_buckets=0, deferred_buckets=0, lean_steps=0, abandoned_buckets=0,
                           undo_bytes=0, undo_elements=0, undo_escapes=0, failed_buckets=0)
        # Note [Speculation and host memory]: the host tier's budget (0: none), the training's
        # own use of it sampled this iteration and the last, and this backward's admissions.
        self.host_cap = 0
        self.host_used = [0, 0]
        self.machine_free = [math.inf, math.inf]  # without a budget (Note [Speculation and host memory])
        self.machine_reserve = 0
        self.undo_rate = _UNDO_BYTES_FIRST        # undo log bytes per element, recently
        # Whether the CPU step stages hbm parameters (Note [An undo needs no memory]: a
        # speculation keeps those copies until validated).
        self.stage_hbm = _C._executor() == "cuda" or os.environ.get("SUPERCHIP_STAGE_HBM_OPERANDS") == "1"
        self.admitted: list = []
        self.inline_seconds = 0.0
        # Note [A job of the asynchronous step that fails] (backend/python/EngineModule.cpp):
        # ticket -> (params, the optimizer's bookkeeping token, _Speculation or None) of the
        # step jobs queued and not known to have run.
        self.jobs: dict = {}
        # Under DDP (Note [Speculation under DDP] in distributed.py): the hook's state once
        # attached, buckets whose local gradients are in but not yet reduced, and the reduced
        # gradients of this backward by parameter.
        self.ddp = None
        self.ddp_tried = False
        self.awaiting: list = []
        self.reduced: dict = {}
        self.hooks = []
        if overlap:
            for group in opt.param_groups:
                self.add_hooks(group["params"])

    @property
    def opt(self):
        return self._opt()

    def add_hooks(self, params) -> None:
        ref = weakref.ref(self)

        def on_grad(p):
            # Note [Compiled autograd]: a traced backward runs no speculation.
            if torch.compiler.is_compiling():
                return
            engine = ref()
            if engine is not None:
                engine._on_grad(p)

        for p in params:
            if p.requires_grad:
                self.hooks.append(p.register_post_accumulate_grad_hook(on_grad))

    def stop(self) -> None:
        """Turns the engine off for good (a parameter it cannot guard joined): the plain step."""
        self.rollback_unstepped(skipped=False)
        _C._engine_synchronize(raise_errors=False)  # a failed step's error: the next step()'s
        self._reconcile()
        if self.tail and self.buckets:  # the plain CPU step cannot address hbm state (CUDA)
            self.opt._engine_place_state(self.buckets, 0)
            self.tail = 0
        for h in self.hooks:
            h.remove()
        self.hooks = []
        self.overlap = False
        self._detach_ddp()
        # Nothing reads them again (the hooks are gone), and each holds its bucket's storages:
        # after model.to("cpu") they kept the model's device copy allocated.
        self.admitted, self.outstanding = [], []

    def _detach_ddp(self) -> None:
        # DDP keeps the hook (it reduces as DDP's own path does); nothing is recorded for us.
        if getattr(self, "ddp", None) is not None:
            self.ddp.listening = False
            self.ddp.ready.clear()
            self.ddp = None

    def __del__(self):
        for h in getattr(self, "hooks", ()):
            h.remove()
        self._detach_ddp()

    # ---- during backward ----

    def _on_grad(self, p) -> None:
        if p.device.type != "superchip":
            # Moved off the device mid-run (model.to("cpu")): nothing of it is speculated, and
            # the optimizer's step() turns the engine off (_FusedOptimizer._engine_guard).
            self.speculating = self.probing = False
            return
        task = torch._C._current_graph_task_id()
        if self.fired and task != self.task and self._grads_were_reset(p):
            # Note [A backward after the model's zero_grad]
            self.rollback_unstepped(skipped=True)
        self.task = task
        if not self.fired:
            self._begin_backward()
        n = self.fired.get(p, 0) + 1
        self.fired[p] = n
        if n == 1:
            self.grad_versions[p] = p.grad._version
        if n > 1:
            # A second backward() before step(): gradients accumulate, speculation is off.
            self.multi_backward = True
            self.speculating = False
            return
        self.order.append(p)
        b = self.bucket_of.get(p)
        if b is not None:
            self.ready[b] = self.ready.get(b, 0) + 1
            if self.ready[b] == len(self.buckets[b]):
                if self.policy == "auto":  # Note [Speculation budget]: its lead starts here
                    self._record(self.ready_ev, b, p.device)
                    self.ready_ok.add(b)
                    if self.rate is not None:
                        self.exposed_at[b] = self._exposed()
                if b >= self.tail and (self.speculating or (self.probing and b == self.probe_bucket)):
                    if self.ddp is None:
                        self._speculate(b, probe=self.probing)
                    else:
                        self.awaiting.append(b)
        if self.ddp is not None:
            self.ddp.poll_all()  # at every hook: a bucket's allreduce ends any time (any engine's)

    # Note [A backward after the model's zero_grad]
    # The engine learns that a backward() had no step() from the optimizer: its zero_grad()
    # (or state_dict(), a later step()) rolls the unstepped speculation back and counts a
    # skipped step. Loops that zero the model instead (the Hugging Face Trainer's
    # model.zero_grad(); Trainer(fp16=True) skips the optimizer's step() when GradScaler finds
    # an overflow) never told it: the next backward looked like gradient accumulation, so
    # skipped_steps stayed 0 and that backward began without the engine's start-of-backward
    # bookkeeping. Results were exact either way (step() validates every speculation); the
    # count and the predictor were not. So the first gradient of a new backward() call (a new
    # autograd graph task) while firings of an unstepped one are recorded asks whether the
    # gradients were reset in between: a parameter of the last backward without a gradient
    # now means zero_grad(set_to_none=True) ran, and the engine does what the optimizer's own
    # zero_grad() does. Gradients accumulating (all still there) keep the accumulation path.
    # A reset to zeros in place (model.zero_grad(set_to_none=False)) moved every gradient's
    # version on since it fired; so did clipping or unscaling between micro-batches, which
    # keep their values: where every version moved, the smallest gradient is read, and zeros
    # there mean a reset. The read happens at the first gradient of such a backward only.
    def _grads_were_reset(self, p) -> bool:
        others = [q for q in self.fired if q is not p]
        if any(q.grad is None for q in others):
            return True
        if not others or any(q.grad._version == self.grad_versions.get(q) for q in others):
            return False
        return not bool(min(others, key=lambda q: q.grad.numel()).grad.any())

    def _poll_reduced(self) -> None:
        if self.ddp is not None and (self.speculating or self.probing):
            self._speculate_reduced()

    def _speculate_reduced(self) -> None:
        """Under DDP: speculates the awaiting buckets whose reduced gradients are all in.

        Called from the gradient hooks only: a bucket whose allreduce completes after the last
        hook of a backward is stepped at step(), in forward order, as without speculation.
        Speculated at the end of backward, in backward order, it would be queued before the
        steps of the first layers, which the next forward needs first (measured: with DDP's
        default 25 MB buckets over a 13 MB model, 12 ms exposed a step, against 0.3 ms when
        those buckets are stepped at step())."""
        ready = self.ddp.ready
        while ready:
            params, grads = ready.popleft()
            for q, g in zip(params, grads):
                self.reduced[q] = g
        if not self.awaiting:
            return
        keep = []
        for b in self.awaiting:
            if all(q in self.reduced for q in self.buckets[b]):
                self._speculate(b, probe=self.probing, grads=self.reduced)
            else:
                keep.append(b)
        self.awaiting = keep

    def _begin_backward(self) -> None:
        self._reconcile()
        self.order = []
        self.ready = {}
        # The last step()'s leads, before this backward records its events over them (not run
        # yet on the device: dropped, the next step() measures again).
        self._read_leads()
        self.leads_due, self.ready_ok, self.exposed_at = None, set(), {}
        self.slack, self.last_spec = math.inf, None
        self.admitted = []
        self._harvest()
        failed, committed, probe_valid, probe_invalid = self.outcomes
        self.outcomes = (False, False, False, False)
        if self.speculating and self.samples == self.samples_seen and self.rate is not None:
            self.rate *= 0.9  # nothing measured last backward: retry (Note [Speculation budget])
        self.samples_seen = self.samples
        failed = failed or self.multi_backward
        self.multi_backward = False
        # The predictor, like a branch predictor. Speculate while the recent steps were valid.
        # After a failure, speculation stops and one small bucket is only *probed* each step
        # (its gradients snapshotted and compared at step(): a copy, no speculative step, no
        # rollback); speculation resumes after 2, 4, 8, ... (at most 64) valid probes in a row,
        # the streak doubling with each failure. Only a committed speculation resets it.
        if failed:
            self.backoff = min(2 * self.backoff, _MAX_BACKOFF)
            self.cooldown = self.backoff
        elif committed:
            self.backoff = 1
        if probe_invalid:
            self.cooldown = self.backoff
        elif probe_valid and self.cooldown > 0:
            self.cooldown -= 1
        # (amsgrad may reach an optimizer after construction: add_param_group, load_state_dict)
        ok = (self.can_speculate and self.opt._engine_can_speculate() and bool(self.buckets)
              and len(self.buckets) > self.tail)
        self._judge_lean()
        ok = ok and not self.lean
        self.speculating = ok and self.cooldown == 0
        self.probing = ok and self.cooldown > 0
        if self.ddp is not None:
            self.awaiting, self.reduced = [], {}
            self.ddp.ready.clear()
            self.ddp.ids = {id(p) for p in self.bucket_of}  # params added since attaching too
            self.ddp.listening = self.speculating or self.probing
        elif not self.ddp_tried and (self.speculating or self.probing):
            from . import distributed as _dist

            if _dist.ddp_of([p for g in self.opt.param_groups for p in g["params"]]) is not None:
                # Before the hook is attached (the first step()), the hooks see local gradients.
                self.speculating = self.probing = False
        if self.probing and self.probe_bucket is None:
            if self.ddp is not None:
                # The first bucket backward finishes, whose allreduce completes first: a later
                # one (the smallest may hold the first layer) may complete only after backward,
                # when nothing is probed, and speculation would never resume.
                self.probe_bucket = self.tail
            else:
                sizes = {b: sum(p.numel() * p.element_size() for p in self.buckets[b])
                         for b in range(self.tail, len(self.buckets))}
                self.probe_bucket = min(sizes, key=sizes.get)
        if self.buckets and self.can_speculate and self.opt._engine_can_speculate():
            self._host_sample()  # the activations are in (Note [Speculation and host memory])

    def _judge_lean(self) -> None:
        """Whether this backward leaves every bucket to the asynchronous step (Note
        [Speculation budget]): judged from the last lean step's wait against its work."""
        if self.policy != "auto":
            return
        mark, self.lean_mark = self.lean_mark, None
        if mark is not None:
            s = _C._engine_stats(self.owner)
            work = s["optimizer_seconds"] - mark[1]
            if work > 0:
                if s["exposed_seconds"] - mark[0] <= _LEAN_EXPOSED * work:
                    self.lean, self.lean_backoff, self.lean_misses, self.lean_trial = True, 1, 0, False
                else:
                    # One wait can be the worker descheduled for a moment: a lean run speculates
                    # after two in a row (a trial, after one).
                    self.lean_misses += 1
                    if self.lean_trial or self.lean_misses >= 2:
                        self.lean, self.lean_wait, self.lean_misses = False, self.lean_backoff, 0
                        self.lean_backoff = min(2 * self.lean_backoff, _MAX_BACKOFF)
            return
        if not self.lean:
            if self.lean_wait > 0:
                self.lean_wait -= 1
            else:
                self.lean, self.lean_trial = True, True  # a lean step on trial

    def _harvest(self) -> None:
        """Counts the outcomes of finished speculations and probes into ``outcomes``: (a
        speculation failed, one committed, a probe was valid, one was invalid), which the next
        backward's predictor consumes. offload_stats() harvests too: a user logging it every
        step made the predictor miss every failure, and it speculated and rolled back every
        step while clipping triggered (120 ms of optimizer time per step for 3.5 ms)."""
        failed = committed = probe_valid = probe_invalid = False
        keep = []
        for s in self.outstanding:
            st = s.spec.status()
            if st == _ABANDONED:  # no memory for its snapshot (Note [Speculation and host memory])
                self.counts["abandoned_buckets"] += 1
                failed = True
            elif st in (_PROBE_VALID, _PROBE_INVALID):
                probe_valid |= st == _PROBE_VALID
                probe_invalid |= st == _PROBE_INVALID
            elif s.probe:
                if s.stepped:
                    keep.append(s)  # its validation has not run yet
                # else its step() never came (zero_grad, a skipped step): no outcome
            elif st in (_COMMITTED, _REDONE, _ROLLED_BACK):
                # (_ROLLED_BACK also after step(): a bucket it stepped plainly, a parameter
                # without its gradient; kept, as it was, that entry stayed here for good.)
                if st != _COMMITTED:
                    self.counts["rolled_back_buckets"] += 1
                    failed = True
                else:
                    committed = True
                if s.spec.elements() > 0:  # the memory its undo log took: up at once, down halfway
                    undo = s.spec.undo_bytes() / s.spec.elements()
                    self.undo_rate = max(undo, 0.5 * (self.undo_rate + undo))
                seconds = s.spec.seconds()
                if seconds > 0 and s.spec.elements() > 0:
                    sample = seconds / s.spec.elements()
                    self.rate = sample if self.rate is None else 0.5 * (self.rate + sample)
                    self.samples += 1
                self.counts["undo_bytes"] += s.spec.undo_bytes()
                self.counts["undo_escapes"] += s.spec.escapes()
                self.counts["undo_elements"] += s.spec.elements()
            else:
                keep.append(s)
        self.outstanding = keep
        self.outcomes = tuple(a or b for a, b in zip(self.outcomes, (failed, committed, probe_valid, probe_invalid)))

    def _fits(self, b: int) -> bool:
        """Whether speculating bucket ``b`` should end before step() (Note [Speculation budget])."""
        if self.policy == "always":
            return True
        if self.last_spec is None or self.last_spec.status() != _QUEUED:
            self.slack = math.inf  # the worker has run everything queued so far
        start = min(self.lead.get(b, math.inf), self.slack)
        end = start - (self.rate or 0.0) * self.bucket_elements[b]
        if self.rate is not None and b in self.lead and end < 0:
            return False
        self.slack = end
        return True

    # Note [Speculation and host memory]
    # A speculated (or probed) bucket's gradients are snapshotted into the host tier, 2 or 4
    # bytes per parameter, until step() validates it: memory the plain step never needs.
    # The speculative step's undo log (ops/cpu/AdamUndo.h: 0.6-1.4 bytes per parameter in
    # training, 5 where the step is rolled back) is host memory too, outside the tiers, and so
    # are the staging copies kept for the undo (Note [An undo needs no memory] in
    # optim/FusedStep.h: on a GPU, every hbm parameter's): both are counted beside the
    # snapshots, the log estimated from recent ones before the step.
    # Where the host tier has a budget (SUPERCHIP_HOST_BYTES), that memory must not be what
    # the training itself needs next: activations and gradients that spill from a full hbm
    # land there too, and a model that trained with overlap=False failed with the engine (its
    # snapshots were kept until the next backward, and the forward between ran out). So a
    # bucket is speculated only while the budget holds the training's own use -- the highest
    # of the tier's allocated bytes less the live snapshots, sampled at each backward's start
    # (activations in), at each speculation and at step() (gradients in), over this iteration
    # and the last -- plus the live snapshots, those admitted but not taken yet, this one's,
    # and 1/32 of the budget for what the samples miss; the others are stepped at step()
    # (deferred). Snapshots are freed once validated. A snapshot that still finds no room
    # abandons its speculation (Note [A speculation without memory],
    # backend/engine/AdamBucket.cpp).
    # Without a budget the machine's own memory bounds the host tier (Note [The machine's
    # memory], allocator/Backing.cpp), and the same holds against it: the host backing refused
    # only a snapshot the machine could not hold at that moment, so a snapshot could still
    # take the memory the next forward's activations (a full hbm spills them to host; on the
    # CPU executor hbm is the machine's memory too) or torch's own CPU tensors (the data
    # loader's batches, which nothing refuses) needed a moment later: the kernel's OOM killer
    # then ends the run that trains with overlap=False. So the engine samples, at the same
    # points, what the machine leaves free for the training -- the headroom, less superchip's
    # blocks not yet written, plus the live snapshots and undo logs (freed once validated) and
    # the host tier's cached blocks (a host block reuses them; hbm's it cannot) -- and admits a
    # bucket only while the lowest such figure of a backward's start and step(), this iteration
    # and the last, covers the live snapshots and logs, those admitted but not taken, this
    # one's, and the reserve superchip leaves free (limit / 32, at least 256 MiB). The figures
    # cost about 75 us a read, so they are read only there, and only in a backward that
    # speculates or probes. With the machine check off (SUPERCHIP_HOST_MEMORY_CHECK=0) or its
    # figures unreadable, nothing is admitted or refused here.

    def _host_sample(self, machine: bool = True) -> None:
        """Samples the training's own use of host (with a budget) or the machine's free memory
        (without one: only where ``machine``, at a backward's start and at step(); a read of the
        kernel's figures costs about 75 us, too much for every bucket)."""
        from . import memory_stats

        st = memory_stats(self.buckets[0][0].device)
        self.host_cap = st["host.capacity_bytes"]
        if self.host_cap:
            used = st["host.allocated_bytes"] - _C._engine_snapshot_bytes()
            self.host_used[0] = max(self.host_used[0], used)
            return
        if not machine or not (self.speculating or self.probing):
            return
        figures = _machine_figures()
        if figures is None:
            self.machine_reserve = None
            return
        # (Only host's cache: a host block refused by the machine check releases host's own.)
        cached = st["host.reserved_bytes"] - st["host.allocated_bytes"]
        free = (figures["headroom"] - figures["unwritten"] + _C._engine_snapshot_bytes()
                + _C._engine_undo_bytes() + max(cached, 0))
        self.machine_free[0] = min(self.machine_free[0], free)
        self.machine_reserve = figures["reserve"]

    def _host_admits(self, b: int, cast_fp32: bool, probe: bool = False) -> int | None:
        """The bytes speculating bucket ``b`` takes (its snapshot in host; a speculation's undo
        log, estimated), or None when there is no room for them."""
        from . import distributed as _dist

        local = (p.to_local() if _dist.is_dtensor(p) else p for p in self.buckets[b])  # FSDP2: the shard
        local = [t for t in local if t.device.type == "superchip"]
        need = sum(t.numel() * (4 if cast_fp32 else t.element_size()) for t in local)
        # The undo log, and the staging copies kept for the undo (as placed at the last plan).
        undo = 0 if probe else int(self.undo_rate * sum(t.numel() for t in local)) + self.bucket_staged[b]
        self._host_sample(machine=False)  # also the budget: set_capacity() may change it any time
        pending = sum(n for spec, n in self.admitted if spec.status() == _QUEUED)
        taken = _C._engine_snapshot_bytes() + _C._engine_undo_bytes() + pending + need + undo
        if self.host_cap:
            room = self.host_cap - max(self.host_used) - self.host_cap // 32
        elif self.machine_reserve is None:
            room = math.inf  # no figures: the backing decides
        else:
            room = min(self.machine_free) - self.machine_reserve
        return need + undo if taken <= room else None

    def _speculate(self, b: int, probe: bool = False, grads: dict | None = None) -> None:
        if not probe and not self._fits(b):
            self.counts["deferred_buckets"] += 1
            return  # stepped at step()
        cast_fp32 = self.opt._cast_grads_fp32(self.buckets[b])
        need = self._host_admits(b, cast_fp32, probe)
        if need is None:
            self.counts["deferred_buckets"] += 1
            return  # stepped at step() (Note [Speculation and host memory])
        params = self.buckets[b]
        try:
            self.opt._prepare_state(params)
        except torch.OutOfMemoryError:
            self.counts["deferred_buckets"] += 1
            return  # no room for its state: step() makes it, or says why it cannot
        try:
            parts = self.opt._engine_parts(params, step_increment=1, grads=grads)
        except torch.OutOfMemoryError:
            self.counts["deferred_buckets"] += 1
            return  # a master's check found no room (Note [A written parameter is its master's new value]): step() steps it
        if parts is None:
            return
        spec = _C._AdamSpeculation(self.owner, parts, cast_fp32, probe)
        self.admitted.append((spec, need))
        _C._engine_speculate(spec, probe, grads_pending=grads is None)
        self.specs[b] = _Speculation(spec, probe)
        self.outstanding.append(self.specs[b])
        if not probe:
            self.last_spec = spec
        self.counts["probed_buckets" if probe else "speculated_buckets"] += 1

    # ---- step() ----

    def step(self) -> None:
        """Queues the step of every bucket in forward order; returns before they run."""
        self._reconcile()
        self.raise_failure()
        if not self.ddp_tried and self.can_speculate and self.opt._engine_can_speculate():
            # After the first backward, between backwards (Note [Speculation under DDP]).
            from . import distributed as _dist

            self.ddp_tried = True
            self.ddp = _dist.attach_ddp_hook([p for g in self.opt.param_groups for p in g["params"]])
            if self.ddp is not None:
                self.ddp.poll = weakref.WeakMethod(self._poll_reduced)
            self.probe_bucket = None
        self._plan()
        # Before any step is queued, in the tiers the plan chose (tail buckets: hbm): the state
        # of every parameter to step, or an error that leaves parameters, state and counts as
        # they were (Note [State and out of memory] in optim.py).
        self.opt._prepare_state([p for b in self.buckets for p in b if p.grad is not None])
        if self.buckets and self.can_speculate and self.opt._engine_can_speculate():
            self._host_sample()  # the gradients are in (Note [Speculation and host memory])
        self._mark_leads()
        if self.lean and self.can_speculate and self.fired and not self.multi_backward and self.buckets:
            s = _C._engine_stats(self.owner)
            self.lean_mark = (s["exposed_seconds"], s["optimizer_seconds"])
            self.counts["lean_steps"] += 1
        # The tail buckets' step is bound (staged) before anything is queued: where it cannot
        # be, step() raises having changed nothing (Note [A step is all or nothing]).
        tail_parts = []
        for b in reversed(range(self.tail)):
            params = [p for p in self.buckets[b] if p.grad is not None]
            if params:
                tail_parts += self.opt._engine_parts(params, step_increment=1)
        tail_step = self.opt._engine_prepare_inline(tail_parts) if tail_parts else None
        # Every other bucket's arguments too, before a count advances or a job is queued: an
        # argument that cannot be converted (a tensor lr of several elements) raised after the
        # counts had advanced and some buckets were queued (found by review).
        queued = []
        for b in reversed(range(self.tail, len(self.buckets))):
            params = [p for p in self.buckets[b] if p.grad is not None]
            if params:
                queued.append((b, params, self.opt._engine_parts(params, step_increment=1),
                               self.opt._engine_token(params)))
        self.opt._engine_advance_steps()
        for b, params, parts, token in queued:
            spec = self.specs.get(b)
            if spec is not None and len(params) == len(self.buckets[b]):
                self.jobs[_C._engine_validate(spec.spec, parts)] = (params, token, spec)
                spec.stepped = True
            else:
                if spec is not None and not spec.probe:
                    _C._engine_rollback(spec.spec)
                    spec.stepped = True
                self.jobs[self.opt._engine_submit(parts)] = (params, token, None)
        if tail_step is not None:
            # The executor steps the tail buckets inline: the next forward starts with them.
            t0 = time.perf_counter()
            tail_step.run()
            self.inline_seconds += time.perf_counter() - t0
        self.opt._stepped([p for b in self.buckets for p in b if p.grad is not None])
        self._end_step(stepped=True)

    def _end_step(self, stepped: bool) -> None:
        # Nothing here may hold a gradient past step(): the speculations stay in `outstanding`
        # until the next backward, and gradients they held stayed in hbm through the next
        # forward beside its activations.
        self.awaiting, self.reduced = [], {}
        if self.ddp is not None:
            # Until the next backward: a rank that joined early runs DDP's hook on zero buckets.
            self.ddp.listening = False
            self.ddp.ready.clear()
        self.specs = {}
        self.fired, self.grad_versions = {}, {}
        self.ready = {}
        self.ready_ok, self.exposed_at = set(), {}
        self.last_spec = None
        if stepped:
            self.host_used = [0, self.host_used[0]]  # this iteration's samples become the last's
            self.machine_free = [math.inf, self.machine_free[0]]
            self.counts["steps"] += 1

    def _exposed(self) -> float:
        return _C._engine_stats(self.owner)["exposed_seconds"]

    @staticmethod
    def _record(events: dict, key, device) -> None:
        ev = events.get(key)
        if ev is None:
            ev = events[key] = _timing_event(device)
        ev.record()

    def _mark_leads(self) -> None:
        """At step(): the leads of this backward's buckets end now (Note [Speculation budget])."""
        self.leads_due = None
        if self.multi_backward or not self.ready_ok:
            return  # accumulation: no speculation, and the first backward's times say nothing
        if self.step_ev is None:
            self.step_ev = _timing_event(self.ready_ev[next(iter(self.ready_ok))].device)
        self.step_ev.record()
        exposed = self._exposed() if self.exposed_at else 0.0
        self.leads_due = ({b: self.exposed_at.get(b) for b in self.ready_ok}, exposed)
        self._read_leads()  # the CPU executor's events are complete at once

    def _read_leads(self) -> None:
        """Each bucket's time from its last gradient to step(), once the events have run."""
        if self.leads_due is None or not self.step_ev.query():
            return  # not yet: the next backward, or the one after, reads them
        due, exposed = self.leads_due
        self.leads_due = None
        for b, exposed_then in due.items():
            ev = self.ready_ev.get(b)
            if ev is None or not ev.query() or b >= len(self.buckets):
                continue
            lead = ev.elapsed_time(self.step_ev) / 1e3
            if exposed_then is not None:
                lead -= exposed - exposed_then
            old = self.lead.get(b)
            # Shorter at once, longer only halfway: a late step() once is no promise.
            self.lead[b] = lead if old is None else min(lead, 0.5 * (old + lead))

    def _plan(self) -> None:
        """(Re)builds the buckets when a parameter that has a gradient is in none of them.

        Not when one of theirs has none this step (an MoE expert no token chose, a block
        LayerDrop skipped): step() steps the parameters with gradients of each bucket, and a
        bucket speculates once all of its parameters have theirs. Rebuilt on every change of
        that set, the buckets changed at every step of such a model, and each rebuild rolled
        back the speculations of its backward (found by review: LayerDrop 0.3, 20 rebuilds in
        20 steps, every speculation rolled back)."""
        with_grad = [p for g in self.opt.param_groups for p in g["params"] if p.grad is not None]
        known = set(self.bucket_of)
        if self.buckets and known.issuperset(with_grad):
            return
        # This backward's speculations were made for the old buckets, whose state is about to
        # change tiers: undo them first; every bucket is then stepped plainly below.
        for s in self.specs.values():
            if not s.stepped:
                _C._engine_rollback(s.spec)
        self.specs = {}
        seen = set(self.order)
        order = [p for p in self.order if p.grad is not None]
        # With those of the old buckets that have no gradient this step: they keep a bucket.
        members = [p for g in self.opt.param_groups for p in g["params"] if p.grad is not None or p in known]
        order += [p for p in reversed(members) if p not in seen]
        size = self.bucket_bytes()
        self.buckets, cur, cur_bytes = [], [], 0
        for p in order:
            cur.append(p)
            cur_bytes += p.numel() * p.element_size()
            if cur_bytes >= size:
                self.buckets.append(cur)
                cur, cur_bytes = [], 0
        if cur:
            self.buckets.append(cur)
        self.bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.bucket_elements = [sum(p.numel() for p in bucket) for bucket in self.buckets]
        self._forget_leads()
        self.tail = self.opt._engine_place_state(self.buckets, self._choose_tail())
        self.bucket_staged = [self._staged_bytes(bucket) for bucket in self.buckets]
        self.specs = {}
        self.probe_bucket = None

    def _staged_bytes(self, bucket) -> int:
        """What the CPU step of `bucket` stages (Note [An undo needs no memory]): its strided
        parameters, and with the CUDA executor its hbm ones."""
        from . import tier_of
        from . import distributed as _dist

        local = (p.to_local() if _dist.is_dtensor(p) else p for p in bucket)
        return sum(t.numel() * t.element_size() for t in local if t.device.type == "superchip"
                   and (not t.is_contiguous() or (self.stage_hbm and tier_of(t) == "hbm")))

    def forget_buckets(self) -> None:
        """The parameters changed (a new param group): step() plans the buckets again."""
        self.buckets, self.bucket_of, self.bucket_elements, self.bucket_staged = [], {}, [], []
        self._forget_leads()

    def _forget_leads(self) -> None:
        # Bucket indices change meaning: what was measured or recorded for them is void.
        self.lead, self.ready_ev, self.ready_ok, self.exposed_at, self.leads_due = {}, {}, set(), {}, None

    def bucket_bytes(self) -> int:
        if self.bucket_bytes_arg is not None:
            return int(self.bucket_bytes_arg)
        # Enough buckets to overlap (about 16 per model), each large enough to amortise a job.
        total = sum(p.numel() * p.element_size() for g in self.opt.param_groups for p in g["params"])
        return int(min(max(total // 16, 1 << 20), 64 << 20))

    def _choose_tail(self) -> int:
        if self.tail_arg is not None:
            return min(int(self.tail_arg), len(self.buckets))
        # Cost model: a tail bucket is stepped by the executor instead of the CPU. With the CPU
        # executor both are the same cores, so inline stepping only adds to the critical path.
        if _C._executor() == "cpu" or not self.buckets:
            return 0
        # One tail bucket where hbm has room for its state beside the step's measured peak
        # (weights, activations, gradients; with weights streamed the peak is near the budget,
        # and a tail there would only push the next pass's activations out of hbm). At most
        # 16 B per parameter: fp32 master, two moments, amsgrad's max.
        from . import memory_stats

        stats = memory_stats(self.buckets[0][0].device)
        if stats["hbm.capacity_bytes"] == 0:  # no budget set: the device's own memory decides
            return 1
        room = stats["hbm.capacity_bytes"] - stats["hbm.peak_allocated_bytes"]
        need = 16 * sum(p.numel() for p in self.buckets[0])
        return 1 if need <= room else 0

    # ---- outside step() ----

    def rollback_unstepped(self, skipped: bool) -> None:
        """Undoes speculation whose step() never came (zero_grad, state_dict, a skipped step)."""
        self._reconcile()
        unstepped = [s for s in self.specs.values() if not s.stepped]
        for s in unstepped:
            _C._engine_rollback(s.spec)
        if self.fired and skipped:
            # A backward() whose step() never came (GradScaler's overflow step, or a user's).
            self.counts["skipped_steps"] += 1
            self.multi_backward = True  # a backward without its step: the predictor backs off
        self._end_step(stepped=False)

    def synchronize(self) -> None:
        _C._engine_synchronize(raise_errors=False)  # another optimizer's error is its own
        self._reconcile()
        self.raise_failure()

    def raise_failure(self) -> None:
        """Raises the error of a queued step of this optimizer that failed (Note [A job of the
        asynchronous step that fails]), once: from its next step(), before that changes
        anything, from its synchronize, or from the first torch.superchip.synchronize()."""
        _C._engine_raise_error(self.owner)

    def _reconcile(self) -> None:
        """Restores the bookkeeping of queued steps that failed on the worker (Note [A job of
        the asynchronous step that fails], backend/python/EngineModule.cpp) and forgets the
        jobs that have run."""
        failed, done = _C._engine_failures(self.owner)
        for ticket in failed:
            job = self.jobs.pop(ticket, None)
            if job is None:
                continue  # not a step (a snapshot, a rollback)
            params, token, spec = job
            if spec is not None and spec in self.outstanding:
                self.outstanding.remove(spec)  # no outcome to count
            if spec is not None and spec.spec.status() == _SPECULATED:
                # Its undo failed too (it needs no memory: a broken device): the step stands.
                # A comparison that failed undoes the step (Note [A validation that fails]).
                continue
            self.opt._engine_unstep(params, token)
            self.counts["failed_buckets"] += 1
        if self.jobs:
            self.jobs = {t: j for t, j in self.jobs.items() if t > done}

    def stats(self) -> dict:
        # Complete counters (every queued job run), without charging this wait as exposed time:
        # reading the counters each step must not change them.
        _C._engine_synchronize(charge_exposed=False, raise_errors=False)
        self._reconcile()
        self.raise_failure()
        self._harvest()
        s = _C._engine_stats(self.owner)
        elements = max(self.counts["undo_elements"], 1)
        return dict(
            buckets=len(self.buckets),
            tail_buckets=self.tail,
            speculated_buckets=self.counts["speculated_buckets"],
            rolled_back_buckets=self.counts["rolled_back_buckets"],
            probed_buckets=self.counts["probed_buckets"],
            deferred_buckets=self.counts["deferred_buckets"],
            abandoned_buckets=self.counts["abandoned_buckets"],
            failed_buckets=self.counts["failed_buckets"],
            lean_steps=self.counts["lean_steps"],
            steps=self.counts["steps"],
            skipped_steps=self.counts["skipped_steps"],
            optimizer_seconds=float(s["optimizer_seconds"] + self.inline_seconds),
            exposed_seconds=float(s["exposed_seconds"] + self.inline_seconds),
            undo_bytes_per_param=self.counts["undo_bytes"] / elements,
            undo_escapes_per_param=self.counts["undo_escapes"] / elements,
        )

"""The places where Inductor chooses code-generation semantics by device *type*.

Note [Why superchip patches Inductor]
Inductor picks a device's kernels through its registered Scheduling, but a few decisions
still compare the device type with a fixed list instead of asking the registration:

1. ``torch._inductor.utils.get_current_backend(device_type)`` answers "cpp" only for
   ``"cpu"`` and ``config.cuda_backend`` ("triton") for any other type. The kernel code
   generator reads it while it generates a kernel (``CSEProxy`` propagates dtypes the C++ way
   only when it says "cpp"); a C++ kernel generated with the Triton answer loses the dtypes of
   indirect indices and fails (``assert var.dtype is not None`` in ``CppKernel``).
2. ``torch._inductor.scheduler.BaseSchedulerNode.is_cpu()`` is ``device.type == "cpu"``. The
   scheduler uses it to keep loop reordering, loop inversion and pointwise reindexing (which
   only the Triton path supports) away from C++ kernels; without it fusion of a superchip
   reduction fails (``TypeError: can't multiply sequence`` in
   ``_try_reindex_pointwise_for_reduction``).
3. (CUDA executor only, untested: no GPU in CI) ``DeviceProperties.create(device)`` records
   ``device.type`` as the target Triton compiles for (``GPUTarget``), and Triton knows no
   "superchip" target. Superchip devices get CUDA device i's properties record instead.
4. ``torch._inductor.ir.is_cpu(node)`` picks the realization thresholds (when a pointwise
   result reused by several consumers, or one with many reads or a large inner function, is
   stored instead of recomputed in each consumer): the CPU's or the GPU's. With the CPU
   executor superchip got the GPU's: rotary-embedding cos/sin recomputed inside each consumer
   kernel, other kernel groupings, so autocast-fp16 training differed from compiled CPU in the
   last bits from the first step (seen by a user-flow probe). It answers as for the executor.
   Only a heuristic: where a torch lacks the function, nothing is patched.
5. Activation checkpointing under compile (``torch.utils.checkpoint``, HF's
   ``gradient_checkpointing_enable()``) wraps each random op of a recomputed region (dropout,
   and SDPA, whose dropout argument makes it one) in the higher-order ops
   ``run_and_save_rng_state`` / ``run_with_rng_state`` (torch/_prims/rng_prims.py), so the
   recomputation draws the same numbers. Their device choice is a fixed map (cpu, cuda, hpu,
   xpu) and anything else fails: ``AssertionError: Backend not supported for superchip``
   (seen by a user-flow probe: compiled HF Llama with gradient checkpointing). Superchip's
   default generator is its executor's (backend/runtime/SuperchipGenerator.h), so for
   superchip tensors these ops save and restore ``torch.superchip``'s RNG state, in the
   backend choice, the fake-tensor rule, the tracing rule (``make_fx``) and a PrivateUse1
   kernel; other devices keep theirs.
   Where a torch lacks these names, nothing is patched (that error stays).
6. The fake-tensor rule of convolution (torch/_subclasses/fake_impls.py) predicts the layout of
   its output from ``torch._C._select_conv_backend`` on the fake inputs: for a superchip
   device that is ``Overrideable``, whose layout is contiguous, where the executor's kernel
   (oneDNN on the CPU, cuDNN on CUDA) returns channels_last for a channels_last input or
   weight. Compiled graphs then failed their stride check (``assert_size_stride``:
   ``expected size 32==32, stride 1==256``) at every conv net Inductor's layout optimization
   made channels_last (a conv net under ``no_grad``) and at every channels_last conv net
   trained compiled (found by review). The two functions answer for superchip fake tensors as
   for the same fake tensors on the executor's device.
7. The scheduler flushes the pending kernels of a device before an extern call only for a
   node that has a device. Event and stream ops (``torch.ops.streams.record_event``, which a
   compiled region's ``torch.Event.record()`` becomes, or compiled autograd tracing a gradient
   hook that records one) have none, and the C++ backend holds its kernels until a flush: the
   event's call was written first, then the frees of the kernel's inputs, then the kernel
   (``UnboundLocalError: arg0_1``, found by review). For superchip graphs the scheduler now
   flushes before such a call too. CUDA's and CPU's graphs are untouched (Triton kernels are
   written at once, and the CPU has no events).

8. ``torch._inductor.utils.device_need_guard(device_type)`` (imported by name into the
   scheduler) is true for GPU types only, and the wrapper declares a graph's streams
   (``default_stream``, ``stream1`` = the user's stream) inside the device guard. A compiled
   region with ``with stream:`` on superchip had its kernels written under ``with stream1:``
   without the declaration (``NameError: name 'stream1' is not defined``, found by running
   Inductor's own tests on superchip). Superchip graphs get a device guard
   (``torch.superchip.device(i)``), which also runs a graph on ``superchip:1`` with that device
   current. Torch 2.12's wrapper names the default stream ``torch.cuda.current_stream()``
   and enters a user's stream with ``torch.cuda.stream(stream1)``, whatever the device ("Found
   no NVIDIA driver" with the CPU executor, found by running the suite on 2.12); for superchip
   graphs they are written as 2.13 writes them (``torch.superchip.current_stream()``,
   ``with stream1:``).
9. ``Scheduler``'s combo-kernel grouping (``config.combo_kernels``) leaves out nodes on
   ``"cpu"`` (the C++ backend has no combo kernels) and grouped superchip ones with the CPU
   executor: compilation failed (``AssertionError: type(self)=<class 'Scheduler'>``). Groups of
   superchip nodes are dropped as CPU ones are; with the CUDA executor they stay (Triton has
   combo kernels). Likewise ``config.benchmark_fusion``: ``Scheduler.speedup_by_fusion``
   fuses CPU nodes without benchmarking (the C++ backend has no kernel benchmark) and tried to
   benchmark superchip ones as Triton kernels (``No module named 'triton'``); superchip nodes
   with the CPU executor are fused as CPU ones are.
10. Fake-tensor rules (``torch._meta_registrations``) pick the layout of some results by
   ``device_hint(tensor)``: the device type, ``"cpu"`` for CPU's kernels. For superchip it
   answered ``"superchip"`` and the rule took the non-CPU side where the executor's kernel is
   the CPU's: ``nonzero_static`` predicted column-major strides, ``pixel_shuffle`` of a
   channels_last input a contiguous result, ``_embedding_bag`` an empty ``bag_size``, and
   compiled ``nonzero_static`` failed its stride check. It answers the executor's type, except
   in ``histc``'s rule: superchip counts integers with either executor (Note [Integer histc]),
   where the CPU's kernel refuses them, and the executor's answer made compiling every
   transformers MoE model (its experts count tokens with an integer ``histc`` on any device
   but the CPU) fail ("histogram_cpu" not implemented for 'torch.int32'). This
   and points 5, 6 and 12 are rules torch uses outside compile too (``torch.export``, ``make_fx``,
   DTensor's propagation): ``apply_fake_rules()`` applies them at ``import superchip``.
11. Dynamo's device interfaces are read once (``get_registered_device_interfaces()``, for its
   handlers of ``torch.<device>.stream``), at the first trace: the interface registered with
   Inductor's backend, after that trace, came too late, and ``get_interface_for_device
   ("superchip")`` failed before the first compile. ``superchip/_inductor/__init__.py``
   registers the interface when ``torch._dynamo.device_interface`` is imported
   (``register_interface_when_dynamo_loads``).
12. (CPU executor) superchip registers a C++ ``dropout`` for AutogradPrivateUse1 that runs the
   CPU's composite in eager mode (Note [Dropout on the CPU executor], backend/native/Dropout.h).
   Tracing (AOTAutograd, ``make_fx``) resolves a key's C++ kernel before torch's Python
   decomposition of ``dropout``, so compiled superchip graphs drew ``rand < 1 - p`` where
   compiled CPU graphs decompose to ``native_dropout`` and draw ``rand > p``: the complement
   mask, so compiled dropout and checkpointed random ops no longer gave compiled CPU's bits.
   While tracing, superchip takes torch's decomposition, as the CPU does.
13. The convolution lowering (torch/_inductor/kernel/conv.py) peels the bias off a convolution on
   any device but the CPU ("cudnn is slower with it"): the convolution's result rounded to its
   dtype, then the bias added in a kernel of its own and rounded again. With the CPU executor,
   compiled bf16 convolutions with a bias differed from compiled CPU's (up to 0.125 for
   conv2d) and took an extra pass over the output (found by Inductor's OpInfo test in bf16 on
   superchip). The lowering's device type answers as for the executor.
14. The ``cat`` lowering (torch/_inductor/lowering.py) lowers a concatenation on the CPU to a
   ``ConcatKernel`` (its inputs written into the output's slices, each computed once: "negative
   performance impact of pointwise_cat optimization on CPU") and on other devices, often, to a
   pointwise kernel that recomputes each input inside it. Superchip with the CPU executor took
   the pointwise side: other kernels than compiled CPU's, and ``torch.diff`` with prepend and
   append in bf16 differed from it (an intermediate rounded to bf16; found by the same run).
   Its device check answers as for the executor.

15. (torch 2.11; Dynamo, whatever the backend) The guard builder describes an identity guard
   (``ID_MATCH``) with ``repr(val)`` of the guarded object, and a compiled ``torch.optim`` step
   guards each parameter by identity: printing a parameter reads its values (slices, a cat, and
   a whole-tensor cast for bf16). For superchip weights in host, every compile of a step staged
   each weight into hbm for nothing, and the streaming plan learned the guard builder's reads
   as the training loop's period: it streamed from the first step with an order the loop did
   not follow, mispredicted, and recorded again (a compiled SGD step at 4x the budget was still
   recording at its sixth step; eagerly, and on 2.13, it streams from the fourth). 2.13 writes
   the object's type instead. For superchip tensors the description gives the type on 2.11
   too; other objects keep their repr. Where the source lacks that expression, nothing is
   patched. Applied when ``torch._dynamo.guards`` is first imported (an import hook, as for
   point 11) and with Inductor's registration.
16. (CPU executor) max-autotune benchmarks the choices of an operator that has more than one
   (``addmm`` with a broadcast bias: ATen's ``addmm`` and ``bias_addmm``; on 2.11 every
   ``nn.Linear``) with a benchmark request picked by device type: the CPU's for ``"cpu"``, the
   GPU's (CUDA events on the current CUDA device) for anything else. Superchip took the GPU's:
   every choice failed ("Torch not compiled with CUDA enabled", "Found no NVIDIA driver") and
   the compile with it (``NoValidChoicesError``, or ``Incorrect result from choice``). A GPU
   request whose tensors are superchip's is timed as the CPU's is. Inductor's autotuning cache
   keeps the timings of a failed run (all infinite): compiles of the same shapes on a machine
   that ran into this keep failing until that cache is cleared (``TORCHINDUCTOR_CACHE_DIR``).
17. A pointwise lowering (``make_pointwise`` in torch/_inductor/lowering.py) puts its result on
   the first operand whose device type ``is_gpu`` names, else on the first operand's device: a
   CPU 0-dim tensor times a superchip tensor (``torch.tensor(2.0) * x``, a scalar the user or a
   scheduler keeps on the CPU) gave a compiled graph whose result was a CPU tensor, where
   eager gives a superchip one (found by a review of Inductor's device checks; with the CUDA
   executor the C++ kernel would have read CUDA memory). For that choice, and only there
   (``lowering.is_gpu`` has no other caller), superchip counts as an accelerator, as eager's
   type promotion treats it: the result is superchip's.
18. (torch 2.11) ``_scaled_dot_product_fused_attention_overrideable_backward``, the backward of
   the attention entry superchip's SDPA takes (the fused entry a PrivateUse1 device gets), has
   no meta function in 2.11 (2.13 has one). Fake tensors then ran the real kernel on zero-filled
   superchip tensors at every trace of a compiled attention backward (a whole attention
   backward at compile time, on the executor's device; found by the emulated flash-entry test
   on 2.11, whose kernel was called three times more than the graph calls it). Where a torch
   lacks it, superchip registers 2.13's: gradients shaped and strided like the inputs. Applied
   at ``import superchip`` with the other fake rules.
19. (CUDA executor only, untested: no GPU in CI; found by a review of Inductor's device checks)
   Two more questions Inductor asks of a device type get "no" for superchip where the answer
   for its Triton kernels is CUDA's. ``BaseSchedulerNode.is_gpu()``: only GPU nodes have their
   0-dim CPU inputs computed in the graph passed to a Triton kernel as scalars
   (``update_zero_dim_cpu_tensor``); a superchip kernel was passed the CPU buffer's pointer.
   ``ir.is_triton(device)`` (by name in ``lowering`` and ``kernel.mm`` too) answers from the
   device's registered Scheduling class, and superchip's, ``CUDACombinedScheduling``, is not
   a ``TritonScheduling``: ops Triton cannot generate (``digamma``, ``i0e``, ``zeta``, ...)
   were lowered to Triton and failed instead of falling back to ATen. Both answer as for
   ``"cuda"``.
20. Heuristics that choose other arithmetic for the CPU than for any other device. A division
   by a constant (``div_prim`` in torch/_inductor/lowering.py) stays a division on the CPU and
   becomes a multiplication by the reciprocal elsewhere (pytorch#157959: "precision issues");
   reductions of at most ``config.cpp.use_two_step_variance_threshold`` elements (LayerNorm
   statistics of short rows) take two-step statistics on the CPU and Welford elsewhere
   (``use_two_step_variance``, 2.12 on); a matmul with one row and a tiny ``mm``/``addmm``/
   ``bmm`` becomes a sum of products on the CPU and stays ATen's kernel elsewhere
   (torch/_inductor/decomposition.py); a graph with convolutions goes channels_last on the CPU
   (oneDNN's layout, ``GraphLowering.decide_layout_opt``); GroupNorm decomposes to the CPU
   kernel's per-channel scale and shift on the CPU (``torch._refs.native_group_norm``).
   Superchip with the CPU executor took the other side: ``x / 3.0`` compiled was 1 ulp off
   compiled CPU (and eager) for some elements; the demo GPT, compiled and trained (the test's
   six steps), had 196 of its 202 losses, gradients and weights off compiled CPU's in the last
   bits, and 194 with dynamic shapes; a small conv net (convolutions, BatchNorm, GroupNorm), 34
   of its 36 losses and gradients. Each check answers as for the executor; with the CPU
   executor that GPT training and the conv net now give compiled CPU's bits (the GPT with
   ``torch.use_deterministic_algorithms(True)``: compiled embedding backward adds rows with
   atomics from several threads, on the CPU as well, so without it rare calls differ in the
   last bits on either device). With the CUDA executor the same rewrites give superchip
   CUDA's side of the checks for ``"cuda"`` that 2.12 and 2.13 add (below).

21. FlexAttention (``torch.nn.attention.flex_attention``) accepts a fixed list of device types
   (``_validate_device``: "FlexAttention is only supported on CUDA, CPU, HPU, or MPS
   devices. Found input tensors on superchip device"), so a model with
   ``attn_implementation="flex_attention"`` (transformers) or a hand-written ``flex_attention``
   call did not run on superchip, eager or compiled (found by a user-flow probe). The check,
   the kernel options it sets for the CPU (no logsumexp output for inference, no max scores:
   ``_apply_kernel_options``) and the lowering's choice between the C++ template and the
   Triton templates (``torch._inductor.kernel.flex.flex_attention.flex_attention``) answer for
   superchip as for its executor: with the CPU executor, inference as on the CPU (the CPU has
   no FlexAttention backward, and superchip refuses one with the CPU's reason) and the CPU's
   bits, eager and compiled; with the CUDA executor, training as on CUDA (eager: torch's dense
   implementation, device-generic; compiled: the Triton templates, with CUDA's table of block
   sizes and warps, ``InductorChoices.get_config_heuristics``, where superchip got the generic
   one; untested: no GPU in CI).
   The eager half is patched at ``import superchip`` (``torch.nn.attention.flex_attention``
   imports no Dynamo), the lowering with Inductor's registration; on a torch whose sources
   lack these expressions FlexAttention keeps torch's refusal of superchip.

The rewrites of points 13, 14 and 20 change expressions in a copy of the function's code
(``_rewrite_code``); where a torch's source lacks one, ``apply()`` raises (point 20 expects
some only from 2.12). Point 15 uses the same rewrite.

The first three answer about the code generator and the fourth picks a heuristic, so for
superchip they should answer as for its executor (``"cpu"`` or ``"cuda"``); the patches below
do exactly that and nothing for other devices.
``get_current_backend`` is imported by name into three modules besides its own, hence four
rebinds.

Other ``device.type == "cpu"`` checks in Inductor choose speed or kernel shape (max-autotune's
C++ GEMM template, which superchip lacks: ATen's mm only; a pad lowered as a cat; how
arg-reductions index non-contiguous inputs; whether grid sampling expands its grid), and
superchip takes their non-CPU side, which generates correct code. One more picks arithmetic
and is left as is because training never reaches it: the lowering of
``quantize_per_tensor.tensor`` (quantized inference) rounds with an FMA on the CPU only.
torch's decompositions (torch/_decomp) have a few more: bicubic coefficients by the CPU's
formula (the same bits either way for the grid_sample tried), the saved statistics of batch
and layer norm (superchip follows CUDA's rule by design, Note [Norm statistics]) and an LSTM
path for the CPU (superchip runs CUDA's fused cells, as the README says). For the example GPT
at the demo's size the generated code has the CPU's kernels, extern calls and allocations, and
the CPU's bits (point 20).

With the CUDA executor, Inductor still takes the non-GPU side of a few checks that only cost
speed (``is_gpu`` in torch/_inductor/utils.py and compile_fx.py): superchip inputs are taken
for unaligned (no 16-byte divisibility hints in Triton kernels), max-autotune has no Triton
GEMM templates, and mix-order reductions and online softmax stay off. Left for a GPU run to
measure (bench/compile.py against compiled CUDA): assuming alignment needs the runtime check
that goes with it, and neither can be tried here. Torch 2.12 and 2.13 (not 2.11, the GPU
image's) also key a few numerics of their lowerings on ``device.type == "cuda"``: FMA in
``addcmul`` and ``addcdiv`` (2.12 on) and two-step variance for bf16/fp16 (2.13) answer as for
the executor with point 20's rewrites (untested: no GPU in CI). Two are left: FMA for
add-with-alpha (2.13) sits in a closure made for every pointwise lowering at import, which a
code rewrite cannot reach, and ``config.align_random_eager`` (2.13) would need CUDA's launch
geometry for superchip's devices; with the CUDA executor on 2.13 those compiled superchip
graphs may differ from compiled CUDA's in the last bits. And the ``addcmul``/``addcdiv``
lowerings put their result on ``self``'s device, a CPU one for a CPU 0-dim ``self`` (eager:
the other operands'): torch's own bug, for CUDA too; left as is.

Tested on torch 2.13 and, with the CPU executor, 2.11 and 2.12; the checked range is the one
superchip supports (2.11 to 2.13). Outside it, or when a patched name is missing, ``apply()`` raises
instead of guessing.
"""

from __future__ import annotations

import importlib

import torch

import superchip

_SUPPORTED = ((2, 11), (2, 13))
_applied = False


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def executor_type(device_type: str) -> str:
    """The device type whose code generation a device type gets: superchip's executor's."""
    return superchip.executor() if device_type == "superchip" else device_type


def _rewrite_code(function, *replacements: tuple[str, str], every: bool = False) -> None:
    """Points 13 to 15 and 20: gives ``function`` (under any wrapper registered around it)
    the code of its own source with each ``(old, new)`` of ``replacements`` applied: the one
    expression ``old`` replaced by ``new`` (``every``: each of its occurrences, at least one).
    Its code object is swapped in place, so the registered wrapper, the module's name and
    recursive calls all get it; globals, defaults and line numbers stay the function's."""
    import inspect
    import textwrap

    function = inspect.unwrap(function)
    if getattr(function, "_superchip_rewritten", False):
        return
    lines, first = inspect.getsourcelines(function)
    source = textwrap.dedent("".join(lines))
    for old, new in replacements:
        if source.count(old) != 1 and not (every and source.count(old) > 1):
            raise RuntimeError(f"superchip: {function.__module__}.{function.__qualname__} does not "
                               f"hold {old!r} {'at all' if every else 'once'}; check "
                               "superchip/_inductor/patches.py")
        source = source.replace(old, new)
    # The decorators (register_lowering) are not run again: the code starts at the def.
    start = source.index("def " + function.__name__)
    offset = first - 1 + source[:start].count("\n")
    module = compile("\n" * offset + source[start:], function.__code__.co_filename, "exec")
    code = next(c for c in module.co_consts if getattr(c, "co_name", None) == function.__name__)
    if code.co_freevars != function.__code__.co_freevars:
        raise RuntimeError(f"superchip: cannot rewrite {function.__qualname__}; check superchip/_inductor/patches.py")
    function.__code__ = code
    function._superchip_rewritten = True


_EXECUTOR_TYPE = '__import__("superchip._inductor.patches", fromlist=["executor_type"]).executor_type'


def _patch_lowering_device_checks() -> None:
    from torch._inductor import lowering
    from torch._inductor.kernel import conv

    # Point 13.
    _rewrite_code(conv.convolution, ("device_type = ir.get_device_type(x)",
                                     f"device_type = {_EXECUTOR_TYPE}(ir.get_device_type(x))"))
    # Point 14.
    _rewrite_code(lowering.cat, ('cpu_device = inputs[0].get_device().type == "cpu"',
                                 f'cpu_device = {_EXECUTOR_TYPE}(inputs[0].get_device().type) == "cpu"'))


def _patch_heuristics_device_checks() -> None:
    """Point 20: the heuristics that pick other arithmetic or layout for the CPU answer for the
    executor."""
    from torch._inductor import decomposition, lowering

    ex = _EXECUTOR_TYPE
    since_2_12 = _torch_version() >= (2, 12)  # 2.11 lacks the checks under it
    _rewrite_code(lowering.div_prim, ('a.get_device().type != "cpu"', f'{ex}(a.get_device().type) != "cpu"'))
    if since_2_12:
        # The CPU's threshold; on 2.13 also CUDA's two-step statistics for bf16/fp16.
        _rewrite_code(lowering.use_two_step_variance, ("device.type", f"{ex}(device.type)"), every=True)
        # CUDA's FMA in addcmul and addcdiv (CUDA executor).
        for function in (lowering.addcmul, lowering.addcdiv):
            _rewrite_code(function, ('device.type in ["cuda", "xpu"]', f'{ex}(device.type) in ["cuda", "xpu"]'))
    _rewrite_code(decomposition.mm, ("self.device.type", f"{ex}(self.device.type)"), every=True)
    _rewrite_code(decomposition.bmm, ("self.device.type", f"{ex}(self.device.type)"), every=True)
    _rewrite_code(decomposition.addmm, ("self.device.type", f"{ex}(self.device.type)"),
                  *([("mat1.device.type", f"{ex}(mat1.device.type)")] if since_2_12 else []),
                  every=True)
    # Layout optimization: with oneDNN, graphs with convolutions on the CPU go channels_last.
    from torch._inductor import graph

    _rewrite_code(graph.GraphLowering.decide_layout_opt,
                  ('n.args[idx].meta["val"].device.type in SUPPORTED_MKLDNN_DEVICES',
                   f'{ex}(n.args[idx].meta["val"].device.type) in SUPPORTED_MKLDNN_DEVICES'))
    # GroupNorm's decomposition follows the CPU kernel's formula (a scale and shift per channel)
    # on the CPU: the kernel eager superchip runs with the CPU executor.
    from torch import _refs

    _rewrite_code(_refs.native_group_norm, ('input.device.type == "cpu"', f'{ex}(input.device.type) == "cpu"'))


_GUARD_REPR_OLD = "type_repr = repr(val)"


def guard_repr(val) -> str:
    """Point 15: how a guard describes ``val``; a superchip tensor by its type, without reading
    its values."""
    if isinstance(val, torch.Tensor) and val.device.type == "superchip":
        return repr(type(val))
    return repr(val)


def patch_guard_repr() -> None:
    """Point 15. Idempotent; nothing on a torch outside the checked range or without the
    expression."""
    import inspect

    if not (_SUPPORTED[0] <= _torch_version() <= _SUPPORTED[1]):
        return
    from torch._dynamo import guards

    method = getattr(guards.GuardBuilder, "id_match_unchecked", None)
    if method is None or _GUARD_REPR_OLD not in inspect.getsource(method):
        return
    _rewrite_code(method, (_GUARD_REPR_OLD, 'type_repr = __import__("superchip._inductor.patches", '
                                            'fromlist=["guard_repr"]).guard_repr(val)'))


def apply() -> None:
    global _applied
    if _applied:
        return
    version = _torch_version()
    if not (_SUPPORTED[0] <= version <= _SUPPORTED[1]):
        raise RuntimeError(
            f"superchip: torch.compile support is written for torch "
            f"{_SUPPORTED[0][0]}.{_SUPPORTED[0][1]} to {_SUPPORTED[1][0]}.{_SUPPORTED[1][1]}; "
            f"torch {torch.__version__} needs the patches in superchip/_inductor/patches.py "
            "checked again."
        )
    _patch_get_current_backend()
    _patch_is_cpu()
    _patch_ir_is_cpu()
    apply_fake_rules()
    if _fake_rules_error is not None:
        raise _fake_rules_error
    _patch_flush_before_deviceless_extern()
    _patch_device_guard()
    _patch_combo_kernel_groups()
    _patch_extern_benchmarks()
    _patch_lowering_device_checks()
    _patch_heuristics_device_checks()
    _patch_pointwise_device()
    patch_guard_repr()
    _patch_flex_attention_lowering()
    if superchip.executor() == "cuda":
        _patch_device_properties()
        _patch_triton_device_checks()
    _applied = True


_fake_rules_applied = False
_fake_rules_error: RuntimeError | None = None


def apply_fake_rules() -> None:
    """Points 5, 6, 10 and 12: the rules torch consults outside Inductor too (fake tensors,
    ``make_fx`` tracing, ``torch.export``) answer for superchip as for its executor. Called at
    ``import superchip`` (torch imports these modules with itself; no Dynamo import)."""
    global _fake_rules_applied
    if _fake_rules_applied:
        return
    _fake_rules_applied = True
    if not (_SUPPORTED[0] <= _torch_version() <= _SUPPORTED[1]):
        return  # import superchip never fails for these; apply() says what to check
    global _fake_rules_error
    try:
        _patch_meta_device_hint()
        _patch_conv_layout()
        _patch_rng_state_ops()
        _patch_dropout_tracing()
        _register_attention_backward_meta()
        _patch_flex_attention_checks()
    except RuntimeError as e:  # a name this torch lacks: import still works, compile says why
        _fake_rules_error = e


_flex_attention_patched = False


def cpu_like_device_types() -> tuple[str, ...]:
    """The device types whose operators run the CPU's kernels: a tuple, for code Dynamo
    traces (a call into superchip's C++ there would break the graph)."""
    return ("cpu", "superchip") if superchip.executor() == "cpu" else ("cpu",)


def _patch_flex_attention_checks() -> None:
    """Point 21, eager half: FlexAttention's device check and its CPU kernel options."""
    global _flex_attention_patched
    from torch.nn.attention import flex_attention as flex

    validate = getattr(flex, "_validate_device", None)
    options = getattr(flex, "_apply_kernel_options", None)
    if validate is None or options is None or getattr(validate, "_superchip", False):
        return
    try:
        flex._superchip_cpu_like = cpu_like_device_types()  # Dynamo traces _apply_kernel_options
        _rewrite_code(options, *((f'{t}.device.type == "cpu"', f"{t}.device.type in _superchip_cpu_like")
                                 for t in ("query", "key", "value")))
    except RuntimeError:
        return  # this torch's source differs: FlexAttention keeps refusing superchip

    cpu_executor = superchip.executor() == "cpu"  # a constant: Dynamo traces this function

    def validate_device(query, key, value):
        if query.device.type != "superchip":
            return validate(query, key, value)
        if cpu_executor and (query.requires_grad or key.requires_grad or value.requires_grad):
            raise NotImplementedError(
                "FlexAttention does not support backward on superchip with the CPU executor (the "
                "CPU has no FlexAttention backward; superchip runs the CPU's kernels). Set the "
                "inputs' requires_grad to False (inference), or use another attention "
                "implementation for training (scaled_dot_product_attention; in transformers, "
                "attn_implementation=\"sdpa\").")

    validate_device._superchip = True
    flex._validate_device = validate_device
    _flex_attention_patched = True


def _patch_flex_attention_lowering() -> None:
    """Point 21, compiled half: the C++ template for superchip with the CPU executor."""
    if not _flex_attention_patched:
        return  # eager flex_attention refuses superchip on this torch: nothing reaches the lowering
    from torch._inductor.kernel.flex import flex_attention as lowering

    _rewrite_code(lowering.flex_attention, ('if query.get_device().type == "cpu":',
                                            f'if {_EXECUTOR_TYPE}(query.get_device().type) == "cpu":'))
    # The templates' block sizes and warps: the executor's table (CUDA's), not the generic one.
    from torch._inductor.choices import InductorChoices

    original = InductorChoices.get_config_heuristics
    if getattr(original, "_superchip", False):
        return

    def get_config_heuristics(self, device_type="cuda"):
        return original(self, executor_type(device_type) if device_type == "superchip" else device_type)

    get_config_heuristics.__wrapped__ = original  # type: ignore[attr-defined]
    get_config_heuristics._superchip = True  # type: ignore[attr-defined]
    InductorChoices.get_config_heuristics = get_config_heuristics


def _patch_meta_device_hint() -> None:
    from torch import _meta_registrations as meta

    original = getattr(meta, "device_hint", None)
    if original is None:
        return  # point 10: nothing patched on a torch without it

    def device_hint(tensor) -> str:
        return executor_type(original(tensor))

    device_hint.__wrapped__ = original  # type: ignore[attr-defined]
    meta.device_hint = device_hint
    # histc counts integers on superchip with either executor (Note [Integer histc]), where the
    # CPU's kernel refuses them: its rule checks the CPU's dtypes for the CPU only (the
    # device type before the answer above; a fake tensor's device reads "meta" in its rule).
    _rewrite_code(meta.meta_histc, ('if device_hint(input) == "cpu":',
                                    'if device_hint(input) == "cpu" and device_hint.__wrapped__(input) == "cpu":'))


def _patch_dropout_tracing() -> None:
    if superchip.executor() != "cpu":
        return  # point 12: nothing registered in C++ with the CUDA executor
    from torch._C import DispatchKey
    from torch._decomp import decompositions

    decomposition = getattr(decompositions, "dropout", None)
    op = torch.ops.aten.dropout.default
    if decomposition is None or DispatchKey.AutogradPrivateUse1 in op.py_kernels:
        return
    # Used by the Python dispatcher only (tracing); eager dispatch keeps the C++ kernel.
    op.py_impl(DispatchKey.AutogradPrivateUse1)(decomposition)


def _patch_pointwise_device() -> None:
    from torch._inductor import lowering

    import inspect

    original = lowering.is_gpu
    if getattr(original, "_superchip", False):
        return
    if inspect.getsource(lowering).count("is_gpu(") != 1:
        raise RuntimeError("superchip: torch._inductor.lowering calls is_gpu in more than one place; "
                           "check point 17 of superchip/_inductor/patches.py")

    def is_gpu(device_type) -> bool:
        # Point 17: make_pointwise's choice of the result's device.
        return device_type == "superchip" or original(device_type)

    is_gpu._superchip = True  # type: ignore[attr-defined]
    is_gpu.__wrapped__ = original  # type: ignore[attr-defined]
    lowering.is_gpu = is_gpu


def _patch_extern_benchmarks() -> None:
    if superchip.executor() == "cuda":
        return  # point 16: the GPU request times CUDA kernels on the current CUDA device
    from torch._inductor.autotune_process import CPUDeviceBenchmarkMixin, GPUDeviceBenchmarkMixin

    original = GPUDeviceBenchmarkMixin.do_bench

    def do_bench(self, fn, *input_tensors, out=None):
        if any(isinstance(t, torch.Tensor) and t.device.type == "superchip" for t in (*input_tensors, out)):
            return CPUDeviceBenchmarkMixin.do_bench(self, fn, *input_tensors, out=out)
        return original(self, fn, *input_tensors, out=out)

    do_bench.__wrapped__ = original  # type: ignore[attr-defined]
    GPUDeviceBenchmarkMixin.do_bench = do_bench


def _patch_device_guard() -> None:
    from torch._inductor import scheduler

    original = scheduler.device_need_guard

    def device_need_guard(device: str) -> bool:
        return device == "superchip" or original(device)

    device_need_guard.__wrapped__ = original  # type: ignore[attr-defined]
    scheduler.device_need_guard = device_need_guard
    _patch_default_stream_line()


def _patch_default_stream_line() -> None:
    # Point 8, torch 2.12: the wrapper names a graph's default stream and enters a user's stream
    # through torch.cuda, whatever the device (2.13 asks the device's op overrides and enters
    # the stream object itself; 2.11 writes no streams).
    import inspect
    import re

    from torch._inductor.codegen import wrapper
    from torch._inductor.virtualized import V

    from .codegen import _SuperchipDeviceOps

    cuda_stream = " = torch.cuda.current_stream()"
    enter = re.compile(r"^with torch\.cuda\.stream\((\w+)\):$")

    class _Rewriting:
        """``code`` with the stream lines written for superchip, as 2.13 writes them."""

        def __init__(self, code) -> None:
            self._code = code

        def __getattr__(self, name):
            return getattr(self._code, name)

        def writeline(self, line) -> None:
            if isinstance(line, str):
                if line.endswith(cuda_stream):
                    line = line[: -len(cuda_stream)] + f" = {V.graph.device_ops.current_stream()}"
                elif match := enter.match(line):
                    line = f"with {match.group(1)}:"
            self._code.writeline(line)

    for name, written in (("EnterDeviceContextManagerWithStreamInfoLine", cuda_stream),
                          ("EnterCudaStreamContextLine", "with torch.cuda.stream(")):
        line_class = getattr(wrapper, name, None)
        if line_class is None or getattr(line_class.codegen, "_superchip", False):
            continue
        if written.strip() not in inspect.getsource(line_class.codegen):
            continue
        original = line_class.codegen

        def codegen(self, code, original=original) -> None:
            if isinstance(V.graph.device_ops, _SuperchipDeviceOps) and not V.graph.cpp_wrapper:
                return original(self, _Rewriting(code))
            return original(self, code)

        codegen._superchip = True  # type: ignore[attr-defined]
        codegen.__wrapped__ = original  # type: ignore[attr-defined]
        line_class.codegen = codegen


def _patch_combo_kernel_groups() -> None:
    if superchip.executor() == "cuda":
        return  # point 9: Triton has combo kernels
    from torch._inductor.scheduler import ForeachKernelSchedulerNode

    original = getattr(ForeachKernelSchedulerNode, "group_nodes_for_combo_kernels", None)
    if original is None:
        return

    def on_superchip(node) -> bool:
        device = node.get_device()
        return device is not None and device.type == "superchip"

    def group_nodes_for_combo_kernels(scheduler):
        # A group holds one device's nodes (the default grouping splits by device).
        return [g for g in original(scheduler) if not any(on_superchip(n) for n in g)]

    group_nodes_for_combo_kernels.__wrapped__ = original  # type: ignore[attr-defined]
    ForeachKernelSchedulerNode.group_nodes_for_combo_kernels = staticmethod(group_nodes_for_combo_kernels)

    from torch._inductor import config
    from torch._inductor.scheduler import Scheduler

    speedup = Scheduler.speedup_by_fusion

    def speedup_by_fusion(self, node1, node2):
        if config.benchmark_fusion and any(on_superchip(n) for n in node1.get_nodes()[:1]):
            # As for CPU nodes: without benchmark_fusion (no Triton template on superchip with
            # the CPU executor), the answer is "fuse".
            with config.patch(benchmark_fusion=False):
                return speedup(self, node1, node2)
        return speedup(self, node1, node2)

    speedup_by_fusion.__wrapped__ = speedup  # type: ignore[attr-defined]
    Scheduler.speedup_by_fusion = speedup_by_fusion


def _patch_get_current_backend() -> None:
    from torch._inductor import utils

    original = utils.get_current_backend

    def get_current_backend(device_type: str | None = None) -> str:
        if not device_type:
            from torch._inductor.virtualized import V

            device_type = V.graph.get_current_device_or_throw().type
        return original(executor_type(device_type))

    get_current_backend.__wrapped__ = original  # type: ignore[attr-defined]
    for name in ("torch._inductor.utils", "torch._inductor.codegen.common",
                 "torch._inductor.scheduler", "torch._inductor.kernel.mm_common"):
        module = importlib.import_module(name)
        if getattr(module, "get_current_backend", None) is not original:
            raise RuntimeError(f"superchip: {name}.get_current_backend is not the one "
                               "superchip's patch expects; check superchip/_inductor/patches.py")
        module.get_current_backend = get_current_backend


def _patch_flush_before_deviceless_extern() -> None:
    from torch._inductor.scheduler import Scheduler

    original = Scheduler.codegen_extern_call

    def codegen_extern_call(self, scheduler_node) -> None:
        current = self.current_device
        if current is not None and current.type == "superchip" and scheduler_node.get_device() is None:
            self.flush()
        original(self, scheduler_node)

    codegen_extern_call.__wrapped__ = original  # type: ignore[attr-defined]
    Scheduler.codegen_extern_call = codegen_extern_call


def _patch_is_cpu() -> None:
    from torch._inductor.scheduler import BaseSchedulerNode

    original = BaseSchedulerNode.is_cpu

    def is_cpu(self) -> bool:
        device = self.get_device()
        if device is not None and device.type == "superchip":
            return not superchip.executor() == "cuda"
        return original(self)

    is_cpu.__wrapped__ = original  # type: ignore[attr-defined]
    BaseSchedulerNode.is_cpu = is_cpu


def _patch_ir_is_cpu() -> None:
    from torch._inductor import ir

    original = getattr(ir, "is_cpu", None)
    get_device_type = getattr(ir, "get_device_type", None)
    if original is None or get_device_type is None:
        return  # a heuristic only (point 4 above): without it, the GPU's thresholds

    def is_cpu(x) -> bool:
        device_type = get_device_type(x)
        return executor_type(device_type) == "cpu" if device_type == "superchip" else original(x)

    is_cpu.__wrapped__ = original  # type: ignore[attr-defined]
    ir.is_cpu = is_cpu


def _patch_triton_device_checks() -> None:
    # Point 19 (called with the CUDA executor only).
    import importlib

    from torch._inductor import ir
    from torch._inductor.scheduler import BaseSchedulerNode

    original_is_gpu = BaseSchedulerNode.is_gpu

    def is_gpu(self) -> bool:
        device = self.get_device()
        if device is not None and device.type == "superchip":
            return True
        return original_is_gpu(self)

    is_gpu.__wrapped__ = original_is_gpu  # type: ignore[attr-defined]
    BaseSchedulerNode.is_gpu = is_gpu

    original_is_triton = ir.is_triton

    def is_triton(x) -> bool:
        if ir.get_device_type(x) == "superchip":
            return original_is_triton("cuda")
        return original_is_triton(x)

    is_triton.__wrapped__ = original_is_triton  # type: ignore[attr-defined]
    for name in ("torch._inductor.ir", "torch._inductor.lowering", "torch._inductor.kernel.mm"):
        module = importlib.import_module(name)
        if getattr(module, "is_triton", None) is original_is_triton:
            module.is_triton = is_triton


def _patch_device_properties() -> None:
    from torch._inductor.runtime.hints import DeviceProperties

    original = DeviceProperties.create  # a cached classmethod, bound to DeviceProperties

    def create(cls, device):
        if device.type == "superchip":
            index = torch.superchip.current_device() if device.index is None else device.index
            device = torch.device("cuda", index)
        return original(device)

    DeviceProperties.create = classmethod(create)


def _patch_conv_layout() -> None:
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

    def on_executor(t):
        """A superchip fake tensor as the same fake tensor on the executor's device."""
        if not isinstance(t, FakeTensor) or t.fake_device.type != "superchip":
            return t
        index = t.fake_device.index
        device = torch.device("cpu") if superchip.executor() == "cpu" else torch.device("cuda", index or 0)
        with unset_fake_temporarily():
            meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        return FakeTensor(t.fake_mode, meta, device)

    def answering_for_the_executor(original):
        def wrapper(*args, **kwargs):
            return original(*[on_executor(a) for a in args], **{k: on_executor(v) for k, v in kwargs.items()})

        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        wrapper.__name__ = original.__name__
        return wrapper

    for name in ("_select_conv_backend", "_conv_determine_backend_memory_format"):
        original = getattr(torch._C, name, None)
        if original is None:
            raise RuntimeError(f"superchip: torch._C.{name} is missing; check superchip/_inductor/patches.py")
        setattr(torch._C, name, answering_for_the_executor(original))


def _superchip_device(args, kwargs):
    """The superchip device of a random op's arguments (as rng_prims.get_device finds it), or None."""
    device = kwargs.get("device")
    if device is not None:
        device = torch.device(device)
    else:
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    return device if device is not None and device.type == "superchip" else None


_attention_meta_library = None


def _register_attention_backward_meta() -> None:
    global _attention_meta_library
    name = "_scaled_dot_product_fused_attention_overrideable_backward"
    if _attention_meta_library is not None or not hasattr(torch.ops.aten, name):
        return
    if torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "Meta"):
        return  # point 18: torch has its own (2.13)

    def meta(grad_out, query, key, value, attn_bias, grad_input_mask, out, logsumexp, cum_seq_q,
             cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
        grad_bias = torch.empty_like(attn_bias) if attn_bias is not None else None
        return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), grad_bias

    library = torch.library.Library("aten", "IMPL")
    library.impl(name, meta, "Meta")
    _attention_meta_library = library


def _patch_rng_state_ops() -> None:
    try:
        from torch._C import DispatchKey
        from torch._higher_order_ops.utils import registered_hop_fake_fns
        from torch._prims import rng_prims

        save, replay = rng_prims.run_and_save_rng_state, rng_prims.run_with_rng_state
        kernels = (save.py_kernels, replay.py_kernels)
        if any(DispatchKey.BackendSelect not in k for k in kernels):
            return
    except (ImportError, AttributeError):
        return  # point 5 above: nothing patched

    def save_state(op, *args, **kwargs):
        device = _superchip_device(args, kwargs)
        return torch.superchip.get_rng_state(device), op(*args, **kwargs)

    def with_state(rng_state, op, *args, **kwargs):
        device = _superchip_device(args, kwargs)
        current = torch.superchip.get_rng_state(device)
        torch.superchip.set_rng_state(rng_state.cpu(), device)
        try:
            return op(*args, **kwargs)
        finally:
            torch.superchip.set_rng_state(current, device)

    def routed(original, ours, lead):
        # lead: the arguments before the random op (run_with_rng_state's state).
        def select(*args, **kwargs):
            if _superchip_device(args[lead + 1:], kwargs) is not None:
                return ours(*args, **kwargs)
            return original(*args, **kwargs)

        select.__wrapped__ = original  # type: ignore[attr-defined]
        return select

    for hop, ours, lead in ((save, save_state, 0), (replay, with_state, 1)):
        hop.py_kernels[DispatchKey.BackendSelect] = routed(hop.py_kernels[DispatchKey.BackendSelect], ours, lead)
        if DispatchKey.PrivateUse1 not in hop.py_kernels:
            hop.py_impl(DispatchKey.PrivateUse1)(ours)
        getattr(hop, "_dispatch_cache", {}).clear()
    # run_and_save_rng_state's fake rule calls the original backend choice directly (torch
    # 2.13: a registered fake function).
    if save in registered_hop_fake_fns:
        registered_hop_fake_fns[save] = routed(registered_hop_fake_fns[save], save_state, 0)
    # So does its tracing rule (make_fx, ProxyTorchDispatchMode), and in torch 2.11 its fake
    # rule too (a FakeTensorMode entry of its python_key_table), through a closure cell of
    # torch's that both share; the cell is pointed at the routed choice (the same function for
    # other devices). Without this, torch 2.11 traced no random op of a superchip region under
    # activation checkpointing ("Backend not supported for superchip"; found by running the
    # suite on torch 2.11, the GPU image's).
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import ProxyTorchDispatchMode

    for mode in (ProxyTorchDispatchMode, FakeTensorMode):
        rule = save.python_key_table.get(mode)
        names = getattr(getattr(rule, "__code__", None), "co_freevars", ())
        if "impl_backend_select" in names:
            cell = rule.__closure__[names.index("impl_backend_select")]
            if not getattr(cell.cell_contents, "_superchip_routed", False):
                cell.cell_contents = routed(cell.cell_contents, save_state, 0)
                cell.cell_contents._superchip_routed = True

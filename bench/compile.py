"""What torch.compile on the superchip device costs against torch.compile on its executor.

Not a test; every figure is a ratio to a baseline measured in the same run.

  (a) step   One training step of the example GPT (examples/model.py: forward, backward,
             torch.optim.AdamW step, loss.item()) with the model compiled by
             ``torch.compile(model)`` (Inductor, default mode) on `superchip` and on the
             executor's own device (`cpu`; `cuda` on a GPU machine whose executor is CUDA).
             Eager rows of both devices are timed beside them for context. The rows take turns
             (interleaved rounds, order rotated); the median per-step time of each is reported
             with the ratio compiled superchip / row.
  (b) dispatch  How much of the compiled superchip step goes through superchip's own dispatch:
             the ops dispatched per step at top level (counted with the profiler, in the
             compiled forward+backward and in the optimizer step; an upper bound on those that
             reach superchip, since a few run on CPU tensors, e.g. AdamW's step counters), times
             the per-op overhead of superchip over the baseline measured here (a + b on 16-element
             fp32 tensors), and the cost of one buffer allocation in the generated code
             (``empty_strided(..., device="superchip")`` against Inductor's CPU fast path).
  (c)        The machine: CPU model, cores, threads, torch, executor, GPU, git commit.

    python bench/compile.py [--reps 15] [--steps-per-rep 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

import superchip

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "bench"))
from data import CharTokenizer, TEXT, get_batch  # noqa: E402
from dispatch import interleaved_samples, machine_info  # noqa: E402
import step_case  # noqa: E402
from step_case import CudaWorker  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402


# ---- (a) training step ------------------------------------------------------------------------

class StepCase(step_case.StepCase):
    """bench/step_case.py's case (compiled or not), timed by wall clock only, with the halves
    (b) counts the ops of."""

    def __init__(self, model: GPT, device: str, compiled: bool, data: torch.Tensor, batch: int,
                 steps: int):
        super().__init__(model, device, data, batch, steps, compiled=compiled)

    def batch_on_device(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = get_batch(self.data, self.batch, self.model.cfg.seq_len, self.gen)
        return x.to(self.device), y.to(self.device)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        _, loss = self.fn(x, y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        return loss

    def __call__(self) -> float:
        """Wall-clock seconds per step."""
        return super().__call__()[0]


class WallClock:
    """A worker's case (bench/step_case.py) timed like StepCase: wall-clock seconds per step."""

    def __init__(self, case):
        self.case = case

    def step(self) -> None:
        self.case.step()

    def __call__(self) -> float:
        return self.case()[0]


def bench_step(args, baseline: str, model: GPT, data: torch.Tensor) -> tuple[dict, dict]:
    cases, worker = {}, None
    for device in ("superchip", baseline):
        if device == "cuda":  # Note [CUDA baseline in its own process] (bench/step_case.py)
            cfg_args = dict(n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model,
                            seq_len=args.seq_len, batch=args.batch, steps_per_rep=args.steps_per_rep)
            worker = CudaWorker(cfg_args, {"cuda compiled": {"compiled": True}, "cuda eager": {}})
            cases.update({n: WallClock(c) for n, c in worker.cases().items()})
            continue
        for compiled in (True, False):
            name = f"{device} {'compiled' if compiled else 'eager'}"
            cases[name] = StepCase(model, device, compiled, data, args.batch, args.steps_per_rep)
    compile_s = {}
    for name, case in cases.items():  # warm-up: compilation, optimizer state, caches
        t0 = time.perf_counter()
        for _ in range(2):
            case.step()
        compile_s[name] = time.perf_counter() - t0
    samples = interleaved_samples(cases, args.reps)
    if worker is not None:
        worker.close()
    med = {n: statistics.median(s) for n, s in samples.items()}
    fastest = {n: min(s) for n, s in samples.items()}
    head = "superchip compiled"
    out = {
        "ms_per_step": {n: 1e3 * t for n, t in med.items()},
        "ms_per_step_fastest": {n: 1e3 * t for n, t in fastest.items()},
        "ratio_superchip_compiled_to": {n: med[head] / t for n, t in med.items() if n != head},
        "ratio_superchip_compiled_to_fastest": {n: fastest[head] / t for n, t in fastest.items()
                                                if n != head},
        "first_two_steps_s": compile_s,
        "samples_ms": {n: [1e3 * t for t in s] for n, s in samples.items()},
    }
    return out, cases


# ---- (b) dispatch -------------------------------------------------------------------------------

def count_top_level_ops(fn) -> Counter:
    """Runs ``fn()`` under the profiler and counts the aten ops it dispatches at top level (ops
    called from inside another op's kernel are not counted: they pay no extra superchip
    dispatch, the forwarded kernel calls them on executor tensors). A dispatch mode would not
    do: Dynamo runs compiled frames eagerly while one is active."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    ops = Counter()
    for ev in prof.events():
        if not ev.name.startswith("aten::"):
            continue
        parent = ev.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is None:
            ops[ev.name[len("aten::"):]] += 1
    return ops


def per_call_us(fn, n: int, reps: int) -> float:
    fn()
    best = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best.append((time.perf_counter() - t0) / n)
    return 1e6 * statistics.median(best)


def bench_dispatch(args, baseline: str, case: StepCase, step_ms: float) -> dict:
    x, y = case.batch_on_device()
    losses = []
    graph = count_top_level_ops(lambda: losses.append(case.forward_backward(x, y)))
    optim = count_top_level_ops(case.opt.step)
    losses[0].item()

    a, b = torch.randn(16).to("superchip"), torch.randn(16).to("superchip")
    ca, cb = a.cpu(), b.cpu()
    op_over = (per_call_us(lambda: a + b, args.ops_per_rep, args.reps)
               - per_call_us(lambda: ca + cb, args.ops_per_rep, args.reps))
    empty_strided = torch.empty_strided
    fast_cpu = getattr(torch._C._dynamo.guards, f"_empty_strided_{baseline}")
    alloc_sc = per_call_us(lambda: empty_strided((16, 32), (32, 1), device="superchip",
                                                 dtype=torch.float32), args.ops_per_rep, args.reps)
    alloc_base = per_call_us(lambda: fast_cpu((16, 32), (32, 1), torch.float32),
                             args.ops_per_rep, args.reps)
    n_graph, n_optim = sum(graph.values()), sum(optim.values())
    n_alloc = graph["empty_strided"]
    est_ms = 1e-3 * ((n_graph + n_optim) * max(op_over, 0.0) + n_alloc * (alloc_sc - alloc_base))
    return {
        "ops_in_compiled_graph": n_graph,
        "ops_in_optimizer_step": n_optim,
        "graph_ops_by_name": dict(graph.most_common()),
        "per_op_overhead_us": op_over,
        "alloc_us": {"superchip": alloc_sc, f"{baseline} fast path": alloc_base},
        "estimated_dispatch_ms_per_step": est_ms,
        "estimated_dispatch_fraction_of_step": est_ms / step_ms,
    }


# ---- main -------------------------------------------------------------------------------------

def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=15, help="interleaved rounds (median taken)")
    p.add_argument("--steps-per-rep", type=int, default=2)
    p.add_argument("--ops-per-rep", type=int, default=20000)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (0: torch's default); 1 is steadier on a busy machine")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    info = machine_info()
    baseline = "cuda" if torch.cuda.is_available() and superchip.executor() == "cuda" else "cpu"
    print(f"machine: {info['cpu']}, {info['cores']} cores ({info['torch_threads']} torch threads)"
          f"{', GPU ' + info['gpu'] if info['gpu'] else ''} | torch {info['torch']} | "
          f"executor {info['executor']} | commit {info['commit']}")

    tok = CharTokenizer(TEXT)
    data = tok.encode(TEXT)
    cfg = GPTConfig(vocab_size=tok.vocab_size, seq_len=args.seq_len, n_layer=args.n_layer,
                    n_head=args.n_head, d_model=args.d_model)
    torch.manual_seed(0)
    model = GPT(cfg)
    step, cases = bench_step(args, baseline, model, data)
    print(f"\n(a) training step: GPT {model.num_params():,} params ({cfg.n_layer} layers, "
          f"d={cfg.d_model}, seq {cfg.seq_len}, batch {args.batch}), torch.optim.AdamW, "
          f"torch.compile(model); median of {args.reps} interleaved rounds x "
          f"{args.steps_per_rep} steps")
    print(f"  {'':<20} {'median':>9} {'fastest':>9}   ms/step   superchip compiled / it: "
          f"median, fastest")
    for name, ms in step["ms_per_step"].items():
        tail = ""
        if name != "superchip compiled":
            tail = (f"   {step['ratio_superchip_compiled_to'][name]:.3f}  "
                    f"{step['ratio_superchip_compiled_to_fastest'][name]:.3f}")
        print(f"  {name:<20} {ms:9.2f} {step['ms_per_step_fastest'][name]:9.2f}{' ' * 10}{tail}")

    disp = bench_dispatch(args, baseline, cases["superchip compiled"],
                          step["ms_per_step"]["superchip compiled"])
    top = ", ".join(f"{k} {v}" for k, v in list(disp["graph_ops_by_name"].items())[:8])
    print(f"\n(b) superchip dispatch in the compiled step: {disp['ops_in_compiled_graph']} ops in "
          f"the compiled forward+backward ({top}), {disp['ops_in_optimizer_step']} in the "
          f"optimizer step")
    print(f"  per-op overhead vs {baseline} {disp['per_op_overhead_us']:+.2f} us; buffer "
          f"allocation superchip {disp['alloc_us']['superchip']:.2f} us, {baseline} fast path "
          f"{disp['alloc_us'][f'{baseline} fast path']:.2f} us")
    print(f"  estimated dispatch cost (upper bound) "
          f"{disp['estimated_dispatch_ms_per_step']:.3f} ms/step = {100 * disp['estimated_dispatch_fraction_of_step']:.2f}% of the compiled "
          f"superchip step")

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "config": vars(args), "step": step, "dispatch": disp},
                      f, indent=2)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()

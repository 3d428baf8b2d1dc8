"""What running on the superchip device costs against running on its executor directly.

Not a test; every figure is a ratio to a baseline measured in the same run.

  (a) step   One training step of the example GPT (examples/model.py: forward, backward,
             torch.optim.AdamW step, loss.item()) on `superchip` and on plain `cpu`; on a
             GPU machine whose executor is CUDA also on plain `cuda`, and `cuda, math sdpa`:
             plain CUDA with scaled_dot_product_attention forced to its math decomposition,
             which shows what CUDA's fused kernel (superchip's choice too) saves. The devices
             take turns (interleaved repetitions of a few steps each); the median per-step
             time of each is reported with the ratio superchip / baseline.
  (b) op     The fixed cost of one small op, `a.add_(b)` and `a + b` on 16-element fp32
             tensors, on superchip and on the baseline: microseconds per op and the
             difference, which is the per-op overhead of dispatching through superchip.
  (c)        The machine: CPU model, cores, threads, torch, executor, GPU, git commit.

    python bench/dispatch.py [--reps 7] [--steps-per-rep 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import superchip

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from benchinfo import cpu_model, git_commit  # noqa: E402
from step_case import CudaWorker, StepCase, build_model, synchronize  # noqa: E402


# ---- machine ----------------------------------------------------------------------------

def machine_info() -> dict:
    info = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "executor": superchip.executor(),
        "commit": git_commit(),
        "gpu": None,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


# ---- timing -----------------------------------------------------------------------------

def interleaved_samples(cases: dict, reps: int) -> dict:
    """Runs each case's ``fn()`` in turn, ``reps`` rounds, rotating the order each round so no
    case always runs first; returns each case's list of results."""
    names = list(cases)
    samples = {n: [] for n in names}
    for r in range(reps):
        for n in names[r % len(names):] + names[:r % len(names)]:
            samples[n].append(cases[n]())
    return samples


def interleaved_medians(cases: dict, reps: int) -> dict:
    return {n: statistics.median(s) for n, s in interleaved_samples(cases, reps).items()}


# ---- (a) training step --------------------------------------------------------------------

def bench_step(args, baselines: list[str]) -> dict:
    cfg_args = {"n_layer": args.n_layer, "n_head": args.n_head, "d_model": args.d_model,
                "seq_len": args.seq_len, "batch": args.batch, "steps_per_rep": args.steps_per_rep}
    model, data = build_model(cfg_args)
    cfg = model.cfg
    cases = {"superchip": StepCase(model, "superchip", data, args.batch, args.steps_per_rep)}
    worker = None
    for b in baselines:
        if b == "cuda":
            # Note [CUDA baseline in its own process] (step_case.py). Its second case forces
            # attention to the math decomposition: "cuda, math sdpa" / cuda is what CUDA's
            # fused kernel (superchip's route too, Note [Attention on superchip]) saves.
            worker = CudaWorker(cfg_args)
            cases.update(worker.cases())
        else:
            cases[b] = StepCase(model, b, data, args.batch, args.steps_per_rep)
    for case in cases.values():  # warm-up: optimizer state, allocator caches, lazy init
        for _ in range(2):
            case.step()
    samples = interleaved_samples(cases, args.reps)
    if worker is not None:
        worker.close()
    wall = {n: [w for w, _ in s] for n, s in samples.items()}
    cpu = {n: [c for _, c in s] for n, s in samples.items()}
    med = {n: statistics.median(s) for n, s in wall.items()}
    fastest = {n: min(s) for n, s in wall.items()}
    med_cpu = {n: statistics.median(s) for n, s in cpu.items()}

    def ratios(fig: dict) -> dict:
        return {n: fig["superchip"] / t for n, t in fig.items() if n != "superchip"}

    return {
        "config": {"n_layer": cfg.n_layer, "d_model": cfg.d_model, "n_head": cfg.n_head,
                   "seq_len": cfg.seq_len, "batch": args.batch, "params": model.num_params()},
        "ms_per_step": {n: 1e3 * t for n, t in med.items()},
        "ms_per_step_fastest": {n: 1e3 * t for n, t in fastest.items()},
        "cpu_ms_per_step": {n: 1e3 * t for n, t in med_cpu.items()},
        "ratio_superchip_to": ratios(med),
        "ratio_superchip_to_fastest": ratios(fastest),
        "cpu_time_ratio_superchip_to": ratios(med_cpu),
        "samples_ms": {n: [1e3 * t for t in s] for n, s in wall.items()},
    }


# ---- (b) per-op overhead ------------------------------------------------------------------

def op_case(device: str, op: str, n_ops: int):
    a = torch.randn(16).to(device)
    b = torch.randn(16).to(device)

    def inplace():
        for _ in range(n_ops):
            a.add_(b)

    def outofplace():
        for _ in range(n_ops):
            a + b

    body = inplace if op == "add_" else outofplace

    def run() -> float:
        synchronize(device)
        t0 = time.perf_counter()
        body()
        synchronize(device)
        a.zero_()  # keep values bounded across repetitions
        return (time.perf_counter() - t0) / n_ops

    return run


def bench_ops(args, baselines: list[str]) -> dict:
    out = {}
    for op, label in (("add_", "a.add_(b)"), ("add", "a + b")):
        devices = ["superchip"] + baselines
        cases = {d: op_case(d, op, args.ops_per_rep) for d in devices}
        for c in cases.values():
            c()  # warm-up
        med = interleaved_medians(cases, args.reps)
        out[label] = {
            "us_per_op": {d: 1e6 * t for d, t in med.items()},
            "overhead_us_vs": {d: 1e6 * (med["superchip"] - med[d]) for d in baselines},
        }
    return out


# ---- main ---------------------------------------------------------------------------------

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
    baselines = ["cpu"]
    if torch.cuda.is_available() and superchip.executor() == "cuda":
        baselines.append("cuda")
    print(f"machine: {info['cpu']}, {info['cores']} cores ({info['torch_threads']} torch threads)"
          f"{', GPU ' + info['gpu'] if info['gpu'] else ''} | torch {info['torch']} | "
          f"executor {info['executor']} | commit {info['commit']}")

    step = bench_step(args, baselines)
    c = step["config"]
    print(f"\n(a) training step: GPT {c['params']:,} params ({c['n_layer']} layers, "
          f"d={c['d_model']}, seq {c['seq_len']}, batch {c['batch']}), AdamW; median of "
          f"{args.reps} interleaved rounds x {args.steps_per_rep} steps")
    print(f"  {'':<16} {'median':>9} {'fastest':>9} {'CPU time':>9}   ms/step   "
          f"superchip / it: median, fastest, CPU time")
    for name, ms in step["ms_per_step"].items():
        tail = ""
        if name != "superchip":
            tail = (f"   {step['ratio_superchip_to'][name]:.3f}  "
                    f"{step['ratio_superchip_to_fastest'][name]:.3f}  "
                    f"{step['cpu_time_ratio_superchip_to'][name]:.3f}")
        print(f"  {name:<16} {ms:9.2f} {step['ms_per_step_fastest'][name]:9.2f} "
              f"{step['cpu_ms_per_step'][name]:9.2f}{' ' * 10}{tail}")

    ops = bench_ops(args, baselines)
    print(f"\n(b) per-op cost, 16-element fp32 tensors; median of {args.reps} rounds x "
          f"{args.ops_per_rep} ops")
    for label, r in ops.items():
        figures = "   ".join(f"{d} {us:6.2f} us" for d, us in r["us_per_op"].items())
        over = "   ".join(f"overhead vs {d} {us:+6.2f} us" for d, us in r["overhead_us_vs"].items())
        print(f"  {label:<10} {figures}   {over}")

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "step": step, "ops": ops}, f, indent=2)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()

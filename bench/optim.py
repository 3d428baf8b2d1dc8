"""Fused CPU AdamW against the memory-bandwidth floor and torch's CPU AdamW, in one run.

Not a test. For each total size (2^24 .. 2^28 elements, split over 16 tensors like a model's
parameters) it measures, interleaved and repeated (median):

  triad        STREAM-style triad in place, a += s*b, over the same number of fp32 elements
               on the optimizer's thread pool: the achievable bandwidth, 12 bytes per element
               (all of them real traffic: no write-allocate, as in the AdamW kernels);
  ours fp32    superchip.optim.AdamW on fp32 CPU parameters (28 bytes per parameter);
  ours bf16    superchip.optim.AdamW on bf16 parameters with fp32 master weights, the bf16
               copy written in the same pass (28 bytes per parameter);
  torch fused  torch.optim.AdamW(fused=True) on fp32 parameters;
  torch        torch.optim.AdamW() (default implementation) on fp32 parameters;
  torch fused mixed   the mixed-precision recipe a user needs with torch: bf16 model
               parameters, fp32 masters stepped by the fused AdamW, grads cast up and the
               parameters cast back (two extra passes).

  floor        the AdamW traffic with no arithmetic (read p, g, m, v; write p, m, v), timed
               alternately with each variant: the bandwidth floor of a fused fp32 step.

Printed: seconds per step, parameters per second, bytes moved per second (28 B/param), the
fraction of the floor (floor time / variant time), and ratios to each torch baseline.

    python bench/optim.py [--sizes 24 26 28] [--reps 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

import superchip

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchinfo import cpu_model, git_commit  # noqa: E402

BYTES_PER_PARAM = 28  # read p, g, m, v; write p, m, v (fp32); the bf16 variant stays at 28


def tensors(total: int, n: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    sizes = [total // n] * n
    sizes[-1] += total - sum(sizes)
    ps = []
    for s in sizes:
        p = torch.nn.Parameter(torch.randn(s, generator=g).to(dtype))
        p.grad = (torch.randn(s, generator=g) * 1e-2).to(dtype)
        ps.append(p)
    return ps


def time_it(fn, reps: int) -> float:
    fn()  # warm-up: allocates state
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def triad(total: int):
    # a += s*b on the optimizer's own thread pool (ops/cpu/Bandwidth): the bandwidth the same
    # threads can draw with the same read-then-write pattern the AdamW kernels have.
    a = torch.zeros(total)
    b = torch.rand(total)
    return lambda: superchip._C._stream_triad_inplace(a, b, 1e-3)


def case_ours(total: int, dtype):
    ps = tensors(total, 16, dtype, seed=1)
    opt = superchip.optim.AdamW(ps, lr=1e-3)
    return opt.step


def case_torch(total: int, fused: bool):
    ps = tensors(total, 16, torch.float32, seed=1)
    opt = torch.optim.AdamW(ps, lr=1e-3, fused=fused) if fused else torch.optim.AdamW(ps, lr=1e-3)
    return opt.step


def case_torch_mixed(total: int):
    model = tensors(total, 16, torch.bfloat16, seed=1)
    masters = [torch.nn.Parameter(p.detach().float()) for p in model]
    opt = torch.optim.AdamW(masters, lr=1e-3, fused=True)

    def step():
        for p, m in zip(model, masters):
            m.grad = p.grad.float()
        opt.step()
        with torch.no_grad():
            for p, m in zip(model, masters):
                p.copy_(m)

    return step


def paired(fn, floor, reps: int) -> tuple[float, float]:
    """Median seconds of fn and of the floor kernel, measured alternately (noise hits both)."""
    fn()
    floor()
    t_fn, t_floor = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        floor()
        t1 = time.perf_counter()
        fn()
        t2 = time.perf_counter()
        t_floor.append(t1 - t0)
        t_fn.append(t2 - t1)
    return statistics.median(t_fn), statistics.median(t_floor)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[24, 26, 28],
                    help="log2 of the total element counts")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--skip-torch-default", action="store_true",
                    help="skip torch's default AdamW (slow at 2^28)")
    ap.add_argument("--json", help="write the figures to this file")
    args = ap.parse_args()

    print(f"machine: {cpu_model()}, {os.cpu_count()} cores | torch {torch.__version__} | "
          f"commit {git_commit()}")
    print(f"superchip optimizer: {superchip._C._optimizer_threads()} threads, "
          f"SIMD path {superchip._C._optimizer_simd_path()} | torch threads {torch.get_num_threads()}")
    variants = {
        "ours fp32": lambda n: case_ours(n, torch.float32),
        "ours bf16": lambda n: case_ours(n, torch.bfloat16),
        "torch fused": lambda n: case_torch(n, fused=True),
        "torch fused mixed": case_torch_mixed,
    }
    if not args.skip_torch_default:
        variants["torch"] = lambda n: case_torch(n, fused=False)
    results = []
    for log2 in args.sizes:
        total = 1 << log2
        bw = 12 * total / time_it(triad(total), args.reps)
        floor_arrays = [torch.rand(total) for _ in range(4)]
        floor = lambda: superchip._C._adam_traffic_floor(*floor_arrays)  # noqa: E731
        times, floors = {}, {}
        for name, make in variants.items():
            step = make(total)  # one variant's tensors at a time: 2^28 elements is 4 GiB each
            times[name], floors[name] = paired(step, floor, args.reps)
            del step
        del floor_arrays
        floor_bw = BYTES_PER_PARAM * total / statistics.median(floors.values())
        print(f"\n2^{log2} elements ({total:,}): triad {bw / 1e9:.1f} GB/s, "
              f"AdamW traffic floor {floor_bw / 1e9:.1f} GB/s ({BYTES_PER_PARAM} B/param)")
        print(f"  {'variant':<18} {'s/step':>9} {'Mparam/s':>9} {'GB/s':>7} {'of floor':>8}"
              f" {'vs torch fused':>15} {'vs torch':>9}")
        row = {"log2": log2, "triad_GBps": bw / 1e9, "floor_GBps": floor_bw / 1e9, "variants": {}}
        for name, t in times.items():
            gbps = BYTES_PER_PARAM * total / t
            ref = times["torch fused mixed"] if name == "ours bf16" else times["torch fused"]
            vs_default = times.get("torch")
            of_floor = floors[name] / t
            print(f"  {name:<18} {t:>9.4f} {total / t / 1e6:>9.1f} {gbps / 1e9:>7.1f}"
                  f" {of_floor:>8.2f} {ref / t:>14.2f}x"
                  f" {(vs_default / t if vs_default else float('nan')):>8.2f}x")
            row["variants"][name] = {"s_per_step": t, "params_per_s": total / t,
                                     "GBps": gbps / 1e9, "fraction_of_floor": of_floor,
                                     "speedup_vs_matching_torch_fused": ref / t}
        results.append(row)
    print("\n'of floor': the AdamW traffic floor's time (same 28 B/param, no arithmetic, same "
          "threads, timed alternately with the variant) over the variant's time.")
    print("'vs torch fused' compares ours bf16 with the torch fused mixed-precision recipe and "
          "every other variant with torch fused fp32.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": cpu_model(), "torch": torch.__version__, "commit": git_commit(),
                       "results": results}, f, indent=2)


if __name__ == "__main__":
    main()

"""python -m superchip info: executor, devices, tiers, budgets, topology and measured rates."""

import os
import sys
import time

import torch

import superchip

_RATE_ELEMENTS = 1 << 25  # 128 MiB per fp32 array: past the caches (16 MiB arrays sit in them)


def _best_of(fn, reps: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measured_rates() -> list:
    """Host bandwidth and fused-AdamW rate on the optimizer's threads (quick, best of 5)."""
    n = _RATE_ELEMENTS
    a, b = torch.zeros(n), torch.rand(n)
    triad = 12 * n / _best_of(lambda: superchip._C._stream_triad_inplace(a, b, 1e-3))
    arrays = [torch.rand(n) for _ in range(4)]
    floor = _best_of(lambda: superchip._C._adam_traffic_floor(*arrays))
    p = torch.nn.Parameter(torch.rand(n))
    p.grad = torch.rand(n)
    opt = superchip.optim.AdamW([p])
    def step():
        opt.step()
        torch.superchip.synchronize()

    adam = _best_of(step, reps=3)
    return [
        f"host bandwidth (in-place triad): {triad / 1e9:.1f} GB/s",
        f"fused AdamW fp32: {n / adam / 1e6:.0f} Mparam/s, {floor / adam:.2f} of the 28 B/param "
        f"traffic floor ({28 * n / floor / 1e9:.1f} GB/s)",
    ]


def info() -> None:
    print(f"torch {torch.__version__}")
    print(f"executor: {superchip.executor()}")
    print(f"devices: {torch.superchip.device_count()}")
    for i in range(torch.superchip.device_count()):
        stats = superchip.memory_stats(i)
        for tier in ("hbm", "host"):
            cap = stats[f"{tier}.capacity_bytes"]
            print(f"  superchip:{i} {tier}: capacity {cap / 2**30:.2f} GiB" if cap else
                  f"  superchip:{i} {tier}: capacity unlimited")
    machine = superchip._C._host_memory()
    if machine:
        # Every host-memory block of 1 MiB or more is checked against it (unless
        # SUPERCHIP_HOST_MEMORY_CHECK=0), budget or not.
        off = os.environ.get("SUPERCHIP_HOST_MEMORY_CHECK", "1") == "0"
        print(f"  host memory: {machine}" + (" (not checked: SUPERCHIP_HOST_MEMORY_CHECK=0)" if off else ""))
    print(f"optimizer: {superchip._C._optimizer_threads()} threads, SIMD path "
          f"{superchip._C._optimizer_simd_path()}")
    for line in measured_rates():
        print(f"  {line}")
    print("topology:")
    print(superchip._C._topology())
    lm = superchip.optim.link_model()
    print("link-cost model (cast-then-move of gradient buckets, measured now):")
    if lm["link_bytes_per_s"] is None:
        print(f"  link (hbm -> host copy): not measured: {lm['link_not_measured']}")
    else:
        print(f"  link (hbm -> host copy, {lm['link_elements'] >> 20} Mi bf16 elements): "
              f"{lm['link_bytes_per_s'] / 1e9:.1f} GB/s; bf16->fp32 cast on the "
              f"executor: {lm['executor_cast_bytes_per_s'] / 1e9:.1f} GB/s")
    print(f"  fused AdamW step (bf16 params, fp32 master): {lm['step_fp32_grads_per_s'] / 1e6:.0f} Mparam/s "
          f"reading fp32 gradients, {lm['step_bf16_grads_per_s'] / 1e6:.0f} Mparam/s reading bf16 "
          f"(converting as it reads)")
    if lm["seconds_per_gi_cast_on_executor"] is None:
        print(f"  -> cast on {lm['cast_on']} (no link measured; SUPERCHIP_CAST_ON overrides)")
    else:
        print(f"  per GiB of bf16 gradients: cast on executor, move fp32, step "
              f"{lm['seconds_per_gi_cast_on_executor'] * 1e3:.0f} ms; move bf16, step "
              f"{lm['seconds_per_gi_cast_on_cpu'] * 1e3:.0f} ms -> cast on {lm['cast_on']} "
              f"(SUPERCHIP_CAST_ON overrides)")

if __name__ == "__main__":
    cmd = sys.argv[1] if len(sys.argv) > 1 else "info"
    if cmd != "info":
        sys.exit(f"usage: python -m superchip info (unknown command {cmd!r})")
    info()

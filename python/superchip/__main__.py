"""python -m superchip info: executor, devices, tiers, budgets and topology."""

import sys

import torch

import superchip


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
    print(f"optimizer: {superchip._C._optimizer_threads()} threads, SIMD path "
          f"{superchip._C._optimizer_simd_path()}")
    print("topology:")
    print(superchip._C._topology())
    print("cast-then-move rule: the narrower dtype crosses the link (fixed rule)")


if __name__ == "__main__":
    cmd = sys.argv[1] if len(sys.argv) > 1 else "info"
    if cmd != "info":
        sys.exit(f"usage: python -m superchip info (unknown command {cmd!r})")
    info()

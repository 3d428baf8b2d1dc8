"""Models larger than hbm (not a test): one Llama-style model trained with everything in hbm
and with hbm at 1/4 of its parameter bytes, in one run.

Prints the median step time of each, their ratio (budget-limited / all-in-hbm), where the
weights were placed, the bytes streamed per step and the staging peak, and writes a PNG of
hbm use over one training step (sampled after every operator) for each configuration.

Weights past hbm's weights limit live in host. With streaming on (the default), the first two
steps record the order in which kernels read them, then a plan reserves a staging arena in hbm
(demoting stationary weights when hbm has no room for it) and each host weight is copied into
it ahead of its use (a copier thread on the CPU executor, the emulated side stream). The
budget-limited run is also measured with streaming off (kernels read host in place), in the
same run, to show what staging costs on the CPU executor, where both tiers are host memory.

    python bench/weights.py [--steps 12] [--png bench/results/weights-....png] [--out ....txt]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import superchip

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchinfo import cpu_model, git_commit  # noqa: E402


def build():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
    return LlamaForCausalLM(cfg)


class HbmTrace(TorchDispatchMode):
    """hbm allocated bytes (and the staged copies among them) after every operator."""

    def __init__(self):
        super().__init__()
        self.t0 = time.perf_counter()
        self.samples = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.samples.append((time.perf_counter() - self.t0, superchip.memory_stats()["hbm.allocated_bytes"],
                             superchip.stream_stats()["staging_bytes"]))
        return out


def run(budget, steps, stream=True):
    gc.collect()
    superchip.set_streaming(stream)
    superchip.empty_cache()
    superchip.set_capacity("hbm", budget)
    superchip.reset_peak_memory_stats()
    model = build()
    pbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model = model.to("superchip")
    tiers = [superchip.tier_of(p) for p in model.parameters()]
    in_host = sum(p.numel() * p.element_size() for p, t in zip(model.parameters(), tiers) if t == "host")
    opt = superchip.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    times = []

    def step():
        x = torch.randint(0, 2048, (4, 128), generator=g).to("superchip")
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss.item()

    spills0 = superchip.memory_stats()["host.num_spills"]
    warm = 3  # two recorded steps, then the plan
    for i in range(steps):
        if i == warm:
            torch.superchip.synchronize()
            superchip.reset_stream_stats()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    torch.superchip.synchronize()
    s = superchip.memory_stats()
    st = superchip.stream_stats()
    plan = superchip.weights_plan(model)
    with HbmTrace() as trace:
        step()
    torch.superchip.synchronize()
    timed = steps - warm
    res = dict(budget=budget, param_bytes=pbytes, weights_in_host=in_host, stream=stream,
               step=statistics.median(times[warm:]), peak_hbm=s["hbm.peak_allocated_bytes"],
               spills_per_step=(s["host.num_spills"] - spills0) / steps,
               streamed_bytes_per_step=st["staged_bytes"] / timed, staging_peak_bytes=st["staging_peak_bytes"],
               prefetch_hits_per_step=st["hits"] / timed, staged_at_use_per_step=st["staged_at_use"] / timed,
               in_place_reads_per_step=st["in_place_reads"] / timed, mispredictions=st["mispredictions"],
               plan={k: v for k, v in plan.items() if k != "order"},
               streamed_weights=sum(1 for e in plan["order"] if e["streamed"]),
               weights_in_host_after_plan=sum(p.numel() * p.element_size() for p in model.parameters()
                                              if superchip.tier_of(p) == "host"),
               trace=trace.samples)
    del model, opt
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--png", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lines = []

    def out(line=""):
        print(line, flush=True)
        lines.append(line)

    machine = dict(cpu=cpu_model(), torch=torch.__version__, executor=superchip.executor(),
                   torch_threads=torch.get_num_threads(), commit=git_commit())
    out(f"machine: {machine['cpu']} | torch {machine['torch']} | executor {machine['executor']} | "
        f"torch threads {machine['torch_threads']} | commit {machine['commit']}")
    old_cap = superchip.memory_stats()["hbm.capacity_bytes"]
    pbytes = sum(p.numel() * p.element_size() for p in build().parameters())
    full = run(16 * pbytes, args.steps)
    quarter = run(pbytes // 4, args.steps)
    in_place = run(pbytes // 4, args.steps, stream=False)
    superchip.set_capacity("hbm", old_cap)
    superchip.set_streaming(True)
    mib = 1 << 20
    runs = (("all in hbm", full), ("hbm = 1/4 of the weights, streamed", quarter),
            ("hbm = 1/4 of the weights, read in place", in_place))
    for name, r in runs:
        p = r["plan"]
        out(f"{name}: hbm budget {r['budget'] / mib:.2f} MiB, weights {r['param_bytes'] / mib:.2f} MiB "
            f"({r['weights_in_host'] / mib:.2f} MiB placed in host, {r['weights_in_host_after_plan'] / mib:.2f} "
            f"after the plan); step {r['step'] * 1e3:.1f} ms; hbm peak {r['peak_hbm'] / mib:.2f} MiB; "
            f"spills/step {r['spills_per_step']:.0f}")
        out(f"    plan {p['state']} v{p['version']}: {r['streamed_weights']} streamed reads/pass, arena "
            f"{p['staging_budget'] / mib:.2f} MiB, depth {p['prefetch_depth']}, {p['demoted']} demoted, {p['promoted']} promoted; "
            f"streamed/step {r['streamed_bytes_per_step'] / mib:.2f} MiB, staging peak "
            f"{r['staging_peak_bytes'] / mib:.2f} MiB; per step: {r['prefetch_hits_per_step']:.0f} prefetched "
            f"reads, {r['staged_at_use_per_step']:.0f} copied at use, {r['in_place_reads_per_step']:.0f} in place")
    out(f"step-time ratio (hbm = 1/4, streamed) / (all in hbm): {quarter['step'] / full['step']:.3f}")
    out(f"step-time ratio (hbm = 1/4, read in place) / (all in hbm): {in_place['step'] / full['step']:.3f}")
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(2, 1, figsize=(11, 6))
        for ax, (name, r) in zip(axes, runs[:2]):
            ts, bs, ss = zip(*r["trace"])
            ax.plot([t * 1e3 for t in ts], [b / mib for b in bs], lw=1, label="hbm allocated")
            if any(ss):
                ax.plot([t * 1e3 for t in ts], [b / mib for b in ss], lw=1, label="staged copies")
            ax.axhline(r["budget"] / mib, color="r", ls="--", lw=1, label="hbm budget")
            ax.set_title(f"{name}: hbm allocated over one training step", fontsize=10)
            ax.set_xlabel("ms")
            ax.set_ylabel("MiB")
            ax.legend(fontsize=8)
        fig.tight_layout()
        Path(args.png).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.png, dpi=110)
        out(f"plot written to {args.png}")
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
        for _, r in runs:
            r.pop("trace")
        Path(args.out).with_suffix(".json").write_text(json.dumps(
            dict(machine=machine, all_in_hbm=full, quarter_streamed=quarter, quarter_in_place=in_place), indent=2) + "\n")


if __name__ == "__main__":
    main()

"""A model larger than the GPU trains on one GPU (not a test; CUDA executor only).

Issue "Models larger than GPU memory", GPU criterion: a Llama-style model whose bf16 weights
and gradients alone exceed the GPU's memory trains with superchip (weights past hbm's budget
live in host and are streamed through an hbm staging arena on a copy stream), and its
throughput is compared with the same model with fewer layers that fits, as layer-tokens per
second (tokens/s x layers; 1.0 = streaming costs nothing per layer). Each configuration runs
in its own process (a clean allocator); torch.optim.SGD without momentum keeps optimizer state
out of the picture (bf16 weights stepped in place), and activation checkpointing bounds the
activations.

The reserve (SUPERCHIP_HBM_RESERVE, both runs) is set so that the weights kept in hbm plus
every gradient fit: at the default 20% the large model's weights (about half the GPU) all fit
under hbm's weights limit, nothing streams, and its gradients spill past the budget instead
(a device synchronization per spilled output), which is not what this benchmark measures. The
streaming plan does not yet demote weights to make room for gradients by itself. Prints and writes (--out) step times, tokens/s, the ratio, where weights were
placed, hbm/host peaks and the streaming statistics.

    python bench/weights_gpu.py [--fit-layers 4] [--big-layers 0 (= auto: bf16 weights +
        gradients > 1.05 x GPU memory)] [--hidden 4096] [--seq 1024] [--batch 4] [--steps 6]
        [--out bench/results/weights-gpu-<machine>.txt]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import superchip

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchinfo import cpu_model, git_commit  # noqa: E402


def config(args, layers):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.inter,
                       num_hidden_layers=layers, num_attention_heads=args.heads,
                       num_key_value_heads=args.heads, max_position_embeddings=args.seq)


def params_per_layer(args):
    h, i = args.hidden, args.inter
    return 4 * h * h + 3 * h * i + 2 * h


def reserve_for(args, layers, gpu_total):
    """SUPERCHIP_HBM_RESERVE such that hbm's weights plus all bf16 gradients fit in the budget,
    with a tenth of it left for activations and the staging arena."""
    budget = gpu_total - max(2**30, gpu_total // 16)  # Runtime.cpp's default hbm budget
    pbytes = 2 * (layers * params_per_layer(args) + 2 * args.vocab * args.hidden + args.hidden)
    weights_in_hbm = budget - pbytes - budget // 10
    return f"{max(20, min(95, round(100 * (1 - weights_in_hbm / budget))))}%"


def one(args, layers):
    """Trains `layers` layers for args.steps steps in this process; returns the figures."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = LlamaForCausalLM._from_config(config(args, layers), dtype=torch.bfloat16).train()
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    model.config.use_cache = False
    pbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model = model.to("superchip")
    build_s = time.perf_counter() - t0
    in_host = sum(p.numel() * p.element_size() for p in model.parameters() if superchip.tier_of(p) == "host")
    opt = torch.optim.SGD(model.parameters(), lr=1e-5)
    g = torch.Generator().manual_seed(0)
    times, losses = [], []
    warm = 3  # two recorded steps, then the plan
    for i in range(args.steps):
        if i == warm:
            torch.superchip.synchronize()
            superchip.reset_stream_stats()
            superchip.reset_peak_memory_stats()
        x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to("superchip")
        t = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # synchronizes
        times.append(time.perf_counter() - t)
    s = superchip.memory_stats()
    st = superchip.stream_stats()
    plan = superchip.weights_plan()
    step = statistics.median(times[warm:])
    return dict(layers=layers, param_bytes=pbytes, weights_in_host=in_host, build_seconds=build_s,
                step_seconds=step, tokens_per_s=args.batch * args.seq / step, losses=losses,
                hbm_capacity=s["hbm.capacity_bytes"], hbm_peak=s["hbm.peak_allocated_bytes"],
                host_peak=s["host.peak_allocated_bytes"], spills=s["host.num_spills"],
                gpu_total=torch.cuda.get_device_properties(0).total_memory,
                stream={k: st[k] for k in ("staged_copies", "staged_bytes", "hits", "prefetch_waits",
                                           "staged_at_use", "in_place_reads", "mispredictions",
                                           "staging_peak_bytes")},
                plan={k: v for k, v in plan.items() if k != "order"})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fit-layers", type=int, default=4)
    ap.add_argument("--big-layers", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=11008)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--reserve", default=None,
                    help="SUPERCHIP_HBM_RESERVE of both runs (default: hbm's weights + gradients fit)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=os.environ.get("SUPERCHIP_COMMIT") or git_commit())
    ap.add_argument("--_one", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.steps <= 3:
        ap.error("--steps must exceed the 3 warm-up steps (two recorded, then the plan)")
    if superchip.executor() != "cuda":
        sys.exit("bench/weights_gpu.py needs the CUDA executor (a GPU and a CUDA build of torch); "
                 "bench/weights.py is the emulated benchmark.")
    if args._one is not None:
        print(json.dumps(one(args, args._one)))
        return
    gpu_total = torch.cuda.get_device_properties(0).total_memory
    big = args.big_layers
    if big == 0:
        per_layer = 4 * params_per_layer(args)  # bf16 weight + bf16 gradient
        big = int(1.05 * gpu_total / per_layer) + 1
    lines = []

    def out(line=""):
        print(line, flush=True)
        lines.append(line)

    reserve = os.environ.get("SUPERCHIP_HBM_RESERVE") or args.reserve or reserve_for(args, big, gpu_total)
    env = dict(os.environ, SUPERCHIP_HBM_RESERVE=reserve)
    machine = dict(gpu=torch.cuda.get_device_name(0), gpu_memory=gpu_total, cpu=cpu_model(),
                   torch=torch.__version__, commit=args.commit, hbm_reserve=reserve)
    out(f"machine: {machine['gpu']} ({gpu_total / 2**30:.1f} GiB) | {machine['cpu']} | torch {machine['torch']} "
        f"| commit {machine['commit']} | SUPERCHIP_HBM_RESERVE={reserve}")
    results = {}
    for name, layers in (("fits", args.fit_layers), ("larger than the GPU", big)):
        cmd = [sys.executable, __file__, "--_one", str(layers)] + [
            f"--{k}={v}" for k, v in (("hidden", args.hidden), ("inter", args.inter), ("heads", args.heads),
                                      ("vocab", args.vocab), ("seq", args.seq), ("batch", args.batch),
                                      ("steps", args.steps))]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            out(f"{name} ({layers} layers): FAILED rc={proc.returncode}\n{proc.stderr[-3000:]}")
            results[name] = dict(layers=layers, failed=proc.stderr[-3000:])
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        results[name] = r
        gib = 2**30
        out(f"{name}: {layers} layers, {r['param_bytes'] / gib:.1f} GiB bf16 weights "
            f"({r['weights_in_host'] / gib:.1f} GiB placed in host); weights+grads "
            f"{2 * r['param_bytes'] / gib:.1f} GiB vs GPU {gpu_total / gib:.1f} GiB; step {r['step_seconds']:.2f} s, "
            f"{r['tokens_per_s']:.0f} tokens/s; hbm peak {r['hbm_peak'] / gib:.1f} of {r['hbm_capacity'] / gib:.1f} GiB, "
            f"host peak {r['host_peak'] / gib:.1f} GiB, {r['spills']} spills; losses {[round(x, 3) for x in r['losses']]}")
        out(f"    plan {r['plan']['state']} mode {r['plan']['mode']} arena {r['plan']['staging_budget'] / gib:.2f} GiB "
            f"depth {r['plan']['prefetch_depth']}; per run after warm-up: {r['stream']}")
    if all("failed" not in r for r in results.values()):
        a, b = results["fits"], results["larger than the GPU"]
        ratio = (b["tokens_per_s"] * b["layers"]) / (a["tokens_per_s"] * a["layers"])
        out(f"per-layer throughput ratio (larger / fits, layer-tokens per second): {ratio:.3f}")
        if b["weights_in_host"] == 0 or b["stream"]["staged_copies"] == 0:
            out("WARNING: the large model streamed nothing (no weight in host, or no staged copy): "
                "the ratio is not a streaming figure; raise --reserve")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")
        Path(args.out).with_suffix(".json").write_text(json.dumps(dict(machine=machine, results=results), indent=2) + "\n")


if __name__ == "__main__":
    main()

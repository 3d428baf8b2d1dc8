"""Offload engine on one GPU: tokens/s of a 1-3B Llama against its peers (not a test).

Issue "The offload engine", GPU criterion: a Llama-style model (HF LlamaForCausalLM, random
init) in bf16, the same batch and sequence length in every configuration, clip_grad_norm_(1.0)
every step, trained with

  superchip, overlap=False   model.to("superchip"), superchip.optim.AdamW(overlap=False)
  superchip, engine          the same with the offload engine (overlap=True)
  superchip, engine, always  the engine with SUPERCHIP_SPECULATION=always: every bucket
                             speculated, against the default budget (Note [Speculation budget])
  GPU only, fused AdamW      model.to("cuda"), torch.optim.AdamW(fused=True): the same bf16
                             script with nothing offloaded (moments in bf16 on the GPU)
  FSDP2 + CPUOffloadPolicy   fp32 parameters sharded (world size 1) and offloaded to the CPU,
                             bf16 compute (MixedPrecisionPolicy), torch.optim.AdamW on the CPU:
                             PyTorch's own offloading, with fp32 master weights and moments in
                             host memory like superchip's

and prints tokens/s, the ratio of each to the engine, step and peak-memory figures, and the
engine's hidden fraction. Every configuration runs in its own process: a clean allocator each,
and the plain-CUDA and FSDP2 baselines never import superchip (pytorch#161129: with a
PrivateUse1 backend registered, torch 2.11 takes it for the accelerator and plain-CUDA backward
asserts). Step time = wall time of --steps steps after --warmup, synchronized at both ends.

    python bench/offload_gpu.py [--layers 24 --hidden 2048 --inter 5504 --heads 16]
        [--batch 8 --seq 1024] [--steps 8 --warmup 3] [--configs engine,always,plain,cuda,fsdp2]
        [--out bench/results/offload-gpu-<machine>.txt]

`--device cpu` runs the same configurations on the CPU (CPU executor, gloo) with a tiny model:
a check of the script itself, no figures worth recording.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchinfo import cpu_model, git_commit  # noqa: E402

CONFIGS = {
    "engine": "superchip, engine",
    "always": "superchip, engine, SUPERCHIP_SPECULATION=always",
    "plain": "superchip, overlap=False",
    "cuda": "GPU only, fused AdamW",
    "fsdp2": "FSDP2 + CPUOffloadPolicy",
}


def build(args, dtype):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.inter,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.heads, max_position_embeddings=args.seq)
    cfg.use_cache = False
    model = LlamaForCausalLM._from_config(cfg, dtype=dtype).train()  # checkpointing needs train mode
    if args.checkpointing:
        model.gradient_checkpointing_enable()
    return model


def one(args, config):
    """Trains `config` in this process; returns its figures (a dict)."""
    import torch

    on_gpu = args.device == "cuda"
    sync = None
    extra = {}
    engine = config in ("engine", "always")
    if config in ("engine", "always", "plain"):
        import superchip

        want = "cuda" if on_gpu else "cpu"
        if superchip.executor() != want:
            raise SystemExit(f"superchip's executor is {superchip.executor()}, this run needs {want}")
        model = build(args, torch.bfloat16).to("superchip")
        opt = superchip.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1,
                                    overlap=engine)
        dev = "superchip"

        def sync():
            torch.superchip.synchronize()
    elif config == "cuda":
        dev = "cuda" if on_gpu else "cpu"
        model = build(args, torch.bfloat16).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    elif config == "fsdp2":
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        dev = "cuda" if on_gpu else "cpu"
        if on_gpu:
            torch.cuda.set_device(0)
        dist.init_process_group("nccl" if on_gpu else "gloo", init_method=f"tcp://127.0.0.1:{args.port}",
                                rank=0, world_size=1)
        mesh = init_device_mesh(dev, (1,))
        model = build(args, torch.float32)
        kw = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                  offload_policy=CPUOffloadPolicy(pin_memory=on_gpu))
        for layer in model.model.layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        try:  # the fused CPU AdamW where it takes DTensor shards, else the default (foreach)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
            extra["fsdp2_optimizer"] = "fused"
        except (RuntimeError, TypeError, ValueError):
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
            extra["fsdp2_optimizer"] = "default"
    else:
        raise SystemExit(f"unknown configuration {config}")
    if sync is None:
        def sync():
            if on_gpu:
                torch.cuda.synchronize()

    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g) for _ in range(4)]
    losses = []
    t0 = None
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            sync()
            if engine:
                base = opt.offload_stats()
            t0 = time.perf_counter()
        x = batches[i % len(batches)].to(dev)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    sync()
    wall = time.perf_counter() - t0
    step = wall / args.steps
    r = dict(config=config, label=CONFIGS[config], step_seconds=step,
             tokens_per_s=args.batch * args.seq / step, losses=[float(x) for x in losses],
             params=sum(p.numel() for p in model.parameters()), **extra)
    if on_gpu:
        r["gpu_peak_bytes"] = torch.cuda.max_memory_allocated()
    if config in ("engine", "always", "plain"):
        import superchip

        s = superchip.memory_stats()
        r["hbm_peak_bytes"] = s["hbm.peak_allocated_bytes"]
        r["host_peak_bytes"] = s["host.peak_allocated_bytes"]
        st = opt.offload_stats()
        r["offload_stats"] = st
        if engine:
            n = args.steps
            opt_s = (st["optimizer_seconds"] - base["optimizer_seconds"]) / n
            exp_s = (st["exposed_seconds"] - base["exposed_seconds"]) / n
            r.update(optimizer_seconds=opt_s, exposed_seconds=exp_s,
                     hidden=1.0 - exp_s / opt_s if opt_s > 0 else 0.0)
    if config == "fsdp2":
        import torch.distributed as dist

        dist.destroy_process_group()
    return r


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--inter", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing in every config")
    ap.add_argument("--configs", default="engine,always,plain,cuda,fsdp2")
    ap.add_argument("--timeout", type=int, default=240, help="seconds per configuration")
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=os.environ.get("SUPERCHIP_COMMIT") or git_commit())
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--_one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    big = dict(layers=24, hidden=2048, inter=5504, heads=16, vocab=32000, batch=8, seq=1024)
    tiny = dict(layers=2, hidden=128, inter=344, heads=4, vocab=512, batch=2, seq=64)
    for k, v in (big if args.device == "cuda" else tiny).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args._one is not None:
        print(json.dumps(one(args, args._one)))
        return
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown configuration(s) {unknown}; choose from {sorted(CONFIGS)}")

    import torch  # the parent never imports superchip

    lines = []

    def out(line=""):
        print(line, flush=True)
        lines.append(line)

    machine = dict(cpu=cpu_model(), cores=os.cpu_count(), torch=torch.__version__, commit=args.commit,
                   device=args.device)
    if args.device == "cuda":
        machine["gpu"] = torch.cuda.get_device_name(0)
        machine["gpu_memory"] = torch.cuda.get_device_properties(0).total_memory
    shape = {k: getattr(args, k) for k in ("layers", "hidden", "inter", "heads", "vocab", "batch", "seq")}
    out(f"machine: {machine.get('gpu', 'no GPU')} | {machine['cpu']}, {machine['cores']} cores | torch "
        f"{machine['torch']} | commit {machine['commit']}")
    out(f"model: HF Llama {shape}, bf16 compute, clip_grad_norm_(1.0); {args.steps} timed steps after "
        f"{args.warmup}; each configuration in its own process")
    results = {}
    for c in configs:
        cmd = [sys.executable, __file__, "--_one", c, "--port", str(free_port()), "--device", args.device,
               "--steps", str(args.steps), "--warmup", str(args.warmup)] + [f"--{k}={v}" for k, v in shape.items()]
        if args.checkpointing:
            cmd.append("--checkpointing")
        env = dict(os.environ)
        if c in ("engine", "always", "plain"):
            env["SUPERCHIP_EXECUTOR"] = "cuda" if args.device == "cuda" else "cpu"
            env["SUPERCHIP_SPECULATION"] = "always" if c == "always" else "auto"
        t = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
            rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as e:
            rc, stdout, stderr = "timeout", "", (e.stderr or b"").decode(errors="replace") if isinstance(
                e.stderr, bytes) else (e.stderr or "")
        if rc != 0:
            out(f"{CONFIGS[c]}: FAILED ({rc}) after {time.perf_counter() - t:.0f} s\n{stderr[-2500:]}")
            results[c] = dict(config=c, failed=str(rc), stderr=stderr[-2500:])
            continue
        r = json.loads(stdout.strip().splitlines()[-1])
        results[c] = r
        gib = 2**30
        mem = ""
        if "gpu_peak_bytes" in r:
            mem += f", torch CUDA peak {r['gpu_peak_bytes'] / gib:.1f} GiB"
        if "hbm_peak_bytes" in r:
            mem += f", hbm peak {r['hbm_peak_bytes'] / gib:.1f} GiB, host peak {r['host_peak_bytes'] / gib:.1f} GiB"
        out(f"{CONFIGS[c]}: {r['params'] / 1e9:.2f}B params, step {r['step_seconds'] * 1e3:.0f} ms, "
            f"{r['tokens_per_s']:.0f} tokens/s{mem} ({time.perf_counter() - t:.0f} s with the build)")
        if c in ("engine", "always"):
            out(f"    engine: optimizer {r['optimizer_seconds'] * 1e3:.0f} ms/step, exposed "
                f"{r['exposed_seconds'] * 1e3:.0f} ms/step, hidden {100 * r['hidden']:.0f}%; counters "
                f"{ {k: r['offload_stats'][k] for k in ('buckets', 'tail_buckets', 'speculated_buckets', 'deferred_buckets', 'rolled_back_buckets', 'lean_steps')} }")
        if c == "fsdp2":
            out(f"    optimizer: torch.optim.AdamW ({r['fsdp2_optimizer']}) on the CPU shards")
        out(f"    losses {[round(x, 4) for x in r['losses']]}")
    if "engine" in results and "failed" not in results["engine"]:
        e = results["engine"]["tokens_per_s"]
        for c, r in results.items():
            if c != "engine" and "failed" not in r:
                out(f"engine / {CONFIGS[c]}: {e / r['tokens_per_s']:.3f} (tokens/s)")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")
        Path(args.out).with_suffix(".json").write_text(
            json.dumps(dict(machine=machine, shape=shape, steps=args.steps, warmup=args.warmup,
                            results=results), indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

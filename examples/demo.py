"""Trains a small character-level GPT on the superchip device: the `make demo` script.

    python examples/demo.py                 # 300 steps on superchip
    python examples/demo.py --steps 30      # a quick check
    python examples/demo.py --device cpu    # the same run on plain PyTorch CPU, for comparison

The training loop is plain PyTorch; the superchip-specific lines are `import superchip`,
`.to("superchip")` and the optimizer, `superchip.optim.AdamW` (a drop-in for
torch.optim.AdamW whose state lives in the host tier; `--optimizer torch` uses torch's). The
superchip optimizer runs on the offload engine (its CPU step overlapped with backward and the
next forward, bit for bit the plain step's result; `--overlap off` steps after backward). At
the end it prints the loss before and after training, a greedy sample, how much of the
optimizer's CPU time the engine hid, the memory of each tier and the executor that ran the
kernels (cuda on a GPU machine, cpu otherwise). Exits with status 1 if the loss did not
decrease.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

import superchip

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from data import CharTokenizer, TEXT, get_batch  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

_MIB = 1024 * 1024


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--untied", action="store_true",
                   help="give the LM head its own weight instead of the token embedding's")
    p.add_argument("--lr", type=float, default=4e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=20, help="linear warm-up steps, then cosine")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip (0: off)")
    p.add_argument("--optimizer", choices=("torch", "superchip"), default="superchip",
                   help="superchip.optim.AdamW (default: fused CPU step, state in the host "
                        "tier) or torch.optim.AdamW")
    p.add_argument("--overlap", choices=("on", "off"), default="on",
                   help="superchip.optim only: the offload engine (default) or the plain step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="superchip")
    p.add_argument("--log-every", type=int, default=25,
                   help="steps between progress lines when stdout is not a terminal")
    p.add_argument("--sample-chars", type=int, default=200)
    p.add_argument("--prompt", default="To be")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    return args


def synchronize(device: torch.device) -> None:
    if device.type == "superchip":
        torch.superchip.synchronize()
    elif device.type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def eval_loss(model: GPT, batches, device: torch.device) -> float:
    """Mean loss over fixed batches, so the before/after figures are directly comparable."""
    model.eval()
    total = 0.0
    for x, y in batches:
        _, loss = model(x.to(device), y.to(device))
        total += loss.item()
    model.train()
    return total / len(batches)


class Progress:
    """A one-line progress bar (`\\r` rewrites) on a terminal; a line every N steps otherwise."""

    def __init__(self, total: int, log_every: int, stream=sys.stdout):
        self.total = total
        self.log_every = max(1, log_every)
        self.stream = stream
        self.tty = stream.isatty()

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        msg = f"step {step:>{len(str(self.total))}}/{self.total}  loss {loss:.4f}  " \
              f"{tokens_per_s:,.0f} tokens/s"
        if self.tty:
            width = 30
            filled = width * step // self.total
            self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {msg}")
            if step == self.total:
                self.stream.write("\n")
            self.stream.flush()
        elif step % self.log_every == 0 or step == 1 or step == self.total:
            print(msg, file=self.stream, flush=True)


def print_memory() -> None:
    s = superchip.memory_stats()

    def mib(key: str) -> str:
        return f"{s[key] / _MIB:9.2f} MiB"

    cap = s["hbm.capacity_bytes"]
    print("memory (superchip.memory_stats()):")
    print(f"  hbm   allocated {mib('hbm.allocated_bytes')}   peak {mib('hbm.peak_allocated_bytes')}"
          f"   reserved {mib('hbm.reserved_bytes')}   capacity "
          + (f"{cap / _MIB:.2f} MiB" if cap else "unlimited"))
    print(f"  host  allocated {mib('host.allocated_bytes')}   peak {mib('host.peak_allocated_bytes')}"
          f"   reserved {mib('host.reserved_bytes')}")


def print_offload(opt) -> None:
    s = opt.offload_stats()
    cpu, exposed = s["optimizer_seconds"], s["exposed_seconds"]
    hidden = 1.0 - exposed / cpu if cpu > 0 else 0.0
    print(f"optimizer (opt.offload_stats()): {cpu:.2f} s of CPU steps, {exposed:.2f} s exposed to "
          f"the training loop: {100 * hidden:.0f}% hidden; {s['buckets']} buckets, "
          f"{s['speculated_buckets']} speculated, {s['deferred_buckets']} deferred to step(), "
          f"{s['rolled_back_buckets']} rolled back, {s['probed_buckets']} probed; {s['lean_steps']} of "
          f"{s['steps']} steps lean (the asynchronous step alone hid the optimizer)")


def executor_description() -> str:
    ex = superchip.executor()
    if ex == "cuda" and torch.cuda.is_available():
        return f"cuda ({torch.cuda.get_device_name(torch.cuda.current_device())})"
    return ex


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)

    tok = CharTokenizer(TEXT)
    data = tok.encode(TEXT)
    cfg = GPTConfig(vocab_size=tok.vocab_size, seq_len=args.seq_len, n_layer=args.n_layer,
                    n_head=args.n_head, d_model=args.d_model, dropout=args.dropout,
                    tie_weights=not args.untied)
    torch.manual_seed(args.seed)
    model = GPT(cfg).to(device)
    if args.optimizer == "superchip":
        opt = superchip.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                                    overlap=args.overlap == "on")
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)

    def lr_factor(step: int) -> float:  # linear warm-up, then cosine down to 10%
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)

    print(f"superchip demo: {model.num_params():,}-parameter GPT ({cfg.n_layer} layers, "
          f"d={cfg.d_model}, {cfg.n_head} heads, seq {cfg.seq_len}, vocab {cfg.vocab_size}), "
          f"batch {args.batch_size}, {args.steps} steps, {args.optimizer}.optim.AdamW "
          f"lr {args.lr} (warm-up {args.warmup}, cosine)"
          + (f", offload engine {args.overlap}" if args.optimizer == "superchip" else ""))
    print(f"device {device}, executor {executor_description()}, torch {torch.__version__}")

    eval_gen = torch.Generator().manual_seed(args.seed + 1)
    eval_batches = [get_batch(data, args.batch_size, args.seq_len, eval_gen) for _ in range(4)]
    loss_before = eval_loss(model, eval_batches, device)

    gen = torch.Generator().manual_seed(args.seed)
    progress = Progress(args.steps, args.log_every)
    tokens_per_step = args.batch_size * args.seq_len
    synchronize(device)
    t_start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = get_batch(data, args.batch_size, args.seq_len, gen)
        x, y = x.to(device), y.to(device)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        sched.step()
        loss_value = loss.item()  # also waits for the step's kernels, so the rate is honest
        elapsed = time.perf_counter() - t_start
        progress.update(step, loss_value, step * tokens_per_step / elapsed)
    synchronize(device)
    train_s = time.perf_counter() - t_start

    loss_after = eval_loss(model, eval_batches, device)
    print(f"trained {args.steps} steps in {train_s:.1f} s: "
          f"{args.steps * tokens_per_step / train_s:,.0f} tokens/s, "
          f"{1000 * train_s / args.steps:.1f} ms/step")
    print(f"loss {loss_before:.4f} -> {loss_after:.4f} (on {len(eval_batches)} fixed batches)")

    model.eval()
    prompt = tok.encode(args.prompt)[None, :].to(device)
    sample = tok.decode(model.generate(prompt, args.sample_chars)[0].cpu())
    print("greedy sample:")
    print("  " + sample.replace("\n", "\n  "))

    if args.optimizer == "superchip":
        print_offload(opt)
    if device.type == "superchip":
        print_memory()
    print(f"executor: {executor_description()}")

    if not loss_after < loss_before:
        print(f"FAILED: the loss did not decrease ({loss_before:.4f} -> {loss_after:.4f})",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

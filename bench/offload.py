"""Offload engine benchmark (not a test): step time and hidden optimizer time, one run.

The demo GPT (and a Hugging Face LlamaForCausalLM with random init when `transformers` is
installed) is trained with superchip.optim.AdamW, clipping on, with overlap=False and with the
engine, clipping never triggering (max_norm 1e9) and triggering every step (max_norm 1e-3).
In emulated mode the executor gets one core (torch.set_num_threads(1)) and the optimizer the
other (SUPERCHIP_OPTIM_THREADS=1), so the overlap is real on a 2-core machine. Prints per
configuration: median step time, optimizer time, exposed time (the training thread waited)
and the fraction of optimizer time hidden = 1 - exposed / optimizer time of the same run;
the step-time ratio is engine / overlap=False measured in this run.

    python bench/offload.py [--steps 12] [--png bench/results/offload-timeline.png]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("SUPERCHIP_OPTIM_THREADS", "1")
import torch  # noqa: E402

import superchip  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from model import GPT, GPTConfig  # noqa: E402


def demo_model():
    cfg = GPTConfig(vocab_size=512, seq_len=128, n_layer=4, n_head=4, d_model=256)
    model = GPT(cfg)

    def loss_fn(m, x):
        return m(x, x)[1]

    return "demo GPT (3.4M params)", model, cfg.vocab_size, cfg.seq_len, loss_fn


def llama_model():
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return None
    cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg)

    def loss_fn(m, x):
        return m(input_ids=x, labels=x).loss

    return "HF Llama (random init)", model, cfg.vocab_size, 128, loss_fn


def run(build, overlap, max_norm, steps, timeline=False):
    name, model, vocab, seq, loss_fn = build()
    torch.manual_seed(0)
    model = model.to("superchip")
    opt = superchip.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, overlap=overlap)
    g = torch.Generator().manual_seed(0)
    times, marks = [], []
    for i in range(steps):
        x = torch.randint(0, vocab, (4, seq), generator=g).to("superchip")
        t0 = time.perf_counter()
        loss = loss_fn(model, x)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
        loss.item()
        t3 = time.perf_counter()
        times.append(t3 - t0)
        marks.append((t0, t1, t2, t3))
        if i == 1:
            base = opt.offload_stats()
    torch.superchip.synchronize()
    st = opt.offload_stats()
    n = steps - 2
    opt_s = (st["optimizer_seconds"] - base["optimizer_seconds"]) / n
    exp_s = (st["exposed_seconds"] - base["exposed_seconds"]) / n
    return dict(name=name, step=statistics.median(times[2:]), optimizer=opt_s, exposed=exp_s,
                hidden=1.0 - exp_s / opt_s if opt_s > 0 else 0.0, stats=st)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    if superchip.executor() == "cpu":
        torch.set_num_threads(1)
    print(f"torch {torch.__version__}, executor {superchip.executor()}, torch threads "
          f"{torch.get_num_threads()}, optimizer threads {superchip._C._optimizer_threads()}")
    for build in (demo_model, llama_model):
        if build() is None:
            print("HF Llama: skipped (transformers is not installed)")
            continue
        for label, max_norm in (("clip never triggers", 1e9), ("clip triggers every step", 1e-3)):
            plain = run(build, False, max_norm, args.steps)
            eng = run(build, True, max_norm, args.steps)
            print(f"{plain['name']}, {label}:")
            print(f"  overlap=False: step {plain['step'] * 1e3:.1f} ms, optimizer {plain['optimizer'] * 1e3:.1f} ms, "
                  f"exposed {plain['exposed'] * 1e3:.1f} ms")
            print(f"  engine:        step {eng['step'] * 1e3:.1f} ms, optimizer {eng['optimizer'] * 1e3:.1f} ms, "
                  f"exposed {eng['exposed'] * 1e3:.1f} ms, hidden {100 * eng['hidden']:.0f}% of optimizer time; "
                  f"step ratio engine/plain {eng['step'] / plain['step']:.3f}; speculated "
                  f"{eng['stats']['speculated_buckets']}, rolled back {eng['stats']['rolled_back_buckets']} "
                  f"of {eng['stats']['buckets']} buckets x {eng['stats']['steps']} steps")


if __name__ == "__main__":
    main()

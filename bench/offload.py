"""Offload engine benchmark (not a test): step time and hidden optimizer time, one run.

The demo GPT (and a Hugging Face LlamaForCausalLM with random init when `transformers` is
installed) is trained with superchip.optim.AdamW, clipping on, with overlap=False and with the
engine, clipping never triggering (max_norm 1e9) and triggering every step (max_norm 1e-3).
A third model is optimizer-bound (8 Linear(2048) layers at 8 tokens a step: backward is short
next to the CPU step, as for a large model on a fast GPU); it is also run with
SUPERCHIP_SPECULATION=always, the engine before its speculation budget (Note [Speculation
budget] in superchip/engine.py), to show what the budget saves.
In emulated mode the executor gets one core (torch.set_num_threads(1)) and the optimizer the
other (SUPERCHIP_OPTIM_THREADS=1), so the overlap is real on a 2-core machine. Prints per
configuration: median step time, optimizer time, exposed time (the training thread waited)
and the fraction of optimizer time hidden = 1 - exposed / optimizer time of the same run;
the step-time ratio is engine / overlap=False measured in this run.

With --png, one step (forward, backward, clip, step, and the next forward) of the demo GPT is
profiled with torch.profiler in both modes and drawn as a timeline (matplotlib): the training
thread's forward/backward/step and its waits for the engine, the engine worker's bucket
copies, speculative and asynchronous CPU steps, validations and rollbacks.

Figures are per step over the steps after the first --warmup (the predictor's first failures
are warm-up, as in any training run of thousands of steps).

    python bench/offload.py [--steps 30] [--warmup 5] [--png bench/results/offload-....png]
                            [--out bench/results/offload-....txt]
"""

from __future__ import annotations

import argparse
import json
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchinfo import cpu_model, git_commit  # noqa: E402


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


def optimizer_bound_model():
    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(8, 2048)
            self.layers = torch.nn.Sequential(*[m for _ in range(8) for m in (torch.nn.Linear(2048, 2048),
                                                                                torch.nn.GELU())])

        def forward(self, x):
            return self.layers(self.embed(x))

    def loss_fn(m, x):
        return m(x).square().mean()

    return "optimizer-bound MLP (33.6M params, 8 tokens/step)", MLP(), 8, 2, loss_fn


def _ranged(name, fn, *a):
    with torch.profiler.record_function(name):
        return fn(*a)


def run(build, overlap, max_norm, steps, warmup, timeline=False, speculation="auto"):
    name, model, vocab, seq, loss_fn = build()
    torch.manual_seed(0)
    model = model.to("superchip")
    os.environ["SUPERCHIP_SPECULATION"] = speculation  # read when the optimizer is built
    opt = superchip.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, overlap=overlap)
    g = torch.Generator().manual_seed(0)
    times = []

    def one_step(x):
        loss = _ranged("forward", loss_fn, model, x)
        _ranged("backward", loss.backward)

        def step():
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            opt.step()
            opt.zero_grad()

        _ranged("clip+step", step)
        return loss

    for i in range(steps):
        x = torch.randint(0, vocab, (4, seq), generator=g).to("superchip")
        t0 = time.perf_counter()
        loss = one_step(x)
        loss.item()
        times.append(time.perf_counter() - t0)
        if i == warmup - 1:
            base = opt.offload_stats()
    torch.superchip.synchronize()
    st = opt.offload_stats()
    n = steps - warmup
    opt_s = (st["optimizer_seconds"] - base["optimizer_seconds"]) / n
    exp_s = (st["exposed_seconds"] - base["exposed_seconds"]) / n
    events = None
    if timeline:
        xs = [torch.randint(0, vocab, (4, seq), generator=g).to("superchip") for _ in range(2)]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            one_step(xs[0])
            _ranged("forward", loss_fn, model, xs[1]).item()
            torch.superchip.synchronize()
        events = [(e.name, e.time_range.start, e.time_range.end, e.thread) for e in prof.events()
                  if e.name in ("forward", "backward", "clip+step") or e.name.startswith("superchip::")]
    return dict(name=name, step=statistics.median(times[warmup:]), optimizer=opt_s, exposed=exp_s,
                hidden=1.0 - exp_s / opt_s if opt_s > 0 else 0.0, stats=st, events=events)


_COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "clip+step": "#937860",
           "superchip::wait": "#c44e52", "superchip::bucket_copy": "#8172b3",
           "superchip::speculative_step": "#55a868", "superchip::cpu_step": "#64b5cd",
           "superchip::validate": "#da8bc3", "superchip::rollback": "#8c8c8c"}


def draw_timeline(runs, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(14, 2.2 * len(runs)), squeeze=False)
    for ax, (title, events) in zip(axes[:, 0], runs):
        t0 = min(e[1] for e in events)
        main_thread = next(e[3] for e in events if e[0] == "forward")
        rows = {"training thread": 1, "engine worker": 0}
        seen = set()
        for name, start, end, thread in events:
            if name.startswith("superchip::") and name != "superchip::wait" and thread == main_thread:
                continue  # an inline (tail or plain) step's inner ranges: drawn by clip+step
            row = rows["training thread"] if thread == main_thread else rows["engine worker"]
            ax.broken_barh([((start - t0) / 1e3, max((end - start) / 1e3, 0.05))], (row - 0.4, 0.8),
                           color=_COLORS.get(name, "#cccccc"), label=None if name in seen else name)
            seen.add(name)
        ax.set_yticks(list(rows.values()), list(rows.keys()))
        ax.set_xlabel("ms")
        ax.set_title(title, fontsize=10)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"timeline written to {path}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--png", default=None, help="write a timeline of one demo-GPT step here")
    ap.add_argument("--out", default=None, help="also write the report here (and a .json beside it)")
    args = ap.parse_args()
    if not 1 <= args.warmup < args.steps:
        ap.error("need 1 <= --warmup < --steps")
    if superchip.executor() == "cpu":
        torch.set_num_threads(1)
    lines, records = [], []

    def out(line=""):
        print(line, flush=True)
        lines.append(line)

    machine = dict(cpu=cpu_model(), cores=os.cpu_count(), torch=torch.__version__,
                   executor=superchip.executor(), torch_threads=torch.get_num_threads(),
                   optimizer_threads=superchip._C._optimizer_threads(), commit=git_commit())
    out(f"machine: {machine['cpu']}, {machine['cores']} cores | torch {machine['torch']} | executor "
        f"{machine['executor']} | torch threads {machine['torch_threads']}, optimizer threads "
        f"{machine['optimizer_threads']} | commit {machine['commit']}")
    out(f"superchip.optim.AdamW, clip_grad_norm_ every step; {args.steps} steps, figures over the "
        f"last {args.steps - args.warmup}; hidden = 1 - exposed / optimizer time")
    timelines = []
    for build in (demo_model, llama_model, optimizer_bound_model):
        if build() is None:
            print("HF Llama: skipped (transformers is not installed)")
            continue
        clips = (("clip never triggers", 1e9), ("clip triggers every step", 1e-3))
        for label, max_norm in clips[:1] if build is optimizer_bound_model else clips:
            draw = bool(args.png) and build is demo_model
            plain = run(build, False, max_norm, args.steps, args.warmup, timeline=draw)
            eng = run(build, True, max_norm, args.steps, args.warmup, timeline=draw)
            if draw:
                timelines += [(f"{plain['name']}, {label}, overlap=False", plain["events"]),
                              (f"{eng['name']}, {label}, engine", eng["events"])]
            hidden_vs_plain = 1.0 - eng["exposed"] / plain["optimizer"]
            st = eng["stats"]
            out(f"{plain['name']}, {label}:")
            out(f"  overlap=False: step {plain['step'] * 1e3:.1f} ms, optimizer {plain['optimizer'] * 1e3:.2f} ms "
                f"(all exposed)")
            out(f"  engine:        step {eng['step'] * 1e3:.1f} ms, optimizer {eng['optimizer'] * 1e3:.2f} ms, "
                f"exposed {eng['exposed'] * 1e3:.2f} ms")
            out(f"  hidden: {100 * hidden_vs_plain:.0f}% of overlap=False's optimizer time "
                f"({100 * eng['hidden']:.0f}% of the engine's own); step-time ratio engine / overlap=False "
                f"{eng['step'] / plain['step']:.3f}")
            out(f"  engine counters over all {st['steps']} steps: {st['buckets']} buckets, speculated "
                f"{st['speculated_buckets']}, deferred to step() {st['deferred_buckets']}, rolled back "
                f"{st['rolled_back_buckets']}, probed {st['probed_buckets']}, lean steps {st['lean_steps']}; undo log "
                f"{st['undo_bytes_per_param']:.2f} B/param")
            record = dict(model=plain["name"], clip=label, plain_step_s=plain["step"],
                          plain_optimizer_s=plain["optimizer"], engine_step_s=eng["step"],
                          engine_optimizer_s=eng["optimizer"], engine_exposed_s=eng["exposed"],
                          hidden_vs_plain=hidden_vs_plain, hidden_vs_engine=eng["hidden"],
                          step_ratio=eng["step"] / plain["step"], counters=st)
            if build is optimizer_bound_model:
                always = run(build, True, max_norm, args.steps, args.warmup, speculation="always")
                out(f"  engine, SUPERCHIP_SPECULATION=always (no budget): step {always['step'] * 1e3:.1f} ms, "
                    f"optimizer {always['optimizer'] * 1e3:.2f} ms, exposed {always['exposed'] * 1e3:.2f} ms; "
                    f"step-time ratio always / overlap=False {always['step'] / plain['step']:.3f}, "
                    f"engine / always {eng['step'] / always['step']:.3f}")
                record.update(always_step_s=always["step"], always_optimizer_s=always["optimizer"],
                              always_exposed_s=always["exposed"], always_counters=always["stats"])
            records.append(record)
    if timelines:
        draw_timeline(timelines, args.png)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")
        Path(args.out).with_suffix(".json").write_text(json.dumps(
            dict(machine=machine, steps=args.steps, warmup=args.warmup, results=records), indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

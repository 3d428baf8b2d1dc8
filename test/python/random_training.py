"""A training run drawn at random from a seed, for test_random_training.py: the model's shape
(widths, residual blocks, LayerNorms, an embedding with a tied head, frozen blocks, activation
checkpointing), the loop (inputs reused for a few passes, evaluation batches, gradient
accumulation, clipping, parameters read between backward and step), a frozen second model
moved in mid-run and read before the forward or between it and its backward, and events at
random steps (hbm budget raised, a parameter moved between tiers by hand, a state dict
reloaded, eval()/train()). Every draw comes from the seed, so every run of a seed trains the
same thing, on any device:

    python random_training.py SEED DEVICE OPTIMIZER HBM OVERLAP
        DEVICE     cpu | superchip
        OPTIMIZER  torch_sgd (torch.optim.SGD, momentum, foreach=False) | sc_adamw
        HBM        quarter (hbm budget a quarter of the parameters' bytes) | full (no budget)
        OVERLAP    0 | 1 (superchip.optim's offload engine)

It prints one JSON line: a digest of every loss's bits, a digest of the final state dict's
bytes, the configuration drawn, and superchip's streaming counters.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import random
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import superchip


class Res(nn.Module):
    def __init__(self, w: int):
        super().__init__()
        self.a, self.b, self.n = nn.Linear(w, 2 * w), nn.Linear(2 * w, w), nn.LayerNorm(w)

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(self.n(x))))


class Net(nn.Module):
    def __init__(self, w: int, blocks: list, ckpt: list, vocab: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, w) if vocab else nn.Linear(w, w)
        self.blocks = nn.ModuleList(blocks)
        self.ckpt = ckpt
        self.head = nn.Linear(w, vocab or w, bias=False)

    def forward(self, x):
        h = self.emb(x)
        for block, ckpt in zip(self.blocks, self.ckpt):
            if ckpt and self.training:
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
            else:
                h = block(h)
        return self.head(h)


def main(seed: int, dev: str, optimizer: str, hbm: str, overlap: bool) -> dict:
    rnd = random.Random(seed)
    torch.manual_seed(seed)
    w, depth = rnd.choice([64, 96, 128]), rnd.randint(3, 9)
    vocab = 500 if rnd.random() < 0.4 else 0
    blocks = []
    for _ in range(depth):
        k = rnd.random()
        if k < 0.5:
            blocks.append(nn.Sequential(nn.Linear(w, w), rnd.choice([nn.Tanh, nn.GELU, nn.SiLU])()))
        elif k < 0.85:
            blocks.append(Res(w))
        else:
            blocks.append(nn.LayerNorm(w))
    ckpt = [rnd.random() < 0.3 for _ in range(depth)]
    frozen = [rnd.random() < 0.15 for _ in range(depth)]
    net = Net(w, blocks, ckpt, vocab)
    tie = bool(vocab) and rnd.random() < 0.5
    if tie:
        net.head.weight = net.emb.weight
    for block, f in zip(net.blocks, frozen):
        if f:
            block.requires_grad_(False)
    second = rnd.choice(["none", "before", "between"])
    ref = nn.Sequential(nn.Linear(w, w), nn.Tanh(), nn.Linear(w, w)).requires_grad_(False) if second != "none" else None
    second_at = rnd.randint(0, 12)
    dtype = rnd.choice([torch.float32, torch.float32, torch.bfloat16])
    clip, peek = rnd.choice([0, 0, 1.0, 0.01]), rnd.random() < 0.3
    reuse, every_eval, accumulate, steps = rnd.choice([1, 1, 3, 8]), rnd.choice([0, 0, 5]), rnd.choice([1, 1, 2]), 24
    events = {rnd.randint(4, steps - 2): rnd.choice(["cap", "tier", "load", "evaltoggle", "none"]) for _ in range(2)}

    pbytes = sum(p.numel() * 4 for p in net.parameters())  # tied once: parameters() deduplicates
    if dev == "superchip":
        superchip.set_capacity("hbm", pbytes // 4 if hbm == "quarter" else 0)
    model = net.to(dev).to(dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer == "torch_sgd":
        # foreach=False: torch takes foreach by default on superchip and not on CPU, which
        # rounds bf16 differently (README, "Optimizers").
        opt = torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=False)
    else:
        opt = superchip.optim.AdamW(params, lr=1e-3, weight_decay=0.1, overlap=overlap)
    g = torch.Generator().manual_seed(seed + 1)

    def batch():
        if vocab:
            return torch.randint(0, vocab, (4, 16), generator=g)
        return torch.randn(4, 16, w, generator=g).to(dtype)

    def loss_of(out, x):
        if vocab:
            return F.cross_entropy(out.reshape(-1, vocab).float(), x.reshape(-1))
        return out.float().square().mean()

    eval_x = batch().to(dev)
    bits, r = [], None
    for i in range(steps):
        if i == second_at and ref is not None:
            r = ref.to(dev).to(dtype)
        if i % reuse == 0:
            x = batch().to(dev)
        event = events.get(i)
        if event == "cap" and dev == "superchip":
            superchip.set_capacity("hbm", pbytes // 2 if hbm == "quarter" else 0)
        if event == "tier":
            p, tier = rnd.choice(params), rnd.choice(["host", "hbm"])
            if dev == "superchip":
                was, before = superchip.tier_of(p), p.detach().cpu().clone()
                try:
                    superchip.move_to_tier(p, tier)
                except torch.OutOfMemoryError:  # hbm full: refused, nothing changed
                    assert superchip.tier_of(p) == was and torch.equal(p.detach().cpu(), before)
        if event == "load":
            buf = io.BytesIO()
            torch.save({k: v.cpu() for k, v in model.state_dict().items()}, buf)
            buf.seek(0)
            model.load_state_dict(torch.load(buf))
        if event == "evaltoggle":
            model.eval()
            model.train()
        for a in range(accumulate):
            xa = x if accumulate == 1 else x[2 * a:2 * a + 2]
            extra = 0
            if r is not None and second == "before":
                with torch.no_grad():
                    extra = r(model.emb(xa).detach() if vocab else xa).float().mean()
            out = model(xa)
            if r is not None and second == "between":
                with torch.no_grad():
                    extra = r(out.detach()[..., :w]).float().mean()
            loss = loss_of(out, xa) + extra
            (loss / accumulate).backward()
            bits.append(loss.item().hex())
        if peek:  # a parameter read between backward and step: the old values
            bits.append(params[0].detach().float().sum().item().hex())
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        opt.zero_grad(set_to_none=rnd.random() < 0.7)
        if every_eval and i % every_eval == every_eval - 1:
            model.eval()
            with torch.no_grad():
                bits.append(loss_of(model(eval_x), eval_x).item().hex())
            model.train()
    if dev == "superchip":
        torch.superchip.synchronize()
    h = hashlib.sha256()
    for k, v in model.state_dict().items():
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    config = dict(dtype=str(dtype), width=w, depth=depth, vocab=vocab, tied=tie, checkpointed=sum(ckpt),
                  frozen=sum(frozen), second=second, reuse=reuse, eval_every=every_eval,
                  accumulate=accumulate, clip=clip, peek=peek, events=sorted(events.values()))
    stats = {}
    if dev == "superchip":
        st = superchip.stream_stats()
        stats = {k: st[k] for k in ("plans", "hits", "staged_at_use", "in_place_reads")}
    return dict(losses=hashlib.sha256("".join(bits).encode()).hexdigest(), state=h.hexdigest(),
                config=config, stream=stats)


def engine_pair(seed: int) -> tuple[bool, dict]:
    """One model stepped by superchip.optim with the offload engine and its copy with
    overlap=False, side by side in this process (no hbm budget), through a loop drawn from
    `seed`: optimizer, dtype (fp16 as autocast with fp32 parameters and a GradScaler, its
    overflow steps included), two param groups, an LR scheduler, bucket size, gradient
    accumulation, clipping, gradients changed between backward and step, parameters read
    there, a backward whose step never comes, an optimizer state dict reloaded. True when every
    logged value and every parameter agree bit for bit."""
    rnd = random.Random(seed)
    torch.manual_seed(seed)
    w, depth = rnd.choice([32, 64, 128]), rnd.randint(2, 6)
    dtype = rnd.choice([torch.float32, torch.bfloat16, torch.float16])
    name = rnd.choice(["AdamW", "Adam", "SGD"])
    bucket_bytes, groups, sched = rnd.choice([None, 4096, 16384]), rnd.random() < 0.5, rnd.random() < 0.5
    scaled = dtype == torch.float16 and rnd.random() < 0.8
    clip, accumulate, set_none = rnd.choice([0, 0, 1.0, 1e-3]), rnd.choice([1, 1, 2, 3]), rnd.random() < 0.5
    peek, orphan, halve = rnd.random() < 0.4, rnd.random() < 0.3, rnd.random() < 0.3
    reload_at, init_scale = rnd.choice([None, 5, 9]), 2.0 ** rnd.choice([4, 16, 30])
    pdtype = torch.float32 if dtype == torch.float16 else dtype
    base = nn.Sequential(*[nn.Sequential(nn.Linear(w, w), nn.Tanh()) for _ in range(depth)], nn.LayerNorm(w),
                         nn.Linear(w, 8))
    models = [copy.deepcopy(base).to("superchip").to(pdtype) for _ in range(2)]

    def optimizer(m, overlap):
        params = m.parameters()
        if groups:
            decay = [p for n, p in m.named_parameters() if n.endswith("weight") and p.dim() == 2]
            rest = [p for n, p in m.named_parameters() if not (n.endswith("weight") and p.dim() == 2)]
            params = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
        kw = dict(lr=1e-2, overlap=overlap, **({"bucket_bytes": bucket_bytes} if bucket_bytes else {}))
        if name == "SGD":
            kw["momentum"] = 0.9
        return getattr(superchip.optim, name)(params, **kw)

    opts = [optimizer(models[0], True), optimizer(models[1], False)]
    scheds = [torch.optim.lr_scheduler.StepLR(o, 3, 0.5) for o in opts] if sched else None
    scalers = [torch.amp.GradScaler("superchip", init_scale=init_scale) for _ in opts] if scaled else None
    g = torch.Generator().manual_seed(seed)
    logs = [[], []]
    for i in range(14):
        xs = torch.randn(4 * accumulate, w, generator=g)
        for k in range(2):
            m, o, log = models[k], opts[k], logs[k]
            for a in range(accumulate):
                with torch.autocast("superchip", dtype=torch.float16, enabled=dtype == torch.float16):
                    loss = m(xs[4 * a:4 * a + 4].to("superchip").to(pdtype)).float().square().mean() / accumulate
                (scalers[k].scale(loss) if scaled else loss).backward()
                log.append(loss.item())
            if peek:
                log.append(sum(p.float().sum().item() for p in m.parameters()))
            if orphan and i % 5 == 2:  # gradients inspected, then zeroed: no step
                log.append(sum(p.grad.float().abs().sum().item() for p in m.parameters() if p.grad is not None))
                o.zero_grad(set_to_none=set_none)
                continue
            if halve and i % 4 == 1:
                with torch.no_grad():
                    for p in m.parameters():
                        if p.grad is not None:
                            p.grad.mul_(0.5)
            if scaled:
                scalers[k].unscale_(o)
            if clip:
                log.append(torch.nn.utils.clip_grad_norm_(m.parameters(), clip).item())
            if scaled:
                scalers[k].step(o)
                scalers[k].update()
            else:
                o.step()
            if sched:
                scheds[k].step()
            o.zero_grad(set_to_none=set_none)
        if reload_at == i:
            for o in opts:
                o.load_state_dict(copy.deepcopy(o.state_dict()))
    torch.superchip.synchronize()
    same = len(logs[0]) == len(logs[1]) and all(a == b or (a != a and b != b) for a, b in zip(*logs))
    same = same and all(torch.equal(p.cpu(), q.cpu()) for p, q in zip(models[0].parameters(), models[1].parameters()))
    st = opts[0].offload_stats()
    return same, dict(dtype=str(dtype), optimizer=name, groups=groups, sched=sched, scaled=scaled, clip=clip,
                      accumulate=accumulate, bucket_bytes=bucket_bytes, buckets=st["buckets"],
                      speculated=st["speculated_buckets"], rolled_back=st["rolled_back_buckets"],
                      skipped=st["skipped_steps"])


if __name__ == "__main__":
    seed, dev, optimizer, hbm, overlap = sys.argv[1:6]
    print(json.dumps(main(int(seed), dev, optimizer, hbm, overlap == "1")))

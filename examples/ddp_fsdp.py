"""Trains the demo GPT on several superchip devices with FSDP2 (or DDP) over torch.distributed.

    torchrun --nproc-per-node 2 examples/ddp_fsdp.py                  # FSDP2, fp32
    torchrun --nproc-per-node 2 examples/ddp_fsdp.py --bf16           # FSDP2, bf16 compute
    torchrun --nproc-per-node 2 examples/ddp_fsdp.py --mode ddp       # DDP
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:29500 examples/ddp_fsdp.py

The superchip-specific lines are `import superchip` (it registers the `sccl` c10d backend),
`.to("superchip")` and `superchip.optim.AdamW`. `dist.init_process_group()` without a
backend gives `cpu:gloo,superchip:sccl`: collectives on superchip tensors go through sccl
(NCCL underneath with the CUDA executor, Gloo emulated), CPU tensors through Gloo. With FSDP2
each rank steps only its shard of the parameters, so each rank's host tier holds 1/world of
the optimizer state: the run ends by printing every rank's host-tier bytes.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import superchip

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from data import CharTokenizer, TEXT, get_batch  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("fsdp", "ddp"), default="fsdp")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--bf16", action="store_true", help="FSDP2 MixedPrecisionPolicy(param_dtype=bf16)")
    p.add_argument("--no-reshard", action="store_true", help="FSDP2 reshard_after_forward=False")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    dist.init_process_group()  # no backend: cpu:gloo,superchip:sccl
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    torch.superchip.set_device(local_rank % torch.superchip.device_count())
    device = torch.device("superchip", torch.superchip.current_device())

    tok = CharTokenizer(TEXT)
    data = tok.encode(TEXT)
    cfg = GPTConfig(vocab_size=tok.vocab_size, seq_len=args.seq_len, n_layer=args.n_layer,
                    d_model=args.d_model)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = GPT(cfg).to(device)

    if args.mode == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("superchip", (world,))
        kw = dict(mesh=mesh, reshard_after_forward=not args.no_reshard)
        if args.bf16:
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        train_model = model
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        train_model = DDP(model)
    opt = superchip.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    if rank == 0:
        print(f"{args.mode}: {sum(p.numel() for p in model.parameters()):,} parameters, {world} ranks, "
              f"backend {dist.get_backend_config()} (sccl over {superchip.distributed.inner_group_backend()}), "
              f"executor {superchip.executor()}", flush=True)

    gen = torch.Generator().manual_seed(args.seed + 1000 * rank)  # each rank its own batches
    first = last = None
    for step in range(1, args.steps + 1):
        x, y = get_batch(data, args.batch_size, args.seq_len, gen)
        _, loss = train_model(x.to(device), y.to(device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().float().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        last = mean.item()
        first = last if first is None else first
        if rank == 0 and (step == 1 or step % 10 == 0 or step == args.steps):
            print(f"step {step:4d}  loss {last:.4f}", flush=True)

    host = torch.tensor([superchip.distributed.host_tier_bytes(device)], dtype=torch.int64)
    hosts = [torch.zeros_like(host) for _ in range(world)]
    dist.all_gather(hosts, host)
    state = sum(p.numel() for p in model.parameters()) * 4 * 2  # fp32 exp_avg + exp_avg_sq
    if rank == 0:
        for r, h in enumerate(hosts):
            print(f"rank {r}: host tier {int(h.item()):,} bytes "
                  f"(AdamW state of the whole model: {state:,} bytes)")
        st = opt.offload_stats()
        hidden = 1 - st["exposed_seconds"] / max(st["optimizer_seconds"], 1e-9)
        print(f"offload engine (rank 0): {st['speculated_buckets']} buckets speculated during backward, "
              f"{st['rolled_back_buckets']} rolled back (clipping changed their gradients), "
              f"{hidden:.0%} of optimizer time hidden")
        print(f"loss {first:.4f} -> {last:.4f}")
    ok = last < first
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

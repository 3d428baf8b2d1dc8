"""Two-process checks of torch.distributed on superchip, run by test_distributed.py.

Launched as ``python dist_checks.py RANK WORLD INIT_DIR RESULT_FILE GROUP``: each rank joins a
process group through a file rendezvous (no ports), runs every check of GROUP in order and
writes ``{check: "ok" | traceback}`` to RESULT_FILE. Every check compares superchip tensors
with the same work on CPU tensors in the same process group (CPU goes through Gloo), so a
collective the two ranks disagree on shows up as a failure on both ranks, not as a hang.
Checks must run the same collectives on every rank, failing or not, so one failure leaves
the others meaningful: assertions come after the collectives.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import superchip
from superchip.distributed import ulysses_attention

# The engine checks test speculation under DDP and FSDP2; how much of it runs must not depend
# on this machine's speed (Note [Speculation budget] in superchip/engine.py).
os.environ.setdefault("SUPERCHIP_SPECULATION", "always")

DEV = torch.device("superchip:0")
RANK = 0
WORLD = 2
INIT_DIR = ""


def eq(a, b, what=""):
    """Bitwise equality of a superchip tensor with a CPU one."""
    assert isinstance(a, torch.Tensor) and a.device.type == "superchip", f"{what}: {a!r} is not on superchip"
    a = a.cpu()
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    assert torch.equal(a, b), f"{what}: max diff {(a.double() - b.double()).abs().max().item()}"


def both(fn):
    """fn(device) on cpu, then on superchip: the two results."""
    return fn(torch.device("cpu")), fn(DEV)


def data(*shape, dtype=torch.float32, seed=0, rank=None):
    """Small integers (exact in every dtype and sum order), distinct per rank and seed."""
    g = torch.Generator().manual_seed(seed * 100 + (RANK if rank is None else rank))
    return (torch.randn(*shape, generator=g) * 4).round().to(dtype)


# ---- collectives ----

def check_backend_selection():
    pg = dist.group.WORLD
    assert pg._get_backend(torch.device("superchip")).name() == "sccl"
    assert pg._get_backend(torch.device("cpu")).name() == "gloo"
    assert superchip.distributed.is_sccl_group()
    assert superchip.distributed.inner_group_backend() == "gloo"


def check_broadcast():
    def run(d):
        t = data(5, 3).to(d)
        dist.broadcast(t, src=1)
        return t
    c, s = both(run)
    eq(s, c, "broadcast")


def check_allreduce_ops():
    ops = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "min": dist.ReduceOp.MIN,
           "max": dist.ReduceOp.MAX, "product": dist.ReduceOp.PRODUCT}
    for name, op in ops.items():
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            if dtype == torch.int64 and name == "avg":
                continue
            def run(d):
                t = data(7, dtype=dtype, seed=3).to(d)
                dist.all_reduce(t, op=op)
                return t
            c, s = both(run)
            eq(s, c, f"all_reduce {name} {dtype}")
    # AVG is SUM / world
    t = data(6).to(DEV)
    ref = t.cpu().clone()
    dist.all_reduce(ref)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    eq(t, ref / WORLD, "avg == sum / world")


def check_allgather():
    def run(d):
        out = [torch.empty(2, 3, device=d) for _ in range(WORLD)]
        dist.all_gather(out, data(2, 3).to(d))
        return torch.stack(out)
    c, s = both(run)
    eq(s, c, "all_gather")
    def run_base(d):
        out = torch.empty(WORLD * 4, 3, device=d, dtype=torch.bfloat16)
        dist.all_gather_into_tensor(out, data(4, 3, dtype=torch.bfloat16).to(d))
        return out
    c, s = both(run_base)
    eq(s, c, "all_gather_into_tensor")
    expected = torch.cat([data(4, 3, dtype=torch.bfloat16, rank=r) for r in range(WORLD)])
    assert torch.equal(c, expected), "all_gather_into_tensor on cpu gathered the wrong values"


def check_reduce_scatter():
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX):
        def run(d):
            out = torch.empty(3, device=d)
            dist.reduce_scatter(out, [data(3, seed=i).to(d) for i in range(WORLD)], op=op)
            return out
        c, s = both(run)
        eq(s, c, f"reduce_scatter {op}")
        def run_base(d):
            out = torch.empty(2, 5, device=d)
            dist.reduce_scatter_tensor(out, data(2 * WORLD, 5).to(d), op=op)
            return out
        c, s = both(run_base)
        eq(s, c, f"reduce_scatter_tensor {op}")


def check_coalesced():
    from torch.distributed.distributed_c10d import _coalescing_manager

    def run_ar(d):
        ts = [data(3, seed=i).to(d) for i in range(3)]
        with _coalescing_manager(async_ops=True) as cm:
            for t in ts:
                dist.all_reduce(t)
        cm.wait()
        return torch.cat(ts)
    c, s = both(run_ar)
    eq(s, c, "coalesced all_reduce")

    be = dist.group.WORLD._get_backend(DEV)
    ts = [data(4, seed=i).to(DEV) for i in range(2)]
    ref = [t.cpu() for t in ts]
    be.allreduce_coalesced(ts).wait()
    for r in ref:
        dist.all_reduce(r)
    for t, r in zip(ts, ref):
        eq(t, r, "allreduce_coalesced")

    outs = [torch.empty(WORLD * 2, device=DEV) for _ in range(2)]
    ins = [data(2, seed=i).to(DEV) for i in range(2)]
    with _coalescing_manager(async_ops=True) as cm:
        for o, i in zip(outs, ins):
            dist.all_gather_into_tensor(o, i)
    cm.wait()
    for o, i in zip(outs, ins):
        ref = torch.empty(WORLD * 2)
        dist.all_gather_into_tensor(ref, i.cpu())
        eq(o, ref, "coalesced all_gather_into_tensor")

    outs = [torch.empty(2, device=DEV) for _ in range(2)]
    ins = [data(WORLD * 2, seed=i).to(DEV) for i in range(2)]
    with _coalescing_manager(async_ops=True) as cm:
        for o, i in zip(outs, ins):
            dist.reduce_scatter_tensor(o, i)
    cm.wait()
    for o, i in zip(outs, ins):
        ref = torch.empty(2)
        dist.reduce_scatter_tensor(ref, i.cpu())
        eq(o, ref, "coalesced reduce_scatter_tensor")


def check_alltoall():
    def even(d):
        out = torch.empty(WORLD * 3, device=d)
        dist.all_to_all_single(out, data(WORLD * 3).to(d))
        return out
    c, s = both(even)
    eq(s, c, "all_to_all_single even")
    # rank r sends r+1+j rows to rank j
    in_splits = [RANK + 1 + j for j in range(WORLD)]
    out_splits = [i + 1 + RANK for i in range(WORLD)]
    def uneven(d):
        out = torch.empty(sum(out_splits), 2, device=d)
        dist.all_to_all_single(out, data(sum(in_splits), 2).to(d), out_splits, in_splits)
        return out
    c, s = both(uneven)
    eq(s, c, "all_to_all_single uneven")
    def listed(d):
        outs = [torch.empty(2, device=d) for _ in range(WORLD)]
        dist.all_to_all(outs, [data(2, seed=j).to(d) for j in range(WORLD)])
        return torch.cat(outs)
    # What rank j sends here is its input RANK. Computed, not taken from Gloo: torch 2.11's Gloo
    # has no list all_to_all ("Backend gloo does not support alltoall"), nor then has sccl
    # over Gloo (the CPU executor); over NCCL it has.
    expected = torch.cat([data(2, seed=RANK, rank=j) for j in range(WORLD)])
    try:
        assert torch.equal(listed(torch.device("cpu")), expected), "all_to_all on cpu"
        gloo_has_it = True
    except RuntimeError as e:
        if "does not support alltoall" not in str(e):
            raise
        gloo_has_it = False
    if gloo_has_it or superchip.distributed.inner_group_backend() != "gloo":
        eq(listed(DEV), expected, "all_to_all")


def check_send_recv():
    peer = 1 - RANK
    def run(d):
        t = data(4).to(d)
        got = torch.empty(4, device=d)
        if RANK == 0:
            dist.send(t, peer)
            dist.recv(got, peer)
        else:
            dist.recv(got, peer)
            dist.send(t, peer)
        reqs = [dist.isend(t, peer, tag=7), dist.irecv(got2 := torch.empty(4, device=d), peer, tag=7)]
        for r in reqs:
            r.wait()
        return torch.stack([got, got2])
    c, s = both(run)
    eq(s, c, "send/recv")
    assert torch.equal(c[0], data(4, rank=peer)) and torch.equal(c[1], data(4, rank=peer))


def check_reduce_gather_scatter():
    def run(d):
        t = data(3).to(d)
        dist.reduce(t, dst=0)
        g = [torch.empty(3, device=d) for _ in range(WORLD)] if RANK == 1 else None
        dist.gather(data(3, seed=5).to(d), g, dst=1)
        out = torch.empty(3, device=d)
        dist.scatter(out, [data(3, seed=j).to(d) for j in range(WORLD)] if RANK == 0 else None, src=0)
        parts = [t, out] + (g if g else [])
        return torch.cat(parts)
    c, s = both(run)
    eq(s, c, "reduce/gather/scatter")


def check_barrier_and_objects():
    dist.barrier()
    dist.barrier(device_ids=None)
    objs = [None] * WORLD
    dist.all_gather_object(objs, {"rank": RANK})
    assert objs == [{"rank": r} for r in range(WORLD)], objs
    lst = [RANK * 10]
    dist.broadcast_object_list(lst, src=1)
    assert lst == [10], lst


def check_host_tier_operands():
    t = data(6).to(DEV)
    superchip.move_to_tier(t, "host")
    ref = t.cpu()
    dist.all_reduce(t)
    dist.all_reduce(ref)
    assert superchip.tier_of(t) == "host"
    eq(t, ref, "host-tier all_reduce")
    out = torch.empty(WORLD * 6, device=DEV)
    superchip.move_to_tier(out, "host")
    dist.all_gather_into_tensor(out, t)
    ref_out = torch.empty(WORLD * 6)
    dist.all_gather_into_tensor(ref_out, ref)
    eq(out, ref_out, "host-tier all_gather_into_tensor")


def check_async_work_and_tier_move():
    t = data(1 << 16).to(DEV)
    ref = t.cpu()
    view = t[10:20]
    work = dist.all_reduce(t, async_op=True)
    err = None
    try:
        superchip.move_to_tier(view, "host")
    except RuntimeError as e:
        err = str(e)
    work.wait()
    dist.all_reduce(ref)
    fut_value = work.get_future().value()
    assert err is None or "in flight" in err, err
    # The move is refused while the collective runs; Gloo may also have finished already.
    if err is not None:
        assert "move_to_tier" in err and "wait" in err, err
    assert superchip._C._leased_storage_count() == 0
    superchip.move_to_tier(view, "host")  # allowed once the work completed
    assert superchip.tier_of(t) == "host"
    eq(t, ref, "async all_reduce")
    assert fut_value[0].device.type == "superchip" and fut_value[0].data_ptr() == t.data_ptr()
    assert work.is_completed() and work.is_success()
    # A held lease refuses deterministically: a recv that waits for a late send.
    got = torch.empty(4, device=DEV)
    if RANK == 0:
        req = dist.irecv(got, 1)
        try:
            superchip.move_to_tier(got, "host")
            refused = False
        except RuntimeError as e:
            refused = "in flight" in str(e) and "recv" in str(e)
        dist.barrier()
        req.wait()
        assert refused, "move_to_tier was not refused while a recv was in flight"
    else:
        dist.barrier()
        dist.send(data(4).to(DEV), 0)


def check_collective_writes_streamed_weight():
    # A weight in host is read through a copy staged in hbm (WeightStreamer). A collective that
    # writes it must make a copy staged while it ran stale, also when the write lands after the
    # call returned (an irecv whose send comes late).
    w = data(4096, seed=7).to(DEV)  # a weight: copied in whole from the CPU
    superchip.move_to_tier(w, "host")
    sent = data(4096, seed=8, rank=1)
    if RANK == 0:
        req = dist.irecv(w, 1)
        staged = superchip.stream_stats()["staged_copies"]
        before = (w * 1).cpu()  # stages a copy of the old bytes; the recv has not landed
        staged_during = superchip.stream_stats()["staged_copies"] - staged
        dist.barrier()
        req.wait()
        after = (w * 1).cpu()
        assert staged_during == 1, f"no copy was staged during the recv ({staged_during})"
        assert torch.equal(before, data(4096, seed=7))
        assert torch.equal(after, sent), "a read after the recv used the copy staged before it"
    else:
        dist.barrier()
        dist.send(sent.to(DEV), 0)


def check_collective_writes_a_parameter():
    # runtime/WriteWatch.h: a collective that writes a bf16 parameter's bytes (here through
    # .data, which moves no version) is a write its optimizer's fp32 master takes; the next
    # step (lr 0) wrote the old master back over the broadcast values (found by review).
    p = torch.nn.Parameter(data(64, seed=3).to(DEV, torch.bfloat16))
    opt = superchip.optim.SGD([p], lr=0.0, overlap=False)
    p.grad = torch.zeros_like(p)
    opt.step()  # the master exists
    dist.broadcast(p.data, 0)
    dist.all_reduce(p.data)
    opt.step()
    eq(p.detach(), data(64, seed=3, rank=0).to(torch.bfloat16) * WORLD, "collective writes undone")


def check_functional_collectives():
    import torch.distributed._functional_collectives as funcol

    # `* 1` waits for the AsyncCollectiveTensor and gives a plain tensor
    c, s = both(lambda d: funcol.all_reduce(data(4).to(d), "sum", dist.group.WORLD) * 1)
    eq(s, c, "funcol.all_reduce")
    c, s = both(lambda d: funcol.all_gather_tensor(data(2, 2).to(d), 0, dist.group.WORLD) * 1)
    eq(s, c, "funcol.all_gather_tensor")
    c, s = both(lambda d: funcol.reduce_scatter_tensor(data(4, 2).to(d), "sum", 0, dist.group.WORLD) * 1)
    eq(s, c, "funcol.reduce_scatter_tensor")


def check_other_backend_strings():
    """sccl alone, the spelled-out default, and "gloo" alone or spelled "cpu:gloo" (a CPU
    script's: superchip tensors get sccl; before, every collective on them raised "No backend
    type associated with device type superchip"), in fresh process groups."""
    for i, backend in enumerate(("sccl", "cpu:gloo,superchip:sccl", "gloo", "cpu:gloo")):
        pg = dist.new_group(backend=backend)
        t = data(3).to(DEV)
        c = data(3)
        dist.all_reduce(t, group=pg)
        dist.all_reduce(c, group=pg)
        dist.barrier(group=pg)
        eq(t, c, f"all_reduce on a {backend} group")
        expected_cpu = "sccl" if backend == "sccl" else "gloo"
        assert pg._get_backend(torch.device("cpu")).name() == expected_cpu
        dist.destroy_process_group(pg)


def check_device_id_and_split():
    """A world group bound to a device (eager init): DeviceMesh then splits the sccl group."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.destroy_process_group()
    dist.init_process_group(init_method=f"file://{os.path.join(INIT_DIR, 'rendezvous_bound')}",
                            rank=RANK, world_size=WORLD, device_id=DEV)
    assert dist.group.WORLD.bound_device_id == DEV
    mesh = init_device_mesh("superchip", (1, WORLD), mesh_dim_names=("replicate", "shard"))
    for dim in ("replicate", "shard"):
        pg = mesh.get_group(dim)
        assert pg._get_backend(DEV).name() == "sccl" and pg.size() == mesh.size(mesh.mesh_dim_names.index(dim))
        t = data(3).to(DEV)
        c = data(3)
        dist.all_reduce(t, group=pg)
        dist.all_reduce(c, group=pg)
        eq(t, c, f"all_reduce over the split '{dim}' group")
    # A group that leaves a rank out: that rank takes part in the split (before: AttributeError,
    # no perform_nocolor_split on the sccl backend), gets no group, and the others use theirs.
    alone = dist.new_group([0])
    if RANK == 0:
        t = data(4).to(DEV)
        dist.all_reduce(t, group=alone)
        eq(t, data(4), "all_reduce over a one-rank group")
    else:
        assert alone == dist.GroupMember.NON_GROUP_MEMBER, alone
    dist.barrier()


# ---- DDP ----

def mlp(seed=0, bn=False):
    torch.manual_seed(seed)
    layers = [nn.Linear(8, 16), nn.ReLU()]
    if bn:
        layers.append(nn.BatchNorm1d(16))
    layers += [nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)]
    return nn.Sequential(*layers)


def batches(n, dev, seed=1):
    g = torch.Generator().manual_seed(seed * 10 + RANK)
    return [(torch.randn(6, 8, generator=g).to(dev), torch.randn(6, 4, generator=g).to(dev)) for _ in range(n)]


def params_cpu(model):
    out = []
    for p in model.parameters():
        p = p.full_tensor() if hasattr(p, "full_tensor") else p
        out.append(p.detach().cpu().clone())
    return out


def train_ddp(dev, steps=3, accumulate=False, bn=False, optim="sgd", **ddp_kw):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = mlp(bn=bn).to(dev)
    ddp = DDP(model, **ddp_kw)
    if optim == "sgd":
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    elif optim == "superchip":
        opt = superchip.optim.AdamW(ddp.parameters(), lr=1e-2)
    else:
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, foreach=False)
    for x, y in batches(steps, dev):
        if accumulate:
            with ddp.no_sync():
                F.mse_loss(ddp(x), y).backward()
        F.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    out = params_cpu(model)
    if bn:
        out += [b.detach().cpu().clone() for b in model.buffers()]
    return out


def assert_params(s, c, what, exact=True):
    assert len(s) == len(c)
    for i, (a, b) in enumerate(zip(s, c)):
        if exact:
            assert torch.equal(a, b), f"{what}: tensor {i} differs by {(a - b).abs().max().item()}"
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: tensor {i}: {m}")


def check_ddp():
    variants = {
        "default": {},
        "bucket views, tiny buckets": dict(gradient_as_bucket_view=True, bucket_cap_mb=0.001),
        "no_sync accumulation": dict(accumulate=True),
        "static_graph": dict(static_graph=True),
        "BatchNorm buffers broadcast": dict(bn=True, broadcast_buffers=True),
        "find_unused_parameters": dict(find_unused_parameters=True),
    }
    for name, kw in variants.items():
        c = train_ddp(torch.device("cpu"), **kw)
        s = train_ddp(DEV, **kw)
        assert_params(s, c, f"DDP {name}")


def check_ddp_superchip_optim():
    c = train_ddp(torch.device("cpu"), optim="torch")
    s = train_ddp(DEV, optim="superchip")
    assert_params(s, c, "DDP + superchip.optim.AdamW vs torch.optim.AdamW", exact=False)


class _SlowBackward(nn.Module):
    """Identity whose backward takes 50 ms: the allreduces of the layers after it complete
    before backward reaches the layers before it, whatever else runs on the machine."""

    class _Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            import time

            time.sleep(0.05)
            return g

    def forward(self, x):
        return self._Fn.apply(x)


def train_ddp_engine(overlap, steps=5, user_hook=False, clip_at=(), join=False, late_hook=None, two_opts=False):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(6)]
    model = nn.Sequential(layers[0], _SlowBackward(), *layers[1:]).to(DEV)
    # A bucket per layer, so reduced gradients arrive while backward runs.
    ddp = DDP(model, bucket_cap_mb=0.25)
    if user_hook:
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    if two_opts:
        # One optimizer over the first layer, one over the layers after the slow one; always
        # speculating, so the count below does not depend on the speculation budget's timing.
        first, rest = list(layers[0].parameters()), [p for l in layers[1:] for p in l.parameters()]
        was = os.environ.get("SUPERCHIP_SPECULATION")
        os.environ["SUPERCHIP_SPECULATION"] = "always"
        try:
            opts = [superchip.optim.AdamW(ps, lr=1e-2, overlap=overlap, bucket_bytes=256 << 10) for ps in (first, rest)]
        finally:
            if was is None:
                del os.environ["SUPERCHIP_SPECULATION"]
            else:
                os.environ["SUPERCHIP_SPECULATION"] = was
    else:
        opts = [superchip.optim.AdamW(ddp.parameters(), lr=1e-2, overlap=overlap, bucket_bytes=256 << 10)]
    g = torch.Generator().manual_seed(10 + RANK)

    def loop(n):
        for step in range(n):
            x, y = torch.randn(256, 256, generator=g).to(DEV), torch.randn(256, 256, generator=g).to(DEV)
            F.mse_loss(ddp(x), y).backward()
            if step in clip_at:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
            for opt in opts:
                opt.step()
            for opt in opts:
                opt.zero_grad()
            if step == 1 and late_hook == "python":
                ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
            elif step == 1 and late_hook == "builtin":
                ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)

    if join:
        # Uneven inputs: rank 0 runs out first; DDP then divides by the ranks still training.
        from torch.distributed.algorithms.join import Join

        with Join([ddp], divide_by_initial_world_size=False):
            loop(steps + 2 * RANK)
    else:
        loop(steps)
    torch.superchip.synchronize()
    hooks = [h.__name__ for h, _ in ddp._comm_hooks]
    stats = [opt.offload_stats() for opt in opts] if overlap else None
    return params_cpu(model), (stats if two_opts or stats is None else stats[0]), hooks


def check_ddp_engine():
    # Note [Speculation under DDP] (superchip/distributed.py): the engine speculates from the
    # reduced gradients DDP's bucket allreduce leaves, through a communication hook that
    # reduces as DDP's built-in path does. Before, each speculation saw the local gradient and
    # was rolled back. Bit for bit the plain step's, whose DDP runs its built-in path: with 3
    # ranks (1/3 is inexact) too.
    plain, _, plain_hooks = train_ddp_engine(False)
    spec, stats, hooks = train_ddp_engine(True)
    # Clipping once: that step is redone, the predictor probes the first bucket backward
    # finishes (the smallest may be reduced only after backward, and was never probed, so
    # speculation never resumed), then speculates again.
    clip_plain, _, _ = train_ddp_engine(False, steps=8, clip_at=(1,))
    clip, clip_stats, _ = train_ddp_engine(True, steps=8, clip_at=(1,))
    # A hook of the user's stays the only one; the engine then takes the plain path.
    user_plain, _, _ = train_ddp_engine(False, user_hook=True)
    user, _, user_hooks = train_ddp_engine(True, user_hook=True)
    # Join(divide_by_initial_world_size=False): DDP divides by the ranks not joined yet, which a
    # hook cannot know: none is installed.
    join_plain, _, _ = train_ddp_engine(False, join=True)
    joined, _, join_hooks = train_ddp_engine(True, join=True)
    # Note [A user's hook after superchip's] (distributed.py): a hook the user registers after
    # the optimizer's first step() replaces superchip's; DDP refused it before ("can only be
    # called once"). The plain run registers it on a DDP with no hook; same bits.
    late_plain, _, _ = train_ddp_engine(False, late_hook="python")
    late, _, late_hooks = train_ddp_engine(True, late_hook="python")
    late_builtin, _, _ = train_ddp_engine(True, late_hook="builtin")
    assert plain_hooks == [] and hooks == ["_reduce_like_ddp"], (plain_hooks, hooks)
    assert stats["speculated_buckets"] > 0 and stats["rolled_back_buckets"] == 0, stats
    assert_params(spec, plain, "DDP + engine vs overlap=False")
    assert clip_stats["rolled_back_buckets"] > 0 and clip_stats["probed_buckets"] > 0, clip_stats
    assert clip_stats["speculated_buckets"] - clip_stats["rolled_back_buckets"] >= 3 * clip_stats["buckets"], clip_stats
    assert_params(clip, clip_plain, "DDP + clipping once + engine vs overlap=False")
    assert user_hooks == ["allreduce_hook"], user_hooks
    assert_params(user, user_plain, "DDP (user's comm hook) + engine vs overlap=False")
    assert join_hooks == [], join_hooks
    assert late_hooks == ["fp16_compress_hook"], late_hooks
    assert_params(late, late_plain, "DDP + a user's hook after the first step() + engine vs overlap=False")
    assert_params(late_builtin, late_plain, "DDP + a built-in hook after the first step() + engine")
    # Two optimizers over one DDP model (DDPListener in distributed.py): each takes its own
    # reduced buckets, and the one over the last layers, whose own hooks all come before the
    # slow layer's backward, speculates its buckets from the other's hooks. Before, the two
    # shared one list and the second speculated nothing.
    two_plain, _, _ = train_ddp_engine(False, steps=6, two_opts=True)
    two, (s_first, s_rest), _ = train_ddp_engine(True, steps=6, two_opts=True)
    assert_params(two, two_plain, "DDP + two optimizers + engine vs overlap=False")
    assert s_rest["speculated_buckets"] >= 3 * s_rest["buckets"] and s_rest["rolled_back_buckets"] == 0, s_rest
    assert s_first["rolled_back_buckets"] == 0, s_first
    assert_params(joined, join_plain, "DDP under Join (uneven inputs) + engine vs overlap=False")


# ---- FSDP2 ----

def shard(model, mesh, **kw):
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def train_fsdp(dev, steps=3, optim="torch", clip=True, **kw):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(dev.type, (WORLD,))
    model = shard(mlp().to(dev), mesh, **kw)
    if optim == "superchip":
        opt = superchip.optim.AdamW(model.parameters(), lr=1e-2)
    elif optim == "superchip_plain":
        opt = superchip.optim.AdamW(model.parameters(), lr=1e-2, overlap=False)
    elif optim == "superchip_sgd":
        opt = superchip.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    elif optim == "torch_sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, foreach=False)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    for x, y in batches(steps, dev):
        F.mse_loss(model(x).float(), y).backward()
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            assert norm.device.type == (dev.type if "offload_policy" not in kw else "cpu")
        opt.step()
        opt.zero_grad()
    return model, opt


def check_fsdp2():
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    variants = {
        "reshard_after_forward=True": dict(reshard_after_forward=True),
        "reshard_after_forward=False": dict(reshard_after_forward=False),
        "MixedPrecisionPolicy(bf16)": dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)),
        "bf16 params, fp32 reduce": dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                        reduce_dtype=torch.float32)),
        "CPUOffloadPolicy": dict(offload_policy=CPUOffloadPolicy()),
    }
    for name, kw in variants.items():
        c = params_cpu(train_fsdp(torch.device("cpu"), **kw)[0])
        m, _ = train_fsdp(DEV, **kw)
        s = params_cpu(m)
        if "offload" not in name.lower():
            assert all(p.to_local().device.type == "superchip" for p in m.parameters()), name
        assert_params(s, c, f"FSDP2 {name}")


def check_fsdp2_superchip_optim():
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    for name, kw in (("bf16 compute", dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))),
                     ("CPUOffloadPolicy", dict(offload_policy=CPUOffloadPolicy()))):
        c = params_cpu(train_fsdp(torch.device("cpu"), optim="torch", **kw)[0])
        s = params_cpu(train_fsdp(DEV, optim="superchip", **kw)[0])
        assert_params(s, c, f"FSDP2 {name} + superchip.optim vs torch AdamW", exact=False)
    c = params_cpu(train_fsdp(torch.device("cpu"), optim="torch_sgd")[0])
    s = params_cpu(train_fsdp(DEV, optim="superchip_sgd")[0])
    assert_params(s, c, "FSDP2 + superchip.optim.SGD (Nesterov) vs torch SGD", exact=False)
    c_model, _ = train_fsdp(torch.device("cpu"), optim="torch")
    s_model, s_opt = train_fsdp(DEV, optim="superchip")
    assert_params(params_cpu(s_model), params_cpu(c_model), "FSDP2 + superchip.optim vs torch AdamW", exact=False)
    from torch.distributed.tensor import DTensor

    total_local = total_global = 0
    for p in s_model.parameters():
        st = s_opt.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            assert isinstance(st[key], DTensor), f"{key} is {type(st[key])}"
            assert st[key].placements == p.placements and st[key].shape == p.shape
            assert superchip.tier_of(st[key].to_local()) == "host"
            total_local += st[key].to_local().numel()
            total_global += st[key].numel()
    # Each rank keeps 1/world of the host-resident state (shards of dim 0; sizes are even here).
    assert total_local * WORLD == total_global, (total_local, total_global)
    gc.collect()
    host = superchip.memory_stats()["host.requested_bytes"]  # bytes asked for, before rounding
    assert total_local * 4 <= host < total_global * 4, (host, total_local, total_global)
    # The engine's speculation holds under FSDP2 (the gradients its hooks see are the reduced
    # shards): before, every speculated bucket was rolled back, because the local shard of a
    # parameter (DTensor.to_local()) is a new view object at each step() and the validation
    # compared identities. Bit for bit the plain step's.
    del s_model, s_opt
    e_model, e_opt = train_fsdp(DEV, steps=4, optim="superchip", clip=False)
    p_model, _ = train_fsdp(DEV, steps=4, optim="superchip_plain", clip=False)
    # With clipping (it scales the local shards of the DTensor gradients in place, which left
    # the DTensor's version counter as it was): the speculations must be redone, not committed
    # (Note [Validation compares bytes] in engine/AdamBucket.cpp). Before: off by about 1e-3.
    ce_model, ce_opt = train_fsdp(DEV, steps=6, optim="superchip", clip=True)
    cp_model, _ = train_fsdp(DEV, steps=6, optim="superchip_plain", clip=True)
    stats = e_opt.offload_stats()
    assert stats["speculated_buckets"] > 0 and stats["rolled_back_buckets"] == 0, stats
    assert_params(params_cpu(e_model), params_cpu(p_model), "FSDP2 + engine vs overlap=False")
    clipped = ce_opt.offload_stats()
    assert clipped["rolled_back_buckets"] > 0, clipped
    assert_params(params_cpu(ce_model), params_cpu(cp_model), "FSDP2 + clipping + engine vs overlap=False")


def check_fsdp2_optimizer_state_dict_roundtrip():
    # superchip.optim.load_state_dict under FSDP2 hands the engine DTensor state, which it places
    # in host with move_to_tier: a DTensor there (no storage of its own) crashed every rank with
    # a segmentation fault at the next step (found by review). Now a DTensor's local shard moves.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    model, opt = train_fsdp(DEV, steps=2, optim="superchip", clip=False)
    model2 = shard(mlp(seed=3).to(DEV), init_device_mesh(DEV.type, (WORLD,)))
    model2.load_state_dict(model.state_dict())
    opt2 = superchip.optim.AdamW(model2.parameters(), lr=1e-2)
    opt2.load_state_dict(opt.state_dict())
    for x, y in batches(2, DEV, seed=7):
        for m, o in ((model, opt), (model2, opt2)):
            F.mse_loss(m(x).float(), y).backward()
            o.step()
            o.zero_grad()
    assert_params(params_cpu(model2), params_cpu(model), "FSDP2 + superchip.optim resumed by load_state_dict")
    for p in model2.parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            assert isinstance(opt2.state[p][key], DTensor) and superchip.tier_of(opt2.state[p][key]) == "host"
    # The public calls on an FSDP2 parameter act on this rank's shard.
    p = next(model2.parameters())
    assert isinstance(p, DTensor) and superchip.tier_of(p) == "hbm"
    assert superchip.move_to_tier(p, "host") is p
    assert superchip.tier_of(p) == "host" and superchip.tier_of(p.to_local()) == "host"


def check_fsdp2_bf16_reload():
    # Note [A written parameter is its master's new value] (optim.py) for FSDP2's sharded
    # parameters: weights loaded with set_model_state_dict after some steps were overwritten by
    # the next step from the optimizer's fp32 master (a step at lr=0 moved them by up to 0.03;
    # found by review). A DTensor's writes count in its own version, not its shard's.
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    for overlap in (True, False):
        torch.manual_seed(0)
        model = shard(mlp().bfloat16().to(DEV), init_device_mesh(DEV.type, (WORLD,)))
        opt = superchip.optim.AdamW(model.parameters(), lr=1e-2, overlap=overlap)
        loaded = {k: v.detach().clone() for k, v in get_model_state_dict(model).items()}

        def step(xy):
            F.mse_loss(model(xy[0].bfloat16()).float(), xy[1]).backward()
            opt.step()
            opt.zero_grad()

        for xy in batches(3, DEV):
            step(xy)
        set_model_state_dict(model, loaded)
        for group in opt.param_groups:
            group["lr"] = 0.0  # weight decay too: lr * wd = 0
        step(next(iter(batches(1, DEV, seed=5))))
        torch.superchip.synchronize()
        for name, p in get_model_state_dict(model).items():
            eq(p.full_tensor(), loaded[name].full_tensor().cpu(), f"{name} after a step at lr=0 (overlap={overlap})")


def check_dcp_roundtrip():
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = os.path.join(INIT_DIR, "dcp")
    model, opt = train_fsdp(DEV, steps=2, optim="superchip")
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    before = params_cpu(model)
    state_before = {k: v.full_tensor().cpu() for k, v in osd["state"]["0.weight"].items() if k != "step"}
    # a fresh model and optimizer, one step apart from the saved ones, then reload
    model2, opt2 = train_fsdp(DEV, steps=1, optim="superchip")
    msd2, osd2 = get_state_dict(model2, opt2)
    dcp.load({"model": msd2, "optim": osd2}, checkpoint_id=path)
    set_state_dict(model2, opt2, model_state_dict=msd2, optim_state_dict=osd2)
    assert_params(params_cpu(model2), before, "DCP reload: parameters")
    _, osd3 = get_state_dict(model2, opt2)
    for k, v in state_before.items():
        assert torch.equal(osd3["state"]["0.weight"][k].full_tensor().cpu(), v), f"DCP reload: {k}"
    # both continue identically
    for m, o in ((model, opt), (model2, opt2)):
        for x, y in batches(1, DEV, seed=9):
            F.mse_loss(m(x), y).backward()
            o.step()
            o.zero_grad()
    assert_params(params_cpu(model2), params_cpu(model), "DCP reload: next step")


# ---- DTensor init, Ulysses ----

def check_dtensor_random_init():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("superchip", (WORLD,))

    def init(seed, placement):
        torch.manual_seed(seed)
        t = distribute_tensor(torch.zeros(8, 6, device=DEV), mesh, [placement])
        nn.init.kaiming_uniform_(t, a=5 ** 0.5)
        return t

    a, b = init(3, Shard(0)), init(3, Shard(0))
    full = a.full_tensor().cpu()
    assert torch.equal(full, b.full_tensor().cpu()), "same seed, different init"
    halves = full.chunk(WORLD)
    assert not torch.equal(halves[0], halves[1]), "shards are identical across ranks"
    bound = 1 / 6 ** 0.5
    assert full.abs().max() <= bound and full.abs().max() > bound / 2
    assert not torch.equal(full, init(4, Shard(0)).full_tensor().cpu())
    r = init(3, Replicate()).to_local().cpu()
    gathered = [torch.empty_like(r) for _ in range(WORLD)]
    dist.all_gather(gathered, r)
    assert torch.equal(gathered[0], gathered[1]), "replicated DTensor differs across ranks"
    # every rank's generator advanced identically
    st = torch.superchip.get_rng_state()
    states = [torch.empty_like(st) for _ in range(WORLD)]
    dist.all_gather(states, st)
    assert torch.equal(states[0], states[1]), "RNG states diverged across ranks"

    # meta-device init, fully_shard, then reset_parameters(): shards initialised in place
    torch.manual_seed(5)
    with torch.device("meta"):
        model = mlp()
    shard(model, mesh)
    model.to_empty(device=DEV)
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    w = model[0].weight
    assert w.to_local().device.type == "superchip"
    full = w.full_tensor().cpu()
    assert not torch.equal(*full.chunk(WORLD)), "meta init: shards identical across ranks"
    assert 0 < full.abs().max() <= 1 / 8 ** 0.5


def check_ulysses():
    def attn(q, k, v, causal=False):
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           is_causal=causal)
        return o.transpose(0, 1)

    for seq, heads, lens, causal in ((8, 4, [4, 4], False), (7, 5, [3, 4], True), (6, 3, [3, 3], True)):
        g = torch.Generator().manual_seed(seq * heads)
        q, k, v, w = (torch.randn(seq, heads, 6, generator=g, dtype=torch.float64) for _ in range(4))
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        ref = attn(qr, kr, vr, causal)
        (ref * w).sum().backward()
        off = sum(lens[:RANK])
        sl = slice(off, off + lens[RANK])
        ql, kl, vl = (t[sl].to(DEV).requires_grad_() for t in (q, k, v))
        out = ulysses_attention(attn, ql, kl, vl, causal=causal)
        (out * w[sl].to(DEV)).sum().backward()
        what = f"ulysses S={seq} H={heads} causal={causal}"
        eq(out, ref[sl].detach(), what + " forward")
        for name, got, want in (("q", ql, qr), ("k", kl, kr), ("v", vl, vr)):
            eq(got.grad, want.grad[sl], f"{what} grad {name}")


GROUPS = {
    "collectives": ["backend_selection", "broadcast", "allreduce_ops", "allgather", "reduce_scatter",
                    "coalesced", "alltoall", "send_recv", "reduce_gather_scatter",
                    "barrier_and_objects", "host_tier_operands", "async_work_and_tier_move",
                    "collective_writes_streamed_weight", "collective_writes_a_parameter",
                    "functional_collectives", "other_backend_strings", "device_id_and_split"],
    "training": ["ddp", "ddp_superchip_optim", "ddp_engine", "fsdp2", "fsdp2_superchip_optim",
                 "fsdp2_optimizer_state_dict_roundtrip", "fsdp2_bf16_reload", "dcp_roundtrip", "dtensor_random_init", "ulysses"],
    "three_ranks": ["ddp_engine"],  # launched on 3 ranks (test_distributed.py)
}


def main() -> int:
    global RANK, WORLD, INIT_DIR
    RANK, WORLD, INIT_DIR, result_file, group = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    import warnings

    warnings.filterwarnings("ignore")
    dist.init_process_group(init_method=f"file://{os.path.join(INIT_DIR, 'rendezvous')}",
                            rank=RANK, world_size=WORLD)
    results = {}
    for name in GROUPS[group]:
        try:
            globals()[f"check_{name}"]()
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
        with open(result_file, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""torch.distributed on superchip: the sccl backend, DDP, FSDP2, superchip.optim on shards,
DCP, DTensor random init and Ulysses attention, each in two processes (dist_checks.py) and
compared with the same work on CPU tensors (Gloo) in the same process group; plus the
single-process parts of the device module that DeviceMesh/FSDP2 use (streams, events,
record_stream).

Two launches of two processes hold every multi-process check, to keep CI time low; each
check is its own pytest case that reads the launch's results.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import superchip

from dist_checks import GROUPS
from helpers import run_python

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD = 2


def launch(group: str, tmp_path_factory, world: int = WORLD) -> dict:
    """Runs every check of `group` on `world` ranks; returns {check: [result per rank]}."""
    root = tmp_path_factory.mktemp(f"dist_{group}")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    procs, files = [], []
    for rank in range(world):
        out = root / f"result{rank}.json"
        files.append(out)
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(HERE, "dist_checks.py"), str(rank), str(world), str(root),
             str(out), group], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            logs.append(p.communicate()[0])
            pytest.fail(f"{group}: ranks timed out (a collective hung); output:\n" + "\n".join(logs)[-4000:])
    results = {}
    for rank, f in enumerate(files):
        got = json.loads(f.read_text()) if f.exists() else {}
        for name in GROUPS[group]:
            results.setdefault(name, []).append(
                got.get(name, f"rank {rank} did not run it (exit {procs[rank].returncode}):\n{logs[rank][-3000:]}"))
    return results


@pytest.fixture(scope="module")
def collectives(tmp_path_factory):
    return launch("collectives", tmp_path_factory)


@pytest.fixture(scope="module")
def training(tmp_path_factory):
    return launch("training", tmp_path_factory)


def assert_ok(results: dict, name: str) -> None:
    failed = [f"rank {r}:\n{msg}" for r, msg in enumerate(results[name]) if msg != "ok"]
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("name", GROUPS["collectives"])
def test_collective(collectives, name):
    assert_ok(collectives, name)


@pytest.mark.parametrize("name", GROUPS["training"])
def test_training(training, name):
    assert_ok(training, name)


def test_ddp_engine_on_three_ranks(tmp_path_factory):
    # DDP divides by the world size: 1/3 is inexact, so the engine's hook must multiply exactly
    # as DDP's built-in path does (Note [Speculation under DDP] in superchip/distributed.py).
    assert_ok(launch("three_ranks", tmp_path_factory, world=3), "ddp_engine")


# ---- single process ----

def test_importing_superchip_after_init_process_group_warns(tmp_path):
    # Found by review: a group made before the import has no backend for superchip tensors;
    # their collectives failed with torch's "No backend type associated with device type
    # superchip", which names neither cause nor remedy.
    code = f'''
import torch.distributed as dist
dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
import superchip
print("OK")
'''
    r = run_python(code)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]
    assert "imported after torch.distributed.init_process_group()" in r.stderr, r.stderr[-3000:]
    assert "cpu:gloo,superchip:sccl" in r.stderr, r.stderr[-3000:]


def test_backend_registered():
    assert "sccl" in dist.Backend.backend_list
    assert dist.Backend.default_device_backend_map["superchip"] == "sccl"
    assert dist.get_default_backend_for_device("superchip") == "sccl"
    assert set(dist.Backend.backend_capability["sccl"]) == {"superchip", "cpu"}


def test_every_backend_string_gives_superchip_tensors_a_backend():
    # Found by review: a GPU script's init_process_group("nccl") (torch: cuda:nccl only) or a
    # composite without superchip ("cpu:gloo,cuda:nccl") left superchip tensors without a
    # backend: the first collective, or DDP's constructor, raised "No backend type associated
    # with device type superchip". They get sccl (NCCL underneath with the CUDA executor) and
    # keep what they name for other devices; a string naming superchip is taken as written.
    # The config is what init_process_group and new_group build their groups from; "cpu:gloo"
    # and "gloo" also run collectives in the two-rank launch (check_other_backend_strings).
    from torch.distributed.distributed_c10d import BackendConfig

    def config(backend):
        return {k: str(v) for k, v in BackendConfig(dist.Backend(backend)).get_device_backend_map().items()}

    assert config("nccl") == {"cuda": "nccl", "superchip": "sccl"}
    assert config("cpu:gloo,cuda:nccl") == {"cpu": "gloo", "cuda": "nccl", "superchip": "sccl"}
    assert config("cpu:gloo") == {"cpu": "gloo", "superchip": "sccl"}
    assert config("gloo") == config(dist.Backend.UNDEFINED) == {"cpu": "gloo", "superchip": "sccl"}
    assert config("sccl") == {"cpu": "sccl", "superchip": "sccl"}
    assert config("superchip:gloo") == {"superchip": "gloo"}


def test_device_module_for_fsdp():
    sc = torch.superchip
    assert sc.is_initialized() and sc.is_available()
    s = sc.Stream()
    assert isinstance(s, torch.Stream) and s.device.type == "superchip"
    assert s != sc.default_stream()
    with sc.stream(s):
        assert sc.current_stream() == s
    assert sc.current_stream() == sc.default_stream()
    e = sc.Event()
    e.record(s)
    s.wait_event(e)
    sc.current_stream().wait_stream(s)
    e.synchronize()  # before query(): on a GPU shared with other work the event may still run
    assert e.query()
    sc.synchronize()
    assert s.query()
    timed = [sc.Event(enable_timing=True) for _ in range(2)]
    timed[0].record()
    timed[1].record()
    timed[1].synchronize()  # CUDA's elapsed_time raises while either event is incomplete
    assert timed[0].elapsed_time(timed[1]) >= 0


@pytest.mark.skipif(superchip.executor() != "cpu",
                    reason="holds an emulated stream busy (_hold_emulated_stream); CUDA streams need a real kernel")
def test_record_stream_defers_reuse(clean_memory):
    sc = torch.superchip
    side = sc.Stream()
    t = torch.ones(4096, device="superchip")
    t.record_stream(side)
    ptr = t.untyped_storage().data_ptr()
    superchip._C._hold_emulated_stream(0, side.stream_id, True)  # the side stream "still runs"
    try:
        del t
        assert superchip._C._pending_stream_frees() == 1
        others = [torch.empty(4096, device="superchip") for _ in range(4)]
        assert all(o.untyped_storage().data_ptr() != ptr for o in others)
        assert superchip.memory_stats()["hbm.active_allocations"] >= 5
    finally:
        superchip._C._hold_emulated_stream(0, side.stream_id, False)
    again = torch.empty(4096, device="superchip")  # the next allocation retires the block
    assert superchip._C._pending_stream_frees() == 0
    del others, again
    with pytest.raises(RuntimeError, match="superchip stream"):
        torch.ones(2, device="superchip").record_stream(torch.Stream(device="cpu"))


@pytest.mark.skipif(superchip.executor() != "cpu",
                    reason="holds an emulated stream busy (_hold_emulated_stream); CUDA streams need a real kernel")
def test_a_freed_block_waits_for_the_stream_that_allocated_it():
    # Note [Blocks and the streams that allocate them]: superchip's tiers are one pool for all
    # streams, where CUDA's allocator keeps a freed block for its own stream. Once a second
    # stream allocates, a freed block waits for the stream that allocated it (before: handed to
    # the next allocation of any stream while its stream's kernels could still use it). A
    # fresh process: the switch is once per process.
    code = """
import torch, superchip
sc = torch.superchip
hold = superchip._C._hold_emulated_stream
pending = superchip._C._pending_stream_frees
ptr = lambda t: t.untyped_storage().data_ptr()
n = 4096
side = sc.Stream()
base = torch.empty(n, device="superchip")   # the device's first stream: the default one
active = superchip.memory_stats()["hbm.active_allocations"]

# One stream: a freed block goes back at once, as in CUDA's allocator.
hold(0, 0, True)
a = torch.empty(n, device="superchip"); del a
assert pending() == 0, pending()
hold(0, 0, False)

# A second stream allocates; a block it allocated waits for it.
with sc.stream(side):
    t = torch.ones(n, device="superchip")
pt = ptr(t)
hold(0, side.stream_id, True)                # the side stream "still runs"
del t
assert pending() == 1, pending()
others = [torch.empty(n, device="superchip") for _ in range(4)]
assert all(ptr(o) != pt for o in others), "reused while its stream runs"
hold(0, side.stream_id, False)
del others
torch.empty(n, device="superchip")           # the next allocation retires it
assert pending() == 0, pending()

# The other way: the default stream's block is not handed to the side stream while it runs.
hold(0, 0, True)
b = torch.ones(n, device="superchip"); pb = ptr(b); del b
assert pending() == 1, pending()
with sc.stream(side):
    mine = [torch.empty(n, device="superchip") for _ in range(4)]
assert all(ptr(m) != pb for m in mine), "handed to another stream while its stream runs"
del mine

# Many blocks waiting on one busy stream, then all of them retired by one allocation.
waiting = [torch.empty(n, device="superchip") for _ in range(200)]
del waiting
assert pending() == 201, pending()
hold(0, 0, False)
torch.empty(n, device="superchip")
assert pending() == 0, pending()
assert superchip.memory_stats()["hbm.active_allocations"] == active, superchip.memory_stats()
print("OK")
"""
    r = run_python(code)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


@pytest.mark.skipif(superchip.executor() != "cuda", reason="a real side-stream kernel (torch.cuda._sleep)")
def test_a_freed_block_waits_for_the_gpu_stream_that_allocated_it():
    # The CUDA form of the test above: a block of superchip's own pool (a factory's), allocated
    # and used on a side stream that is still running, is not handed to the default stream.
    code = """
import torch, superchip
sc = torch.superchip
pending = superchip._C._pending_stream_frees
ptr = lambda t: t.untyped_storage().data_ptr()
n = 1 << 20
base = torch.empty(n, device="superchip")
side = sc.Stream()
with sc.stream(side):
    t = torch.empty(n, device="superchip")   # a factory: superchip's pool, not CUDA's
    torch.cuda._sleep(int(1e9))              # the side stream "still runs" (about half a second)
    t.fill_(1)
pt = ptr(t)
del t
assert pending() == 1, pending()
others = [torch.empty(n, device="superchip") for _ in range(4)]
assert all(ptr(o) != pt for o in others), "reused while its stream runs"
sc.synchronize()
torch.empty(n, device="superchip")
assert pending() == 0, pending()
print("OK")
"""
    r = run_python(code)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


@pytest.mark.skipif(superchip.executor() != "cpu",
                    reason="holds an emulated stream busy (_hold_emulated_stream)")
def test_blocks_waiting_for_a_stream_are_freed_before_out_of_memory():
    # A block freed while a stream still uses it waits for that stream (record_stream; under
    # the CUDA executor every freed host block, Note [Host blocks and GPU readers]). When both
    # tiers are full but for such blocks, the allocator waits for their streams and frees them
    # instead of failing (before: out of memory, both tiers named). The emulated wait returns at
    # once.
    code = """
import torch, superchip
side = torch.superchip.Stream()
n = 768 * 1024 // 4
t = torch.empty(n, device="superchip")
assert superchip.tier_of(t) == "hbm"
t.record_stream(side)
superchip._C._hold_emulated_stream(0, side.stream_id, True)
del t
assert superchip._C._pending_stream_frees() == 1
u = torch.empty(n, device="superchip")  # hbm holds the waiting block: host
assert superchip.tier_of(u) == "host", superchip.tier_of(u)
v = torch.empty(n, device="superchip")  # both tiers full but for the waiting block
assert superchip.tier_of(v) == "hbm" and superchip._C._pending_stream_frees() == 0
superchip._C._hold_emulated_stream(0, side.stream_id, False)
print("OK")
"""
    r = run_python(code, env={"SUPERCHIP_HBM_BYTES": "1M", "SUPERCHIP_HOST_BYTES": "1M"})
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


@pytest.mark.skipif(superchip.executor() != "cuda", reason="a real side-stream kernel (torch.cuda._sleep)")
def test_record_stream_defers_reuse_of_gpu_outputs():
    # An op output on the CUDA executor is CUDA's caching-allocator memory adopted by superchip;
    # record_stream must reach that allocator (before, it was dropped: the block could be handed
    # out again while a side stream still used it).
    sc = torch.superchip
    side = sc.Stream()
    n = 1 << 20
    t = torch.ones(n, device="superchip") * 2  # an executor output: adopted memory
    ptr = t.untyped_storage().data_ptr()
    with sc.stream(side):
        torch.cuda._sleep(int(1e9))  # the side stream "still runs" (about half a second)
    t.record_stream(side)
    del t
    others = [torch.ones(n, device="superchip") * 3 for _ in range(4)]
    assert all(o.untyped_storage().data_ptr() != ptr for o in others)
    sc.synchronize()


def test_sccl_rejects_foreign_tensor_error_text():
    # The creator's own error path: a group world of one, a meta tensor is neither cpu nor superchip.
    import datetime

    store = dist.HashStore()
    inner = dist.ProcessGroupGloo(store, 0, 1, datetime.timedelta(seconds=10))
    backend = superchip._C._create_sccl_backend(inner, 0, 1, 10.0)
    t = torch.ones(3, device="superchip")
    backend.allreduce([t]).wait()
    assert torch.equal(t.cpu(), torch.ones(3))
    # Either executor's text: the CUDA executor also serves cuda tensors.
    with pytest.raises(RuntimeError, match=r"got a tensor on meta; it serves superchip tensors .*Move it with"):
        backend.allreduce([torch.ones(3, device="meta")])

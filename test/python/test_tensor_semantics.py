"""Tensor semantics on superchip: views and storage sharing, in-place ops through views,
non-contiguous and zero-size tensors, scalars, printing, dtype promotion, copies in every
direction with dtype conversion, ``out=``/``resize_``/``set_``, storages, and the mixed-device
error."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F

import superchip  # noqa: F401

from helpers import DEVICE, assert_close_cpu, run_python

# ---- views and storage ----


def test_views_share_storage():
    base = torch.arange(12.0, device=DEVICE)
    views = [base.view(3, 4), base[2:], base.view(3, 4).t(), base.view(3, 4)[:, 1],
             base.reshape(2, 6), base.unsqueeze(0), base.as_strided((2, 2), (1, 3), 1)]
    for v in views:
        assert v.device == DEVICE
        assert v.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
        assert v._base is base or v._base is None or v._base._base is base
    assert base[2:].data_ptr() == base.data_ptr() + 2 * base.element_size()


def test_inplace_through_views():
    base = torch.zeros(4, 4, device=DEVICE)
    base[1].fill_(1.0)
    base[:, 2] += 2.0
    base.t()[3].mul_(0).add_(5.0)        # row 3 of the transpose is column 3
    base.view(16)[::5].sub_(7.0)         # the diagonal
    ref = torch.zeros(4, 4)
    ref[1].fill_(1.0)
    ref[:, 2] += 2.0
    ref.t()[3].mul_(0).add_(5.0)
    ref.view(16)[::5].sub_(7.0)
    torch.testing.assert_close(base.cpu(), ref, rtol=0, atol=0)


def test_view_version_counter_and_autograd_sees_inplace():
    a = torch.ones(3, device=DEVICE, requires_grad=True)
    b = a * 2
    v = b[1:]
    v.mul_(3)
    b.sum().backward()
    torch.testing.assert_close(a.grad.cpu(), torch.tensor([2.0, 6.0, 6.0]))


# ---- layouts ----


@pytest.mark.parametrize("make", [
    lambda t: t.t(),
    lambda t: t[::2, 1::3],
    lambda t: t[:, :1].expand(6, 5),
    lambda t: t.unsqueeze(0).expand(2, 6, 5).transpose(0, 2),
    lambda t: t.flip(0)[1:],
    lambda t: t.permute(1, 0)[1::2],
], ids=["transpose", "step_slice", "expand", "expand_transpose", "flip_slice", "permute_step"])
def test_non_contiguous_ops_match_cpu(make):
    cpu = torch.randn(6, 5)
    dev = cpu.to(DEVICE)
    x_cpu, x_dev = make(cpu), make(dev)
    assert x_dev.stride() == x_cpu.stride()
    assert x_dev.is_contiguous() == x_cpu.is_contiguous()
    assert_close_cpu(x_dev, x_cpu, rtol=0, atol=0)
    assert_close_cpu(x_dev.contiguous(), x_cpu.contiguous(), rtol=0, atol=0)
    assert_close_cpu(x_dev.exp() + 1, x_cpu.exp() + 1)
    assert_close_cpu(x_dev.sum(-1), x_cpu.sum(-1))
    assert_close_cpu(x_dev @ x_dev.transpose(-1, -2), x_cpu @ x_cpu.transpose(-1, -2))


def test_zero_size_tensors():
    z = torch.empty(0, 3, device=DEVICE)
    assert z.shape == (0, 3) and z.numel() == 0 and z.device == DEVICE
    assert (z + 1).shape == (0, 3)
    assert z.sum().item() == 0.0
    assert z.sum(0).shape == (3,)
    assert torch.cat([z, torch.ones(2, 3, device=DEVICE)]).shape == (2, 3)
    assert z.cpu().shape == (0, 3)
    assert torch.zeros(0, device=DEVICE).to(torch.float16).dtype == torch.float16
    assert (z @ torch.ones(3, 4, device=DEVICE)).shape == (0, 4)
    torch.testing.assert_close((torch.ones(2, 0, device=DEVICE) @ torch.ones(0, 2,
                               device=DEVICE)).cpu(), torch.zeros(2, 2))


def test_item_and_scalars():
    t = torch.tensor([1.5, -2.25], device=DEVICE)
    assert t[1].item() == -2.25
    assert torch.tensor(7, device=DEVICE).item() == 7
    assert torch.tensor(True, device=DEVICE).item() is True
    assert float(t.sum()) == -0.75
    assert int(torch.tensor(3, device=DEVICE)) == 3
    assert t.tolist() == [1.5, -2.25]
    assert bool((t > 0).any())


def test_repr_names_device():
    r = repr(torch.arange(3, device=DEVICE))
    assert "device='superchip:0'" in r
    assert "0, 1, 2" in r
    assert "device='superchip:0'" in repr(torch.empty(0, device=DEVICE))
    assert "bfloat16" in repr(torch.ones(2, dtype=torch.bfloat16, device=DEVICE))


# ---- dtype promotion ----


@pytest.mark.parametrize("fn", [
    lambda a, b, dev: a + b,
    lambda a, b, dev: a * 2.5,
    lambda a, b, dev: a / b,
    lambda a, b, dev: a + True,
    lambda a, b, dev: b & (a > 1),
    lambda a, b, dev: a + torch.tensor(1.5),       # a CPU 0-dim tensor acts as a scalar
    lambda a, b, dev: torch.where(b, a, 0.5),
    lambda a, b, dev: a.float() + torch.ones(3, dtype=torch.float64, device=dev),
    lambda a, b, dev: a.half() + a.bfloat16(),
    lambda a, b, dev: a.to(torch.int8) + a.to(torch.uint8),
    lambda a, b, dev: b + b,
], ids=["int+bool", "int*float_scalar", "int_div", "int+bool_scalar", "bool&bool",
        "int+cpu0dim", "where_scalar", "f32+f64", "f16+bf16", "i8+u8", "bool+bool"])
def test_dtype_promotion(fn):
    a_cpu = torch.tensor([1, 2, 3])
    b_cpu = torch.tensor([True, False, True])
    expected = fn(a_cpu, b_cpu, "cpu")
    actual = fn(a_cpu.to(DEVICE), b_cpu.to(DEVICE), DEVICE)
    assert actual.dtype == expected.dtype
    assert_close_cpu(actual, expected)


def test_int_float_tensor_promotion():
    a = torch.tensor([1, 2], device=DEVICE)
    b = torch.tensor([0.5, 0.25], device=DEVICE)
    assert (a + b).dtype == torch.float32
    assert (b.half() * 2).dtype == torch.float16
    torch.testing.assert_close((a + b).cpu(), torch.tensor([1.5, 2.25]))


# ---- copies ----

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32,
          torch.int64, torch.uint8, torch.bool]


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("dst_dtype", DTYPES)
def test_copy_cpu_to_superchip_with_cast(src_dtype, dst_dtype):
    cpu = (torch.randn(5, 7) * 4).to(src_dtype)
    moved = cpu.to(DEVICE, dst_dtype)
    assert moved.device == DEVICE and moved.dtype == dst_dtype
    torch.testing.assert_close(moved.cpu(), cpu.to(dst_dtype), rtol=0, atol=0)
    moved2 = cpu.to("superchip", dtype=dst_dtype, non_blocking=True)
    torch.superchip.synchronize()
    torch.testing.assert_close(moved2.cpu(), cpu.to(dst_dtype), rtol=0, atol=0)


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("dst_dtype", DTYPES)
def test_copy_superchip_to_cpu_and_superchip_with_cast(src_dtype, dst_dtype):
    cpu = (torch.randn(5, 7) * 4).to(src_dtype)
    dev = cpu.to(DEVICE)
    back = dev.to("cpu", dst_dtype)
    assert back.device.type == "cpu" and back.dtype == dst_dtype
    torch.testing.assert_close(back, cpu.to(dst_dtype), rtol=0, atol=0)
    same = dev.to(DEVICE, dst_dtype)
    assert same.device == DEVICE and same.dtype == dst_dtype
    torch.testing.assert_close(same.cpu(), cpu.to(dst_dtype), rtol=0, atol=0)
    if dst_dtype == src_dtype:
        assert same is dev  # no-op .to returns self
    else:
        assert same.untyped_storage().data_ptr() != dev.untyped_storage().data_ptr()


def test_copy_noncontiguous_in_every_direction():
    cpu = torch.randn(8, 6)
    dst = torch.zeros(6, 8, device=DEVICE)
    dst.copy_(cpu.t())                                   # cpu strided -> superchip
    torch.testing.assert_close(dst.cpu(), cpu.t().contiguous(), rtol=0, atol=0)
    dst2 = torch.zeros(4, 6, device=DEVICE, dtype=torch.float64)
    dst2.copy_(dst.t()[::2])                             # superchip strided -> superchip, cast
    torch.testing.assert_close(dst2.cpu(), cpu[::2].double(), rtol=0, atol=0)
    out = torch.zeros(6, 8, dtype=torch.bfloat16)
    out.t().copy_(dst.t())                               # superchip strided -> cpu strided, cast
    torch.testing.assert_close(out, cpu.t().bfloat16(), rtol=0, atol=0)
    dst3 = torch.zeros(3, device=DEVICE)
    dst3.copy_(torch.tensor(2.0))                        # broadcasting copy from a scalar
    torch.testing.assert_close(dst3.cpu(), torch.full((3,), 2.0))


def test_complex_conj_view_in_subprocess():
    # In a child process: a broken conjugate view can crash (SIGSEGV) the whole interpreter.
    res = run_python(
        "import torch, superchip\n"
        "c = torch.tensor([1+2j, 3-4j], dtype=torch.complex64)\n"
        "d = c.to('superchip')\n"
        "assert d.conj().is_conj()\n"
        "assert torch.equal(d.conj().cpu(), c.conj())\n"
        "assert torch.equal(d.conj().resolve_conj().cpu(), c.conj().resolve_conj())\n"
        "assert torch.equal((d.conj() * d).cpu(), c.conj() * c)\n"
        "print('OK')\n")
    assert res.returncode == 0 and "OK" in res.stdout, (res.returncode, res.stderr[-2000:])


def test_clone_and_detach():
    a = torch.randn(4, device=DEVICE)
    c = a.clone()
    assert c.data_ptr() != a.data_ptr()
    c.add_(1)
    torch.testing.assert_close(c.cpu(), a.cpu() + 1)
    d = a.detach()
    assert d.data_ptr() == a.data_ptr()


# ---- out=, resize_, set_, storages ----


def test_out_resizes_output():
    out = torch.empty(0, device=DEVICE)
    a = torch.randn(3, 4, device=DEVICE)
    b = torch.randn(4, 5, device=DEVICE)
    res = torch.mm(a, b, out=out)
    assert res is out and out.shape == (3, 5) and out.device == DEVICE
    torch.testing.assert_close(out.cpu(), a.cpu() @ b.cpu())
    out2 = torch.empty(0, device=DEVICE)
    torch.add(a, 1, out=out2)
    assert out2.shape == (3, 4)
    torch.testing.assert_close(out2.cpu(), a.cpu() + 1)
    vals, idx = torch.empty(0, device=DEVICE), torch.empty(0, dtype=torch.long, device=DEVICE)
    torch.max(a, 1, out=(vals, idx))
    torch.testing.assert_close(idx.cpu(), a.cpu().argmax(1))


def test_out_wrong_device_errors():
    a = torch.randn(3, device=DEVICE)
    with pytest.raises(RuntimeError):
        torch.add(a, a, out=torch.empty(3))


def test_resize_():
    t = torch.arange(4.0, device=DEVICE)
    t.resize_(2, 2)
    assert t.shape == (2, 2)
    torch.testing.assert_close(t.cpu(), torch.arange(4.0).view(2, 2))
    t.resize_(10, 10)
    assert t.shape == (10, 10) and t.untyped_storage().nbytes() >= 400
    torch.testing.assert_close(t.view(-1)[:4].cpu(), torch.arange(4.0))  # prefix kept
    t.resize_(0)
    assert t.numel() == 0


@pytest.fixture
def deterministic_algorithms():
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(was)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.complex64, torch.int64,
                                   torch.uint8, torch.bool])
def test_deterministic_mode_fills_new_memory_as_cpu(deterministic_algorithms, dtype):
    # Under torch.use_deterministic_algorithms(True), CPU and CUDA fill uninitialized memory
    # with NaN (the integer maximum, True): superchip's own empty, empty_strided and resize_
    # did not (upstream test_torch's test_deterministic_empty / _resize).
    def made(device):
        grown = torch.zeros(3, dtype=dtype, device=device)
        grown.resize_(7)
        return [torch.empty(5, dtype=dtype, device=device),
                torch.empty_like(torch.zeros(2, 3, dtype=dtype, device=device)),
                torch.empty_strided((2, 3), (1, 2), dtype=dtype, device=device),
                torch.zeros(1, dtype=dtype, device=device).new_empty(4),
                torch.empty_permuted((2, 3, 4), (2, 0, 1), dtype=dtype, device=device),
                grown]
    for got, want in zip(made(DEVICE), made("cpu")):
        assert got.device == DEVICE
        torch.testing.assert_close(got.cpu(), want, equal_nan=True, rtol=0, atol=0)
    assert torch.utils.deterministic.fill_uninitialized_memory
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        torch.empty(4, dtype=dtype, device=DEVICE)  # the switch is honoured: no fill, no error
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = True


def test_indexing_a_cpu_tensor_with_superchip_indices_raises():
    # CPU indices into a superchip tensor are accepted (as CUDA accepts them); superchip
    # indices into a CPU tensor are an error, as CUDA indices are (upstream test_torch's
    # test_advancedindex_mixed_devices_error). Before, the call was forwarded and returned a
    # superchip tensor.
    x = torch.arange(6.0).view(3, 2)
    idx = torch.tensor([0, 2], device=DEVICE)
    msg = r"indices should be either on cpu or on the same device as the indexed tensor \(cpu\)"
    with pytest.raises(RuntimeError, match=msg):
        x[idx]
    with pytest.raises(RuntimeError, match=msg):
        x[idx] = torch.zeros(2, 2)
    assert x.flatten().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    xs = x.to(DEVICE)
    assert xs[torch.tensor([0, 2])].device == DEVICE
    assert xs[torch.tensor([0, 2])].cpu().tolist() == [[0.0, 1.0], [4.0, 5.0]]
    with pytest.raises(RuntimeError, match="same device"):  # CPU values (not 0-dim): as CUDA
        xs[torch.tensor([1])] = torch.full((1, 2), 9.0)
    xs[torch.tensor([1])] = torch.tensor(9.0)  # a CPU 0-dim value, with CPU indices
    assert xs.cpu().tolist() == [[0.0, 1.0], [9.0, 9.0], [4.0, 5.0]]


def test_set_():
    a = torch.arange(6.0, device=DEVICE)
    b = torch.empty(0, device=DEVICE)
    b.set_(a.untyped_storage(), 2, (2, 2), (1, 2))
    assert b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    torch.testing.assert_close(b.cpu(), torch.tensor([[2.0, 4.0], [3.0, 5.0]]))
    b.fill_(-1)
    torch.testing.assert_close(a.cpu(), torch.tensor([0.0, 1.0, -1.0, -1.0, -1.0, -1.0]))
    c = torch.empty(0, device=DEVICE)
    c.set_(a)
    assert c.data_ptr() == a.data_ptr() and c.shape == a.shape
    d = torch.empty(3, device=DEVICE).set_()
    assert d.numel() == 0
    with pytest.raises(RuntimeError):
        torch.empty(0).set_(a.untyped_storage())   # superchip storage under a CPU tensor


@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")
def test_storage_ops():
    t = torch.arange(5, dtype=torch.float32, device=DEVICE)
    s = t.untyped_storage()
    assert s.device == DEVICE
    assert s.nbytes() == 20 and len(s) == 20
    cpu_s = s.cpu()
    assert cpu_s.device.type == "cpu"
    assert torch.frombuffer(bytearray(cpu_s.tolist()), dtype=torch.float32).tolist() == \
        [0.0, 1.0, 2.0, 3.0, 4.0]
    s2 = torch.UntypedStorage(8, device=DEVICE)
    assert s2.device == DEVICE and s2.nbytes() == 8
    s2.fill_(0)
    assert torch.empty(0, dtype=torch.int32, device=DEVICE).set_(s2).cpu().tolist() == [0, 0]
    back = cpu_s.superchip()
    assert back.device == DEVICE and back.nbytes() == 20
    typed = t.storage()
    assert typed.dtype == torch.float32 and typed.device == DEVICE and typed.size() == 5
    clone = s.clone()
    assert clone.data_ptr() != s.data_ptr()
    t.zero_()
    assert torch.empty(0, device=DEVICE).set_(clone).cpu().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    s.copy_(clone)
    assert t.cpu().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


# ---- devices ----


def test_mixed_device_error_names_both_devices():
    a = torch.ones(3, device=DEVICE)
    b = torch.ones(3)
    with pytest.raises(RuntimeError) as exc:
        a + b
    msg = str(exc.value)
    assert "Expected all tensors to be on the same device" in msg
    assert "superchip:0" in msg and "cpu" in msg
    assert "generator" not in msg  # named only where a generator was passed
    with pytest.raises(RuntimeError, match="use a generator of that device"):
        torch.normal(torch.ones(3, device=DEVICE), torch.ones(3), generator=torch.Generator())
    with pytest.raises(RuntimeError, match="superchip:0"):
        torch.mm(torch.ones(2, 2), torch.ones(2, 2, device=DEVICE))


@pytest.mark.parametrize("case", ["weight", "bias", "transposed", "conv1d", "backward"])
def test_a_convolution_weight_left_on_the_cpu_is_refused(case):
    # Convolution reaches superchip through ATen's overrideable hooks, not the forwarding
    # fallback: a module not moved to the device computed its forward on the CPU weight, and
    # backward failed on that weight's gradient ("expected device cpu but got superchip:0").
    torch.manual_seed(0)
    x = torch.randn(1, 2, 6, 6, device=DEVICE)
    w, b = torch.randn(3, 2, 3, 3), torch.randn(3)
    calls = {
        "weight": lambda: F.conv2d(x, w, b.to(DEVICE)),
        "bias": lambda: F.conv2d(x, w.to(DEVICE), b),
        "transposed": lambda: F.conv_transpose2d(x, torch.randn(2, 3, 3, 3)),
        "conv1d": lambda: F.conv1d(x[:, :, 0], torch.randn(3, 2, 3)),
        # backward's operands are checked too (a gradient from another device)
        "backward": lambda: torch.ops.aten.convolution_backward(
            torch.ones(1, 3, 4, 4), x, w.to(DEVICE), None, [1, 1], [0, 0], [1, 1], False,
            [0, 0], 1, [True, True, False]),
    }
    with pytest.raises(RuntimeError, match=r"same device.*superchip:0 and cpu.*convolution"):
        calls[case]()
    # Everything on the device still computes the CPU's bits.
    y = F.conv2d(x, w.to(DEVICE), b.to(DEVICE))
    assert torch.equal(y.cpu(), F.conv2d(x.cpu(), w, b))


def test_cpu_zero_dim_tensor_is_a_scalar():
    a = torch.tensor([1.0, 2.0], device=DEVICE)
    res = a * torch.tensor(3.0)
    assert res.device == DEVICE
    torch.testing.assert_close(res.cpu(), torch.tensor([3.0, 6.0]))
    res2 = torch.tensor(2.0) + a
    assert res2.device == DEVICE
    torch.testing.assert_close(res2.cpu(), torch.tensor([3.0, 4.0]))
    a.add_(torch.tensor(1.0))
    torch.testing.assert_close(a.cpu(), torch.tensor([2.0, 3.0]))


def test_cpu_scalar_tensor_is_not_accepted_as_an_output():
    x = torch.ones(3, device="superchip")
    out = torch.zeros(())
    with pytest.raises(RuntimeError, match="superchip:0 and cpu"):
        torch.add(x, 1, out=out)
    assert out.shape == () and float(out) == 0.0


def test_sending_a_superchip_tensor_to_another_process_says_what_to_do():
    # Note [Tensors sent to another process] (superchip/__init__.py): torch's reducer raised
    # "_share_fd_: only available on CPU" (found by review; from a Queue, the child hung).
    from multiprocessing.reduction import ForkingPickler

    t = torch.arange(4.0, device="superchip")
    for obj in (t, torch.nn.Parameter(t.clone()), t.untyped_storage()):
        with pytest.raises(RuntimeError, match=r"cannot be sent to another process.*\.cpu\(\).*'fork'"):
            ForkingPickler.dumps(obj)
    cpu = pickle.loads(ForkingPickler.dumps(torch.arange(4.0)))  # CPU tensors as before
    assert torch.equal(cpu, torch.arange(4.0))


def _put_a_superchip_tensor(queue):
    queue.put(torch.arange(4.0, device="superchip"))
    queue.put("next")  # what follows still arrives


def test_a_queue_receiver_gets_the_refusal_instead_of_waiting():
    # Note [Tensors sent to another process]: a multiprocessing.Queue pickles in its feeder
    # thread, which printed the refusal and dropped the tensor: get() waited for ever. The
    # refusal now travels in its place and get() raises it. Forked on the CPU executor (a
    # forked child cannot use CUDA); spawned on CUDA's.
    import multiprocessing
    import queue as queue_module
    context = multiprocessing.get_context("spawn" if superchip.executor() == "cuda" else "fork")
    q = context.Queue()
    child = context.Process(target=_put_a_superchip_tensor, args=(q,))
    child.start()
    try:
        with pytest.raises(RuntimeError, match=r"cannot be sent to another process.*\.cpu\(\).*received"):
            q.get(timeout=60)
        assert q.get(timeout=60) == "next"
    except queue_module.Empty:
        pytest.fail("the receiver waited for the superchip tensor until its timeout")
    finally:
        child.join(60)
    assert child.exitcode == 0


def test_share_memory_is_refused_rather_than_pretended():
    # Note [Tensors sent to another process]: torch makes share_memory_() a no-op for a
    # PrivateUse1 device and is_shared() said True, so a Hogwild script (share_memory(), then
    # forked trainers) trained a private copy per process without a word.
    import warnings
    model = torch.nn.Linear(4, 4).to("superchip")
    model.register_buffer("steps", torch.zeros((), device="superchip"))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert not model.weight.is_shared() and not model.weight.untyped_storage().is_shared()
    with pytest.raises(RuntimeError, match=r"Linear.share_memory\(\): superchip memory cannot be shared.*distributed"):
        model.share_memory()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    cpu_model = torch.nn.Linear(4, 4)
    assert cpu_model.share_memory() is cpu_model and cpu_model.weight.is_shared()  # CPU modules as before
    # A tensor's share_memory_() (datasets shares a counter it may never send) warns once.
    counter = torch.zeros((), device="superchip")
    superchip._warned_share_memory = False  # whatever ran before in this process
    with pytest.warns(RuntimeWarning, match="share_memory_\\(\\) does nothing for a superchip tensor"):
        assert counter.share_memory_() is counter
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        counter.untyped_storage().share_memory_()  # once per process
    assert not counter.is_shared()
    assert torch.ones(3).share_memory_().is_shared()  # CPU tensors as before


class _RowsOnTheDevice(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.full((1024,), float(i)).to("superchip") * 2  # built in the worker


def _collate_with_a_parameter(items):
    return {"x": torch.stack(items), "p": torch.nn.Parameter(torch.ones(3, device="superchip")),
            "leaf": torch.zeros(2, device="superchip", requires_grad=True)}


def test_a_dataloader_worker_hands_its_superchip_batches_over():
    # Note [Tensors sent to another process]: a worker's batch went through the reducer
    # that refuses superchip tensors, from the worker's feeder thread; the loop waited for
    # it for ever (here: until the DataLoader's timeout). Batches now travel as copies and
    # arrive on the superchip device, counted in hbm. A forked child cannot use CUDA, so the
    # CUDA executor's workers are spawned (a fresh interpreter: slower, the same reducer).
    context = "spawn" if superchip.executor() == "cuda" else "fork"
    loader = torch.utils.data.DataLoader(_RowsOnTheDevice(), batch_size=4, num_workers=1,
                                         multiprocessing_context=context, timeout=60,
                                         collate_fn=_collate_with_a_parameter)
    before = superchip.memory_stats()["hbm.allocated_bytes"]
    batches = list(loader)
    assert [b["x"].device for b in batches] == [DEVICE, DEVICE]
    for k, b in enumerate(batches):
        want = torch.arange(4.0 * k, 4.0 * k + 4).mul(2).unsqueeze(1).expand(4, 1024)
        assert torch.equal(b["x"].cpu(), want)
        assert type(b["p"]) is torch.nn.Parameter and b["p"].requires_grad and b["p"].device == DEVICE
        assert b["leaf"].is_leaf and b["leaf"].requires_grad and b["leaf"].device == DEVICE
    grown = superchip.memory_stats()["hbm.allocated_bytes"] - before
    assert grown >= 2 * 4 * 1024 * 4, grown  # both batches are superchip memory of this process
    # Outside a DataLoader worker, nothing changed: a copy where torch shares would be wrong.
    from multiprocessing.reduction import ForkingPickler
    with pytest.raises(RuntimeError, match="cannot be sent to another process"):
        ForkingPickler.dumps(batches[0]["x"])


def test_dlpack_gives_an_alias_as_for_cuda():
    # Note [DLPack] (superchip/__init__.py): torch.from_dlpack(t) raised "Unknown device type
    # superchip for Dlpack" (torch's __dlpack_device__ knows PrivateUse1 only by its default
    # name); a CUDA tensor gives an alias. It is a view of t's own storage, so a tier move
    # (which frees the old block) and a pending optimizer step apply to it; a raw capsule,
    # which kept reading the freed block after a move, is refused with what to do.
    import numpy as np
    from torch.utils.dlpack import DLDeviceType
    x = torch.arange(6.0).to("superchip").view(2, 3)
    assert x.__dlpack_device__() == (DLDeviceType.kDLExtDev, 0)
    y = torch.from_dlpack(x)
    assert y.device == x.device and y.data_ptr() == x.data_ptr() and y.shape == x.shape
    y.add_(1)
    assert torch.equal(x.cpu(), torch.arange(1.0, 7.0).view(2, 3))
    superchip.move_to_tier(x, "host")
    x.fill_(5.0)
    z = torch.full((2, 3), 7.0, device="superchip")  # may take x's old block
    assert torch.equal(y.cpu(), torch.full((2, 3), 5.0)) and superchip.tier_of(y) == "host"
    assert torch.equal(torch.from_dlpack(x, device="cpu"), torch.full((2, 3), 5.0))
    assert torch.equal(torch.from_numpy(np.from_dlpack(x, device="cpu")), torch.full((2, 3), 5.0))
    for capsule in (lambda: x.__dlpack__(), lambda: torch.utils.dlpack.to_dlpack(x)):
        with pytest.raises(BufferError, match="torch.from_dlpack"):
            capsule()
    with pytest.raises(TypeError, match="stream must be"):  # a bad argument first, as torch checks it
        x.__dlpack__(stream=object())
    del z
    lin = torch.nn.Linear(64, 64).to("superchip")
    opt = superchip.optim.SGD(lin.parameters(), lr=0.5)
    before = lin.weight.detach().cpu()
    lin(torch.ones(4, 64, device="superchip")).sum().backward()
    opt.step()
    seen = torch.from_dlpack(lin.weight.detach()).cpu()
    torch.superchip.synchronize()
    assert not torch.equal(seen, before) and torch.equal(seen, lin.weight.detach().cpu())

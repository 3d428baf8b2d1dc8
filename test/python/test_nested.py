"""Nested tensors on superchip (Note [Nested tensors], backend/native/Forward.cpp): torch.nested
tensors of the strided layout (NestedTensorImpl) keep their buffer in superchip memory and run
the executor's nested kernels; the inference fast paths of nn.TransformerEncoder and
nn.MultiheadAttention, which build them from a padding mask, give the CPU's bits. Before, a
nested result failed ("NestedTensorImpl doesn't support strides") and nested operands found no
kernel."""

from __future__ import annotations

import warnings

import pytest
import torch

import superchip

from helpers import DEVICE, assert_matches_cpu

pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")


def _parts():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, 8, generator=g) for n in (2, 5, 3)]


def _padding_mask():
    lengths = torch.tensor([5, 3, 1])
    return torch.arange(5)[None, :] >= lengths[:, None]  # True where padded


def test_transformer_encoder_fast_path_with_a_padding_mask(monkeypatch):
    # An eval-mode encoder given a padding mask converts its input to a nested tensor
    # (torch._nested_tensor_from_mask) and runs the fused encoder layers on it.
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
    enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    x, mask = torch.randn(3, 5, 32), _padding_mask()
    calls = []
    from_mask = torch._nested_tensor_from_mask

    def counting(*args, **kwargs):
        calls.append(args[0].device)
        return from_mask(*args, **kwargs)

    monkeypatch.setattr(torch, "_nested_tensor_from_mask", counting)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = enc(x, src_key_padding_mask=mask)
        enc.to(DEVICE)
        got = enc(x.to(DEVICE), src_key_padding_mask=mask.to(DEVICE))
    assert calls == [torch.device("cpu"), DEVICE]  # both took the nested fast path
    assert got.device == DEVICE and not got.is_nested
    assert_matches_cpu(got.cpu(), ref)


def test_multihead_attention_fast_path_with_a_padding_mask():
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(16, 2, batch_first=True).eval()
    x, mask = torch.randn(3, 5, 16), _padding_mask()
    with torch.no_grad():
        ref, _ = mha(x, x, x, key_padding_mask=mask, need_weights=False)
        mha.to(DEVICE)
        xs = x.to(DEVICE)
        got, _ = mha(xs, xs, xs, key_padding_mask=mask.to(DEVICE), need_weights=False)
    assert_matches_cpu(got.cpu(), ref)


def test_nested_ops_and_autograd_match_cpu():
    def run(device):
        a = torch.nested.nested_tensor([p.to(device) for p in _parts()], requires_grad=True)
        torch.manual_seed(1)
        lin = torch.nn.Linear(8, 4).to(device)  # nested_linear, a kernel of the nested key only
        y = torch.nn.functional.softmax(lin(a), -1)
        z = torch.matmul(y, y.transpose(-1, -2)) * 2 + 1
        out = z.to_padded_tensor(0.0)
        out.square().sum().backward()
        assert a.device.type == out.device.type == a.grad.device.type == device
        return out.cpu(), a.grad.to_padded_tensor(0.0).cpu(), lin.weight.grad.cpu(), lin.bias.grad.cpu()

    for want, got in zip(run("cpu"), run("superchip")):
        assert_matches_cpu(got, want)


def test_nested_copies_views_and_memory():
    parts = _parts()
    before = superchip.memory_stats()["hbm.allocated_bytes"]
    cpu = torch.nested.nested_tensor(parts)
    n = cpu.to(DEVICE)  # BackendSelect sends this to superchip's nested kernel with a CPU operand
    assert n.is_nested and n.device == DEVICE
    nbytes = sum(p.numel() for p in parts) * 4
    assert superchip.memory_stats()["hbm.allocated_bytes"] - before == nbytes
    views = n.unbind()  # dense views of the nested buffer
    assert all(v.device == DEVICE for v in views)
    n.mul_(3)  # the buffer is written in place: the views see it
    for v, p in zip(views, parts):
        assert torch.equal(v.cpu(), p * 3)
    back = n.cpu()
    assert back.is_nested and back.device.type == "cpu"
    assert all(torch.equal(b, p * 3) for b, p in zip(back.unbind(), parts))
    half = n.to(torch.float16)  # a superchip-to-superchip copy with a cast
    assert half.device == DEVICE and half.dtype == torch.float16
    assert torch.equal(half.to_padded_tensor(0.0).cpu(), cpu.mul(3).to(torch.float16).to_padded_tensor(0.0))
    del n, views, v, half
    assert superchip.memory_stats()["hbm.allocated_bytes"] == before


def test_jagged_nested_tensors():
    # layout=torch.jagged is a Python tensor subclass over a dense values tensor.
    parts = _parts()
    j = torch.nested.nested_tensor([p.to(DEVICE) for p in parts], layout=torch.jagged)
    want = torch.nested.nested_tensor(parts, layout=torch.jagged)
    assert j.device == DEVICE
    assert_matches_cpu((j.sin() * 2).values().cpu(), (want.sin() * 2).values())


def test_nested_tensors_save_and_load(tmp_path):
    parts = _parts()
    torch.save(torch.nested.nested_tensor(parts).to(DEVICE), tmp_path / "n.pt")
    back = torch.load(tmp_path / "n.pt")
    assert back.is_nested and back.device == DEVICE
    assert all(torch.equal(b.cpu(), p) for b, p in zip(back.unbind(), parts))
    assert torch.load(tmp_path / "n.pt", map_location="cpu").device.type == "cpu"


@pytest.mark.parametrize("op", ["transpose", "view", "unbind", "unsqueeze", "narrow"])
def test_views_of_a_normal_tensor_made_in_inference_mode(op):
    # Note [Views in inference mode] (native/Forward.cpp): a nested view op forwarded inside
    # torch.inference_mode() of a tensor made outside it raised "Cannot set version_counter
    # for inference tensor" (its result was made an inference tensor); CPU gives a normal view
    # sharing the base's version counter. Found by PyTorch's test_nestedtensor on superchip.
    fn = {"transpose": lambda t: t.transpose(-1, -2), "view": lambda t: t.view(2, -1, 3, 1),
          "unbind": lambda t: t.unbind()[1], "unsqueeze": lambda t: t.unsqueeze(-1),
          "narrow": lambda t: t.narrow(0, 0, 1)}[op]
    parts = [torch.randn(2, 3), torch.randn(4, 3)]
    out = {}
    for dev in ("cpu", DEVICE):
        nt = torch.nested.nested_tensor(parts, device=dev)
        with torch.inference_mode():
            v = fn(nt)
            keys = str(torch._C._dispatch_keys(v)).replace("PrivateUse1", "CPU")
        nt.add_(1)  # a write to the base: the view sees it and shares its version counter
        out[dev] = (v.is_inference(), v._version, keys, v.cpu() if not v.is_nested else [t.cpu() for t in v.unbind()])
    cpu, sc = out["cpu"], out[DEVICE]
    assert cpu[:3] == sc[:3], (cpu[:3], sc[:3])
    assert not sc[0] and sc[1] == 1
    if isinstance(cpu[3], list):
        assert all(torch.equal(a, b) for a, b in zip(cpu[3], sc[3]))
    else:
        assert torch.equal(cpu[3], sc[3])

"""Sparse tensors on superchip (Note [Sparse tensors], backend/native/Forward.cpp): COO tensors
(SparsePrivateUse1) and the compressed layouts (CSR, CSC, BSR: SparseCsrPrivateUse1) keep
their indices and values in superchip memory and run the executor's sparse kernels, with the
CPU's results. Before, every sparse call failed ("Could not run ... with arguments from the
'Sparsesuperchip' backend"), nn.Embedding(sparse=True) failed in backward, and a sparse result
(to_sparse) was refused."""

from __future__ import annotations

import pytest
import torch

import superchip

from helpers import DEVICE, assert_matches_cpu

pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state",
                                        "ignore:Sparse invariant checks are implicitly disabled")


def _coo(device="cpu"):
    i = torch.tensor([[0, 1, 1, 2, 0], [2, 0, 2, 1, 2]])  # (0, 2) twice: uncoalesced
    v = torch.tensor([3.0, 4.0, 5.0, 6.0, 7.0])
    return torch.sparse_coo_tensor(i, v, (3, 4)).to(device)


def _same(got, want):
    assert got.device == DEVICE and got.layout == want.layout
    got = got.cpu()
    assert got.layout == want.layout
    if want.layout == torch.sparse_coo:
        assert got.is_coalesced() == want.is_coalesced() and got._nnz() == want._nnz()
        assert torch.equal(got._indices(), want._indices())
        assert_matches_cpu(got._values(), want._values())
    assert_matches_cpu(got.to_dense(), want.to_dense())


def test_coo_copies_and_ops_match_cpu():
    c, s = _coo(), _coo(DEVICE)
    assert s.device == DEVICE and s.layout == torch.sparse_coo and s._indices().device == DEVICE
    _same(s, c)
    _same(s.coalesce(), c.coalesce())
    _same(s + s, c + c)
    _same(s * 2.5, c * 2.5)
    _same(s.t(), c.t())
    d = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    assert_matches_cpu(torch.sparse.mm(s, d.to(DEVICE)).cpu(), torch.sparse.mm(c, d))
    dense = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    assert torch.equal((dense.to(DEVICE) + s).cpu(), dense + c)  # a dense result
    _same(dense.to(DEVICE).to_sparse(), dense.to_sparse())  # a sparse result of a dense op
    assert_matches_cpu(torch.sparse.sum(s, dim=1).to_dense().cpu(), torch.sparse.sum(c, dim=1).to_dense())
    assert s.to(torch.float64).dtype == torch.float64
    assert "device='superchip:0'" in repr(s)


def test_coo_in_place_ops_update_the_superchip_tensor():
    # A kernel that replaces a sparse operand's indices or values, its sizes or its coalesced
    # flag: the superchip tensor takes them over.
    for op in (lambda t: t.add_(t), lambda t: t.mul_(3), lambda t: t.zero_(),
               lambda t: t.sparse_resize_((5, 6), 2, 0), lambda t: t.copy_(_coo(t.device).coalesce() * 2),
               lambda t: t.copy_(_coo().coalesce() * 2), lambda t: t.add_(t.coalesce()).mul_(2)):
        want, got = _coo(), _coo(DEVICE)
        assert op(got) is got
        op(want)
        _same(got, want)
    back = _coo()
    assert back.copy_(_coo(DEVICE) * 2) is back  # superchip to cpu
    assert back.device.type == "cpu" and torch.equal(back.to_dense(), _coo().to_dense() * 2)


def test_compressed_layouts_match_cpu():
    d = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    d[d.abs() < 0.7] = 0
    x = torch.randn(6, 3, generator=torch.Generator().manual_seed(1))
    for convert in (lambda t: t.to_sparse_csr(), lambda t: t.to_sparse_csc(),
                    lambda t: t.to_sparse_bsr((2, 2))):
        want = convert(d)
        for got in (convert(d.to(DEVICE)), want.to(DEVICE)):  # made on superchip; copied there
            assert got.device == DEVICE and got.layout == want.layout
            assert torch.equal(got.to_dense().cpu(), d) and torch.equal(got.cpu().to_dense(), d)
            assert_matches_cpu((got @ x.to(DEVICE)).cpu(), want @ x)
    csr = d.to_sparse_csr().to(DEVICE)
    csr.mul_(2)
    assert torch.equal(csr.to_dense().cpu(), d * 2)


@pytest.mark.parametrize("opt_name", ["SGD", "SparseAdam"])
def test_sparse_embedding_trains_as_on_cpu(opt_name):
    def run(device):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(20, 8, sparse=True).to(device)
        opt = getattr(torch.optim, opt_name)(emb.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            idx = torch.randint(0, 20, (6,), generator=g)
            emb(idx.to(device)).square().sum().backward()
            assert emb.weight.grad.layout == torch.sparse_coo and emb.weight.grad.device.type == device
            opt.step()
            opt.zero_grad()
        return emb.weight.detach().cpu()

    assert_matches_cpu(run("superchip"), run("cpu"))


def test_superchip_adamw_refuses_sparse_gradients_as_torch_does():
    emb = torch.nn.Embedding(10, 4, sparse=True).to(DEVICE)
    opt = superchip.optim.AdamW(emb.parameters(), lr=0.1)
    emb(torch.tensor([1, 2]).to(DEVICE)).sum().backward()
    before = emb.weight.detach().cpu()
    # It says what to do (found by review: it said only "does not support sparse gradients").
    with pytest.raises(RuntimeError, match=r"does not step sparse gradients.*sparse=False.*SparseAdam"):
        opt.step()
    assert torch.equal(emb.weight.detach().cpu(), before)
    # move_to_tier names the layout instead of torch's "Cannot access storage of SparseTensorImpl".
    with pytest.raises(ValueError, match="strided tensor's storage; this one is torch.sparse_coo"):
        superchip.move_to_tier(emb.weight.grad, "host")
    values = emb.weight.grad.coalesce()._values()
    assert superchip.tier_of(superchip.move_to_tier(values, "host")) == "host"
    nt = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged).to(DEVICE)
    with pytest.raises(ValueError, match=r"torch.jagged.*t.values\(\)"):
        superchip.move_to_tier(nt, "host")
    assert superchip.tier_of(superchip.move_to_tier(nt.values(), "host")) == "host"


def test_sparse_memory_is_accounted_and_given_back():
    key = "hbm.requested_bytes"
    before = superchip.memory_stats()[key]
    s = _coo(DEVICE)
    assert superchip.memory_stats()[key] - before == 5 * 2 * 8 + 5 * 4  # indices (int64), values
    c = s.coalesce()  # new indices and values, made by the executor and adopted
    assert superchip.memory_stats()[key] - before > 100
    del s, c
    assert superchip.memory_stats()[key] == before


def test_sparse_tensors_save_and_load(tmp_path):
    coo = _coo(DEVICE)
    csr = torch.randn(3, 4, generator=torch.Generator().manual_seed(0)).to(DEVICE).to_sparse_csr()
    torch.save({"coo": coo, "csr": csr}, tmp_path / "s.pt")
    back = torch.load(tmp_path / "s.pt")
    assert back["coo"].device == back["csr"].device == DEVICE and back["csr"].layout == torch.sparse_csr
    _same(back["coo"], _coo())
    assert torch.equal(back["csr"].to_dense().cpu(), csr.to_dense().cpu())
    on_cpu = torch.load(tmp_path / "s.pt", map_location="cpu")
    assert on_cpu["coo"].device.type == on_cpu["csr"].device.type == "cpu"
    torch.save(_coo(), tmp_path / "c.pt")
    _same(torch.load(tmp_path / "c.pt", map_location="superchip"), _coo())

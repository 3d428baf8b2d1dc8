"""The training loop of test_training_parity.py, free of superchip so that its plain-CUDA
reference can run in a child process that never imports it.

Note [CUDA reference in its own process]
With torch 2.11 (the H100 machine's; later versions not checked), once a PrivateUse1 device is
registered ``at::getAccelerator()`` names it rather than CUDA, and every backward over plain
CUDA tensors in that process then trips ``opt_ready_stream && opt_parent_stream`` in the
autograd engine (pytorch/pytorch#161129). The CUDA reference therefore trains in a child:

    python parity_train.py OPTIMIZER CONFIG_JSON OUT.pt     # torch.save of train()'s result
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
from data import CharTokenizer, TEXT, get_batch  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

STEPS = 20
BATCH, SEQ = 8, 32


def small_config(**overrides) -> GPTConfig:
    cfg = dict(vocab_size=CharTokenizer(TEXT).vocab_size, seq_len=SEQ, n_layer=2, n_head=2,
               d_model=64)
    cfg.update(overrides)
    return GPTConfig(**cfg)


def seeded_model(**cfg) -> GPT:
    torch.manual_seed(0)
    return GPT(small_config(**cfg))


def make_optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)


def train(model: GPT, device: str, optimizer: str, steps: int = STEPS):
    """Trains ``model`` in place on ``device``; returns the per-step losses (CPU floats, as
    tensors so they compare bit for bit) and the final parameters and optimizer state on CPU."""
    model = model.to(device)
    opt = make_optimizer(optimizer, model.parameters())
    data = CharTokenizer(TEXT).encode(TEXT)
    gen = torch.Generator().manual_seed(1234)
    losses = []
    for _ in range(steps):
        x, y = get_batch(data, BATCH, SEQ, gen)
        _, loss = model(x.to(device), y.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.detach().cpu())
    params = {n: p.detach().cpu() for n, p in model.named_parameters()}
    state = {n: {k: v.detach().cpu() for k, v in opt.state[p].items() if torch.is_tensor(v)}
             for n, p in model.named_parameters()}
    return torch.stack(losses), params, state


def cuda_reference(optimizer: str, cfg: dict, out: str):
    """The plain-CUDA run, with attention forced to the math route (deterministic; the test
    forces superchip's run to it too), saved to ``out``."""
    with sdpa_kernel([SDPBackend.MATH]):
        result = train(seeded_model(**cfg), "cuda", optimizer)
    torch.save(result, out)


if __name__ == "__main__":
    cuda_reference(sys.argv[1], json.loads(sys.argv[2]), sys.argv[3])

"""Parameter-efficient fine-tuning on superchip, as our users run it: LoRA adapters from
`peft` on a frozen bf16 Hugging Face Llama (activation checkpointing, adapter dropout), and a
QLoRA-style frozen base quantized to NF4 by torchao (a tensor subclass over plain uint8 and
bf16 tensors). Each is compared with the same run on the CPU: bit for bit on the CPU executor,
within the tolerance table on CUDA's (helpers.assert_matches_cpu); superchip.optim.AdamW
against torch.optim.AdamW within the fp32 tolerance.

Needs `peft` and `torchao` (scripts/setup.sh installs both).
"""

from __future__ import annotations

import copy
import json
import textwrap

import pytest
import torch

import superchip

from helpers import DEVICE, assert_matches_cpu, run_python

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


def _base_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)


def _lora_run(base, device, opt_cls, steps=3):
    torch.manual_seed(1)
    cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.1)
    model = peft.get_peft_model(copy.deepcopy(base), cfg).to(device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = opt_cls(trainable, lr=1e-3, weight_decay=0.01)
    torch.manual_seed(2)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 256, (2, 16)).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().cpu())
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return torch.stack(losses), state, model, opt


def test_lora_on_frozen_bf16_llama_like_cpu():
    base = _base_llama()
    want_losses, want_state, _, _ = _lora_run(base, "cpu", torch.optim.AdamW)
    got_losses, got_state, model, _ = _lora_run(base, DEVICE, torch.optim.AdamW)
    assert_matches_cpu(got_losses, want_losses)
    assert want_state.keys() == got_state.keys()
    assert any("lora_A" in k for k in got_state)
    for k in want_state:
        assert_matches_cpu(got_state[k], want_state[k])
    # The frozen base did not move, and stayed bf16 on superchip.
    w = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    assert w.device.type == "superchip" and w.dtype == torch.bfloat16 and not w.requires_grad
    assert torch.equal(w.cpu(), base.model.layers[0].self_attn.q_proj.weight)


def test_lora_with_superchip_adamw_like_torch_adamw():
    base = _base_llama()
    want_losses, want_state, _, _ = _lora_run(base, "cpu", torch.optim.AdamW)
    got_losses, got_state, _, opt = _lora_run(base, DEVICE, superchip.optim.AdamW)
    torch.testing.assert_close(got_losses, want_losses, rtol=1e-5, atol=1e-6)
    for k in want_state:
        if "lora_" in k:
            torch.testing.assert_close(got_state[k].float(), want_state[k].float(), rtol=1e-5, atol=1e-6)
        else:  # frozen: untouched
            assert torch.equal(got_state[k], want_state[k]), k
    # State only for the adapters (bf16 adapters: fp32 moments and master weights in host).
    stats = opt.offload_stats()
    assert stats["steps"] == 3 and stats["skipped_steps"] == 0


def test_nf4_base_with_lora_adapter_like_cpu():
    nf4 = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    torch.manual_seed(0)
    w = torch.randn(256, 128, dtype=torch.bfloat16)
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    b0 = torch.randn(256, 8, dtype=torch.bfloat16) * 0.01

    def run(device):
        wq = nf4.to_nf4(w.to(device))
        a = torch.full((8, 128), 0.01, dtype=torch.bfloat16, device=device, requires_grad=True)
        b = b0.clone().to(device).requires_grad_()
        xx = x.clone().to(device).requires_grad_()
        y = nf4.linear_nf4(xx, wq) + (xx @ a.t()) @ b.t()
        y.float().pow(2).sum().backward()
        return [t.detach().cpu() for t in (y, a.grad, b.grad, xx.grad, wq.get_original_weight())]

    want, got = run("cpu"), run(DEVICE)
    for g, e in zip(got, want):
        assert_matches_cpu(g, e)


@pytest.mark.parametrize("how", ["device_map", "then_to"])
def test_from_pretrained_onto_superchip_like_cpu(tmp_path, how):
    # Note [Hub kernels] (superchip/__init__.py): transformers kernelizes what from_pretrained
    # loads for the model's device, and the `kernels` package it requires raised "Unsupported
    # device type 'superchip'" (found by review): the README's device_map="superchip" failed.
    _base_llama().save_pretrained(tmp_path)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(2))
    ref = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    if how == "device_map":
        model = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, device_map=DEVICE)
    else:
        model = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).to(DEVICE)
    assert all(p.device.type == "superchip" for p in model.parameters())
    want = ref(input_ids=ids, labels=ids)
    got = model(input_ids=ids.to(DEVICE), labels=ids.to(DEVICE))
    assert_matches_cpu(got.logits.detach().cpu(), want.logits.detach())
    assert_matches_cpu(got.loss.detach().cpu(), want.loss.detach())


def test_trainer_device_follows_accelerate_torch_device_and_refuses_torchrun():
    # Note [Trainer's device with the CUDA executor] (superchip/_huggingface.py): transformers
    # picks a single process's device as "cuda:0" whenever torch.cuda is available, before it
    # reads ACCELERATE_TORCH_DEVICE, so with the CUDA executor Trainer moved the model to plain
    # CUDA and counted every GPU in n_gpu (nn.DataParallel). Checked here with torch.cuda saying
    # two GPUs are available; transformers is imported before superchip, as a script may.
    r = run_python(textwrap.dedent("""
        import json, os, torch
        torch.cuda.is_available = lambda: True
        torch.cuda.device_count = lambda: 2
        torch.cuda.set_device = lambda device: None
        from transformers import TrainingArguments
        import superchip
        def device(**kw):
            a = TrainingArguments(output_dir="out", report_to=[], **kw)
            return [str(a.device), a.n_gpu]
        out = dict(plain=device())
        os.environ["ACCELERATE_TORCH_DEVICE"] = "superchip"
        out.update(superchip=device(), use_cpu=device(use_cpu=True))
        # One of two processes torchrun started (Note [Trainer under torchrun]): Trainer's and a
        # bare Accelerator's state are refused before accelerate makes a process group (which
        # would wait for the other rank), and nothing of them is left.
        os.environ.update(WORLD_SIZE="2", LOCAL_RANK="0", RANK="0")
        from accelerate import Accelerator
        from accelerate.state import PartialState
        for name, make in (("torchrun", device), ("accelerator", Accelerator)):
            try:
                make()
                out[name] = "ran"
            except RuntimeError as e:
                out[name] = str(e)
        left = PartialState._shared_state != {}
        # A script that made its own process group distributes the work itself: left alone.
        import torch.distributed as dist
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
        out["own_group"] = str(Accelerator().device)
        print(json.dumps(dict(out, left=left)))
    """), env={"SUPERCHIP_EXECUTOR": "cpu"})
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    refused = [out.pop("torchrun"), out.pop("accelerator")]
    for msg in refused:
        assert "accelerate cannot train on superchip in 2 processes" in msg and "fully_shard" in msg, msg
    assert out == {"plain": ["cuda:0", 2], "superchip": ["superchip:0", 1], "use_cpu": ["cpu", 0],
                   "own_group": "superchip", "left": False}, out

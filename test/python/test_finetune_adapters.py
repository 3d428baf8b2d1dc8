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


@pytest.mark.parametrize("cuda", [False, True], ids=["as-is", "cuda-available"])
def test_trainer_trains_on_superchip_as_accelerate_does(cuda):
    # Note [Trainer's device] (superchip/_huggingface.py): transformers picks a single process's
    # device itself, "cuda:0" whenever torch.cuda is available, else ACCELERATE_TORCH_DEVICE or
    # the CPU, and Trainer moved a superchip model there: to the CPU unless that variable was set,
    # and with the CUDA executor to plain CUDA even with it, counting every GPU in n_gpu
    # (nn.DataParallel). Checked as is and with torch.cuda saying two GPUs are available;
    # transformers is imported before superchip, as a script may.
    r = run_python(textwrap.dedent(f"""
        import json, os, torch
        if {cuda}:
            torch.cuda.is_available = lambda: True
            torch.cuda.device_count = lambda: 2
            torch.cuda.set_device = lambda device: None
            # bitsandbytes (which peft imports) believes it and loads its CUDA kernels, which a
            # CPU torch lacks (AttributeError): hidden, as where it is not installed.
            import sys
            sys.modules["bitsandbytes"] = None
        from transformers import TrainingArguments
        import superchip
        def device(variable=None, **kw):
            os.environ.pop("ACCELERATE_TORCH_DEVICE", None)
            if variable:
                os.environ["ACCELERATE_TORCH_DEVICE"] = variable
            a = TrainingArguments(output_dir="out", report_to=[], **kw)
            return [str(a.device), a.n_gpu]
        out = dict(plain=device(), variable=device("superchip"), use_cpu=device(use_cpu=True), other=device("cpu"))
        os.environ["ACCELERATE_USE_CPU"] = "1"
        print(json.dumps(dict(out, use_cpu_variable=device())))
    """), env={"SUPERCHIP_EXECUTOR": "cpu"})
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    # The variable naming another device, and ACCELERATE_USE_CPU: transformers' choice (which
    # reads the latter for accelerate's state only, so it says cuda:0 where CUDA is available).
    other = ["cuda:0", 2] if cuda else ["cpu", 0]
    assert out == {"plain": ["superchip:0", 1], "variable": ["superchip:0", 1], "use_cpu": ["cpu", 0],
                   "other": other, "use_cpu_variable": other}, out


# The token dataset of the Trainer runs in subprocesses: 16 rows of 16 seeded tokens.
_TOKEN_DATA = """
class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 16
    def __getitem__(self, i):
        ids = torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}
"""


def test_trainer_bf16_trains_on_superchip_with_the_cpus_bits():
    # TrainingArguments(bf16=True) asks transformers whether "the GPU" takes bf16, from a list of
    # device types without superchip, and raised "Your setup doesn't support bf16/gpu" (CPU
    # executor; the CUDA executor passed only because torch.cuda answered). Trained with
    # accelerate's bf16 autocast, on superchip as on the CPU (transformers imported first).
    r = run_python(textwrap.dedent("""
        import json, os, sys, tempfile, torch, transformers
        import superchip
    """) + _TOKEN_DATA + textwrap.dedent("""
        def run(use_cpu):
            torch.manual_seed(0)
            cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, num_key_value_heads=1)
            args = transformers.TrainingArguments(output_dir=tempfile.mkdtemp(), bf16=True, use_cpu=use_cpu, max_steps=3,
                                                  per_device_train_batch_size=2, logging_steps=1, report_to=[],
                                                  save_strategy="no", disable_tqdm=True, optim="adamw_torch")
            t = transformers.Trainer(model=transformers.LlamaForCausalLM(cfg), args=args, train_dataset=Data())
            t.train()
            return dict(device=str(args.device), precision=t.accelerator.mixed_precision,
                        losses=[h["loss"] for h in t.state.log_history if "loss" in h],
                        params=[p.detach().cpu() for p in t.model.parameters()])
        s, c = run(False), run(True)
        print(json.dumps(dict(device=s["device"], precision=s["precision"], losses=s["losses"], cpu=c["losses"],
                              diff=max((a - b).abs().max().item() for a, b in zip(s["params"], c["params"])))))
    """), timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["device"] == "superchip:0" and out["precision"] == "bf16" and len(out["losses"]) == 3, out
    if superchip.executor() == "cpu":
        assert out["losses"] == out["cpu"] and out["diff"] == 0, out
    else:  # CUDA's bf16 kernels round differently from the CPU's
        assert all(abs(a - b) <= 2e-2 * abs(b) for a, b in zip(out["losses"], out["cpu"])), out


def _word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(125)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                                unk_token="<unk>")


def test_pipelines_run_on_superchip_as_torch_reads_a_device_index():
    # Note [Pipelines' device] (superchip/_huggingface.py): a pipeline maps a device index (and
    # no device, as index 0) to cuda:N or else the CPU and moves the model there, so a model on
    # superchip handed to pipeline() was moved to the CPU (CPU executor) or to plain cuda:0.
    tokenizer = _word_tokenizer()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, eos_token_id=1)
    model = transformers.LlamaForCausalLM(cfg)
    generate = lambda p: p("w1 w2 w3", max_new_tokens=5, do_sample=False)[0]["generated_text"]
    want = generate(transformers.pipeline("text-generation", model=copy.deepcopy(model), tokenizer=tokenizer,
                                          device="cpu"))
    placed = copy.deepcopy(model).to(DEVICE)
    cases = dict(model_on_superchip=dict(model=placed), index=dict(model=copy.deepcopy(model), device=0),
                 cpu_index=dict(model=copy.deepcopy(model), device=-1), cpu=dict(model=copy.deepcopy(model), device="cpu"))
    got = {}
    for name, kw in cases.items():
        p = transformers.pipeline("text-generation", tokenizer=tokenizer, **kw)
        got[name] = (str(p.device), next(p.model.parameters()).device.type, generate(p))
    assert got["model_on_superchip"][:2] == ("superchip:0", "superchip"), got
    assert next(placed.parameters()).device.type == "superchip", got  # not moved away
    assert got["index"][:2] == ("superchip:0", "superchip"), got
    assert got["cpu_index"][:2] == ("cpu", "cpu") and got["cpu"][:2] == ("cpu", "cpu"), got
    if superchip.executor() == "cpu":
        assert all(text == want for _, _, text in got.values()), (got, want)


@pytest.mark.parametrize("cache", ["offloaded", "offloaded_static"])
def test_offloaded_kv_caches_generate_on_superchip(cache):
    # Note [Offloaded caches] (superchip/_huggingface.py): transformers orders the offloaded
    # cache's copies with torch.cuda.default_stream(device) for any device, and generation on
    # superchip raised "Torch not compiled with CUDA enabled".
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    want = model.generate(ids, attention_mask=mask, max_new_tokens=9, do_sample=False, pad_token_id=0)
    model = model.to(DEVICE)
    kept = model.generate(ids.to(DEVICE), attention_mask=mask.to(DEVICE), max_new_tokens=9, do_sample=False,
                          pad_token_id=0)
    out = model.generate(ids.to(DEVICE), attention_mask=mask.to(DEVICE), max_new_tokens=9, do_sample=False,
                         pad_token_id=0, cache_implementation=cache, return_dict_in_generate=True)
    assert torch.equal(out.sequences.cpu(), kept.cpu())
    if superchip.executor() == "cpu":
        assert torch.equal(out.sequences.cpu(), want)
    # The last update was layer 2's: layers 1 and 2 are offloaded, layer 0 prefetched back.
    assert [layer.keys.device.type for layer in out.cache.layers] == ["superchip", "cpu", "cpu"]


_TRAINER_RANK = """
import json, os, sys
os.environ["ACCELERATE_TORCH_DEVICE"] = "superchip"
import torch, superchip, transformers
""" + _TOKEN_DATA + """
def run(device, opt, trainer_kw=None, **kw):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg).to(device)
    args = transformers.TrainingArguments(
        output_dir=os.path.join(sys.argv[1], "out"), max_steps=4, per_device_train_batch_size=2,
        max_grad_norm=1.0, logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True, seed=0,
        use_cpu=device == "cpu", **kw)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Data(),
                                   optimizers=(opt(model) if opt else None, None), **(trainer_kw or {}))
    trainer.train()
    torch.superchip.synchronize()
    params = list(trainer.model.parameters())
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in params)
    return dict(device=str(args.device), wrapped=type(trainer.model_wrapped).__name__, world=args.world_size,
                losses=[h["loss"] for h in trainer.state.log_history if "loss" in h],
                local=local / sum(p.numel() for p in params), optimizer=type(inner).__module__,
                params=[(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu() for p in params])

adamw = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False)
engine = lambda overlap: lambda m: superchip.optim.AdamW(m.parameters(), lr=1e-2, overlap=overlap, bucket_bytes=16 << 10)
runs = dict(superchip=run("superchip", adamw), engine=run("superchip", engine(True)), plain=run("superchip", engine(False)))
# Trainer's own optimizer (it takes no optimizer with FSDP): DDP, then FSDP2.
runs["ddp"] = run("superchip", None)
runs["fsdp2"] = run("superchip", None, fsdp="full_shard",  # transformers 5's default version: 2
                    fsdp_config={"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
# superchip.optim with Trainer's parameter groups: optimizer_cls_and_kwargs (transformers refuses
# optimizers= with FSDP).
runs["fsdp2_superchip_optim"] = run("superchip", None, trainer_kw=dict(
    optimizer_cls_and_kwargs=(superchip.optim.AdamW, dict(lr=1e-2))), fsdp="full_shard",
    fsdp_config={"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
runs["fsdp1"] = run("superchip", None, fsdp="full_shard",
                    fsdp_config={"version": 1, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
os.environ.pop("ACCELERATE_USE_FSDP")  # accelerate's Accelerator sets it for the process
os.environ.pop("ACCELERATE_TORCH_DEVICE")  # accelerate's variable wins over use_cpu
runs["cpu"] = run("cpu", adamw)
same = lambda a, b: a["losses"] == b["losses"] and all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
sums = [p.double().sum().item() for name in ("superchip", "fsdp2_superchip_optim") for p in runs[name]["params"]]
out = {k: {f: v for f, v in r.items() if f != "params"} for k, r in runs.items()}
out.update(cpu_bits=same(runs["superchip"], runs["cpu"]), engine_bits=same(runs["engine"], runs["plain"]), sums=sums,
           fsdp2_diff=max((a - b).abs().max().item() for a, b in zip(runs["fsdp2"]["params"], runs["ddp"]["params"])))
with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(out, f)
"""


@pytest.mark.skipif(superchip.executor() == "cuda" and torch.superchip.device_count() < 2,
                    reason="two ranks need two GPUs with the CUDA executor")
def test_trainer_under_torchrun_is_data_parallel_with_the_cpus_bits_and_runs_fsdp2(tmp_path):
    # Note [accelerate's processes on superchip] (superchip/_huggingface.py): accelerate has no
    # distributed mode for a device outside its fixed list, so under torchrun each Trainer
    # process trained alone on all of the data (both ranks ended with the same weights as one
    # process would). Now two ranks run DDP over sccl: each takes half of every batch, and the
    # run gives the bits of the same Trainer run on CPU tensors under torchrun (DDP over Gloo),
    # with the engine giving the plain step's bits; Trainer's FSDP2 shards the model.
    script = tmp_path / "rank.py"
    script.write_text(_TRAINER_RANK)
    r = run_python(f"import runpy, sys; sys.argv = {['torchrun', '--standalone', '--nproc-per-node', '2', str(script), str(tmp_path)]!r}; "
                   "from torch.distributed.run import main; main()",
                   env={"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    for out in ranks:
        for name in ("superchip", "engine", "plain"):
            assert out[name]["device"].startswith("superchip:"), out
            assert out[name]["wrapped"] == "DistributedDataParallel" and out[name]["world"] == 2, out
        assert out["cpu"]["device"] == "cpu:0" and out["cpu"]["wrapped"] == "DistributedDataParallel", out
        assert out["cpu_bits"] and out["engine_bits"], out
        assert len(out["superchip"]["losses"]) == 4, out
    assert ranks[0]["sums"] == ranks[1]["sums"], ranks  # gradients averaged: one model on both ranks
    # FSDP2 through Trainer (fsdp="full_shard"): parameters sharded in half over the ranks,
    # the DDP run's losses and, to fp32 rounding (its reduce-scatter divides before it sums),
    # its weights.
    for out in ranks:
        fsdp2, ddp = out["fsdp2"], out["ddp"]
        assert fsdp2["wrapped"].startswith("FSDP") and fsdp2["device"].startswith("superchip:"), out
        assert fsdp2["local"] <= 0.55 and ddp["local"] == 1.0, out
        for a, b in zip(fsdp2["losses"], ddp["losses"]):
            assert abs(a - b) <= 1e-6 * abs(b), out
        assert out["fsdp2_diff"] <= 1e-6, out
        ours = out["fsdp2_superchip_optim"]
        assert ours["wrapped"].startswith("FSDP") and ours["optimizer"] == "superchip.optim", out
        assert ours["local"] <= 0.55 and len(ours["losses"]) == 4, out
        # FSDP1 (fsdp_config version 1) wraps and trains as well.
        assert out["fsdp1"]["wrapped"] == "FullyShardedDataParallel", out
        for a, b in zip(out["fsdp1"]["losses"], ddp["losses"]):
            assert abs(a - b) <= 1e-6 * abs(b), out


def test_accelerate_modes_superchip_processes_cannot_run_are_refused_leaving_no_state():
    # Note [accelerate's processes on superchip]: Megatron-LM mode over superchip processes would
    # silently have run DDP; it is refused, and accelerate's state is left empty. One process of
    # torchrun --nproc-per-node 1 (a real one-rank process group).
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = run_python(textwrap.dedent("""
        import json, os, superchip, accelerate
        from accelerate.state import AcceleratorState, PartialState
        out = dict(mode=str(PartialState().distributed_type), device=str(PartialState().device))
        os.environ["ACCELERATE_USE_MEGATRON_LM"] = "true"
        import accelerate.accelerator
        accelerate.accelerator.is_megatron_lm_available = lambda: True  # as where it is installed
        try:
            accelerate.Accelerator()
            out["megatron"] = "ran"
        except ValueError as e:
            out["megatron"] = str(e)
        out["left"] = PartialState._shared_state != {} or AcceleratorState._shared_state != {}
        print(json.dumps(out))
    """), env={"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "SUPERCHIP_EXECUTOR": "cpu"})
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["mode"] == "DistributedType.MULTI_CPU" and out["device"] == "superchip:0", out
    assert "Megatron-LM mode does not run on the superchip device" in out["megatron"], out
    assert not out["left"], out


def test_a_find_spec_query_before_the_import_keeps_the_patches_pending():
    # superchip/_after_import.py: importlib.util.find_spec (libraries' "is X available" checks)
    # asks the finders for a module without executing it; superchip's finder had taken the
    # module's patches off its list there, so the real import later went unpatched.
    r = run_python(textwrap.dedent("""
        import importlib.util, json, sys
        import superchip
        query = importlib.util.find_spec("transformers.training_args") is not None
        loaded = "transformers.training_args" in sys.modules
        from transformers import TrainingArguments
        patched = getattr(TrainingArguments.__dict__["_setup_devices"].func, "_superchip", False)
        print(json.dumps(dict(query=query, loaded=loaded, patched=patched)))
    """))
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"query": True, "loaded": False, "patched": True}


_SAFETENSORS_LIBRARIES = """
from safetensors import safe_open
import safetensors.torch, peft, accelerate.utils.modeling, huggingface_hub, transformers.modeling_utils
"""


@pytest.mark.parametrize("first", ["superchip", "libraries"], ids=["superchip-first", "libraries-first"])
def test_safetensors_and_what_calls_it_load_onto_superchip(tmp_path, first):
    # Note [safetensors' device names] (superchip/_huggingface.py): safetensors refused the name
    # ("device superchip is invalid"), and with it peft's adapter loading given superchip,
    # accelerate's checkpoint loading with a superchip device map and huggingface_hub's
    # load_torch_model. A file 4x hbm's budget is placed as .to("superchip") places it.
    # `safe_open` bound before and after superchip is imported.
    libraries = textwrap.dedent(_SAFETENSORS_LIBRARIES)
    r = run_python((libraries if first == "libraries" else "") + "import superchip\n"
                   + (libraries if first == "superchip" else "") + textwrap.dedent(f"""
        import json, sys, torch, peft, safetensors
        from accelerate import init_empty_weights, load_checkpoint_and_dispatch
        from accelerate.utils import load_checkpoint_in_model
        from safetensors.torch import save_file, load_file
        d = {str(tmp_path)!r}
        torch.manual_seed(0)
        big = {{f"w{{i}}": torch.randn(256, 256) for i in range(16)}}  # 4 MiB
        save_file(big, d + "/big.safetensors")
        def same(got, want):
            return sorted(got) == sorted(want) and all(
                v.device == torch.device("superchip", 0) and torch.equal(v.cpu(), want[k]) for k, v in got.items())
        out = dict(names=[str(n) for n in ("superchip", "superchip:0", torch.device("superchip"), torch.device("superchip", 0))])
        out["load_file"] = [same(load_file(d + "/big.safetensors", device=n), big)
                            for n in ("superchip", "superchip:0", torch.device("superchip"), torch.device("superchip", 0))]
        loaded = load_file(d + "/big.safetensors", device="superchip")
        out["tiers"] = sorted({{superchip.tier_of(v) for v in loaded.values()}})
        s = superchip.memory_stats()
        out["peak"], out["budget"] = s["hbm.peak_allocated_bytes"], s["hbm.capacity_bytes"]
        del loaded
        with safe_open(d + "/big.safetensors", framework="pt", device="superchip") as f:
            part = f.get_slice("w2")[1:3]
            out["safe_open"] = [same({{"w1": f.get_tensor("w1")}}, {{"w1": big["w1"]}}), part.device.type, torch.equal(part.cpu(), big["w2"][1:3])]
        try:
            load_file(d + "/big.safetensors", device="bogus")
        except Exception as e:
            out["other"] = f"{{type(e).__name__}}: {{e}}"
        out["bound"] = sorted(m for m in ("__main__", "safetensors.torch", "transformers.modeling_utils",
                                          "accelerate.utils.modeling", "accelerate.utils.offload")
                              if getattr(sys.modules.get(m), "safe_open", None) is not safetensors.safe_open)

        # peft: an adapter saved from the CPU, loaded onto superchip.
        import transformers
        cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2)
        base = transformers.LlamaForCausalLM(cfg)
        base.save_pretrained(d + "/base")
        lora = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
        lora.save_pretrained(d + "/adapter")
        want = {{k: v.clone() for k, v in peft.get_peft_model_state_dict(lora).items()}}
        out["peft_weights"] = same(peft.utils.load_peft_weights(d + "/adapter", device="superchip"),
                                   peft.utils.load_peft_weights(d + "/adapter", device="cpu"))
        onto = transformers.LlamaForCausalLM.from_pretrained(d + "/base", device_map="superchip")
        model = peft.PeftModel.from_pretrained(onto, d + "/adapter", torch_device="superchip")
        out["peft_model"] = same(peft.get_peft_model_state_dict(model), want)

        # accelerate: a checkpoint into a model on meta, mapped to superchip by hand and by "auto".
        net = lambda: torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
        ref = net()
        save_file(ref.state_dict(), d + "/net.safetensors")
        with init_empty_weights():
            m1 = net()
        load_checkpoint_in_model(m1, d + "/net.safetensors", device_map={{"": "superchip"}})
        with init_empty_weights():
            m2 = net()
        m2 = load_checkpoint_and_dispatch(m2, d + "/net.safetensors", device_map="auto")
        out["accelerate"] = [same(m1.state_dict(), ref.state_dict()), same(m2.state_dict(), ref.state_dict())]

        # huggingface_hub
        import huggingface_hub
        m3 = net().to("superchip")
        huggingface_hub.load_torch_model(m3, d + "/net.safetensors", map_location="superchip")
        out["hub"] = same(m3.state_dict(), ref.state_dict())
        print(json.dumps(out))
    """), env={"SUPERCHIP_HBM_BYTES": "1M"}, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["load_file"] == [True] * 4, out
    assert out["tiers"] == ["hbm", "host"] and out["peak"] <= out["budget"], out
    assert out["safe_open"] == [True, "superchip", True], out
    assert out["other"] == "SafetensorError: device bogus is invalid", out
    assert out["bound"] == [], out
    assert out["peft_weights"] and out["peft_model"], out
    assert out["accelerate"] == [True, True] and out["hub"], out


def test_trl_trainers_train_on_superchip_with_the_cpus_bits():
    # trl (the SFT, DPO and GRPO trainers most fine-tunes go through) on top of the Trainer
    # path above, as a user runs it: SFT of LoRA adapters in bf16 with packed rows (trl's
    # padding-free batches: position ids instead of padding), and DPO of a full model against
    # its frozen reference. Each trains on superchip and with use_cpu=True in one process;
    # the CPU executor gives the CPU's bits, losses and every parameter.
    pytest.importorskip("trl")
    r = run_python(textwrap.dedent("""
        import copy, json, tempfile, torch, transformers
        import superchip
        from datasets import Dataset
        from peft import LoraConfig
        from tokenizers import Tokenizer, models, pre_tokenizers
        from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

        words = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(125)]
        tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                                         eos_token="<eos>", unk_token="<unk>")
        g = torch.Generator().manual_seed(1)
        def text(n):
            return " ".join(f"w{int(i)}" for i in torch.randint(0, 125, (n,), generator=g))
        sft_data = Dataset.from_dict({"text": [text(int(n)) for n in torch.randint(4, 24, (24,), generator=g)]})
        dpo_data = Dataset.from_dict({"prompt": [text(6) for _ in range(8)], "chosen": [text(5) for _ in range(8)],
                                      "rejected": [text(7) for _ in range(8)]})

        def llama():
            torch.manual_seed(0)
            cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, num_key_value_heads=1, pad_token_id=0,
                                           eos_token_id=1)
            return transformers.LlamaForCausalLM(cfg)

        def common(use_cpu):
            return dict(output_dir=tempfile.mkdtemp(), use_cpu=use_cpu, max_steps=3, per_device_train_batch_size=4,
                        learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no", seed=0,
                        disable_tqdm=True)

        def sft(use_cpu):
            args = SFTConfig(**common(use_cpu), bf16=True, packing=True, padding_free=True, max_length=32)
            return SFTTrainer(model=llama(), args=args, train_dataset=sft_data, processing_class=tokenizer,
                              peft_config=LoraConfig(r=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.1))

        def dpo(use_cpu):
            model = llama()
            return DPOTrainer(model=model, ref_model=copy.deepcopy(model), args=DPOConfig(**common(use_cpu)),
                              train_dataset=dpo_data, processing_class=tokenizer)

        out = {}
        for name, make in (("sft", sft), ("dpo", dpo)):
            runs = {}
            for use_cpu in (False, True):
                t = make(use_cpu)
                t.train()
                runs[use_cpu] = dict(device=str(t.args.device), losses=[h["loss"] for h in t.state.log_history if "loss" in h],
                                     params=[p.detach().cpu() for p in t.model.parameters()])
            s, c = runs[False], runs[True]
            out[name] = dict(device=s["device"], losses=s["losses"], cpu=c["losses"],
                             diff=max((a.float() - b.float()).abs().max().item() for a, b in zip(s["params"], c["params"])))
        print(json.dumps(out))
    """), timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for name in ("sft", "dpo"):
        got = out[name]
        assert got["device"] == "superchip:0" and len(got["losses"]) == 3, (name, got)
        if superchip.executor() == "cpu":
            assert got["losses"] == got["cpu"] and got["diff"] == 0, (name, got)
        else:  # CUDA's kernels round differently from the CPU's (bf16 for SFT)
            assert all(abs(a - b) <= 2e-2 * abs(b) for a, b in zip(got["losses"], got["cpu"])), (name, got)

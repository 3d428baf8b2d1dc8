"""Hugging Face architectures as users fine-tune them: one forward and backward of each
model family with a tiny random configuration, on superchip and on the CPU, loss and every
parameter's gradient compared (bit for bit on the CPU executor, where dropout draws the CPU's
masks too; within the tolerance table in eval mode on CUDA's, whose kernels and dropout
differ). Dense decoders with their attention and norm variants (GQA, sliding windows,
soft-capping, partial rotary, ALiBi, parallel blocks, QK-norm), mixtures of experts (routing,
top-k, shared experts, DeepSeek's latent attention), encoder-decoders (T5's relative
positions, BART), state-space and recurrent models (Mamba, RWKV) and an encoder (BERT); and
the vision and audio encoders (ViT, ConvNeXt, ResNet, Swin, DINOv2, CLIP's and SigLIP's
towers, Whisper, wav2vec 2.0: convolutions, group and batch norms, weight-normed positional
convolutions, SpecAugment masking).

Needs `transformers` (scripts/setup.sh installs it)."""

from __future__ import annotations

import copy

import numpy as np

import pytest
import torch

import superchip

from helpers import DEVICE
from tolerances import tol

transformers = pytest.importorskip("transformers")

_SMALL = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=64, max_position_embeddings=64, pad_token_id=0)
_GPT = dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, n_inner=64, rotary_dim=4)
_MOE = dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, n_routed_experts=4, kv_lora_rank=16, q_lora_rank=16,
            qk_rope_head_dim=4, v_head_dim=8, qk_nope_head_dim=4, n_group=1, topk_group=1, first_k_dense_replace=1)
_SEQ2SEQ = dict(d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8, encoder_layers=2, decoder_layers=2,
                encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                decoder_start_token_id=0)
ARCHITECTURES = {
    "llama": {}, "mistral": {}, "qwen2": {}, "qwen3": {}, "gemma": dict(head_dim=8), "gemma2": dict(head_dim=8),
    "phi": {}, "phi3": {}, "cohere": {}, "starcoder2": {}, "glm4": {}, "olmo2": {},
    "gpt2": _GPT, "gpt_neox": _GPT, "opt": dict(ffn_dim=64, word_embed_proj_dim=32), "bloom": _GPT, "falcon": _GPT,
    "mixtral": _MOE, "qwen2_moe": _MOE, "qwen3_moe": _MOE, "olmoe": _MOE, "deepseek_v3": _MOE,
    "t5": _SEQ2SEQ, "bart": _SEQ2SEQ, "mamba": {}, "rwkv": {}, "bert": {},
}


def _assert_like_cpu(arch, got, want):
    """(loss, {name: gradient}) of superchip's run against the CPU's."""
    (got_loss, got), (want_loss, want) = got, want
    assert got.keys() == want.keys() and want, arch
    for name, g in [("loss", got_loss)] + sorted(got.items()):
        w = want_loss if name == "loss" else want[name]
        if superchip.executor() == "cpu":
            assert torch.equal(g, w), (arch, name, (g - w).abs().max())
        else:
            torch.testing.assert_close(g, w, **tol(w.dtype), msg=f"{arch}: {name}")


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_architecture_trains_with_the_cpus_bits(arch):
    cfg = transformers.AutoConfig.for_model(arch, **_SMALL, **ARCHITECTURES[arch])
    seq2seq = arch in ("t5", "bart")
    auto = transformers.AutoModelForSeq2SeqLM if seq2seq else transformers.AutoModelForCausalLM
    torch.manual_seed(0)
    model = auto.from_config(cfg)
    emulated = superchip.executor() == "cpu"
    model.train(emulated)  # dropout only where superchip draws the CPU's masks
    ours = copy.deepcopy(model).to(DEVICE)
    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(1))

    def run(m, device):
        torch.manual_seed(3)  # the CPU executor's dropout draws from the CPU generator
        out = m(input_ids=ids.to(device), labels=ids.to(device))
        out.loss.backward()
        return out.loss.detach().cpu(), {n: p.grad.cpu() for n, p in m.named_parameters() if p.grad is not None}

    _assert_like_cpu(arch, run(ours, DEVICE), run(model, "cpu"))


def _pixels():
    return {"pixel_values": torch.randn(2, 3, 32, 32)}


_VIT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32, patch_size=8)
_STAGES = dict(hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1])
ENCODERS = {
    "vit": (_VIT, _pixels), "clip_vision_model": (_VIT, _pixels), "siglip_vision_model": (_VIT, _pixels),
    "dinov2": (dict(_VIT, mlp_ratio=2), _pixels), "convnext": (dict(_STAGES, image_size=32), _pixels),
    "resnet": (dict(_STAGES, embedding_size=8), _pixels),
    "swin": (dict(embed_dim=16, depths=[1, 1], num_heads=[2, 2], image_size=32, patch_size=4, window_size=4), _pixels),
    "whisper": (dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                     encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16, max_source_positions=20, vocab_size=64,
                     decoder_start_token_id=1, pad_token_id=0),
                lambda: {"input_features": torch.randn(2, 16, 40), "decoder_input_ids": torch.randint(1, 64, (2, 5))}),
    "wav2vec2": (dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, conv_dim=[16, 16],
                      conv_kernel=[5, 3], conv_stride=[4, 2], num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4,
                      mask_time_prob=0.3, mask_time_length=2),
                 lambda: {"input_values": torch.randn(2, 400)}),
}


@pytest.mark.parametrize("arch", sorted(ENCODERS))
def test_vision_and_audio_encoder_trains_with_the_cpus_bits(arch):
    kw, inputs = ENCODERS[arch]
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(transformers.AutoConfig.for_model(arch, **kw))
    emulated = superchip.executor() == "cpu"
    model.train(emulated)
    ours = copy.deepcopy(model).to(DEVICE)
    torch.manual_seed(1)
    x = inputs()

    def run(m, device):
        torch.manual_seed(3)
        np.random.seed(3)  # wav2vec 2.0 draws its SpecAugment masks with numpy
        out = m(**{k: v.to(device) for k, v in x.items()}).last_hidden_state
        loss = out.float().pow(2).mean()
        loss.backward()
        return loss.detach().cpu(), {n: p.grad.cpu() for n, p in m.named_parameters() if p.grad is not None}

    _assert_like_cpu(arch, run(ours, DEVICE), run(model, "cpu"))


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_mixture_of_experts_generates_with_the_cpus_scores(arch):
    # transformers' generate() switches the experts to `batched_mm` while decoding on any
    # device but the CPU: on the CPU executor superchip's scores were 1 ulp off the CPU's.
    # They stay `grouped_mm` there, as on the CPU (superchip/_huggingface.py); with the CUDA
    # executor they switch, as on CUDA, and the scores are compared within the tolerance table.
    cfg = transformers.AutoConfig.for_model(arch, **_SMALL, **ARCHITECTURES[arch])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    assert "grouped_mm" in model.get_experts_implementation().values()
    ours = copy.deepcopy(model).to(DEVICE)
    ids = torch.randint(1, 128, (2, 8), generator=torch.Generator().manual_seed(1))

    def run(m, device):
        out = m.generate(ids.to(device), max_new_tokens=6, do_sample=False, output_scores=True,
                         return_dict_in_generate=True)
        return out.sequences.cpu(), torch.stack(out.scores).cpu()

    (got_ids, got), (want_ids, want) = run(ours, DEVICE), run(model, "cpu")
    assert "grouped_mm" in ours.get_experts_implementation().values()  # restored after decoding
    if superchip.executor() == "cpu":
        assert torch.equal(got_ids, want_ids) and torch.equal(got, want), (got - want).abs().max()
    else:
        torch.testing.assert_close(got, want, **tol(want.dtype))

"""A tiny random-weight Llama (through transformers) for fast model tests."""
from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from gateeng.config import ModelConfig
from gateeng.model.families import config_from_hf
from gateeng.model.loader import DTYPES, LoadedModel
from gateeng.model.llama import LlamaModel


class ByteTokenizer:
    """Bytes as token ids: enough to exercise text paths without a tokenizer file."""
    eos_token_id = 255
    chat_template = "<role>content ... <assistant>"

    def encode(self, text, add_special_tokens=False, split_special_tokens=False):
        return list(text.encode())

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if i < 255).decode(errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, return_dict=False):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"
        return self.encode(text) if tokenize else text


def hf_tiny(seed=0, rope_scaling=None, tie=True, max_positions=512) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=max_positions, rms_norm_eps=1e-5, tie_word_embeddings=tie,
                      bos_token_id=1, eos_token_id=255, rope_theta=10000.0)
    if rope_scaling:
        cfg.rope_parameters = dict(rope_scaling, rope_theta=10000.0)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():   # larger weights than the default init, so logits are O(1-10)
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
    return m


def tiny_loaded(dtype="float32", hf=None) -> LoadedModel:
    hf = hf or hf_tiny()
    cfg = config_from_hf(hf.config)
    model = LlamaModel(cfg, DTYPES[dtype])
    model.load_hf_state_dict(hf.state_dict())
    return LoadedModel(model, ByteTokenizer(), cfg, "tiny-random", "tiny")


# Tiny random models of each supported family, built from their transformers configs.
FAMILIES = ("llama", "llama3", "mistral", "qwen2", "qwen3")
# The mixtures of experts: 4 experts, 2 per token. The Qwen3-MoE model's layer 1 is a
# plain MLP (mlp_only_layers); OLMoE's q/k norms span the whole projection.
MOE_FAMILIES = ("qwen3_moe", "mixtral", "olmoe")


def hf_family(family: str, seed: int = 0, tie: bool = False, **overrides):
    """A random-weight model of `family`, small enough for fast parity tests. Norm
    weights and biases are random too, so every family-specific term matters.
    `overrides`: config fields set otherwise (vocab_size=..., mlp_only_layers=[])."""
    import transformers as tf
    torch.manual_seed(seed)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  rms_norm_eps=1e-6, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=255)
    if family == "llama":
        cfg, cls = tf.LlamaConfig(**common), tf.LlamaForCausalLM
    elif family == "llama3":      # Llama 3.x: llama3 RoPE scaling, rope_theta 500000
        cfg, cls = tf.LlamaConfig(**common), tf.LlamaForCausalLM
        cfg.rope_parameters = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                               "rope_theta": 500000.0}
    elif family == "mistral":     # a sliding window the tiny context never reaches
        cfg, cls = tf.MistralConfig(**common, sliding_window=4096), tf.MistralForCausalLM
    elif family == "qwen2":       # q, k, v biases
        cfg, cls = tf.Qwen2Config(**common, use_sliding_window=False), tf.Qwen2ForCausalLM
    elif family == "qwen3":       # per-head q/k RMSNorm, head_dim != hidden / heads
        cfg, cls = tf.Qwen3Config(**dict(common, head_dim=32), use_sliding_window=False), tf.Qwen3ForCausalLM
    elif family == "qwen3_moe":
        cfg, cls = tf.Qwen3MoeConfig(**common, use_sliding_window=False, num_experts=4, num_experts_per_tok=2,
                                     moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
                                     mlp_only_layers=[1]), tf.Qwen3MoeForCausalLM
    elif family == "mixtral":
        cfg, cls = tf.MixtralConfig(**dict(common, intermediate_size=32), num_local_experts=4,
                                    num_experts_per_tok=2), tf.MixtralForCausalLM
    elif family == "olmoe":
        cfg, cls = tf.OlmoeConfig(**dict(common, intermediate_size=32), num_experts=4, num_experts_per_tok=2,
                                  norm_topk_prob=False), tf.OlmoeForCausalLM
    else:
        raise ValueError(family)
    for field, value in overrides.items():
        setattr(cfg, field, value)
    m = cls(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() >= 2:            # matrices, and transformers' fused [experts, rows, cols]
                p.normal_(0, 0.1)
            elif name.endswith("bias"):
                p.normal_(0, 0.5)
            else:                   # norm weights
                p.uniform_(0.5, 1.5)
    return m


def save_family(family: str, path, tie: bool = False) -> None:
    """A tiny `family` model saved as a Hugging Face directory (safetensors, config,
    and a byte-level tokenizer with a ChatML template), as `--model` takes it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    hf = hf_family(family, tie=tie)
    hf.save_pretrained(path, safe_serialization=True)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet[:254])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>")
    fast.add_special_tokens({"additional_special_tokens": []})
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    fast.save_pretrained(path)


def spec_tiny(seed=0, head_dim=32, max_positions=256, device="cpu", moe=False, layers=2) -> LoadedModel:
    """A tiny bf16 Llama whose weights come from integers (numpy's PCG64), so they have
    the same bits on every machine: the golden file's tiny model. head_dim 32 takes the
    vector attention scores of the reference builds; 16 their portable ones. `device`:
    where the weights live (bench/gpu_check.py decodes the golden answers on CUDA).
    `moe`: a Qwen3-MoE instead (q/k norms; layer 0 routes to 2 of 8 experts with
    renormalized weights, layer 1 is a plain MLP). `layers`: 2 for the golden file; 1
    where the Triton interpreter, slow per layer, checks the kernels (not with moe)."""
    import numpy as np

    from gateeng.config import SOFTMAX_TOPK, MoeConfig
    rng = np.random.default_rng(seed)
    heads, kv_heads = 4, 2
    terms = dict(architecture="llama")
    if moe:
        terms = dict(architecture="qwen3_moe", qk_norm=True,
                     moe=MoeConfig(num_experts=8, top_k=2, intermediate_size=64, routing=SOFTMAX_TOPK,
                                   norm_topk_prob=True, sparse_layers=(0,)))
    cfg = ModelConfig(vocab_size=256, hidden_size=heads * head_dim, intermediate_size=192, num_layers=layers,
                      num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-5,
                      rope_theta=10000.0, max_position=max_positions, tie_word_embeddings=True,
                      eos_token_ids=(255,), **terms)
    model = LlamaModel(cfg, torch.bfloat16, device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            values = rng.integers(-1000, 1001, size=tuple(p.shape)) / 5000.0
            if p.dim() == 1:   # norm weights near 1
                values = 1.0 + values / 4
            p.copy_(torch.from_numpy(values.astype(np.float32)).to(torch.bfloat16))
    model.finalize()
    name = "tiny-spec-moe" if moe else "tiny-spec"
    return LoadedModel(model, ByteTokenizer(), cfg, name, name)

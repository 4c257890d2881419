"""A tiny random-weight Llama (through transformers) for fast model tests."""
from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from gateeng.config import ModelConfig
from gateeng.loader import DTYPES, LoadedModel
from gateeng.model import LlamaModel


class ByteTokenizer:
    """Bytes as token ids: enough to exercise text paths without a tokenizer file."""
    eos_token_id = 255

    def encode(self, text, add_special_tokens=False):
        return list(text.encode())

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if i < 255).decode(errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, return_dict=False):
        return self.encode("<user>" + messages[-1]["content"] + "<assistant>")


def hf_tiny(seed=0, rope_scaling=None, tie=True) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=tie,
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
    cfg = ModelConfig.from_hf(hf.config)
    model = LlamaModel(cfg, DTYPES[dtype])
    model.load_hf_state_dict(hf.state_dict())
    return LoadedModel(model, ByteTokenizer(), cfg, "tiny-random", "tiny")

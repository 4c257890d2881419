"""The golden file's cases and how an answer is recorded: token ids and the float32
bits of each token's logprob, plus a hash of the bits of its top-2 alternatives."""
from __future__ import annotations

import hashlib
import struct

from gateeng.config import EngineConfig
from gateeng.engine.engine import Engine
from gateeng.request import SamplingParams

PROMPTS = [
    "Write a story about a dragon who learns to paint.",
    "Explain how a refrigerator works.",
    "What are the benefits of learning a second language?",
    "Describe a day in the life of a medieval blacksmith.",
    "List three uses of a paperclip.",
    "Why is the sky blue?",
    "Translate 'good morning' into French and Spanish.",
    "Give me a haiku about autumn rain.",
]
TOKENS = 32
GREEDY = dict(max_tokens=TOKENS, ignore_eos=True, logprobs=2)
SEEDED = dict(max_tokens=TOKENS, ignore_eos=True, logprobs=2, temperature=0.8, top_p=0.95)

CASES = {
    "smollm2": [dict(prompts=PROMPTS, chat=True, params=GREEDY),
                dict(prompts=PROMPTS, chat=True, params=SEEDED, seeds=list(range(100, 108)))],
    "tiny": [dict(prompts=[[5, 17, 200, 3], list(range(40, 80))], chat=False, params=GREEDY),
             dict(prompts=[[5, 17, 200, 3], list(range(40, 80))], chat=False, params=SEEDED, seeds=[1, 2])],
}
CASES["smollm2-q4_1"] = CASES["smollm2"]
CASES["tiny-q8_0"] = CASES["tiny-q4_0"] = CASES["tiny-moe"] = CASES["tiny-kquant"] = CASES["tiny"]


def _smollm():
    from gateeng.model import loader
    return loader.load(None, "bfloat16", dequantize=True)


def _smollm_as_stored():
    """The embedded GGUF as shipped: Q4_1 weights (and a Q8_0 embedding) as stored."""
    from gateeng.model import loader
    return loader.load(None)


def _tiny():
    from tests.tiny import spec_tiny
    return spec_tiny()


def _tiny_moe():
    """A tiny Qwen3-MoE (8 experts, 2 per token, renormalized; a plain-MLP layer too)."""
    from tests.tiny import spec_tiny
    return spec_tiny(moe=True)


def _tiny_quantized(kind, label: str = None, **shape):
    """A tiny random Llama GGUF, every matrix in `kind` (a type, or tests/tiny_gguf.py's
    {pattern: type}), of the given shape, as stored."""
    def load():
        import tempfile
        from pathlib import Path

        from gateeng.model import loader
        from tests.tiny_gguf import write_tiny_gguf
        where = Path(tempfile.mkdtemp(prefix="gateeng-golden-"))
        return loader.load(str(write_tiny_gguf(where / f"tiny-{label or kind}.gguf", kind, tie=False, **shape)["path"]))
    return load


# The K-quants, each type as stored: q, k, v, o and the embedding in Q4_K, gate and up
# in Q5_K, down and the lm_head in Q6_K; rows of 256 values (their super-block).
K_QUANTS = {"blk.*.ffn_down.weight": "Q6_K", "blk.*.ffn_gate.weight": "Q5_K", "blk.*.ffn_up.weight": "Q5_K",
            "output.weight": "Q6_K", "*": "Q4_K"}

MODELS = {"smollm2": _smollm, "tiny": _tiny, "smollm2-q4_1": _smollm_as_stored,
          "tiny-q8_0": _tiny_quantized("Q8_0"), "tiny-q4_0": _tiny_quantized("Q4_0"), "tiny-moe": _tiny_moe,
          "tiny-kquant": _tiny_quantized(K_QUANTS, "kquant", hidden=256, heads=2, kv_heads=1, head_dim=128,
                                         intermediate=512)}


def record(completion) -> dict:
    tops = b"".join(struct.pack("<if", i, v) for lp in completion.logprobs for i, v in lp.top)
    return {"tokens": list(completion.token_ids),
            "logprob_bits": [struct.unpack("<I", struct.pack("<f", lp.logprob))[0] for lp in completion.logprobs],
            "top2_sha256": hashlib.sha256(tops).hexdigest()}


def answers(loaded, case: dict, prompts: int = None, device: str = "cpu") -> list:
    """The reference's answers to the case's first `prompts` prompts (all: None), all in
    one batch, from an engine with plan=invariant on `device`: on CPU, this machine's
    default (or GATEENG_CPU_ISA) build. The golden file was made with one prompt at a
    time: a reference answer does not depend on its batch."""
    engine = Engine(EngineConfig(plan="invariant", dtype="bfloat16", num_kv_blocks=512, max_model_len=256,
                                 device=device), loaded=loaded)
    try:
        chosen = case["prompts"][:prompts]
        seeds = case.get("seeds", [None] * len(chosen))
        params = [SamplingParams(**dict(case["params"], seed=seed)) for seed in seeds[:len(chosen)]]
        handles = engine.submit_many(chosen, params, chat=case["chat"])
        return [record(h.result()) for h in handles]
    finally:
        engine.shutdown()

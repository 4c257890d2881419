"""The golden file's cases and how an answer is recorded: token ids and the float32
bits of each token's logprob, plus a hash of the bits of its top-2 alternatives."""
from __future__ import annotations

import hashlib
import struct

from gateeng.config import EngineConfig
from gateeng.engine.client import Engine
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


def _smollm():
    from gateeng.model import loader
    return loader.load(None, "bfloat16")


def _tiny():
    from tests.tiny import spec_tiny
    return spec_tiny()


MODELS = {"smollm2": _smollm, "tiny": _tiny}


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

"""32 concurrent requests on a KV cache far too small for them (real model, float32)."""
import pytest

from gateeng.config import EngineConfig
from gateeng.engine.engine import Engine
from gateeng.request import DeterminismParams, FinishReason, Mode, SamplingParams

pytestmark = pytest.mark.model

WORDS = "apple river stone cloud music garden silver window number castle forest yellow".split()
VERIFIED = DeterminismParams(Mode.VERIFIED)


def prompts(n):
    return [f"Tell me about the {WORDS[i % 12]} and the {WORDS[(i * 5) % 12]} number {i}." for i in range(n)]


def test_32_requests_on_small_cache_all_complete_and_verified_ones_are_the_reference(smollm):
    loaded = smollm("float32")
    ps = prompts(32)
    params = [SamplingParams(max_tokens=16 + (i % 4) * 4, ignore_eos=True) for i in range(32)]
    verified = list(range(0, 32, 4))
    ref = Engine(EngineConfig(dtype="float32", plan="invariant", num_kv_blocks=512), loaded=loaded)
    want = {i: c.token_ids for i, c in zip(verified, ref.generate([ps[i] for i in verified],
                                                                    [params[i] for i in verified]))}
    ref.shutdown()
    # 12 blocks x 16 tokens = 192 KV slots for 32 requests of ~40 tokens each. The
    # speculative route: every VERIFIED token is decoded on the fast plan and verified
    # while requests are preempted and recomputed around it, and the start prices no
    # routes (timing passes on a cache this small is no part of what is shown here).
    tight = Engine(EngineConfig(dtype="float32", num_kv_blocks=12, verified_route="speculative"), loaded=loaded)
    got = tight.generate(ps, params, [VERIFIED if i in want else None for i in range(32)])
    assert tight.core.scheduler.num_preemptions > 0
    # Preemption and recompute must lose nothing: every request runs to its length...
    for p, c in zip(params, got):
        assert c.finish_reason is FinishReason.LENGTH and c.completion_tokens == p.max_tokens
    # ...and VERIFIED bits do not depend on the cache pressure (OFF bits may).
    for i, tokens in want.items():
        assert got[i].token_ids == tokens, f"VERIFIED request {i} differs from the reference"
    tight.shutdown()
    tight.core.blocks.check_integrity()
    assert tight.core.blocks.num_free == tight.core.blocks.num_blocks

"""64 concurrent requests on a KV cache far too small for them (real model, float32)."""
import pytest

from gateeng.config import EngineConfig
from gateeng.engine import Engine
from gateeng.request import SamplingParams

pytestmark = pytest.mark.model

WORDS = "apple river stone cloud music garden silver window number castle forest yellow".split()


def prompts(n):
    return [f"Tell me about the {WORDS[i % 12]} and the {WORDS[(i * 5) % 12]} number {i}." for i in range(n)]


def test_64_requests_on_small_cache_complete_identically(smollm):
    loaded = smollm("float32")
    ps = prompts(64)
    params = [SamplingParams(max_tokens=16 + (i % 4) * 4, ignore_eos=True) for i in range(64)]
    roomy = Engine(EngineConfig(dtype="float32", num_kv_blocks=512), loaded=loaded)
    want = [c.token_ids for c in roomy.generate(ps, params)]
    assert roomy.scheduler.num_preemptions == 0
    roomy.shutdown()
    # 24 blocks x 16 tokens = 384 KV slots for 64 requests of ~40 tokens each.
    tight = Engine(EngineConfig(dtype="float32", num_kv_blocks=24), loaded=loaded)
    got = tight.generate(ps, params)
    assert tight.scheduler.num_preemptions > 0
    assert [c.token_ids for c in got] == want
    tight.shutdown()
    tight.blocks.check_integrity()
    assert tight.blocks.num_free == tight.blocks.num_blocks

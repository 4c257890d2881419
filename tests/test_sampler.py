"""Token choice and margin without a model."""
import pytest
import torch

from gateeng.request import GREEDY_TEMPERATURE, SamplingParams
from gateeng.plans.sampler import RowSpec, sample


@pytest.mark.parametrize("temperature", [0.0, 1e-38, 1e-37, 1e-6])
def test_temperature_below_the_floor_is_greedy(temperature):
    assert temperature < GREEDY_TEMPERATURE
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 300, generator=gen) * 5
    greedy = sample(logits, [RowSpec(SamplingParams(), 0, 7)] * 4)
    tiny = sample(logits, [RowSpec(SamplingParams(temperature=temperature, seed=3), 3, 7)] * 4)
    assert tiny == greedy
    assert greedy[0] == logits.argmax(-1).tolist()
    assert all(m > 0 for m in greedy[1])


def test_temperature_at_the_floor_samples():
    logits = torch.zeros(1, 300)   # all tied: only the Gumbel noise decides
    picks = {sample(logits, [RowSpec(SamplingParams(temperature=GREEDY_TEMPERATURE, seed=s), s, 7)])[0][0]
             for s in range(8)}
    assert len(picks) > 1

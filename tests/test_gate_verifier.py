import math

import pytest

from gateeng.engine import gate
from gateeng.engine import verifier


@pytest.mark.parametrize("margin, unverified, finishing, tau, window, expect", [
    (5.0, 1, False, 0.25, 4, None),
    (0.1, 1, False, 0.25, 4, "margin"),
    (0.0, 1, False, 0.0, 4, "margin"),          # a tie triggers even at tau = 0
    (math.nan, 1, False, 0.25, 4, "margin"),
    (0.3, 1, False, 0.0, 4, None),              # tau = 0: window-only (LLM-42 style)
    (5.0, 4, False, 0.25, 4, "window"),
    (5.0, 1, True, 0.25, 4, "finish"),
    (0.1, 4, True, 0.25, 4, "margin"),          # one reason per trigger, margin first
])
def test_gate_table(margin, unverified, finishing, tau, window, expect):
    assert gate.decide(margin, unverified, finishing, tau, window) == expect


@pytest.mark.parametrize("spec, preds, accepted, nxt, mismatch", [
    ([], [7], 0, 7, False),
    ([1, 2, 3], [1, 2, 3, 4], 3, 4, False),
    ([1, 2, 3], [9, 2, 3, 4], 0, 9, True),
    ([1, 2, 3], [1, 9, 3, 4], 1, 9, True),
    ([1, 2, 3], [1, 2, 9, 4], 2, 9, True),
])
def test_compare_table(spec, preds, accepted, nxt, mismatch):
    o = verifier.compare(spec, preds)
    assert (o.accepted, o.next_token, o.mismatch) == (accepted, nxt, mismatch)
    assert o.rolled_back(len(spec)) == len(spec) - accepted


def test_compare_needs_one_more_prediction():
    with pytest.raises(ValueError):
        verifier.compare([1, 2], [1, 2])

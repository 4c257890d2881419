"""Comparison of a replay against the speculated tokens (pure).

A replay of the unverified positions [canonical_len, len(tokens)) with the
invariant plan gives one prediction per position: predictions[i] is the canonical
token that follows input position canonical_len + i. The first len(speculated)
predictions check the speculated tokens; the last one is the next token, which is
already verified because its whole context now is.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VerifyOutcome:
    accepted: int      # speculated tokens confirmed
    next_token: int    # verifier's token after the accepted ones
    mismatch: bool

    def rolled_back(self, num_speculated: int) -> int:
        return num_speculated - self.accepted


def compare(speculated: list, predictions: list) -> VerifyOutcome:
    if len(predictions) != len(speculated) + 1:
        raise ValueError(f"need {len(speculated) + 1} predictions, got {len(predictions)}")
    for i, (s, p) in enumerate(zip(speculated, predictions)):
        if s != p:
            return VerifyOutcome(accepted=i, next_token=p, mismatch=True)
    return VerifyOutcome(accepted=len(speculated), next_token=predictions[-1], mismatch=False)

"""The verification stage: a step's outputs in, request updates out.

For each scheduled sequence and the runner's SeqOutput it applies the token-level
result:
  prefill ends, OFF and REFERENCE decodes: append the token and commit it;
  VERIFIED fast decodes (the speculative route): append the token unverified and
    ask the gate whether to verify (`pending_verify` = the trigger's reason;
    `replay_due` once the replay may not wait: see Scheduler);
  replays on the invariant plan (a verify pass, or a decode on the direct route):
    compare the predictions with the speculated tokens, keep the agreeing prefix,
    append the verifier's next token and commit.
It writes a request's token state (tokens, num_verified, spec_margins,
pending_verify, eager_len, stop_text_len, stats) and nothing else. The scheduler,
which owns KV blocks and request status, applies the returned Outcomes. Every
increment of a request's DeterminismStats is also added to the step's own
DeterminismStats (`drain`), so observers and the route policy get the step's
counts without a copy of every request's counters.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from gateeng.engine import gate
from gateeng.engine import verifier
from gateeng.request import DeterminismStats, FinishReason, Mode, Reason, Request, StreamPolicy
from gateeng.config import DIRECT, SPECULATIVE
from gateeng.engine.stopping import StopChecker



@dataclass(frozen=True)
class Outcome:
    """What the scheduler must apply for one scheduled sequence."""
    request: Request
    num_computed: int                 # positions with KV written, after this step
    rolled_back: bool                 # tokens were cut: KV past len(tokens) is stale
    finish: Optional[FinishReason]    # the request finished at a committed token


def discard_speculation(req: Request) -> None:
    """Drop the unverified tokens (a preempted request re-derives them)."""
    req.truncate(req.num_verified)
    req.spec_margins.clear()
    req.pending_verify = None
    req.replay_due = False
    req.pending_age = 0
    req.eager_len = min(req.eager_len, len(req.output_ids))


class VerificationStage:
    def __init__(self, stop: StopChecker, router_tau: float = 0.0):
        self.stop = stop
        self.router_tau = router_tau   # the router-margin bound (EngineConfig.router_margin_threshold)
        # (reason, fast-path margin of the first wrong token) per mismatch; drained per step.
        self.mismatches: list[tuple[str, float]] = []
        self.counted = DeterminismStats()   # this step's increments, over every request

    def drain(self) -> tuple:
        """(mismatches, the step's DeterminismStats increments); starts the next step's."""
        out = (tuple(self.mismatches), self.counted)
        self.mismatches.clear()
        self.counted = DeterminismStats()
        return out

    def _count(self, req: Request, name: str, n: int = 1) -> None:
        req.stats.add(name, n)
        self.counted.add(name, n)

    def apply(self, plan, outputs: dict) -> list[Outcome]:
        outcomes = []
        for seq in plan.seqs:
            req = seq.request
            if req.finished:
                continue
            out = outputs.get(req.request_id)
            if out is not None and out.prompt_logprobs:
                req.prompt_logprobs.extend(out.prompt_logprobs)
            if seq.replay:
                outcomes.append(self._replay(req, seq, out))
            elif not seq.sample_rows:
                outcomes.append(Outcome(req, seq.end, False, None))   # a prefill chunk
            elif req.mode is Mode.VERIFIED and seq.route == SPECULATIVE:
                self._speculate(req, out.tokens[-1], out.margins[-1],
                                out.router_margins[-1] if out.router_margins else math.inf)
                req.logprobs.extend(out.logprobs[-1:])    # provisional: a replay replaces it
                outcomes.append(Outcome(req, seq.end, False, None))
            else:
                req.tokens.append(out.tokens[-1])
                req.logprobs.extend(out.logprobs[-1:])
                outcomes.append(Outcome(req, seq.end, False, self._commit_upto(req, len(req.tokens))))
        return outcomes

    def _speculate(self, req: Request, token: int, margin: float, router_margin: float) -> None:
        req.tokens.append(token)
        req.spec_margins.append(margin)
        self._count(req, "decode_steps")
        would_finish = self.stop.check(req, len(req.tokens) - 1)[0] is not None
        if req.pending_verify is not None:
            req.pending_age += 1       # a margin-triggered replay waiting for company
        else:
            reason = gate.decide(margin, req.num_unverified, would_finish, req.tau, req.window, router_margin,
                                 self.router_tau)
            if reason is not None:
                req.pending_verify = reason
                self._count(req, DeterminismStats.trigger_field(reason))
        # A window or finish trigger cannot wait: W bounds the unverified tokens, and
        # nothing may be decoded past a token that would finish the request.
        req.replay_due = req.pending_verify is not None and (would_finish or req.num_unverified >= req.window)
        num_out = len(req.output_ids)
        shown = max(req.eager_len, req.num_verified - req.num_prompt)
        if req.det.stream_policy is StreamPolicy.EAGER and margin >= req.tau and shown == num_out - 1:
            req.eager_len = num_out

    def _replay(self, req: Request, seq, out) -> Outcome:
        first = seq.start + 1            # index of the first speculated token
        speculated = req.tokens[first:seq.end]
        outcome = verifier.compare(speculated, out.tokens)
        if seq.route == DIRECT:
            self._count(req, "direct_steps")
        if speculated:
            self._count(req, "verify_passes")
            self._count(req, "replayed_tokens", seq.num_tokens)
        if outcome.mismatch:
            # The trigger that caught it says how to tune: window or finish catches
            # mean a flip slipped past the margin test (tau too low).
            reason = req.pending_verify or Reason.DIRECT
            self._count(req, "mismatches")
            self._count(req, DeterminismStats.mismatch_field(reason))
            self._count(req, "rolled_back_tokens", outcome.rolled_back(len(speculated)))
            self.mismatches.append((reason, req.spec_margins[outcome.accepted]))
        req.spec_margins.clear()
        req.truncate(first + outcome.accepted)
        req.tokens.append(outcome.next_token)
        if out.logprobs:
            # Every kept token's logprobs come from the invariant plan's row that predicted it.
            del req.logprobs[first - req.num_prompt:]
            req.logprobs.extend(out.logprobs[:outcome.accepted + 1])
        req.eager_len = min(req.eager_len, first + outcome.accepted - req.num_prompt)
        req.pending_verify = None
        req.replay_due = False
        req.pending_age = 0
        finish = self._commit_upto(req, len(req.tokens))
        return Outcome(req, first + outcome.accepted, outcome.mismatch, finish)

    def _commit_upto(self, req: Request, upto: int) -> Optional[FinishReason]:
        """Make tokens[num_verified:upto] final, one at a time, stopping at a finish."""
        for i in range(req.num_verified, upto):
            req.num_verified = i + 1
            reason, cut = self.stop.check(req, i)
            if reason is not None:
                req.truncate(i + 1)
                req.stop_text_len = cut
                return reason
        return None

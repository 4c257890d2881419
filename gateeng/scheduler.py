"""Continuous batching with chunked prefill, paged KV and preemption by recompute.

Pure Python, no torch. Contract with the runner: `schedule()` returns a StepPlan
(which token positions of which request to run, and on which plan); the runner
returns one SeqOutput (tokens and margins) per scheduled request; `update()`
applies it, running the verification stage for VERIFIED requests (gate, verify
compare, commit / rollback). The scheduler is the only writer of Request state.

Token bookkeeping per request (tokens = prompt + output):
  num_computed   positions with KV written
  num_verified   leading tokens that are final (OFF: all of them)
  canonical_len  positions with invariant-plan KV (VERIFIED); == num_verified - 1
                 once decoding, so a verify replay starts there
A VERIFIED request decodes speculatively on the fast plan; the gate may mark it
`pending_verify` (with the trigger's reason), and the next step replays
[canonical_len, len(tokens)) on the invariant plan. Rollback is truncating
`tokens` and the block table.
"""
from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from gateeng import gate, verifier
from gateeng.block_manager import BlockManager
from gateeng.request import FinishReason, Mode, Request, Status, StreamPolicy
from gateeng.stopping import StopChecker


class Kind(enum.Enum):
    FAST = "fast"
    INVARIANT = "invariant"


@dataclass(frozen=True)
class ScheduledSeq:
    """One request's share of a step, fixed when the step is planned (later updates
    to the request do not change it)."""
    request: Request
    start: int           # first position to compute
    end: int             # one past the last position
    kind: Kind
    replay: bool = False  # verify pass: a prediction for every row
    sample_rows: tuple = ()   # row offsets within the chunk that need a sampled token

    @classmethod
    def plan(cls, req: Request, start: int, end: int, kind: Kind, replay: bool = False) -> "ScheduledSeq":
        if replay:
            rows = tuple(range(end - start))
        else:
            rows = (end - start - 1,) if end == len(req.tokens) else ()
        return cls(req, start, end, kind, replay, rows)

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def decode(self) -> bool:
        """Samples one new token after the prompt (not a prefill chunk, not a replay)."""
        return bool(self.sample_rows) and not self.replay and self.start >= self.request.num_prompt


@dataclass
class StepPlan:
    seqs: list = field(default_factory=list)

    def of_kind(self, kind: Kind) -> list:
        return [s for s in self.seqs if s.kind is kind]


@dataclass(frozen=True)
class SeqOutput:
    """What the runner returns for one scheduled sequence: immutable, so observers
    may keep it."""
    tokens: tuple
    margins: tuple


class Scheduler:
    def __init__(self, blocks: BlockManager, stop: StopChecker, max_num_seqs: int,
                 max_num_batched_tokens: int):
        self.blocks = blocks
        self.stop = stop
        self.max_num_seqs = max_num_seqs
        self.token_budget = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []   # drained by the engine after each step
        # (trigger reason, fast-path margin of the first wrong token) per mismatch; drained likewise
        self.mismatches: list[tuple[str, float]] = []
        self.num_preemptions = 0

    # ---- queue -------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        self.waiting.append(req)

    def abort(self, request_id: str) -> Optional[Request]:
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.request_id == request_id:
                    queue.remove(req)
                    self._finish(req, FinishReason.ABORT, remove=False)
                    return req
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- schedule ----------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.token_budget
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            seq = self._next_chunk(req, budget)
            if seq is None:
                i += 1
                continue
            if self._reserve(req, seq.end):
                plan.seqs.append(seq)
                budget -= seq.num_tokens
                i += 1
            else:
                # Out of KV blocks: recompute-preempt the newest request (maybe this one).
                victim = self.running[-1]
                self._preempt(victim)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            self._match_prefix(req)
            seq = self._next_chunk(req, budget)
            if seq is None or not self._reserve(req, seq.end):
                # A waiting request holds no blocks: the match goes back (its blocks
                # stay cached), so only running requests ever keep this one out.
                self._unmatch(req)
                if not self.running and not plan.seqs and not self.fits(len(req.tokens)):
                    # Unreachable for a request admitted through fits(); a direct caller's
                    # oversized request must not wait forever.
                    self.waiting.popleft()
                    self._finish(req, FinishReason.ABORT, remove=False)
                    continue
                break   # FCFS: wait for blocks to come back
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            plan.seqs.append(seq)
            budget -= seq.num_tokens
        return plan

    def fits(self, num_tokens: int) -> bool:
        """Can a request of `num_tokens` positions ever run? The admission rule: a
        request that passes it is never dropped for lack of KV, since the scheduler
        can always preempt everything else to make room."""
        return self.blocks.blocks_needed(num_tokens) <= self.blocks.num_blocks

    def _next_chunk(self, req: Request, budget: int) -> Optional[ScheduledSeq]:
        if req.pending_verify:
            start, end = req.canonical_len, len(req.tokens)
            if end - start > budget:
                return None   # replays are not split; next step
            return ScheduledSeq.plan(req, start, end, Kind.INVARIANT, replay=True)
        start = req.num_computed
        end = min(len(req.tokens), start + budget)
        if req.mode is Mode.REFERENCE:
            kind = Kind.INVARIANT
        elif req.mode is Mode.VERIFIED and start < req.prefill_target:
            kind = Kind.INVARIANT   # prompt (or recompute) KV is canonical from the start
        else:
            kind = Kind.FAST
        return ScheduledSeq.plan(req, start, end, kind)

    def _reserve(self, req: Request, end: int) -> bool:
        need = self.blocks.blocks_needed(end) - len(req.block_table)
        if need > self.blocks.num_free:
            return False
        for _ in range(need):
            req.block_table.append(self.blocks.allocate())
        return True

    def _match_prefix(self, req: Request) -> None:
        bs = self.blocks.block_size
        # Leave at least one position to compute: its logits give the next token.
        max_blocks = (len(req.tokens) - 1) // bs
        matched = self.blocks.match_prefix(req.tokens, max_blocks, canonical_only=req.mode is not Mode.OFF)
        req.block_table = matched
        req.num_computed = len(matched) * bs
        req.num_registered_blocks = len(matched)
        req.prefill_target = len(req.tokens)
        if req.num_preemptions == 0:
            req.num_cached_tokens = min(req.num_computed, req.num_prompt)

    def _unmatch(self, req: Request) -> None:
        self.blocks.release_all(req.block_table)
        req.num_computed = 0
        req.num_registered_blocks = 0

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._unmatch(req)
        # Speculated tokens are dropped; the recompute re-derives them.
        del req.tokens[req.num_verified:]
        req.spec_margins.clear()
        req.pending_verify = None
        req.eager_len = min(req.eager_len, len(req.output_ids))
        req.num_preemptions += 1
        req.status = Status.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- update ------------------------------------------------------------
    def update(self, plan: StepPlan, outputs: dict) -> None:
        for seq in plan.seqs:
            req = seq.request
            if req.finished:
                continue
            out = outputs.get(req.request_id)
            if seq.replay:
                self._commit_replay(req, seq, out)
            else:
                req.num_computed = seq.end
                if seq.sample_rows:
                    token, margin = out.tokens[-1], out.margins[-1]
                    if req.mode is Mode.VERIFIED and seq.kind is Kind.FAST:
                        self._speculate(req, token, margin)
                    else:
                        req.tokens.append(token)
                        self._commit_upto(req, len(req.tokens))
            if not req.finished:
                self._register_blocks(req)

    def _speculate(self, req: Request, token: int, margin: float) -> None:
        req.tokens.append(token)
        req.spec_margins.append(margin)
        req.stats.decode_steps += 1
        would_finish = self.stop.check(req, len(req.tokens) - 1)[0] is not None
        reason = gate.decide(margin, req.num_unverified, would_finish, req.tau, req.window)
        if reason is not None:
            req.pending_verify = reason
            req.stats.add(f"triggers_{reason}")
        num_out = len(req.output_ids)
        shown = max(req.eager_len, req.num_verified - req.num_prompt)
        if req.det.stream_policy is StreamPolicy.EAGER and margin >= req.tau and shown == num_out - 1:
            req.eager_len = num_out

    def _commit_replay(self, req: Request, seq: ScheduledSeq, out: SeqOutput) -> None:
        first = seq.start + 1            # index of the first speculated token
        speculated = req.tokens[first:seq.end]
        outcome = verifier.compare(speculated, out.tokens)
        st = req.stats
        st.verify_passes += 1
        st.replayed_tokens += seq.num_tokens
        if outcome.mismatch:
            # The trigger that caught it says how to tune: window or finish catches
            # mean a flip slipped past the margin test (tau too low).
            reason = req.pending_verify
            st.mismatches += 1
            st.add(f"mismatches_{reason}")
            st.rolled_back_tokens += outcome.rolled_back(len(speculated))
            self.mismatches.append((reason, req.spec_margins[outcome.accepted]))
        req.spec_margins.clear()
        del req.tokens[first + outcome.accepted:]
        req.tokens.append(outcome.next_token)
        req.eager_len = min(req.eager_len, first + outcome.accepted - req.num_prompt)
        req.pending_verify = None
        req.num_computed = len(req.tokens) - 1
        self.blocks.truncate(req.block_table, len(req.tokens))
        self._commit_upto(req, len(req.tokens))

    def _commit_upto(self, req: Request, upto: int) -> None:
        """Make tokens[num_verified:upto] final, one at a time, stopping at a finish."""
        for i in range(req.num_verified, upto):
            req.num_verified = i + 1
            reason, cut = self.stop.check(req, i)
            if reason is not None:
                del req.tokens[i + 1:]
                req.stop_text_len = cut
                self._finish(req, reason)
                return

    def _register_blocks(self, req: Request) -> None:
        ready = req.num_computed if req.mode is Mode.OFF else req.canonical_len
        upto = ready // self.blocks.block_size
        if upto > req.num_registered_blocks:
            self.blocks.register(req.block_table, req.tokens, req.num_registered_blocks, upto,
                                 canonical=req.mode is not Mode.OFF)
            req.num_registered_blocks = upto

    def _finish(self, req: Request, reason: FinishReason, remove: bool = True) -> None:
        if remove:
            self.running.remove(req)
        # The KV already written stays valid: cache it before the blocks go back,
        # so even a one-step request leaves its prompt for the next one.
        self._register_blocks(req)
        self.blocks.release_all(req.block_table)
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.pending_verify = None
        self.finished.append(req)

"""Continuous batching with chunked prefill, paged KV and preemption by recompute.

Pure Python, no torch. The scheduler plans: `schedule()` returns a StepPlan
(which token positions of which request to run, and on which plan, including the
route of each VERIFIED decode, chosen by a RoutePolicy); the runner returns one
SeqOutput per scheduled request; the verification stage (verification.py) turns
those into token updates and Outcomes; `update()` applies the Outcomes to what
the scheduler owns: KV blocks, num_computed and request status.

Token bookkeeping per request (tokens = prompt + output):
  num_computed   positions with KV written
  num_verified   leading tokens that are final (OFF: all of them)
  canonical_len  positions with invariant-plan KV (VERIFIED); == num_verified - 1
                 once decoding, so a verify replay starts there
A VERIFIED request decodes either speculatively on the fast plan (the gate may
then mark it `pending_verify`, and the next step replays [canonical_len,
len(tokens)) on the invariant plan) or directly on the invariant plan (the same
replay, planned at once). Rollback is truncating `tokens` and the block table.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable, Optional

from gateeng.engine.block_manager import BlockManager
from gateeng.config import DIRECT, KERNEL_PREFILL_WORK, SPECULATIVE
from gateeng.request import FinishReason, Mode, Request, Status
from gateeng.engine.route import RoutePolicy
from gateeng.engine.verification import Outcome, discard_speculation
from gateeng.step import PlanKind, ScheduledSeq, StepPlan


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 route: Optional[RoutePolicy] = None, max_verify_delay: int = 0, prefill_chunk: int = 0,
                 clock: Callable[[], float] = time.monotonic):
        self.blocks = blocks
        self.clock = clock   # stamps first admissions: the engine's clock, the one Request.arrival is on
        self.prefill_chunk = prefill_chunk   # 0 = no cap beyond the token budget
        self._prefill_left = 0
        # A margin-triggered replay may wait this many steps for an invariant pass to
        # join (other replays, prefills, direct decodes), speculating meanwhile; window
        # and finish triggers never wait. Fewer, fuller invariant passes for a little
        # VERIFIED latency.
        self.max_verify_delay = max_verify_delay
        self.max_num_seqs = max_num_seqs
        self.token_budget = max_num_batched_tokens
        self.route = route or RoutePolicy()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []   # drained by the engine after each step
        # Requests admitted for the first time this step (their queue time ends, their
        # prompt's prefix-cache lookup counts); the engine takes them after each step.
        self.admitted: list[Request] = []
        self.num_preemptions = 0
        # False while a weight update waits for the running requests: nothing new
        # (nor a preempted request) joins the batch on the weights about to go.
        self.admitting = True

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
        decoding = sum(len(r.tokens) - r.num_computed <= 1 or bool(r.pending_verify) for r in self.running)
        # While requests decode, prefill at most max(prefill_chunk, their number) positions:
        # a step's cost grows with its rows, and each decode in it waits for them. Scaling
        # with the decodes keeps admission going at high concurrency (a full batch admits
        # about as many prompt positions per step as it decodes tokens).
        self._prefill_left = max(self.prefill_chunk, decoding) if self.prefill_chunk and decoding else budget
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            seq = self._next_chunk(req, budget)
            if seq is None:
                i += 1
                continue
            if self.reserve(req, seq.end):
                plan.seqs.append(seq)
                budget -= seq.num_tokens
                self._count_prefill(seq)
                i += 1
            else:
                # Out of KV blocks: recompute-preempt the newest request (maybe this one).
                victim = self.running[-1]
                self._preempt(victim)
        while self.admitting and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            self._match_prefix(req)
            seq = self._next_chunk(req, budget)
            if seq is None or not self.reserve(req, seq.end):
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
            if req.first_scheduled_time is None:   # a preempted request comes back: not a new admission
                req.first_scheduled_time = self.clock()
                self.admitted.append(req)
            self.running.append(req)
            plan.seqs.append(seq)
            budget -= seq.num_tokens
            self._count_prefill(seq)
        self._choose_routes(plan, budget)
        return plan

    def _choose_routes(self, plan: StepPlan, budget: int) -> None:
        """Move the VERIFIED decodes the route policy picks onto the invariant plan,
        then, if the step has an invariant pass, the waiting replays and the OFF
        sequences the policy picks. A direct decode replays the request's unverified
        tokens too, so it needs len(tokens) - canonical_len rows (its KV blocks are
        already reserved)."""
        spec = [i for i, s in enumerate(plan.seqs) if s.route == SPECULATIVE]
        waiting = [i for i in spec if plan.seqs[i].request.pending_verify]   # replays that wait
        idx = [i for i in spec if not plan.seqs[i].request.pending_verify]
        fast = sum(s.num_tokens for s in plan.seqs if s.kind is PlanKind.FAST)
        inv = sum(s.num_tokens for s in plan.seqs if s.kind is PlanKind.INVARIANT)
        rows = [self._replay_rows(i, plan) for i in idx]
        waiting_rows = tuple(self._replay_rows(i, plan) for i in waiting)
        # OFF sequences on the fast plan that may join an invariant pass, fewest rows first
        # (decodes, then prefill chunks both plans attend alike): the order they would move in.
        off = sorted((i for i, s in enumerate(plan.seqs) if s.kind is PlanKind.FAST and s.request.mode is Mode.OFF
                      and s.num_tokens * s.end <= KERNEL_PREFILL_WORK),
                     key=lambda i: plan.seqs[i].num_tokens)
        off_rows = tuple(plan.seqs[i].num_tokens for i in off)
        for i, r, direct in zip(idx, rows, self.route.choose(fast, inv, rows, budget, waiting_rows, off_rows)):
            if direct:
                inv += r
                budget -= r - 1
                self._to_replay(plan, i, DIRECT)
        # Waiting replays join any invariant pass this step has: it runs anyway.
        for i in waiting:
            extra = self._replay_rows(i, plan) - 1
            if inv and extra <= budget:
                budget -= extra
                inv += extra + 1
                self._to_replay(plan, i, None)
        # OFF decodes and prefill chunks may ride along on it too (they promise nothing
        # about the plan).
        fast = sum(s.num_tokens for s in plan.seqs if s.kind is PlanKind.FAST)
        for i in off[:self.route.off_to_move(fast, inv, off_rows)]:
            s = plan.seqs[i]
            plan.seqs[i] = ScheduledSeq.plan(s.request, s.start, s.end, PlanKind.INVARIANT)

    @staticmethod
    def _replay_rows(i: int, plan: StepPlan) -> int:
        req = plan.seqs[i].request
        return len(req.tokens) - req.canonical_len

    @staticmethod
    def _to_replay(plan: StepPlan, i: int, route: Optional[str]) -> None:
        req = plan.seqs[i].request
        plan.seqs[i] = ScheduledSeq.plan(req, req.canonical_len, len(req.tokens), PlanKind.INVARIANT,
                                         replay=True, route=route)

    def fits(self, num_tokens: int) -> bool:
        """Can a request of `num_tokens` positions ever run? The admission rule: a
        request that passes it is never dropped for lack of KV, since the scheduler
        can always preempt everything else to make room."""
        return self.blocks.blocks_needed(num_tokens) <= self.blocks.num_blocks

    def _next_chunk(self, req: Request, budget: int) -> Optional[ScheduledSeq]:
        if req.pending_verify and (req.replay_due or req.pending_age >= self.max_verify_delay):
            start, end = req.canonical_len, len(req.tokens)
            if end - start > budget:
                return None   # replays are not split; next step
            return ScheduledSeq.plan(req, start, end, PlanKind.INVARIANT, replay=True)
        start = req.num_computed
        end = min(len(req.tokens), start + budget)
        if end - start > 1:                 # a prefill chunk
            end = min(end, start + self._prefill_left)
            if end <= start:
                return None                 # this step's prefill share is spent
        if req.mode is Mode.REFERENCE:
            kind = PlanKind.INVARIANT
        elif req.mode is Mode.VERIFIED and start < req.prefill_target:
            kind = PlanKind.INVARIANT   # prompt (or recompute) KV is canonical from the start
        else:
            kind = PlanKind.FAST
        return ScheduledSeq.plan(req, start, end, kind)

    def _count_prefill(self, seq: ScheduledSeq) -> None:
        if not seq.replay and seq.num_tokens > 1:
            self._prefill_left -= seq.num_tokens

    def reserve(self, req: Request, end: int) -> bool:
        """Blocks for positions [0, end) of `req`, from the free list; False (and
        nothing taken) when it cannot cover them."""
        need = self.blocks.blocks_needed(end) - len(req.block_table)
        if need > self.blocks.num_free:
            return False
        for _ in range(need):
            req.block_table.append(self.blocks.allocate())
        return True

    def _match_prefix(self, req: Request) -> None:
        bs = self.blocks.block_size
        # Leave at least one position to compute: its logits give the next token.
        max_blocks = (len(req.tokens) - 1) // bs if self.looks_up(req) else 0
        matched = self.blocks.match_prefix(req.tokens, max_blocks, canonical_only=req.mode is not Mode.OFF)
        req.block_table = matched
        req.num_computed = len(matched) * bs
        req.num_registered_blocks = len(matched)
        req.prefill_target = len(req.tokens)
        if req.num_preemptions == 0:
            req.num_cached_tokens = min(req.num_computed, req.num_prompt)

    def take_admitted(self) -> list:
        """The requests admitted for the first time since the last call, in order."""
        admitted, self.admitted = self.admitted, []
        return admitted

    def looks_up(self, req: Request) -> bool:
        """Whether the prefix cache may serve `req`: it is on, and the request asks for no
        prompt logprobs (those need every prompt position computed)."""
        return self.blocks.enable_prefix_caching and req.params.prompt_logprobs is None

    def _unmatch(self, req: Request) -> None:
        self.blocks.release_all(req.block_table)
        req.num_computed = 0
        req.num_registered_blocks = 0

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._unmatch(req)
        discard_speculation(req)   # the recompute re-derives the speculated tokens
        req.num_preemptions += 1
        req.status = Status.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- update ------------------------------------------------------------
    def update(self, outcomes: list[Outcome]) -> None:
        """Apply the verification stage's Outcomes (after it updated the tokens)."""
        for o in outcomes:
            req = o.request
            req.num_computed = o.num_computed
            if o.rolled_back:
                self.blocks.truncate(req.block_table, len(req.tokens))
            if o.finish is not None:
                self._finish(req, o.finish)
            else:
                self._register_blocks(req)

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

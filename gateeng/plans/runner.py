"""ModelRunner: turns a StepPlan into rows, runs each plan's forward, samples.

It reads requests and never writes them; the scheduler applies what it returns.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from gateeng.plans import sampler
from gateeng.plans.generic import FastPlan, InvariantPlan
from gateeng.plans.head import choose
from gateeng.plans.rows import Rows
from gateeng.step import PlanKind, SeqOutput, StepPlan

if TYPE_CHECKING:   # the model calls the plans' ops, so compute names it only for types
    from gateeng.model.llama import KVCache, LlamaModel


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVCache, fast: FastPlan, invariant: InvariantPlan,
                 sample=sampler.sample, logprobs=sampler.logprobs):
        self.model = model
        self.sample = sample
        self.logprobs = logprobs
        self.kv = kv
        self.plans = {PlanKind.FAST: fast, PlanKind.INVARIANT: invariant}
        self.last_seconds: dict = {}   # wall time per plan in the last step (metrics)

    def run(self, step: StepPlan) -> dict:
        outputs = {}
        self.last_seconds = {}
        for kind, plan in self.plans.items():
            seqs = step.of_kind(kind)
            if not seqs:
                continue
            t0 = time.perf_counter()
            rows, specs, owners, prompt = self._rows(seqs)
            router = None
            if self.model.cfg.moe is None:
                hidden = plan.hidden(self.model, self.kv, rows)
            else:   # (a mixture of experts runs on the CPU plans only: plans.factory)
                hidden, router = plan.hidden_and_router(self.model, self.kv, rows)
            n = len(rows.sample_rows)
            tokens, margins = choose(plan, self.model, hidden[:n], specs, self.sample)
            entries, prompt_entries = self._logprobs(plan, hidden, specs, tokens, prompt)
            routers = router.tolist() if router is not None else [None] * n
            per_request = {seq.request.request_id: ([], [], [], []) for seq in seqs}
            for i, (owner, tok, mar, rm) in enumerate(zip(owners, tokens, margins, routers)):
                per_request[owner][0].append(tok)
                per_request[owner][1].append(mar)
                if entries[i] is not None:
                    per_request[owner][2].append(entries[i])
                if rm is not None:
                    per_request[owner][3].append(rm)
            for rid, (toks, mars, lps, rms) in per_request.items():
                outputs[rid] = SeqOutput(tuple(toks), tuple(mars), tuple(lps), prompt_entries.get(rid, ()),
                                         tuple(rms))
            self.last_seconds[kind] = time.perf_counter() - t0
        return outputs

    def _logprobs(self, plan, hidden, specs, tokens, prompt) -> tuple[list, dict]:
        """A sampler.Logprobs per sample row whose request asked for them (else None),
        and per request those of the prompt tokens its extra rows predict; all from
        one call of the plan's full float32 lm_head over just those rows."""
        wanted = [i for i, spec in enumerate(specs) if spec.params.logprobs is not None]
        out, by_request = [None] * len(specs), {}
        if not wanted and not prompt:
            return out, by_request
        n = len(specs)   # hidden holds the sample rows, then the extra rows
        full = plan.full_logits(self.model, hidden[wanted + list(range(n, n + len(prompt)))])
        for j, i in enumerate(wanted):
            out[i] = self.logprobs(full[j], specs[i].params, tokens[i], specs[i].params.logprobs)
        for j, (rid, params, token) in enumerate(prompt, start=len(wanted)):
            by_request.setdefault(rid, []).append(self.logprobs(full[j], params, token, params.prompt_logprobs))
        return out, {rid: tuple(v) for rid, v in by_request.items()}

    def _rows(self, seqs):
        """The step's rows; sampler specs and owners per sample row; and per extra row
        (a prompt position whose next prompt token's logprob is wanted) its owner,
        params and that token."""
        bs = self.kv.block_size
        rows = Rows([], [], [], [], [])
        specs, owners, prompt = [], [], []
        for seq in seqs:
            req = seq.request
            first = rows.add_chunk(req.tokens[seq.start:seq.end], seq.start, req.block_table, bs)
            for off in seq.sample_rows:
                rows.sample_rows.append(first + off)
                specs.append(sampler.RowSpec(req.params, req.seed, seq.start + off + 1))
                rows.greedy.append(req.params.greedy)
                owners.append(req.request_id)
            if req.params.prompt_logprobs is not None:
                # Row p predicts prompt token p + 1; positions already recorded (before a
                # preemption's recompute) are not asked again.
                for p in range(max(seq.start, len(req.prompt_logprobs)), min(seq.end, req.num_prompt - 1)):
                    rows.extra_rows.append(first + p - seq.start)
                    prompt.append((req.request_id, req.params, req.tokens[p + 1]))
        return rows, specs, owners, prompt

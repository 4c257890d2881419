"""ModelRunner: turns a StepPlan into rows, runs each plan's forward, samples.

It reads requests and never writes them; the scheduler applies what it returns.
"""
from __future__ import annotations

import time

from gateeng import sampler
from gateeng.model import KVCache, LlamaModel
from gateeng.plan import FastPlan, InvariantPlan, Rows
from gateeng.scheduler import Kind, SeqOutput, StepPlan


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVCache, fast: FastPlan, invariant: InvariantPlan,
                 sample=sampler.sample):
        self.model = model
        self.sample = sample
        self.kv = kv
        self.plans = {Kind.FAST: fast, Kind.INVARIANT: invariant}
        self.last_seconds: dict = {}   # wall time per plan in the last step (metrics)

    def run(self, step: StepPlan) -> dict:
        outputs = {}
        self.last_seconds = {}
        for kind, plan in self.plans.items():
            seqs = step.of_kind(kind)
            if not seqs:
                continue
            t0 = time.perf_counter()
            rows, specs, owners = self._rows(seqs)
            logits = plan.logits(self.model, self.kv, rows)
            tokens, margins = self.sample(logits, specs)
            per_request = {seq.request.request_id: ([], []) for seq in seqs}
            for owner, tok, mar in zip(owners, tokens, margins):
                per_request[owner][0].append(tok)
                per_request[owner][1].append(mar)
            for rid, (toks, mars) in per_request.items():
                outputs[rid] = SeqOutput(tuple(toks), tuple(mars))
            self.last_seconds[kind] = time.perf_counter() - t0
        return outputs

    def _rows(self, seqs):
        bs = self.kv.block_size
        rows = Rows([], [], [], [], [])
        specs, owners = [], []
        for seq in seqs:
            req = seq.request
            table = req.block_table
            first = len(rows)
            for p in range(seq.start, seq.end):
                rows.input_ids.append(req.tokens[p])
                rows.positions.append(p)
                rows.slots.append(table[p // bs] * bs + p % bs)
            rows.seqs.append((first, len(rows), table))
            for off in seq.sample_rows:
                rows.sample_rows.append(first + off)
                specs.append(sampler.RowSpec(req.params, req.seed, seq.start + off + 1))
                rows.greedy.append(req.params.greedy)
                owners.append(req.request_id)
        return rows, specs, owners

"""Scripted stand-ins for the model runner, so the scheduler, gate and commit logic
can be tested without a model."""
from __future__ import annotations

from gateeng.step import PlanKind, SeqOutput, StepPlan

VOCAB = 50
EOS = 49


def truth(tokens: list) -> int:
    """The 'canonical' next token after `tokens` (never EOS by itself)."""
    return (sum(tokens) * 7 + len(tokens) * 3) % (VOCAB - 2)


class FakeRunner:
    """Invariant rows get truth(); fast rows get truth() unless `script` says otherwise.

    script: {(request_id, output_index): (token, margin)} overrides the fast path's
    choice for that output position; default fast margin is `margin`.
    """

    def __init__(self, script=None, margin=10.0, invariant_override=None):
        self.script = script or {}
        self.margin = margin
        self.invariant_override = invariant_override or {}
        self.calls = {PlanKind.FAST: 0, PlanKind.INVARIANT: 0}

    def run(self, plan: StepPlan) -> dict:
        out = {}
        for seq in plan.seqs:
            req = seq.request
            self.calls[seq.kind] += 1
            toks, margins = [], []
            for off in seq.sample_rows:
                pos = seq.start + off + 1          # index of the token being chosen
                ctx = req.tokens[:pos]
                tok, mar = truth(ctx), self.margin
                out_idx = pos - req.num_prompt
                if seq.kind is PlanKind.FAST and (req.request_id, out_idx) in self.script:
                    tok, mar = self.script[(req.request_id, out_idx)]
                if seq.kind is PlanKind.INVARIANT and (req.request_id, out_idx) in self.invariant_override:
                    tok = self.invariant_override[(req.request_id, out_idx)]
                toks.append(tok)
                margins.append(mar)
            out[req.request_id] = SeqOutput(tuple(toks), tuple(margins))
        return out


def reference_output(prompt: list, max_tokens: int, overrides=None, rid="r") -> list:
    tokens = list(prompt)
    out = []
    for i in range(max_tokens):
        tok = (overrides or {}).get((rid, i), truth(tokens))
        tokens.append(tok)
        out.append(tok)
        if tok == EOS:
            break
    return out

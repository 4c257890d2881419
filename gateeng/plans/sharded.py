"""ShardedPlan: the driver's plan at tensor-parallel size > 1.

It wraps the plan that runs the driver's own shard (rank 0). Each forward and
each logits call is first announced to the other ranks (`command`: a context
manager that broadcasts the message and holds the group for the collectives that
follow), which then run the same call on their shards (engine.tp_processes).
Logits are always the dense float32 ones, gathered over the vocabulary
(plans.collectives.vocab_logits), so the driver chooses every token from the same
values one device would have, by the same rule: greedy ties and the seeded
choice are as at size 1. Every other attribute is the wrapped plan's.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from gateeng.plans.collectives import vocab_logits
from gateeng.plans.rows import Rows
from gateeng.step import PlanKind

HIDDEN, LOGITS = "hidden", "logits"   # the messages a rank runs (engine.tp_processes)


class ShardedPlan:
    sparse_greedy = False   # dense logits for every row: no candidate search over a shard

    def __init__(self, inner, kind: PlanKind, command):
        self.inner = inner
        self.kind = kind
        self._command = command

    def __getattr__(self, name):   # only for what this class does not define
        return getattr(self.inner, name)

    @torch.inference_mode()
    def hidden(self, model, kv, rows: Rows) -> torch.Tensor:
        with self._command((HIDDEN, self.kind, rows)):
            return self.inner.hidden(model, kv, rows)

    @torch.inference_mode()
    def hidden_and_router(self, model, kv, rows: Rows) -> tuple:
        """hidden's result and a mixture of experts' router margins (the driver's: every
        rank's forward routes as the driver's does, model.shard)."""
        with self._command((HIDDEN, self.kind, rows)):
            return self.inner.hidden_and_router(model, kv, rows)

    @torch.inference_mode()
    def full_logits(self, model, hidden: torch.Tensor) -> torch.Tensor:
        with self._command((LOGITS, self.kind, hidden)):
            return vocab_logits(self.inner, model, hidden)

    def choice_logits(self, model, hidden: torch.Tensor, greedy: list) -> torch.Tensor:
        return self.full_logits(model, hidden)

    def logits(self, model, kv, rows: Rows) -> torch.Tensor:
        return self.choice_logits(model, self.hidden(model, kv, rows), rows.greedy)


def announcing(plans, command):
    """`plans` (plans.factory.Plans of the driver's shard) with both the fast and the
    invariant plan announcing their calls through `command`."""
    return replace(plans, fast=ShardedPlan(plans.fast, PlanKind.FAST, command),
                   invariant=ShardedPlan(plans.invariant, PlanKind.INVARIANT, command))


def run(message, plans: dict, model, kv) -> None:
    """A non-driver rank's share of one announced call: the same forward or logits
    call on its shard (the driver keeps the results)."""
    what, kind, arg = message
    plan = plans[kind]
    with torch.inference_mode():
        if what == HIDDEN:
            plan.hidden(model, kv, arg)
        elif what == LOGITS:
            vocab_logits(plan, model, arg)
        else:
            raise ValueError(f"unknown tensor-parallel message {what!r}")

"""Token choice and margin, the same on both plans.

Greedy: argmax of the logits (ties go to the lowest id). Otherwise: argmax of
logits/T (after top-k / top-p filtering) plus Gumbel noise hashed from
(seed, absolute position, vocab id), so a seed names the same tokens whatever the
batch. The margin is top-1 minus top-2 of exactly the scores that are argmaxed.
Non-greedy rows are handled one at a time at shape [vocab].

Two arithmetics, one semantics: `Sampler(ops)` computes every step with the
reference kernels (plans.reference_ops: kernels/SPEC.md's exp, log, sums and
Gumbel noise, the same bits on every machine), which both plans use wherever the
reference serves; `sample` and `logprobs` are torch's, for where it does not (a
float32 model, or no reference build), whose transcendental ops are torch's and
stay at a fixed shape.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gateeng.kernels import fixed_order as ref
from gateeng.request import SamplingParams


@dataclass(frozen=True)
class RowSpec:
    params: SamplingParams
    seed: int
    position: int   # index of the token being chosen (tokens[position])


@dataclass(frozen=True)
class Logprobs:
    """A token's log-probability and the top alternatives at its position, on the
    distribution the request samples from (see `logprobs`)."""
    token: int
    logprob: float
    top: tuple          # ((token id, logprob), ...), most likely first


def filter_top_k_top_p(scores: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True, stable=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) > top_p   # the top token always stays
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores


def sample(logits: torch.Tensor, specs: list) -> tuple[list, list]:
    """logits: float32 [rows, vocab]. Returns (tokens, margins) as Python lists."""
    n = logits.shape[0]
    tokens, margins = [0] * n, [0.0] * n
    greedy = [i for i, s in enumerate(specs) if s.params.greedy]
    if greedy:
        tok, mar = ref.argmax_margin(logits[greedy])
        for j, i in enumerate(greedy):
            tokens[i], margins[i] = int(tok[j]), float(mar[j])
    for i, s in enumerate(specs):
        if s.params.greedy:
            continue
        p = s.params
        scores = filter_top_k_top_p(logits[i] / p.temperature, p.top_k, p.top_p)
        scores = scores + ref.gumbel_noise(s.seed, s.position, scores.shape[-1]).to(scores.device)
        tok, mar = ref.argmax_margin(scores)
        tokens[i], margins[i] = int(tok), float(mar)
    return tokens, margins


def _top(lp: torch.Tensor, token: int, k: int) -> Logprobs:
    """The token's log-probability and the k most likely ids (lower id first among ties)."""
    top = ()
    if k:
        values, ids = torch.sort(lp, descending=True, stable=True)
        top = tuple((int(i), float(v)) for i, v in zip(ids[:k].tolist(), values[:k].tolist()))
    return Logprobs(int(token), float(lp[token]), top)


class Sampler:
    """sample and logprobs on the reference kernels `ops` (plans.reference_ops): every
    binary32 step is kernels/SPEC.md's ("sampling", "logprobs")."""

    def __init__(self, ops):
        self.ops = ops

    def scores(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """The row's scores: logits / T, top-k, top-p (dropped ids -inf)."""
        return self.ops.sample_scores(logits.float().contiguous(), params.temperature, params.top_k, params.top_p)

    def sample(self, logits: torch.Tensor, specs: list) -> tuple[list, list]:
        n = logits.shape[0]
        tokens, margins = [0] * n, [0.0] * n
        greedy = [i for i, s in enumerate(specs) if s.params.greedy]
        if greedy:
            tok, mar = self.ops.argmax_margin(logits[greedy].float().contiguous())
            for j, i in enumerate(greedy):
                tokens[i], margins[i] = int(tok[j]), float(mar[j])
        for i, s in enumerate(specs):
            if s.params.greedy:
                continue
            scores = self.scores(logits[i], s.params)
            noisy = self.ops.add_f32(scores, self.ops.gumbel(ref.row_key(s.seed, s.position), scores.shape[-1]))
            tok, mar = self.ops.argmax_margin(noisy[None])
            tokens[i], margins[i] = int(tok[0]), float(mar[0])
        return tokens, margins

    def logprobs(self, full_logits: torch.Tensor, params: SamplingParams, token: int, k: int) -> Logprobs:
        scores = full_logits.float().contiguous() if params.greedy else self.scores(full_logits, params)
        return _top(self.ops.log_softmax(scores), token, k)


def logprobs(full_logits: torch.Tensor, params: SamplingParams, token: int, k: int) -> Logprobs:
    """Log-probabilities on the distribution the request samples from:
    log_softmax(logits / T) over the tokens top-k and top-p keep (the others get
    -inf), where T is the temperature, or 1 for a greedy request (the distribution
    whose argmax greedy takes, left untruncated). One row at a time at shape
    [vocab], from the plan's full float32 logits, so a VERIFIED row's values are as
    batch-invariant as its token."""
    if params.greedy:
        scores = full_logits
    else:
        scores = filter_top_k_top_p(full_logits / params.temperature, params.top_k, params.top_p)
    return _top(torch.log_softmax(scores, dim=-1), token, k)

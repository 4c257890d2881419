"""The lm_head and the token choice: greedy rows by an exact float32 top-2 over
the bf16 logits' candidates (greedy_top2 / greedy_logits), sampled rows through
the plan's dense logits and the sampler (`choose`). Both plans use it; a plan
passes its own matmul for the candidate head."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from gateeng.kernels import fixed_order as ref
from gateeng.plans import packing


def float_logits(plan, model, hidden: torch.Tensor) -> torch.Tensor:
    """Logits in float32, by `plan`'s matmul over the float32 lm_head (from the
    dtype-rounded hidden state and weights): bf16 logits are so coarse that
    top-1/top-2 ties are common and the margin would say little."""
    return plan.linear(hidden.float(), packing.lm_head_f32(model))


def _greedy_bound(model, hidden: torch.Tensor, largest: torch.Tensor) -> torch.Tensor:
    """[rows] bound on |bf16 logit - float32 logit| for every id (see greedy_logits),
    given each row's largest |bf16 logit|."""
    k = hidden.shape[-1]
    accumulation = hidden.float().norm(dim=-1) * (packing.lm_head_max_norm(model) * k * 2.0 ** -23)
    return largest * 2.0 ** -7 + accumulation + 1e-3


def int8_logit_bound(hidden: torch.Tensor, abs_sum: float) -> torch.Tensor:
    """[rows] float32 bound on |int8 logit - reference logit| over every id: the int8
    logit is cpu_ops' int8 kernels' float32 output on a quantized lm_head whose values
    are w = d * q (packing.int8_head), the reference logit the spec's qdot (kernels/
    SPEC.md), for bf16 rows x of K values and `abs_sum` at least every row's sum of
    |w| (packing.lm_head_abs_sum). With X = max |x| over the row:

    - the kernels' inputs (cpu_ops.cpp quantize_rows): per block of 32 values, the
      scale amax / 127 and the integer nearbyint(x * (127 / amax)), each rounded once,
      so scale * integer is within X (1/254 + 2^-20) of x, and the exact sum of those
      times w within X (1/254 + 2^-20) abs_sum of the exact x . w;
    - their binary32 steps: each block's integer sum exact (or rounded once), times
      d * scale, added into the column's sum block after block (at most 2 K/32 + 8
      roundings on any term's way, counting generously);
    - the reference's: each product exact, a (sub-)block's chain of at most 32 steps,
      its scale, at most 16 ceil(K/4096) or ceil(K/512) lane additions, the tree's 4
      levels (at most 64 + K/16);
    each rounding at most 2^-24 of what it rounds, so both sums lie within
    1.03 (72 + K/8) 2^-24 X abs_sum of the exact ones; a flushed or denormal result
    errs by at most 2^-126, and a few thousand of them stay below 2^-100.

    The caller makes sure no block of x has 0 < amax < 2^-100 (its scale would not be
    that of the bound) and every x is finite."""
    k = hidden.shape[-1]
    c = 1 / 254 + 2.0 ** -20 + 1.03 * (72 + k / 8) * 2.0 ** -24
    bound = hidden.double().abs().amax(dim=-1) * (abs_sum * c) + 2.0 ** -100
    return (bound * (1 + 2.0 ** -20)).float()   # rounded to binary32 above the float64 value


def greedy_logits(model, hidden: torch.Tensor, head=None) -> torch.Tensor:
    """bf16 logits, with the exact float32 value written over every candidate for the
    top-2. A greedy row only needs its top-1 and top-2 (token and margin).

    The bf16 lm_head (float32 accumulation, output rounded to 8 bits) errs by at
    most 2^-9 |logit| (rounding) plus K * 2^-24 * sum_i |h_i w_i| (accumulation),
    and the second term is at most K * 2^-24 * ||h|| * max_v ||w_v|| (Cauchy-Schwarz).
    Every id whose bf16 logit is within twice a bound above both of the bf16
    second-best gets its exact logit, so both exact top-2 ids are among them and
    every other id keeps a bf16 value below them: the sampler's argmax and margin
    are the float32 ones. An exact logit is one float32 dot product per (row, id),
    `(h * w).sum(-1)`: its bits depend on that row and id only (the start-up
    self-check proves it), so the result does not depend on the batch either.
    (Logprobs over the whole row need the full float32 lm_head.) `head` computes
    the bf16 logits: the plain weight by default (the invariant plan, which
    multiplies only plain weights); the fast plan passes its packed copy."""
    logits = _bf16_logits(model, hidden, head).float()
    bound = _greedy_bound(model, hidden, logits.abs().amax(dim=-1))[:, None]
    second = torch.topk(logits, 2, dim=-1).values[:, 1:]
    r, v = torch.nonzero(logits >= second - 2 * bound, as_tuple=True)
    logits.index_put_((r, v), exact_logits(hidden, packing.lm_head_f32(model), r, v))
    return logits


def _bf16_logits(model, hidden: torch.Tensor, head) -> torch.Tensor:
    return head(hidden) if head is not None else F.linear(hidden, model.lm_head)


# Vocabulary ids per chunk in greedy_top2's candidate search.
TOP2_CHUNK = 128


def greedy_top2(model, hidden: torch.Tensor, head=None, kernels=None) -> tuple[list, list]:
    """The argmax and the margin the sampler would take from greedy_logits (the
    float32 top-1 id, lowest among ties, and top-1 minus top-2), without building
    or scanning a dense logit row more than the bf16 lm_head's output needs: on CPU,
    a full-vocabulary topk, compare or nonzero over 32 rows costs 1-3 ms each.

    The candidates are greedy_logits' set: with `kernels` (plans.cpu_ops), one C++
    pass over each row's bf16 logits finds them; otherwise the logits are cut into
    chunks of TOP2_CHUNK ids, a row's two largest values lie in the two chunks with
    the largest maxima, so the bf16 second-best comes from those 256 values, and the
    candidates are searched only in chunks whose maximum reaches the threshold.
    Only candidates get exact logits, and every other id is below the exact top-2,
    so the result equals greedy_logits' followed by the sampler's, bit for bit.
    Returns Python lists (tokens, margins). `head` as in greedy_logits."""
    bf = _bf16_logits(model, hidden, head)
    rows, vocab = bf.shape
    if kernels is not None and bf.dtype == torch.bfloat16 and bf.device.type == "cpu" and vocab >= 2:
        # threshold = second - 2 * bound(largest): the kernel adds the largest-logit term
        slack = 2 * _greedy_bound(model, hidden, torch.zeros(rows, device=bf.device))
        r, ids, ok = kernels.greedy_candidates(bf, slack.float())
        found = bool(ok)
    else:
        r, ids = _chunked_candidates(model, hidden, bf)
        found = True
    if found:
        exact = exact_logits(hidden, packing.lm_head_f32(model), r, ids)
        neg = torch.full((rows,), float("-inf"), device=bf.device)
        top = neg.scatter_reduce(0, r, exact, "amax")
        is_top = exact == top[r]
        token = torch.full((rows,), vocab, dtype=torch.int64, device=bf.device).scatter_reduce(
            0, r[is_top], ids[is_top], "amin")
        rest = ids != token[r]
        margin = top - neg.scatter_reduce(0, r[rest], exact[rest], "amax")
        found = bool((torch.bincount(r, minlength=rows) >= 2).all()) and bool(torch.isfinite(margin).all())
    if not found:
        # Non-finite logits: the dense path decides as it always has.
        tok, mar = ref.argmax_margin(greedy_logits(model, hidden, head))
        return tok.tolist(), mar.tolist()
    return token.tolist(), margin.tolist()


def _chunked_candidates(model, hidden: torch.Tensor, bf: torch.Tensor):
    """(rows, ids) of greedy_logits' candidates, from the bf16 logits in chunks."""
    rows, vocab = bf.shape
    chunk = TOP2_CHUNK if vocab >= 2 * TOP2_CHUNK else -(-vocab // 2)
    nchunks = -(-vocab // chunk)
    logits = torch.empty(rows, nchunks * chunk, dtype=torch.float32, device=bf.device)
    logits[:, :vocab] = bf
    logits[:, vocab:] = float("-inf")
    chunks = logits.view(rows, nchunks, chunk)
    cmax = chunks.amax(dim=-1)
    largest = torch.maximum(cmax.amax(dim=-1), -logits[:, :vocab].amin(dim=-1))   # max |logit|, no abs() pass
    threshold = _second_largest(chunks, cmax) - 2 * _greedy_bound(model, hidden, largest)
    rr, cc = torch.nonzero(cmax >= threshold[:, None], as_tuple=True)
    j, off = torch.nonzero(chunks[rr, cc] >= threshold[rr, None], as_tuple=True)
    r, ids = rr[j], cc[j] * chunk + off
    keep = ids < vocab   # a non-finite threshold lets the -inf padding past the lm_head through
    return r[keep], ids[keep]


def _second_largest(chunks: torch.Tensor, cmax: torch.Tensor) -> torch.Tensor:
    """[rows] second-largest value of each row of chunks [rows, n, c] (n >= 2), given
    the chunk maxima cmax [rows, n]: it lies in the chunk holding the row's maximum
    or is the next chunk's maximum."""
    best2 = cmax.topk(2, dim=-1).indices
    pair = chunks.gather(1, best2[..., None].expand(-1, -1, chunks.shape[-1]))
    return pair.flatten(1).topk(2, dim=-1).values[:, 1]


def exact_logits(hidden: torch.Tensor, weight_f32: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """float32 logit of vocab id ids[i] for hidden row rows[i], one dot product each."""
    return (hidden.index_select(0, rows).float() * weight_f32.index_select(0, ids)).sum(-1)


def mixed_lm_head(model, hidden: torch.Tensor, greedy: list, full, head=None) -> torch.Tensor:
    """greedy_logits for greedy rows, `full` (float32 logits) for the others."""
    sampled = [i for i, g in enumerate(greedy) if not g]
    if not sampled:
        return greedy_logits(model, hidden, head)
    logits = torch.empty(hidden.shape[0], model.lm_head.shape[0], dtype=torch.float32, device=hidden.device)
    logits[sampled] = full(hidden[sampled])
    rows = [i for i, g in enumerate(greedy) if g]
    if rows:
        logits[rows] = greedy_logits(model, hidden[rows], head)
    return logits


def choose(plan, model, hidden: torch.Tensor, specs: list, sample) -> tuple[list, list]:
    """(tokens, margins) for the sample rows `hidden`, one sampler.RowSpec each.
    Greedy rows of a bf16 model take the plan's own greedy_choice, or else
    greedy_top2, where the plan allows it (`plan.sparse_greedy`; a plan without it
    takes the dense path); every other
    row goes through the plan's dense choice_logits and `sample`. Both give the
    tokens and margins `sample` would take from choice_logits."""
    greedy = [i for i, s in enumerate(specs) if s.params.greedy]
    if not greedy or not getattr(plan, "sparse_greedy", False) or model.dtype == torch.float32:
        return sample(plan.choice_logits(model, hidden, [s.params.greedy for s in specs]), specs)
    n = len(specs)
    tokens, margins = [0] * n, [0.0] * n
    rows = hidden if len(greedy) == n else hidden[greedy]
    own = getattr(plan, "greedy_choice", None)   # the reference's: candidates from the int8 logits
    tok, mar = (own(model, rows) if own is not None else
                greedy_top2(model, rows, plan.candidate_head(model), getattr(plan, "kernels", None)))
    for j, i in enumerate(greedy):
        tokens[i], margins[i] = tok[j], mar[j]
    sampled = [i for i in range(n) if not specs[i].params.greedy]
    if sampled:
        tok, mar = sample(plan.choice_logits(model, hidden[sampled], [False] * len(sampled)),
                          [specs[i] for i in sampled])
        for j, i in enumerate(sampled):
            tokens[i], margins[i] = tok[j], mar[j]
    return tokens, margins

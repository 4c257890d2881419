"""Kernel plans: how the model's reductions are computed for one forward.

FastPlan: ordinary torch ops at whatever shape the batch has (the batch can change
the bits: that is the phenomenon VERIFIED requests are protected from).

InvariantPlan: every reduction has a shape that does not depend on the batch.
Rows are processed in groups of exactly `rows` (padded), so each matmul, norm and
lm_head call has the same M; attention splits keys at fixed absolute positions.
A row's result then depends only on its token, its position and its sequence's
KV, which is what makes the canonical reference well defined.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from gateeng.kernels import reference as ref


@dataclass
class Rows:
    """The rows of one forward pass, as plain lists (built by the runner)."""
    input_ids: list
    positions: list
    slots: list
    seqs: list          # (row_start, row_end, block_table) per sequence, rows contiguous
    sample_rows: list   # rows whose logits are wanted, in order
    greedy: list = field(default_factory=list)   # per sample row; empty = none known greedy

    def __len__(self):
        return len(self.input_ids)


def _slot_tensor(block_table: list, length: int, block_size: int, device) -> torch.Tensor:
    blocks = torch.tensor(block_table, dtype=torch.int64, device=device)
    slots = (blocks[:, None] * block_size + torch.arange(block_size, device=device)).view(-1)
    return slots[:length]


def row_block_tables(tables: list, width: int) -> torch.Tensor:
    """[len(tables), width] block ids, one row per query row; zeros past a table's
    end (those keys are masked by position) and for padding rows (table None)."""
    out = torch.zeros(len(tables), width, dtype=torch.int64)
    for i, t in enumerate(tables):
        if t:
            t = t[:width]
            out[i, :len(t)] = torch.tensor(t, dtype=torch.int64)
    return out


@dataclass
class FastAttnMeta:
    prefill: list               # (row_start, row_end, key slots [ctx], mask [q, ctx])
    decode_rows: torch.Tensor   # [B] rows that are single-token decodes
    decode_slots: torch.Tensor  # [B, Lmax]
    decode_mask: torch.Tensor   # [B, Lmax]


class FastPlan:
    name = "fast"

    def __init__(self, logit_noise: float = 0.0):
        self.logit_noise = logit_noise   # test-only perturbation (provokes rollbacks)
        self._noise_gen = torch.Generator().manual_seed(1234)

    linear = staticmethod(F.linear)
    rms_norm = staticmethod(ref.rms_norm)

    def _meta(self, rows: Rows, block_size: int, dev) -> FastAttnMeta:
        prefill, dec_rows, dec_tables, dec_ctx = [], [], [], []
        for start, end, table in rows.seqs:
            ctx = rows.positions[end - 1] + 1
            if end - start == 1:
                dec_rows.append(start)
                dec_tables.append(table)
                dec_ctx.append(ctx)
            else:
                slots = _slot_tensor(table, ctx, block_size, dev)
                qpos = torch.tensor(rows.positions[start:end], device=dev)
                mask = torch.arange(ctx, device=dev)[None, :] <= qpos[:, None]
                prefill.append((start, end, slots, mask))
        # Decode rows: one padded [B, Lmax] slot matrix built in a few tensor ops.
        lmax = max(dec_ctx, default=0)
        width = -(-lmax // block_size)
        tables = row_block_tables(dec_tables, width)
        slots = (tables[:, :, None] * block_size + torch.arange(block_size)).view(len(dec_rows), width * block_size)[:, :lmax]
        mask = torch.arange(lmax)[None, :] < torch.tensor(dec_ctx, dtype=torch.int64)[:, None]
        return FastAttnMeta(prefill, torch.tensor(dec_rows, dtype=torch.int64, device=dev),
                            slots.contiguous().to(dev), mask.to(dev))

    def attention(self, q, k_cache, v_cache, meta: FastAttnMeta, scale: float):
        nb, bs, hkv, d = k_cache.shape
        kflat, vflat = k_cache.view(nb * bs, hkv, d), v_cache.view(nb * bs, hkv, d)
        out = torch.empty_like(q)
        # index_select, not advanced indexing: the same gather, an order of magnitude
        # cheaper on CPU.
        for start, end, slots, mask in meta.prefill:
            k = kflat.index_select(0, slots).transpose(0, 1)[None]
            v = vflat.index_select(0, slots).transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(q[start:end].transpose(0, 1)[None], k, v,
                                               attn_mask=mask, scale=scale, enable_gqa=True)
            out[start:end] = o[0].transpose(0, 1)
        if len(meta.decode_rows):
            out.index_copy_(0, meta.decode_rows, self._decode_attention(q.index_select(0, meta.decode_rows),
                                                                        kflat, vflat, meta, scale))
        return out

    @staticmethod
    def _decode_attention(q, kflat, vflat, meta: FastAttnMeta, scale: float):
        """One query row per sequence: two float32 batched matmuls over the padded
        context (cheaper than SDPA at q_len 1 on CPU). Query heads h*g..h*g+g-1 share
        KV head h (grouped-query attention)."""
        b, lmax = meta.decode_slots.shape
        hq, hkv, d = q.shape[1], kflat.shape[1], kflat.shape[2]
        flat = meta.decode_slots.view(-1)
        k = kflat.index_select(0, flat).view(b, lmax, hkv, d).permute(0, 2, 3, 1).float()   # [B, Hkv, D, L]
        v = vflat.index_select(0, flat).view(b, lmax, hkv, d).transpose(1, 2).float()       # [B, Hkv, L, D]
        scores = torch.matmul(q.view(b, hkv, hq // hkv, d).float(), k) * scale               # [B, Hkv, g, L]
        scores = scores.masked_fill(~meta.decode_mask[:, None, None, :], float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1), v).view(b, hq, d).to(q.dtype)

    @staticmethod
    def _lm_head(model, hidden: torch.Tensor, greedy: list) -> torch.Tensor:
        """float32 logits whose top-2 are exact for greedy rows, at a bf16 matmul's cost.

        A non-greedy row samples over the whole vocabulary: its logits are the
        float32 lm_head. A greedy row only needs its top-1 and top-2 (token and
        margin): the bf16 lm_head (fp32 accumulation, output rounded to 8 bits,
        so |error| <= 2^-9 |logit| plus a far smaller accumulation-order term)
        finds candidates, and every id whose bf16 logit is within twice a
        generous bound (2^-7 |max logit| + 1e-3) of the bf16 second-best gets its
        exact float32 logit. Both exact top-2 ids are then among them, and every
        other id keeps a bf16 value below them, so the sampler's argmax and margin
        are the float32 ones. (Logprobs over the whole row would need the full
        float32 lm_head.)"""
        if model.dtype == torch.float32 or not any(greedy):
            return model.logits(hidden, FastPlan)
        sampled = [i for i, g in enumerate(greedy) if not g]
        if not sampled:
            return FastPlan._greedy_logits(model, hidden)
        logits = torch.empty(hidden.shape[0], model.lm_head.shape[0], dtype=torch.float32, device=hidden.device)
        logits[sampled] = model.logits(hidden[sampled], FastPlan)
        rows = [i for i, g in enumerate(greedy) if g]
        logits[rows] = FastPlan._greedy_logits(model, hidden[rows])
        return logits

    @staticmethod
    def _greedy_logits(model, hidden: torch.Tensor) -> torch.Tensor:
        """bf16 logits, with the float32 value written over every candidate for the top-2."""
        logits = F.linear(hidden, model.lm_head).float()
        bound = logits.abs().amax(dim=-1, keepdim=True) * 2.0 ** -7 + 1e-3
        second = torch.topk(logits, 2, dim=-1).values[:, 1:]
        r, v = torch.nonzero(logits >= second - 2 * bound, as_tuple=True)
        exact = (hidden.index_select(0, r).float() * model.lm_head_f32.index_select(0, v)).sum(-1)
        logits.index_put_((r, v), exact)
        return logits

    @torch.inference_mode()
    def logits(self, model, kv, rows: Rows) -> torch.Tensor:
        dev = model.embed.device
        meta = self._meta(rows, kv.block_size, dev)
        hidden = model(torch.tensor(rows.input_ids, device=dev), torch.tensor(rows.positions, device=dev),
                       torch.tensor(rows.slots, device=dev), meta, kv, self)
        logits = self._lm_head(model, hidden[rows.sample_rows], rows.greedy)
        if self.logit_noise:
            logits += (torch.randn(logits.shape, generator=self._noise_gen) * self.logit_noise).to(logits.device)
        return logits


@dataclass
class InvariantAttnMeta:
    block_tables: torch.Tensor   # [R, W] per row
    positions: torch.Tensor      # [R]
    split: int


class InvariantPlan:
    name = "invariant"

    def __init__(self, rows: int = 16, split: int = 64):
        self.rows = rows
        self.split = split

    linear = staticmethod(ref.matmul)
    rms_norm = staticmethod(ref.rms_norm)

    def describe(self) -> str:
        """What the canonical bits depend on, besides weights, dtype and device kind."""
        return f"{self.name}(rows={self.rows},split={self.split})"

    def attention(self, q, k_cache, v_cache, meta: InvariantAttnMeta, scale: float):
        return ref.split_attention(q, k_cache, v_cache, meta.block_tables, meta.positions,
                                   meta.split, scale)

    @torch.inference_mode()
    def logits(self, model, kv, rows: Rows) -> torch.Tensor:
        """Run rows in groups of exactly `self.rows`; a sequence's rows stay in position
        order across groups, so each group's attention sees the KV the earlier ones wrote."""
        n, c, dev = len(rows), self.rows, model.embed.device
        row_table = [None] * n
        for start, end, table in rows.seqs:
            for r in range(start, end):
                row_table[r] = table
        wanted = set(rows.sample_rows)
        out = {}
        for g in range(0, n, c):
            idx = list(range(g, min(g + c, n)))
            pad = c - len(idx)
            ids = [rows.input_ids[r] for r in idx] + [0] * pad
            pos = [rows.positions[r] for r in idx] + [0] * pad
            slots = [rows.slots[r] for r in idx] + [-1] * pad
            width = max(p // kv.block_size + 1 for p in pos)
            tables = row_block_tables([row_table[r] for r in idx] + [None] * pad, width)
            pos_t = torch.tensor(pos, device=dev)
            meta = InvariantAttnMeta(tables.to(dev), pos_t, self.split)
            hidden = model(torch.tensor(ids, device=dev), pos_t, torch.tensor(slots, device=dev), meta, kv, self)
            logits = model.logits(hidden, self)   # the full group: fixed M
            for i, r in enumerate(idx):
                if r in wanted:
                    out[r] = logits[i]
        if not rows.sample_rows:
            return torch.zeros(0, model.cfg.vocab_size, device=dev)
        return torch.stack([out[r] for r in rows.sample_rows])

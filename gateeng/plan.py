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

from dataclasses import dataclass

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
        prefill, dec_rows, dec_slots = [], [], []
        for start, end, table in rows.seqs:
            ctx = rows.positions[end - 1] + 1
            slots = _slot_tensor(table, ctx, block_size, dev)
            if end - start == 1:
                dec_rows.append(start)
                dec_slots.append(slots)
            else:
                qpos = torch.tensor(rows.positions[start:end], device=dev)
                mask = torch.arange(ctx, device=dev)[None, :] <= qpos[:, None]
                prefill.append((start, end, slots, mask))
        lmax = max((len(s) for s in dec_slots), default=0)
        slots = torch.zeros(len(dec_rows), lmax, dtype=torch.int64, device=dev)
        mask = torch.zeros(len(dec_rows), lmax, dtype=torch.bool, device=dev)
        for i, s in enumerate(dec_slots):
            slots[i, :len(s)] = s
            mask[i, :len(s)] = True
        return FastAttnMeta(prefill, torch.tensor(dec_rows, dtype=torch.int64, device=dev), slots, mask)

    def attention(self, q, k_cache, v_cache, meta: FastAttnMeta, scale: float):
        nb, bs, hkv, d = k_cache.shape
        kflat, vflat = k_cache.view(nb * bs, hkv, d), v_cache.view(nb * bs, hkv, d)
        out = torch.empty_like(q)
        for start, end, slots, mask in meta.prefill:
            k = kflat[slots].transpose(0, 1)[None]
            v = vflat[slots].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(q[start:end].transpose(0, 1)[None], k, v,
                                               attn_mask=mask, scale=scale, enable_gqa=True)
            out[start:end] = o[0].transpose(0, 1)
        if len(meta.decode_rows):
            k = kflat[meta.decode_slots].transpose(1, 2)    # [B, Hkv, L, D]
            v = vflat[meta.decode_slots].transpose(1, 2)
            qd = q[meta.decode_rows][:, :, None, :]          # [B, H, 1, D]
            o = F.scaled_dot_product_attention(qd, k, v, attn_mask=meta.decode_mask[:, None, None, :],
                                               scale=scale, enable_gqa=True)
            out[meta.decode_rows] = o[:, :, 0, :]
        return out

    @torch.inference_mode()
    def logits(self, model, kv, rows: Rows) -> torch.Tensor:
        dev = model.embed.device
        meta = self._meta(rows, kv.block_size, dev)
        hidden = model(torch.tensor(rows.input_ids, device=dev), torch.tensor(rows.positions, device=dev),
                       torch.tensor(rows.slots, device=dev), meta, kv, self)
        logits = model.logits(hidden[rows.sample_rows], self)
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

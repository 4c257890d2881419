"""Tensor parallelism's shapes: which sizes a model admits, and each rank's slice of K.

The split is Megatron's (model.shard). q/k/v and gate/up (each expert's too) are
split by output columns, and so is the lm_head (by vocabulary rows). o and down (each
expert's too) are split by K: their input is the rank's own heads and MLP columns.
A row-parallel projection's slice of K must be whole blocks of the reference's dot
(kernels/SPEC.md, "Tensor parallelism"). Then the ranks' subtree sums
(linear_partial), combined by the tree's top levels (combine_partials), give the
bits of one device. Pure arithmetic on shapes: no process group, no model.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

from gateeng.config import ModelConfig

# The reference dot's blocks of K (SPEC.md, "dot"): the most ranks that can split it.
# kernels/ref_ops.cpp and kernels/triton_reference.py name it too; tests/test_one_owner.py
# holds the three and SPEC.md equal.
DOT_BLOCKS = 16
# What the dot's blocks are made of (SPEC.md): a bf16 weight's K in pairs, a quantized
# one's in GGUF blocks of 32 values (its lanes).
PAIR, QUANT_BLOCK = 2, 32   # (a K-quant's blocks are its super-blocks of 256: ref_ops.cpp qblock)


class KSlice(NamedTuple):
    """One rank's part of a dot over K values: elements [start, stop), the whole K's
    units (pairs, or a quantized weight's GGUF blocks) per block (`per`), and how many
    of the whole K's blocks it holds."""
    start: int
    stop: int
    per: int
    blocks: int


def k_slice(k: int, size: int, rank: int, unit: int = PAIR) -> KSlice:
    """Rank `rank` of `size`'s blocks of a dot over k values (k a multiple of `unit`:
    PAIR for a bf16 weight, QUANT_BLOCK for a quantized one; size a power of two up to
    16). Where k is a multiple of 16 units this is the even split [rank*k/size,
    (rank+1)*k/size); otherwise the last ranks may hold fewer units, or none."""
    if not _power_of_two(size) or size > DOT_BLOCKS or not 0 <= rank < size:
        raise ValueError(f"rank {rank} of size {size}: size must be a power of two up to {DOT_BLOCKS}")
    units = (k + unit - 1) // unit
    per = (units + DOT_BLOCKS - 1) // DOT_BLOCKS
    blocks = DOT_BLOCKS // size
    first, last = min(units, rank * blocks * per), min(units, (rank + 1) * blocks * per)
    return KSlice(unit * first, min(k, unit * last), per, blocks)


def refusal(cfg: ModelConfig, size: int) -> Optional[str]:
    """Why this model cannot run at this tensor-parallel size, or None if it can."""
    if not _power_of_two(size) or size > DOT_BLOCKS:
        return (f"tensor-parallel size {size} is not a power of two from 1 to {DOT_BLOCKS}: the reference's "
                f"dot splits K into {DOT_BLOCKS} blocks, and each rank must hold a whole subtree of them")
    if size == 1:
        return None
    # Heads that do not split evenly are not refused: attention is then whole on every
    # rank (model.shard), and o still splits on its K blocks. A mixture of experts splits
    # each expert as a plain MLP; its plain-MLP layers, where it has any, as a dense model's.
    moe = cfg.moe
    mlps = ()
    if moe is None or len(moe.sparse_layers) < cfg.num_layers:
        mlps += (("MLP", "intermediate_size", cfg.intermediate_size),)
    if moe is not None:
        mlps += (("expert MLP", "the experts' intermediate size", moe.intermediate_size),)
    for what, field, columns in mlps:
        if columns % size:
            return f"the model's {columns} {what} columns ({field}) do not split evenly over {size} ranks"
    for name, k in ((("attention output projection", cfg.num_heads * cfg.head_dim),)
                    + tuple((f"{what} down projection", columns) for what, _, columns in mlps)):
        if k % (2 * DOT_BLOCKS):
            return (f"the {name}'s K = {k} is not a multiple of {2 * DOT_BLOCKS}: an even split of it "
                    f"would not fall on the reference dot's block boundaries")
    return None


def _power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0

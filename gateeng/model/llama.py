"""Llama-family decoder (Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3, SmolLM) over a paged KV cache.

One model definition. How each reduction is computed (matmul, RMSNorm, attention)
is chosen by the plan object passed to `forward`, so the fast and invariant plans
share every weight and every elementwise step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Optional

import torch

from gateeng.config import ModelConfig
from gateeng.logs import log
from gateeng.model import rope
from gateeng.plans import cpu_linear, kernel_names


def _released(t: torch.Tensor) -> bool:
    """Whether release_plain_weights emptied t's storage."""
    return t.numel() > 0 and t.untyped_storage().nbytes() == 0


def _release(t: torch.Tensor) -> int:
    """Empty t's storage (its shape and dtype stay; a stray use fails loudly); the bytes freed."""
    freed = t.untyped_storage().nbytes()
    t.untyped_storage().resize_(0)
    return freed


@dataclass(frozen=True)
class QuantBlocks:
    """A Q8_0, Q4_0 or Q4_1 weight [N, K] as its integers and block scales (kernels/SPEC.md,
    "Quantized weights"), on any device: q int8 [N, K] (Q4_0's n - 8), d float16
    [N, K/32], m float16 [N, K/32] for Q4_1, else None."""
    q: torch.Tensor
    d: torch.Tensor
    m: Optional[torch.Tensor]


class KVCache:
    """Per layer, K and V as [num_blocks, block_size, num_kv_heads, head_dim]."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype, device):
        shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: "KVSlots") -> None:
        """Store the rows' K and V at their slots (padding rows store nothing)."""
        nb, bs = self.k.shape[1], self.k.shape[2]
        writers, real = slots.writers()
        if writers is not None:
            k, v = k.index_select(0, writers), v.index_select(0, writers)
        self.k[layer].view(nb * bs, *self.k.shape[3:]).index_copy_(0, real, k)
        self.v[layer].view(nb * bs, *self.v.shape[3:]).index_copy_(0, real, v)


class KVSlots:
    """One forward's cache slot per row; padding rows carry -1 and store nothing."""

    def __init__(self, slots: torch.Tensor):
        self.all = slots
        self._writers = None

    def writers(self):
        """(indices of the rows that store KV, their slots), or (None, all slots) when
        every row does; decided once per forward."""
        if self._writers is None:
            keep = self.all >= 0
            if bool(keep.all()):
                self._writers = (None, self.all)
            else:
                rows = keep.nonzero().view(-1)
                self._writers = (rows, self.all.index_select(0, rows))
        return self._writers


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's weights, as the forward reads them (LlamaModel.step_layers)."""
    qkv: torch.Tensor
    qkv_bias: Optional[torch.Tensor]
    q_norm: Optional[torch.Tensor]
    k_norm: Optional[torch.Tensor]
    o: torch.Tensor
    o_bias: Optional[torch.Tensor]
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    next_norm: torch.Tensor   # the norm after this layer's MLP


class LlamaModel(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, dtype=torch.bfloat16, device="cpu"):
        super().__init__()
        self.cfg = cfg
        self.tp = None   # a tensor-parallel shard's row-parallel sums (model.shard.RowParallel)
        h, d = cfg.hidden_size, cfg.head_dim
        qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * d

        def p(*shape):
            return torch.nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

        self.embed = p(cfg.vocab_size, h)
        self.layers = torch.nn.ModuleList()
        for _ in range(cfg.num_layers):
            layer = torch.nn.Module()
            layer.input_norm = p(h)
            layer.qkv = p(qkv, h)                         # q, k, v stacked
            layer.qkv_bias = p(qkv) if cfg.qkv_bias else None
            layer.o = p(h, cfg.num_heads * d)
            layer.o_bias = p(h) if cfg.o_bias else None
            layer.q_norm = p(d) if cfg.qk_norm else None
            layer.k_norm = p(d) if cfg.qk_norm else None
            layer.post_norm = p(h)
            layer.gate_up = p(2 * cfg.intermediate_size, h)  # gate, up stacked
            layer.down = p(h, cfg.intermediate_size)
            self.layers.append(layer)
        self.norm = p(h)
        self.lm_head = self.embed if cfg.tie_word_embeddings else p(cfg.vocab_size, h)
        cos, sin = rope.tables(cfg, dtype)   # the same bits on every machine (model/rope.py)
        self.register_buffer("cos", cos.to(device), persistent=False)
        self.register_buffer("sin", sin.to(device), persistent=False)

    @property
    def dtype(self):
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.device

    def finalize(self) -> None:
        """Call after loading weights. Logits are computed in float32 (from the
        dtype-rounded hidden state and weights): bf16 logits are so coarse that
        top-1/top-2 ties are common and the margin would say little."""
        # Each layer's weights as plain attributes, with the norm after its MLP (the next
        # layer's input norm, or the final one): a one-row decode step spent a tenth of a
        # millisecond on nn.Module attribute lookups and on slicing self.layers.
        norms = [layer.input_norm for layer in self.layers[1:]] + [self.norm]
        self.step_layers = [LayerWeights(*(getattr(layer, f.name) for f in fields(LayerWeights)[:-1]), norm)
                            for layer, norm in zip(self.layers, norms)]
        self.packed = {}   # id(weight) -> x @ weight.T for the fast plan (pack_fast)
        self.shared = {}   # id(weight) -> cpu_linear.Packed: the one packed copy (pack_shared, set_packed)
        self.blocks = {}   # id(weight) -> QuantBlocks: a quantized weight on a device (set_blocks)
        # Weights served as stored in a GGUF file (model.gguf_weights): {type: tensors}, and
        # the reference kernels their packed copies need (embedding rows, plain copies).
        self.stored_types, self.quant_ops = {}, None
        self.fast_quantized_matmul = None   # the fast plan's matmul on them, by kernel_plan name (pack_fast)
        self.invariant_packed = {}   # the same for the machine-specific invariant plan, whose bits
        self.invariant_matmul = kernel_names.TORCH_MM   # depend on the kernel: its name in kernel_plan
        # pack_fast's probe: the fast plan takes the row-invariant kernel up to this many
        # rows and the other one above (None: the row-invariant kernel at every row count).
        self.fast_rowwise_max_rows = None
        self.dense_head = None   # hidden -> float32 logits on the packed lm_head (pack_fast)
        self.plain_needed = True   # whether a plan multiplies the plain weights (pack_fast)
        self.freed_bytes = 0       # plain weights freed once packed (pack_shared, release_plain_weights)
        # pack_shared's check of each weight's row-invariant matmul (id -> the matmul, or
        # None where it disagreed), and that matmul's name.
        self.rowwise_checked, self.rowwise_checked_name = {}, None
        # (packed, output sizes, norms, matmul) for the one-call decode layers (pack_fast);
        # matmul None: cpu_ops' own VDPBF16PS, else the reference's linear.
        self.fused_layers = None
        lm_head = self.lm_head
        self.lm_head_bf16 = lambda x: torch.nn.functional.linear(x, lm_head)   # the greedy candidate search
        for name in ("lm_head_f32", "lm_head_max_norm"):
            self.__dict__.pop(name, None)

    @cached_property
    def lm_head_f32(self) -> torch.Tensor:
        """The lm_head in float32, made on first use: only the plans that take logits
        from a float32 matmul read it (the machine-specific invariant plan, the exact
        top-2 of plans.head). A float32 model's is its lm_head itself."""
        return self.lm_head.detach().float()

    @cached_property
    def lm_head_max_norm(self) -> float:
        """The largest row norm of the lm_head: bounds the bf16 lm_head's error (plans.head)."""
        return max(float(rows.float().norm(dim=-1).max()) for rows in self.lm_head.detach().split(4096))

    def projections(self) -> list:
        """Every layer's projection weights (qkv, o, gate_up, down), layer by layer:
        with the lm_head, what the plans multiply."""
        return [w for layer in self.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]

    @property
    def quantized(self) -> bool:
        """Whether some weights are served quantized, as stored (set_packed, set_blocks)."""
        return bool(self.blocks) or any(p.data.dtype == torch.uint8 for p in self.shared.values())

    def set_blocks(self, w: torch.Tensor, blocks: QuantBlocks) -> None:
        """w's one copy is `blocks`, a quantized weight as the Triton reference reads it
        (kernels/triton_reference.py qmatmul, qrows): w keeps its shape, without
        storage. Call after finalize."""
        _release(w)
        self.blocks[id(w)] = blocks

    def set_packed(self, w: torch.Tensor, packed: cpu_linear.Packed, ops) -> None:
        """w's one copy is `packed`, a quantized weight in the reference kernels' layout
        (`ops`: their module, which reads it): w keeps its shape, without storage. Call
        after finalize."""
        _release(w)
        self.shared[id(w)] = packed
        self.quant_ops = ops

    def pack_shared(self, ref, release: bool = False, kernels=None) -> None:
        """The one packed copy of every projection and the lm_head, in the reference
        kernels' layout (`ref`: plans.reference_ops' module), as `shared`: the
        reference multiplies it, and the fast plan too where it can (pack_fast).
        Nothing where the reference does not take this model's weights.
        `release` (a model no one else holds, as for release_plain_weights): each plain
        weight is freed as soon as its packed copy exists, so start-up never holds the
        weights twice, only one weight more than once. pack_fast reads a freed weight
        back from its packed copy where it needs it (plain), and puts every plain
        weight back where a plan multiplies them after all (restore_plain_weights).
        With `kernels` (the C++ kernels pack_fast will get), each weight's row-invariant
        matmul is checked against F.linear here, while its plain copy is still at hand."""
        every = [w for w in self.projections() + [self.lm_head] if id(w) not in self.shared]
        if not every or ref is None:
            return
        if not all(cpu_linear.packable(w, ref) for w in every):
            return
        name = cpu_linear.rowwise_kernel(kernels, ref)
        for w in every:
            p = self.shared[id(w)] = cpu_linear.shared_pack(w, ref)
            if name is not None:
                self.rowwise_checked[id(w)] = cpu_linear.checked(cpu_linear.rowwise(name, p, kernels, ref), w)
            if release:
                self.freed_bytes += _release(w)
        self.rowwise_checked_name = name
        if release:
            self.__dict__.pop("lm_head_f32", None)

    def plain(self, w: torch.Tensor) -> torch.Tensor:
        """w, or where pack_shared freed it, an exact copy read back from its packed copy
        (a quantized weight: its values in bf16, kernels/SPEC.md)."""
        if not _released(w):
            return w
        p = self.shared[id(w)]
        if p.data.dtype == torch.uint8:
            return self.quant_ops.qrows(p.data, torch.arange(p.n), p.per)
        return cpu_linear.unpack(p)

    def restore_plain_weights(self) -> None:
        """Every freed plain weight back, read from its packed copy (its own storage
        again, so every reference to the weight sees it)."""
        if self.quantized:
            raise RuntimeError("quantized weights have no plain copy to restore")
        with torch.no_grad():
            for w in self.projections() + [self.lm_head]:
                if _released(w):
                    values = cpu_linear.unpack(self.shared[id(w)])
                    w.untyped_storage().resize_(values.numel() * values.element_size())
                    w.copy_(values)
        self.freed_bytes = 0

    def pack_fast(self, kernels=None, ref=None) -> None:
        """The fast plan's matmuls (`packed`, plans.cpu_linear says which): with the C++
        kernels (`kernels`), a row-invariant matmul on the shared copy (pack_shared),
        with float32 logits from the same packed lm_head (`dense_head`); a start-up
        probe keeps oneDNN's packed copy too only where it is much faster at some row
        count. Without a row-invariant matmul, oneDNN's copy (or the plain weights),
        which the machine-specific invariant plan multiplies in fixed row groups."""
        if self.packed:
            return
        weights = self.projections()
        every = weights + [self.lm_head]
        if self.quantized:
            return self._pack_quantized(kernels, ref)
        name = cpu_linear.rowwise_kernel(kernels, ref) if self.shared else None
        rowwise = {}
        if name is not None:   # each weight checked on its own, by pack_shared or here (plain: read back)
            done = self.rowwise_checked if self.rowwise_checked_name == name else {}
            rowwise = {id(w): done[id(w)] if id(w) in done else
                       cpu_linear.checked(cpu_linear.rowwise(name, self.shared[id(w)], kernels, ref), self.plain(w))
                       for w in every}
            if not all(rowwise.values()):   # a kernel that disagrees with F.linear is never used
                rowwise, name = {}, None
        onednn = cpu_linear.onednn_available()

        def other(w):   # the fast plan's alternative to the row-invariant kernel
            plain = self.plain(w)   # (a copy read back only for the probe: `others` come after a restore)
            return cpu_linear.pack(plain) if onednn else (lambda x: torch.nn.functional.linear(x, plain))
        copy_bytes = sum(w.numel() * w.element_size() for w in every)
        if rowwise and not cpu_linear.second_copy_fits(copy_bytes):
            log(f"fast plan: no second copy of the weights is tried ({copy_bytes / 2**20:.0f} MiB would not fit "
                "in the memory available)")
        elif rowwise:
            probe = self.layers[0].gate_up
            self.fast_rowwise_max_rows = cpu_linear.rowwise_max_rows(rowwise[id(probe)], other(probe),
                                                                     probe.shape[1])
        need_other = not rowwise or self.fast_rowwise_max_rows is not None   # it serves some row counts
        self.plain_needed = not rowwise or (need_other and not onednn)
        if self.plain_needed:
            self.restore_plain_weights()
        others = {id(w): other(w) for w in every} if need_other and (rowwise or onednn) else {}
        fast = {id(w): cpu_linear.fast_linear(rowwise.get(id(w)), others.get(id(w)), self.fast_rowwise_max_rows)
                for w in every}
        self.packed = {id(w): fast[id(w)] for w in weights if fast[id(w)] is not None}
        self.lm_head_bf16 = fast[id(self.lm_head)] or self.lm_head_bf16
        # Only weights really packed: the invariant plan's description says which kernel.
        if rowwise:
            self.dense_head = cpu_linear.dense_head(self.shared[id(self.lm_head)], ref)
            self.invariant_packed = {id(w): rowwise[id(w)] for w in weights}
            self.invariant_matmul = name
        elif self.packed:
            self.invariant_packed, self.invariant_matmul = dict(self.packed), kernel_names.ONEDNN_PACKED
        # The C++ one-call decode layers (FastPlan.decode_layers) take the row-invariant
        # matmul (VDPBF16PS, or the reference's AVX2 build) at the row counts it serves,
        # and layers without biases or q/k norms.
        plain_layers = all(w is None for layer in self.step_layers
                           for w in (layer.qkv_bias, layer.o_bias, layer.q_norm, layer.k_norm))
        if rowwise and plain_layers and self.tp is None:   # a shard's o and down sum over the ranks
            layers = self.step_layers
            self.fused_layers = ([self.shared[id(w)].data for lw in layers for w in (lw.qkv, lw.o, lw.gate_up, lw.down)],
                                 [self.shared[id(w)].n for lw in layers for w in (lw.qkv, lw.o, lw.gate_up, lw.down)],
                                 [w for lw in layers for w in (lw.post_norm, lw.next_norm)],
                                 None if name == kernel_names.CPU_DPBF16 else ref.linear)

    def _pack_quantized(self, kernels, ref) -> None:
        """pack_fast for weights served as stored: the fast plan multiplies them with
        cpu_ops' int8 kernel where the CPU has one (AVX-512 VNNI, else AVX2: its own
        arithmetic), else with the reference's matmul, the one kernel that takes them
        (bf16 weights beside them: the reference's matmul too, which takes both
        layouts)."""
        weights = self.projections()
        ref = ref or self.quant_ops   # the build that packed them reads them in any case
        int8, self.fast_quantized_matmul = (
            (kernels.qlinear_vnni, kernel_names.CPU_QVNNI) if getattr(kernels, "qvnni", False) else
            (kernels.qlinear_avx2, kernel_names.CPU_QAVX2) if getattr(kernels, "qavx2", False) else
            (None, kernel_names.REF_LINEAR))

        def fast(w, f32=False):
            p = self.shared[id(w)]
            fn = int8 if int8 is not None and p.data.dtype == torch.uint8 else ref.linear
            return lambda x: fn(x.contiguous(), p.data, p.n, f32, p.per)
        self.packed = {id(w): fast(w) for w in weights}
        self.lm_head_bf16 = fast(self.lm_head)
        self.dense_head = fast(self.lm_head, True)
        self.invariant_packed = {id(w): cpu_linear.rowwise(kernel_names.REF_LINEAR, self.shared[id(w)], kernels, ref)
                                 for w in weights}
        self.invariant_matmul = kernel_names.REF_LINEAR
        self.plain_needed = False
        plain_layers = all(w is None for layer in self.step_layers
                           for w in (layer.qkv_bias, layer.o_bias, layer.q_norm, layer.k_norm))
        if plain_layers and self.tp is None:
            layers = self.step_layers
            packed = [self.shared[id(w)] for lw in layers for w in (lw.qkv, lw.o, lw.gate_up, lw.down)]
            every_quantized = all(p.data.dtype == torch.uint8 for p in packed)
            self.fused_layers = ([p.data for p in packed], [p.n for p in packed],
                                 [w for lw in layers for w in (lw.post_norm, lw.next_norm)],
                                 int8 if int8 is not None and every_quantized else ref.linear)

    def drop_weight(self, w: torch.Tensor) -> None:
        """Let w's memory go, its plain storage and its packed copy: for a model no one
        else holds whose weights were copied elsewhere (model.shard), which then no
        longer runs."""
        self.shared.pop(id(w), None)
        if not _released(w):
            _release(w)

    def release_plain_weights(self) -> int:
        """Free the plain projection and lm_head weights where no plan multiplies them
        (pack_fast: the one packed copy serves both plans): each keeps its shape and
        dtype, its storage emptied, so a stray use fails loudly ("setStorage ...
        requiring a storage size") instead of reading anything. A tied embedding's
        rows then come from the packed lm_head (embed_rows). Returns the bytes freed.
        Only for a model no one else holds (the engine that loaded it): a released
        model no longer runs on torch ops. Counts the weights pack_shared freed too."""
        if self.plain_needed or not self.shared:
            return 0
        # An untied embedding is not in this list: its plain rows stay (looked up, not multiplied).
        for w in self.projections() + [self.lm_head]:
            self.freed_bytes += _release(w)
        self.__dict__.pop("lm_head_f32", None)
        return self.freed_bytes

    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of token ids: rows of the embedding, or of the packed lm_head
        when they are tied and the plain copy was released (the pairs of a row sit at
        [id // 16, :, id % 16, :] of the packed layout)."""
        if not _released(self.embed):
            return self.embed[ids]
        packed = self.shared[id(self.embed)].data
        if packed.dtype == torch.uint8:
            return self.quant_ops.qrows(packed, ids, self.shared[id(self.embed)].per)
        return packed[ids // 16, :, ids % 16, :].reshape(ids.shape[0], -1)

    def hf_state_dict(self, get=lambda t: t) -> dict:
        """The weights under transformers' LlamaForCausalLM names (load_hf_state_dict's
        inverse): the stacked qkv and gate_up split back into their projections.
        `get` maps each parameter first (`lambda p: p.grad` names the gradients)."""
        if self.quantized:
            raise ValueError("a model served with quantized weights has no transformers checkpoint "
                             "(serve its GGUF with --dequantize for one)")
        cfg = self.cfg
        nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        sd = {"model.embed_tokens.weight": get(self.embed), "model.norm.weight": get(self.norm)}
        for i, layer in enumerate(self.layers):
            pre = f"model.layers.{i}."
            sd[pre + "input_layernorm.weight"] = get(layer.input_norm)
            sd[pre + "post_attention_layernorm.weight"] = get(layer.post_norm)
            for n, w in zip("qkv", get(layer.qkv).split([nq, nkv, nkv])):
                sd[pre + f"self_attn.{n}_proj.weight"] = w
            if layer.qkv_bias is not None:
                for n, b in zip("qkv", get(layer.qkv_bias).split([nq, nkv, nkv])):
                    sd[pre + f"self_attn.{n}_proj.bias"] = b
            sd[pre + "self_attn.o_proj.weight"] = get(layer.o)
            if layer.o_bias is not None:
                sd[pre + "self_attn.o_proj.bias"] = get(layer.o_bias)
            if layer.q_norm is not None:
                sd[pre + "self_attn.q_norm.weight"] = get(layer.q_norm)
                sd[pre + "self_attn.k_norm.weight"] = get(layer.k_norm)
            gate, up = get(layer.gate_up).split(cfg.intermediate_size)
            sd[pre + "mlp.gate_proj.weight"], sd[pre + "mlp.up_proj.weight"] = gate, up
            sd[pre + "mlp.down_proj.weight"] = get(layer.down)
        if not cfg.tie_word_embeddings:
            sd["lm_head.weight"] = get(self.lm_head)
        return sd

    def logits(self, hidden: torch.Tensor, plan) -> torch.Tensor:
        return plan.linear(hidden.float(), self.lm_head_f32)

    def forward(self, input_ids, positions, slots, attn_meta, kv: KVCache, plan) -> torch.Tensor:
        """Hidden states after the final norm, [rows, hidden]. Each residual add is
        fused with the RMSNorm that follows it (the next layer's input norm, or the
        final one): the same bits as the add, then the norm."""
        cfg = self.cfg
        nq, d = cfg.num_heads * cfg.head_dim, cfg.head_dim
        h = plan.embed(self, input_ids)
        cos, sin = self.cos[positions], self.sin[positions]   # [rows, head_dim], gathered once per forward
        slots = KVSlots(slots)
        x = plan.rms_norm(h, self.layers[0].input_norm, cfg.rms_norm_eps)
        fused = plan.decode_layers(self, h, x, cos, sin, kv, slots, attn_meta)   # every layer in one call
        if fused is not None:
            return fused
        for i, layer in enumerate(self.step_layers):
            qkv = plan.linear(x, layer.qkv)
            if layer.qkv_bias is not None:     # elementwise: the same bits in any batch
                qkv = plan.add(qkv, layer.qkv_bias)
            if layer.q_norm is not None:       # one reduction per (row, head)
                q, k, v = qkv.split([nq, cfg.num_kv_heads * d, cfg.num_kv_heads * d], dim=-1)
                qkv = torch.cat([plan.rms_norm(q.reshape(-1, d), layer.q_norm, cfg.rms_norm_eps).view(q.shape),
                                 plan.rms_norm(k.reshape(-1, d), layer.k_norm, cfg.rms_norm_eps).view(k.shape),
                                 v], -1)
            q = plan.rope_store(qkv, cos, sin, kv, i, slots, cfg.num_heads)
            attn = plan.attention(q, kv.k[i], kv.v[i], attn_meta, 1.0 / math.sqrt(d))
            o = self._row_parallel(plan, attn.reshape(-1, nq), layer.o, "o")
            h, x = plan.add_rms_norm(h, plan.add(o, layer.o_bias) if layer.o_bias is not None else o, layer.post_norm,
                                     cfg.rms_norm_eps)
            mlp = self._row_parallel(plan, plan.silu_mul(plan.linear(x, layer.gate_up)), layer.down, "down")
            h, x = plan.add_rms_norm(h, mlp, layer.next_norm, cfg.rms_norm_eps)
        return x

    def _row_parallel(self, plan, x: torch.Tensor, w: torch.Tensor, which: str) -> torch.Tensor:
        """x @ w.T for o and down: on a tensor-parallel shard, the sum over the ranks."""
        return plan.linear(x, w) if self.tp is None else self.tp.linear(plan, x, w, which)

    def load_hf_state_dict(self, sd: dict) -> None:
        """Weights named as in transformers' LlamaForCausalLM."""
        def take(name):
            t = sd[name]
            return t.to(dtype=self.dtype, device=self.device)

        with torch.no_grad():
            self.embed.copy_(take("model.embed_tokens.weight"))
            for i, layer in enumerate(self.layers):
                pre = f"model.layers.{i}."
                layer.input_norm.copy_(take(pre + "input_layernorm.weight"))
                layer.post_norm.copy_(take(pre + "post_attention_layernorm.weight"))
                layer.qkv.copy_(torch.cat([take(pre + f"self_attn.{n}_proj.weight") for n in "qkv"]))
                if layer.qkv_bias is not None:
                    layer.qkv_bias.copy_(torch.cat([take(pre + f"self_attn.{n}_proj.bias") for n in "qkv"]))
                layer.o.copy_(take(pre + "self_attn.o_proj.weight"))
                if layer.o_bias is not None:
                    layer.o_bias.copy_(take(pre + "self_attn.o_proj.bias"))
                if layer.q_norm is not None:
                    layer.q_norm.copy_(take(pre + "self_attn.q_norm.weight"))
                    layer.k_norm.copy_(take(pre + "self_attn.k_norm.weight"))
                layer.gate_up.copy_(torch.cat([take(pre + "mlp.gate_proj.weight"), take(pre + "mlp.up_proj.weight")]))
                layer.down.copy_(take(pre + "mlp.down_proj.weight"))
            self.norm.copy_(take("model.norm.weight"))
            if not self.cfg.tie_word_embeddings:
                self.lm_head.copy_(take("lm_head.weight"))
        self.finalize()

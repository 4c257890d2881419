"""Engine and model configuration. Plain dataclasses; validation lives next to the values."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    max_position: int = 2048
    tie_word_embeddings: bool = True
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple = ()

    @classmethod
    def from_hf(cls, hf) -> "ModelConfig":
        """From a transformers LlamaConfig-like object (Llama, Qwen2, Mistral, SmolLM)."""
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        rope = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
        rope = dict(rope)
        theta = rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        scaling = rope if rope.get("rope_type", rope.get("type", "default")) not in ("default", None) else None
        eos = hf.eos_token_id
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        return cls(
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            bos_token_id=hf.bos_token_id,
            eos_token_ids=eos,
        )


@dataclass
class EngineConfig:
    model: Optional[str] = None          # HF directory or .gguf file; None = embedded SmolLM2
    dtype: str = "bfloat16"              # bfloat16 | float32
    device: str = "cpu"                  # cpu | cuda
    plan: str = "fast"                   # fast | invariant (server-wide batch-invariant mode)
    block_size: int = 16
    num_kv_blocks: int = 1024
    max_model_len: int = 2048
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    # Invariant plan shape: every matmul runs on row groups of exactly `invariant_rows`
    # rows (0 = chosen for the CPU, see plan.default_invariant_rows) and attention
    # splits keys at multiples of `attention_split` (a multiple of block_size).
    invariant_rows: int = 0
    attention_split: int = 64
    # Margin gate defaults (per-request overrides allowed).
    # tau 0.3: `gateeng calibrate` on the embedded SmolLM2 (bf16, CPU) caught every flip at
    # its own step at a 14% trigger rate (bench/RESULTS.md); recalibrate for other models.
    margin_threshold: float = 0.3
    max_window: int = 32
    # VERIFIED decode route: adaptive (per step, from measured plan costs) | speculative | direct.
    verified_route: str = "adaptive"
    # Steps a margin-triggered replay may wait for an invariant pass to join (0 = at once).
    max_verify_delay: int = 8
    max_queue: int = 256
    # Test-only: Gaussian noise of this std added to fast-path logits, to provoke rollbacks.
    fast_logit_noise: float = 0.0
    num_threads: Optional[int] = None

    def validate(self) -> None:
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"dtype must be 'bfloat16' or 'float32', got {self.dtype!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.plan not in ("fast", "invariant"):
            raise ValueError(f"plan must be 'fast' or 'invariant', got {self.plan!r}")
        if self.attention_split % self.block_size:
            raise ValueError("attention_split must be a multiple of block_size")
        from gateeng.route import ROUTES
        if self.verified_route not in ROUTES:
            raise ValueError(f"verified_route must be one of {', '.join(ROUTES)}, got {self.verified_route!r}")
        if self.max_verify_delay < 0:
            raise ValueError(f"max_verify_delay must be >= 0, got {self.max_verify_delay}")
        if self.invariant_rows < 0:
            raise ValueError(f"invariant_rows must be >= 0 (0 = chosen for the CPU), got {self.invariant_rows}")
        validate_threshold(self.margin_threshold)
        validate_window(self.max_window)
        for name in ("block_size", "num_kv_blocks", "max_model_len", "max_num_seqs",
                     "max_num_batched_tokens", "max_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def validate_threshold(tau: float) -> float:
    if tau is None or not math.isfinite(tau) or tau < 0:
        raise ValueError(f"margin_threshold must be a finite number >= 0, got {tau!r}")
    return float(tau)


def validate_window(w: int) -> int:
    if w is None or int(w) < 1:
        raise ValueError(f"max_window must be >= 1, got {w!r}")
    return int(w)

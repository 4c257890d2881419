"""Engine and model configuration. Plain dataclasses; validation lives next to the values."""
from __future__ import annotations

import enum
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

# The largest prefill chunk (its queries x its keys) the fast plan's C++ kernels
# attend row by row, as the invariant plan does, rather than with SDPA: up to about
# this size the row-by-row kernel is the faster, past it SDPA is. The scheduler lets
# OFF chunks within it ride along on an invariant pass: beyond it the fast plan's
# attention is the faster one, which the route cost model, fitted on decode passes,
# would not see.
KERNEL_PREFILL_WORK = 128 * 128

# The routes of a VERIFIED decode, and the policies that choose them (--verified-route):
# adaptive picks a route per step from measured plan costs (engine/route.py).
SPECULATIVE, DIRECT, ADAPTIVE = "speculative", "direct", "adaptive"
ROUTE_POLICIES = (ADAPTIVE, SPECULATIVE, DIRECT)
# The two plans, by name (--plan; a step's PlanKind in gateeng/step.py).
FAST, INVARIANT = "fast", "invariant"
PLANS = (FAST, INVARIANT)
# The weights' and KV cache's dtypes, and the devices an engine runs on.
BFLOAT16, FLOAT32 = "bfloat16", "float32"
DTYPES = (BFLOAT16, FLOAT32)
DEVICES = ("cpu", "cuda")


class Mode(str, enum.Enum):
    """A request's determinism: the one owner of the mode names on every wire."""
    OFF = "off"              # no promise about the bits (fast path, or a spare invariant row)
    VERIFIED = "verified"    # fast path, margin-gated verification, bitwise == reference
    REFERENCE = "reference"  # invariant plan for every step (plan=invariant engine)


class StreamPolicy(str, enum.Enum):
    """When a VERIFIED stream sends a token: once verified, or at once where its margin is high."""
    VERIFIED_ONLY = "verified_only"
    EAGER = "eager"


# The determinism modes a request may name, on both fronts (gRPC's MODE_<NAME>, HTTP's
# `determinism.mode`).
REQUEST_MODES = (Mode.OFF.value, Mode.VERIFIED.value)


def cache_root() -> Path:
    """Where gateeng keeps what it builds once: converted models, compiled kernels."""
    return Path(os.environ.get("GATEENG_CACHE", "~/.cache/gateeng")).expanduser()


# The routing rules of a mixture-of-experts layer (kernels/SPEC.md, "Mixture of experts"):
# softmax over every expert's router logit, then the top k of those probabilities
# (Qwen3-MoE, OLMoE); or the top k logits, then a softmax over those k (Mixtral).
SOFTMAX_TOPK, TOPK_SOFTMAX = "softmax_topk", "topk_softmax"
ROUTINGS = (SOFTMAX_TOPK, TOPK_SOFTMAX)
# Where a q/k RMSNorm reduces: over each head (Qwen3), or over the whole q (and k)
# projection (OLMoE).
QK_NORM_HEAD, QK_NORM_PROJECTION = "head", "projection"


@dataclass(frozen=True)
class MoeConfig:
    """A mixture of experts: which layers route each token to `top_k` of `num_experts`
    MLPs of width `intermediate_size` (the others are plain MLPs of the model's
    intermediate_size), and how (`routing`, `norm_topk_prob`)."""
    num_experts: int
    top_k: int
    intermediate_size: int
    routing: str                       # one of ROUTINGS
    norm_topk_prob: bool               # SOFTMAX_TOPK: the k probabilities divided by their sum
    sparse_layers: tuple               # the indices of the layers that route (ascending)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    architecture: str                  # transformers' model_type (gateeng/model/families.py)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    max_position: int = 2048
    tie_word_embeddings: bool = True
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple = ()
    qkv_bias: bool = False             # q, k and v biases
    o_bias: bool = False               # o's bias
    qk_norm: bool = False              # RMSNorm of each head's q and k before RoPE
    sliding_window: Optional[int] = None   # attention window; None = full attention
    # Fields added after the first model fingerprint: at these defaults a model's
    # fingerprint is what it was before they existed (model.fingerprint, LATER_FIELDS).
    qk_norm_scope: str = QK_NORM_HEAD  # what a q/k norm reduces over (QK_NORM_HEAD, QK_NORM_PROJECTION)
    moe: Optional[MoeConfig] = None    # a mixture of experts; None: every layer a plain MLP

    @classmethod
    def from_hf(cls, hf, *, qkv_bias: bool, o_bias: bool, qk_norm: bool, **terms) -> "ModelConfig":
        """From a transformers config, with the attention terms its family sets
        (gateeng/model/families.py reads a config with them) and its other `terms`
        (qk_norm_scope, moe)."""
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
            architecture=hf.model_type,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=qk_norm,
            sliding_window=_sliding_window(hf),
            **terms,
        )


def _sliding_window(hf) -> Optional[int]:
    """The attention window the model applies, or None for full attention. A config
    with use_sliding_window carries a window that applies only where it is set."""
    window = getattr(hf, "sliding_window", None)
    if window is None or (hasattr(hf, "use_sliding_window") and not hf.use_sliding_window):
        return None
    return int(window)


# Positions of KV cache per running request that the default cache size provides
# (EngineConfig.num_kv_blocks = 0): at the default max_num_seqs, 16384 positions.
KV_POSITIONS_PER_SEQ = 256
# Positions per KV cache block, EngineConfig.block_size by default; a plan built on its own
# (tests, tools) takes it too.
BLOCK_SIZE = 16


@dataclass
class EngineConfig:
    model: Optional[str] = None          # HF directory or .gguf file; None = embedded SmolLM2
    dtype: str = BFLOAT16                # one of DTYPES
    # A GGUF's quantized weights are served as stored (bf16 on CPU, tensor-parallel size
    # 1); True serves the file dequantized to `dtype` instead (model.loader).
    dequantize: bool = False
    device: str = "cpu"                  # cpu | cuda
    plan: str = FAST                     # fast | invariant (server-wide batch-invariant mode)
    block_size: int = BLOCK_SIZE
    # KV cache blocks; 0: sized for max_num_seqs requests of KV_POSITIONS_PER_SEQ positions
    # each, and for one request of max_model_len when that is more (kv_blocks). The
    # memory a block takes is the model's: layers x KV heads x head dim x block_size.
    num_kv_blocks: int = 0
    # Positions one request may use (prompt + output); 0 = the model's limit (its
    # max_position_embeddings, or its sliding window if smaller), within what the
    # KV cache holds. An explicit value above either is refused.
    max_model_len: int = 0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # While requests are decoding, a step prefills at most max(prefill_chunk, number
    # of decoding requests) prompt positions (0 = up to the whole budget): long
    # prompts are chunked and interleaved with the decodes, which bounds their
    # inter-token latency. 8: chosen with bench/serve.py's prefill phase, which
    # measures a decoding stream beside long prompts at each setting (bench/RESULTS.md,
    # "Long prompts").
    prefill_chunk: int = 8
    enable_prefix_caching: bool = True
    # CPU: the fast plan multiplies packed weights (plans.packing.pack_fast). With the C++
    # kernels and the reference, that is the one packed copy the reference multiplies
    # too (plans/cpu_linear.py: VDPBF16PS on AVX-512 BF16, else the reference's AVX2
    # matmul), and an engine that loaded its own model frees the plain weights;
    # elsewhere oneDNN's packed copy. Off: the fast plan multiplies the plain weights
    # (slower steps, and the plain weights stay beside the reference's packed copy).
    # A float32 model's invariant plan's bits depend on it (kernel_plan: matmul=...); a
    # bf16 model's invariant plan is the reference (gateeng-ref-1) either way.
    pack_fast_weights: bool = True
    # CPU: the C++ kernels (plans/cpu_ops.py: RMSNorm with the residual add, RoPE with
    # the KV store, the SiLU gate, attention over the paged cache in place, the
    # VDPBF16PS matmul) for the fast plan and a float32 model's invariant plan, built on
    # first use; torch ops where they cannot be built. A float32 model's invariant
    # plan's bits depend on it (kernel_plan names which); a bf16 model's invariant plan
    # is the reference, on its own kernels (plans/reference_ops.py) either way.
    cpu_kernels: bool = True
    # Invariant plan shape: matmuls that are not row-invariant by construction (oneDNN,
    # torch.mm) and the sampled rows' float32 lm_head run on row groups of exactly
    # `invariant_rows` rows (0 = chosen for the CPU, see plan.default_invariant_rows);
    # torch attention splits keys at multiples of `attention_split` (a multiple of
    # block_size).
    invariant_rows: int = 0
    attention_split: int = 64
    # Margin gate defaults (per-request overrides allowed).
    # tau 0.3: `gateeng calibrate` on the embedded SmolLM2 (bf16, CPU) caught every flip at
    # its own step at a 14% trigger rate (bench/RESULTS.md); recalibrate for other models.
    margin_threshold: float = 0.3
    # A mixture of experts' router-margin gate: a fast-path token is verified when, in any
    # routing layer, its k-th router score is within this of the (k+1)-th (the fast path
    # may have chosen other experts than the reference). 0: exact ties only.
    router_margin_threshold: float = 0.0
    max_window: int = 32
    # VERIFIED decode route: adaptive (per step, from measured plan costs) | speculative | direct.
    verified_route: str = ADAPTIVE
    # The adaptive route's plan costs are timed once per machine, build, model and
    # settings and kept in $GATEENG_CACHE (engine/route_costs.py); True times them
    # again at start-up and replaces what is kept.
    recalibrate_route: bool = False
    # Steps a margin-triggered replay may wait for an invariant pass to join (0 = at once).
    max_verify_delay: int = 8
    max_queue: int = 256
    # Test-only: Gaussian noise of this std added to fast-path logits, to provoke rollbacks.
    fast_logit_noise: float = 0.0
    num_threads: Optional[int] = None   # per rank where tensor_parallel_size > 1
    # Ranks (processes) the model is split over, one torch.distributed group on gloo
    # (engine/tp_processes.py); 1: this process alone.
    tensor_parallel_size: int = 1
    # Seconds any collective of that group may wait before the engine fails closed:
    # a long prefill step on a loaded 2-core machine takes a few seconds.
    tensor_parallel_timeout: float = 15.0
    # A weight update (Engine.update_weights) holds admission and lets the running
    # requests finish on the old weights for up to this many seconds; those still
    # running then end (abort), so that no answer mixes two weight versions.
    weight_update_wait: float = 30.0

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.plan not in PLANS:
            raise ValueError(f"plan must be one of {', '.join(PLANS)}, got {self.plan!r}")
        if self.attention_split % self.block_size:
            raise ValueError("attention_split must be a multiple of block_size")
        if self.verified_route not in ROUTE_POLICIES:
            raise ValueError(f"verified_route must be one of {', '.join(ROUTE_POLICIES)}, got {self.verified_route!r}")
        if self.max_verify_delay < 0:
            raise ValueError(f"max_verify_delay must be >= 0, got {self.max_verify_delay}")
        if self.prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0 (0 = no limit), got {self.prefill_chunk}")
        if self.invariant_rows < 0:
            raise ValueError(f"invariant_rows must be >= 0 (0 = chosen for the CPU), got {self.invariant_rows}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_timeout <= 0:
            raise ValueError(f"tensor_parallel_timeout must be > 0 seconds, got {self.tensor_parallel_timeout}")
        if not (math.isfinite(self.weight_update_wait) and self.weight_update_wait >= 0):
            raise ValueError(f"weight_update_wait must be a number of seconds >= 0, got {self.weight_update_wait}")
        validate_threshold(self.margin_threshold)
        validate_threshold(self.router_margin_threshold, "router_margin_threshold")
        validate_window(self.max_window)
        if self.max_window + 1 > self.max_num_batched_tokens:
            raise ValueError(f"max_window {self.max_window} must be below the step token budget "
                             f"max_num_batched_tokens {self.max_num_batched_tokens}: a verify replay is W+1 "
                             f"positions in one step")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be >= 0 (0 = the model's limit), got {self.max_model_len}")
        if self.num_kv_blocks < 0:
            raise ValueError(f"num_kv_blocks must be >= 0 (0 = sized for max_num_seqs), got {self.num_kv_blocks}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def kv_blocks(cfg: "EngineConfig") -> int:
    """The KV cache's blocks: cfg.num_kv_blocks, or (0) enough for max_num_seqs
    requests of KV_POSITIONS_PER_SEQ positions each and for one of max_model_len."""
    if cfg.num_kv_blocks:
        return cfg.num_kv_blocks
    positions = max(cfg.max_num_seqs * KV_POSITIONS_PER_SEQ, cfg.max_model_len)
    return -(-positions // cfg.block_size)


def validate_threshold(tau: float, what: str = "margin_threshold") -> float:
    if tau is None or not math.isfinite(tau) or tau < 0:
        raise ValueError(f"{what} must be a finite number >= 0, got {tau!r}")
    return float(tau)


def validate_window(w: int) -> int:
    if w is None or int(w) < 1:
        raise ValueError(f"max_window must be >= 1, got {w!r}")
    return int(w)


@dataclass(frozen=True)
class GateBounds:
    """What a request may ask of the gate (operator flags). A larger tau or a
    smaller W costs other requests invariant passes; a larger W makes one verify
    replay, which is not split across steps, a longer step for everyone."""
    max_margin_threshold: float = 4.0
    min_window: int = 4
    max_window: int = 64

    def validate(self) -> None:
        if not (math.isfinite(self.max_margin_threshold) and self.max_margin_threshold >= 0):
            raise ValueError(f"the tau ceiling must be a finite number >= 0, got {self.max_margin_threshold}")
        if not 1 <= self.min_window <= self.max_window:
            raise ValueError(f"need 1 <= W floor <= W ceiling, got {self.min_window} and {self.max_window}")

    def check(self, tau: Optional[float], window: Optional[int], what: str = "determinism") -> None:
        if tau is not None and not (math.isfinite(tau) and 0 <= tau <= self.max_margin_threshold):
            raise ValueError(f"{what}.margin_threshold must be in [0, {self.max_margin_threshold:g}] on this "
                             f"server (--request-tau-max), got {tau:g}")
        if window is not None and not self.min_window <= window <= self.max_window:
            raise ValueError(f"{what}.max_window must be in [{self.min_window}, {self.max_window}] on this "
                             f"server (--request-window-min/--request-window-max), got {window}")


# An HTTP body may exceed --max-prompt-bytes by this much (the other fields, JSON
# escapes); past it the body is refused by its Content-Length, unparsed.
HTTP_BODY_SLACK_BYTES = 64 * 1024
# An HTTP request's choices: `n` per prompt, and prompts x n in all. Each choice is
# a request of the engine's own; a request that could never fit the queue is
# refused at once rather than with a 429 that no retry could cure.
HTTP_MAX_N = 16
HTTP_MAX_CHOICES = 64
# The OpenAI front's port (vLLM's); `--http-port -1` turns the front off.
HTTP_PORT = 8000
# The gRPC port, and where the command line's clients look for a server by default.
GRPC_PORT = 50051
LOCAL_SERVER = f"127.0.0.1:{GRPC_PORT}"


@dataclass(frozen=True)
class ConnectionLimits:
    """What one HTTP listener holds at most (serving/http_server.py enforces it;
    `gateeng serve` exposes each as a flag)."""
    max_connections: int = 512          # open at once; one more is answered 503 and closed
    header_timeout_s: float = 10.0      # from opening (or a kept-alive connection's next byte) to whole headers
    body_timeout_s: float = 30.0        # from the headers to the whole body
    keep_alive_timeout_s: float = 5.0   # an idle kept-alive connection is closed after this

    def validate(self, what: str) -> None:
        if self.max_connections < 1:
            raise ValueError(f"--{what}-max-connections must be >= 1, got {self.max_connections}")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                flag = "--http-" + name.removesuffix("_s").replace("_", "-")
                raise ValueError(f"{flag} must be a number of seconds > 0, got {value}")


# The /metrics endpoint answers a scraper or two: a handful of connections is plenty.
METRICS_MAX_CONNECTIONS = 16
# File descriptors kept beyond the listeners' connections: the model and kernel
# files, logs, the tensor-parallel group, the outgoing sockets of the process.
RESERVED_FDS = 256
# Connections a listener takes from the kernel's queue in one pass of its event loop,
# each admitted or closed as it is taken: a flood holds at most this many descriptors
# beyond the listener's limit at once (the ones closed are released on the next pass),
# inside RESERVED_FDS.
ACCEPTS_PER_PASS = 32
LISTEN_BACKLOG = 1024        # the kernel's queue of connections not yet taken, per listener
# A gRPC connection holds three descriptors: the client's socket at the accept gate,
# the gate's socket to gRPC, and gRPC's end of it (serving/grpc_gate.py).
GRPC_FDS_PER_CONNECTION = 3
# Fewer connections than this on a listener is no server: the start is refused.
MIN_CONNECTIONS = 4


def _scaled(connections: int, scale: float) -> int:
    """A connection limit scaled down by `scale` (<= 1), but not below MIN_CONNECTIONS."""
    return connections if scale >= 1 else min(connections, max(MIN_CONNECTIONS, int(connections * scale)))


@dataclass(frozen=True)
class GrpcLimits:
    """What the gRPC listener holds at most (serving/grpc_gate.py and gRPC's own
    server options enforce it; `gateeng serve` exposes each as a flag)."""
    max_connections: int = 256          # open at once; one more is closed at once (or a silent one is)
    handshake_timeout_s: float = 5.0    # from opening to the HTTP/2 preface (TLS: the handshake and preface)
    idle_timeout_s: float = 300.0       # a connection with no call in flight for this long is closed

    def validate(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"--grpc-max-connections must be >= 1, got {self.max_connections}")
        for name in ("handshake_timeout_s", "idle_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                flag = "--grpc-" + name.removesuffix("_s").replace("_", "-")
                raise ValueError(f"{flag} must be a number of seconds > 0, got {value}")


@dataclass(frozen=True)
class TlsFiles:
    """TLS on both fronts (vLLM's flag names): the server's certificate chain and key,
    and, where given, the CAs whose client certificates are required."""
    certfile: Optional[str] = None      # --ssl-certfile
    keyfile: Optional[str] = None       # --ssl-keyfile
    ca_certs: Optional[str] = None      # --ssl-ca-certs: require a client certificate signed by one of these

    @property
    def enabled(self) -> bool:
        return bool(self.certfile or self.keyfile)

    def validate(self) -> None:
        if bool(self.certfile) != bool(self.keyfile):
            raise ValueError("--ssl-certfile and --ssl-keyfile go together: give both, or neither")
        if self.ca_certs and not self.enabled:
            raise ValueError("--ssl-ca-certs (client certificates) needs TLS: give --ssl-certfile and "
                             "--ssl-keyfile too")


@dataclass
class ServerConfig:
    """The server's own settings (the engine's are EngineConfig). `gateeng serve`
    takes its defaults from here."""
    host: str = "127.0.0.1"
    port: int = GRPC_PORT
    metrics_port: Optional[int] = 9400     # None: no /metrics endpoint
    drain_seconds: float = 30.0            # SIGTERM: how long in-flight requests may finish
    max_prompt_bytes: int = 0              # 0: 32 bytes per context position
    bounds: GateBounds = field(default_factory=GateBounds)
    http_port: Optional[int] = HTTP_PORT   # the OpenAI-compatible HTTP front; None: off
    served_model_name: Optional[str] = None   # the model's name on both fronts; None: gateway.model_name(source)
    # GetModelInfo.source: the model's path on this machine, shown to any client
    # only when the operator asks; otherwise clients get its name and fingerprint.
    expose_model_path: bool = False
    http_limits: ConnectionLimits = field(default_factory=ConnectionLimits)
    metrics_limits: ConnectionLimits = field(
        default_factory=lambda: ConnectionLimits(max_connections=METRICS_MAX_CONNECTIONS))
    http_default_mode: str = Mode.OFF.value   # determinism of HTTP requests that name none (REQUEST_MODES)
    grpc_limits: GrpcLimits = field(default_factory=GrpcLimits)
    tls: TlsFiles = field(default_factory=TlsFiles)   # HTTPS and gRPC over TLS where enabled
    metrics_host: Optional[str] = None     # the --metrics-port listener's address; None: `host`
    # Once the engine is up, exempt every object then alive from garbage collection
    # (gc.freeze). Process-wide, so only for a process that runs one server for its
    # whole life (`gateeng serve`); servers started and stopped in one process
    # would never free a frozen engine.
    freeze_heap: bool = False

    def prompt_bytes(self, max_model_len: int) -> int:
        """The prompt byte limit for a server whose context holds max_model_len positions."""
        return self.max_prompt_bytes or 32 * max_model_len

    def validate(self) -> None:
        self.bounds.validate()
        if self.http_default_mode not in REQUEST_MODES:
            raise ValueError(f"http_default_mode must be one of {', '.join(REQUEST_MODES)}, "
                             f"got {self.http_default_mode!r}")
        if self.drain_seconds < 0 or self.max_prompt_bytes < 0:
            raise ValueError("drain_seconds and max_prompt_bytes must be >= 0")
        self.http_limits.validate("http")
        self.metrics_limits.validate("metrics")
        self.grpc_limits.validate()
        self.tls.validate()

    def descriptors_needed(self) -> int:
        """Open files the listeners may hold at their limits, plus RESERVED_FDS."""
        return RESERVED_FDS + self._listener_fds(1.0)

    def _listener_fds(self, scale: float) -> int:
        return sum(fds * _scaled(n, scale) for n, fds in self._listeners())

    def _listeners(self) -> list:
        """(max connections, descriptors per connection) of each listener this server opens."""
        out = [(self.grpc_limits.max_connections, GRPC_FDS_PER_CONNECTION)]
        if self.http_port is not None:
            out.append((self.http_limits.max_connections, 1))
        if self.metrics_port is not None:
            out.append((self.metrics_limits.max_connections, 1))
        return out

    def fitted(self, open_files: int) -> "ServerConfig":
        """These settings with every listener's connection limit scaled down alike, so that
        their descriptors and RESERVED_FDS fit `open_files` (the open-file limit the process
        may have); ValueError where even MIN_CONNECTIONS each would not fit. A flood on one
        listener then never takes the descriptors another, or the model's files, need."""
        budget = open_files - RESERVED_FDS
        full = self._listener_fds(1.0)
        if full <= budget:
            return self
        scale = budget / full
        while scale > 0 and self._listener_fds(scale) > budget:
            scale -= 0.001
        if scale <= 0 or self._listener_fds(scale) > budget:
            raise ValueError(f"an open-file limit of {open_files} leaves too few descriptors for "
                             f"{MIN_CONNECTIONS} connections on each listener after the {RESERVED_FDS} kept for "
                             f"the model's files: raise `ulimit -n`")

        def cut(limits, n):
            return replace(limits, max_connections=_scaled(limits.max_connections, n))
        return replace(self, grpc_limits=cut(self.grpc_limits, scale), http_limits=cut(self.http_limits, scale),
                       metrics_limits=cut(self.metrics_limits, scale))

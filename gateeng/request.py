"""Request parameters and per-request state: plain values, no engine machinery.

`EngineCore.new_request` builds a `Request` with its effective tau, window and
seed; after that, who writes which fields:
  - the scheduler: status, finish_reason, block_table, num_computed,
    num_registered_blocks, num_cached_tokens, prefill_target, num_preemptions,
    first_scheduled_time (and pending_verify, cleared at a finish);
  - the verification stage (engine/verification.py, also on the scheduler's
    preemptions through discard_speculation): the token state, that is tokens
    (cut only through `truncate`, which logs each cut in `cuts`), num_verified,
    logprobs, prompt_logprobs, spec_margins, pending_verify, replay_due,
    pending_age, eager_len, stop_text_len and stats;
  - the output processor: first_token_time, and stats.retractions;
  - the engine core: finish_detail, when a weight update ends the request.
Everyone else reads them. The output's text is the output side's own state
(output_processor.RequestHandle.text), which follows `tokens` and `cuts`."""
from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import Optional

# Mode and StreamPolicy are config's (the determinism vocabulary every wire speaks), read here by requests.
from gateeng.config import DIRECT, Mode, StreamPolicy, validate_threshold, validate_window


class Reason(str, enum.Enum):
    """Why VERIFIED tokens were replayed: a trigger of the margin gate, or the direct
    route, which replays a request's unverified tokens when it moves the request onto
    the invariant plan. A mismatch is counted under the reason that replayed it. The
    values are the `reason` labels of the metrics."""
    MARGIN = "margin"
    ROUTER = "router"   # a mixture of experts' k-th and (k+1)-th router scores within the bound
    WINDOW = "window"
    FINISH = "finish"
    DIRECT = DIRECT


TRIGGERS = (Reason.MARGIN, Reason.ROUTER, Reason.WINDOW, Reason.FINISH)   # the gate's reasons, in the order it checks them


class FinishReason(str, enum.Enum):
    STOP = "stop"      # stop string or stop token id
    LENGTH = "length"  # max_tokens or context end
    EOS = "eos"
    ABORT = "abort"


class Status(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


# Below this temperature a request is greedy: logits / T would overflow float32
# (1e-38 turns every score into inf) long before T reaches 0, and at T < 1e-5 the
# sampled distribution is already the argmax.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20    # top alternatives a request may ask for per token
# The one default for max_tokens: engine API, gRPC server, Python client and CLI.
DEFAULT_MAX_TOKENS = 128
# 2^64 over the golden ratio: the seeds of a request's choices (choice_seed) lie far apart.
CHOICE_SEED_STRIDE = 0x9E3779B97F4A7C15


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request that asks for several choices (OpenAI's
    `n`) with `seed`: seed + index * CHOICE_SEED_STRIDE mod 2^64. Choice 0 keeps the
    request's seed, so n=1 is the plain request, and every choice is a request of its
    own with this seed: a single request with it gives the same choice (bit for bit,
    VERIFIED) and replays it."""
    return (seed + index * CHOICE_SEED_STRIDE) % 2**64


@dataclass
class SamplingParams:
    temperature: float = 0.0      # < GREEDY_TEMPERATURE (0 included) = greedy
    top_p: float = 1.0
    top_k: int = 0                # 0 = off
    seed: Optional[int] = None    # None with temperature > 0: the engine draws one and reports it
    max_tokens: int = DEFAULT_MAX_TOKENS
    stop: tuple = ()
    stop_token_ids: tuple = ()
    ignore_eos: bool = False
    logprobs: Optional[int] = None   # None = off; else each output token's logprob and this many alternatives
    prompt_logprobs: Optional[int] = None   # the same for prompt tokens 1.. (recomputes cached prefixes)

    def validate(self) -> None:
        for name in ("top_k", "max_tokens", "seed", "logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise ValueError(f"{name} must be an integer, got {v!r}")
        if not all(isinstance(s, str) for s in self.stop):
            raise ValueError("stop must be strings")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be integers")
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"{name} must be a number, got {v!r}")
        t = self.temperature
        if t is None or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if self.top_p is None or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_tokens is None or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens!r}")
        if self.seed is not None and not (0 <= self.seed < 2**64):
            raise ValueError(f"seed must be in [0, 2^64), got {self.seed}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not (0 <= k <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}] (alternatives per token), got {k}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def to_dict(self) -> dict:
        """Plain JSON values: what a response carries so that it can be replayed."""
        return {**dataclasses.asdict(self), "stop": list(self.stop), "stop_token_ids": list(self.stop_token_ids)}

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        """The inverse of to_dict; unknown fields are refused, never dropped."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown sampling fields {unknown}; known: {sorted(names)}")
        params = cls(**{**d, "stop": tuple(d.get("stop") or ()),
                        "stop_token_ids": tuple(d.get("stop_token_ids") or ())})
        params.validate()
        return params


@dataclass
class DeterminismParams:
    mode: Mode = Mode.OFF
    margin_threshold: Optional[float] = None   # None = engine default (tau)
    max_window: Optional[int] = None            # None = engine default (W)
    stream_policy: StreamPolicy = StreamPolicy.VERIFIED_ONLY

    def validate(self) -> None:
        if self.margin_threshold is not None:
            validate_threshold(self.margin_threshold)
        if self.max_window is not None:
            validate_window(self.max_window)


@dataclass
class DeterminismStats:
    decode_steps: int = 0        # speculative route: fast-plan decodes the gate looked at
    direct_steps: int = 0        # direct route: decodes run on the invariant plan
    triggers_margin: int = 0
    triggers_router: int = 0
    triggers_window: int = 0
    triggers_finish: int = 0
    verify_passes: int = 0
    replayed_tokens: int = 0
    mismatches: int = 0
    mismatches_margin: int = 0   # mismatches by the trigger that caught them
    mismatches_router: int = 0
    mismatches_window: int = 0
    mismatches_finish: int = 0
    mismatches_direct: int = 0   # found by a direct decode before any trigger
    rolled_back_tokens: int = 0
    retractions: int = 0

    @property
    def triggers(self) -> int:
        return self.triggers_margin + self.triggers_router + self.triggers_window + self.triggers_finish

    @staticmethod
    def trigger_field(reason: Reason) -> str:
        """The field that counts the gate's triggers for `reason`."""
        return TRIGGER_FIELDS[reason]

    @staticmethod
    def mismatch_field(reason: Reason) -> str:
        """The field that counts the mismatches replayed for `reason`."""
        return MISMATCH_FIELDS[reason]

    def add(self, name: str, n: int = 1) -> None:
        setattr(self, name, getattr(self, name) + n)

    def snapshot(self) -> "DeterminismStats":
        return dataclasses.replace(self)


TRIGGER_FIELDS = {Reason.MARGIN: "triggers_margin", Reason.ROUTER: "triggers_router",
                  Reason.WINDOW: "triggers_window", Reason.FINISH: "triggers_finish"}
MISMATCH_FIELDS = {Reason.MARGIN: "mismatches_margin", Reason.ROUTER: "mismatches_router",
                   Reason.WINDOW: "mismatches_window",
                   Reason.FINISH: "mismatches_finish", Reason.DIRECT: "mismatches_direct"}


@dataclass
class Request:
    request_id: str
    prompt_ids: list
    params: SamplingParams
    det: DeterminismParams
    arrival: float = 0.0
    tokens: list = field(default_factory=list)   # prompt + output
    num_computed: int = 0       # positions whose KV is written (by either plan)
    num_verified: int = 0       # leading tokens that are final
    block_table: list = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_registered_blocks: int = 0
    prefill_target: int = 0     # VERIFIED: positions below this are computed on the invariant plan
    status: Status = Status.WAITING
    finish_reason: Optional[FinishReason] = None
    stop_text_len: Optional[int] = None  # output text is cut here when a stop string matched
    pending_verify: Optional[Reason] = None   # the trigger's reason while a replay is pending
    replay_due: bool = False    # the pending replay may not wait (window reached, or a finish ahead)
    pending_age: int = 0        # steps a margin-triggered replay has waited for company
    spec_margins: list = field(default_factory=list)   # fast margins of tokens[num_verified:]
    eager_len: int = 0          # EAGER: output tokens that may be sent before verification
    stats: DeterminismStats = field(default_factory=DeterminismStats)
    tau: float = 0.0            # effective margin threshold
    window: int = 1             # effective max window
    seed: int = 0               # effective sampling seed
    # The engine's clock (time.monotonic on the driving thread): the scheduler stamps the
    # first admission, the output processor the first token sent.
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    num_preemptions: int = 0
    # The lengths `tokens` was cut back to, oldest first (one per cut, by `truncate`):
    # whoever follows the tokens incrementally (the output's text) learns of a
    # rollback here, keeping its own place in the list.
    cuts: list = field(default_factory=list)
    # With params.logprobs: a sampler.Logprobs per output token (output order).
    logprobs: list = field(default_factory=list)
    # With params.prompt_logprobs: one per prompt token after the first.
    prompt_logprobs: list = field(default_factory=list)
    # Why the request ended where finish_reason alone does not say (an abort by a
    # weight update); '' otherwise.
    finish_detail: str = ""

    def __post_init__(self):
        if not self.tokens:
            self.tokens = list(self.prompt_ids)
        if not self.num_verified:
            self.num_verified = len(self.tokens)

    def truncate(self, n: int) -> None:
        """Drop tokens[n:] (a rollback, a stop, discarded speculation); every cut of
        `tokens` goes through here and is logged in `cuts`, so the output text follows."""
        if n < len(self.tokens):
            self.cuts.append(n)
        del self.tokens[n:]
        del self.logprobs[max(0, n - self.num_prompt):]

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_ids(self) -> list:
        return self.tokens[self.num_prompt:]

    @property
    def mode(self) -> Mode:
        return self.det.mode

    @property
    def canonical_len(self) -> int:
        """Positions whose KV was written by the invariant plan from final tokens."""
        if self.mode is Mode.OFF:
            return 0
        return min(self.num_computed, self.num_verified - 1)

    @property
    def num_unverified(self) -> int:
        return len(self.tokens) - self.num_verified

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def emit_limit(self) -> int:
        """How many output tokens the client may have seen by now."""
        verified_out = self.num_verified - self.num_prompt
        if self.mode is Mode.VERIFIED and self.det.stream_policy is StreamPolicy.EAGER:
            return max(verified_out, self.eager_len)
        return verified_out

"""What the engine hands back to callers: stream events and the final completion."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from gateeng.request import DeterminismStats, FinishReason, Mode, SamplingParams

if TYPE_CHECKING:   # the record is built by the engine core (reproducibility imports torch)
    from gateeng.reproducibility import Reproducibility


@dataclass
class Chunk:
    token_ids: list
    text: str
    position: int          # output index of token_ids[0]
    logprobs: list = field(default_factory=list)   # sampler.Logprobs per token, if asked for
    weight_version: int = 0   # the weights that computed token_ids (the record's weight_version)


@dataclass
class Rollback:
    position: int          # output tokens from this index on are withdrawn


@dataclass
class Completion:
    request_id: str
    token_ids: list
    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int
    mode: Mode
    margin_threshold: float
    sampling: SamplingParams   # as run: the seed the engine drew filled in (None for greedy)
    stats: DeterminismStats = field(default_factory=DeterminismStats)
    reproducibility: Optional[Reproducibility] = None   # what the bits depend on (shared, immutable)
    logprobs: list = field(default_factory=list)   # sampler.Logprobs per token, if asked for
    prompt_logprobs: list = field(default_factory=list)   # per prompt token after the first, if asked for
    prompt_ids: list = field(default_factory=list)
    finish_detail: str = ""   # why it ended where finish_reason alone does not say ('' otherwise)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seed(self) -> Optional[int]:
        """The seed used; None for greedy (no seed used)."""
        return self.sampling.seed

"""The HTTP front's reading of a request, the peer of edge.py: a JSON body becomes
the values a request runs with (prompts, `n`, the stream options, SamplingParams,
DeterminismParams, echo and logprobs, the tokenize routes' input), checked by
checks.py exactly as the gRPC front's are. Pure functions of the body and the
bounds they are given: no sockets, no engine, nothing from Starlette.

Fail closed: an unknown field, an OpenAI option we do not implement (at any value
but its "off"), a field of the wrong type or an unknown determinism mode is
refused, never ignored or coerced. Every refusal is a Refusal (INVALID, or
NOT_FOUND for a model not served here) whose message names the field.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Optional

from gateeng.config import HTTP_MAX_CHOICES, HTTP_MAX_N, GateBounds
from gateeng.request import DeterminismParams, SamplingParams, StreamPolicy
from gateeng.serving import checks
from gateeng.serving.refusals import Kind, Refusal

# Accepted, and ignored because they change nothing here.
HARMLESS = {"user"}
# OpenAI options we do not implement: accepted only at the value that means "off".
OFF_VALUES = {"best_of": 1, "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None,
              "suffix": None, "tools": None, "tool_choice": None, "parallel_tool_calls": None}
COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "stream", "stream_options",
          "determinism", "ignore_eos", "n"}
COMPLETION_FIELDS = COMMON | {"prompt", "logprobs", "echo"}
CHAT_FIELDS = COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens", "response_format"}
TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt"}
DETOKENIZE_FIELDS = {"model", "tokens"}
COMPLETION_MAX_TOKENS = 16   # OpenAI's default for /v1/completions


@dataclasses.dataclass(frozen=True)
class Generation:
    """What a completions or chat request asks for: each prompt (a chat request's
    one list of messages) is decoded `n` times with `sampling` and `determinism`.
    `logprobs` is the number of alternatives per token (None: no logprobs)."""
    prompts: list
    n: int
    stream: bool
    include_usage: bool
    sampling: SamplingParams
    determinism: DeterminismParams
    logprobs: Optional[int] = None
    echo: bool = False


def parse(raw: bytes, allowed: set, model_name: str) -> dict:
    """The body as a JSON object whose fields are all `allowed` (or harmless, or an
    unimplemented option at its "off"), naming `model_name` or no model."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise Refusal(Kind.INVALID, f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise Refusal(Kind.INVALID, "the body must be a JSON object")
    for key, value in body.items():
        if key in allowed or key in HARMLESS:
            continue
        if key in OFF_VALUES:
            off = value is None or value in ([], {}) or (not isinstance(value, bool) and value == OFF_VALUES[key])
            if not off:
                raise Refusal(Kind.INVALID, f"`{key}` = {value!r} is not supported by this server", param=key)
            continue
        raise Refusal(Kind.INVALID, f"unknown field `{key}`; supported: {', '.join(sorted(allowed))}", param=key)
    model = body.get("model")
    if model not in (None, model_name):
        raise Refusal(Kind.NOT_FOUND, f"model {model!r} is not served here; this server serves {model_name!r}",
                      param="model", code="model_not_found")
    return body


# ---- the generation routes ----------------------------------------------------------
def completion(body: dict, max_model_len: int, default_mode: str, bounds: GateBounds) -> Generation:
    """/v1/completions: `prompt` (one or a list), `logprobs` as an integer, `echo`."""
    prompt_list = prompts(body.get("prompt"))
    k = checks.integer(body.get("logprobs"), "logprobs")
    echo = checks.boolean(body.get("echo"), "echo") or False
    streamed, usage = stream(body)
    if echo and streamed:
        raise Refusal(Kind.INVALID, "`echo` is not served on a stream (the prompt's logprobs come with the "
                                    "whole answer); ask without `stream`", param="echo")
    params = sampling(body, max_model_len, COMPLETION_MAX_TOKENS, logprobs=k,
                      prompt_logprobs=k if echo and k is not None else None)
    det = determinism(body, default_mode, bounds)
    return Generation(prompt_list, n(body, len(prompt_list)), streamed, usage, params, det, k, echo)


def chat(body: dict, max_model_len: int, default_mode: str, bounds: GateBounds) -> Generation:
    """/v1/chat/completions: `messages`, `logprobs` as a flag with `top_logprobs`,
    `response_format` text only. An unset max_tokens is half the context."""
    messages = checks.messages(body.get("messages"))
    response_format(body.get("response_format"))
    k = None
    if checks.boolean(body.get("logprobs"), "logprobs"):
        k = checks.integer(body.get("top_logprobs"), "top_logprobs") or 0
    elif body.get("top_logprobs") is not None:
        raise Refusal(Kind.INVALID, "`top_logprobs` needs `logprobs: true`", param="top_logprobs")
    streamed, usage = stream(body)
    params = sampling(body, max_model_len, max(1, max_model_len // 2), logprobs=k)
    det = determinism(body, default_mode, bounds)
    return Generation([messages], n(body, 1), streamed, usage, params, det, k)


def prompts(value) -> list:
    """The prompts of a completions request: a string, a list of token ids, or a
    list of either (one choice each, as OpenAI serves a batch)."""
    if isinstance(value, str) or (isinstance(value, list) and value and not isinstance(value[0], (str, list))):
        value = [value]
    if not isinstance(value, list) or not value:
        raise Refusal(Kind.INVALID, "prompt must be a string, a list of token ids, or a non-empty list of either",
                      param="prompt")
    out = []
    for i, p in enumerate(value):
        if isinstance(p, list):
            out.append(checks.token_ids(p, f"prompt[{i}]" if len(value) > 1 else "prompt"))
        elif isinstance(p, str):   # text is checked with its size, in Gateway.start
            out.append(p)
        else:
            raise Refusal(Kind.INVALID, f"prompt[{i}] must be a string or a list of token ids", param="prompt")
    return out


def n(body: dict, prompt_count: int) -> int:
    """OpenAI's `n`: choices per prompt, 1 to HTTP_MAX_N, and HTTP_MAX_CHOICES in all."""
    value = checks.integer(body.get("n"), "n")
    value = 1 if value is None else value
    if not 1 <= value <= HTTP_MAX_N:
        raise Refusal(Kind.INVALID, f"`n` must be in [1, {HTTP_MAX_N}], got {value}", param="n")
    if prompt_count * value > HTTP_MAX_CHOICES:
        raise Refusal(Kind.INVALID, f"{prompt_count} prompts x n={value} is {prompt_count * value} choices; at "
                                    f"most {HTTP_MAX_CHOICES} per request: split it", param="n")
    return value


def stream(body: dict) -> tuple:
    """(stream, include_usage). stream_options needs a stream (as OpenAI)."""
    streamed = checks.boolean(body.get("stream"), "stream") or False
    options = body.get("stream_options")
    if options is None:
        return streamed, False
    if not streamed:
        raise Refusal(Kind.INVALID, "`stream_options` is only allowed with `stream: true`", param="stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise Refusal(Kind.INVALID, "`stream_options` supports only `include_usage`", param="stream_options")
    return True, bool(checks.boolean(options.get("include_usage"), "stream_options.include_usage"))


def response_format(value) -> None:
    """Only {"type": "text"} (or none): we constrain no output to a schema."""
    if value is not None and value != {"type": "text"}:
        kind = value.get("type") if isinstance(value, dict) else value
        raise Refusal(Kind.INVALID, f"response_format {kind!r} is not supported; only {{\"type\": \"text\"}}",
                      param="response_format")


def sampling(body: dict, max_model_len: int, max_tokens_default: int, logprobs=None,
             prompt_logprobs=None) -> SamplingParams:
    """OpenAI's sampling fields (temperature 1 where unset), checked by
    checks.sampling as gRPC's are; max_completion_tokens before max_tokens."""
    fields = {key: body.get(key) for key in ("temperature", "top_p", "top_k", "seed", "stop", "ignore_eos")}
    fields.update(max_tokens=body.get("max_completion_tokens", body.get("max_tokens")), logprobs=logprobs,
                  prompt_logprobs=prompt_logprobs)
    return checks.sampling(fields, max_model_len, temperature=1.0, max_tokens=max_tokens_default)


def determinism(body: dict, default_mode: str, bounds: GateBounds) -> DeterminismParams:
    """The `determinism` extension: a mode named in checks.MODES (`default_mode`,
    --http-default-mode, where none is named), the gate's overrides, and
    verified_only streaming, the only policy an OpenAI stream can keep."""
    d = body.get("determinism")
    if d is None:
        d = {}
    if not isinstance(d, dict):
        raise Refusal(Kind.INVALID, f"`determinism` must be an object or null, got {type(d).__name__}",
                      param="determinism")
    unknown = set(d) - {"mode", "margin_threshold", "max_window", "stream_policy"}
    if unknown:
        raise Refusal(Kind.INVALID, f"unknown determinism fields {sorted(unknown)}", param="determinism")
    mode = d.get("mode", default_mode)
    if not isinstance(mode, str) or mode not in checks.MODES:
        raise Refusal(Kind.INVALID, f"determinism.mode {mode!r} is not known; known: {', '.join(checks.MODES)}",
                      param="determinism.mode")
    if d.get("stream_policy", StreamPolicy.VERIFIED_ONLY.value) != StreamPolicy.VERIFIED_ONLY.value:
        raise Refusal(Kind.INVALID, "determinism.stream_policy: only verified_only; an OpenAI stream has no way "
                                    "to withdraw tokens (EAGER needs gRPC's rollback events)",
                      param="determinism.stream_policy")
    return checks.determinism(checks.MODES[mode], d.get("margin_threshold"), d.get("max_window"),
                              StreamPolicy.VERIFIED_ONLY, bounds)


# ---- the tokenizer routes -----------------------------------------------------------
def tokenize_input(body: dict) -> tuple:
    """/tokenize's (prompt, chat): the ids the completions route (`prompt`, text) or
    the chat route (`messages`, with the generation prompt) would decode from."""
    if ("prompt" in body) == ("messages" in body):
        raise Refusal(Kind.INVALID, "send `prompt` (text) or `messages`, one of them", param="prompt")
    if "messages" in body:
        if checks.boolean(body.get("add_generation_prompt"), "add_generation_prompt") is False:
            raise Refusal(Kind.INVALID, "`add_generation_prompt` false is not supported: the chat route always "
                                        "opens the assistant's turn", param="add_generation_prompt")
        prompt, is_chat = checks.messages(body["messages"]), True
    else:
        prompt, is_chat = body["prompt"], False
        if not isinstance(prompt, str):
            raise Refusal(Kind.INVALID, "`prompt` must be a string", param="prompt")
    # The completions route adds no special tokens to a text prompt; asking for
    # them here would count ids that route never decodes from.
    if checks.boolean(body.get("add_special_tokens"), "add_special_tokens"):
        raise Refusal(Kind.INVALID, "`add_special_tokens` true is not supported: /v1/completions adds none to "
                                    "a text prompt", param="add_special_tokens")
    return prompt, is_chat


def detokenize_ids(body: dict, vocab_size: int) -> list:
    """/detokenize's `tokens`: integer ids within the vocabulary."""
    ids = checks.token_ids(body.get("tokens"), "tokens")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise Refusal(Kind.INVALID, f"token ids {bad[:8]} are outside the vocabulary [0, {vocab_size})",
                      param="tokens")
    return ids

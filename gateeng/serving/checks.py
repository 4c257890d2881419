"""The one request-checking path both fronts use, once each has read its own wire
format into plain Python values (grpc_edge.py for protobuf, http_edge.py for JSON):
strict types, the prompt's size before anything is tokenized, the sampling
fields and their bounds, and the determinism field with the names of its modes.

Strict means: a boolean is a JSON boolean, an integer is an integer (not 2.7,
not `true`), a number is finite, a string holds no lone surrogate (JSON can
spell one, UTF-8 cannot). Every refusal is a BadRequest whose message names the
field and what is allowed (refusals.from_engine makes it INVALID_ARGUMENT /
HTTP 400).
"""
from __future__ import annotations

import math
from typing import Optional

from gateeng.config import REQUEST_MODES, GateBounds
from gateeng.request import DEFAULT_MAX_TOKENS, DeterminismParams, Mode, SamplingParams, StreamPolicy

MAX_REQUEST_ID_BYTES = 128
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_BYTES = 256
MAX_STOP_TOKEN_IDS = 64
MAX_MESSAGES = 256


class BadRequest(ValueError):
    def __init__(self, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.param, self.code = param, code


# ---- strict types ----------------------------------------------------------------
def integer(value, field: str):
    """An integer or None (unset); a boolean or a float is not one."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise BadRequest(f"{field} must be an integer, got {value!r}", param=field)
    return value


def number(value, field: str):
    """A finite number or None (unset)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"{field} must be a number, got {value!r}", param=field)
    try:
        value = float(value)
    except OverflowError:     # an integer past float's range
        value = math.inf
    if not math.isfinite(value):
        raise BadRequest(f"{field} must be a finite number, got {value}", param=field)
    return value


def boolean(value, field: str):
    """true, false, or None (unset)."""
    if value is not None and not isinstance(value, bool):
        raise BadRequest(f"{field} must be true or false, got {value!r}", param=field)
    return value


def utf8(value, field: str) -> bytes:
    """A string's UTF-8 bytes; refused if it is not a string or holds a lone surrogate."""
    if not isinstance(value, str):
        raise BadRequest(f"{field} must be a string, got {type(value).__name__}", param=field)
    try:
        return value.encode()
    except UnicodeEncodeError as e:
        raise BadRequest(f"{field} holds a lone surrogate ({value[e.start]!r} at character {e.start}), which is "
                         f"not text: send valid UTF-8", param=field) from None


def text(value, field: str) -> str:
    """A string that UTF-8 can encode."""
    utf8(value, field)
    return value


def token_ids(value, field: str = "prompt") -> list:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise BadRequest(f"{field} must be a list of integer token ids", param=field)
    return value


def messages(value, field: str = "messages") -> list:
    """A list of {"role", "content"} objects ("name" is accepted and dropped). A
    content is a string or a list of text parts ({"type": "text", "text": ...}),
    which are joined with newlines, as vLLM joins them; a part of another type is
    refused by name. Which roles are known is the engine's to say."""
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise BadRequest(f"{field} must be a list of {{role, content}} objects", param=field)
    out = []
    for i, m in enumerate(value):
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise BadRequest(f"{field}[{i}] has fields {sorted(extra)}; supported: role, content", param=field)
        for key in ("role", "content"):
            if key not in m:
                raise BadRequest(f"{field}[{i}] has no `{key}`", param=field)
        out.append({"role": text(m["role"], f"{field}[{i}].role"),
                    "content": content(m["content"], f"{field}[{i}].content")})
    return out


def content(value, field: str) -> str:
    """A message's content: a string, or a list of text parts joined with newlines."""
    if not isinstance(value, list):
        return text(value, field)
    texts = []
    for j, part in enumerate(value):
        where = f"{field}[{j}]"
        if not isinstance(part, dict) or "type" not in part:
            raise BadRequest(f"{where} must be a {{type, text}} object", param=field)
        if part["type"] != "text":
            raise BadRequest(f"{where} is of type {part['type']!r}; this server reads only text parts", param=field)
        extra = set(part) - {"type", "text"}
        if extra or "text" not in part:
            raise BadRequest(f"{where}: a text part has exactly `type` and `text`", param=field)
        texts.append(text(part["text"], f"{where}.text"))
    return "\n".join(texts)


def strings(value, field: str) -> tuple:
    """A string or a list of strings, as a tuple; None is ()."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) for s in value):
        raise BadRequest(f"{field} must be a string or a list of strings", param=field)
    return tuple(text(s, field) for s in value)


# ---- sizes, before tokenizing -------------------------------------------------------
def prompt_size(prompt, max_prompt_bytes: int, max_model_len: int) -> None:
    """The prompt's bytes (text, messages) or length (token ids), cheap to measure
    and checked before any tokenizing: a prompt past --max-prompt-bytes is far
    longer than the context holds."""
    limit = (f"this server accepts at most {max_prompt_bytes} (--max-prompt-bytes), far more than a "
             f"{max_model_len}-token context holds: shorten the prompt")
    if isinstance(prompt, str):
        size = len(utf8(prompt, "prompt"))
        if size > max_prompt_bytes:
            raise BadRequest(f"prompt text is {size} bytes; {limit}", param="prompt", code="context_length_exceeded")
    elif prompt and isinstance(prompt[0], dict):
        if len(prompt) > MAX_MESSAGES:
            raise BadRequest(f"messages has {len(prompt)} turns; at most {MAX_MESSAGES}", param="messages")
        size = sum(len(m["content"].encode()) + len(m["role"].encode()) for m in prompt)
        if size > max_prompt_bytes:
            raise BadRequest(f"messages are {size} bytes; {limit}", param="messages",
                             code="context_length_exceeded")
    elif len(prompt) >= max_model_len:
        raise BadRequest(f"prompt has {len(prompt)} tokens but the context holds {max_model_len}: shorten the "
                         f"prompt", param="prompt", code="context_length_exceeded")


# ---- sampling -----------------------------------------------------------------------
def sampling(fields: dict, max_model_len: int, prefix: str = "", temperature: float = 0.0,
             max_tokens: int = DEFAULT_MAX_TOKENS) -> SamplingParams:
    """SamplingParams from the fields a request set (None or absent = unset);
    `prefix` names them as the front spells them ("sampling." for gRPC).
    `temperature` and `max_tokens` are the front's defaults; an unset max_tokens
    is clamped to what the context can hold, an explicit one past it is refused."""
    def get(name, check):
        return check(fields.get(name), prefix + name)

    n = get("max_tokens", integer)
    if n is not None and n >= max_model_len:
        raise BadRequest(f"{prefix}max_tokens {n} exceeds the context ({max_model_len} tokens, the prompt "
                         f"included): ask for at most {max_model_len - 1}", param=prefix + "max_tokens",
                         code="context_length_exceeded")
    stop = get("stop", strings)
    if len(stop) > MAX_STOP_STRINGS:
        raise BadRequest(f"{prefix}stop has {len(stop)} strings; at most {MAX_STOP_STRINGS}", param=prefix + "stop")
    for s in stop:
        if len(s.encode()) > MAX_STOP_STRING_BYTES:
            raise BadRequest(f"a {prefix}stop string is {len(s.encode())} bytes; at most {MAX_STOP_STRING_BYTES}",
                             param=prefix + "stop")
    stop_ids = tuple(fields.get("stop_token_ids") or ())
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise BadRequest(f"{prefix}stop_token_ids has {len(stop_ids)} ids; at most {MAX_STOP_TOKEN_IDS}",
                         param=prefix + "stop_token_ids")
    for t in stop_ids:
        integer(t, prefix + "stop_token_ids")

    def given(value, default):
        return default if value is None else value
    params = SamplingParams(
        temperature=given(get("temperature", number), temperature), top_p=given(get("top_p", number), 1.0),
        top_k=given(get("top_k", integer), 0), seed=get("seed", integer),
        max_tokens=given(n, max(1, min(max_tokens, max_model_len - 1))), stop=stop, stop_token_ids=stop_ids,
        ignore_eos=given(get("ignore_eos", boolean), False), logprobs=get("logprobs", integer),
        prompt_logprobs=get("prompt_logprobs", integer))
    try:
        params.validate()
    except ValueError as e:
        raise BadRequest(f"{prefix}{e}") from None
    return params


# ---- determinism --------------------------------------------------------------------
# The modes a request may ask for, by the name both fronts spell: HTTP's
# `determinism.mode` values, and the proto's Determinism.Mode as MODE_<NAME>
# (MODE_UNSPECIFIED is off). REFERENCE is never asked for: it is every request's
# mode on an engine that runs only the invariant plan.
MODES = {name: Mode(name) for name in REQUEST_MODES}


def determinism(mode: Mode, tau: Optional[float], window: Optional[int], stream_policy: StreamPolicy,
                bounds: GateBounds) -> DeterminismParams:
    """A request's determinism, with its gate overrides checked against the server's
    bounds: tau a finite number >= 0, W an integer, both within GateBounds."""
    tau = number(tau, "determinism.margin_threshold")
    window = integer(window, "determinism.max_window")
    try:
        bounds.check(tau, window)
    except ValueError as e:
        raise BadRequest(str(e), param="determinism") from None
    return DeterminismParams(mode=mode, margin_threshold=tau, max_window=window, stream_policy=stream_policy)

"""Request checks at the gRPC edge, cheapest first, before anything is tokenized:
the protobuf itself (unknown fields and enum values), sizes, and the conversion
to the engine's parameters (checks.py holds what the HTTP front shares).

Fail closed: a request that asks for something this server does not understand
(an unknown enum value, a field from a newer API version) is refused, never
served with a weaker guarantee. Every refusal is a BadRequest whose message
names the field and what is allowed.
"""
from __future__ import annotations

from google.protobuf import message as pb_message
from google.protobuf import unknown_fields

from gateeng.config import GateBounds
from gateeng.request import DEFAULT_MAX_TOKENS, DeterminismParams, Mode, SamplingParams, StreamPolicy
from gateeng.serving import checks
from gateeng.serving.checks import MAX_MESSAGES, MAX_REQUEST_ID_BYTES, MAX_STOP_TOKEN_IDS, BadRequest
from gateeng.v1 import engine_pb2 as pb

__all__ = ["BadRequest", "parse", "check_generate", "prompt_from_proto", "sampling_from_proto",
           "determinism_from_proto"]


def parse(cls, raw: bytes):
    """Parse a request message; malformed bytes or invalid UTF-8 in a string field
    are the client's error, not the server's."""
    try:
        msg = cls.FromString(raw)
    except pb_message.DecodeError as e:
        raise BadRequest(f"malformed {cls.DESCRIPTOR.name}: {e} (string fields must be valid UTF-8)") from None
    _refuse_unknown(msg, cls.DESCRIPTOR.name)
    return msg


def _refuse_unknown(msg, path: str) -> None:
    """Unknown fields and unknown enum values, anywhere in the message."""
    if len(unknown_fields.UnknownFieldSet(msg)):
        numbers = sorted({f.field_number for f in unknown_fields.UnknownFieldSet(msg)})
        raise BadRequest(f"{path} has fields this server does not know (numbers {numbers}); "
                         f"upgrade the server or drop them")
    for field, value in msg.ListFields():
        name = f"{path}.{field.name}"
        if field.enum_type is not None:
            known = dict((v.number, v.name) for v in field.enum_type.values)
            values = value if field.is_repeated else [value]
            for v in values:
                if v not in known:
                    listed = ", ".join(f"{n} ({k})" for k, n in sorted(known.items()))
                    raise BadRequest(f"{name} = {v} is not a known value; known values: {listed}")
        elif field.message_type is not None:
            for sub in (value if field.is_repeated else [value]):
                _refuse_unknown(sub, name)


def check_generate(req: pb.GenerateRequest, max_prompt_bytes: int, max_model_len: int) -> None:
    """Size limits: cheap checks on bytes and counts, before any tokenizing."""
    if len(req.request_id.encode()) > MAX_REQUEST_ID_BYTES:
        raise BadRequest(f"request_id is {len(req.request_id.encode())} bytes; at most {MAX_REQUEST_ID_BYTES}")
    which = req.WhichOneof("input")
    if which is None:
        raise BadRequest("set `text`, `token_ids` or `messages` as the input")
    if which == "token_ids" and req.chat:
        raise BadRequest("`chat` applies a template to text; send `text` or set chat=false")
    if which == "text" and len(req.text.encode()) > max_prompt_bytes:
        raise BadRequest(f"prompt text is {len(req.text.encode())} bytes; this server accepts at most "
                         f"{max_prompt_bytes} (--max-prompt-bytes), far more than a {max_model_len}-token "
                         f"context holds: shorten the prompt")
    if which == "messages":
        msgs = req.messages.messages
        if len(msgs) > MAX_MESSAGES:
            raise BadRequest(f"messages has {len(msgs)} turns; at most {MAX_MESSAGES}")
        size = sum(len(m.content.encode()) + len(m.role.encode()) for m in msgs)
        if size > max_prompt_bytes:
            raise BadRequest(f"messages are {size} bytes; this server accepts at most {max_prompt_bytes} "
                             f"(--max-prompt-bytes), far more than a {max_model_len}-token context holds")
    if which == "token_ids" and len(req.token_ids.ids) >= max_model_len:
        raise BadRequest(f"prompt has {len(req.token_ids.ids)} tokens but the context holds {max_model_len}: "
                         f"shorten the prompt")
    sp = req.sampling
    checks.stop_strings(tuple(sp.stop))
    if len(sp.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise BadRequest(f"sampling.stop_token_ids has {len(sp.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS}")


def prompt_from_proto(req: pb.GenerateRequest):
    """The engine's prompt: text, token ids, or a list of {"role", "content"} messages."""
    which = req.WhichOneof("input")
    if which == "text":
        return req.text
    if which == "token_ids":
        return list(req.token_ids.ids)
    return [{"role": m.role, "content": m.content} for m in req.messages.messages]


def sampling_from_proto(sp: pb.SamplingParams) -> SamplingParams:
    def opt(name, default):
        return getattr(sp, name) if sp.HasField(name) else default
    return SamplingParams(temperature=opt("temperature", 0.0), top_p=opt("top_p", 1.0), top_k=opt("top_k", 0),
                          seed=opt("seed", None), max_tokens=opt("max_tokens", DEFAULT_MAX_TOKENS),
                          stop=tuple(sp.stop), stop_token_ids=tuple(sp.stop_token_ids), ignore_eos=sp.ignore_eos,
                          logprobs=opt("logprobs", None), prompt_logprobs=opt("prompt_logprobs", None))


def determinism_from_proto(d: pb.Determinism, bounds: GateBounds) -> DeterminismParams:
    return checks.determinism(
        Mode.VERIFIED if d.mode == pb.Determinism.MODE_VERIFIED else Mode.OFF,
        d.margin_threshold if d.HasField("margin_threshold") else None,
        d.max_window if d.HasField("max_window") else None,
        StreamPolicy.EAGER if d.stream_policy == pb.Determinism.EAGER else StreamPolicy.VERIFIED_ONLY, bounds)

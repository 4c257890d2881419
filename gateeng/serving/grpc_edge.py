"""The gRPC front's reading of a request, cheapest first, before anything is
tokenized: the protobuf itself (malformed bytes, unknown fields and enum
values), the request id and the input's shape, then the conversion to plain
values that checks.py checks exactly as it does the HTTP front's.

Fail closed: a request that asks for something this server does not understand
(an unknown enum value, a field from a newer API version) is refused, never
served with a weaker guarantee. Every refusal is a BadRequest whose message
names the field and what is allowed.
"""
from __future__ import annotations

from google.protobuf import message as pb_message
from google.protobuf import unknown_fields

from gateeng.config import GateBounds
from gateeng.request import DeterminismParams, Mode, SamplingParams, StreamPolicy
from gateeng.serving import checks
from gateeng.serving.checks import MAX_REQUEST_ID_BYTES, BadRequest
from gateeng.v1 import engine_pb2 as pb

__all__ = ["BadRequest", "parse", "check_generate", "prompt_from_proto", "sampling_from_proto",
           "mode_from_proto", "determinism_from_proto"]


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


def check_generate(req: pb.GenerateRequest) -> None:
    """What only a GenerateRequest can get wrong: the request id and the input's
    shape. Sizes and values are checks.py's, shared with the HTTP front."""
    if len(req.request_id.encode()) > MAX_REQUEST_ID_BYTES:
        raise BadRequest(f"request_id is {len(req.request_id.encode())} bytes; at most {MAX_REQUEST_ID_BYTES}")
    which = req.WhichOneof("input")
    if which is None:
        raise BadRequest("set `text`, `token_ids` or `messages` as the input")
    if which == "token_ids" and req.chat:
        raise BadRequest("`chat` applies a template to text; send `text` or set chat=false")


def prompt_from_proto(req: pb.GenerateRequest):
    """The engine's prompt: text, token ids, or a list of {"role", "content"} messages."""
    which = req.WhichOneof("input")
    if which == "text":
        return req.text
    if which == "token_ids":
        return list(req.token_ids.ids)
    return [{"role": m.role, "content": m.content} for m in req.messages.messages]


def sampling_from_proto(sp: pb.SamplingParams, max_model_len: int) -> SamplingParams:
    """The fields the client set (proto3 `optional` presence), checked as the
    HTTP front's are; greedy and DEFAULT_MAX_TOKENS where unset."""
    fields = {f.name: value for f, value in sp.ListFields()}
    fields["stop"] = tuple(sp.stop)
    return checks.sampling(fields, max_model_len, prefix="sampling.")


def mode_from_proto(mode: int) -> Mode:
    """Determinism.Mode by its name in checks.MODES (MODE_VERIFIED is "verified");
    MODE_UNSPECIFIED is off."""
    if mode == pb.Determinism.MODE_UNSPECIFIED:
        return Mode.OFF
    return checks.MODES[pb.Determinism.Mode.Name(mode).removeprefix("MODE_").lower()]


def determinism_from_proto(d: pb.Determinism, bounds: GateBounds) -> DeterminismParams:
    return checks.determinism(
        mode_from_proto(d.mode),
        d.margin_threshold if d.HasField("margin_threshold") else None,
        d.max_window if d.HasField("max_window") else None,
        StreamPolicy.EAGER if d.stream_policy == pb.Determinism.EAGER else StreamPolicy.VERIFIED_ONLY, bounds)

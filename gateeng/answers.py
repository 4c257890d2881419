"""Answers as a client holds them: the one reader of what a VERIFIED answer records.

An answer is the body of the HTTP front's answer (/v1/completions or
/v1/chat/completions, not streamed), one of its choices, the openai client's object
for either, a gRPC CompleteResponse (the message, or as JSON: what `gateeng generate
--json` prints), or a list of any of these. Each choice of an HTTP answer carries its
own record (`replay`, `reproducibility`, `determinism`), whatever `n` is; a
one-choice answer also carries them at its top level, and an answer from before
choices carried them is read from there.

`read_all` turns each into one `Answer` per choice: the prompt's token ids (after any
chat template), the sampling parameters as run (the drawn seed filled in), the output
ids, the logprobs where they were asked for, the determinism mode and the
Reproducibility record as stored. `gateeng replay` decodes them again; the trainer's
`Policy.logprobs_from` rescores them. Anything that lacks what they need is refused
with BadAnswer, naming what is missing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

from google.protobuf import json_format
from google.protobuf.message import Message

from gateeng.request import Mode, SamplingParams
from gateeng.v1 import engine_pb2 as pb

# The modes whose bits are the reference's: a VERIFIED answer, or a plan=invariant server's.
PROMISED = (Mode.VERIFIED.value, Mode.REFERENCE.value)
HTTP_KINDS = ("text_completion", "chat.completion")
# A choice's own fields: each choice carries them; a one-choice answer also at its top.
OWN_FIELDS = ("replay", "reproducibility", "determinism")


class BadAnswer(ValueError):
    """An answer lacks something its reader needs, or is not an answer at all."""


@dataclass(frozen=True)
class Logprob:
    value: float
    top: tuple                 # ((token id, or its text where only text was stored), value), most likely first
    text: Optional[str] = None  # the token's text, where the response showed it


@dataclass(frozen=True)
class Answer:
    label: str
    mode: str                  # off | verified | reference
    prompt_ids: list
    sampling: SamplingParams
    output_ids: list
    logprobs: Optional[list]   # Logprob per output token, None if not asked for
    record: dict               # the Reproducibility fields as stored

    @property
    def promised(self) -> bool:
        """Whether its bits are the reference's (VERIFIED or REFERENCE)."""
        return self.mode in PROMISED


def json_logprob(v: float) -> float:
    """A logprob as the HTTP front writes it: JSON has no -inf, so a token top-k or top-p
    removed gets the most negative float."""
    return v if math.isfinite(v) else -3.4028234663852886e38


def sampling_from_proto(sp: pb.SamplingParams) -> SamplingParams:
    """The inverse of the gRPC client's sampling_proto (unset fields take SamplingParams' defaults)."""
    fields = {f.name: value for f, value in sp.ListFields()}
    return SamplingParams.from_dict({**fields, "stop": list(sp.stop), "stop_token_ids": list(sp.stop_token_ids)})


def read_all(answers, label: str = "answer") -> list:
    """One Answer per choice of `answers` (one answer or a list of them, in any of the
    shapes above), in order; the first that cannot be read raises BadAnswer, naming it."""
    items = list(answers) if isinstance(answers, (list, tuple)) else [answers]
    if not items:
        raise BadAnswer("no answers given")
    out = []
    for i, item in enumerate(items):
        name = f"{label} {i}" if len(items) > 1 else label
        for one_label, one in each_choice(name, plain(item)):
            if isinstance(one, BadAnswer):
                raise BadAnswer(f"{one_label}: {one}")
            out.append(parse(one, one_label))
    return out


def plain(obj):
    """A protobuf message, a dict or plain JSON values: the openai client's objects (pydantic
    models, whose extra fields hold our record) as the JSON they were read from."""
    if isinstance(obj, Message):
        return obj
    dump = getattr(obj, "model_dump", None)
    return dump() if callable(dump) else obj


def each_choice(label: str, obj) -> list:
    """(label, answer of one choice) per choice: an HTTP answer with several choices (`n`,
    a prompt list) is read as one answer per choice, each with its own fields; a
    choice given alone is read as a one-choice answer."""
    if isinstance(obj, dict) and obj_kind(obj) is None and isinstance(obj.get("replay"), dict):
        kind = "chat.completion" if "message" in obj else "text_completion"
        return [(label, {"object": kind, "choices": [obj], **{k: obj[k] for k in OWN_FIELDS if k in obj}})]
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if obj_kind(obj) is None or not isinstance(choices, list) or len(choices) < 2:
        return [(label, obj)]
    out = []
    for i, choice in enumerate(choices):
        if not isinstance(choice, dict):
            out.append((f"{label} choice {i}", BadAnswer("a choice is a JSON object")))
            continue
        own = {key: choice[key] for key in OWN_FIELDS if key in choice}
        out.append((f"{label} choice {choice.get('index', i)}",
                    {"object": obj["object"], "id": obj.get("id", ""), "choices": [choice], **own}))
    return out


def obj_kind(obj) -> Optional[str]:
    """The HTTP answer's object kind, or None for anything else."""
    kind = obj.get("object") if isinstance(obj, dict) else None
    return kind if kind in HTTP_KINDS else None


def parse(obj, label: str) -> Answer:
    """One choice's answer: an HTTP body with one choice, or a gRPC CompleteResponse."""
    if isinstance(obj, pb.CompleteResponse):
        return _parse_grpc(obj, label)
    if not isinstance(obj, dict):
        raise BadAnswer(f"an answer is a JSON object, an openai client's object or a gRPC CompleteResponse, "
                        f"got {type(obj).__name__}")
    if obj_kind(obj) is not None:
        return _parse_http(obj, label)
    try:
        msg = json_format.ParseDict(obj, pb.CompleteResponse())
    except json_format.ParseError as e:
        raise BadAnswer(f"neither an HTTP completion nor a gRPC CompleteResponse: {e}") from None
    return _parse_grpc(msg, label)


def _missing(what: str) -> BadAnswer:
    return BadAnswer(f"the response has no {what}: it comes from a server that does not record what a "
                     f"replay or a trainer needs")


def _parse_grpc(msg: pb.CompleteResponse, label: str) -> Answer:
    if not msg.HasField("prompt_token_ids") or not msg.HasField("sampling"):
        raise _missing("prompt_token_ids and sampling")
    if not msg.HasField("reproducibility"):
        raise _missing("reproducibility record")
    sampling = _sampling(lambda: sampling_from_proto(msg.sampling))
    logprobs = None
    if sampling.logprobs is not None:
        logprobs = [Logprob(e.logprob, tuple((t.token_id, t.logprob) for t in e.top)) for e in msg.logprobs]
    record = {f.name: getattr(msg.reproducibility, f.name) for f in msg.reproducibility.DESCRIPTOR.fields}
    return Answer(_named(label, msg.request_id), msg.determinism.mode, list(msg.prompt_token_ids.ids), sampling,
                  list(msg.token_ids), logprobs, record)


def _parse_http(body: dict, label: str) -> Answer:
    replay, record = body.get("replay"), body.get("reproducibility")
    if not isinstance(replay, dict) or not {"prompt_token_ids", "token_ids", "sampling"} <= set(replay):
        raise _missing("`replay` block (prompt_token_ids, token_ids, sampling)")
    if not isinstance(record, dict):
        raise _missing("`reproducibility` record")
    sampling = _sampling(lambda: SamplingParams.from_dict(replay["sampling"]))
    out = list(replay["token_ids"])
    choice = (body.get("choices") or [{}])[0]
    logprobs = None
    lp = choice.get("logprobs")
    if sampling.logprobs is not None and lp:
        if body["object"] == "chat.completion":
            logprobs = [Logprob(c["logprob"], tuple((t["token"], t["logprob"]) for t in c["top_logprobs"]),
                                c["token"]) for c in lp["content"]]
        else:   # echo puts the prompt's entries first: the output's are the last ones
            first = len(lp["token_logprobs"]) - len(out)
            logprobs = [Logprob(v, tuple((top or {}).items()), t) for v, top, t in
                        zip(lp["token_logprobs"][first:], lp["top_logprobs"][first:], lp["tokens"][first:])]
    mode = (body.get("determinism") or {}).get("mode", "")
    return Answer(_named(label, body.get("id", "")), mode, list(replay["prompt_token_ids"]), sampling, out,
                  logprobs, record)


def _sampling(make: Callable[[], SamplingParams]) -> SamplingParams:
    try:
        return make()
    except (TypeError, ValueError) as e:
        raise BadAnswer(f"its sampling parameters cannot be read: {e}") from None


def _named(label: str, request_id: str) -> str:
    return f"{label} ({request_id})" if request_id else label

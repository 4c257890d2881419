"""`gateeng replay`: decode stored responses again and say whether the bits are the same.

A stored response is a gRPC CompleteResponse as JSON (what `gateeng generate
--json` prints) or the body of the HTTP front's answer (/v1/completions or
/v1/chat/completions, not streamed). A file holds one, or a JSONL of many (an
eval log). Each carries what a replay needs: the prompt's token ids (after any
chat template), the sampling parameters as run (the seed the server drew
included), the Reproducibility record, the output ids, and the logprobs if they
were asked for.

Before anything is decoded, each item's record is compared with the target's
(`reproducibility.differences`): an item whose record names another reference,
model or dtype is refused with the fields that differ. Every other item is
decoded as VERIFIED, the reference decode, on a local engine or on a running
server (gRPC or the OpenAI-compatible front), and compared token by token and
logprob bit by bit (the alternatives too where both sides name them by token id:
gRPC responses and replays; an HTTP body names them by text). OFF items carry
no promise; they are compared all the same, which shows whether an OFF answer
happened to be the reference.
"""
from __future__ import annotations

import dataclasses
import json
import struct
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional


from gateeng import reproducibility
from gateeng.answers import PROMISED, Answer, BadAnswer, Logprob, each_choice, json_logprob, parse
from gateeng.request import DeterminismParams, Mode, SamplingParams
from gateeng.serving.grpc_client import Client
from gateeng.serving.http_client import http_json, openai_base

# Requests a replay keeps in flight at once (they batch on the target; VERIFIED
# bits do not depend on the batch).
IN_FLIGHT = 8
# Alternatives a replay asks for at least: the top two give each token's margin.
MARGIN_ALTERNATIVES = 2


class Unreplayable(BadAnswer):
    """A stored item lacks something a replay needs, or the target cannot run it."""


@dataclass(frozen=True)
class Replayed:
    output_ids: list
    logprobs: list             # Logprob per output token (at least MARGIN_ALTERNATIVES alternatives)


# ---- reading stored responses ------------------------------------------------------

def read(path: Path) -> list:
    """(label, Answer or Unreplayable) per response in a JSON or JSONL file."""
    text = path.read_text()
    try:
        objects = [(path.name, json.loads(text))]
    except json.JSONDecodeError:
        objects = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    objects.append((f"{path.name}:{n}", json.loads(line)))
                except json.JSONDecodeError as e:
                    objects.append((f"{path.name}:{n}", Unreplayable(f"not JSON: {e}")))
    out = []
    for label, obj in [one for label, obj in objects for one in each_choice(label, obj)]:
        try:
            if isinstance(obj, BadAnswer):
                raise obj
            out.append((label, parse(obj, label)))
        except BadAnswer as e:
            out.append((label, e if isinstance(e, Unreplayable) else Unreplayable(str(e))))
    return out


# ---- targets: where the replay decodes ----------------------------------------------

def replay_params(item: Answer) -> SamplingParams:
    """The stored parameters, asking for the alternatives that give margins."""
    k = max(item.sampling.logprobs or 0, MARGIN_ALTERNATIVES)
    return dataclasses.replace(item.sampling, logprobs=k, prompt_logprobs=None)


def _from_entries(entries) -> list:
    return [Logprob(e.logprob, tuple(e.top)) for e in entries]


class LocalTarget:
    """A local engine: the config's model, or an already loaded one."""

    def __init__(self, config, loaded=None):
        from gateeng.engine.engine import Engine
        self.engine = Engine(config, loaded)
        self.name = f"this machine ({self.engine.reproducibility.device_name})"

    def record(self) -> dict:
        return dataclasses.asdict(self.engine.reproducibility)

    def token_text(self, token: int) -> Optional[str]:
        return self.engine.tokenizer.decode([token])

    def decode(self, items: list) -> Iterator:
        det = DeterminismParams(Mode.VERIFIED)
        for start in range(0, len(items), IN_FLIGHT):
            handles = []
            for it in items[start:start + IN_FLIGHT]:
                try:
                    handles.append(self.engine.submit(it.prompt_ids, replay_params(it), det))
                except Exception as e:     # refused (too long for this engine, ...): that item only
                    handles.append(e)
            for i, h in enumerate(handles):
                try:
                    if isinstance(h, Exception):
                        raise h
                    c = h.result()
                except Exception as e:
                    yield start + i, e
                    continue
                yield start + i, Replayed(list(c.token_ids), _from_entries(c.logprobs))

    def close(self) -> None:
        self.engine.shutdown()


def _threaded(items: list, one: Callable) -> Iterator:
    """(index, one(item)) in item order, IN_FLIGHT running at a time; an error is
    yielded as its exception."""
    def run(i):
        try:
            return i, one(items[i])
        except Exception as e:      # reported per item, the others go on
            return i, e
    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        yield from pool.map(run, range(len(items)))


class GrpcTarget:
    def __init__(self, address: str, api_key: Optional[str] = None, tls: Optional[dict] = None):
        """`tls`: Client's TLS files (ca_file, cert_file, key_file), where the server has TLS."""
        self.client, self.name = Client(address, api_key=api_key, **(tls or {})), address

    def record(self) -> dict:
        r = self.client.server_info().reproducibility
        return {f.name: getattr(r, f.name) for f in r.DESCRIPTOR.fields}

    def token_text(self, token: int) -> Optional[str]:
        return None

    def decode(self, items: list) -> Iterator:
        def one(it):
            res = self.client.complete(it.prompt_ids, replay_params(it), DeterminismParams(Mode.VERIFIED),
                                       timeout=3600)
            return Replayed(list(res.token_ids), [Logprob(e.logprob, tuple((t.token_id, t.logprob) for t in e.top))
                                                  for e in res.logprobs])
        return _threaded(items, one)

    def close(self) -> None:
        self.client.close()


class OpenAITarget:
    """A gateeng HTTP front: /v1/models shows its record, /v1/completions decodes."""

    def __init__(self, url: str, api_key: Optional[str] = None, ca_file: Optional[str] = None):
        """`ca_file`: the CA an https:// server's certificate chains to."""
        self.base, self.api_key, self.ca_file = openai_base(url), api_key, ca_file
        self.name = self.base
        self.model = http_json(f"{self.base}/models", timeout=30, api_key=api_key, ca_file=ca_file)["data"][0]

    def record(self) -> dict:
        record = self.model.get("reproducibility")
        if record is None:
            raise Unreplayable(f"{self.base}/models shows no Reproducibility record: not a gateeng server, so "
                               f"there is no promise to check against")
        return record

    def token_text(self, token: int) -> Optional[str]:
        return None

    def decode(self, items: list) -> Iterator:
        def one(it):
            p = replay_params(it)
            if p.stop_token_ids:
                raise Unreplayable("the OpenAI API has no stop_token_ids: replay this one over gRPC (--server)")
            body = {"model": self.model["id"], "prompt": it.prompt_ids, "max_tokens": p.max_tokens,
                    "temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k, "stop": list(p.stop),
                    "ignore_eos": p.ignore_eos, "logprobs": p.logprobs, "determinism": {"mode": Mode.VERIFIED.value}}
            if p.seed is not None:
                body["seed"] = p.seed
            res = http_json(f"{self.base}/completions", body, api_key=self.api_key, ca_file=self.ca_file)
            lp = res["choices"][0]["logprobs"]
            return Replayed(list(res["replay"]["token_ids"]),
                            [Logprob(v, tuple(top.items()), t) for v, top, t in
                             zip(lp["token_logprobs"], lp["top_logprobs"], lp["tokens"])])
        return _threaded(items, one)

    def close(self) -> None:
        pass


# ---- comparing ----------------------------------------------------------------------

def _bits(v: float) -> bytes:
    """A logprob's binary32 bits. JSON holds a binary32 exactly (-inf as the most
    negative float); a stored value that is no binary32 keeps its binary64 bits,
    so it equals nothing a server computed."""
    x = json_logprob(float(v))
    try:
        single = struct.pack("<f", x)
    except OverflowError:
        return struct.pack("<d", x)
    return single if struct.unpack("<f", single)[0] == x else struct.pack("<d", x)


def _margin(lp: Optional[Logprob]) -> Optional[float]:
    if lp is None or len(lp.top) < 2:
        return None
    return float(lp.top[0][1]) - float(lp.top[1][1])


def _by_id(top: tuple) -> bool:
    return all(isinstance(t, int) for t, _ in top)


def _logprobs_equal(a: Logprob, b: Logprob) -> bool:
    """The token's logprob bits; and the alternatives', id by id, where both sides
    name them by id (gRPC and local replays). The HTTP front names alternatives by
    their text, which several ids may share, so there only the token's own counts."""
    if _bits(a.value) != _bits(b.value):
        return False
    if not (_by_id(a.top) and _by_id(b.top)):
        return True
    if len(b.top) < len(a.top):       # a replay asks for at least as many as were stored
        return False
    return all(ta == tb and _bits(va) == _bits(vb) for (ta, va), (tb, vb) in zip(a.top, b.top))


def compare(item: Answer, got: Replayed, token_text: Callable[[int], Optional[str]]) -> tuple:
    """(identical, what to print)."""
    def shown(ids, lps, i):
        if i >= len(ids):
            return f"ends after {len(ids)} tokens"
        lp = lps[i] if lps and i < len(lps) else None
        text = lp.text if lp is not None and lp.text is not None else token_text(ids[i])
        margin = _margin(lp)
        detail = f"id {ids[i]}" + (f", margin {margin:.4g}" if margin is not None else "")
        return (f"{text!r} " if text is not None else "") + f"({detail})"
    a, b = item.output_ids, got.output_ids
    for i in range(max(len(a), len(b))):
        if i >= len(a) or i >= len(b) or a[i] != b[i]:
            return False, (f"diverges at token {i}: stored {shown(a, item.logprobs, i)} vs replayed "
                           f"{shown(b, got.logprobs, i)}")
    if item.logprobs is None:
        return True, f"identical ({len(a)} tokens; no logprobs stored)"
    for i, (x, y) in enumerate(zip(item.logprobs, got.logprobs)):
        if not _logprobs_equal(x, y):
            return False, (f"tokens identical ({len(a)}), logprob bits differ at token {i}: stored {x.value!r} "
                           f"vs replayed {y.value!r}")
    if len(item.logprobs) != len(a):
        return False, f"tokens identical ({len(a)}), but {len(item.logprobs)} logprobs stored"
    return True, f"identical ({len(a)} tokens, logprob bits equal)"


# ---- the command --------------------------------------------------------------------

@dataclass
class Outcome:
    label: str
    promised: bool
    identical: bool
    message: str


def run(items: list, target, show_progress: bool = True, out=sys.stdout) -> list:
    """Check, replay and compare every item; print one line per item as it ends."""
    from tqdm import tqdm
    outcomes: list = []
    bar = tqdm(total=len(items), desc="replay", unit="response", file=sys.stderr, disable=not show_progress or None)

    def report(label, promised, identical, message):
        outcomes.append(Outcome(label, promised, identical, message))
        prefix = "" if promised else "no promise (OFF): "
        bar.write(f"{label}: {prefix}{message}", file=out)
        bar.update(1)
    here = None
    try:
        here = target.record()
    except Exception as e:      # unreachable, or not a gateeng server: every item is refused with the reason
        here_error = f"cannot read {target.name}'s record: {e}"
    runnable = []
    for label, item in items:
        if isinstance(item, Unreplayable):
            report(label, True, False, f"cannot replay: {item}")
            continue
        promised = item.mode in PROMISED
        if here is None:
            report(item.label, promised, False, f"refused: {here_error}")
            continue
        diff = reproducibility.differences(item.record, here)
        if diff:
            report(item.label, promised, False, f"refused before decoding: its record differs from {target.name}: "
                                                + "; ".join(diff))
            continue
        runnable.append(item)
    for i, got in target.decode(runnable):
        item = runnable[i]
        promised = item.mode in PROMISED
        if isinstance(got, Exception):
            report(item.label, promised, False, f"replay failed: {got}")
        else:
            report(item.label, promised, *compare(item, got, target.token_text))
    bar.close()
    return outcomes


def summary(outcomes: list) -> str:
    promised = [o for o in outcomes if o.promised]
    off = [o for o in outcomes if not o.promised]
    same = sum(o.identical for o in promised)
    text = f"{len(outcomes)} responses: {same} of {len(promised)} VERIFIED identical"
    if off:
        text += f"; {sum(o.identical for o in off)} of {len(off)} OFF (no promise) equal the reference"
    return text

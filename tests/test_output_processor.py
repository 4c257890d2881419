"""The output side without a model: incremental text, stop strings, stream events."""
import random

import pytest

from gateeng.engine.detokenizer import IncrementalText
from gateeng.engine.output_processor import OutputProcessor, RequestHandle
from gateeng.outputs import Chunk, Rollback
from gateeng.request import DeterminismParams, FinishReason, Mode, Request, SamplingParams, StreamPolicy
from gateeng.engine.stopping import StopChecker
from tests.tiny import ByteTokenizer

TOK = ByteTokenizer()
decode = TOK.decode
WORDS = "héllo wörld 日本語 😀 ok".encode()   # multi-byte characters split across byte tokens


class CountingDecode:
    def __init__(self):
        self.tokens = 0

    def __call__(self, ids):
        self.tokens += len(ids)
        return decode(ids)


def test_incremental_text_equals_one_decode():
    rng = random.Random(0)
    for _ in range(300):   # random bytes: split characters and invalid sequences alike
        ids = [rng.choice(WORDS) for _ in range(rng.randrange(1, 40))]
        t = IncrementalText(decode)
        for k, tok in enumerate(ids, 1):
            t.append(tok)
            assert decode(ids[:k]).startswith(t.text)
        assert t.final(len(ids)) == decode(ids)


def test_a_character_split_across_tokens_is_never_shown_half_done():
    chars = list("héllo wörld 日本語 😀")
    rng = random.Random(2)
    for _ in range(50):
        text = "".join(rng.choice(chars) for _ in range(20))
        t = IncrementalText(decode)
        for tok in text.encode():
            t.append(tok)
            assert "\ufffd" not in t.text and text.startswith(t.text)
        assert t.text == text


def test_truncate_restores_the_state_of_a_shorter_list():
    rng = random.Random(1)
    for _ in range(100):
        ids = list(WORDS)
        t = IncrementalText(decode)
        t.sync(ids, len(ids))
        k = rng.randrange(len(ids))
        other = ids[:k] + [rng.choice(WORDS) for _ in range(10)]
        t.truncate(k)
        assert t.take_low_water() == k and t.take_low_water() is None
        t.sync(other, len(other))
        fresh = IncrementalText(decode)
        fresh.sync(other, len(other))
        assert t.text == fresh.text and t.final(len(other)) == decode(other)


def test_cost_per_token_does_not_grow_with_the_output():
    counting = CountingDecode()
    t = IncrementalText(counting)
    for tok in b"abcdefgh " * 200:
        t.append(tok)
    assert counting.tokens < 4 * len(t)          # a whole-text decode per token would be ~n^2/2


def make_request(stop=(), max_tokens=50, mode=Mode.OFF, policy=StreamPolicy.VERIFIED_ONLY):
    """A request and its handle, which holds the output's text as the engine's does."""
    req = Request("r", [1, 2], SamplingParams(max_tokens=max_tokens, stop=tuple(stop), ignore_eos=True),
                  DeterminismParams(mode, stream_policy=policy))
    return req, RequestHandle("r", IncrementalText(decode))


def feed(req, stop, text: bytes):
    """Commit tokens one at a time like the verification stage; the finish, if any."""
    for tok in text:
        req.tokens.append(tok)
        req.num_verified = len(req.tokens)
        reason, cut = stop.check(req, len(req.tokens) - 1)
        if reason is not None:
            req.truncate(len(req.tokens))
            req.stop_text_len = cut
            return reason
    return None


@pytest.mark.parametrize("stop", [["END"], ["rld E"], ["x", "ND"]])
def test_stop_string_split_across_tokens_is_cut_and_never_streamed(stop):
    req, h = make_request(stop)
    checker = StopChecker(eos_token_ids=(), max_model_len=1000, text_of={"r": h.text}.get)
    proc = OutputProcessor(observer=_Quiet(), reproducibility=None)
    text = "wörld END after".encode()
    for i in range(len(text)):
        reason = feed(req, checker, text[i:i + 1])
        if reason:
            break
        proc.emit(req, h)
    assert reason is FinishReason.STOP
    req.finish_reason = reason
    done = proc.finish(req, h)
    want = "wörld END after"
    want = want[:min(want.find(s) for s in stop if s in want)]
    assert done.text == want
    chunks = _drain(h)
    assert "".join(c.text for c in chunks) == want
    assert [t for c in chunks for t in c.token_ids] == done.token_ids


def test_eager_rollback_is_sent_once_and_the_stream_adds_up():
    req, h = make_request(mode=Mode.VERIFIED, policy=StreamPolicy.EAGER)
    proc = OutputProcessor(observer=_Quiet(), reproducibility=None)
    req.tokens += list(b"abc")            # unverified, but shown eagerly
    req.eager_len = 3
    proc.emit(req, h)
    req.truncate(3)                       # the verifier kept only "a" and chose "X"
    req.tokens.append(ord("X"))
    req.num_verified = len(req.tokens)
    req.eager_len = 1
    proc.emit(req, h)
    req.finish_reason = FinishReason.LENGTH
    done = proc.finish(req, h)
    events = _drain(h)
    assert [type(e) for e in events] == [Chunk, Rollback, Chunk]
    assert events[1].position == 1 and done.text == "aX" and req.stats.retractions == 1
    assert events[0].text[:1] + events[2].text == "aX"


class _Quiet:
    def __getattr__(self, name):
        return lambda *a, **k: None


def _drain(h):
    out = []
    while not h.events.empty():
        out.append(h.events.get())
    return out


def test_a_rollback_under_a_same_last_token_reaches_the_text():
    """The text learns of a cut from Request.cuts, even where the regrown tokens end
    in the token the withdrawn ones ended in ("abc" becomes "aXc")."""
    req, h = make_request(mode=Mode.VERIFIED, policy=StreamPolicy.EAGER)
    proc = OutputProcessor(observer=_Quiet(), reproducibility=None)
    req.tokens += list(b"abc")
    req.eager_len = 3
    proc.emit(req, h)
    req.truncate(3)
    req.tokens += list(b"Xc")
    req.num_verified = len(req.tokens)
    req.eager_len = 1
    proc.emit(req, h)
    req.finish_reason = FinishReason.LENGTH
    done = proc.finish(req, h)
    events = _drain(h)
    assert req.cuts == [3] and done.text == "aXc" and h.text.text == "aXc"
    assert [type(e) for e in events] == [Chunk, Rollback, Chunk] and events[1].position == 1
    assert events[0].text[:1] + events[2].text == "aXc"

"""The request checks both fronts share, without a model: strict types, sizes
before tokenizing, sampling bounds. Each refusal names the field."""
import math

import pytest

from gateeng.serving import checks
from gateeng.serving.checks import BadRequest


@pytest.mark.parametrize("check, value, words", [
    (checks.integer, True, "must be an integer, got True"),
    (checks.integer, 2.7, "must be an integer, got 2.7"),
    (checks.integer, 2.0, "must be an integer"),
    (checks.integer, math.inf, "must be an integer, got inf"),
    (checks.integer, "3", "must be an integer"),
    (checks.number, math.nan, "finite"),
    (checks.number, math.inf, "finite"),
    (checks.number, 10 ** 400, "finite"),
    (checks.number, False, "must be a number"),
    (checks.number, "hot", "must be a number"),
    (checks.boolean, "no", "must be true or false, got 'no'"),
    (checks.boolean, 0, "must be true or false"),
    (checks.text, "a\udc80b", r"lone surrogate \('\\udc80' at character 1\)"),
    (checks.text, 5, "must be a string, got int"),
    (checks.token_ids, [True], "list of integer token ids"),
    (checks.token_ids, [1, 2.0], "list of integer token ids"),
    (checks.strings, [1, 2], "a string or a list of strings"),
    (checks.strings, ["\ud800"], "lone surrogate"),
])
def test_strict_types_refuse_what_json_or_protobuf_would_coerce(check, value, words):
    with pytest.raises(BadRequest, match=words) as ei:
        check(value, "field")
    assert ei.value.param == "field"


def test_strict_types_pass_what_they_should():
    assert checks.integer(3, "f") == 3 and checks.integer(None, "f") is None
    assert checks.number(2, "f") == 2.0 and checks.number(None, "f") is None
    assert checks.boolean(False, "f") is False and checks.text("é", "f") == "é"
    assert checks.strings("x", "f") == ("x",) and checks.strings(None, "f") == ()


@pytest.mark.parametrize("value, words", [
    ([{"role": "user"}], r"messages\[0\] has no `content`"),
    ([{"role": 1, "content": "x"}], r"messages\[0\].role must be a string"),
    ([{"role": "user", "content": None}], r"messages\[0\].content must be a string"),
    ([{"role": "user", "content": "x", "tool_calls": []}], r"fields \['tool_calls'\]"),
    ({"role": "user"}, "list of"),
    ([["user", "x"]], "list of"),
])
def test_messages_are_role_and_content_strings(value, words):
    with pytest.raises(BadRequest, match=words):
        checks.messages(value)


def test_a_message_name_is_dropped():
    assert checks.messages([{"role": "user", "content": "x", "name": "a"}]) == [{"role": "user", "content": "x"}]


@pytest.mark.parametrize("prompt, words", [
    ("x" * 65, "prompt text is 65 bytes; this server accepts at most 64"),
    ([{"role": "user", "content": "x" * 61}], "messages are 65 bytes"),
    ([{"role": "user", "content": ""}] * 257, "257 turns; at most 256"),
    ([1] * 100, "prompt has 100 tokens but the context holds 100"),
])
def test_prompt_size_is_checked_in_bytes_before_tokenizing(prompt, words):
    with pytest.raises(BadRequest, match=words) as ei:
        checks.prompt_size(prompt, max_prompt_bytes=64, max_model_len=100)
    assert ei.value.code in ("context_length_exceeded", None)


def test_prompts_within_the_limits_pass():
    for prompt in ("x" * 64, [{"role": "user", "content": "x" * 60}], [1] * 99, "", []):
        checks.prompt_size(prompt, max_prompt_bytes=64, max_model_len=100)


@pytest.mark.parametrize("fields, words", [
    ({"max_tokens": 10 ** 9}, r"max_tokens 1000000000 exceeds the context \(100 tokens"),
    ({"max_tokens": 100}, "ask for at most 99"),
    ({"max_tokens": 0}, "max_tokens must be >= 1"),
    ({"top_k": 2.7}, "top_k must be an integer, got 2.7"),
    ({"top_k": math.inf}, "top_k must be an integer, got inf"),
    ({"top_k": math.nan}, "top_k must be an integer"),
    ({"top_p": 0}, r"top_p must be in \(0, 1\]"),
    ({"temperature": -1}, "temperature must be a finite number >= 0"),
    ({"seed": 2 ** 64}, "seed must be in"),
    ({"ignore_eos": "no"}, "ignore_eos must be true or false"),
    ({"stop": ["a"] * 17}, "17 strings; at most 16"),
    ({"stop": "a" * 257}, "257 bytes; at most 256"),
    ({"stop_token_ids": [True]}, "stop_token_ids must be an integer"),
    ({"logprobs": 21}, r"logprobs must be in \[0, 20\]"),
])
def test_sampling_fields_are_checked_with_their_names(fields, words):
    with pytest.raises(BadRequest, match=words):
        checks.sampling(fields, max_model_len=100)


def test_an_unset_max_tokens_is_clamped_to_the_context_and_defaults_are_the_fronts():
    assert checks.sampling({}, max_model_len=100).max_tokens == 99        # DEFAULT_MAX_TOKENS is 128
    assert checks.sampling({}, max_model_len=1000).max_tokens == 128
    p = checks.sampling({"max_tokens": None, "temperature": None}, max_model_len=100, temperature=1.0,
                        max_tokens=16)
    assert (p.max_tokens, p.temperature) == (16, 1.0)
    p = checks.sampling({"max_tokens": 99, "stop": "x", "top_k": 5}, max_model_len=100)
    assert (p.max_tokens, p.stop, p.top_k) == (99, ("x",), 5)

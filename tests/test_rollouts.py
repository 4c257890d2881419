"""No silent off-policy: the trainer's Policy reads each rollout's record as a client
got it (an HTTP body, an openai object, a gRPC CompleteResponse, their choices) and
rescores it bit for bit, or refuses it naming why: an OFF answer, a server on a
GGUF's quantized weights as stored, a server on other (stale) weights. A server says
whether a trainer can reproduce it (`trainable`), and a gRPC tool pointed at the
HTTP port says so."""
import struct

import openai
import pytest
import torch

from gateeng.config import ServerConfig
from gateeng.model import loader
from gateeng.plans import reference_ops
from gateeng.request import DeterminismParams, Mode, SamplingParams
from gateeng.serving.grpc_client import Client
from gateeng.tools import cli
from gateeng.train import Policy
from test_server_async import Running
from test_weight_update import TOKEN, config
from tests.tiny_gguf import write_tiny_gguf
from tiny import save_family

VERIFIED_BODY = {"determinism": {"mode": "verified"}}
PROMPT = "The sky is"


@pytest.fixture(scope="module", autouse=True)
def reference_runs():
    if not reference_ops.runnable():
        pytest.skip("no build of the reference runs here")


class Served(Running):
    """A bf16 server of `path` with the HTTP front and an admin token."""

    def __init__(self, path, dequantize=False):
        loaded = loader.load(str(path), "bfloat16", dequantize=dequantize)
        super().__init__(config(), loaded=loaded, settings=ServerConfig(port=0, metrics_port=None, http_port=0),
                         admin_token=TOKEN)
        self.api = openai.OpenAI(base_url=f"http://127.0.0.1:{self.server.http.port}/v1", api_key="unused")

    def card(self) -> dict:
        return self.api.models.list().data[0].model_dump()

    def sample(self, n=2, **kw) -> object:
        """VERIFIED, seeded completions (logprobs of every token) through the openai client."""
        args = dict(model=self.card()["id"], prompt=PROMPT, max_tokens=8, temperature=0.8, seed=3, n=n,
                    logprobs=0, extra_body=VERIFIED_BODY)
        return self.api.completions.create(**{**args, **kw})


def bits(values) -> list:
    return [struct.pack("<d", float(v)).hex() for v in values]


def served_bits(res) -> list:
    """Each choice's logprobs as the server sent them."""
    return [bits(c.logprobs.token_logprobs) for c in res.choices]


def policy_bits(lps) -> list:
    return [bits(lp.tolist()) for lp in lps]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("rollouts") / "tiny"
    save_family("llama", path)
    return path


@pytest.fixture(scope="module")
def served(model_dir):
    srv = Served(model_dir)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def policy(model_dir):
    return Policy.load(str(model_dir))


def push(srv, directory, tmp_path, capsys) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    assert cli.main(["update-weights", "--server", srv.target, str(directory), "--admin-token-file", str(token)]) == 0
    capsys.readouterr()


def test_a_bf16_server_is_trainable_and_names_the_policys_weights(served, policy):
    card = served.card()
    assert card["trainable"] is True and card["untrainable_reason"] == ""
    assert card["reproducibility"]["model_fingerprint"] == policy.fingerprint
    with Client(served.target) as c:
        info = c.model_info()
    assert info.trainable and info.untrainable_reason == "" and info.fingerprint == policy.fingerprint


def test_every_shape_of_answer_rescores_bit_for_bit(served, policy):
    res = served.sample(n=3, top_p=0.9)
    assert all(c.model_extra["replay"]["token_ids"] for c in res.choices)
    expect = served_bits(res)
    assert policy_bits(policy.logprobs_from(res)) == expect                   # the openai object
    assert policy_bits(policy.logprobs_from(res.choices)) == expect           # its choices
    assert policy_bits(policy.logprobs_from(res.model_dump())) == expect      # the HTTP body
    one = served.sample(n=1, temperature=0.0)      # greedy: logprobs at T=1, untruncated
    assert one.choices[0].model_extra["replay"] == one.model_extra["replay"]   # each choice carries its own
    tiny_t = served.sample(n=1, temperature=1e-6)   # below the greedy temperature: greedy, as the server runs it
    chat = served.api.chat.completions.create(model=served.card()["id"], messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=6, temperature=0.7, seed=5, logprobs=True,
                                              extra_body=VERIFIED_BODY)
    with Client(served.target) as c:
        grpc_res = c.complete([5, 17, 200, 3], SamplingParams(temperature=0.9, top_k=20, seed=9, max_tokens=7,
                                                             logprobs=0), DeterminismParams(Mode.VERIFIED))
    got = policy_bits(policy.logprobs_from([one, tiny_t, chat, grpc_res, res.choices[1]]))
    assert got == [served_bits(one)[0], served_bits(tiny_t)[0],
                   bits(e.logprob for e in chat.choices[0].logprobs.content),
                   bits(e.logprob for e in grpc_res.logprobs), expect[1]]


def test_the_sampling_is_read_from_the_record_and_a_callers_own_stays_theirs(served, policy):
    res = served.sample(n=1, temperature=0.8)
    replay = res.choices[0].model_extra["replay"]
    assert replay["sampling"]["temperature"] == 0.8
    assert policy_bits(policy.logprobs_from(res)) == served_bits(res)
    # Ids passed by hand take the caller's sampling: at T=1 they are other numbers, accepted as asked.
    seq, n = replay["prompt_token_ids"] + replay["token_ids"], len(replay["prompt_token_ids"])
    fingerprint = res.model_extra["reproducibility"]["model_fingerprint"]
    other = policy.logprobs([seq], [n], temperature=1.0, model_fingerprint=fingerprint)
    assert policy_bits(other) != served_bits(res)
    assert policy_bits(policy.logprobs([seq], [n], temperature=0.8, model_fingerprint=fingerprint)) == served_bits(res)
    with pytest.raises(ValueError, match="model_fingerprint 0{64}, the policy's " + policy.fingerprint):
        policy.logprobs([seq], [n], temperature=0.8, model_fingerprint="0" * 64)


def test_off_rollouts_are_refused(served, policy):
    off = served.sample(n=1, extra_body={})
    with pytest.raises(ValueError, match="served OFF, not VERIFIED"):
        policy.logprobs_from(off)
    with pytest.raises(ValueError, match="answer 1 .*served OFF"):   # one OFF answer refuses the batch
        policy.logprobs_from([served.sample(n=1), off])


def test_stale_weights_are_refused_and_accepted_after_the_update(model_dir, tmp_path, capsys):
    srv = Served(model_dir)
    try:
        trainer = Policy.load(str(model_dir))
        before = srv.sample()
        start = trainer.fingerprint
        opt = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
        (-sum(lp.sum() for lp in trainer.logprobs_from(before))).backward()
        opt.step()
        assert trainer.fingerprint != start
        with pytest.raises(ValueError, match=f"model_fingerprint {start}, the policy's {trainer.fingerprint}; "
                                             f".*update was not pushed"):
            trainer.logprobs_from(before)
        trainer.save(tmp_path / "step-1")
        push(srv, tmp_path / "step-1", tmp_path, capsys)
        assert srv.card()["reproducibility"]["model_fingerprint"] == trainer.fingerprint
        after = srv.sample()
        assert policy_bits(trainer.logprobs_from(after)) == served_bits(after)
        # A trainer that missed the update (a fresh load of the old checkpoint) is the stale one now.
        fresh = Policy.load(str(model_dir))
        with pytest.raises(ValueError, match=f"model_fingerprint {trainer.fingerprint}, the policy's {start}"):
            fresh.logprobs_from(after)
    finally:
        srv.stop()


def test_quantized_weights_as_stored_are_refused_and_dequantize_rescores_before_and_after_an_update(
        tmp_path, capsys):
    path = write_tiny_gguf(tmp_path / "tiny-q8.gguf", "Q8_0")["path"]
    trainer = Policy.load(str(path))
    stored = Served(path)
    try:
        card = stored.card()
        assert card["trainable"] is False and "--dequantize" in card["untrainable_reason"]
        with Client(stored.target) as c:
            assert not c.model_info().trainable
        res = stored.sample()
        theirs = card["reproducibility"]["model_fingerprint"]
        with pytest.raises(ValueError, match=f"model_fingerprint {theirs}, the policy's {trainer.fingerprint}; "
                                             f"a GGUF's quantized weights are served as stored .*--dequantize"):
            trainer.logprobs_from(res)
    finally:
        stored.stop()
    dequantized = Served(path, dequantize=True)
    try:
        assert dequantized.card()["trainable"] is True
        res = dequantized.sample()
        assert policy_bits(trainer.logprobs_from(res)) == served_bits(res)
        opt = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
        (-sum(lp.sum() for lp in trainer.logprobs_from(res))).backward()
        opt.step()
        trainer.save(tmp_path / "step-1")
        push(dequantized, tmp_path / "step-1", tmp_path, capsys)
        after = dequantized.sample()
        assert policy_bits(trainer.logprobs_from(after)) == served_bits(after)
    finally:
        dequantized.stop()


def test_update_weights_pointed_at_the_http_port_says_so(served, model_dir, tmp_path, capsys):
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    http = f"127.0.0.1:{served.server.http.port}"
    assert cli.main(["update-weights", "--server", http, str(model_dir), "--admin-token-file", str(token)]) == 2
    err = capsys.readouterr().err
    assert "HTTP/1.1 server" in err and "give the server's gRPC port (--port" in err

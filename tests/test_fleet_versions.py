"""The weight version a fleet request runs on (pure): its first tokens sent pin the
version that computed them (each chunk names it), whatever version the fleet served
when the request arrived; a failover then re-runs it only on a replica of that
version, and tokens of other weights end it. Before any token is sent it may run on
any replica."""
import pytest

from gateeng.engine.errors import EngineDead
from gateeng.fleet.fleet import Handle, _Request, pin_version, runs_on
from gateeng.outputs import Chunk
from gateeng.request import DeterminismParams, Mode, SamplingParams


def sent(req, chunk: Chunk) -> None:
    """What the fleet does with a chunk from the replica running `req`."""
    pin_version(req, chunk)
    req.sent.extend(chunk.token_ids)


def test_a_request_carries_the_version_its_tokens_came_from():
    # Admitted while the fleet served version 0, it passed the barrier as it closed
    # and ran on version 1: its failover must look for version 1.
    req = _Request("r", [1, 2, 3], SamplingParams(max_tokens=4), DeterminismParams(Mode.VERIFIED), print,
                   Handle("r"))
    assert runs_on(req, 0) and runs_on(req, 1)    # nothing sent: any replica may run it whole
    sent(req, Chunk([], "", 0, [], weight_version=1))   # text only: nothing pinned
    assert req.weight_version is None
    sent(req, Chunk([7], "x", 0, [], weight_version=1))
    assert req.weight_version == 1 and runs_on(req, 1) and not runs_on(req, 0) and not runs_on(req, 2)
    sent(req, Chunk([8], "y", 1, [], weight_version=1))
    with pytest.raises(EngineDead, match="on weight_version 2, but the tokens already sent came from "
                                         "weight_version 1"):
        sent(req, Chunk([9], "z", 2, [], weight_version=2))
    assert req.sent == [7, 8]

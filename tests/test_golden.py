"""The golden file (tests/golden/gateeng-ref-1.json): the reference's VERIFIED answers,
made once and committed. Every build of the reference this machine runs must give
them again, bit for bit: whatever CPU kind runs the suite checks the promise anew.
The scalar build, many times slower, answers the first prompt of each case."""
import json
from pathlib import Path

import pytest

from gateeng.plans import reference_ops
from gateeng.plans.kernel_names import ISA_ENV, REFERENCE, REFERENCE_ISAS
from tests.golden.cases import CASES, MODELS, answers

GOLDEN = json.loads((Path(__file__).parent / "golden" / f"{REFERENCE}.json").read_text())
BUILDS = [pytest.param(isa, marks=pytest.mark.skipif(isa not in reference_ops.runnable(),
                                                      reason=f"this CPU cannot run the {isa} build"))
          for isa in REFERENCE_ISAS]


def test_the_golden_file_is_this_reference_and_these_cases():
    assert GOLDEN["reference"] == REFERENCE
    for name, model in GOLDEN["models"].items():
        assert [{k: v for k, v in case.items() if k != "answers"} for case in model["cases"]] == CASES[name]


@pytest.fixture(scope="module")
def models(smollm):
    """Each golden model, loaded on first use (the embedded one from the session's)."""
    cache = {"smollm2": smollm("bfloat16"), "smollm2-q4_1": smollm("as_stored")}

    def get(name):
        if name not in cache:
            cache[name] = MODELS[name]()
        return cache[name]
    return get


def test_the_golden_file_holds_every_model():
    assert sorted(GOLDEN["models"]) == sorted(MODELS)


@pytest.mark.model
@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_build_gives_the_golden_answers(models, name, isa, monkeypatch):
    monkeypatch.setenv(ISA_ENV, isa)
    loaded = models(name)
    golden = GOLDEN["models"][name]
    assert loaded.fingerprint == golden["fingerprint"], "the model's weights are not the golden file's"
    prompts = 1 if isa == "scalar" and name.startswith("smollm2") else None
    for case, want in zip(CASES[name], (c["answers"] for c in golden["cases"])):
        got = answers(loaded, case, prompts)
        assert got == want[:len(got)], f"{name}, {case['params']}: {isa} differs from the golden answers"

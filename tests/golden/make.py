"""Writes tests/golden/gateeng-ref-1.json: the reference's VERIFIED answers, made once
and committed, checked again by every machine that runs the suite
(tests/test_golden.py). Run it only when the spec's version changes:

    python -m tests.golden.make
"""
from __future__ import annotations

import json
from pathlib import Path

from tests.golden.cases import CASES, MODELS, answers

OUT = Path(__file__).with_name("gateeng-ref-1.json")


def main() -> None:
    golden = {"reference": "gateeng-ref-1", "models": {}}
    for name, load in MODELS.items():
        loaded = load()
        golden["models"][name] = {"fingerprint": loaded.fingerprint,
                                  "cases": [dict(case, answers=answers(loaded, case)) for case in CASES[name]]}
        print(f"{name}: {len(CASES[name])} cases")
    OUT.write_text(json.dumps(golden, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()

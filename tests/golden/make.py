"""Writes tests/golden/gateeng-ref-1.json: the reference's VERIFIED answers, made once
and committed, checked again by every machine that runs the suite
(tests/test_golden.py). Answers already in the file are kept: a model added to
tests/golden/cases.py gets its answers once. When the spec's version changes, write
the whole file anew (`--all`):

    python -m tests.golden.make [--all]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.golden.cases import CASES, MODELS, answers

OUT = Path(__file__).with_name("gateeng-ref-1.json")


def main() -> None:
    golden = {"reference": "gateeng-ref-1", "models": {}}
    if OUT.exists() and "--all" not in sys.argv:
        golden = json.loads(OUT.read_text())
    for name, load in MODELS.items():
        if name in golden["models"]:
            continue
        loaded = load()
        golden["models"][name] = {"fingerprint": loaded.fingerprint,
                                  "cases": [dict(case, answers=answers(loaded, case)) for case in CASES[name]]}
        print(f"{name}: {len(CASES[name])} cases")
    OUT.write_text(json.dumps(golden, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()

"""bench/RESULTS.md holds the present only, and every figure in it can be traced: each
section names the commit it measured (`at <commit>`, or `at commit <commit>`) and the
machine it ran on."""
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "RESULTS.md"
COMMIT = re.compile(r"\b[Aa]t\s+(?:commit\s+)?[0-9a-f]{7,40}\b")
MACHINE = re.compile(r"AMD EPYC|Intel|Xeon|NVIDIA")
SUMMARY = "## At a glance"   # figures from the sections below, each naming its section


def sections(text: str) -> dict:
    """{heading: body} for every ## and ### section."""
    parts = re.split(r"(?m)^(#{2,3} .*)$", text)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def untraced(text: str) -> list:
    """Headings of the sections that name no commit or no machine."""
    return [h for h, body in sections(text).items()
            if not h.startswith(SUMMARY) and not (COMMIT.search(body) and MACHINE.search(body))]


def test_every_section_names_its_commit_and_machine():
    missing = untraced(RESULTS.read_text())
    assert not missing, "sections without `at <commit>` or a machine: " + "; ".join(missing)


def test_a_section_without_them_is_caught():
    doc = ("# t\n## At a glance\nx\n## A\n`python a.py` at 1a2b3c4; AMD EPYC [avx2]\n"
           "### B\nmeasured on an AMD EPYC, commit unknown\n## C\nat commit 0123abc on an Intel Xeon\n")
    assert untraced(doc) == ["### B"]

"""`gateeng calibrate` pieces: the statistics, the prompt file, and a run on the tiny model."""
import json
import math

import pytest

from gateeng.tools import calibrate as cal
from gateeng.tools.prompts import read_prompts
from gateeng.plans.generic import FastPlan
from tiny import tiny_loaded


def test_clopper_pearson_upper_bound():
    n = 1000
    assert cal.clopper_pearson_upper(0, n) == pytest.approx(1 - 0.05 ** (1 / n), rel=1e-9)   # closed form
    assert cal.clopper_pearson_upper(5, 100) == pytest.approx(0.10225, abs=5e-5)              # published table
    assert cal.clopper_pearson_upper(3, 3) == 1.0
    assert cal.clopper_pearson_upper(0, 0) == 1.0


def test_tau_table_counts_triggers_catches_and_misses():
    margins = [0.0, 0.05, 0.2, 1.0, 5.0, math.nan]
    flipped = [False, True, False, True, False, False]
    rows = {r.tau: r for r in cal.tau_table(margins, flipped, taus=(0.0, 0.1, 2.0))}
    assert rows[0.0].trigger_rate == pytest.approx(2 / 6)   # a tie and a NaN always trigger
    assert rows[0.1].trigger_rate == pytest.approx(3 / 6) and rows[0.1].catch_rate == 0.5
    assert rows[0.1].misses == 1 and rows[0.1].miss_rate == pytest.approx(1 / 6)
    assert rows[2.0].misses == 0 and rows[2.0].catch_rate == 1.0
    assert cal.recommend(list(rows.values()), 0.5) == 2.0
    assert cal.recommend(list(rows.values()), 1e-9) is None


def test_read_prompts_text_and_jsonl(tmp_path):
    p = tmp_path / "p.txt"
    p.write_text("first prompt\n\n{\"prompt\": \"second\", \"id\": 3}\n")
    assert read_prompts(p) == ["first prompt", "second"]
    p.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(ValueError, match="p.txt:1"):
        read_prompts(p)


def test_calibrate_quick_on_tiny_model_finds_the_flips_it_is_given(tmp_path):
    """A noisy fast plan flips often and at random margins: calibrate must count the
    flips and catch them all once tau covers every margin."""
    prompts = [[i + 1, i + 7, i + 3, 200 - i] for i in range(6)]
    report = cal.calibrate(tiny_loaded("float32"), prompts, n_tokens=10, batch_sizes=(1, 3), dtype="float32",
                           block_size=4, target_miss=0.5, show_progress=False, fast=FastPlan(logit_noise=3.0))
    assert report.steps == 2 * 6 * 9 and report.flips > 5
    rows = report.rows
    assert all(a.trigger_rate <= b.trigger_rate and a.catch_rate <= b.catch_rate for a, b in zip(rows, rows[1:]))
    assert rows[0].misses == report.flips - sum(f and m == 0 for m, f in zip(report.margins, report.flipped))
    assert rows[-1].misses < report.flips   # a large tau catches flips the noise made
    js, png = cal.write(report, tmp_path, {"model": "tiny"})
    data = json.loads(js.read_text())
    assert data["flips"] == report.flips and len(data["table"]) == len(cal.TAUS)
    assert data["reproducibility"]["isa"] and png.stat().st_size > 10_000
    assert "recommended tau" in cal.markdown(report)


@pytest.mark.parametrize("untested", [None, 128])
def test_the_report_names_the_fast_plan_and_the_row_counts_it_did_not_measure(untested):
    rows = cal.tau_table([1.0, 2.0], [False, False], taus=(0.0,))
    report = cal.Report(2, 0, {1: 0}, {1: 2}, 0.95, 1e-3, 0.0, rows, {}, [1.0, 2.0], [False, False],
                        "VDPBF16PS packed weights up to 128 rows, another kernel above", untested)
    text = cal.markdown(report)
    assert "fast plan: VDPBF16PS packed weights up to 128 rows" in text
    assert ("more than 128 rows, which no batch here reached" in text) == (untested is not None)

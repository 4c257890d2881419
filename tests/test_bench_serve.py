"""bench/serve.py --quick against a real `gateeng serve`: the load generator runs, and
what the product promises under load holds (the figures themselves go to RESULTS.md)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.model
ROOT = Path(__file__).resolve().parents[1]


def test_serve_bench_quick(tmp_path):
    out = tmp_path / "serve"
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "serve.py"), "--quick", "--out", str(out)],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(out.with_suffix(".json").read_text())
    assert out.with_suffix(".png").stat().st_size > 0 and "| concurrency |" in out.with_suffix(".md").read_text()
    for level in report["load"]["levels"]:
        assert level["health"]["checks"] > 0 and level["health"]["failed"] == 0
        for cls in ("off", "verified"):
            stats = level[cls]
            assert stats["completed"] == stats["requests"] > 0 and not stats["errors"]
        assert level["verified_equal_alone"] == level["verified_checked"] > 0
        assert list(level["idle_after"].values()) == [0, 0, 0]
    q = report["queue"]
    assert q["codes"].get("RESOURCE_EXHAUSTED", 0) > 0 and set(q["codes"]) <= {"OK", "RESOURCE_EXHAUSTED"}
    assert q["admitted_completed"] == q["codes"]["OK"] > 0
    assert list(q["idle_after"].values()) == [0, 0, 0]
    assert report["prefill"]["alone_tokens_per_s"] > 0 and report["rss"]["rss_after_all_mb"] > 0
    assert report["exit_code"] == 0

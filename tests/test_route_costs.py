"""The route's plan costs: timings whose fit is unsound are refused (the policy keeps
its priors, both plans priced alike), costs are never negative, and sound costs are
kept once per key and read back by later starts instead of timing passes again."""
import dataclasses
import json
import shutil

import pytest

from gateeng.config import EngineConfig
from gateeng.engine import pricing, route_costs
from gateeng.engine.core import EngineCore
from gateeng.engine.route import RoutePolicy
from gateeng.step import PlanKind
from tiny import hf_family, save_family, tiny_loaded

FACTS = {"device": "cpu: a test CPU", "threads": 2, "model": "m1"}


def timings(fast: dict, invariant: dict) -> list:
    """[(kind, rows, seconds)] from {rows: ms} per plan."""
    return ([("fast", r, ms / 1e3) for r, ms in fast.items()]
            + [("invariant", r, ms / 1e3) for r, ms in invariant.items()])


STEADY_FAST = {1: 8.0, 8: 13.0, 32: 30.0}
STEADY_INV = {1: 9.0, 8: 15.0, 32: 36.0}

REFUSED = [   # (what happened on the host, fast timings, why it is refused)
    ("a stall at 8 rows", {1: 10.0, 8: 300.0, 32: 40.0}, "cheaper with more rows"),
    ("a load that eased while the row counts were timed", {1: 30.0, 8: 28.0, 32: 16.0}, "falls with rows"),
    ("one fast pass at 1 row, then a loaded host", {1: 1.0, 8: 50.0, 32: 200.0}, "is negative"),
    ("no line fits", {1: 10.0, 8: 10.5, 32: 70.0}, "where it took"),
]


@pytest.mark.parametrize("what, fast, why", REFUSED, ids=[r[0] for r in REFUSED])
def test_an_unsound_fit_is_refused_and_names_why(what, fast, why):
    assert why in pricing.refusal(timings(fast, STEADY_INV), group_rows=0)
    # the same for the invariant plan
    assert why in pricing.refusal(timings(STEADY_FAST, fast), group_rows=0)


def test_steady_timings_with_a_little_noise_are_accepted():
    assert pricing.refusal(timings(STEADY_FAST, STEADY_INV), group_rows=0) is None
    noisy = {1: 8.4, 8: 12.6, 32: 31.0}
    assert pricing.refusal(timings(noisy, STEADY_INV), group_rows=0) is None


def test_a_grouped_invariant_plan_is_fitted_per_group():
    # 16-row groups: 1, 8 and 32 rows are 1, 1 and 2 groups.
    assert pricing.refusal(timings(STEADY_FAST, {1: 20.0, 8: 21.0, 32: 41.0}), group_rows=16) is None
    assert "where it took" in pricing.refusal(timings(STEADY_FAST, {1: 20.0, 8: 21.0, 32: 82.0}), group_rows=16)


def test_missing_and_non_positive_timings_are_refused():
    assert "no invariant pass" in pricing.refusal(timings(STEADY_FAST, {}), group_rows=0)
    assert "took" in pricing.refusal(timings({1: 8.0, 8: 0.0, 32: 30.0}, STEADY_INV), group_rows=0)
    assert "took" in pricing.refusal(timings({1: 8.0, 8: float("nan"), 32: 30.0}, STEADY_INV), group_rows=0)


def fake_timer(fast: dict, invariant: dict, calls: list):
    def time_pass(kind, rows):
        calls.append((kind, rows))
        return (fast if kind is PlanKind.FAST else invariant)[rows] / 1e3
    return time_pass


def never_timed(kind, rows):
    raise AssertionError("a pass was timed")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(route_costs, "cache_root", lambda: tmp_path)
    return tmp_path / route_costs.FOLDER


def seeded(time_pass, facts=FACTS, group_rows=0, **kwargs) -> RoutePolicy:
    route = RoutePolicy(group_rows=group_rows)
    pricing.seed(route, time_pass, [1, 8, 32], 128, facts, threads=2, probe=lambda: HOST["share"], **kwargs)
    return route


HOST = {"share": 0.99}   # the share of the CPU this process gets: 0.99 is a quiet host, 0.5 a busy one


@pytest.fixture(autouse=True)
def host(monkeypatch) -> dict:
    """HOST, quiet unless a test says otherwise, for the passes timed and the probe."""
    HOST["share"] = 0.99
    monkeypatch.setattr(pricing, "_cpu_share", lambda run, threads: (run(), HOST["share"]))
    return HOST


@pytest.mark.parametrize("what, fast, why", REFUSED, ids=[r[0] for r in REFUSED])
def test_a_refused_fit_leaves_both_plans_priced_alike_and_says_why(what, fast, why, cache, capsys):
    calls = []
    route = seeded(fake_timer(fast, STEADY_INV, calls))
    err = capsys.readouterr().err
    assert "refused" in err and why in err and "fast " + "/".join(f"{ms:.1f}" for ms in fast.values()) in err
    assert len(calls) == 3 * 2 * (1 + pricing.MAX_REPEATS)   # more rounds were timed, to no avail
    prior = RoutePolicy(group_rows=0)
    assert route.fast.seen == route.invariant.seen == 0
    for rows in (1, 8, 32, 64):
        assert route.fast.cost(rows) == route.invariant.cost(rows) == prior.fast.cost(rows) > 0


def test_a_refusal_is_kept_its_fit_never_used_and_a_busy_host_times_no_more(cache, host, capsys):
    host["share"] = 0.5
    seeded(fake_timer(REFUSED[0][1], STEADY_INV, []))
    [kept] = cache.glob("*.json")
    assert json.loads(kept.read_text())["refused"]
    capsys.readouterr()
    calls = []
    route = seeded(fake_timer(STEADY_FAST, STEADY_INV, calls))
    err = capsys.readouterr().err
    assert not calls   # the host is still busy: nothing is timed
    assert "priced alike" in err and "were refused" in err and "busy too" in err and str(kept) in err
    assert route.fast.seen == 0 and route.describe() == RoutePolicy(group_rows=0).describe()
    host["share"] = 0.99   # a quiet host times them again
    route = seeded(fake_timer(STEADY_FAST, STEADY_INV, calls))
    assert "quiet now: timing them again" in capsys.readouterr().err
    assert route.fast.seen == 3 and not json.loads(kept.read_text())["refused"]


def test_timings_from_a_busy_host_serve_while_it_is_busy_and_are_timed_again_once_it_is_quiet(cache, host, capsys):
    host["share"] = 0.5
    busy = {r: 3 * ms for r, ms in STEADY_FAST.items()}
    first = seeded(fake_timer(busy, STEADY_INV, []))
    [kept] = cache.glob("*.json")
    assert "a busy host: 50% of the CPU" in capsys.readouterr().err
    assert json.loads(kept.read_text())["cpu_share"] == 0.5
    calls = []
    assert seeded(fake_timer(STEADY_FAST, STEADY_INV, calls)).describe() == first.describe()
    assert not calls and "busy too" in capsys.readouterr().err
    host["share"] = 0.99
    quiet = seeded(fake_timer(STEADY_FAST, STEADY_INV, calls))
    assert quiet.fast.cost(32) == pytest.approx(0.030, rel=0.05) and json.loads(kept.read_text())["cpu_share"] == 0.99
    calls.clear()
    seeded(fake_timer(STEADY_FAST, STEADY_INV, calls))
    assert not calls   # quiet timings serve without a pass


def test_recalibrating_after_a_refusal_times_again(cache, host):
    seeded(fake_timer(REFUSED[0][1], STEADY_INV, []))
    host["share"] = 0.5
    calls = []
    route = seeded(fake_timer(STEADY_FAST, STEADY_INV, calls), measure_again=True)
    assert len(calls) > 1 and route.fast.seen == 3


def test_a_stall_over_the_first_rounds_is_outlasted_by_more_rounds(cache):
    calls = []
    steady = fake_timer(STEADY_FAST, STEADY_INV, calls)

    def stalled(kind, rows):   # every 8-row fast pass of the first four rounds stalls
        seconds = steady(kind, rows)
        return 0.300 if (kind, rows) == (PlanKind.FAST, 8) and calls.count((kind, rows)) <= 5 else seconds
    route = seeded(stalled)
    assert route.fast.seen == 3 and route.fast.cost(8) == pytest.approx(0.013, rel=0.1)
    assert len(calls) == 3 * 2 * (1 + 5)   # the set-up pass, then five rounds


def test_accepted_noisy_timings_give_non_negative_costs(cache):
    # Rising, within tolerance of a line, but the line's base is barely above zero:
    # the cost models never end below zero whatever order the passes came in.
    route = seeded(fake_timer({1: 1.2, 8: 7.0, 32: 30.5}, {1: 1.0, 8: 8.0, 32: 32.0}, []))
    for model in (route.fast, route.invariant):
        assert model.theta[0] >= 0 and model.theta[1] > 0


def test_kept_costs_are_read_back_by_the_same_key_only(cache, capsys):
    calls = []
    first = seeded(fake_timer(STEADY_FAST, STEADY_INV, calls))
    assert len(calls) == 3 * 2 * (1 + pricing.REPEATS)
    [kept] = cache.glob("*.json")
    assert f"kept in {kept}" in capsys.readouterr().err
    again = seeded(never_timed)
    assert f"route costs from {kept}" in capsys.readouterr().err
    assert again.describe() == first.describe() and again.fast.seen == first.fast.seen == 3
    # Another machine, thread count, model or setting is another key: timed anew.
    for changed in ({"threads": 1}, {"model": "m2"}, {"device": "cpu: another CPU"}):
        calls.clear()
        seeded(fake_timer(STEADY_FAST, STEADY_INV, calls), facts=dict(FACTS, **changed))
        assert calls
    assert len(list(cache.glob("*.json"))) == 4


def test_other_rows_priced_are_another_key(cache):
    seeded(fake_timer(STEADY_FAST, STEADY_INV, []))
    calls = []
    route = RoutePolicy(group_rows=0)
    pricing.seed(route, fake_timer(STEADY_FAST, STEADY_INV, calls), [1, 8], 128, FACTS, threads=2,
                 probe=lambda: None)
    assert calls


def test_recalibrating_times_again_and_replaces_what_is_kept(cache):
    seeded(fake_timer(STEADY_FAST, STEADY_INV, []))
    [kept] = cache.glob("*.json")
    slower = {r: 2 * ms for r, ms in STEADY_FAST.items()}
    calls = []
    route = seeded(fake_timer(slower, STEADY_INV, calls), measure_again=True)
    assert calls and route.fast.cost(32) == pytest.approx(0.060, rel=0.05)
    assert seeded(never_timed).describe() == route.describe()
    assert json.loads(kept.read_text())["measured"][0] == ["fast", 1, pytest.approx(0.016)]


DAMAGE = {   # how a kept file may come to be unreadable: its bytes, from the whole file's
    "empty (a disk that lost it)": lambda record: b"",
    "cut short": lambda record: json.dumps(record).encode()[:40],
    "not text": lambda record: b"\xff\xfe not json",
    "not an object": lambda record: b"[1, 2]",
    "measurements that are no list": lambda record: json.dumps(dict(record, measured=3)).encode(),
    "a measurement of the wrong shape": lambda record: json.dumps(dict(record, measured=[["fast", 1]])).encode(),
}


@pytest.mark.parametrize("damage", DAMAGE.values(), ids=DAMAGE.keys())
def test_a_damaged_file_is_logged_and_timed_again_never_a_crash(damage, cache, capsys):
    seeded(fake_timer(STEADY_FAST, STEADY_INV, []))
    [kept] = cache.glob("*.json")
    record = json.loads(kept.read_text())
    kept.write_bytes(damage(record))
    capsys.readouterr()
    calls = []
    route = seeded(fake_timer(STEADY_FAST, STEADY_INV, calls))
    assert calls and route.fast.seen == 3
    assert f"the route costs in {kept} are unreadable" in capsys.readouterr().err
    assert json.loads(kept.read_text())["measured"] == record["measured"]   # written whole again


def test_kept_costs_that_no_longer_pass_are_timed_again(cache, capsys):
    seeded(fake_timer(STEADY_FAST, STEADY_INV, []))
    [kept] = cache.glob("*.json")
    record = json.loads(kept.read_text())
    record["measured"] = [["fast", r, ms / 1e3] for r, ms in ((1, 40.0), (8, 20.0), (32, 10.0))] + \
        [m for m in record["measured"] if m[0] == "invariant"]
    kept.write_text(json.dumps(record))
    calls = []
    seeded(fake_timer(STEADY_FAST, STEADY_INV, calls))
    assert calls and "are refused" in capsys.readouterr().err


def test_a_cache_that_cannot_be_written_is_logged_and_the_costs_still_serve(cache, capsys):
    cache.write_text("a file where the folder goes")
    route = seeded(fake_timer(STEADY_FAST, STEADY_INV, []))
    assert "could not keep the route costs" in capsys.readouterr().err
    assert route.fast.seen == 3


# An engine start on a tiny model: its own sub-millisecond timings are mostly the
# host's noise, so a start that times passes is handed steady ones (one 32-row group
# each, or a flat line).
ENGINE = EngineConfig(dtype="float32", num_kv_blocks=64, invariant_rows=32)
STEADY = timings(STEADY_FAST, {1: 20.0, 8: 20.5, 32: 21.0})


def start(monkeypatch, cfg: EngineConfig, loaded, times: bool) -> EngineCore:
    """An EngineCore of `loaded`, whose start times passes (the steady ones) where
    `times`, and fails the test if it times any where not."""
    with monkeypatch.context() as m:
        m.setattr(pricing, "price_plans", (lambda time_pass, rows, **_: [t for t in STEADY if t[1] in rows]) if times
                  else (lambda *a, **k: pytest.fail("a start timed passes where costs were kept")))
        return EngineCore(cfg, loaded)


def test_a_second_engine_start_reads_the_costs_and_times_no_pass(cache, monkeypatch, capsys):
    first = start(monkeypatch, ENGINE, tiny_loaded(), times=True)
    [kept] = cache.glob("*.json")
    assert first.route.fast.seen == 3
    capsys.readouterr()
    second = start(monkeypatch, ENGINE, tiny_loaded(), times=False)
    assert f"route costs from {kept}" in capsys.readouterr().err
    assert second.route.describe() == first.route.describe()
    # Another setting that changes a pass's cost is another key.
    start(monkeypatch, dataclasses.replace(ENGINE, block_size=32), tiny_loaded(), times=True)
    assert len(list(cache.glob("*.json"))) == 2


def test_a_new_checkpoint_of_the_same_model_reads_the_costs_and_another_model_times_its_own(
        cache, monkeypatch, capsys, tmp_path):
    """Each saved step of a training run is the same model with other weights: the key
    names the model's layout, not its values, so a start on the next step reads the
    costs the first one timed."""
    from gateeng.model import loader
    save_family("llama", tmp_path / "step0")
    shutil.copytree(tmp_path / "step0", tmp_path / "step1")
    hf_family("llama", seed=1).save_pretrained(tmp_path / "step1", safe_serialization=True)
    save_family("qwen2", tmp_path / "other")
    step0, step1, other = (loader.load(str(tmp_path / name), "float32") for name in ("step0", "step1", "other"))
    assert step0.fingerprint != step1.fingerprint and step0.layout == step1.layout != other.layout
    start(monkeypatch, ENGINE, step0, times=True)
    [kept] = cache.glob("*.json")
    capsys.readouterr()
    start(monkeypatch, ENGINE, step1, times=False)
    assert f"route costs from {kept}" in capsys.readouterr().err
    start(monkeypatch, ENGINE, other, times=True)
    assert len(list(cache.glob("*.json"))) == 2

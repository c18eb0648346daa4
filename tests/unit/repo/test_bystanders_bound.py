"""The hostile suites' collateral bound (support/bystanders.py) can fail: each way a hostile
case may harm its bystanders fails `unharmed`, checked here on records made by hand."""

from __future__ import annotations

import pytest
from support.bystanders import FACTORS, KINDS, NOISE_FLOOR_S, OverBound, Record, measured_twice, unharmed


def record(seconds: dict[str, list[float]], failures: list[str] | None = None) -> Record:
    return Record({k: list(seconds.get(k, [])) for k in KINDS}, failures or [])


def steady(value: float, count: int = 100) -> dict[str, list[float]]:
    return {k: [value] * count for k in KINDS}


def test_p99_is_the_nearest_rank_of_what_was_seen():
    assert record({"grpc": [i / 1000 for i in range(1, 101)]}).p99("grpc") == 0.099
    assert record({"grpc": [0.3, 0.1, 0.2]}).p99("grpc") == 0.3  # few calls: the worst


def test_within_each_kinds_factor_of_the_calm_p99_passes_and_beyond_it_fails():
    calm = record(steady(0.2))
    unharmed(record({k: [0.2 * FACTORS[k] - 0.01] * 100 for k in KINDS}), calm)
    for kind in KINDS:
        slow = steady(0.2)
        over = 0.2 * FACTORS[kind] + 0.01
        slow[kind] = [0.2] * 98 + [over, over]  # the 99th of 100 calls
        with pytest.raises(AssertionError, match=f"{kind} p99 {over * 1000:.0f} ms"):
            unharmed(record(slow), calm)


def test_a_failed_call_or_a_kind_never_called_fails():
    calm = record(steady(0.2))
    with pytest.raises(AssertionError, match="UNAVAILABLE"):
        unharmed(record(steady(0.2), ["grpc: UNAVAILABLE"]), calm)
    starved = steady(0.2)
    starved["status"] = []
    with pytest.raises(AssertionError, match="no status call"):
        unharmed(record(starved), calm)


def test_latencies_under_the_noise_floor_compare_from_the_floor():
    calm = record(steady(0.001))
    unharmed(record({k: [FACTORS[k] * NOISE_FLOOR_S - 0.001] * 10 for k in KINDS}), calm)
    with pytest.raises(AssertionError, match="status p99"):
        unharmed(record(steady(2 * NOISE_FLOOR_S + 0.001)), calm)


def test_with_calm_runs_on_both_sides_the_larger_p99_is_the_baseline():
    before, after = record(steady(0.1)), record(steady(0.3))
    unharmed(record(steady(0.3 * FACTORS["grpc"] - 0.01)), before, after)
    with pytest.raises(AssertionError, match="grpc p99"):
        unharmed(record(steady(0.3 * FACTORS["grpc"] + 0.01)), before, after)
    with pytest.raises(AssertionError, match="no calm run"):
        unharmed(record(steady(0.1)))


def test_a_case_over_the_p99_bound_is_measured_once_more_and_a_failed_call_never_is():
    calm = record(steady(0.1))
    over, within = record(steady(0.1 * FACTORS["grpc"] + 0.05)), record(steady(0.1))
    runs: list[int] = []

    def case(*records: Record):
        def run():
            runs.append(len(runs))
            return len(runs), records[len(runs) - 1], calm

        return run

    assert measured_twice(case(over, within), calm) == 2 and len(runs) == 2  # the second measurement decides
    runs.clear()
    with pytest.raises(OverBound, match="p99"):
        measured_twice(case(over, over), calm)
    assert len(runs) == 2
    runs.clear()
    with pytest.raises(AssertionError, match="UNAVAILABLE") as failed:
        measured_twice(case(record(steady(0.1), ["grpc: UNAVAILABLE"]), within), calm)
    assert not isinstance(failed.value, OverBound) and len(runs) == 1  # a failed call fails at once

"""Routing policies as pure functions: one contract every policy passes, then each policy's
own promise (spread, order, affinity with bounded load)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollwire.proxy.config import RoutingSection
from rollwire.proxy.fleet.breaker import Breaker
from rollwire.proxy.policies import POLICIES, Affinity, Candidate, LeastLoaded, RoundRobin, make_policy, routing_key

ADDRESSES = [f"10.0.0.{i}:50051" for i in range(1, 6)]
ROUTING = RoutingSection()

candidate_sets = st.lists(
    st.builds(Candidate, st.sampled_from(ADDRESSES), st.integers(0, 50), st.integers(0, 5000)),
    min_size=1,
    max_size=5,
    unique_by=lambda c: c.address,
)


@pytest.mark.parametrize("name", POLICIES.names())
@settings(max_examples=200, deadline=None)
@given(candidates=candidate_sets, key=st.binary(max_size=40))
def test_every_policy_chooses_one_of_the_candidates(name, candidates, key):
    assert make_policy(name, ROUTING).choose(candidates, key) in candidates


@pytest.mark.parametrize("name", POLICIES.names())
def test_every_policy_reports_the_name_it_is_registered_under(name):
    assert make_policy(name, ROUTING).name == name  # the Policy protocol's `name` never drifts from the registry


@pytest.mark.parametrize("name", POLICIES.names())
def test_a_single_candidate_is_always_chosen(name):
    only = Candidate("10.0.0.1:1", in_flight=99, work=9999)
    assert all(make_policy(name, ROUTING).choose([only], bytes([i])) == only for i in range(20))


def test_unknown_policy_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="least-loaded, round-robin, affinity"):
        make_policy("random", ROUTING)


# -- least loaded (power of two choices) --------------------------------------------------
def test_least_loaded_never_picks_the_most_loaded_of_several():
    policy = LeastLoaded(random.Random(1))
    cands = [Candidate("a:1", 1, 100), Candidate("b:1", 1, 200), Candidate("c:1", 1, 900)]
    picks = Counter(policy.choose(cands, b"").address for _ in range(3000))
    assert picks["c:1"] == 0
    assert picks["a:1"] > picks["b:1"] > 0  # a wins both its pairs, b only against c


def test_least_loaded_breaks_equal_work_by_in_flight():
    policy = LeastLoaded(random.Random(2))
    cands = [Candidate("a:1", 5, 100), Candidate("b:1", 1, 100)]
    assert {policy.choose(cands, b"").address for _ in range(50)} == {"b:1"}


def test_least_loaded_spreads_a_stream_of_groups_evenly():
    policy, load = LeastLoaded(random.Random(3)), Counter()
    for _ in range(3000):
        cands = [Candidate(a, load[a], load[a]) for a in ADDRESSES]
        load[policy.choose(cands, b"").address] += 1
    assert max(load.values()) - min(load.values()) <= 2


# -- round robin ----------------------------------------------------------------------------
def test_round_robin_cycles_in_address_order():
    policy = RoundRobin()
    cands = [Candidate(a) for a in reversed(ADDRESSES[:3])]
    assert [policy.choose(cands, b"").address for _ in range(6)] == ADDRESSES[:3] * 2


def test_round_robin_neither_skips_nor_repeats_when_membership_changes():
    policy = RoundRobin()
    cands = [Candidate(a) for a in ADDRESSES[:4]]
    assert policy.choose(cands, b"").address == ADDRESSES[0]
    assert policy.choose(cands, b"").address == ADDRESSES[1]
    without_third = [c for c in cands if c.address != ADDRESSES[2]]
    assert policy.choose(without_third, b"").address == ADDRESSES[3]
    assert policy.choose(cands, b"").address == ADDRESSES[0]


# -- affinity -------------------------------------------------------------------------------
def idle(addresses):
    return [Candidate(a) for a in addresses]


def test_affinity_sends_a_key_to_the_same_replica_every_time():
    policy = Affinity()
    for i in range(50):
        key = f"prompt {i}".encode()
        assert len({policy.choose(idle(ADDRESSES), key).address for _ in range(5)}) == 1


def test_affinity_spreads_keys_over_all_replicas():
    policy = Affinity()
    owners = Counter(policy.choose(idle(ADDRESSES[:3]), f"k{i}".encode()).address for i in range(3000))
    assert set(owners) == set(ADDRESSES[:3])
    assert all(700 < n < 1300 for n in owners.values()), owners


def test_affinity_moves_only_the_keys_of_a_replica_that_joins():
    policy = Affinity()
    keys = [f"k{i}".encode() for i in range(2000)]
    before = {k: policy.choose(idle(ADDRESSES[:3]), k).address for k in keys}
    after = {k: policy.choose(idle(ADDRESSES[:4]), k).address for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(after[k] == ADDRESSES[3] for k in moved)  # keys only move to the newcomer
    assert 0.15 < len(moved) / len(keys) < 0.35  # about a quarter, not a reshuffle


def test_affinity_spills_to_the_least_loaded_when_its_choice_is_too_far_ahead():
    policy = Affinity(load_factor=1.25, min_gap=4)
    key = b"hot prompt"
    owner = policy.choose(idle(ADDRESSES[:3]), key).address
    others = [a for a in ADDRESSES[:3] if a != owner]

    def loads(mine, first, second):
        return [
            Candidate(owner, in_flight=mine),
            Candidate(others[0], in_flight=first),
            Candidate(others[1], in_flight=second),
        ]

    assert policy.choose(loads(6, 2, 1), key).address == others[1]  # above ceil(1.25 * 10 / 3) = 5 and 5 ahead
    assert policy.choose(loads(4, 2, 1), key).address == owner  # above the bound but only 3 ahead: keep the cache
    assert policy.choose(loads(40, 30, 30), key).address == owner  # ahead, but within 1.25 x the average
    assert policy.choose(loads(60, 30, 30), key).address == others[0]
    assert Affinity(load_factor=1.25, min_gap=0).choose(loads(4, 2, 1), key).address == others[1]  # plain bounded load


def test_affinity_refuses_bad_settings():
    with pytest.raises(ValueError):
        Affinity(load_factor=0.9)
    with pytest.raises(ValueError):
        Affinity(min_gap=-1)


def test_routing_key_prefers_the_group_key_then_the_prompt_prefix():
    assert routing_key("g1", "abc", None, 64) == routing_key("g1", "xyz", None, 64)
    assert routing_key("", "same start, different end 1", None, 10) == routing_key(
        "", "same start, different end 2", None, 10
    )
    assert routing_key("", "abc", None, 64) != routing_key("", "abd", None, 64)
    assert routing_key("", None, [1, 2, 3, 4], 3) == routing_key("", None, [1, 2, 3, 9], 3)
    assert routing_key("", None, [1, 2], 64) != routing_key("", "1,2", None, 64)


# -- circuit breaker ---------------------------------------------------------------------
def test_breaker_ejects_after_consecutive_failures_and_backs_off():
    b = Breaker(threshold=3, base_s=2.0, max_s=5.0)
    assert not b.record_failure(0) and not b.record_failure(0)
    b.record_success()  # not consecutive any more
    assert not b.record_failure(0) and not b.record_failure(0)
    assert b.record_failure(0) and not b.allows(1.9) and b.allows(2.0)
    assert b.record_failure(2.0)  # half-open: one failure ejects again, for longer
    assert not b.allows(5.9) and b.allows(6.0)
    assert b.record_failure(6.0) and b.open_until == 11.0  # capped at max_s
    b.record_success()
    assert b.allows(11.0) and not b.record_failure(12.0)  # closed again: threshold counts anew

"""The behaviour check's logic (rollwire.learner.ingest.check): which tokens it compares under
which version, and the bound. `score` here is a table of logprobs per version standing in for
the fleet; the check against real replicas is tests/integration/learner/test_learner_ingest_check.py."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from rollwire.common.errors import InvalidArgument
from rollwire.common.reasons import Reason
from rollwire.learner.ingest.check import BehaviourCheck, first_gap, trained_by_version

TRUE = {1: [-0.5, -1.0, -2.0, -0.25], 2: [-0.6, -1.5, -2.5, -0.3]}


def table_score(calls: list):
    async def score(sequences, *, adapter, timeout):
        calls.append((sequences, adapter, timeout))
        version = int(adapter.partition("@")[2])
        return SimpleNamespace(logprobs=[TRUE[version]])

    return score


def test_trained_tokens_are_grouped_by_the_version_they_name():
    assert trained_by_version([1, 0, 2, 1], [True, False, True, True]) == {1: [0, 3], 2: [2]}


def test_the_first_token_beyond_the_bound_is_named_and_nan_is_beyond_any():
    assert first_gap([-0.5, -1.2], [-0.5, -1.0], [0, 1], 0.1) == (1, -1.2, -1.0)
    assert first_gap([-0.5, -1.05], [-0.5, -1.0], [0, 1], 0.1) is None
    gap = first_gap([math.nan], [-1.0], [0], 10.0)
    assert gap is not None and gap[0] == 0


async def test_honest_logprobs_pass_with_one_score_per_version():
    calls: list = []
    check = BehaviourCheck(1e-3, table_score(calls), "pol")
    claimed = [TRUE[1][0], 0.0, TRUE[2][2], TRUE[1][3] + 5e-4]
    await check.verify([7, 8], [1, 2, 3, 4], claimed, [1, 0, 2, 1], [True, False, True, True])
    assert [(c[0], c[1]) for c in calls] == [([([7, 8], [1, 2, 3, 4])], "pol@1"), ([([7, 8], [1, 2, 3, 4])], "pol@2")]


@pytest.mark.parametrize("forged_at", [0, 2, 3])
async def test_a_forged_trained_logprob_is_refused_and_untrained_ones_are_ignored(forged_at):
    check = BehaviourCheck(1e-3, table_score([]), "pol")
    versions, mask = [1, 0, 2, 1], [True, False, True, True]
    claimed = [TRUE[v][j] if v else -9.0 for j, v in enumerate(versions)]  # token 1 is the environment's: ignored
    claimed[forged_at] -= 0.01
    with pytest.raises(InvalidArgument) as refused:
        await check.verify([7], [1, 2, 3, 4], claimed, versions, mask)
    assert refused.value.reason == Reason.BEHAVIOUR_MISMATCH and f"token {forged_at} " in refused.value.message

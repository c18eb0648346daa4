"""No producer can poison or starve training (issue 32, item 3).

- Whatever check_shape accepts gives a finite loss and finite gradients through the learner's
  own float32 arithmetic (group_advantages, policy_loss), equal to the same formulas in
  float64: a property over generated trajectories with extreme numbers.
- A step whose gradient is not finite is skipped: the weights and the optimiser stay bit for
  bit as they were, the skip is counted and logged with the producers behind it, and the next
  step trains.
- The room: a byte budget and per-producer shares, so one producer filling its share never
  locks another out, and every hold is released once.
"""

from __future__ import annotations

import math
import sys

import grpc
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rollwire.common.errors import InvalidArgument, ResourceExhausted
from rollwire.common.reasons import Reason
from rollwire.learner.config import IngestSection, TrainSection, group_reservation, sample_bytes
from rollwire.learner.ingest.intake import Ingest, Trajectory, check_shape
from rollwire.learner.ingest.room import compact_sample
from rollwire.learner.rollouts.buffer import Buffer, GroupLedger
from rollwire.learner.rollouts.groups import ScoredGroup, ScoredSample
from rollwire.learner.run.metrics import LearnerMetrics
from rollwire.learner.tasks.task import Example
from rollwire.learner.train.grpo import group_advantages, policy_loss
from rollwire.learner.train.trainer import Trainer

CFG = IngestSection(enabled=True)
VOCAB = 100
EXTREME = [-1e4, -1000.0, -80.0, -50.0, -50.0001, -20.0, -1.0, -1e-45, -5e-324, -0.0, 0.0, 5e-324, 1e-45,
           1.0, 1e6, -1e6, 1e6 + 1, 3.4e38, -3.4e38, 3.5e38, 1e39, -1e39, math.nan, math.inf, -math.inf]  # fmt: skip
numbers = st.sampled_from(EXTREME) | st.floats(allow_nan=True, allow_infinity=True) | st.floats(-60, 0)


@st.composite
def groups(draw) -> tuple[list[Trajectory], list[list[float]]]:
    """A group of 2-4 trajectories of 1-5 tokens with extreme rewards and logprobs, and the
    policy's logprobs of the same tokens (anything a model may give, -200..0)."""
    size, width = draw(st.integers(2, 4)), draw(st.integers(1, 5))
    out, policy = [], []
    for _ in range(size):
        mask = draw(st.lists(st.booleans(), min_size=width, max_size=width))
        out.append(
            Trajectory("g", size, [1], [2] * width, mask, draw(st.lists(numbers, min_size=width, max_size=width)),
                       [1] * width, draw(numbers))
        )  # fmt: skip
        policy.append(draw(st.lists(st.floats(-200, 0), min_size=width, max_size=width)))
    return out, policy


def accepted(t: Trajectory) -> bool:
    try:
        check_shape(t, CFG, VOCAB)
    except InvalidArgument as err:
        assert err.reason == Reason.BAD_TRAJECTORY
        return False
    return True


def reference(rewards, behaviour, policy, mask):
    """The clipped, truncated surrogate in float64 without any clamp: (loss, d loss / d logp)."""
    r = torch.tensor(rewards, dtype=torch.float64)
    return surrogate64((r - r.mean()) / (r.std(unbiased=False) + 1e-6), behaviour, policy, mask)


def surrogate64(advantages, behaviour, policy, mask, clip=(0.2, 0.28), cap=4.0):
    a = torch.as_tensor(advantages, dtype=torch.float64).unsqueeze(1).expand(-1, len(mask[0]))
    logp = torch.tensor(policy, dtype=torch.float64, requires_grad=True)
    m = torch.tensor(mask, dtype=torch.float64)
    rho = torch.exp(logp - torch.tensor(behaviour, dtype=torch.float64))
    s = torch.min(rho * a, rho.clamp(1 - clip[0], 1 + clip[1]) * a)
    s = torch.where(a < 0, torch.max(s, cap * a), s)
    loss = (-s * m).sum() / max(float(m.sum()), 1.0)
    loss.backward()
    assert logp.grad is not None
    return loss.item(), logp.grad


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(groups())
@example(  # the audit's reproductions (A3): a behaviour logprob of -1000, a reward of 1e39
    ([Trajectory("g", 2, [1], [3, 4], [True, True], [-1000.0, -0.1], [1, 1], 1.0),
      Trajectory("g", 2, [1], [3, 4], [True, True], [-0.5, -0.1], [1, 1], 1e39)], [[-2.0, -1.9], [-2.0, -1.9]])
)  # fmt: skip
def test_whatever_the_checks_accept_gives_a_finite_loss_and_gradient(drawn):
    trajectories, policy = drawn
    for t in trajectories:
        if not any(t.loss_mask):
            continue
        bounded = math.isfinite(t.reward) and abs(t.reward) <= CFG.max_abs_reward
        in_range = all(CFG.min_logprob <= lp <= 0 for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if m)
        assert accepted(t) == (bounded and in_range), t
    if not all(any(t.loss_mask) and accepted(t) for t in trajectories):
        return
    samples = [compact_sample(t.token_ids, t.logprobs, t.token_versions, t.loss_mask, t.reward, False)
               for t in trajectories]  # fmt: skip
    rewards = [s.reward for s in samples]
    advantages = group_advantages(torch.tensor([rewards], dtype=torch.float64))[0]
    assert advantages.dtype == torch.float32 and bool(torch.isfinite(advantages).all())
    width = len(trajectories[0].token_ids)
    logp = torch.tensor(policy, requires_grad=True)
    behaviour = torch.tensor([list(s.logprobs) for s in samples])
    mask = torch.tensor([list(s.loss_mask) for s in samples], dtype=torch.float32)
    terms = policy_loss(logp, behaviour, advantages.unsqueeze(1).expand(-1, width), mask, clip_high=0.28)
    terms.loss.backward()
    assert logp.grad is not None
    assert math.isfinite(terms.loss.item()) and bool(torch.isfinite(logp.grad).all())
    want_loss, want_grad = reference(rewards, behaviour.double().tolist(), policy, mask.tolist())
    assert terms.loss.item() == pytest.approx(want_loss, rel=1e-4, abs=1e-4)
    assert torch.allclose(logp.grad.double(), want_grad, rtol=1e-3, atol=1e-5)


def test_the_bounds_are_named_in_the_refusal():
    t = Trajectory("g", 2, [1], [3, 4], [True, True], [-0.5, -0.1], [1, 1], 1e39)
    with pytest.raises(InvalidArgument, match=r"ingest\.max_abs_reward"):
        check_shape(t, CFG, VOCAB)
    t.reward, t.logprobs = 1.0, [-1000.0, -0.1]
    with pytest.raises(InvalidArgument, match=r"ingest\.min_logprob"):
        check_shape(t, CFG, VOCAB)
    t.logprobs = [CFG.min_logprob, -0.0]  # the floor itself is accepted
    check_shape(t, CFG, VOCAB)


def test_the_loss_clamps_the_ratio_so_its_gradient_stays_finite():
    """The audit's case at the loss: a behaviour logprob 998 below the policy's gave a finite
    loss and a NaN gradient; now that token's gradient is the clip's zero, the other's is kept."""
    for advantage in (1.0, -1.0):
        w = torch.tensor(0.0, requires_grad=True)
        logp = (w - 2.0).expand(1, 2)
        terms = policy_loss(logp, torch.tensor([[-1000.0, -1.9]]), torch.tensor([[advantage] * 2]), torch.ones(1, 2))
        terms.loss.backward()
        assert w.grad is not None and math.isfinite(w.grad.item()) and math.isfinite(terms.loss.item())
        # token 1 (rho = e^998, beyond even float64) is clipped or truncated: no gradient; token 2 has
        # rho = e^-0.1 inside the clip: d/dw of -rho A / 2 (float64 overflows on token 1 too, so by hand)
        assert w.grad.item() == pytest.approx(-advantage * math.exp(-0.1) / 2, abs=1e-6)
        assert terms.loss.item() == pytest.approx(
            -(1.2 if advantage > 0 else 4.0) * advantage / 2 - advantage * math.exp(-0.1) / 2, abs=1e-5
        )


# -- the trainer skips a step whose gradient is not finite -------------------------------------
def batch(poisoned: str = "", count: int = 2) -> list[ScoredGroup]:
    """`count` groups of 4; with `poisoned`, the last one (sent by that producer) carries a NaN
    behaviour logprob, as a broken generator or a producer past the checks could."""
    out = []
    for g in range(count):
        samples = [ScoredSample([40 + i, 41 + g, 2], [-1.0] * 3, [1, 1, 1], "x", "eos", float((i + g) % 2), False)
                   for i in range(4)]  # fmt: skip
        out.append(ScoredGroup(Example(g, "p", "a", {"group_id": f"grp-{g}"}), [10 + g, 11, 12], samples, 1))
    if poisoned:
        out[-1].samples[0].logprobs = [-1.0, math.nan, -1.0]
        out[-1].source, out[-1].producer = "ingest", poisoned
    return out


@pytest.mark.parametrize("poison", ["nan_logprob", "inf_gradient"])
def test_a_step_with_a_non_finite_gradient_or_loss_is_skipped_counted_and_logged(tiny_model, poison):
    """A NaN behaviour logprob makes the loss NaN (the clamp gives its token no gradient); an
    infinite gradient (a hook here) leaves the loss finite. Either step is skipped."""
    from structlog.testing import capture_logs

    micro = 1 if poison == "nan_logprob" else 0  # micro-batches narrow the suspects to the poisoned group
    trainer = Trainer(tiny_model, TrainSection(lr=1e-2, groups_per_step=2, micro_batch_groups=micro), 1.0, seed=0)
    trainer.step(batch(), version=1)  # AdamW has state: a skipped step must not touch it either
    weights = trainer.adapter_payload()
    state = {k: v.clone() for s in trainer.optimizer.state.values() for k, v in s.items() if torch.is_tensor(v)}
    lora = next(p for p in trainer.model.parameters() if p.requires_grad)
    hook = lora.register_hook(lambda g: g * math.inf) if poison == "inf_gradient" else None
    with capture_logs() as logs:
        stats = trainer.step(batch("token:poisoner"), version=2)
    if hook is not None:
        hook.remove()
    reason = "nonfinite_loss" if poison == "nan_logprob" else "nonfinite_gradient"
    assert stats.skipped == reason, stats
    assert trainer.adapter_payload() == weights  # bit for bit
    after = {k: v for s in trainer.optimizer.state.values() for k, v in s.items() if torch.is_tensor(v)}
    assert state.keys() == after.keys() and all(torch.equal(state[k], after[k]) for k in state)
    assert all(p.grad is None for p in trainer.model.parameters() if p.requires_grad)
    (line,) = [e for e in logs if e["event"] == "step_skipped"]
    if micro:
        assert line["producers"] == ["token:poisoner"] and line["groups"] == ["token:poisoner/grp-1"], line
    else:
        assert line["producers"] == ["producer", "token:poisoner"] and len(line["groups"]) == 2, line
    metrics = LearnerMetrics()
    metrics.on_step(stats, [0], 3)
    value = metrics.registry.get_sample_value
    assert value("rollwire_learner_skipped_steps_total", {"reason": reason}) == 1
    assert value("rollwire_learner_steps_total") == 0
    # the run goes on: the next batch trains
    good = trainer.step(batch(), version=3)
    assert not good.skipped and math.isfinite(good.grad_norm) and trainer.adapter_payload() != weights


# -- the room: a byte budget and per-producer shares --------------------------------------------
def ingest(**cfg) -> Ingest:
    buffer = Buffer(1, keep_zero_variance=False, ledger=GroupLedger())
    buffer.next_train_version = 3
    sizes = dict(max_tokens=8, max_group_size=4, max_prompt_tokens=16)
    return Ingest(IngestSection(enabled=True, **sizes, **cfg), buffer, lambda: 3, VOCAB)


def traj(group: str, reward: float = 0.0) -> Trajectory:
    return Trajectory(group, 2, [5, 6], [10, 11, 12], [True, False, True], [-0.5, 0.0, -0.5], [3, 0, 3], reward)


def test_one_producer_filling_its_share_does_not_lock_out_another():
    i = ingest(max_pending_groups=8, producer_share=0.5)
    for g in range(4):
        i.submit(traj(f"a{g}"), "token:a")
    with pytest.raises(ResourceExhausted) as info:
        i.submit(traj("a4"), "token:a")
    err = info.value
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.reason == Reason.INGEST_QUOTA
    assert "ingest.producer_share" in err.message and "token:a" in err.message and err.retry_after_s == 1.0
    assert i.submit(traj("a0", reward=1), "token:a") is True  # its open groups still take their samples
    for g in range(4):
        i.submit(traj(f"b{g}"), "token:b")  # not locked out
    with pytest.raises(ResourceExhausted) as info:
        i.submit(traj("c0"), "token:c")  # the learner is full: 8 groups
    assert info.value.reason == Reason.INGEST_FULL
    assert i.counts[Reason.INGEST_QUOTA] == 1 and i.counts[Reason.INGEST_FULL] == 1


def test_the_byte_budget_binds_per_producer_and_every_hold_is_released_once():
    reserve = group_reservation(2, 2, 8)
    i = ingest(max_pending_groups=1000, max_pending_bytes=1 << 16, producer_share=0.5)
    fits = (1 << 15) // reserve
    for g in range(fits):
        i.submit(traj(f"a{g}"), "token:a")
    assert i.room.bytes["token:a"] == fits * reserve
    with pytest.raises(ResourceExhausted, match=r"ingest\.max_pending_bytes") as info:
        i.submit(traj("late"), "token:a")
    assert info.value.reason == Reason.INGEST_QUOTA
    i.submit(traj("b0"), "token:b")
    # completing a group shrinks its hold to what its samples take; training releases it
    i.submit(traj("a0", reward=1), "token:a")
    assert i.room.holds[1].nbytes == 4 * 2 + 2 * sample_bytes(3) < reserve
    (group,) = i.buffer._groups
    assert group.producer == "token:a"
    i.buffer._groups.clear()
    i.buffer.ledger.train(1)
    i.on_trained([group], applied=False)  # a skipped step: its samples count as dropped
    assert i.counts["dropped"] == 2 and i.groups["skipped"] == 1
    held = i.room.held
    i.room.release(1)  # released once: a second release changes nothing
    assert i.room.held == held and i.room.bytes["token:a"] == (fits - 1) * reserve
    i.stop()
    assert i.room.held == 0 and not i.room.holds and not i.room.groups and not i.room.bytes


def test_an_idle_incomplete_group_expires_before_the_group_timeout():
    now = [0.0]
    i = ingest(group_idle_s=10, group_timeout_s=600)
    i.clock = lambda: now[0]
    i.submit(traj("a"), "token:a")
    now[0] = 11.0
    assert i.expire() == 1 and i.counts["expired"] == 1 and i.room.held == 0


def test_a_held_sample_is_compact():
    """One trajectory of 32768 tokens held as arrays: about 17 bytes a token (lists took ~85)."""
    import tracemalloc

    n = 32768
    ids, logprobs, versions, mask = [7] * n, [-0.5] * n, [3] * n, [True] * n
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    sample = compact_sample(ids, logprobs, versions, mask, 1.0, True)
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert held <= sample_bytes(n) and sys.getsizeof(sample.token_ids) < 4 * n + 100

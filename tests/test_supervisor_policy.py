"""Restart policy arithmetic with an injected clock and random source."""

from __future__ import annotations

import random

import pytest

from poolserve.service.lifecycle.backoff import DecayingCounter, backoff_delay
from poolserve.supervisor.clock import FakeClock
from poolserve.supervisor.policy import RestartPolicy
from poolserve.supervisor.spec import SupervisorSpec


class FixedRandom(random.Random):
    """A random source that always draws the same number."""

    def __init__(self, value: float) -> None:
        super().__init__(0)
        self.value = value

    def random(self) -> float:
        return self.value


def test_counter_halves_every_half_life() -> None:
    counter = DecayingCounter(half_life=30.0)
    assert counter.add(0.0) == 1.0
    assert counter.value(30.0) == pytest.approx(0.5)
    assert counter.value(60.0) == pytest.approx(0.25)
    assert counter.add(30.0) == pytest.approx(1.5)
    counter.reset()
    assert counter.value(30.0) == 0.0


def test_counter_never_decays_backwards_in_time() -> None:
    counter = DecayingCounter(half_life=10.0)
    counter.add(100.0)
    assert counter.value(50.0) == 1.0


@pytest.mark.parametrize("failures", [1, 2, 3, 5, 8, 20, 1000])
def test_backoff_stays_within_jitter_bounds(failures: int) -> None:
    nominal = min(15.0, 0.1 * 2 ** (failures - 1))
    rng = random.Random(failures)
    for _ in range(200):
        delay = backoff_delay(failures, base=0.1, cap=15.0, jitter=0.5, rng=rng)
        assert nominal * 0.5 <= delay <= nominal


def test_backoff_extremes_of_the_random_draw() -> None:
    low = backoff_delay(3, base=0.1, cap=15.0, jitter=0.5, rng=FixedRandom(0.999999))
    high = backoff_delay(3, base=0.1, cap=15.0, jitter=0.5, rng=FixedRandom(0.0))
    assert low == pytest.approx(0.2, rel=1e-4)
    assert high == pytest.approx(0.4)


def test_backoff_doubles_then_caps_without_jitter() -> None:
    delays = [
        backoff_delay(n, base=0.1, cap=1.0, jitter=0.0, rng=random.Random(0)) for n in range(1, 7)
    ]
    assert delays == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])


def test_backoff_survives_huge_failure_counts() -> None:
    delay = backoff_delay(1e9, base=0.1, cap=15.0, jitter=0.0, rng=random.Random(0))
    assert delay == 15.0


def test_pause_once_the_threshold_is_exceeded() -> None:
    clock = FakeClock()
    policy = RestartPolicy(SupervisorSpec("sup", failure_threshold=5.0), clock, random.Random(0))
    decisions = [policy.on_failure("a") for _ in range(5)]
    assert not any(decision.paused for decision in decisions)

    sixth = policy.on_failure("a")
    assert sixth.paused and sixth.pause_started
    assert sixth.resume_in == 15.0
    assert policy.paused
    clock.advance(10.0)
    assert policy.pause_remaining() == pytest.approx(5.0)

    seventh = policy.on_failure("b")
    assert seventh.paused and not seventh.pause_started  # one pause, not a new one

    policy.resume()
    assert policy.pause_remaining() == 0.0
    assert policy.failures() == 0.0
    assert not policy.on_failure("a").paused


def test_failures_spread_over_time_never_pause() -> None:
    clock = FakeClock()
    policy = RestartPolicy(SupervisorSpec("sup", failure_threshold=2.0), clock, random.Random(0))
    for _ in range(100):
        assert not policy.on_failure("a").paused
        clock.advance(60.0)  # two half-lives between failures
    assert policy.failures() < 2.0


def test_decay_lets_a_burst_be_forgotten() -> None:
    clock = FakeClock()
    policy = RestartPolicy(SupervisorSpec("sup", failure_threshold=5.0), clock, random.Random(0))
    for _ in range(5):
        policy.on_failure("a")
    clock.advance(30.0)  # one half-life: 5 -> 2.5
    assert policy.failures() == pytest.approx(2.5)
    assert not policy.on_failure("a").paused  # 3.5


def test_backoff_grows_per_child_and_decays() -> None:
    clock = FakeClock()
    policy = RestartPolicy(
        SupervisorSpec(
            "sup", backoff_base=1.0, backoff_max=100.0, jitter=0.0, failure_threshold=100.0
        ),
        clock,
        random.Random(0),
    )
    assert [policy.on_failure("a").delay for _ in range(4)] == pytest.approx([1, 2, 4, 8])
    assert policy.on_failure("b").delay == pytest.approx(1.0)  # another child: its own count
    clock.advance(30.0 * 20)  # twenty half-lives: "a" is as good as new
    assert policy.on_failure("a").delay == pytest.approx(1.0, rel=1e-3)
    policy.forget("a")
    assert policy.on_failure("a").delay == pytest.approx(1.0)


def test_spec_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="jitter"):
        SupervisorSpec("x", jitter=2.0)
    with pytest.raises(ValueError, match="failure_decay"):
        SupervisorSpec("x", failure_decay=0.0)

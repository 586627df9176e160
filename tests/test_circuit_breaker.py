"""The circuit breaker on a fake clock: it opens, half-opens for exactly one probe, and
closes or opens again on the probe's outcome."""
from __future__ import annotations

import pytest

from storage.circuit_breaker import BreakerConfig, CircuitBreaker, Permit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def opened(failures: int = 2, cooldown_s: float = 5.0) -> tuple[CircuitBreaker, Clock]:
    clock = Clock()
    breaker = CircuitBreaker(BreakerConfig(failures=failures, cooldown_s=cooldown_s), clock)
    for _ in range(failures):
        breaker.record(breaker.allow(), ok=False)
    return breaker, clock


def test_consecutive_failures_open_it_and_a_success_resets_the_count():
    breaker = CircuitBreaker(BreakerConfig(failures=3), Clock())
    for ok in (False, False, True, False, False):
        assert breaker.allow() is Permit.CALL
        assert breaker.record(Permit.CALL, ok) is False
    assert breaker.available
    assert breaker.record(breaker.allow(), ok=False) is True  # the third in a row
    assert breaker.allow() is Permit.REFUSED and not breaker.available


def test_after_the_cooldown_exactly_one_probe_goes_through():
    breaker, clock = opened(cooldown_s=5.0)
    clock.now += 4.9
    assert not breaker.available and breaker.allow() is Permit.REFUSED
    clock.now += 0.1
    assert breaker.available  # a caller that checks first still gets to probe
    assert breaker.allow() is Permit.PROBE
    assert not breaker.available
    assert [breaker.allow() for _ in range(3)] == [Permit.REFUSED] * 3


def test_a_good_probe_closes_it():
    breaker, clock = opened()
    clock.now += 5
    assert breaker.record(breaker.allow(), ok=True) is True
    assert breaker.available and breaker.allow() is Permit.CALL
    assert breaker.record(Permit.CALL, ok=False) is False  # the count starts again


def test_a_failed_probe_opens_it_for_another_cooldown():
    breaker, clock = opened(cooldown_s=5.0)
    clock.now += 7
    permit = breaker.allow()
    clock.now += 1  # the probe takes a while
    assert breaker.record(permit, ok=False) is True
    clock.now += 4.9
    assert not breaker.available and breaker.allow() is Permit.REFUSED
    clock.now += 0.1
    assert breaker.allow() is Permit.PROBE


def test_calls_let_through_before_it_opened_do_not_change_it():
    clock = Clock()
    breaker = CircuitBreaker(BreakerConfig(failures=1, cooldown_s=5.0), clock)
    late = breaker.allow()
    breaker.record(breaker.allow(), ok=False)
    clock.now += 3
    assert breaker.record(late, ok=False) is False  # does not push the cooldown back
    assert breaker.record(late, ok=True) is False  # nor close it without a probe
    clock.now += 2
    assert breaker.allow() is Permit.PROBE
    assert breaker.record(late, ok=False) is False  # nor spoil the probe under way
    assert breaker.allow() is Permit.REFUSED


def test_a_refused_call_has_no_outcome():
    breaker, _ = opened()
    with pytest.raises(ValueError, match="refused"):
        breaker.record(breaker.allow(), ok=False)


def test_config_is_validated():
    for fields in (dict(failures=0), dict(failures=True), dict(failures=1.5), dict(cooldown_s=-1),
                   dict(cooldown_s=float("nan"))):
        with pytest.raises(ValueError, match="breaker"):
            BreakerConfig(**fields)


def test_is_open_from_the_failure_that_opens_it_until_a_probe_closes_it():
    breaker, clock = opened(cooldown_s=5.0)
    assert breaker.is_open
    clock.now += 5.0
    assert breaker.available and breaker.is_open  # a probe is due: still open
    probe = breaker.allow()
    breaker.record(probe, ok=False)
    assert breaker.is_open
    clock.now += 5.0
    breaker.record(breaker.allow(), ok=True)
    assert not breaker.is_open and not CircuitBreaker(BreakerConfig()).is_open

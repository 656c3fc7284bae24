"""How retries wait (jobs.retry): exponential backoff with a cap, jitter, the attempt budget."""

import random

import pytest

from jobs.retry import retries_left, retry_delay_seconds

NO_JITTER = {
    "initial_delay_seconds": 10,
    "backoff_factor": 2.0,
    "max_delay_seconds": 100,
    "jitter": False,
}


@pytest.mark.parametrize(
    ("attempt_number", "delay"), [(1, 10), (2, 20), (3, 40), (4, 80), (5, 100), (20, 100)]
)
def test_retry_delay_is_exponential_and_capped(attempt_number, delay):
    assert retry_delay_seconds(NO_JITTER, attempt_number=attempt_number) == delay


def test_retry_delay_defaults_apply_to_an_empty_policy():
    """Defaults: 10 s initial, factor 2, jitter on (so within [0, 10] for attempt 1)."""
    delay = retry_delay_seconds({}, attempt_number=1, rng=random.Random(7))
    assert delay == random.Random(7).uniform(0, 10)


def test_retry_delay_with_jitter_stays_within_zero_and_the_ceiling():
    policy = {**NO_JITTER, "jitter": True}
    rng = random.Random(1234)
    for attempt_number, ceiling in [(1, 10), (2, 20), (3, 40), (6, 100)]:
        delays = [
            retry_delay_seconds(policy, attempt_number=attempt_number, rng=rng) for _ in range(200)
        ]
        assert all(0 <= delay <= ceiling for delay in delays)
        # Full jitter spreads over the whole window, not just near the ceiling.
        assert min(delays) < ceiling / 4 and max(delays) > ceiling * 3 / 4


def test_retry_delay_with_jitter_is_reproducible_with_a_seed():
    policy = {**NO_JITTER, "jitter": True}
    first = [retry_delay_seconds(policy, attempt_number=3, rng=random.Random(5)) for _ in range(3)]
    assert first == [random.Random(5).uniform(0, 40)] * 3


@pytest.mark.parametrize(
    ("max_attempts", "attempt_number", "left"),
    [(3, 1, True), (3, 2, True), (3, 3, False), (3, 4, False), (1, 1, False)],
)
def test_retries_left_counts_the_attempt_budget(max_attempts, attempt_number, left):
    assert retries_left({"max_attempts": max_attempts}, attempt_number=attempt_number) is left


def test_retries_left_default_budget_is_three_attempts():
    assert retries_left({}, attempt_number=2) is True
    assert retries_left({}, attempt_number=3) is False

"""storage.metrics: the tallies summed over their shards, and the readiness ping."""

from __future__ import annotations

import pytest

from jobs.models import Tally
from storage.metrics import TallySum, database_ping, tallies_sum


@pytest.mark.django_db
def test_tallies_are_summed_over_their_shards_by_name_and_labels():
    Tally.objects.all().delete()  # the triggers' rows of other tests' runs, if any
    Tally.objects.bulk_create(
        [
            Tally(name="lag", labels='le="0.5"', shard=0, count=2, total=0.5),
            Tally(name="lag", labels='le="0.5"', shard=3, count=3, total=1.0),
            Tally(name="lag", labels='le="1.0"', shard=1, count=1, total=0.75),
            Tally(name="other", labels="", shard=0, count=9, total=0.0),
            Tally(name="unasked", labels="", shard=0, count=4, total=0.0),
        ]
    )
    found = sorted(tallies_sum(names=["lag", "other"]))
    assert found == [
        TallySum("lag", 'le="0.5"', 5, 1.5),
        TallySum("lag", 'le="1.0"', 1, 0.75),
        TallySum("other", "", 9, 0.0),
    ]
    assert all(type(tally.count) is int for tally in found)
    assert tallies_sum(names=["none such"]) == []


@pytest.mark.django_db
def test_the_database_answers_the_ping():
    assert database_ping() is None

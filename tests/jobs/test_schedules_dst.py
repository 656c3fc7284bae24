"""docs/time.md holds the DST tables the implementation produces, and the tables say what
the documented policy says for New York and Berlin on their 2025 transition days."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs.schedules import FOLD_POLICIES, GAP_POLICIES
from tests.jobs.dst_tables import (
    BEGIN,
    END,
    TRANSITION_DAYS,
    WILDCARD_HOUR,
    fires,
    local_day,
    render,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "time.md"


def test_docs_time_md_holds_the_tables_the_code_produces():
    text = DOC.read_text()
    documented = text[text.index(BEGIN) : text.index(END) + len(END)]
    assert documented == render(), "regenerate with: python -m tests.jobs.dst_tables"


SPRING = [day for day in TRANSITION_DAYS if day[1].month == 3]
FALL = [day for day in TRANSITION_DAYS if day[1].month != 3]


@pytest.mark.parametrize(("timezone", "transition", "fixed"), SPRING)
@pytest.mark.parametrize("fold", FOLD_POLICIES)
def test_spring_forward_under_every_gap_and_fold(timezone, transition, fixed, fold):
    window = local_day(timezone, transition)
    shifted = fires(fixed, timezone, {"gap": "shift", "fold": fold}, *window)
    assert len(shifted) == 1 and shifted[0].endswith(f"({transition:%H:%M}Z) shifted")
    assert fires(fixed, timezone, {"gap": "skip", "fold": fold}, *window) == []
    # The local day has 23 hours; the skipped hour gives one shifted fire, or none.
    for gap, expected in (("shift", 1), ("skip", 0)):
        hourly = fires(WILDCARD_HOUR, timezone, {"gap": gap, "fold": fold}, *window)
        assert sum(entry.endswith("shifted") for entry in hourly) == expected
        assert len(hourly) == 23 + expected


@pytest.mark.parametrize(("timezone", "transition", "fixed"), FALL)
@pytest.mark.parametrize("gap", GAP_POLICIES)
def test_fall_back_under_every_gap_and_fold(timezone, transition, fixed, gap):
    window = local_day(timezone, transition)
    first = fires(fixed, timezone, {"gap": gap, "fold": "first"}, *window)
    both = fires(fixed, timezone, {"gap": gap, "fold": "both"}, *window)
    auto = fires(fixed, timezone, {"gap": gap, "fold": "auto"}, *window)
    assert [entry[-3:] for entry in first] == ["1st"]
    assert [entry[-3:] for entry in both] == ["1st", "2nd"]
    assert auto == first  # a fixed hour fires once
    hourly = {
        fold: fires(WILDCARD_HOUR, timezone, {"gap": gap, "fold": fold}, *window)
        for fold in FOLD_POLICIES
    }
    # The local day has 25 hours: both and auto follow elapsed time; first drops the 2nd.
    assert len(hourly["both"]) == 25
    assert hourly["auto"] == hourly["both"]
    assert hourly["first"] == [entry for entry in hourly["both"] if not entry.endswith("2nd")]
    assert len(hourly["first"]) == 24

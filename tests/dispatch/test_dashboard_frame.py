"""The dashboard in the product's frame (its title, header, links and logout), its figures
rounded for people, and plots that span the minutes the system has lived (at least 5),
not a sliver of the hour."""

from __future__ import annotations

import datetime as dt

import pytest

from dispatch.charts import _format
from dispatch.dashboard import MIN_PLOT_MINUTES, _plot_span
from tests.factories import superuser

NOW = dt.datetime(2030, 1, 1, 12, 0, tzinfo=dt.UTC)


@pytest.mark.django_db
def test_the_dashboard_has_its_own_frame_with_a_logout(client):
    client.force_login(superuser("op"))
    page = client.get("/dashboard/").content.decode()
    assert "<title>Dashboard | Durable job scheduler</title>" in page
    assert '<div id="site-name"><a href="/">Durable job scheduler</a></div>' in page
    assert 'id="logout-form"' in page and 'action="/admin/logout/"' in page
    assert "Django administration" not in page
    assert 'href="/api/docs/"' in page and 'href="/admin/"' in page


def test_figures_are_rounded_for_people():
    assert _format(0.700625, "s") == "0.701 s"
    assert _format(12.3456, "s") == "12.3 s"
    assert _format(150, "s") == "2.5 min"
    assert _format(0.0004, "s") == "0.4 ms"
    assert _format(1234.5, "") == "1234"


@pytest.mark.parametrize(
    ("age_minutes", "minutes", "label"),
    [
        (None, MIN_PLOT_MINUTES, "last 5 min"),
        (0.5, 5, "last 5 min"),
        (12.2, 13, "last 13 min"),
        (59.5, 60, "last hour"),
    ],  # fmt: skip
)
def test_the_plots_span_the_minutes_with_runs(age_minutes, minutes, label):
    runs = [] if age_minutes is None else [
        {"created_at": NOW - dt.timedelta(minutes=age_minutes)},
        {"created_at": NOW - dt.timedelta(seconds=5)},
    ]  # fmt: skip
    span = _plot_span(runs, NOW)
    assert (span.minutes, span.label) == (minutes, label)
    if runs and age_minutes > MIN_PLOT_MINUTES:  # the oldest run first, the newest last
        assert span.index(runs[0]["created_at"]) == 0
        assert span.index(runs[1]["created_at"]) == minutes - 1

"""/dashboard/ over real HTTP: who may open it, and that its figures and plots are the
database's (a known set of runs, attempts, jobs and counters)."""

import datetime as dt
import re

import pytest
import requests
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.test import Client

from dispatch.dashboard import dashboard_figures
from jobs.counters import counter_increment
from jobs.services import job_backfill, job_trigger
from jobs.transitions import attempt_fail, attempt_succeed, run_claim
from tests import factories


def session_for(user, live_server) -> requests.Session:
    client = Client()
    client.force_login(user)
    session = requests.Session()
    session.cookies.set("sessionid", client.cookies["sessionid"].value)
    session.base = live_server.url
    return session


def figures(html: str) -> dict[str, str]:
    """data-figure name -> its text (the first of each name; rows are read apart)."""
    found = {}
    for name, text in re.findall(r'data-figure="([\w-]+)"[^>]*>([^<]*)<', html):
        found.setdefault(name, text.strip())
    return found


def row(html: str, attribute: str, value: str) -> dict[str, str]:
    match = re.search(rf'<tr {attribute}="{re.escape(value)}">(.*?)</tr>', html, re.S)
    assert match, f"no row {attribute}={value}"
    return figures(match.group(1))


def series_max(html: str, title: str) -> dict[str, float]:
    """The peak of each series of the chart titled `title`."""
    chart = re.search(rf'<svg[^>]*aria-label="{title}".*?</svg>', html, re.S)
    assert chart, f"no chart {title}"
    return {
        label: float(peak)
        for label, peak in re.findall(r'data-series="(\w+)" data-max="([\d.e+-]+)"', chart[0])
    }


@pytest.fixture
def staff(transactional_db):
    """Staff in the operators group: the dashboard's lists show every owner's runs."""
    user = get_user_model().objects.create_user("staff", password="pw", is_staff=True)
    user.groups.add(Group.objects.get_or_create(name="operators")[0])
    return user


@pytest.fixture
def workload(transactional_db):
    """Ten minutes ago: two runs succeeded (1 s and 3 s... one of them failed instead), one
    running on worker w2, one queued and unpublished; a job overdue by five minutes; two
    lease expiries and a duplicate delivery counted."""
    owner = factories.owner("dash")
    base = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=10)
    at = lambda seconds: base + dt.timedelta(seconds=seconds)  # noqa: E731
    runs = [
        factories.queued_run(owner, run_at=base, materialize_at=at(0.02), args=[n], name=f"j{n}")
        for n in range(4)
    ]
    ran, failed, running, _queued = runs
    attempts = {}
    for run in (ran, failed, running):
        factories.publish(run, at=at(0.1))
        attempts[run.id] = run_claim(
            run_id=run.id,
            worker="w2" if run is running else "w1",
            now=at(0.3),
            lease_seconds=3600,
            published_at=at(0.1),
        )
    assert attempt_succeed(attempt=attempts[ran.id], now=at(1.3))
    assert attempt_fail(attempt=attempts[failed.id], now=at(3.3), error="x", retry_at=None)
    factories.make_job(
        owner,
        now=base,
        name="late",
        schedule={"kind": "once", "run_at": (base + dt.timedelta(minutes=5)).isoformat()},
    )
    counter_increment("scheduler_lease_expired_total", by=2)
    counter_increment("scheduler_duplicate_deliveries_total")
    return {"failed_job": failed.job_id, "failed_run": failed.id}


def test_the_dashboard_shows_the_figures_in_the_database(live_server, staff, workload):
    http = session_for(staff, live_server)
    page = http.get(f"{http.base}/dashboard/")
    assert page.status_code == 200, page.text[:300]
    html = page.text
    shown = figures(html)
    assert {state: shown[f"runs-{state}"] for state in ("succeeded", "failed", "running")} == {
        "succeeded": "1", "failed": "1", "running": "1"
    }  # fmt: skip
    assert (shown["runs-queued"], shown["runs-pending"]) == ("1", "0")
    assert (shown["due-now"], shown["overdue-now"]) == ("1", "1")
    oldest = re.search(r'data-figure="oldest-overdue-seconds" data-value="([\d.]+)"', html)
    # The queued run unpublished for ten minutes, more than the job overdue by five.
    assert 600 <= float(oldest[1]) < 630
    assert (shown["dead-letters"], shown["lease-expired"], shown["duplicate-deliveries"]) == (
        "1", "2", "1"
    )  # fmt: skip
    assert (shown["succeeded-last-hour"], shown["failed-last-hour"]) == ("1", "1")
    assert row(html, "data-queue", "jobs") == {
        "broker-ready": "0", "outbox-pending": "1", "runs-queued": "1", "queue-control": ""
    }  # fmt: skip
    assert row(html, "data-worker", "w1") == {"worker-running": "0", "worker-attempts": "2"}
    assert row(html, "data-worker", "w2") == {"worker-running": "1", "worker-attempts": "1"}
    assert row(html, "data-job", str(workload["failed_job"])) == {"job-failed": "1"}
    assert f'data-run="{workload["failed_run"]}"' in html
    # The plots: every stage's p50 and p99 at the known lags (all four runs in one minute).
    assert series_max(html, "discovery lag") == {"p50": 0.02, "p99": 0.02}
    assert series_max(html, "publish lag") == {"p50": pytest.approx(0.08), "p99": 0.08}
    assert series_max(html, "queue wait") == {"p50": 0.2, "p99": 0.2}
    assert series_max(html, "run duration") == {"p50": 3.0, "p99": 3.0}
    assert series_max(html, "runs finished / min") == {"succeeded": 1, "failed": 1}
    # Nothing from another origin: no CDN script, style or font.
    assert not re.findall(r'(?:src|href)="(?:https?:)?//', html)


def test_the_panel_refreshes_the_figures_without_the_page(live_server, staff, workload):
    http = session_for(staff, live_server)
    page = http.get(f"{http.base}/dashboard/").text
    assert 'fetch("/dashboard/panel/"' in page
    counter_increment("scheduler_duplicate_deliveries_total", by=4)
    panel = http.get(f"{http.base}/dashboard/panel/")
    assert panel.status_code == 200
    assert "<html" not in panel.text  # a fragment the page swaps in
    assert figures(panel.text)["duplicate-deliveries"] == "5"


def test_only_staff_and_operators_open_the_dashboard(live_server, transactional_db):
    anonymous = requests.get(f"{live_server.url}/dashboard/", allow_redirects=False)
    assert anonymous.status_code == 302
    assert anonymous.headers["Location"] == "/admin/login/?next=/dashboard/"
    users = get_user_model().objects
    plain = users.create_user("plain", password="pw")
    assert session_for(plain, live_server).get(f"{live_server.url}/dashboard/").status_code == 403
    # Staff open it (docs/api.md); its lists show them only their own jobs' runs.
    staff_only = users.create_user("staff-only", password="pw", is_staff=True)
    assert session_for(staff_only, live_server).get(f"{live_server.url}/dashboard/").ok
    operator = users.create_user("operator", password="pw")
    operator.groups.add(Group.objects.get_or_create(name="operators")[0])
    for path in ("/dashboard/", "/dashboard/panel/"):
        assert session_for(operator, live_server).get(f"{live_server.url}{path}").ok


def test_the_queues_panel_counts_the_backlog_and_the_queued_runs_by_lane(staff):
    """A backfill run and a manual trigger, both unpublished: each is counted in its lane
    (`jobs.backfill`, `jobs.manual`), pending and queued alike, none in `jobs` itself."""
    now = dt.datetime.now(dt.UTC)
    job = factories.make_job(
        factories.owner("lanes"), now=now - dt.timedelta(days=1),
        schedule={"kind": "cron", "expression": "0 * * * *", "timezone": "UTC"},
    )  # fmt: skip
    assert job_backfill(job=job, instants=[now - dt.timedelta(hours=2)], actor=staff, now=now)
    assert job_trigger(job=job, actor=staff, now=now)

    queues = {queue.name: queue for queue in dashboard_figures(user=staff)["queues"]}
    shown = {name: (q.outbox_pending, q.runs_queued) for name, q in queues.items()}
    assert shown == {"jobs": (0, 0), "jobs.backfill": (1, 1), "jobs.manual": (1, 1)}

"""/dashboard/: what an operator watches, on one page that refreshes itself.

`dashboard_figures` reads everything in a bounded number of queries, each through an
index (runs by state and creation, queued runs, running attempts, due jobs) except the
counts of runs by state, which /metrics makes too; the lag and throughput plots are drawn
from the runs created in the last hour (at most SAMPLE of them). The page polls
`/dashboard/panel/` (the same figures as an HTML fragment) every REFRESH_SECONDS.
docs/operations.md, "Dashboard", says what each figure is.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections import defaultdict

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.contrib.auth.views import redirect_to_login
from django.db.models import Count, Max, Q
from django.http import HttpRequest, HttpResponse, HttpResponseForbidden
from django.shortcuts import render

from jobs.clock import db_now
from jobs.lanes import lane_queue
from jobs.models import (
    Attempt,
    AttemptState,
    Counter,
    Job,
    JobState,
    OutboxMessage,
    QueueControl,
    Run,
    RunState,
)
from jobs.queues import queue_paused_now
from jobs.roles import user_is_operator
from jobs.selectors import (
    job_list,
    oldest_overdue_seconds,
    oldest_queued_at,
    run_list,
    runs_by_state_and_backlog,
)

from .charts import Series, line_chart
from .queues import queue_of_lane
from .reconciler import BrokerQueueDepth

WINDOW = dt.timedelta(hours=1)
MINUTES = 60
# The plots span the minutes since the window's first run, at least this many: on a new
# system they fill their frame from the first minute instead of a sliver at the right.
MIN_PLOT_MINUTES = 5
SAMPLE = 20_000  # newest runs of the window the plots are drawn from
OVERDUE_AFTER = dt.timedelta(seconds=60)
TOP_FAILING_WINDOW = dt.timedelta(hours=24)
TOP_FAILING = 10
DEAD_LETTERS_SHOWN = 10
REFRESH_SECONDS = 5
# (label, colour, from, to): the instants of each stage, as /metrics measures them.
STAGES = {
    "discovery lag": ("due_at", "created_at"),
    "publish lag": ("ready_at", "published_at"),
    "queue wait": ("published_at", "started_at"),
    "run duration": ("started_at", "finished_at"),
}
P50, P99 = "#1f77b4", "#d62728"


@dataclasses.dataclass(frozen=True)
class QueueFigures:
    name: str
    broker_ready: int | None  # None: the broker did not answer
    outbox_pending: int  # runs not yet published to it (the backlog)
    runs_queued: int  # published or not, waiting for a worker's claim
    paused: bool = False  # its queue (a lane's, or itself) is paused (jobs.queues)
    max_running: int | None = None
    rate_limit: str = ""


@dataclasses.dataclass(frozen=True)
class WorkerFigures:
    name: str
    running: int
    attempts: int  # attempts of the window's runs
    last_started_at: dt.datetime | None


def _quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


@dataclasses.dataclass(frozen=True)
class PlotSpan:
    """The minutes the plots span, ending now: the last hour, or less on a younger system."""

    start: dt.datetime
    minutes: int

    def index(self, at: dt.datetime) -> int:
        return min(self.minutes - 1, max(0, int((at - self.start).total_seconds() // 60)))

    def x(self, minute: int) -> float:
        return (minute + 0.5) / self.minutes

    @property
    def label(self) -> str:
        return "last hour" if self.minutes == MINUTES else f"last {self.minutes} min"


def _plot_span(runs: list[dict], now: dt.datetime) -> PlotSpan:
    oldest = min((run["created_at"] for run in runs), default=now)
    minutes = -int(-(now - oldest).total_seconds() // 60)  # rounded up
    minutes = max(MIN_PLOT_MINUTES, min(MINUTES, minutes))
    return PlotSpan(start=now - dt.timedelta(minutes=minutes), minutes=minutes)


def _window_runs(since: dt.datetime) -> list[dict]:
    # Every state named, so PostgreSQL reads run_state_idx (state, -created_at) by range.
    return list(
        Run.objects.filter(state__in=RunState.values, created_at__gte=since)
        .order_by("-created_at")
        .values("state", "due_at", "created_at", "published_at", "started_at", "finished_at")[
            :SAMPLE
        ]
    )


def _lag_charts(runs: list[dict], span: PlotSpan) -> list:
    charts = []
    for title, (start, end) in STAGES.items():
        per_minute: dict[int, list[float]] = defaultdict(list)
        for run in runs:
            run["ready_at"] = max(run["created_at"], run["due_at"])
            if run[start] is None or run[end] is None or run["state"] == RunState.SKIPPED:
                continue
            lag = max(0.0, (run[end] - run[start]).total_seconds())
            per_minute[span.index(run["created_at"])].append(lag)
        series = [
            Series(label, color, [
                (span.x(m), _quantile(per_minute[m], q) if per_minute[m] else None)
                for m in range(span.minutes)
            ])
            for label, color, q in (("p50", P50, 0.5), ("p99", P99, 0.99))
        ]  # fmt: skip
        charts.append(line_chart(title=title, series=series, unit="s", x_label=span.label))
    return charts


def _throughput_chart(runs: list[dict], span: PlotSpan):
    finished: dict[str, list[int]] = {
        RunState.SUCCEEDED: [0] * span.minutes,
        RunState.FAILED: [0] * span.minutes,
    }
    for run in runs:
        if run["state"] in finished and run["finished_at"] and run["finished_at"] >= span.start:
            finished[run["state"]][span.index(run["finished_at"])] += 1
    series = [
        Series(state, color, [(span.x(m), n) for m, n in enumerate(finished[state])])
        for state, color in ((RunState.SUCCEEDED, "#2ca02c"), (RunState.FAILED, P99))
    ]
    totals = {state: sum(counts) for state, counts in finished.items()}
    chart = line_chart(title="runs finished / min", series=series, x_label=span.label)
    return chart, totals


def _queues() -> list[QueueFigures]:
    """Each Celery queue a run travels in, lanes apart (`<queue>.backfill`): the outbox
    rows name it, the queued runs are counted by their job's queue, their kind and whether
    they were replayed."""
    pending = dict(OutboxMessage.objects.values_list("queue").annotate(n=Count("id")).order_by())
    queued: dict[str, int] = defaultdict(int)
    for queue, kind, replayed, n in (
        Run.objects.filter(state=RunState.QUEUED)
        .annotate(replayed=Q(replayed_at__isnull=False))
        .values_list("job__queue", "kind", "replayed")
        .annotate(n=Count("id"))
        .order_by()
    ):
        queued[lane_queue(queue, kind, replayed=replayed)] += n
    names = sorted(
        {*getattr(settings, "SCHEDULER_QUEUES", []), settings.SCHEDULER_DEFAULT_QUEUE}
        | pending.keys()
        | queued.keys()
    )
    depth = BrokerQueueDepth(settings.CELERY_BROKER_URL, settings.CELERY_BROKER_TRANSPORT_OPTIONS)
    try:
        now = db_now()
        controls = {control.name: control for control in QueueControl.objects.all()}
        figures = []
        for name in names:
            control = controls.get(queue_of_lane(name))
            figures.append(QueueFigures(
                name, depth(name), pending.get(name, 0), queued.get(name, 0),
                paused=queue_paused_now(control, now=now),
                max_running=control.max_running if control else None,
                rate_limit=control.rate_limit if control else "",
            ))  # fmt: skip
        return figures
    finally:
        depth.close()


def _workers(since: dt.datetime) -> list[WorkerFigures]:
    running = dict(
        Attempt.objects.filter(state=AttemptState.RUNNING)
        .values_list("worker")
        .annotate(n=Count("id"))
        .order_by()
    )
    recent = {
        worker: (n, last)
        for worker, n, last in Attempt.objects.filter(
            run__state__in=RunState.values, run__created_at__gte=since
        )
        .values_list("worker")
        .annotate(n=Count("id"), last=Max("started_at"))
        .order_by()
    }
    return [
        WorkerFigures(name, running.get(name, 0), *recent.get(name, (0, None)))
        for name in sorted(running.keys() | recent.keys())
    ]


def _counter(name: str) -> int:
    return sum(Counter.objects.filter(name=name).values_list("value", flat=True))


def dashboard_figures(*, user: AbstractBaseUser, now: dt.datetime | None = None) -> dict:
    """Every figure of the dashboard at `now` (default: the database's clock). Lists that
    name jobs or runs (top failing jobs, dead letters) show only what `user` may see."""
    now = now or db_now()
    since = now - WINDOW
    runs = _window_runs(since)
    by_state, backlog = runs_by_state_and_backlog()  # as /metrics: tallies on PostgreSQL
    due_jobs = Job.objects.filter(state=JobState.ACTIVE, next_run_at__lte=now)
    oldest_queued = oldest_queued_at()
    span = _plot_span(runs, now)
    throughput, finished = _throughput_chart(runs, span)
    top_failing = (
        Run.objects.filter(
            state=RunState.FAILED,
            created_at__gte=now - TOP_FAILING_WINDOW,
            job__in=job_list(user=user),
        )
        .values("job_id", "job__name", "job__task")
        .annotate(failed=Count("id"), last=Max("finished_at"))
        .order_by("-failed", "-last")[:TOP_FAILING]
    )
    dead_letters = run_list(user=user).filter(state=RunState.FAILED).order_by("-created_at")
    return {
        "now": now,
        "refresh_seconds": REFRESH_SECONDS,
        "runs_by_state": [(state, by_state.get(state, 0)) for state in RunState.values],
        "due_now": due_jobs.count(),
        "overdue_now": due_jobs.filter(next_run_at__lte=now - OVERDUE_AFTER).count(),
        "oldest_overdue_seconds": oldest_overdue_seconds(now=now),
        "oldest_queued_seconds": max(0.0, (now - oldest_queued).total_seconds())
        if oldest_queued
        else 0.0,
        "sampled_runs": len(runs),
        "lag_charts": _lag_charts(runs, span),
        "throughput_chart": throughput,
        "finished_last_hour": finished,
        "queues": _queues(),
        "outbox_backlog": backlog,
        "dead_letters": by_state.get(RunState.FAILED, 0),
        "dead_letter_runs": list(dead_letters.select_related("job")[:DEAD_LETTERS_SHOWN]),
        "top_failing": list(top_failing),
        "lease_expired": _counter("scheduler_lease_expired_total"),
        "duplicate_deliveries": _counter("scheduler_duplicate_deliveries_total"),
        "workers": _workers(since),
    }


def _operator_page(template: str):
    def view(request: HttpRequest) -> HttpResponse:
        if not request.user.is_authenticated:
            return redirect_to_login(request.get_full_path(), settings.LOGIN_URL)
        if not (request.user.is_staff or user_is_operator(request.user)):
            return HttpResponseForbidden("The dashboard is for operators and staff.")
        return render(request, template, dashboard_figures(user=request.user))

    return view


dashboard_page = _operator_page("dispatch/dashboard.html")
dashboard_panel = _operator_page("dispatch/dashboard_panel.html")

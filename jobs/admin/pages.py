"""What the admin's job and run pages show besides their fields: a job's schedule in words
with its next fires (`schedules.job_preview`, DST flags included), its recent runs and its
history; a run's stages as a timeline with the lag of each, and its attempts."""

from __future__ import annotations

import datetime as dt
import json

from cron_descriptor import ExpressionDescriptor, Options
from django.conf import settings
from django.urls import reverse

from .. import schedules
from ..dependencies import dependency_graph, dependency_preview, is_dependent
from ..models import Attempt, Job, Run
from ..occurrences import job_occurrences
from ..redaction import redact, redact_value
from ..selectors import job_history, run_history
from ..services import job_is_editable

NEXT_FIRES = 10
RECENT_RUNS = 20
# The occurrences timeline: the last day and the next week, at most this many entries.
TIMELINE_PAST, TIMELINE_AHEAD = dt.timedelta(days=1), dt.timedelta(days=7)
TIMELINE_ENTRIES = 60

GAP_WORDS = {
    "shift": "a local time that spring-forward skips fires once, at the first instant after "
    "the gap",
    "skip": "a local time that spring-forward skips does not fire",
}
FOLD_WORDS = {
    "first": "a local time that fall-back repeats fires once, at its first instant",
    "both": "a local time that fall-back repeats fires at both of its instants",
    "auto": "a local time that fall-back repeats fires once when the hour is fixed, in both "
    "hours when the hour is a wildcard or a step",
}
DST_FLAG_WORDS = {
    "gap_shifted": "moved to the end of a spring-forward gap",
    "fold_first": "first of a repeated local time",
    "fold_second": "second of a repeated local time",
}
ON_WORDS = {
    "succeeded": "succeeded",
    "failed": "failed (after its retries)",
    "finished": "succeeded or failed",
}
UNITS = [(86400, "day"), (3600, "hour"), (60, "minute"), (1, "second")]


def _every(seconds: int) -> str:
    for size, unit in UNITS:
        if seconds % size == 0:
            count = seconds // size
            return f"every {unit}" if count == 1 else f"every {count} {unit}s"
    return f"every {seconds} seconds"  # pragma: no cover - 1 divides everything


def _instant(text: str | None) -> str:
    return dt.datetime.fromisoformat(text).strftime("%Y-%m-%d %H:%M:%S %Z") if text else ""


def schedule_words(spec: dict) -> str:
    """`At 09:00, Monday through Friday (Europe/Berlin time), from ... until ...`."""
    schedule = spec["schedule"]
    if schedule["kind"] == "once":
        words = f"Once, at {_instant(schedule['run_at'])}"
    elif schedule["kind"] == "after":
        words = (
            f"After each run of {len(schedule['jobs'])} upstream job(s) ends "
            f"{ON_WORDS[schedule.get('on', 'succeeded')]}, for the same instant"
        )
        if schedule.get("within_seconds"):
            words += f"; all within {schedule['within_seconds']} s of the first"
        elif len(schedule["jobs"]) > 1:
            bound = settings.SCHEDULER_DEPENDENCY_WITHIN_SECONDS
            words += f"; all within {bound:g} s of the first (the default bound)"
    elif schedule["kind"] == "interval":
        anchor = "start_at" if spec.get("start_at") else "the job's creation"
        words = f"{_every(schedule['every_seconds']).capitalize()}, counted from {anchor}"
    else:
        options = Options()
        options.use_24hour_time_format = True
        try:
            words = ExpressionDescriptor(schedule["expression"], options).get_description()
        except Exception:  # noqa: BLE001 - the describer knows less syntax than croniter
            words = f"Cron '{schedule['expression']}'"
        words += f" ({schedule.get('timezone', 'UTC')} time; cron '{schedule['expression']}')"
    if spec.get("start_at"):
        words += f", from {_instant(spec['start_at'])}"
    if spec.get("end_at"):
        words += f", until {_instant(spec['end_at'])}"
    return words + "."


def policy_words(spec: dict) -> list[str]:
    retry, misfire = spec["retry"], spec["misfire"]
    grace = misfire.get("grace_seconds")
    lines = []
    if spec["schedule"]["kind"] == "cron":
        lines.append(f"Daylight saving: {GAP_WORDS[spec['dst']['gap']]}; "
                     f"{FOLD_WORDS[spec['dst']['fold']]}.")  # fmt: skip
    lines += [
        f"Missed occurrences: {misfire['policy']}"
        + (f" within {grace} s" if grace is not None else "") + ".",
        f"When a run is still active at the next occurrence: {spec['overlap']}.",
        f"Up to {retry['max_attempts']} attempts, {retry['initial_delay_seconds']} s apart at "
        f"first, x{retry['backoff_factor']} each time, at most {retry['max_delay_seconds']} s"
        + (" (with jitter)" if retry["jitter"] else "") + ".",
        f"Timeout {spec['timeout_seconds']} s, heartbeat within "
        f"{spec['heartbeat_timeout_seconds']} s; delivery {spec['delivery']}; queue "
        f"'{spec['queue']}', priority {spec['priority']}.",
    ]  # fmt: skip
    if spec.get("pause_after_failures"):
        lines.append(f"Paused after {spec['pause_after_failures']} consecutive failed runs.")
    return lines


def job_page(*, job: Job, now: dt.datetime) -> dict:
    """The job page's context: schedule, next fires, recent runs, history."""
    fires, fires_problem = [], ""
    if job_is_editable(job=job) and is_dependent(job.spec):
        # No times of its own: the instants its upstreams share (each runs on their ends).
        visible = Job.objects.filter(deleted_at=None)
        upstreams = list(visible.filter(id__in=job.spec["schedule"]["jobs"]))
        fires = [
            {"at": at, "local": at.isoformat(), "dst": "", "doubled": False}
            for at in dependency_preview(
                upstreams=upstreams, visible=visible, after=now, count=NEXT_FIRES
            )
        ]
    elif job_is_editable(job=job):
        try:
            fires = schedules.job_preview(job=job, after=now, count=NEXT_FIRES)
        except schedules.ScheduleError as exc:
            fires_problem = str(exc)
    for fire in fires:
        fire["dst_words"] = DST_FLAG_WORDS.get(fire["dst"], "")
    timeline, timeline_problem = [], ""
    try:
        timeline, _ = job_occurrences(job=job, start=now - TIMELINE_PAST, end=now + TIMELINE_AHEAD,
                                      cursor=None, limit=TIMELINE_ENTRIES, now=now)  # fmt: skip
    except schedules.ScheduleError as exc:
        timeline_problem = str(exc)
    history = job_history(job=job, redacted=True)
    for version in history["versions"]:
        for change in version["changes"]:
            change["from_text"], change["to_text"] = _json(change["from"]), _json(change["to"])
    for event in history["events"]:
        event.data_text = _json(event.data) if event.data else ""
    return {
        "job_page": True,
        "schedule_words": schedule_words(job.spec),
        "policy_words": policy_words(job.spec),
        "next_fires": fires,
        "next_fires_problem": fires_problem,
        "timeline": timeline,
        "timeline_problem": timeline_problem,
        "timeline_url": reverse("job-occurrences", args=[job.id]),
        "recent_runs": list(
            Run.objects.filter(job=job).order_by("-scheduled_for", "-id")[:RECENT_RUNS]
        ),
        "runs_url": reverse("admin:jobs_run_changelist") + f"?job__exact={job.id}",
        "history": history,
        # Upstream and downstream jobs (jobs.dependencies), each linked to its page.
        "graph": dependency_graph(job=job, visible=Job.objects.filter(deleted_at=None)),
    }


def _json(value) -> str:
    """A stored value as a page shows it: secret-looking values masked (jobs.redaction)."""
    return json.dumps(redact_value(value), ensure_ascii=False, default=str)


def duration(delta: dt.timedelta | None) -> str:
    """`850 ms`, `12.3 s`, `4 min 05 s`, `2 h 01 min`."""
    if delta is None:
        return ""
    seconds = delta.total_seconds()
    sign, seconds = ("-" if seconds < 0 else ""), abs(seconds)
    if seconds < 1:
        return f"{sign}{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{sign}{seconds:.1f} s"
    minutes, rest = divmod(int(seconds), 60)
    if minutes < 120:
        return f"{sign}{minutes} min {rest:02d} s"
    return f"{sign}{minutes // 60} h {minutes % 60:02d} min"


# (stage, the run's field, the name of the lag that ends at this stage)
STAGES = [
    ("due", "due_at", ""),
    ("created", "created_at", "discovery lag"),
    ("published", "published_at", "publish lag"),
    ("started", "started_at", "queue wait"),
    ("finished", "finished_at", "run duration"),
]


def run_stages(run: Run) -> list[dict]:
    """Each stage with its instant and the lag since the stage before (when both are
    known), and its share of the whole, for the timeline's bar."""
    stages, previous = [], None
    for name, field, lag_name in STAGES:
        at = getattr(run, field)
        lag = at - previous if at is not None and previous is not None else None
        stages.append({"name": name, "at": at, "lag_name": lag_name, "lag": lag,
                       "lag_text": duration(lag)})  # fmt: skip
        previous = at if at is not None else previous
    total = sum((s["lag"].total_seconds() for s in stages if s["lag"]), 0.0)
    for stage in stages:
        share = stage["lag"].total_seconds() / total if stage["lag"] and total > 0 else 0
        stage["percent"] = max(0.0, round(100 * share, 1))
    return stages


def run_page(*, run: Run) -> dict:
    """The run page's context: the timeline, the attempts newest first, the history."""
    attempts = list(Attempt.objects.filter(run=run).order_by("-number"))
    for attempt in attempts:
        attempt.error = redact(attempt.error)  # stored redacted; shown so whatever wrote it
        attempt.took = duration(
            attempt.finished_at - attempt.started_at
            if attempt.finished_at and attempt.started_at
            else None
        )
        attempt.log_url = reverse("admin:logs_app_attempt_log", args=[attempt.id])
        # Its TaskResult (django-celery-results), kept when SCHEDULER_CELERY_RESULTS is on.
        attempt.task_url = (
            reverse("admin:django_celery_results_taskresult_changelist")
            + f"?task_id={attempt.task_id}"
            if attempt.task_id
            else ""
        )
    events = run_history(run=run)
    for event in events:
        event.data_text = _json(event.data) if event.data else ""
    return {
        "run_page": True,
        # The page's heading: the run's __str__ (two UUIDs) runs under the action buttons.
        "subtitle": f"{run.kind.capitalize()} run of {run.job.name}, "
        f"{run.scheduled_for:%Y-%m-%d %H:%M:%S} UTC",
        "stages": run_stages(run),
        "attempts": attempts,
        "events": events,
        "job_url": reverse("admin:jobs_job_change", args=[run.job_id]),
    }

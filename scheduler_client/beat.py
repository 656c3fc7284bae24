"""From Celery beat: a jobs file (for `schedctl apply`) from a Celery app's `beat_schedule`.

Carried over: `crontab` entries (as 5-field cron expressions in the app's `timezone`),
`schedule` entries given as seconds, a `timedelta` or `celery.schedules.schedule` (as
`interval` schedules), `args`, `kwargs`, and the options `queue` and `priority`.
Named instead of carried: `solar` schedules, other schedule classes, crontabs restricting
both the day of the month and the day of the week (beat wants both, cron either), intervals
that are not whole seconds, arguments JSON cannot hold, the other options (`expires`,
`exchange`, `routing_key`, ...), and, when a server is asked, tasks it does not know as job
tasks (`@job_task` in a module of `SCHEDULER_TASK_MODULES`).

Celery is imported only here, and only when a beat schedule is read.
"""

from __future__ import annotations

import datetime as dt
import importlib
import json
import os
import sys
from dataclasses import dataclass, field

CARRIED_OPTIONS = ("queue", "priority")


@dataclass
class BeatImport:
    jobs: list[dict] = field(default_factory=list)
    # (entry name, why it was not carried over); an entry may be carried with a note too.
    skipped: list[tuple[str, str]] = field(default_factory=list)
    notes: list[tuple[str, str]] = field(default_factory=list)
    timezone: str = "UTC"


def celery_app_load(target: str):
    """`module:attribute` (or `module`, whose `app` or `celery` is taken) -> the app."""
    module_name, _, attribute = target.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `celery -A` does: the project's own modules
    module = importlib.import_module(module_name)
    for name in [attribute] if attribute else ["app", "celery"]:
        app = getattr(module, name, None)
        if app is not None:
            return app
    raise ValueError(f"{target}: no Celery app found (name it: module:app)")


def beat_import(app) -> BeatImport:
    """The job bodies of `app.conf.beat_schedule`, and what could not be carried over."""
    from celery.schedules import crontab, schedule, solar

    tz = str(app.conf.timezone or "UTC")
    result = BeatImport(timezone=tz)
    if not app.conf.enable_utc and not app.conf.timezone:
        result.notes.append(("*", "enable_utc is off and no timezone is set: crontabs read "
                                  "as UTC"))  # fmt: skip
    for name, entry in (app.conf.beat_schedule or {}).items():
        task = entry.get("task")
        if not task:
            result.skipped.append((name, "no task"))
            continue
        sched = entry.get("schedule")
        if isinstance(sched, int | float) and not isinstance(sched, bool):
            sched = dt.timedelta(seconds=sched)
        if isinstance(sched, solar):
            result.skipped.append((name, f"solar schedule ({sched.event}): no equivalent"))
            continue
        if isinstance(sched, crontab):
            expression, problem = _cron_expression(sched)
            if problem:
                result.skipped.append((name, problem))
                continue
            body_schedule = {"kind": "cron", "expression": expression, "timezone": tz}
        elif isinstance(sched, dt.timedelta) or type(sched) is schedule:
            every = sched if isinstance(sched, dt.timedelta) else sched.run_every
            seconds = every.total_seconds()
            if seconds < 1 or seconds != int(seconds):
                result.skipped.append((name, f"interval of {seconds}s is not whole seconds"))
                continue
            body_schedule = {"kind": "interval", "every_seconds": int(seconds)}
            if getattr(sched, "relative", False):
                result.notes.append((name, "relative=True not carried: the interval counts "
                                           "from the job's creation"))  # fmt: skip
        else:
            result.skipped.append(
                (name, f"custom schedule class {type(sched).__module__}.{type(sched).__name__}")
            )
            continue
        body = {"name": name, "task": task, "schedule": body_schedule}
        args, kwargs = list(entry.get("args") or ()), dict(entry.get("kwargs") or {})
        try:
            json.dumps([args, kwargs])
        except (TypeError, ValueError) as exc:
            result.skipped.append((name, f"arguments JSON cannot hold: {exc}"))
            continue
        if args:
            body["args"] = args
        if kwargs:
            body["kwargs"] = kwargs
        options = dict(entry.get("options") or {})
        for option in CARRIED_OPTIONS:
            if option in options:
                body[option] = options.pop(option)
        if options:
            result.notes.append((name, f"options not carried: {', '.join(sorted(options))}"))
        result.jobs.append(body)
    return result


def _cron_expression(sched) -> tuple[str, str | None]:
    fields = [
        sched._orig_minute,
        sched._orig_hour,
        sched._orig_day_of_month,
        sched._orig_month_of_year,
        sched._orig_day_of_week,
    ]
    texts = []
    for value in fields:
        if isinstance(value, int):
            texts.append(str(value))
        elif isinstance(value, str):
            texts.append(value.replace(" ", "").upper() or "*")
        elif isinstance(value, set | list | tuple | range | frozenset):
            texts.append(",".join(str(v) for v in sorted(value)))
        else:
            return "", f"crontab field {value!r} has no cron equivalent"
    if texts[2] != "*" and texts[4] != "*":
        return "", (
            "crontab restricts both day_of_month and day_of_week: beat runs when both match, "
            "cron when either does"
        )
    return " ".join(texts), None


def jobs_file_text(result: BeatImport, *, source: str) -> str:
    """The jobs file (YAML), with what was not carried over in its header."""
    import yaml

    lines = [
        f"# Imported from {source}'s beat_schedule (timezone {result.timezone})",
        "# by `schedctl import-beat`; apply it with `schedctl apply -f <this file>`.",
    ]
    if result.skipped:
        lines.append("# Not carried over:")
        lines += [f"#   {name}: {why}" for name, why in result.skipped]
    if result.notes:
        lines.append("# Carried with a difference:")
        lines += [f"#   {name}: {why}" for name, why in result.notes]
    body = yaml.safe_dump({"jobs": result.jobs}, sort_keys=False, allow_unicode=True)
    return "\n".join(lines) + "\n" + body

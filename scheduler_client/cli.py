"""`schedctl`: the scheduler from a terminal or a script.

Tables for people, `-o json` for scripts; the API's message on stderr and a non-zero exit
on any failure (1: the API refused or the server could not be reached; 2: bad usage).
Shell completion: `schedctl completion bash|zsh|fish`.
"""

from __future__ import annotations

import datetime as dt
import functools
import itertools
import json
import sys
import time
import uuid
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .client import ApiError, Client, ConnectionFailed

out = Console(soft_wrap=True)
err = Console(stderr=True)

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


# --- plumbing: the client, output, errors ----------------------------------------------


class Obj:
    def __init__(self, url: str | None, token: str | None, profile: str | None) -> None:
        self.url, self.token, self.profile = url, token, profile
        self._client: Client | None = None

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = Client(self.url, self.token, profile=self.profile)
        return self._client


def output_option(command):
    return click.option(
        "-o",
        "--output",
        type=click.Choice(["table", "json"]),
        default="table",
        show_default=True,
        help="table for people, json for scripts.",
    )(command)


def api_command(command):
    """Turn the client's errors into the API's message and exit status 1."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except ApiError as exc:
            err.print(f"[red]Error:[/red] {exc.status} {exc.detail}", markup=True, highlight=False)
            sys.exit(1)
        except ConnectionFailed as exc:
            err.print(f"[red]Error:[/red] cannot reach the server: {exc}", highlight=False)
            sys.exit(1)
        except (ValueError, OSError, ImportError) as exc:
            err.print(f"[red]Error:[/red] {exc}", highlight=False)
            sys.exit(1)

    return wrapper


def client_of(ctx: click.Context) -> Client:
    return ctx.find_object(Obj).client


def emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


def table(title: str | None, columns: list[str], rows: list[list[Any]]) -> None:
    grid = Table(title=title, show_lines=False, header_style="bold")
    for column in columns:
        grid.add_column(column, overflow="fold")
    for row in rows:
        grid.add_row(*["" if cell is None else str(cell) for cell in row])
    out.print(grid)


def fields(title: str, pairs: list[tuple[str, Any]]) -> None:
    grid = Table(title=title, show_header=False, box=None)
    grid.add_column(style="bold")
    grid.add_column(overflow="fold")
    for key, value in pairs:
        if isinstance(value, dict | list):
            value = json.dumps(value)
        grid.add_row(key, "" if value is None else str(value))
    out.print(grid)


def schedule_text(schedule: dict) -> str:
    kind = schedule.get("kind")
    if kind == "cron":
        return f"cron {schedule.get('expression')} {schedule.get('timezone', 'UTC')}"
    if kind == "interval":
        return f"every {schedule.get('every_seconds')}s"
    if kind == "once":
        return f"once {schedule.get('run_at')}"
    if kind == "after":
        return f"after {', '.join(schedule.get('jobs', []))} ({schedule.get('on', 'succeeded')})"
    return json.dumps(schedule)


def load_json_option(value: str | None, what: str) -> Any:
    if value is None:
        return None
    try:
        return json.loads(value)
    except ValueError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint=what) from exc


def filters_option(command):
    return click.option(
        "--filter",
        "filters",
        multiple=True,
        metavar="KEY=VALUE",
        help="Bulk: act on every run matching (state, job, task, queue, kind, label, "
        "failure_reason, scheduled_after, scheduled_before); repeatable.",
    )(command)


def parse_filters(filters: tuple[str, ...]) -> dict:
    found = {}
    for item in filters:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--filter")
        found[key] = value
    return found


# --- the root ---------------------------------------------------------------------------


@click.group(context_settings=CONTEXT)
@click.option("--url", envvar="SCHEDULER_URL", help="The server (default: profile, or "
              "http://127.0.0.1:8000). Env: SCHEDULER_URL.")  # fmt: skip
@click.option("--token", envvar="SCHEDULER_TOKEN", help="API token. Env: SCHEDULER_TOKEN.")
@click.option(
    "--profile",
    envvar="SCHEDULER_PROFILE",
    help="A profile of ~/.config/schedctl/config.toml. Env: SCHEDULER_PROFILE.",
)
@click.version_option("0.1.0", prog_name="schedctl")
@click.pass_context
def cli(ctx, url, token, profile):
    """The durable scheduler from a terminal or a script.

    \b
    Example:
      export SCHEDULER_URL=http://127.0.0.1:8000 SCHEDULER_TOKEN=...
      schedctl jobs list
      schedctl apply -f jobs.yaml --dry-run
    """
    ctx.obj = Obj(url, token, profile)


# --- jobs -------------------------------------------------------------------------------


@cli.group(context_settings=CONTEXT)
def jobs():
    """Jobs: list, read, create and operate them.

    \b
    Example:
      schedctl jobs list --state active
    """


JOB_COLUMNS = ["ID", "NAME", "TASK", "STATE", "VERSION", "SCHEDULE", "NEXT RUN"]


def job_row(job) -> list:
    return [job.id, job.name, job.task, job.state, job.version, schedule_text(job.schedule),
            job.next_run_at]  # fmt: skip


@jobs.command("list", context_settings=CONTEXT)
@click.option("--state", help="active, paused, cancelled, completed.")
@click.option("--task")
@click.option("--queue")
@click.option("--label", metavar="KEY:VALUE")
@click.option("--limit", type=int, default=100, show_default=True, help="0: all.")
@output_option
@click.pass_context
@api_command
def jobs_list(ctx, state, task, queue, label, limit, output):
    """List your jobs, newest first.

    \b
    Example:
      schedctl jobs list --label team:billing -o json
    """
    found = []
    for job in client_of(ctx).jobs(state=state, task=task, queue=queue, label=label):
        found.append(job)
        if limit and len(found) >= limit:
            break
    if output == "json":
        return emit_json([job.raw for job in found])
    table(None, JOB_COLUMNS, [job_row(job) for job in found])


def show_job(job, output: str) -> None:
    if output == "json":
        return emit_json(job.raw)
    fields(f"job {job.name}", [(key, job.raw.get(key)) for key in job.raw])


@jobs.command("get", context_settings=CONTEXT)
@click.argument("job_id")
@output_option
@click.pass_context
@api_command
def jobs_get(ctx, job_id, output):
    """Show a job: its body, state, version and next run.

    \b
    Example:
      schedctl jobs get 6f1c8a4e-2d0b-4c1e-9a57-0b3c2f6e9d10
    """
    show_job(client_of(ctx).job(job_id), output)


@jobs.command("create", context_settings=CONTEXT)
@click.option("-f", "--file", "file", type=click.File("r"), help="A job body (JSON or YAML).")
@click.option("--name")
@click.option("--task")
@click.option("--cron", metavar="EXPRESSION", help="A cron schedule, e.g. '0 9 * * MON-FRI'.")
@click.option("--timezone", "tz", default=None, help="The cron schedule's zone (default UTC).")
@click.option("--every", type=int, metavar="SECONDS", help="An interval schedule.")
@click.option("--at", "run_at", metavar="INSTANT", help="Once, at an ISO 8601 instant.")
@click.option("--args", "args_json", metavar="JSON", help="Positional arguments, a JSON list.")
@click.option("--kwargs", "kwargs_json", metavar="JSON", help="Keyword arguments, JSON object.")
@click.option("--queue")
@click.option("--idempotency-key", help="Default: a new one (kept across retries).")
@output_option
@click.pass_context
@api_command
def jobs_create(ctx, file, name, task, cron, tz, every, run_at, args_json, kwargs_json, queue,
                idempotency_key, output):  # fmt: skip
    """Create a job, from a file or from options.

    \b
    Examples:
      schedctl jobs create --name hello --task scheduler.echo --at 2030-01-01T09:00:00Z \\
          --args '["hello"]'
      schedctl jobs create --name report --task scheduler.echo \\
          --cron '0 9 * * MON-FRI' --timezone Europe/Berlin
      schedctl jobs create -f job.yaml
    """
    import yaml

    body: dict = yaml.safe_load(file.read()) if file else {}
    if name:
        body["name"] = name
    if task:
        body["task"] = task
    kinds = [k for k in (cron, every, run_at) if k is not None]
    if len(kinds) > 1:
        raise click.UsageError("give one of --cron, --every, --at")
    if cron is not None:
        body["schedule"] = {"kind": "cron", "expression": cron, **({"timezone": tz} if tz else {})}
    elif every is not None:
        body["schedule"] = {"kind": "interval", "every_seconds": every}
    elif run_at is not None:
        body["schedule"] = {"kind": "once", "run_at": run_at}
    if args_json is not None:
        body["args"] = load_json_option(args_json, "--args")
    if kwargs_json is not None:
        body["kwargs"] = load_json_option(kwargs_json, "--kwargs")
    if queue:
        body["queue"] = queue
    show_job(client_of(ctx).job_create(body, idempotency_key=idempotency_key), output)


def _job_action(name: str, method: str, doc: str):
    @jobs.command(name, context_settings=CONTEXT, help=doc)
    @click.argument("job_id")
    @output_option
    @click.pass_context
    @api_command
    def action(ctx, job_id, output):
        job = getattr(client_of(ctx), method)(job_id)
        if output == "json":
            return emit_json(job.raw)
        out.print(f"job {job.id} ({job.name}): {job.state}, version {job.version}")

    return action


_job_action("pause", "job_pause", "Pause a job: no occurrence runs until it is resumed.\n\n"
            "\b\nExample:\n  schedctl jobs pause <job id>")  # fmt: skip
_job_action("resume", "job_resume", "Resume a paused job (missed occurrences meet its misfire "
            "policy).\n\n\b\nExample:\n  schedctl jobs resume <job id>")  # fmt: skip
_job_action("cancel", "job_cancel", "Cancel a job and its active runs.\n\n"
            "\b\nExample:\n  schedctl jobs cancel <job id>")  # fmt: skip


RUN_COLUMNS = ["ID", "JOB", "KIND", "STATE", "SCHEDULED FOR", "ATTEMPTS", "REASON"]


def run_row(run) -> list:
    return [run.id, run.job, run.kind, run.state, run.scheduled_for, run.attempt_count,
            run.failure_reason or run.skip_reason]  # fmt: skip


def show_run(run, output: str) -> None:
    if output == "json":
        return emit_json(run.raw)
    fields(f"run {run.id}", [(key, run.raw.get(key)) for key in run.raw if key != "attempts"])
    if run.attempts:
        table("attempts", ["#", "STATE", "WORKER", "STARTED", "FINISHED", "ERROR"],
              [[a.number, a.state, a.worker, a.started_at, a.finished_at, a.error[-200:]]
               for a in run.attempts])  # fmt: skip


@jobs.command("trigger", context_settings=CONTEXT)
@click.argument("job_id")
@click.option("--wait", "wait_", is_flag=True, help="Wait until the run ends; exit 1 unless "
              "it succeeded.")  # fmt: skip
@click.option("--idempotency-key", help="Default: a new one (kept across retries).")
@output_option
@click.pass_context
@api_command
def jobs_trigger(ctx, job_id, wait_, idempotency_key, output):
    """Run a job now (a manual run), whatever its schedule.

    \b
    Example:
      schedctl jobs trigger <job id> --wait
    """
    client = client_of(ctx)
    run = client.job_trigger(job_id, idempotency_key=idempotency_key)
    if wait_:
        run = client.wait(run.id)
    show_run(run, output)
    if wait_ and run.state != "succeeded":
        sys.exit(1)


def parse_instant(text: str, what: str) -> dt.datetime:
    try:
        value = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError as exc:
        raise click.BadParameter(f"{text!r} is not an ISO 8601 instant", param_hint=what) from exc
    if value.tzinfo is None:
        raise click.BadParameter(f"{text!r} needs an offset (Z or +hh:mm)", param_hint=what)
    return value


def _iso(value: dt.datetime) -> str:
    return value.astimezone(dt.UTC).isoformat().replace("+00:00", "Z")


@jobs.command("backfill", context_settings=CONTEXT)
@click.argument("job_id")
@click.option("--start", required=True, help="Inclusive, ISO 8601 with an offset.")
@click.option("--end", required=True, help="Exclusive, ISO 8601 with an offset.")
@click.option("--step", type=int, default=None, metavar="SECONDS",
              help="The window is sent in slices of this length (default: from the "
                   "schedule; halved when a slice holds over 1,000 occurrences).")  # fmt: skip
@output_option
@click.pass_context
@api_command
def jobs_backfill(ctx, job_id, start, end, step, output):
    """Run a job's occurrences in [start, end) as backfill runs, with a progress bar.

    Idempotent: occurrences an earlier backfill ran are not run again.

    \b
    Example:
      schedctl jobs backfill <job id> --start 2026-01-01T00:00:00Z --end 2026-02-01T00:00:00Z
    """
    client = client_of(ctx)
    low, high = parse_instant(start, "--start"), parse_instant(end, "--end")
    if high <= low:
        raise click.BadParameter("must be after --start", param_hint="--end")
    job = client.job(job_id)
    if step is None:
        every = job.schedule.get("every_seconds")
        step = int(every) * 500 if job.schedule.get("kind") == "interval" and every else 86_400
    step = max(1, step)
    span = (high - low).total_seconds()
    created, existing, pruned = [], [], []
    operation = uuid.uuid4().hex  # each slice's key: a retried slice is answered once
    with Progress(
        TextColumn("[bold]backfill"),
        BarColumn(),
        TextColumn("{task.percentage:>3.0f}%"),
        TextColumn("{task.fields[runs]} runs"),
        TimeElapsedColumn(),
        console=err,
        transient=False,
        disable=False,
    ) as progress:
        bar = progress.add_task("backfill", total=span, runs=0)
        cursor = low
        while cursor < high:
            upper = min(high, cursor + dt.timedelta(seconds=step))
            try:
                result = client.job_backfill(
                    job_id,
                    start=_iso(cursor),
                    end=_iso(upper),
                    idempotency_key=f"schedctl-backfill-{operation}-{_iso(cursor)}-{_iso(upper)}",
                )
            except ApiError as exc:
                too_many = exc.status == 400 and isinstance(exc.body, dict) and "end" in exc.body
                if too_many and step > 1:
                    step = max(1, step // 2)  # over 1,000 occurrences in the slice
                    continue
                raise
            created += result.created
            existing += result.existing
            pruned += result.pruned
            progress.update(bar, completed=(upper - low).total_seconds(),
                            runs=len(created) + len(existing))  # fmt: skip
            cursor = upper
    summary = {"created": created, "existing": existing, "pruned": pruned}
    if output == "json":
        return emit_json(summary)
    out.print(f"backfill of {job.name}: {len(created)} runs created, {len(existing)} existing, "
              f"{len(pruned)} pruned earlier")  # fmt: skip


@jobs.command("history", context_settings=CONTEXT)
@click.argument("job_id")
@output_option
@click.pass_context
@api_command
def jobs_history(ctx, job_id, output):
    """A job's versions (with what changed) and its audit events, newest first.

    \b
    Example:
      schedctl jobs history <job id> -o json | jq '.versions[0].changes'
    """
    history = client_of(ctx).job_history(job_id)
    if output == "json":
        return emit_json(history)
    versions = [
        [v["version"], v["created_at"], v["created_by"],
         ", ".join(c["field"] for c in v.get("changes", []))]
        for v in history["versions"]
    ]  # fmt: skip
    table("versions", ["VERSION", "AT", "BY", "CHANGES"], versions)
    events = [[e["created_at"], e["actor"], e["action"], e["run"]] for e in history["events"]]
    table("events", ["AT", "ACTOR", "ACTION", "RUN"], events)


@jobs.command("occurrences", context_settings=CONTEXT)
@click.argument("job_id")
@click.option("--from", "start", required=True, help="ISO 8601 with an offset.")
@click.option("--to", "end", required=True, help="ISO 8601 with an offset.")
@click.option("--limit", default=1000, show_default=True, help="At most this many.")
@output_option
@click.pass_context
@api_command
def jobs_occurrences(ctx, job_id, start, end, limit, output):
    """Every occurrence of a job in a window, past and future, and its decision (ran,
    skipped, will_run, ...) with the reasons (GET /jobs/{id}/occurrences/).

    \b
    Example:
      schedctl jobs occurrences <job id> --from 2026-12-20T00:00:00Z --to 2027-01-05T00:00:00Z
    """
    found = list(itertools.islice(client_of(ctx).job_occurrences(job_id, start=start, end=end),
                                  limit + 1))  # fmt: skip
    if len(found) > limit:
        found = found[:limit]
        click.echo(f"(the first {limit}; --limit or a narrower window for more)", err=True)
    if output == "json":
        return emit_json(found)
    table(None, ["SCHEDULED FOR", "LOCAL", "DECISION", "RUN", "STATE", "REASONS"],
          [[o.get("scheduled_for"), o.get("local"), o.get("decision"), o.get("run"),
            o.get("state"), "; ".join(o.get("reasons") or [])] for o in found])  # fmt: skip


# --- runs -------------------------------------------------------------------------------


@cli.group(context_settings=CONTEXT)
def runs():
    """Runs: list, read, follow their logs, cancel and replay them.

    \b
    Example:
      schedctl runs list --state failed
    """


@runs.command("list", context_settings=CONTEXT)
@click.option("--job")
@click.option("--state", help="pending, queued, running, retry_wait, succeeded, failed, ...")
@click.option("--kind", help="scheduled, manual, backfill.")
@click.option("--after", "scheduled_after", help="scheduled_for >= this instant.")
@click.option("--before", "scheduled_before", help="scheduled_for < this instant.")
@click.option("--limit", type=int, default=100, show_default=True, help="0: all.")
@output_option
@click.pass_context
@api_command
def runs_list(ctx, job, state, kind, scheduled_after, scheduled_before, limit, output):
    """List runs, newest first.

    \b
    Example:
      schedctl runs list --job <job id> --state failed -o json
    """
    found = []
    for run in client_of(ctx).runs(job=job, state=state, kind=kind,
                                   scheduled_after=scheduled_after,
                                   scheduled_before=scheduled_before):  # fmt: skip
        found.append(run)
        if limit and len(found) >= limit:
            break
    if output == "json":
        return emit_json([run.raw for run in found])
    table(None, RUN_COLUMNS, [run_row(run) for run in found])


@runs.command("get", context_settings=CONTEXT)
@click.argument("run_id")
@click.option("--wait", "wait_", is_flag=True, help="Wait until the run ends.")
@output_option
@click.pass_context
@api_command
def runs_get(ctx, run_id, wait_, output):
    """Show a run with its attempts and per-stage timestamps.

    \b
    Example:
      schedctl runs get <run id> --wait
    """
    client = client_of(ctx)
    show_run(client.wait(run_id) if wait_ else client.run(run_id), output)


@runs.command("logs", context_settings=CONTEXT)
@click.argument("run_id")
@click.option("--attempt", type=int, help="Default: the latest attempt.")
@click.option("-f", "--follow", is_flag=True, help="Live tail until the attempt ends.")
@output_option
@click.pass_context
@api_command
def runs_logs(ctx, run_id, attempt, follow, output):
    """A run's log lines (one attempt).

    \b
    Examples:
      schedctl runs logs <run id>
      schedctl runs logs <run id> --follow
    """
    client = client_of(ctx)
    if follow:
        lines = client.follow_logs(run_id, attempt=attempt)
    else:
        lines = _all_lines(client, run_id, attempt)
    for line in lines:
        if output == "json":
            click.echo(json.dumps(line.__dict__))
        else:
            click.echo(f"{line.ts} {line.level:<7} {line.text}")
        sys.stdout.flush()


def _all_lines(client: Client, run_id: str, attempt: int | None):
    after = -1
    while True:
        page = client.logs(run_id, attempt=attempt, after=after)
        yield from page.lines
        if not page.lines:
            return
        after, attempt = page.lines[-1].n, page.attempt


def _run_action(name: str, method: str, bulk: str, doc: str):
    @runs.command(name, context_settings=CONTEXT, help=doc)
    @click.argument("run_id", required=False)
    @filters_option
    @click.option("--dry-run", is_flag=True, help="Bulk: count the matching runs only.")
    @output_option
    @click.pass_context
    @api_command
    def action(ctx, run_id, filters, dry_run, output):
        client = client_of(ctx)
        if bool(run_id) == bool(filters):
            raise click.UsageError("give a run id or --filter (bulk), not both")
        if run_id:
            run = getattr(client, method)(run_id)
            if output == "json":
                return emit_json(run.raw)
            return out.print(f"run {run.id}: {run.state}")
        bulk_operation(client, bulk, parse_filters(filters), dry_run=dry_run, output=output)

    return action


def bulk_operation(client: Client, action: str, filters: dict, *, dry_run: bool, output: str):
    operation = client.runs_bulk(action, filters=filters, dry_run=dry_run)
    if dry_run or operation.id is None:
        if output == "json":
            return emit_json(operation.raw)
        return out.print(f"{operation.matched} runs match")
    with Progress(TextColumn(f"[bold]{action}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err) as progress:  # fmt: skip
        bar = progress.add_task(action, total=operation.matched or None)
        while operation.state != "done":
            progress.update(bar, completed=operation.done, total=operation.matched or None)
            time.sleep(0.5)
            operation = client.operation(operation.id)
        progress.update(bar, completed=operation.done, total=operation.matched)
    if output == "json":
        return emit_json(operation.raw)
    refused = ", ".join(f"{k}: {v}" for k, v in operation.refused.items()) or "none"
    out.print(f"{action}: {operation.done} of {operation.matched} runs; refused: {refused}")


_run_action(
    "cancel",
    "run_cancel",
    "cancel",
    "Cancel a run, or every run matching --filter (POST /runs/bulk/cancel/).\n\n"
    "\b\nExamples:\n  schedctl runs cancel <run id>\n"
    "  schedctl runs cancel --filter state=queued --filter job=<job id> --dry-run",
)
_run_action(
    "replay",
    "run_replay",
    "replay",
    "Replay a failed or cancelled run (a new attempt), or every run matching --filter "
    "(POST /runs/bulk/replay/).\n\n\b\nExamples:\n  schedctl runs replay <run id>\n"
    "  schedctl runs replay --filter state=failed --filter failure_reason=exhausted",
)


# --- schedules ------------------------------------------------------------------------


@cli.group(context_settings=CONTEXT)
def schedules():
    """Schedules: see when one fires before saving it.

    \b
    Example:
      schedctl schedules preview --cron '30 2 * * *' --timezone America/New_York
    """


@schedules.command("preview", context_settings=CONTEXT)
@click.option("--cron", metavar="EXPRESSION")
@click.option("--timezone", "tz")
@click.option("--every", type=int, metavar="SECONDS")
@click.option("--at", "run_at", metavar="INSTANT")
@click.option("--schedule", "schedule_json", metavar="JSON", help="A whole schedule object.")
@click.option("--after", help="Default: now.")
@click.option("--count", type=int, default=10, show_default=True)
@click.option("--dst", "dst_json", metavar="JSON", help='e.g. {"gap": "skip", "fold": "first"}')
@output_option
@click.pass_context
@api_command
def schedules_preview(ctx, cron, tz, every, run_at, schedule_json, after, count, dst_json, output):
    """The next fire instants of a schedule, daylight saving named.

    \b
    Example:
      schedctl schedules preview --cron '30 2 * * *' --timezone America/New_York \\
          --after 2025-03-08T00:00:00Z --count 3
    """
    if schedule_json:
        schedule = load_json_option(schedule_json, "--schedule")
    elif cron:
        schedule = {"kind": "cron", "expression": cron, **({"timezone": tz} if tz else {})}
    elif every:
        schedule = {"kind": "interval", "every_seconds": every}
    elif run_at:
        schedule = {"kind": "once", "run_at": run_at}
    else:
        raise click.UsageError("give --cron, --every, --at or --schedule")
    found = client_of(ctx).schedule_preview(
        schedule, after=after, count=count, dst=load_json_option(dst_json, "--dst")
    )
    if output == "json":
        return emit_json([o.__dict__ for o in found])
    table(None, ["AT (UTC)", "LOCAL", "DST", "DOUBLED"],
          [[o.at, o.local, o.dst, "yes" if o.doubled else ""] for o in found])  # fmt: skip


# --- apply and import-beat ------------------------------------------------------------


@cli.command("apply", context_settings=CONTEXT)
@click.option("-f", "--file", "path", required=True, help="A jobs file (YAML or JSON; '-': "
              "standard input).")  # fmt: skip
@click.option("--prune", is_flag=True, help="Cancel your managed jobs the file no longer names.")
@click.option("--dry-run", is_flag=True, help="Print the plan; change nothing.")
@output_option
@click.pass_context
@api_command
def apply_command(ctx, path, prune, dry_run, output):
    """Make your jobs match a file, keyed by name: create, update (a new version), leave
    alone; with --prune, cancel those it no longer names. Running it twice changes nothing.

    The file: `jobs:` followed by job bodies as `POST /jobs/` takes them. The jobs get the
    label `managed-by: schedctl`; --prune considers only jobs bearing it.

    \b
    Example:
      schedctl apply -f jobs.yaml --dry-run
      schedctl apply -f jobs.yaml --prune
    """
    from .apply import apply_execute, apply_plan, jobs_file_read

    client = client_of(ctx)
    plan, desired = apply_plan(client, jobs_file_read(path), prune=prune)
    if not dry_run:
        apply_execute(client, plan, desired)
    if output == "json":
        return emit_json({"dry_run": dry_run, "changes": [c.as_dict() for c in plan]})
    marks = {"create": "+", "update": "~", "unchanged": "=", "prune": "-"}
    table("plan" if dry_run else "applied", ["", "ACTION", "NAME", "JOB", "VERSION", "FIELDS"],
          [[marks[c.action], c.action, c.name, c.job, c.version, ", ".join(c.fields)]
           for c in plan])  # fmt: skip
    counts = {action: sum(c.action == action for c in plan) for action in marks}
    out.print(", ".join(f"{n} {action}" for action, n in counts.items()))


@cli.command("import-beat", context_settings=CONTEXT)
@click.argument("target", metavar="MODULE:APP")
@click.option("-w", "--write", "path", default="-", show_default=True,
              help="The jobs file to write ('-': standard output).")  # fmt: skip
@click.option("--offline", is_flag=True, help="Do not ask the server which tasks it knows.")
@click.pass_context
@api_command
def import_beat(ctx, target, path, offline):
    """Write a jobs file (for `schedctl apply`) from a Celery app's beat_schedule, and name
    what cannot be carried over (solar schedules, custom schedule classes, tasks the server
    does not know as job tasks). Exit 0 even then: the file holds what could be carried.

    \b
    Example:
      schedctl import-beat proj.celery:app -w jobs.yaml && schedctl apply -f jobs.yaml
    """
    from .apply import managed
    from .beat import beat_import, celery_app_load, jobs_file_text

    result = beat_import(celery_app_load(target))
    if not offline:
        client = client_of(ctx)
        kept = []
        for body in result.jobs:
            try:
                client.job_normalize(managed(body))
            except ApiError as exc:
                if exc.status != 400:
                    raise
                if isinstance(exc.body, dict) and "task" in exc.body:
                    result.skipped.append((body["name"], f"task {body['task']!r} is not a "
                                           "registered job task"))  # fmt: skip
                else:
                    result.skipped.append((body["name"], f"refused: {exc.detail}"))
                continue
            kept.append(body)
        result.jobs = kept
    text = jobs_file_text(result, source=target)
    if path == "-":
        click.echo(text, nl=False)
    else:
        with open(path, "w") as handle:
            handle.write(text)
    err.print(f"{len(result.jobs)} jobs written", highlight=False)
    for name, why in result.skipped:
        err.print(f"not carried over: {name}: {why}", highlight=False)
    for name, why in result.notes:
        err.print(f"carried with a difference: {name}: {why}", highlight=False)


# --- queues and calendars ---------------------------------------------------------------


@cli.group(context_settings=CONTEXT)
def queues():
    """Queues: their lanes and depths; pause, resume and limit them (operators).

    \b
    Example:
      schedctl queues pause jobs --reason 'database maintenance'
    """


@queues.command("list", context_settings=CONTEXT)
@output_option
@click.pass_context
@api_command
def queues_list(ctx, output):
    """Every queue with paused, ready, waiting, running, max_running and rate_limit.

    \b
    Example:
      schedctl queues list -o json
    """
    found = client_of(ctx).queues()
    if output == "json":
        return emit_json(found)
    columns = ["name", "paused", "ready", "waiting", "running", "max_running", "rate_limit"]
    table(None, [c.upper() for c in columns], [[q.get(c) for c in columns] for q in found])


@queues.command("pause", context_settings=CONTEXT)
@click.argument("name")
@click.option("--reason", default="")
@click.option("--until", help="Resume by itself at this instant.")
@output_option
@click.pass_context
@api_command
def queues_pause(ctx, name, reason, until, output):
    """Pause a queue: its runs wait in PostgreSQL until it is resumed.

    \b
    Example:
      schedctl queues pause jobs --reason deploy --until 2026-12-05T08:00:00Z
    """
    _show_queue(client_of(ctx).queue_pause(name, reason=reason, until=until), output)


@queues.command("resume", context_settings=CONTEXT)
@click.argument("name")
@output_option
@click.pass_context
@api_command
def queues_resume(ctx, name, output):
    """Resume a paused queue.

    \b
    Example:
      schedctl queues resume jobs
    """
    _show_queue(client_of(ctx).queue_resume(name), output)


@queues.command("set", context_settings=CONTEXT)
@click.argument("name")
@click.option("--max-running", help="Runs running at once across the fleet; 'none' removes.")
@click.option("--rate-limit", help="Runs started per period, e.g. 100/s; 'none' removes.")
@output_option
@click.pass_context
@api_command
def queues_set(ctx, name, max_running, rate_limit, output):
    """Limit a queue across the whole fleet.

    \b
    Example:
      schedctl queues set jobs --max-running 10 --rate-limit 100/s
    """
    changes: dict = {}
    if max_running is not None:
        changes["max_running"] = None if max_running == "none" else int(max_running)
    if rate_limit is not None:
        changes["rate_limit"] = None if rate_limit == "none" else rate_limit
    if not changes:
        raise click.UsageError("give --max-running or --rate-limit")
    _show_queue(client_of(ctx).queue_set(name, changes), output)


def _show_queue(queue: Any, output: str) -> None:
    if output == "json":
        return emit_json(queue)
    fields("queue", list(queue.items()) if isinstance(queue, dict) else [("answer", queue)])


@cli.group(context_settings=CONTEXT)
def calendars():
    """Calendars: when jobs must not run (holidays, freezes), or the only days they may.

    \b
    Example:
      schedctl calendars create -f holidays.yaml
    """


@calendars.command("list", context_settings=CONTEXT)
@output_option
@click.pass_context
@api_command
def calendars_list(ctx, output):
    """Your calendars.

    \b
    Example:
      schedctl calendars list -o json
    """
    found = list(client_of(ctx).calendars())
    if output == "json":
        return emit_json(found)
    table(None, ["ID", "NAME", "TIMEZONE", "DATES", "RANGES", "RRULES"],
          [[c.get("id"), c.get("name"), c.get("timezone"), len(c.get("dates") or []),
            len(c.get("ranges") or []), len(c.get("rrules") or [])] for c in found])  # fmt: skip


@calendars.command("create", context_settings=CONTEXT)
@click.option("-f", "--file", "file", type=click.File("r"), required=True,
              help="A calendar body (YAML or JSON).")  # fmt: skip
@output_option
@click.pass_context
@api_command
def calendars_create(ctx, file, output):
    """Create a calendar from a file.

    \b
    Example (holidays.yaml: name, timezone, dates, ranges, rrules, holidays):
      schedctl calendars create -f holidays.yaml
    """
    import yaml

    _show_queue(client_of(ctx).calendar_create(yaml.safe_load(file.read())), output)


@calendars.command("import", context_settings=CONTEXT)
@click.argument("calendar_id")
@click.argument("ics", type=click.File("rb"))
@output_option
@click.pass_context
@api_command
def calendars_import(ctx, calendar_id, ics, output):
    """Add an iCalendar file's events to a calendar.

    \b
    Example:
      schedctl calendars import <calendar id> holidays.ics
    """
    _show_queue(client_of(ctx).calendar_import(calendar_id, ics.read()), output)


# --- completion -------------------------------------------------------------------------


@cli.command("completion", context_settings=CONTEXT)
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
def completion(shell):
    """Print the shell completion script (click's).

    \b
    Example:
      eval "$(schedctl completion bash)"     # in ~/.bashrc
    """
    from click.shell_completion import get_completion_class

    completer = get_completion_class(shell)(cli, {}, "schedctl", "_SCHEDCTL_COMPLETE")
    click.echo(completer.source())


def main() -> None:
    cli(prog_name="schedctl")


if __name__ == "__main__":
    main()

"""The HTTP client of the scheduler's REST API (`/api/v1/`), without Django.

    from scheduler_client import Client

    client = Client()                       # SCHEDULER_URL / SCHEDULER_TOKEN, or a profile
    job = client.job_create({"name": "hello", "task": "scheduler.echo",
                             "schedule": {"kind": "once", "run_at": "2030-01-01T09:00:00Z"}})
    run = client.job_trigger(job.id)
    for line in client.follow_logs(run.id):
        print(line.text)
    print(client.wait(run.id).state)

Every POST carries an `Idempotency-Key` (one per call, the same on each of its retries), so a
request retried after a dropped connection or a restarted web process is answered once.
Retries: 429, 502, 503, 504 and transport errors (refused or dropped connections), with
exponential backoff and `Retry-After` honoured, at most `retries` times.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx

from .config import Settings, settings_load
from .models import (
    TERMINAL_RUN_STATES,
    BackfillResult,
    Job,
    LogLine,
    LogPage,
    Occurrence,
    Operation,
    Run,
)

RETRY_STATUSES = frozenset({429, 502, 503, 504})
USER_AGENT = "scheduler-client/0.1"


class ApiError(Exception):
    """An answer of the API outside 2xx: its status and its message (`detail`, or the field
    errors of a 400)."""

    def __init__(self, status: int, body: Any, *, method: str = "", url: str = "") -> None:
        self.status = status
        self.body = body
        self.method = method
        self.url = url
        super().__init__(f"{status}: {error_message(body)}")

    @property
    def detail(self) -> str:
        return error_message(self.body)


class ConnectionFailed(Exception):
    """The server could not be reached, after every retry."""


def error_message(body: Any) -> str:
    """The API's message: `detail`, or `field: reason` for each field of a 400."""
    if isinstance(body, dict):
        if "detail" in body and len(body) <= 3:
            return str(body["detail"])
        return "; ".join(f"{field}: {_flatten(reason)}" for field, reason in body.items())
    if isinstance(body, list):
        return "; ".join(_flatten(item) for item in body)
    return str(body)


def _flatten(reason: Any) -> str:
    if isinstance(reason, list):
        return " ".join(_flatten(item) for item in reason)
    if isinstance(reason, dict):
        return ", ".join(f"{key}: {_flatten(value)}" for key, value in reason.items())
    return str(reason)


class Client:
    """One server, one token. `url` is the server's root (`http://127.0.0.1:8000`) or its
    API root (`.../api/v1`); both default to the settings (environment, then profile)."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        profile: str | None = None,
        timeout: float = 60.0,
        retries: int | None = None,
        backoff: float = 0.5,
        max_backoff: float = 10.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        found: Settings = settings_load(profile=profile)
        url = url or found.url
        self.token = token or found.token
        root = url.rstrip("/")
        if not root.endswith("/api/v1"):
            root += "/api/v1"
        self.api_root = root + "/"
        self.retries = found.retries if retries is None else retries
        self.transport_retries = 0  # of the latest call (see _job_action)
        self.backoff = backoff
        self.max_backoff = max_backoff
        headers = {"User-Agent": USER_AGENT, "Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Token {self.token}"
        self.http = httpx.Client(headers=headers, timeout=timeout, transport=transport)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- the request, its retries and its errors ------------------------------------

    def url(self, path: str) -> str:
        return (
            path if path.startswith(("http://", "https://")) else self.api_root + path.lstrip("/")
        )

    def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: dict | None = None,
        headers: dict | None = None,
        idempotency_key: str | None = None,
        timeout: float | None = None,
        raw: tuple[bytes, str] | None = None,
    ) -> httpx.Response:
        """Send, retrying what may be retried; raise ApiError for an answer outside 2xx."""
        headers = dict(headers or {})
        if method == "POST":
            headers["Idempotency-Key"] = idempotency_key or str(uuid.uuid4())
        content = None
        if json_body is not None:
            content = json.dumps(json_body).encode()
            headers["Content-Type"] = "application/json"
        elif raw is not None:
            content, headers["Content-Type"] = raw
        # A `next` link carries its own query: the parameters are added to it (httpx would
        # replace it).
        url = str(
            httpx.URL(self.url(path)).copy_merge_params(
                {k: v for k, v in (params or {}).items() if v is not None}
            )
        )
        extra = {"timeout": timeout} if timeout is not None else {}
        attempt = 0
        while True:
            try:
                response = self.http.request(method, url, content=content, headers=headers, **extra)
            except httpx.TransportError as exc:
                self.transport_retries += 1
                if attempt >= self.retries:
                    raise ConnectionFailed(f"{method} {url}: {exc or type(exc).__name__}") from exc
                self._sleep(attempt, None)
                attempt += 1
                continue
            if response.status_code in RETRY_STATUSES and attempt < self.retries:
                self._sleep(attempt, response.headers.get("Retry-After"))
                attempt += 1
                continue
            if response.status_code >= 400:
                raise ApiError(response.status_code, _body(response), method=method, url=url)
            return response

    def _sleep(self, attempt: int, retry_after: str | None) -> None:
        delay = min(self.max_backoff, self.backoff * 2**attempt) * (0.5 + random.random() / 2)
        if retry_after:
            try:
                delay = max(delay, min(float(retry_after), 120.0))
            except ValueError:
                pass  # an HTTP date: the backoff instead
        time.sleep(delay)

    def get(self, path: str, **params) -> Any:
        return _body(self.request("GET", path, params=params))

    def post(self, path: str, body: Any = None, *, idempotency_key: str | None = None, **params):
        response = self.request(
            "POST", path, json_body=body, params=params, idempotency_key=idempotency_key
        )
        return _body(response)

    def pages(self, path: str, **params) -> Iterator[dict]:
        """Every item of a cursor-paginated list, page after page (`next`)."""
        url: str | None = path
        while url:
            page = self.get(url, **params)
            params = {}  # `next` carries the query
            yield from page["results"]
            url = page.get("next")

    # --- jobs -------------------------------------------------------------------------

    def jobs(self, **filters) -> Iterator[Job]:
        """The caller's jobs (filters: state, task, queue, label="k:v", ordering, ...)."""
        for item in self.pages("jobs/", **filters):
            yield Job.from_api(item)

    def job(self, job_id: str) -> Job:
        return Job.from_api(self.get(f"jobs/{job_id}/"))

    def job_create(self, body: dict, *, idempotency_key: str | None = None) -> Job:
        return Job.from_api(self.post("jobs/", body, idempotency_key=idempotency_key))

    def job_normalize(self, body: dict) -> dict:
        """The body as the server would store it, every default filled in (a dry run)."""
        return self.post("jobs/", body, dry_run="true")

    def job_update(self, job_id: str, patch: dict, *, if_match: int | None = None) -> Job:
        headers = {"If-Match": f'"{if_match}"'} if if_match is not None else {}
        response = self.request("PATCH", f"jobs/{job_id}/", json_body=patch, headers=headers)
        return Job.from_api(_body(response))

    def job_delete(self, job_id: str) -> None:
        self.request("DELETE", f"jobs/{job_id}/")

    def job_pause(self, job_id: str) -> Job:
        return self._job_action(job_id, "pause", "paused")

    def job_resume(self, job_id: str) -> Job:
        return self._job_action(job_id, "resume", "active")

    def job_cancel(self, job_id: str) -> Job:
        return self._job_action(job_id, "cancel", "cancelled")

    def _job_action(self, job_id: str, action: str, reached: str) -> Job:
        """A state change that the API does not key by Idempotency-Key: when it was
        retried after a dropped connection and answers 409 from the very state it leads
        to, the first try did it: the job is answered, not the 409."""
        self.transport_retries = 0
        try:
            return Job.from_api(self.post(f"jobs/{job_id}/{action}/"))
        except ApiError as exc:
            state = exc.body.get("state") if isinstance(exc.body, dict) else None
            if exc.status == 409 and state == reached and self.transport_retries:
                return self.job(job_id)
            raise

    def job_trigger(self, job_id: str, *, idempotency_key: str | None = None) -> Run:
        return Run.from_api(self.post(f"jobs/{job_id}/trigger/", idempotency_key=idempotency_key))

    def job_backfill(
        self, job_id: str, *, start: str, end: str, idempotency_key: str | None = None
    ) -> BackfillResult:
        body = self.post(
            f"jobs/{job_id}/backfill/",
            {"start": start, "end": end},
            idempotency_key=idempotency_key,
        )
        return BackfillResult.from_api(body)

    def job_history(self, job_id: str) -> dict:
        return self.get(f"jobs/{job_id}/history/")

    def job_occurrences(self, job_id: str, *, start: str, end: str) -> Iterator[dict]:
        """Every occurrence in the window, page after page (the server pages by cursor)."""
        yield from self.pages(f"jobs/{job_id}/occurrences/", **{"from": start, "to": end})

    def job_runs(self, job_id: str, **filters) -> Iterator[Run]:
        for item in self.pages(f"jobs/{job_id}/runs/", **filters):
            yield Run.from_api(item)

    # --- runs -------------------------------------------------------------------------

    def runs(self, **filters) -> Iterator[Run]:
        """Visible runs (filters: job, state, kind, scheduled_after, scheduled_before)."""
        for item in self.pages("runs/", **filters):
            yield Run.from_api(item)

    def run(self, run_id: str) -> Run:
        return Run.from_api(self.get(f"runs/{run_id}/"))

    def run_cancel(self, run_id: str) -> Run:
        return Run.from_api(self.post(f"runs/{run_id}/cancel/"))

    def run_replay(self, run_id: str) -> Run:
        return Run.from_api(self.post(f"runs/{run_id}/replay/"))

    def runs_bulk(self, action: str, *, filters: dict, dry_run: bool = False) -> Operation:
        """`POST /runs/bulk/<action>/` (cancel, replay): a dry run's count, or an operation."""
        body = self.post(f"runs/bulk/{action}/", {"filter": filters, "dry_run": dry_run})
        return Operation.from_api(body)

    def operation(self, operation_id: str) -> Operation:
        return Operation.from_api(self.get(f"operations/{operation_id}/"))

    def wait(self, run_id: str, *, timeout: float | None = None, poll: float = 1.0) -> Run:
        """Poll the run until it is terminal (succeeded, failed, cancelled, skipped); raise
        TimeoutError after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            run = self.run(str(run_id))
            if run.state in TERMINAL_RUN_STATES:
                return run
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"run {run_id} is still {run.state} after {timeout}s")
            time.sleep(poll)

    def logs(self, run_id: str, *, attempt: int | None = None, after: int = -1) -> LogPage:
        return LogPage.from_api(self.get(f"runs/{run_id}/logs/", attempt=attempt, after=after))

    def follow_logs(
        self,
        run_id: str,
        *,
        attempt: int | None = None,
        wait: int = 20,
        start_timeout: float | None = None,
    ) -> Iterator[LogLine]:
        """Every line of the attempt (default: the latest), live while it runs; ends when
        the attempt has ended and its last line was given. A run without an attempt yet is
        waited for (at most `start_timeout` seconds, default for ever)."""
        deadline = None if start_timeout is None else time.monotonic() + start_timeout
        params = {"follow": "true", "wait": wait, "attempt": attempt}
        url = f"runs/{run_id}/logs/"
        while True:
            try:
                page = self.get(url, **params)
                break
            except ApiError as exc:
                # No attempt yet: its run is still waiting to be delivered.
                if exc.status != 404 or self.run(str(run_id)).state in TERMINAL_RUN_STATES:
                    raise
                if deadline is not None and time.monotonic() > deadline:
                    raise
                time.sleep(1.0)
        while True:
            for line in page["lines"]:
                yield LogLine.from_api(line)
            if not page.get("next"):
                return
            page = self.get(page["next"], wait=wait)

    # --- schedules, queues, calendars --------------------------------------------------

    def schedule_preview(
        self,
        schedule: dict,
        *,
        after: str | None = None,
        count: int = 10,
        dst: dict | None = None,
        calendars: dict | None = None,
    ) -> list[Occurrence]:
        body: dict = {"schedule": schedule, "count": count}
        if after:
            body["after"] = after
        if dst:
            body["dst"] = dst
        if calendars:
            body["calendars"] = calendars
        answer = self.post("schedules/preview/", body)
        return [Occurrence.from_api(item) for item in answer["occurrences"]]

    def queues(self) -> list[dict]:
        body = self.get("queues/")
        return body["results"] if isinstance(body, dict) and "results" in body else body

    def queue_pause(self, name: str, *, reason: str = "", until: str | None = None) -> dict:
        body = {"reason": reason, **({"until": until} if until else {})}
        return self.post(f"queues/{name}/pause/", body)

    def queue_resume(self, name: str) -> dict:
        return self.post(f"queues/{name}/resume/")

    def queue_set(self, name: str, changes: dict) -> dict:
        return _body(self.request("PATCH", f"queues/{name}/", json_body=changes))

    def calendars(self) -> Iterator[dict]:
        yield from self.pages("calendars/")

    def calendar_create(self, body: dict) -> dict:
        return self.post("calendars/", body)

    def calendar_import(self, calendar_id: str, ics: bytes) -> dict:
        """Add an iCalendar file's events to the calendar."""
        response = self.request(
            "POST", f"calendars/{calendar_id}/import/", raw=(ics, "text/calendar")
        )
        return _body(response)


def _body(response: httpx.Response) -> Any:
    if not response.content:
        return None
    try:
        return response.json()
    except ValueError:
        return response.text

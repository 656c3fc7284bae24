"""Jobs as code: make the caller's managed jobs match a file (`schedctl apply`).

A jobs file is YAML or JSON: `{"jobs": [<job body>, ...]}` (or the list alone). Jobs are
keyed by `name`. Every job the file describes is labelled `managed-by: schedctl`: the
server keeps the names of such jobs unique among their owner's live (active or paused)
jobs, so two applies of one file at once cannot both create a job, and `--prune` touches
only jobs that an apply made, never one created otherwise.

The plan compares the file's body, as the server would store it (`POST /jobs/?dry_run=true`
fills in every default), with each job's stored body: equal bodies are left alone (no
request, no version); a different one is sent whole as a PATCH with `If-Match: <version>`
(a new version); a stale version (someone changed the job meanwhile) is read again and
planned again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .client import ApiError, Client
from .models import Job

MANAGED_LABEL = "managed-by"
MANAGED_BY = "schedctl"
LIVE_STATES = ("active", "paused")


class JobsFileError(ValueError):
    pass


def jobs_file_read(path: str) -> list[dict]:
    """The job bodies of a YAML or JSON file ('-': standard input)."""
    import sys

    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    try:
        document = yaml.safe_load(text)  # JSON is YAML
    except yaml.YAMLError as exc:
        raise JobsFileError(f"{path}: not YAML or JSON: {exc}") from exc
    bodies = document.get("jobs") if isinstance(document, dict) else document
    if bodies is None:
        bodies = []
    if not isinstance(bodies, list) or not all(isinstance(b, dict) for b in bodies):
        raise JobsFileError(f"{path}: expected a list of job bodies under 'jobs'")
    names: set[str] = set()
    for index, body in enumerate(bodies):
        name = body.get("name")
        if not isinstance(name, str) or not name:
            raise JobsFileError(f"{path}: job #{index + 1} has no name")
        if name in names:
            raise JobsFileError(f"{path}: the name {name!r} is used twice")
        names.add(name)
    return bodies


def managed(body: dict) -> dict:
    labels = {**(body.get("labels") or {}), MANAGED_LABEL: MANAGED_BY}
    return {**body, "labels": labels}


@dataclass
class Change:
    action: str  # create, update, unchanged, prune
    name: str
    job: str | None = None
    fields: list[str] = field(default_factory=list)
    version: int | None = None

    def as_dict(self) -> dict:
        return {
            "action": self.action,
            "name": self.name,
            "job": self.job,
            "fields": self.fields,
            "version": self.version,
        }


def managed_jobs(client: Client) -> dict[str, Job]:
    """The caller's live jobs that an apply made, by name."""
    found: dict[str, Job] = {}
    for state in LIVE_STATES:
        for job in client.jobs(label=f"{MANAGED_LABEL}:{MANAGED_BY}", state=state, page_size=500):
            found[job.name] = job
    return found


def changed_fields(current: dict, desired: dict) -> list[str]:
    keys = sorted(set(current) | set(desired))
    return [key for key in keys if _canonical(current.get(key)) != _canonical(desired.get(key))]


def _canonical(value) -> str:
    """JSON with sorted keys and whole floats as integers: a default (10) and the same value
    given (10.0 once validated) are one value."""
    return json.dumps(_numbers(value), sort_keys=True, separators=(",", ":"))


def _numbers(value):
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {key: _numbers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_numbers(item) for item in value]
    return value


def apply_plan(client: Client, bodies: list[dict], *, prune: bool) -> tuple[list[Change], dict]:
    """What applying the bodies would do, and each body as the server would store it."""
    desired = {}
    for body in bodies:
        try:
            desired[body["name"]] = client.job_normalize(managed(body))
        except ApiError as exc:
            raise ApiError(
                exc.status, {"detail": f"job {body['name']!r}: {exc.detail}"}, url=exc.url
            ) from exc
    existing = managed_jobs(client)
    plan = [_planned(name, spec, existing.get(name)) for name, spec in desired.items()]
    if prune:
        plan += [
            Change("prune", name, job=job.id, version=job.version)
            for name, job in sorted(existing.items())
            if name not in desired
        ]
    return plan, desired


def _planned(name: str, spec: dict, job: Job | None) -> Change:
    if job is None:
        return Change("create", name)
    fields = changed_fields(job.spec, spec)
    action = "update" if fields else "unchanged"
    return Change(action, name, job=job.id, fields=fields, version=job.version)


def apply_execute(client: Client, plan: list[Change], desired: dict, *, on_step=None) -> None:
    """Carry out the plan; each change's `job` and `version` are updated to the result."""
    for change in plan:
        _execute(client, change, desired)
        if on_step:
            on_step(change)


def _execute(client: Client, change: Change, desired: dict, *, again: int = 3) -> None:
    if change.action == "unchanged":
        return
    if change.action == "prune":
        try:
            job = client.job_cancel(change.job)
        except ApiError as exc:
            if exc.status not in (404, 409):  # cancelled or deleted meanwhile
                raise
            return
        change.version = job.version
        return
    spec = desired[change.name]
    try:
        if change.action == "create":
            job = client.job_create(spec)
        else:
            job = client.job_update(change.job, spec, if_match=change.version)
    except ApiError as exc:
        # 409: another apply created it meanwhile (names of managed jobs are unique);
        # 412: changed meanwhile. Either way: plan this job again from what is there now.
        if exc.status not in (409, 412) or again == 0:
            raise
        job = managed_jobs(client).get(change.name)
        if job is None and exc.status == 409:
            raise
        replanned = _planned(change.name, spec, job)
        change.action, change.job, change.fields, change.version = (
            replanned.action,
            replanned.job,
            replanned.fields,
            replanned.version,
        )
        _execute(client, change, desired, again=again - 1)
        return
    change.job, change.version = job.id, job.version

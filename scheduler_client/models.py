"""Typed results of the API: the fields a caller reads most, and `raw`, the whole answer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TERMINAL_RUN_STATES = frozenset({"succeeded", "failed", "cancelled", "skipped"})
# The fields the server sets on a job: everything else of a job's answer is its body.
JOB_SERVER_FIELDS = frozenset(
    {"id", "owner", "state", "version", "next_run_at", "created_at", "updated_at"}
)


@dataclass(frozen=True)
class Job:
    id: str
    name: str
    task: str
    state: str
    version: int
    schedule: dict
    queue: str
    labels: dict
    next_run_at: str | None
    created_at: str | None
    raw: dict = field(repr=False, compare=False)

    @classmethod
    def from_api(cls, body: dict) -> Job:
        return cls(
            id=body["id"],
            name=body.get("name", ""),
            task=body.get("task", ""),
            state=body.get("state", ""),
            version=body.get("version", 0),
            schedule=body.get("schedule") or {},
            queue=body.get("queue", ""),
            labels=body.get("labels") or {},
            next_run_at=body.get("next_run_at"),
            created_at=body.get("created_at"),
            raw=body,
        )

    @property
    def spec(self) -> dict:
        """The job's body as stored (without the server's fields)."""
        return {k: v for k, v in self.raw.items() if k not in JOB_SERVER_FIELDS}


@dataclass(frozen=True)
class Attempt:
    number: int
    state: str
    worker: str
    started_at: str | None
    finished_at: str | None
    error: str

    @classmethod
    def from_api(cls, body: dict) -> Attempt:
        return cls(
            number=body["number"],
            state=body["state"],
            worker=body.get("worker", ""),
            started_at=body.get("started_at"),
            finished_at=body.get("finished_at"),
            error=body.get("error", ""),
        )


@dataclass(frozen=True)
class Run:
    id: str
    job: str
    kind: str
    state: str
    scheduled_for: str
    attempt_count: int
    failure_reason: str
    skip_reason: str
    result: Any
    timestamps: dict
    attempts: list[Attempt]
    raw: dict = field(repr=False, compare=False)

    @classmethod
    def from_api(cls, body: dict) -> Run:
        return cls(
            id=body["id"],
            job=body.get("job", ""),
            kind=body.get("kind", ""),
            state=body.get("state", ""),
            scheduled_for=body.get("scheduled_for", ""),
            attempt_count=body.get("attempt_count", 0),
            failure_reason=body.get("failure_reason", ""),
            skip_reason=body.get("skip_reason", ""),
            result=body.get("result"),
            timestamps=body.get("timestamps") or {},
            attempts=[Attempt.from_api(a) for a in body.get("attempts") or []],
            raw=body,
        )

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_RUN_STATES


@dataclass(frozen=True)
class LogLine:
    n: int
    ts: str
    stream: str
    level: str
    text: str

    @classmethod
    def from_api(cls, body: dict) -> LogLine:
        return cls(
            n=body["n"],
            ts=body.get("ts", ""),
            stream=body.get("stream", ""),
            level=body.get("level", ""),
            text=body.get("text", ""),
        )


@dataclass(frozen=True)
class LogPage:
    run: str
    attempt: int
    attempt_state: str
    complete: bool
    ended: bool
    lines: list[LogLine]
    next: str | None
    raw: dict = field(repr=False, compare=False)

    @classmethod
    def from_api(cls, body: dict) -> LogPage:
        return cls(
            run=body["run"],
            attempt=body["attempt"],
            attempt_state=body.get("attempt_state", ""),
            complete=body.get("complete", False),
            ended=body.get("ended", False),
            lines=[LogLine.from_api(line) for line in body.get("lines", [])],
            next=body.get("next"),
            raw=body,
        )


@dataclass(frozen=True)
class Occurrence:
    at: str
    local: str
    dst: str
    doubled: bool
    excluded: bool
    reason: str

    @classmethod
    def from_api(cls, body: dict) -> Occurrence:
        return cls(
            at=body["at"],
            local=body.get("local", ""),
            dst=body.get("dst", ""),
            doubled=body.get("doubled", False),
            excluded=body.get("excluded", False),
            reason=body.get("reason", ""),
        )


@dataclass(frozen=True)
class BackfillResult:
    created: list[str]
    existing: list[str]
    pruned: list[str]

    @classmethod
    def from_api(cls, body: dict) -> BackfillResult:
        return cls(
            created=list(body.get("created", [])),
            existing=list(body.get("existing", [])),
            pruned=list(body.get("pruned", [])),
        )


@dataclass(frozen=True)
class Operation:
    """A bulk operation (`GET /operations/{id}/`), or a dry run's count (`id` None)."""

    id: str | None
    state: str
    matched: int
    done: int
    refused: dict
    raw: dict = field(repr=False, compare=False)

    @classmethod
    def from_api(cls, body: dict) -> Operation:
        return cls(
            id=body.get("id"),
            state=body.get("state", "done" if "id" not in body else ""),
            matched=body.get("matched", 0),
            done=body.get("done", 0),
            refused=body.get("refused") or {},
            raw=body,
        )

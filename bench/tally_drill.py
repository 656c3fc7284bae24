"""A drill for the tallies' locks: claims, cancels with cancel_previous, job cancels through
the API and promotions racing at load for a bounded time, counting the deadlocks PostgreSQL
detected in the drill's database (`pg_stat_database.deadlocks`, before and after), the
errors of every step by kind (a deadlock by the trigger function or the relation it was
on), and the API's 500s; then checks that the tallies still equal a count of the rows.

    .venv/bin/python -m bench.tally_drill [--seconds 150] [--jobs 100] [--claimers 3]

Creates a fresh PostgreSQL database (dropped afterwards). Every actor is a thread with its
own database session, on the product's own functions:
- the scheduler (`scheduler_run_once` on the database's clock: the materializer, whose
  jobs are interval jobs every second with overlap `cancel_previous`, so each occurrence
  cancels the previous run, queued, running or waiting for a retry, and inserts a queued
  one; the promoter and the completer);
- a second promoter (`promoter_run_once`), so retries are promoted against the
  materializer's cancels;
- `--claimers` workers claiming queued runs (`run_claim`) and ending them: half succeed in
  packs (`attempts_succeed`), a third fail with a retry a moment later (retry_wait), the
  rest stay running until cancel_previous cancels them;
- an API client creating jobs like the others and cancelling them a few seconds later
  (`POST /api/v1/jobs/{id}/cancel/`: `job_cancel`, each active run in turn);
- the pruner every second (`pruner_run_once`: the tallies' roll-up).
The result is printed and written under var/bench/.
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
import random
import re
import threading
import time

from bench.common import RESULTS, bench_environment

EVERY = {"kind": "interval", "every_seconds": 1}


class Drill:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds
        self.lock = threading.Lock()
        self.steps: collections.Counter = collections.Counter()
        self.errors: collections.Counter = collections.Counter()
        self.statuses: collections.Counter = collections.Counter()
        self.samples: dict[str, str] = {}

    def running(self) -> bool:
        return time.monotonic() < self.deadline

    def actor(self, name: str, step) -> threading.Thread:
        """A thread calling `step()` until the deadline, counting its steps and errors."""
        from django.db import connection

        def target() -> None:
            try:
                while self.running():
                    try:
                        step()
                        outcome = None
                    except Exception as exc:  # noqa: BLE001 - counted, the drill goes on
                        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                        kind = type(exc).__name__
                        if "deadlock detected" in text:
                            # A tally's trigger in the context, or the rows it was on.
                            where = re.search(r'function (\w+)\(\)|relation "(\w+)"', str(exc))
                            kind = f"deadlock on {where and (where[1] or where[2])}"
                        outcome = f"{name}: {kind}"
                        with self.lock:
                            self.samples.setdefault(outcome, str(exc)[:1500])
                    with self.lock:
                        self.steps[name] += 1
                        if outcome:
                            self.errors[outcome] += 1
            finally:
                connection.close()

        return threading.Thread(target=target, name=name, daemon=True)


def deadlocks() -> int:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
        return cursor.fetchone()[0]


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.tally_drill",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--seconds", type=float, default=150)
    parser.add_argument("--jobs", type=int, default=100, help="cancel_previous jobs at start")
    parser.add_argument("--claimers", type=int, default=3)
    args = parser.parse_args()
    started = dt.datetime.now(dt.UTC)
    with bench_environment("bench_tally_drill", task_modules="tests.sample_tasks"):
        from django.contrib.auth import get_user_model
        from django.db import connection, transaction
        from django.db.models import Count
        from rest_framework.test import APIClient

        from dispatch.promoter import PromoterConfig, promoter_run_once
        from dispatch.pruner import PrunerConfig, pruner_run_once
        from dispatch.scheduler import SchedulerConfig, scheduler_run_once
        from jobs.clock import db_now
        from jobs.models import OutboxMessage, Run, RunState
        from jobs.services import job_create_bulk
        from jobs.transitions import attempt_fail, attempts_succeed, run_claim
        from storage.metrics import tallies_sum
        from storage.tallies import OUTBOX_BACKLOG, RUNS_BY_STATE
        from tests.factories import job_body, job_spec, token_for

        owner = get_user_model().objects.create_user("drill")
        retry = {"max_attempts": 100, "initial_delay_seconds": 0.5, "max_delay_seconds": 1}
        spec = {"schedule": EVERY, "overlap": "cancel_previous", "retry": retry}
        now = db_now()
        job_create_bulk(
            owner=owner,
            specs=[job_spec(args=[n], **spec) for n in range(args.jobs)],
            now=now - dt.timedelta(seconds=1),
        )
        drill = Drill(args.seconds)
        before = deadlocks()

        def schedule() -> None:
            scheduler_run_once(now=db_now(), config=SchedulerConfig())

        def promote() -> None:
            promoter_run_once(now=db_now(), config=PromoterConfig())
            time.sleep(0.05)

        def work() -> None:
            ids = list(
                Run.objects.filter(state=RunState.QUEUED)
                .order_by("?")
                .values_list("id", flat=True)[:10]
            )
            if not ids:
                time.sleep(0.05)
                return
            claimed = [run_claim(run_id=run_id, worker="drill") for run_id in ids]
            claimed = [attempt for attempt in claimed if attempt is not None]
            random.shuffle(claimed)
            half, third = len(claimed) // 2, len(claimed) * 5 // 6
            with transaction.atomic():
                attempts_succeed(outcomes=[(attempt, None) for attempt in claimed[:half]])
            retry_at = db_now() + dt.timedelta(seconds=0.5)
            for attempt in claimed[half:third]:
                attempt_fail(attempt=attempt, now=db_now(), error="drill", retry_at=retry_at)

        client = APIClient(SERVER_NAME="localhost", raise_request_exception=False)
        client.credentials(HTTP_AUTHORIZATION=f"Token {token_for(owner)}")
        created: collections.deque = collections.deque()

        def cancel_jobs() -> None:
            body = job_body(name="drill", **spec)
            response = client.post("/api/v1/jobs/", body, format="json")
            with drill.lock:
                drill.statuses[f"create {response.status_code}"] += 1
            if response.status_code == 201:
                created.append((time.monotonic(), response.json()["id"]))
            while created and created[0][0] < time.monotonic() - 3:
                _, job_id = created.popleft()
                response = client.post(f"/api/v1/jobs/{job_id}/cancel/")
                with drill.lock:
                    drill.statuses[f"cancel {response.status_code}"] += 1
            time.sleep(0.1)

        def prune() -> None:
            pruner_run_once(now=db_now(), config=PrunerConfig())
            time.sleep(1)

        actors = [
            drill.actor("scheduler", schedule),
            drill.actor("promoter", promote),
            drill.actor("api", cancel_jobs),
            drill.actor("pruner", prune),
            *(drill.actor(f"claimer-{n}", work) for n in range(args.claimers)),
        ]
        for actor in actors:
            actor.start()
        for actor in actors:
            actor.join()
        time.sleep(1.5)  # the statistics collector's flush
        after = deadlocks()

        # Every figure the tallies give equals a count of the rows, before and after the
        # roll-up of what is left.
        def figures() -> tuple[dict, dict]:
            tallied = {
                (name, labels): count
                for name, labels, count, _ in tallies_sum(names=[RUNS_BY_STATE, OUTBOX_BACKLOG])
                if count
            }
            counted = {
                (RUNS_BY_STATE, f'state="{state}"'): n
                for state, n in Run.objects.values_list("state").annotate(n=Count("id"))
            }
            pending = OutboxMessage.objects.filter(state="pending").count()
            if pending:
                counted[(OUTBOX_BACKLOG, "")] = pending
            return tallied, counted

        tallied, counted = figures()
        consistent = tallied == counted
        pruner_run_once(now=db_now(), config=PrunerConfig())
        tallied_after, counted_after = figures()
        consistent = consistent and tallied_after == counted_after
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM jobs_tally_delta")
            deltas_left = cursor.fetchone()[0]
        result = {
            "started": started.isoformat(),
            "seconds": args.seconds,
            "jobs": args.jobs,
            "claimers": args.claimers,
            "deadlocks": after - before,
            "errors": dict(drill.errors),
            "error_samples": drill.samples,
            "steps": dict(drill.steps),
            "api": dict(drill.statuses),
            "api_500s": sum(n for key, n in drill.statuses.items() if key.endswith(" 500")),
            "runs": {labels: n for (_, labels), n in counted_after.items()},
            "tallies_equal_counts": consistent,
            "deltas_left_after_roll_up": deltas_left,
        }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"tally-drill-{started:%Y%m%dT%H%M%S}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"written to {path}")


if __name__ == "__main__":
    main()

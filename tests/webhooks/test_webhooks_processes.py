"""Webhooks with real processes: failed runs from a real worker, deliveries posted by the
scheduler's webhook loop to a real receiver on loopback, while the web process and the
poster are SIGKILLed; and a receiver answering 500 for a while."""

from __future__ import annotations

import collections
import datetime as dt
import random
import threading
import time

import pytest
import requests

from dispatch.management.commands.standalone import web_argv
from jobs.clock import db_now
from jobs.models import Run, RunState, WebhookDelivery, WebhookDeliveryState
from tests import factories
from tests.jobs.test_throttling import free_port, web_up
from tests.processes import wait_for
from tests.webhooks.receiver import Receiver, documented_verify

pytestmark = pytest.mark.slow

ENV = {"SCHEDULER_WEBHOOK_ALLOW_PRIVATE": "true", "SCHEDULER_WEBHOOK_RETRY_SECONDS": "0.5"}


class Web:
    """The web process, started again after a kill; requests retried across its death."""

    def __init__(self, stack, token: str) -> None:
        self.stack, self.port = stack, free_port()
        self.base = f"http://127.0.0.1:{self.port}/api/v1"
        self.headers = {"Authorization": f"Token {token}"}
        stack.start("web", web_argv(host="127.0.0.1", port=self.port, workers=1))
        self.wait_up()

    def wait_up(self) -> None:
        wait_for(lambda: web_up(self.port), timeout=60, message="the web process")

    def kill_and_restart(self) -> None:
        self.stack.kill("web")
        self.stack.restart("web")
        self.wait_up()

    def post(self, path: str, body) -> dict:
        """POST until answered (the same body: idempotent by its keys)."""
        for _ in range(5):
            try:
                answer = requests.post(self.base + path, json=body, headers=self.headers,
                                       timeout=60)  # fmt: skip
            except requests.ConnectionError:
                self.wait_up()
                continue
            assert answer.status_code in (200, 201, 202), answer.content[:500]
            return answer.json()
        raise AssertionError(f"POST {path} never answered")


class Scene:
    """The processes, a receiver, and a webhook of its owner on run.failed."""

    def __init__(self, stack, receiver: Receiver) -> None:
        stack.env.update(ENV)
        self.stack, self.receiver = stack, receiver
        self.web = Web(stack, factories.token_for(factories.owner("hooks")))
        stack.scheduler("scheduler", "--partition-lease-seconds", "3")
        stack.relay()
        stack.worker(concurrency=4)
        hook = self.web.post("/webhooks/", {"url": receiver.url, "events": ["run.failed"]})
        self.secret = hook["secret"]
        self.told_before: set[str] = set()

    def failed_runs_told(self, *, runs: int, kills: int = 0, failing_for: float = 0.0) -> str:
        """`runs` jobs whose one run fails; the receiver answers 500 for `failing_for`
        seconds, or the poster is killed `kills` times with posts in flight (the web too,
        mid-request). Checks that each run is told, signed, under one delivery id; the
        figures, as text."""
        receiver, stack, web = self.receiver, self.stack, self.web
        receiver.requests.clear()
        receiver.delay = 1.0 if kills else 0.0
        if failing_for:
            receiver.failing.set()
        due = (db_now() + dt.timedelta(seconds=2)).isoformat()
        first = len(self.told_before)
        bodies = [
            factories.job_body(name=f"fails {index}", task="tests.fail",
                               schedule={"kind": "once", "run_at": due},
                               retry={"max_attempts": 1}, idempotency_key=f"hook-{index}")
            for index in range(first, first + runs)
        ]  # fmt: skip
        chunks = [bodies[start : start + 50] for start in range(0, runs, 50)]
        for number, chunk in enumerate(chunks):
            if kills and number == 1:  # killed mid-request as often as not: posted again
                threading.Timer(random.uniform(0.05, 0.5), web.kill_and_restart).start()
            web.post("/jobs/bulk/", chunk)
        started = time.monotonic()

        def told() -> set[str]:
            return {r["json"]["data"]["run"]["id"] for r in receiver.accepted()}

        poster_kills = 0
        while poster_kills < kills:
            # The poster killed while its posts are in flight (the receiver holds each a
            # while): it never hears their answers, and posts them again after the lease.
            wait_for(lambda: receiver.in_flight, timeout=60, interval=0.05,
                     message="a post in flight")  # fmt: skip
            stack.kill("scheduler")
            poster_kills += 1
            stack.restart("scheduler")

        def pending() -> bool:
            return WebhookDelivery.objects.exclude(state=WebhookDeliveryState.DELIVERED).exists()

        # Every run told, and every delivery known delivered (a post whose poster was killed
        # reached the receiver, but stays pending until posted again).
        deadline = started + 90 + runs
        while (len(told()) < runs or pending()) and time.monotonic() < deadline:
            if failing_for and time.monotonic() - started > failing_for:
                receiver.failing.clear()
            time.sleep(0.2)
        failed = {str(run_id) for run_id in Run.objects.filter(state=RunState.FAILED)
                  .values_list("id", flat=True)} - self.told_before  # fmt: skip
        assert len(failed) == runs
        assert told() == failed, f"missing: {len(failed - told())}"
        assert not pending()
        self.told_before |= failed
        return self._checked(kills=kills, failing_for=failing_for, started=started)

    def _checked(self, *, kills: int, failing_for: float, started: float) -> str:
        verify = documented_verify()
        requests_ = self.receiver.requests
        by_run = collections.defaultdict(set)
        accepted = collections.Counter()
        for request in requests_:
            headers, body = request["headers"], request["json"]
            assert verify(self.secret, request["body"], headers["X-Scheduler-Signature"])
            assert headers["X-Scheduler-Delivery"] == body["id"]
            assert headers["X-Scheduler-Event"] == body["event"] == "run.failed"
            by_run[body["data"]["run"]["id"]].add(body["id"])
            if request["status"] == 200:
                accepted[body["id"]] += 1
        # Duplicates only under the same delivery id: one id per run.
        assert all(len(ids) == 1 for ids in by_run.values()), by_run
        if not kills:
            assert set(accepted.values()) == {1}, "a delivery accepted twice"
        if failing_for:
            refused = [r for r in requests_ if r["status"] == 500]
            assert refused, "the receiver refused nothing: the test proves nothing"
        duplicates = sum(accepted.values()) - len(accepted)
        return (f"{len(by_run)} failed runs told in {time.monotonic() - started:.1f} s; "
                f"{kills} poster kills, {duplicates} duplicates accepted (same delivery id), "
                f"{len(requests_)} requests")  # fmt: skip


def test_every_failed_run_is_told_through_a_failing_receiver_and_kills(stack, report_figure):
    """Nothing killed, the receiver answering 500 for 5 s: each run told exactly once
    after; then the poster killed twice with posts in flight, and the web process once:
    none missing, duplicates only under the same delivery id."""
    with Receiver() as receiver:
        scene = Scene(stack, receiver)
        report_figure(scene.failed_runs_told(runs=30, failing_for=5.0))
        report_figure(scene.failed_runs_told(runs=60, kills=2))


@pytest.mark.drill
@pytest.mark.timeout(600)
def test_200_failed_runs_told_while_the_web_and_the_poster_are_killed(stack, report_figure):
    with Receiver() as receiver:
        report_figure(Scene(stack, receiver).failed_runs_told(runs=200, kills=6))

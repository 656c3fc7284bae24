"""Machines lost: the product's web, two schedulers, two relays and two workers on a
three-node RabbitMQ cluster (quorum queues, CELERY_BROKER_URL naming the three nodes) and a
PostgreSQL primary with a synchronous standby (DATABASE_URL naming both hosts with
`target_session_attrs=read-write`), built on this machine by tests/faults/machines.py.

- The RabbitMQ node leading the `jobs` queue SIGKILLed while 1,000 runs flow: every run
  succeeds, each executed once (the handlers' own record file and effect counter say so, not
  the runs' states), relays and workers carry on within 10 s, the node restarted rejoins.
- The PostgreSQL primary stopped (`-m immediate`) and the standby promoted while jobs are
  created through the API and runs flow: every job answered 201 exists after, every run is
  terminal, executed at most once, and each process reconnects within 10 s of the
  promotion (its first session on the new primary, by its application_name)."""

from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg
import pytest
import requests

from dispatch.management.commands.standalone import web_argv
from tests.faults import machines
from tests.faults.helpers import restarts_services
from tests.processes import ROOT, Stack, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.faults, pytest.mark.drill, restarts_services]

RECOVERY_BOUND = 10.0  # seconds: the promise
WEB_PORT = 5699
SCHEDULERS = ("scheduler1", "scheduler2")
RELAYS = ("relay1", "relay2")
WORKERS = ("worker1", "worker2")


@dataclasses.dataclass
class Site:
    stack: Stack
    cluster: machines.RabbitCluster
    pair: machines.PostgresPair
    token: str

    def post(self, path: str, body, timeout: float = 10) -> requests.Response:
        return requests.post(
            f"http://127.0.0.1:{WEB_PORT}/api/v1/{path}", json=body, timeout=timeout,
            headers={"Authorization": f"Token {self.token}"},
        )  # fmt: skip

    def rows(self, query: str, *params) -> list[tuple]:
        """A query on whichever server is the primary now (libpq finds it)."""
        with psycopg.connect(self.pair.url(), connect_timeout=5) as db:
            return db.execute(query, params).fetchall()

    def executed(self) -> collections.Counter:
        """Each run's executions, as its handler recorded them (tests.fault_tasks)."""
        return collections.Counter(
            e["run_id"] for e in self.stack.executions() if e["event"] == "executed"
        )

    def effects(self) -> dict[str, int]:
        """Each run's committed ledger effects (tests.fault_tasks' counter)."""
        return {
            labels.split('"')[1]: value
            for labels, value in self.rows(
                "SELECT labels, value FROM dispatch_counter WHERE name = 'test_effect_commits'"
            )
        }


def _manage(env: dict, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.fixture
def site(tmp_path: Path, request):
    reason = machines.available()
    if reason:
        pytest.skip(reason)
    with machines.machines() as (cluster, pair):
        stack = Stack(
            tmp_path,
            extra_env={
                "DATABASE_URL": pair.url(),
                "CELERY_BROKER_URL": cluster.url,
                "SCHEDULER_QUEUE_TYPE": "quorum",
                "SCHEDULER_THROTTLE_RATES": "user=100000/min,bulk=1000/min",
            },
        )
        try:
            _manage(stack.env, "migrate", "--no-input", "-v", "0")
            user = "from django.contrib.auth import get_user_model as u; u()._default_manager"
            user += ".create_user('drill')"
            _manage(stack.env, "shell", "-c", user)
            token = _manage(stack.env, "drf_create_token", "drill").split()[2]
            stack.start("web", web_argv(host="127.0.0.1", port=WEB_PORT, workers=2),
                        {"SCHEDULER_DB_APPLICATION_NAME": "web"})  # fmt: skip
            for name in SCHEDULERS:
                stack.scheduler(name, SCHEDULER_DB_APPLICATION_NAME=name)
            for name in RELAYS:
                stack.relay(name, SCHEDULER_DB_APPLICATION_NAME=name)
            for name in WORKERS:
                stack.worker(name, concurrency=2, SCHEDULER_DB_APPLICATION_NAME=name)
            wait_for(lambda: _web_up(), timeout=60, message="the web process")
            yield Site(stack, cluster, pair, token)
        finally:
            stack.stop_all()
            report = getattr(request.node, "rep_call", None)
            if report is not None and report.failed:
                for name in stack.processes:
                    tail = stack.log(name).decode(errors="replace")[-3000:]
                    report.sections.append((f"process {name} (log tail)", tail))


def _web_up() -> bool:
    try:
        return requests.get(f"http://127.0.0.1:{WEB_PORT}/healthz", timeout=2).ok
    except requests.RequestException:
        return False


def _job(name: str, run_at: dt.datetime) -> dict:
    return {
        "name": name,
        "task": "faults.work",
        "args": [0.0],
        "schedule": {"kind": "once", "run_at": run_at.isoformat()},
    }


def _states(site: Site) -> dict[str, int]:
    return dict(site.rows("SELECT state, count(*) FROM jobs_run GROUP BY state"))


def _first_after(rows: list[tuple], instant: float) -> dict[str, float]:
    """Per name, the seconds from `instant` to its first timestamp after it."""
    return {name: round(at.timestamp() - instant, 2) for name, at in rows if at is not None}


@pytest.mark.timeout(900)
def test_the_rabbitmq_node_leading_the_queue_killed_while_1000_runs_flow(site, report_figure):
    runs = 1000
    start = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=10)
    for batch in range(4):  # due over 40 s: runs flow before, during and after the kill
        bodies = [
            _job(f"r{batch}-{i}", start + dt.timedelta(seconds=40 * (batch * 250 + i) / runs))
            for i in range(250)
        ]
        answer = site.post("jobs/bulk/", bodies, timeout=120)
        assert answer.status_code == 201, answer.text[:2000]
    assert site.rows("SELECT count(*) FROM jobs_job")[0][0] == runs
    wait_for(lambda: _states(site).get("succeeded", 0) >= 150, timeout=180,
             message="runs to flow")  # fmt: skip
    leader = site.cluster.leader("jobs")
    killed_at = time.time()
    leader.kill()
    survivor = next(node for node in site.cluster.nodes if node is not leader)

    wait_for(lambda: _states(site).get("succeeded", 0) == runs, timeout=400, interval=1,
             message=f"every run to succeed ({_states(site)})")  # fmt: skip
    new_leader = site.cluster.leader("jobs", via=survivor)
    # A worker's first claim of a message published after the kill: what it had taken
    # from the dead node before does not count.
    workers = _first_after(
        site.rows("SELECT split_part(a.worker, '@', 1), min(a.started_at) FROM jobs_attempt a "
                  "JOIN jobs_run r ON r.id = a.run_id WHERE r.published_at > to_timestamp(%s) "
                  "GROUP BY 1", killed_at),
        killed_at,
    )  # fmt: skip
    published = _first_after(
        site.rows("SELECT 'relays', min(published_at) FROM jobs_run "
                  "WHERE published_at > to_timestamp(%s)", killed_at),
        killed_at,
    )  # fmt: skip
    executed, effects = site.executed(), site.effects()

    leader.start()
    leader.await_startup()
    wait_until_rejoined = time.monotonic()
    wait_for(lambda: len(site.cluster.running(survivor)) == 3, timeout=120,
             message="the restarted node to rejoin")  # fmt: skip
    rejoined = site.cluster.running(leader)
    report_figure(
        f"RabbitMQ leader {leader.name} killed (new leader {new_leader.name}): first claim "
        f"of a message published after the kill per worker {workers} s, first publication "
        f"{published} s; "
        f"{len(executed)} runs executed, max {max(executed.values())} executions, "
        f"{sum(effects.values())} effects; node rejoined "
        f"{time.monotonic() - wait_until_rejoined:.1f} s after its restart"
    )
    assert _states(site) == {"succeeded": runs}
    assert len(executed) == runs and set(executed.values()) == {1}
    assert len(effects) == runs and set(effects.values()) == {1}
    assert new_leader is not leader
    assert set(workers) == set(WORKERS) and max(workers.values()) <= RECOVERY_BOUND
    assert published and published["relays"] <= RECOVERY_BOUND
    for name in RELAYS:  # both relays live on
        assert site.stack.processes[name].poll() is None, name
    assert rejoined == sorted(node.name for node in site.cluster.nodes)


class Creator(threading.Thread):
    """Creates one-time jobs through the API, one at a time, noting each 201 and when."""

    def __init__(self, site: Site, name: str) -> None:
        super().__init__(daemon=True)
        self.site, self.prefix = site, name
        self.stop = threading.Event()
        self.acknowledged: list[tuple[str, float]] = []
        self.refused = 0

    def run(self) -> None:
        index = 0
        while not self.stop.is_set():
            index += 1
            due = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=2)
            try:
                answer = self.site.post("jobs/", _job(f"{self.prefix}-{index}", due), timeout=15)
            except requests.RequestException:
                self.refused += 1
                time.sleep(0.2)
                continue
            if answer.status_code == 201:
                self.acknowledged.append((answer.json()["id"], time.time()))
            else:
                self.refused += 1
                time.sleep(0.2)
            time.sleep(0.05)


@pytest.mark.timeout(900)
def test_the_postgresql_primary_lost_and_the_standby_promoted_while_jobs_are_created(
    site, report_figure
):
    creators = [Creator(site, f"c{n}") for n in range(2)]
    for creator in creators:
        creator.start()
    time.sleep(20)  # jobs created and runs flowing
    stopped_at = time.time()
    site.pair.stop_primary()
    time.sleep(5)  # as a failover manager takes a few seconds to decide
    site.pair.promote()
    promoted_at = time.time()
    sessions: dict[str, float] = {}
    new_primary = site.pair.ports[1]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(sessions) < 7:
        # Since the stop, not the promotion: a process that retries every 0.2 s (the web,
        # under two creators) can open its session as the promotion ends, before
        # promote() has returned; the new primary has no other sessions of the product.
        for name, started in _sessions(site.pair, new_primary, stopped_at):
            sessions.setdefault(name, started)
        time.sleep(0.25)
    time.sleep(10)  # creations go on against the new primary
    for creator in creators:
        creator.stop.set()
    for creator in creators:
        creator.join(30)
    acknowledged = [entry for creator in creators for entry in creator.acknowledged]
    before = [job for job, at in acknowledged if at < stopped_at]
    after = [at - promoted_at for _, at in acknowledged if at > promoted_at]

    def settled() -> bool:
        states = _states(site)
        return sum(states.values()) == len(acknowledged) and set(states) <= {
            "succeeded",
            "failed",
            "cancelled",
            "skipped",
        }

    wait_for(settled, timeout=300, interval=1, message=f"every run terminal ({_states(site)})")
    ids = [job for job, _ in acknowledged]
    found = site.rows("SELECT count(*) FROM jobs_job WHERE id = ANY(%s::uuid[])", ids)[0][0]
    executed, effects = site.executed(), site.effects()
    reconnected = {name: round(at - promoted_at, 2) for name, at in sessions.items()}
    report_figure(
        f"PostgreSQL primary stopped, standby promoted 5 s later: {len(acknowledged)} jobs "
        f"acknowledged ({len(before)} before the stop), {found} found after; runs "
        f"{_states(site)}; first session on the new primary after the promotion {reconnected} "
        f"s; first 201 after it {min(after):.2f} s; max executions "
        f"{max(executed.values())}, max effects {max(effects.values())}"
    )
    assert found == len(acknowledged) and len(before) > 50
    assert max(executed.values()) == 1 and max(effects.values()) == 1
    expected = {"web", *SCHEDULERS, *RELAYS, *WORKERS}
    assert set(reconnected) == expected, reconnected
    assert max(reconnected.values()) <= RECOVERY_BOUND, reconnected
    assert min(after) <= RECOVERY_BOUND


def _sessions(pair: machines.PostgresPair, port: int, since: float) -> list[tuple[str, float]]:
    """The product's sessions on the server at `port` that began after `since`."""
    try:
        text = pair.sql(
            port,
            "SELECT json_agg(json_build_array(application_name, "
            "extract(epoch FROM backend_start))) FROM pg_stat_activity "
            f"WHERE backend_start > to_timestamp({since}) AND application_name <> '' "
            "AND application_name NOT LIKE 'psql%'",
        )
    except RuntimeError:
        return []
    return [(name, float(at)) for name, at in json.loads(text or "[]")]

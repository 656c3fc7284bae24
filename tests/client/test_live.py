"""`schedctl` with real processes: `runs logs --follow` of a running attempt ends when the
attempt ends; the client survives a web process restarted mid-command, and a dropped
answer to a committed creation is retried with its Idempotency-Key: one job."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
import uuid

import pytest

from dispatch.management.commands.standalone import web_argv
from jobs.models import Attempt, Job, Run, RunState
from tests.factories import one_time_job, owner, token_for
from tests.jobs.test_throttling import free_port, web_up
from tests.processes import wait_for

from .helpers import SCHEDCTL, ok, schedctl

pytestmark = pytest.mark.slow


def test_follow_ends_when_the_running_attempt_ends(stack, live_server, report_figure):
    stack.scheduler()
    stack.relay()
    stack.worker()
    token = token_for(owner())
    job = one_time_job(task="faults.chatty", args=[20, 6.0])
    run = wait_for(lambda: Run.objects.filter(job=job).first(), timeout=30, message="the run")
    wait_for(lambda: Attempt.objects.filter(run=run, state="running").exists(), timeout=60,
             message="the attempt to run")  # fmt: skip

    started = time.time()
    follow = schedctl("runs", "logs", str(run.id), "--follow", "-o", "json",
                      url=live_server.url, token=token, timeout=120)  # fmt: skip
    ended = time.time()
    ok(follow)
    lines = [json.loads(line) for line in follow.stdout.splitlines()]
    assert [line["text"] for line in lines] == [f"attempt 1 line {i}" for i in range(20)]
    attempt = Attempt.objects.get(run=run)
    # It was following while the attempt ran, and stopped once it had ended.
    assert attempt.finished_at is not None and attempt.finished_at.timestamp() > started
    assert ended >= attempt.finished_at.timestamp()
    assert Run.objects.get(id=run.id).state == RunState.SUCCEEDED
    report_figure(
        f"runs logs --follow: returned {ended - attempt.finished_at.timestamp():.2f}s after "
        "the attempt ended"
    )
    # Without --follow, and the table form: the same lines.
    table = ok(schedctl("runs", "logs", str(run.id), url=live_server.url, token=token))
    assert [row.split()[-1] for row in table.stdout.splitlines()] == [str(i) for i in range(20)]
    # wait(): a run that is over answers at once.
    got = ok(schedctl("runs", "get", str(run.id), "--wait", "-o", "json",
                      url=live_server.url, token=token)).json()  # fmt: skip
    assert got["state"] == "succeeded"


class AnswerDropper:
    """A TCP proxy before the web process that forwards the first `POST /api/v1/jobs/`
    whole but closes the client's connection instead of passing the answer back: the job
    was committed, and the client saw a dropped connection, as if the web process had died
    between its commit and its answer. Everything else passes through."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.dropped = 0
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self.handle, args=(client,), daemon=True).start()

    def handle(self, client: socket.socket) -> None:
        with client, socket.create_connection(("127.0.0.1", self.upstream)) as upstream:
            request = self.read_request(client)
            upstream.sendall(request)
            answer = b""
            while chunk := upstream.recv(65536):  # gunicorn's sync workers close after one
                answer += chunk
            if request.startswith(b"POST /api/v1/jobs/ ") and not self.dropped:
                self.dropped += 1
                return  # the answer is lost
            client.sendall(answer)

    @staticmethod
    def read_request(client: socket.socket) -> bytes:
        data = b""
        while b"\r\n\r\n" not in data:
            data += client.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(body) < length:
            body += client.recv(65536)
        return head + b"\r\n\r\n" + body

    def close(self) -> None:
        self.server.close()


def test_the_client_survives_a_web_restart_and_a_lost_answer(stack):
    token = token_for(owner("restarts"))
    port = free_port()
    stack.start("web", web_argv(host="127.0.0.1", port=port, workers=1))
    wait_for(lambda: web_up(port), timeout=60, message="the web process")
    url = f"http://127.0.0.1:{port}"

    # The web process is killed; a command started meanwhile waits for its restart.
    stack.kill("web")
    command = subprocess.Popen(
        [SCHEDCTL, "jobs", "create", "--name", "through a restart", "--task", "tests.record",
         "--every", "60", "-o", "json"],
        env={"SCHEDULER_URL": url, "SCHEDULER_TOKEN": token, "PATH": "/usr/bin:/bin",
             "SCHEDULER_CONFIG": "/nonexistent"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    time.sleep(2)
    assert command.poll() is None  # still retrying
    stack.restart("web")
    stdout, stderr = command.communicate(timeout=120)
    assert command.returncode == 0, stderr
    created = json.loads(stdout)
    assert list(Job.objects.filter(name="through a restart").values_list("id", flat=True)) == [
        uuid.UUID(created["id"])
    ]

    # A creation committed whose answer was lost: the retry, with the same key, is
    # answered with the same job; no second job.
    wait_for(lambda: web_up(port), timeout=60, message="the web process")
    proxy = AnswerDropper(port)
    try:
        result = ok(schedctl("jobs", "create", "--name", "answer lost", "--task", "tests.record",
                             "--every", "60", "-o", "json",
                             url=f"http://127.0.0.1:{proxy.port}", token=token))  # fmt: skip
    finally:
        proxy.close()
    assert proxy.dropped == 1
    jobs = list(Job.objects.filter(name="answer lost").values_list("id", flat=True))
    assert [str(job) for job in jobs] == [result.json()["id"]]

"""bin/check-services, which bin/test runs first: it passes when PostgreSQL and RabbitMQ
answer, and names what is missing otherwise. Only URLs of other hosts are given here, so
it never tries to start a service of this machine."""

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bin" / "check-services"


def check(**env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items()
            if k not in ("DATABASE_URL", "CELERY_BROKER_URL", "CI")}  # fmt: skip
    return subprocess.run(
        [sys.executable, str(SCRIPT)], env={**base, **env}, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip


def test_both_services_answer():
    done = check()
    assert (done.returncode, done.stderr) == (0, "")


def test_a_service_that_does_not_answer_is_named_with_what_to_do():
    # 192.0.2.1 (TEST-NET-1) never answers: not this machine's, so nothing is started.
    done = check(DATABASE_URL="postgres://postgres@192.0.2.1:5432/test", CI="true")
    assert done.returncode == 2
    assert "postgresql does not answer on 192.0.2.1:5432." in done.stderr
    assert "It is not on this machine" in done.stderr
    assert "rabbitmq" not in done.stderr
    assert "CI=true: every test must run" in done.stderr


def test_without_ci_the_missing_services_are_stood_in_for():
    done = check(
        DATABASE_URL="postgres://postgres@192.0.2.1:5432/test",
        CELERY_BROKER_URL="amqp://guest:guest@192.0.2.1:5672//",
        CI="",
    )
    assert done.returncode == 0
    assert "The tests run on the embedded PostgreSQL instead" in done.stderr
    assert "The tests that need RabbitMQ are reported skipped." in done.stderr


def test_several_hosts_pass_when_one_answers():
    # libpq's several hosts and kombu's several URLs: the first here never answers.
    done = check(
        DATABASE_URL="postgresql://postgres@127.0.0.1:1,127.0.0.1:5432/test"
        "?target_session_attrs=read-write",
        CELERY_BROKER_URL="amqp://guest:guest@127.0.0.1:1//;amqp://guest:guest@127.0.0.1:5672//",
    )
    assert (done.returncode, done.stderr) == (0, "")

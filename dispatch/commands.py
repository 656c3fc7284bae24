"""Command lines of the project's processes, shared by `standalone`, the tests and bench/."""

import sys


def worker_argv(
    *, name: str, concurrency: int, queues: list[str], loglevel: str = "INFO"
) -> list[str]:
    """A Celery worker consuming `queues`. Gossip, mingle and event heartbeats are off: the
    scheduler keeps its own state in PostgreSQL and uses none of them."""
    return [
        sys.executable, "-m", "celery", "-A", "scheduler_project", "worker",
        f"--loglevel={loglevel}", f"--concurrency={concurrency}", "-Q", ",".join(queues),
        "-n", f"{name}@%h", "--without-gossip", "--without-mingle", "--without-heartbeat",
    ]  # fmt: skip

"""Command lines of the project's processes, shared by `standalone`, the tests and bench/."""

import sys


def worker_argv(
    *,
    name: str,
    concurrency: int,
    queues: list[str],
    loglevel: str = "INFO",
    extra: tuple[str, ...] = (),
) -> list[str]:
    """A Celery worker consuming `queues` (and the lanes of each configured one, which the
    worker adds itself: scheduler_project/celery.py), with any extra options.

    Gossip and mingle are off: the scheduler keeps its state in PostgreSQL and uses neither.
    Worker heartbeats stay on: without their timer, a solo-pool worker was measured to stall
    10 s between deliveries (docs/celery-settings.md)."""
    return [
        sys.executable, "-m", "celery", "-A", "scheduler_project", "worker",
        f"--loglevel={loglevel}", f"--concurrency={concurrency}", "-Q", ",".join(queues),
        "-n", f"{name}@%h", "--without-gossip", "--without-mingle", *extra,
    ]  # fmt: skip

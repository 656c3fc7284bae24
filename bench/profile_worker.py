"""Profile of the worker path: one Celery worker (`--pool=solo`, so every task runs in the
profiled main thread) under cProfile, over `--jobs` runs of a no-op job.

    .venv/bin/python -m bench.profile_worker --jobs 2000 --output var/bench/profile.txt

A real scheduler and relay feed it (a fresh database and vhost, dropped afterwards); the
jobs are due at one instant, so the worker is never idle for long. Prints, per run, how
often the worker's path does what costs time outside Python (statements, connections, commits,
threads), then the top functions by cumulative and by own time. The lease keeper's and log
shipper's threads are not profiled (cProfile follows one thread): their cost shows as the
statements and time of the threads they start, not inside them.
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import pstats
import subprocess
import sys
import time
from pathlib import Path

from bench.common import (
    ROOT,
    Stack,
    bench_environment,
    create_due_burst,
    create_once_jobs,
)

# (label, path suffix of the file, function name): counted per run.
COUNTED = [
    ("SQL statements (Django cursor execute)", "django/db/backends/utils.py", "_execute"),
    ("new database connections", "django/db/backends/base/base.py", "connect"),
    ("connections closed", "django/db/backends/base/base.py", "close"),
    ("commits (Django)", "django/db/backends/base/base.py", "commit"),
    ("atomic blocks entered", "django/db/transaction.py", "__enter__"),
    ("savepoints", "django/db/backends/base/base.py", "savepoint"),
    ("psycopg waits (about one per round trip)", "psycopg/connection.py", "wait"),
    ("threads started", "threading.py", "start"),
    ("task executions (Celery trace)", "celery/app/trace.py", "trace_task"),
]


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.profile_worker",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--top", type=int, default=45)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--output", type=Path, default=None, help="also write the text here")
    parser.add_argument("--from-prof", type=Path, default=None,
                        help="only report on this saved profile (of --jobs runs)")  # fmt: skip
    args = parser.parse_args()
    if args.from_prof:
        text = report(args.from_prof, runs=args.jobs + 2, wall=None, top=args.top)
        print(text)
        if args.output:
            args.output.write_text(text)
        return
    # The Stack's options: one scheduler and one relay feed the profiled worker.
    stack_args = argparse.Namespace(
        schedulers=1, relays=1, scheduler_args="", relay_args="", workers=0
    )
    with bench_environment("bench_profile", task_modules="tests.sample_tasks") as (env, workdir):
        out, wall = profile(args, stack_args, env, workdir)
        text = report(out, runs=args.jobs + 2, wall=wall, top=args.top)
        if args.output:
            saved = args.output.with_suffix(".prof")
            saved.write_bytes(out.read_bytes())
            print(f"profile saved: {saved} (python -m bench.profile_worker --from-prof reads it)")
    print(text)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text)
        print(f"written: {args.output}")


def profile(args, stack_args, env: dict, workdir: Path) -> tuple[Path, float]:
    """Runs the profiled worker over the burst: (the profile file, due -> last success)."""
    from dispatch.commands import worker_argv
    from jobs.models import Run, RunState

    out = workdir / "worker.prof"
    argv = worker_argv(
        name="profiled", concurrency=1, queues=["jobs"], loglevel="WARNING", extra=("--pool=solo",)
    )
    assert argv[1:3] == ["-m", "celery"], argv
    argv = [sys.executable, "-m", "cProfile", "-o", str(out), *argv[1:]]
    with Stack(stack_args, env, workdir, label="profile") as stack:
        stack.start(workers=False)
        log = open(workdir / "profile-worker.log", "ab")  # noqa: SIM115
        worker = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            create_once_jobs("warmup", 2, dt.datetime.now(dt.UTC))
            due = create_due_burst("profile", args.jobs, min_lead=5)
            began = time.monotonic()
            deadline = began + args.timeout
            succeeded = 0
            while succeeded < args.jobs + 2:
                if time.monotonic() > deadline or worker.poll() is not None:
                    raise SystemExit(f"profiled worker: {succeeded} runs; see {workdir}")
                time.sleep(0.5)
                succeeded = Run.objects.filter(state=RunState.SUCCEEDED).count()
            wall = (dt.datetime.now(dt.UTC) - due).total_seconds()
        finally:
            worker.terminate()
            worker.wait(timeout=120)
            log.close()
    return out, wall


def report(out: Path, *, runs: int, wall: float | None, top: int) -> str:
    stats = pstats.Stats(str(out))
    rate = "reported from a saved profile"
    if wall:
        rate = f"due -> last success {wall:.1f}s ({runs / wall:.1f} runs/s under the profiler)"
    text = io.StringIO()
    text.write(
        f"Worker-path profile: one worker, --pool=solo, cProfile, {runs} runs of tests.record\n"
        f"(a no-op that appends one line to a file when SAMPLE_TASK_RECORD is set; unset here).\n"
        f"Taken {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC by bench.profile_worker on "
        f"{git_commit()};\n{rate}. Machine: 2 "
        f"cores shared with other sessions (noisy);\nthe counts per run are exact, the times "
        f"are not.\n\n"
    )
    text.write(f"Per run (calls / {runs} runs), the worker's main thread:\n")
    for label, suffix, name in COUNTED:
        calls = sum(
            stat[1]  # primitive calls
            for (path, _line, function), stat in stats.stats.items()
            if path.endswith(suffix) and function == name
        )
        text.write(f"  {label:42s} {calls / runs:8.2f}\n")
    text.write(f"\nProfile total {stats.total_tt:.1f}s; per run {1000 * stats.total_tt / runs:.2f}")
    text.write(" ms (includes the worker's start and idle waits)\n\n")
    text.write(task_path(stats, runs=runs, top=top))
    for order, count in (("cumulative", 30), ("tottime", 30)):
        buffer = io.StringIO()
        pstats.Stats(str(out), stream=buffer).sort_stats(order).print_stats(count)
        body = buffer.getvalue()
        body = body[body.find("   ncalls") :] if "   ncalls" in body else body
        text.write(f"Whole process, top {count} by {order} time (pstats):\n{short(body)}\n")
    return text.getvalue()


def short(text: str) -> str:
    """Paths relative to site-packages, the standard library or the repository."""
    for prefix in (*sorted(set(sys.path) - {""}, key=len, reverse=True), str(ROOT)):
        text = text.replace(prefix.rstrip("/") + "/", "")
    return text


def task_path(stats: pstats.Stats, *, runs: int, top: int) -> str:
    """The top functions by cumulative time among those Celery's trace of a task calls,
    directly or not (what one delivery costs once the worker has it), per run."""
    children: dict = {}
    for key, (*_counts, callers) in stats.stats.items():
        for caller in callers:
            children.setdefault(caller, set()).add(key)
    roots = [key for key in stats.stats if key[0].endswith("celery/app/trace.py")]
    roots = [key for key in roots if key[2] == "trace_task"]
    task = max((stats.stats[key][3] for key in roots), default=0.0)
    reached, frontier = set(roots), list(roots)
    while frontier:
        for child in children.get(frontier.pop(), ()):
            # One also called outside the task (exec, next() into the event loop) can total
            # more than the task itself: neither it nor what it calls is the task's cost.
            if child not in reached and stats.stats[child][3] <= task * 1.0001:
                reached.add(child)
                frontier.append(child)
    # Those called less than once every other run are the worker's start, not the path.
    reached = {key for key in reached if stats.stats[key][1] >= runs / 2}
    below = sorted(reached, key=lambda key: stats.stats[key][3], reverse=True)[:top]
    lines = [
        f"The task path: top {top} functions by cumulative time among those celery's "
        f"trace_task calls ({1000 * task / runs:.2f} ms per run), per run (cumulative and "
        f"own times count every call, from inside the task or not):",
        f"{'calls':>8} {'cum ms':>8} {'own ms':>8}  function",
    ]
    for key in below:
        path, line, function = key
        _cc, calls, own, cumulative, _callers = stats.stats[key]
        where = short(f"{path}:{line}({function})") if line else function
        lines.append(
            f"{calls / runs:8.2f} {1000 * cumulative / runs:8.3f} {1000 * own / runs:8.3f}  {where}"
        )
    return "\n".join(lines) + "\n\n"


def git_commit() -> str:
    """HEAD, and the last commit that changed the product (anything outside bench/)."""

    def last(*paths: str) -> str:
        result = subprocess.run(["git", "log", "-1", "--format=%h", "--", *paths], cwd=ROOT,
                                capture_output=True, text=True)  # fmt: skip
        return result.stdout.strip() or "unknown"

    return f"{last()} (product code as of {last('.', ':!bench', ':!README.md')})"


if __name__ == "__main__":
    main()

"""The benchmark harness: every workload of docs/benchmarks.md, on the real stack, in one command.

    .venv/bin/python -m bench.run w1 --jobs 10000     # burst: N one-time jobs due at once
    .venv/bin/python -m bench.run w1 --owners 8 --api # the same, 8 owners, created through the API
    .venv/bin/python -m bench.run w2 --jobs 1000 --minutes 3   # steady cron, every minute
    .venv/bin/python -m bench.run w3                  # W1 1,000 behind 200,000 future jobs
    .venv/bin/python -m bench.run claim --jobs 10000  # scheduler + relay only, no workers
    .venv/bin/python -m bench.run precision           # one job at a time, 100 trials
    .venv/bin/python -m bench.run bare --jobs 10000   # bare Celery alone
    .venv/bin/python -m bench.run all                 # each of the above once, in turn

Each invocation makes a fresh PostgreSQL database and RabbitMQ vhost (dropped afterwards)
and starts real scheduler, relay and Celery worker processes (`--schedulers`, `--relays`,
`--workers`, `--concurrency`, `--pool`). W1 also drains as many no-op tasks through bare
Celery (bench.bare_celery: same broker, pool, workers and concurrency, late acks) in
the same run, and prints the ratio; W2 drains as many as a minute boundary has, and puts
each boundary's p99 lateness beside it: on a shared, noisy machine the ratio is the figure to
quote. `--repeat K` runs everything K times and reports medians. Prints a table and writes
everything measured to var/bench/<UTC timestamp>.json (`--output` to choose).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
from pathlib import Path

from bench.common import bench_environment, ratio, results_header, results_path

# Per workload, the defaults that differ from the common ones (`--jobs` mostly).
DEFAULT_JOBS = {"w1": 10_000, "w2": 1_000, "w3": 1_000, "claim": 10_000, "bare": 10_000}
ALL = ["w1", "w2", "w3", "claim", "precision"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.run",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("workload", choices=[*DEFAULT_JOBS, "precision", "all"])
    p.add_argument("--jobs", type=int, help="jobs per workload (w1/claim/bare 10000, w2/w3 1000)")
    p.add_argument("--minutes", type=int, default=3, help="W2: minute boundaries measured")
    p.add_argument("--future", type=int, default=200_000, help="W3: future jobs behind W1")
    p.add_argument("--trials", type=int, default=100, help="precision: trials")
    p.add_argument("--precision-lead", type=float, default=1.0, help="precision: seconds to due")
    p.add_argument("--schedulers", type=int, default=2)
    p.add_argument("--relays", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--pool", default="prefork", help="the Celery pool: prefork, threads, solo")
    p.add_argument("--worker-args", default="", help='more worker options, e.g. "-O fair"')
    p.add_argument("--scheduler-args", default="", help='e.g. "--poll-interval 0.5"')
    p.add_argument("--relay-args", default="", help='e.g. "--batch-size 500"')
    p.add_argument("--bare-acks", choices=["late", "early"], default="late",
                   help="bare Celery's acknowledgement (the product acks early)")  # fmt: skip
    p.add_argument("--lead", type=float, default=5.0,
                   help="least seconds between creating a burst and its due instant "
                        "(raised to cover the measured creation time)")  # fmt: skip
    p.add_argument(
        "--owners",
        type=int,
        default=1,
        help="W1/W3: owners the burst's jobs are shared among (bench-1 .. bench-N)",
    )
    p.add_argument(
        "--api",
        action="store_true",
        help="W1/W3: create the burst through POST /api/v1/jobs/bulk/ of a web "
        "process (gunicorn), a client per owner, all at once",
    )
    p.add_argument("--web-workers", type=int, default=2, help="--api: gunicorn workers")
    p.add_argument("--bulk-size", type=int, default=250, help="--api: jobs a request")
    p.add_argument("--timeout", type=float, default=900, help="seconds a workload may take")
    p.add_argument("--repeat", type=int, default=1, help="run K times, report medians")
    p.add_argument(
        "--task",
        default="tests.record",
        help="the task scheduled: tests.record, or tests.record_packed (pack=20)",
    )
    p.add_argument("--output", type=Path, default=None, help="the JSON file to write")
    return p


# Integrity counts: across repetitions the worst one is reported, never a median.
WORST = {"missing", "doubled", "missed", "duplicate_deliveries", "runs_with_several_attempts"}


def median_tree(results: list, key: str = ""):
    """The median of every number across repetitions (the worst for integrity counts),
    keeping the shape of one result (lists, such as W2's boundaries, are kept from the
    first repetition; the JSON holds every repetition)."""
    first = results[0]
    if key == "cpu_seconds" and all(isinstance(r, dict) for r in results):
        # A role (a connection of psql or autovacuum) can be absent from a repetition: 0 s.
        roles = sorted({role for r in results for role in r})
        return {role: statistics.median(r.get(role, 0.0) for r in results) for role in roles}
    if isinstance(first, dict):
        return {k: median_tree([r.get(k) if r else None for r in results], k) for k in first}
    numbers = [r for r in results if isinstance(r, int | float) and not isinstance(r, bool)]
    if numbers and len(numbers) == len(results):
        if key in WORST:
            return max(numbers)
        if all(isinstance(n, int) for n in numbers):
            return statistics.median_low(numbers)
        return statistics.median(numbers)
    if all(isinstance(r, bool) for r in results):
        return any(results)  # timed_out: in any repetition
    return first


def fmt(value, unit: str = "") -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.3f}{unit}" if abs(value) < 10 else f"{value:.1f}{unit}"
    return f"{value}{unit}"


def rows(name: str, r: dict) -> list[tuple[str, str, str, str, str]]:
    """(figure, product, bare Celery, ratio, target) for the table."""
    if name == "w1":
        b = r["bare"]
        out = [
            ("W1 last start after due", fmt(r["last_start"], "s"), fmt(b["last_start"], "s"),
             fmt(r["last_start_ratio"], "x"), "<= 1.15x"),
            ("W1 lateness p50 / p99", f"{fmt(r['lateness']['p50'])} / {fmt(r['lateness']['p99'])}",
             "", "", ""),
            ("sustained throughput", fmt(r["throughput"], "/s"), fmt(b["throughput"], "/s"),
             fmt(r["throughput_ratio"], "x"), ">= 0.9x"),
        ]  # fmt: skip
        out += _stage_rows(r["stages"])
        out += _cpu_rows(r.get("cpu_seconds"), b.get("cpu_seconds"))
        out.append(_integrity_row("W1", r))
        return out
    if name == "w2":
        out = []
        for b in r["boundaries"]:
            at = b["boundary"][11:16]
            out.append((f"W2 {at} p99 lateness (missed, doubled)",
                        f"{fmt(b['lateness']['p99'], 's')} ({b['missed']}, {b['doubled']})",
                        fmt(r["bare"]["last_start"], "s"), fmt(b.get("p99_ratio"), "x"),
                        "<= 1.15x @1000, <= 1.3x @5000"))  # fmt: skip
            out += _stage_rows(b.get("stages", {}))
        out.append(
            (
                "W2 worst p99 / bare drain",
                fmt(r["worst_p99"], "s"),
                fmt(r["bare"]["last_start"], "s"),
                fmt(r["worst_p99_ratio"], "x"),
                "",
            )
        )
        out.append(("W2 missed / doubled", f"{r['missed']} / {r['doubled']}", "", "", "0 / 0"))
        return out
    if name == "w3":
        return [
            (f"W3 last start, {r['future_jobs']} future", fmt(r["behind"]["last_start"], "s"),
             "", fmt(r["last_start_ratio"], "x"), "< 1.10x"),
            ("W3 last start, none behind", fmt(r["without"]["last_start"], "s"), "", "", ""),
            _integrity_row("W3 behind", r["behind"]),
        ]  # fmt: skip
    if name == "claim":
        return [
            ("claim-to-broker", fmt(r["runs_per_second"], "/s"), "", "", ">= 10000/s"),
            ("  due -> all created + confirmed", fmt(r["seconds"], "s"), "", "", ""),
            ("  runs / in broker / doubled",
             f"{r['runs']} / {r['in_broker']} / {r['doubled']}", "", "", ""),
        ]  # fmt: skip
    if name == "precision":
        s = r["lateness"]
        out = [
            (f"precision p50 / p99 ({r['trials']} trials)",
             f"{fmt(s['p50'], 's')} / {fmt(s['p99'], 's')}", "", "", "p99 <= 0.050s"),
        ]  # fmt: skip
        out += _stage_rows(r["stages"])
        out.append(_integrity_row("precision", r))
        return out
    if name == "bare":
        drain = fmt(r["last_start"], "s")
        return [
            (
                "bare Celery drain / throughput",
                "",
                f"{drain} / {fmt(r['throughput'], '/s')}",
                "",
                "",
            )
        ]
    return []


def _stage_rows(stages: dict) -> list[tuple]:
    """A row per stage of a run's path (due -> created -> published -> started -> finished)."""
    return [
        (f"  {stage} p50 / p99", f"{fmt(s['p50'])} / {fmt(s['p99'])}", "", "", "")
        for stage, s in stages.items()
    ]


def _cpu_rows(product: dict | None, bare: dict | None) -> list[tuple]:
    """CPU seconds from the end of the burst's creation to its last run's end (bare Celery:
    from the first publish to the last start), all roles, then each."""
    if not product:
        return []
    bare = bare or {}
    total, bare_total = sum(product.values()), sum(bare.values()) if bare else None
    out = [("CPU seconds, every process", fmt(total, "s"), fmt(bare_total, "s"),
            fmt(ratio(total, bare_total), "x"), "")]  # fmt: skip
    for role in sorted(set(product) | set(bare)):
        out.append((f"  CPU {role}", fmt(product.get(role), "s"), fmt(bare.get(role), "s"), "", ""))
    return out


def _integrity_row(label: str, r: dict) -> tuple[str, str, str, str, str]:
    return (f"{label} runs / missing / doubled / dup. deliveries",
            f"{r['runs']} / {r['missing']} / {r['doubled']} / {r['duplicate_deliveries']}",
            "", "", "none missing or doubled")  # fmt: skip


def print_table(results: dict) -> None:
    table = [("figure", "product", "bare Celery", "ratio", "target")]
    for name, result in results.items():
        table.extend(rows(name, result["median"]))
    widths = [max(len(row[i]) for row in table) for i in range(5)]
    for index, row in enumerate(table):
        cells = (cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        print("  ".join(cells).rstrip())
        if index == 0:
            print("  ".join("-" * width for width in widths))


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    os.environ["BENCH_TASK"] = args.task  # read by bench.common.bench_task
    names = ALL if args.workload == "all" else [args.workload]
    started = dt.datetime.now(dt.UTC)
    output = args.output or results_path(started)
    document = {
        **results_header(args, started),
        "results": {},
    }
    from bench.workloads import WORKLOADS

    try:
        with bench_environment("bench", task_modules="tests.sample_tasks") as (env, workdir):
            print(f"work directory (process logs): {workdir}")
            for name in names:
                args.jobs = document["options"]["jobs"] or DEFAULT_JOBS.get(name)
                reps = []
                for rep in range(args.repeat):
                    print(f"{name} ({rep + 1}/{args.repeat}) ...", flush=True)
                    reps.append(WORKLOADS[name](args, env, workdir))
                    document["results"][name] = {
                        "jobs": args.jobs,
                        "median": median_tree(reps),
                        "repetitions": reps,
                    }
                    write(document, output)  # each repetition is kept, whatever follows
    except BaseException as exc:
        document["error"] = repr(exc)
        raise
    finally:
        write(document, output)
        print_table(document["results"])
        print(f"written: {output}")
    return document


def write(document: dict, output: Path) -> None:
    document["finished"] = dt.datetime.now(dt.UTC).isoformat()
    document["host"]["load_average_after"] = os.getloadavg()
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(document, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()

"""Clock skew: every scheduler, relay and worker process records the skew between its clock
and the database's (`jobs.clock.clock_skew_record`) every `poll_interval`, so /metrics
exports `scheduler_clock_skew_seconds` per process (docs/scale.md). Nothing compares
instants on a process's clock (leases, due times and heartbeats use the database's); the
metric shows an operator the host whose clock drifted."""

from __future__ import annotations

import dataclasses
import datetime as dt
import threading

from jobs.clock import CLOCK_SKEW_EXPIRY, clock_skew_record

from .config import config_require
from .loop import StopSignal, run_loop, run_once_step

PROCESS_KINDS = ("scheduler", "relay", "worker")


@dataclasses.dataclass(frozen=True)
class ClockSkewConfig:
    kind: str
    name: str = ""
    poll_interval: float = 10.0  # well within CLOCK_SKEW_EXPIRY: a live process never expires

    def __post_init__(self) -> None:
        config_require(self, positive=("poll_interval",))
        if self.kind not in PROCESS_KINDS:
            raise ValueError(
                f"ClockSkewConfig.kind must be one of {PROCESS_KINDS}, not {self.kind!r}"
            )
        if self.poll_interval * 3 > CLOCK_SKEW_EXPIRY.total_seconds():
            raise ValueError("ClockSkewConfig.poll_interval must be under a third of the expiry")


@dataclasses.dataclass(frozen=True)
class ClockSkewResult:
    skew_seconds: float


def clock_skew_run_once(*, now: dt.datetime, config: ClockSkewConfig) -> ClockSkewResult:
    return ClockSkewResult(skew_seconds=clock_skew_record(kind=config.kind, name=config.name))


def clock_skew_thread(config: ClockSkewConfig, stop: StopSignal) -> threading.Thread:
    """The loop of this process's measurements, in a daemon thread (not started)."""
    step = run_once_step(clock_skew_run_once, config)
    return threading.Thread(
        target=run_loop, args=(step,), kwargs={"name": "clock-skew", "stop": stop},
        name="clock-skew", daemon=True,
    )  # fmt: skip

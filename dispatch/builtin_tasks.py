"""Tasks every installation has, so that a new system can be tried and probed at once."""

import time

from .registry import job_task


@job_task(name="scheduler.echo")
def echo(ctx, *args, **kwargs):
    """Logs and returns its arguments: a smoke test of the whole pipeline."""
    ctx.logger.info(
        "echo run %s attempt %s: args=%r kwargs=%r", ctx.run_id, ctx.attempt, args, kwargs
    )
    return {"args": list(args), "kwargs": kwargs}


@job_task(name="scheduler.sleep")
def sleep(ctx, seconds: float = 1.0):
    """Sleeps, stopping early when the run is cancelled or its lease is lost."""
    deadline = time.monotonic() + float(seconds)
    while time.monotonic() < deadline and not ctx.cancel_requested:
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
    return {"slept": seconds, "stopped_early": time.monotonic() < deadline}

"""The client project's tasks: registered with `job_task`, found by the worker through
SCHEDULER_TASK_MODULES=myteam.tasks (see ../README.md)."""

from dispatch import job_task


@job_task(name="myteam.report")
def report(ctx, title, recipients=()):
    ctx.logger.info("building %s for %d recipients", title, len(recipients))
    return {"title": title, "sent": len(recipients)}


@job_task(name="myteam.cleanup")
def cleanup(ctx, older_than_days=30):
    for step in range(3):
        if ctx.cancel_requested:
            return {"stopped_at": step}
        ctx.logger.info("cleanup step %d (older than %d days)", step, older_than_days)
        ctx.heartbeat()
    return {"removed": 0}


@job_task(name="myteam.ping", pack=20)
def ping(ctx):
    return "pong"

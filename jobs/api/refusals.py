"""Why an operator action changed nothing: one wording for the API's 409 and the admin's
messages, by action, formatted with the object's state as read after the refusal."""

REFUSALS = {
    "job.pause": "only an active job can be paused, not a {state} one",
    "job.resume": "only a paused job can be resumed, not a {state} one",
    "job.cancel": "a {state} job cannot be cancelled",
    "job.trigger": "a {state} job cannot be triggered",
    "job.backfill": "a {state} job cannot be backfilled",
    "job.change": "a {state} job cannot be changed",
    "run.cancel": "a {state} run cannot be cancelled",
    "run.replay": "only a failed or cancelled run can be replayed, not a {state} one",
}


def refusal(action: str, *, state: str) -> str:
    return REFUSALS[action].format(state=state)


def schedule_refusal(error: Exception) -> str:
    """A resume refused because the job's schedule cannot be evaluated any more."""
    return (
        f"the job's schedule cannot be evaluated ({error}); PATCH its schedule (or edit it "
        "on its admin page) first, then resume"
    )

"""The invariant checker: reads the database after a fault run and lists every violation."""

from __future__ import annotations

from collections import Counter as Tally
from collections import defaultdict

from jobs.models import Attempt, AttemptState, Counter, Effect, Run, RunKind, RunState
from jobs.transitions import TERMINAL_RUN_STATES
from tests.fault_tasks import EFFECT_COUNTER, effect_labels


def invariant_violations(*, effect_name: str = "work") -> list[str]:
    """Empty when every promise held; otherwise one line per broken promise."""
    problems: list[str] = []
    runs = list(Run.objects.all())
    attempts: dict = defaultdict(list)
    for attempt in Attempt.objects.order_by("run_id", "number"):
        attempts[attempt.run_id].append(attempt)
    effects = Tally(Effect.objects.filter(name=effect_name).values_list("run_id", flat=True))
    commits = dict(Counter.objects.filter(name=EFFECT_COUNTER).values_list("labels", "value"))

    occurrences = Tally((r.job_id, r.scheduled_for) for r in runs if r.kind == RunKind.SCHEDULED)
    problems += [f"occurrence {key} has {n} runs" for key, n in occurrences.items() if n > 1]
    for run in runs:
        mine = attempts[run.id]
        if run.state not in TERMINAL_RUN_STATES:
            problems.append(f"run {run.id} is not terminal: {run.state}")
        succeeded = [a for a in mine if a.state == AttemptState.SUCCEEDED]
        if len(succeeded) > 1:
            problems.append(f"run {run.id} has {len(succeeded)} succeeded attempts")
        if run.state == RunState.SUCCEEDED and len(succeeded) != 1:
            problems.append(f"succeeded run {run.id} has {len(succeeded)} succeeded attempts")
        tokens = [a.fencing_token for a in mine]
        if tokens != sorted(set(tokens)):
            problems.append(f"run {run.id} fencing tokens not strictly increasing: {tokens}")
        if mine and run.fencing_token != tokens[-1]:
            problems.append(
                f"run {run.id} token {run.fencing_token} != last attempt's {tokens[-1]}"
            )
        if [a.number for a in mine] != list(range(1, len(mine) + 1)):
            problems.append(f"run {run.id} attempt numbers {[a.number for a in mine]}")
        committed = commits.get(effect_labels(run.id), 0)
        if committed > 1 or effects[run.id] > 1:
            problems.append(f"run {run.id} effect committed {committed} times")
        if run.state == RunState.SUCCEEDED and (committed != 1 or effects[run.id] != 1):
            problems.append(f"succeeded run {run.id}: effect committed {committed} times")
    return problems

# The metrics the database keeps as the events commit (storage.tallies; docs/operations.md,
# "Metrics"): the triggers append to jobs_tally_delta, which the pruner rolls up into
# jobs_tally; the stage histograms and the attempts by outcome (row triggers), the runs by
# state and the outbox backlog (statement triggers, started from the rows already there);
# the failed runs, as they fail (scheduler_dead_letter_total).

from django.db import migrations

from storage.tallies import DEAD_LETTER_TALLY, STAGE_HISTOGRAMS, STATE_TALLIES


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0001_jobs_runs_attempts"),
    ]

    operations = [
        STAGE_HISTOGRAMS.operation(),
        STATE_TALLIES.operation(),
        DEAD_LETTER_TALLY.operation(),
    ]

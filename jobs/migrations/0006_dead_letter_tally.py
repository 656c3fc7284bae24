# scheduler_dead_letter_total counted as each run ends failed (storage.tallies.DEAD_LETTER_TALLY),
# started from the failed runs there and those retention deleted.

from django.db import migrations

from storage.tallies import DEAD_LETTER_TALLY


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0005_backfilled_occurrences"),
    ]

    operations = [
        DEAD_LETTER_TALLY.operation(),
    ]

# Job completion's rule (storage.completion): the SQL function that completes a job whose
# schedule is over once none of its runs is active, and the trigger that calls it in the
# statement that ends a run (dispatch.completer calls it too, as the safety net).

from django.db import migrations

from storage.completion import JOB_COMPLETION


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0002_tally_triggers"),
    ]

    operations = [
        JOB_COMPLETION.operation(),
    ]

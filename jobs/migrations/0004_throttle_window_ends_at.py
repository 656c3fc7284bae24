# The throttle windows are read on the database's clock and kept until they end
# (storage.throttle): each row holds its window's end, indexed for the pruner, instead of
# a window number a row alone could not date. The rows are counts of windows in progress:
# dropping them starts every count over, at most once.

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0003_job_completion_trigger"),
    ]

    operations = [
        migrations.RunSQL("DELETE FROM jobs_throttle_window", migrations.RunSQL.noop),
        migrations.RemoveField(model_name="throttlewindow", name="bucket"),
        migrations.AddField(
            model_name="throttlewindow",
            name="window_ends_at",
            field=models.DateTimeField(),
        ),
        migrations.AddIndex(
            model_name="throttlewindow",
            index=models.Index(fields=["window_ends_at"], name="throttle_window_ends_idx"),
        ),
    ]

# When a pending outbox row's tries began to be refused in a way that lasts (dispatch.relay
# fails the run `undeliverable` only after a grace of such refusals). Nullable, no default:
# adding it rewrites no row.

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0006_dead_letter_tally"),
    ]

    operations = [
        migrations.AddField(
            model_name="outboxmessage",
            name="refused_since",
            field=models.DateTimeField(blank=True, null=True),
        ),
    ]

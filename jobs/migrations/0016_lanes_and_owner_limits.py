"""What the relay publishes, when, and in what order: the pending outbox indexed by (queue,
owner, priority, id) for claims per queue (backpressure) and per owner (fair shares); each
outbox row's owner; operators' per-owner limits (OwnerLimit) and the runs that count
against a limited owner (ActiveRun)."""

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models

# The owner of the rows written before this migration, from their run's job.
FILL_OWNERS = """
UPDATE dispatch_outboxmessage SET owner_id = (
    SELECT job.owner_id FROM jobs_run AS run JOIN jobs_job AS job ON job.id = run.job_id
     WHERE run.id = dispatch_outboxmessage.run_id
)
"""


class Migration(migrations.Migration):

    dependencies = [
        ('jobs', '0015_partition_leases'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.RemoveIndex(
            model_name='outboxmessage',
            name='outbox_pending_idx',
        ),
        migrations.AddField(
            model_name='outboxmessage',
            name='owner',
            field=models.ForeignKey(db_index=False, null=True, on_delete=django.db.models.deletion.CASCADE, related_name='+', to=settings.AUTH_USER_MODEL),
        ),
        migrations.RunSQL(FILL_OWNERS, migrations.RunSQL.noop),
        migrations.AlterField(
            model_name='outboxmessage',
            name='owner',
            field=models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='+', to=settings.AUTH_USER_MODEL),
        ),
        migrations.AddIndex(
            model_name='outboxmessage',
            index=models.Index(condition=models.Q(('state', 'pending')), fields=['queue', 'owner', '-priority', 'id'], name='outbox_pending_idx'),
        ),
        migrations.CreateModel(
            name='OwnerLimit',
            fields=[
                ('owner', models.OneToOneField(on_delete=django.db.models.deletion.CASCADE, primary_key=True, related_name='run_limit', serialize=False, to=settings.AUTH_USER_MODEL)),
                ('max_active_runs', models.PositiveIntegerField(blank=True, help_text='Runs of this owner in the broker or running at once; empty: unlimited.', null=True)),
                ('updated_at', models.DateTimeField(auto_now=True)),
            ],
        ),
        migrations.CreateModel(
            name='ActiveRun',
            fields=[
                ('run', models.OneToOneField(on_delete=django.db.models.deletion.CASCADE, primary_key=True, related_name='+', serialize=False, to='jobs.run')),
                ('published_at', models.DateTimeField()),
                ('owner', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='+', to=settings.AUTH_USER_MODEL)),
            ],
        ),
    ]

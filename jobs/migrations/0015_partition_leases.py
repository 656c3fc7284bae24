"""Partition leases of scheduler replicas (dispatch.partitions, docs/architecture.md,
"Partitions"): one row per held partition, one per live replica. Both tables stay as small
as the partition count and the number of replicas."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('jobs', '0014_run_indexes_no_query_needs'),
    ]

    operations = [
        migrations.CreateModel(
            name='PartitionLease',
            fields=[
                ('partition', models.PositiveIntegerField(primary_key=True, serialize=False)),
                ('holder', models.CharField(max_length=200)),
                ('expires_at', models.DateTimeField()),
                ('acquired_at', models.DateTimeField()),
            ],
            options={
                'db_table': 'jobs_partition_lease',
            },
        ),
        migrations.CreateModel(
            name='SchedulerReplica',
            fields=[
                ('holder', models.CharField(max_length=200, primary_key=True, serialize=False)),
                ('expires_at', models.DateTimeField()),
                ('joined_at', models.DateTimeField()),
                ('session_pid', models.IntegerField(blank=True, null=True)),
                ('session_started_at', models.DateTimeField(blank=True, null=True)),
            ],
            options={
                'db_table': 'jobs_scheduler_replica',
            },
        ),
    ]

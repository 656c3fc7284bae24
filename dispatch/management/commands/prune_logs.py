"""`python manage.py prune_logs [--days N]`: prune run logs past retention, batch by batch
(`logs_app.retention.logs_prune` until nothing is left, bounded)."""

from django.core.management.base import BaseCommand, CommandError

from jobs.clock import db_now
from logs_app.retention import logs_prune

MAX_BATCHES = 10_000  # a bound, so that a pruner racing endless new expiries still stops


class Command(BaseCommand):
    help = "Delete the logs (chunks, stored content, manifests) of attempts past retention."

    def add_arguments(self, parser):
        parser.add_argument(
            "--days",
            type=int,
            default=None,
            help="Retention in days (default SCHEDULER_LOG_RETENTION_DAYS).",
        )
        parser.add_argument("--batch-size", type=int, default=1000)

    def handle(self, *args, days, batch_size, **options):
        if days is not None and days < 0:
            raise CommandError("--days must be 0 or more")
        now = db_now()
        total = 0
        for _ in range(MAX_BATCHES):
            deleted = logs_prune(now=now, retention_days=days, batch_size=batch_size)
            total += deleted
            if not deleted:
                break
        else:
            self.stderr.write(f"stopped after {MAX_BATCHES} batches; run it again")
        self.stdout.write(f"pruned {total} log chunks and manifests")

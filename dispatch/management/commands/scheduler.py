import threading

from django.conf import settings
from django.core.management.base import BaseCommand

from dispatch.loop import StopSignal, run_loop
from dispatch.reaper import OutageGrace, ReaperConfig, reaper_run_once
from dispatch.reconcile import BrokerQueueDepth, ReconcileConfig, reconcile_run_once
from dispatch.scheduler import SchedulerConfig, scheduler_run_once, scheduler_sleep_seconds
from jobs.clock import db_now


class Command(BaseCommand):
    help = (
        "Run one scheduler replica: turns due occurrences and retries into queued runs, and "
        "runs the reaper (expired leases, timeouts) and reconciliation loops beside it."
    )

    def add_arguments(self, parser):
        parser.add_argument("--batch-size", type=int, default=SchedulerConfig.batch_size)
        parser.add_argument("--poll-interval", type=float, default=SchedulerConfig.poll_interval)
        parser.add_argument("--max-steps", type=int, default=None, help="stop after N steps")
        parser.add_argument(
            "--without-reaper", action="store_true", help="run no reaper loop in this process"
        )
        parser.add_argument(
            "--without-reconciler",
            action="store_true",
            help="run no reconciliation loop in this process",
        )
        parser.add_argument(
            "--reconcile-interval", type=float, default=ReconcileConfig.poll_interval
        )
        parser.add_argument(
            "--queued-after",
            type=float,
            default=ReconcileConfig.queued_after_seconds,
            help="seconds after which a published, unclaimed run is published again",
        )

    def handle(self, *args, **options):
        stop = StopSignal().install()
        loops = [threading.Thread(target=self.scheduler_loop, args=(stop, options), daemon=True)]
        if not options["without_reaper"]:
            loops.append(threading.Thread(target=self.reaper_loop, args=(stop,), daemon=True))
        if not options["without_reconciler"]:
            loops.append(
                threading.Thread(target=self.reconcile_loop, args=(stop, options), daemon=True)
            )
        self.stdout.write("scheduler started")
        for loop in loops:
            loop.start()
        # The scheduler loop ends on SIGTERM or after --max-steps; the others follow it.
        loops[0].join()
        stop.event.set()
        for loop in loops[1:]:
            loop.join(timeout=30)

    def scheduler_loop(self, stop: StopSignal, options: dict) -> None:
        config = SchedulerConfig(
            batch_size=options["batch_size"], poll_interval=options["poll_interval"]
        )

        def step() -> float:
            result = scheduler_run_once(now=db_now(), config=config)
            if result.batch_full:
                return 0.0
            return scheduler_sleep_seconds(now=db_now(), config=config)

        run_loop(step, name="scheduler", stop=stop, max_steps=options["max_steps"])

    def reaper_loop(self, stop: StopSignal) -> None:
        config = ReaperConfig()
        grace = OutageGrace(config.recovery_grace_seconds)

        def step() -> float:
            now = db_now()  # fails while the database is away, which restarts the grace
            if not grace.ready():
                return config.poll_interval
            result = reaper_run_once(now=now, config=config)
            return 0.0 if result.batch_full else config.poll_interval

        run_loop(step, name="reaper", stop=stop, on_error=grace.outage)

    def reconcile_loop(self, stop: StopSignal, options: dict) -> None:
        config = ReconcileConfig(
            poll_interval=options["reconcile_interval"],
            queued_after_seconds=options["queued_after"],
        )
        depth = BrokerQueueDepth(
            settings.CELERY_BROKER_URL, settings.CELERY_BROKER_TRANSPORT_OPTIONS
        )

        def step() -> float:
            reconcile_run_once(now=db_now(), config=config, queue_depth=depth)
            return config.poll_interval

        try:
            run_loop(step, name="reconcile", stop=stop)
        finally:
            depth.close()

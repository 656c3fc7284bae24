"""`python manage.py scheduler`: one scheduler replica, a thread per loop.

The command only chooses the loops; each is `dispatch.loop.run_loop` around one concern's
`*_run_once` (see each module's docstring).
"""

import threading
from collections.abc import Callable

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db.backends.signals import connection_created

from dispatch.clockskew import ClockSkewConfig, clock_skew_run_once
from dispatch.loop import StopSignal, run_loop, run_once_step
from dispatch.partitions import PartitionKeeper, PartitionsConfig, replica_holder
from dispatch.pruner import PrunerConfig, pruner_run_once
from dispatch.reaper import OutageGrace, ReaperConfig, reaper_run_once
from dispatch.reconciler import (
    BrokerQueueDepth,
    ReconcileConfig,
    ReconcileWindow,
    reconcile_run_once,
)
from dispatch.scheduler import SchedulerConfig, SchedulerWake
from dispatch.wakeup import Listener
from dispatch.webhooks import WebhookConfig, webhook_deliveries_run_once
from jobs.notify import CHANNEL_PARTITIONS, CHANNEL_SCHEDULE, CHANNEL_WEBHOOKS
from storage.sessions import session_idle_in_transaction_timeout_set

# The maintenance loops (reaper, reconciliation, pruner, clock skew) run transactions of a
# few statements with nothing but Python between them: a session of theirs idle inside a
# transaction this long is a process frozen there (SIGSTOP, a paused VM), and PostgreSQL
# ends it, releasing the rows it locked (an attempt being reaped, its run). The scheduler
# loop is not bounded so (a catch-up pass may think long between statements): another
# replica ends its session when its membership expires (dispatch.partitions).
LOOP_IDLE_IN_TRANSACTION_SECONDS = 10
BOUNDED_LOOPS = ("reaper", "reconciler", "pruner", "clock-skew", "webhooks")


class Command(BaseCommand):
    help = (
        "Run one scheduler replica: turns due occurrences and retries into queued runs, and "
        "runs the reaper (expired leases, timeouts), reconciliation, pruning and webhook "
        "delivery loops beside it. "
        "It dispatches only the partitions whose lease it holds, kept by a loop of its own."
    )

    def add_arguments(self, parser):
        parser.add_argument("--batch-size", type=int, default=SchedulerConfig.batch_size)
        parser.add_argument("--poll-interval", type=float, default=SchedulerConfig.poll_interval)
        parser.add_argument("--max-steps", type=int, default=None, help="stop after N steps")
        parser.add_argument(
            "--partition-lease-seconds",
            type=float,
            default=None,
            help="how long a partition lease lasts unrenewed (renewed every third of it); "
            "default SCHEDULER_PARTITION_LEASE_SECONDS",
        )
        parser.add_argument(
            "--without-reaper", action="store_true", help="run no reaper loop in this process"
        )
        parser.add_argument(
            "--without-reconciler",
            action="store_true",
            help="run no reconciliation loop in this process",
        )
        parser.add_argument(
            "--without-pruner",
            action="store_true",
            help="run no pruning loop (finished runs, idempotency keys, run logs) in this process",
        )
        parser.add_argument(
            "--without-webhooks",
            action="store_true",
            help="post no webhook deliveries from this process",
        )
        parser.add_argument(
            "--reconcile-interval", type=float, default=ReconcileConfig.poll_interval
        )
        parser.add_argument(
            "--prune-interval",
            type=float,
            default=PrunerConfig.poll_interval,
            help="seconds between pruning steps (retention is in days: no hurry)",
        )
        parser.add_argument(
            "--queued-after",
            type=float,
            default=ReconcileConfig.queued_after_seconds,
            help="seconds after which a published, unclaimed run is published again",
        )

    def handle(self, *args, **options):
        stop = StopSignal().install()
        try:
            loops = self.loops(options, stop)
        except ValueError as exc:  # a Config refusing an option's value
            raise CommandError(str(exc)) from exc
        connection_created.connect(self._session_opened, weak=False)
        self.keeper.first_pass()  # alone, it dispatches every partition from its first pass
        self.stdout.write("scheduler started")
        for loop in loops:
            loop.start()
        # The scheduler loop ends on SIGTERM or after --max-steps; the others follow it.
        loops[0].join()
        stop.event.set()
        for loop in loops[1:]:
            loop.join(timeout=30)

    def loops(self, options: dict, stop: StopSignal) -> list[threading.Thread]:
        """The loops this process runs, by its options; ValueError for a value out of range."""
        lease = options["partition_lease_seconds"]
        partitions = PartitionsConfig(
            holder=replica_holder(),
            partitions=settings.SCHEDULER_PARTITIONS,
            lease_seconds=settings.SCHEDULER_PARTITION_LEASE_SECONDS if lease is None else lease,
        )
        self.keeper = PartitionKeeper(partitions, Listener((CHANNEL_PARTITIONS,), stop))
        scheduler = SchedulerConfig(
            batch_size=options["batch_size"],
            poll_interval=options["poll_interval"],
            scope=self.keeper.config.scope,
        )
        listener = Listener((CHANNEL_SCHEDULE,), stop)
        wake = SchedulerWake(scheduler, listener)
        loops = [
            self.loop(
                "scheduler",
                run_once_step(wake.run_once, scheduler, sleep=wake.sleep_seconds),
                stop,
                max_steps=options["max_steps"],
                wait=wake.wait,
                close=listener.close,
            )
        ]
        step = run_once_step(
            self.keeper.run_once, self.keeper.config, sleep=self.keeper.sleep_seconds
        )
        loops.append(
            self.loop("partitions", step, stop, wait=self.keeper.wait, close=self.keeper.close)
        )
        skew = ClockSkewConfig(kind="scheduler")
        loops.append(self.loop("clock-skew", run_once_step(clock_skew_run_once, skew), stop))
        if not options["without_reaper"]:
            reaper = ReaperConfig()
            grace = OutageGrace(reaper.recovery_grace_seconds)

            def reap(*, now, config):
                # The step read the database's clock first: an outage restarts the grace.
                return reaper_run_once(now=now, config=config) if grace.ready() else None

            loops.append(
                self.loop("reaper", run_once_step(reap, reaper), stop, on_error=grace.outage)
            )
        if not options["without_reconciler"]:
            reconcile = ReconcileConfig(
                poll_interval=options["reconcile_interval"],
                queued_after_seconds=options["queued_after"],
                queue_high_water=settings.SCHEDULER_QUEUE_HIGH_WATER,
                owner_max_active_runs=settings.SCHEDULER_OWNER_MAX_ACTIVE_RUNS,
            )
            depth = BrokerQueueDepth(
                settings.CELERY_BROKER_URL, settings.CELERY_BROKER_TRANSPORT_OPTIONS
            )
            # The loop's own walk over the queued runs, carried from each pass to the next.
            window = ReconcileWindow()
            step = run_once_step(reconcile_run_once, reconcile, queue_depth=depth, window=window)
            loops.append(self.loop("reconciler", step, stop, close=depth.close))
        if not options["without_webhooks"]:
            webhooks = WebhookConfig(
                retry_seconds=settings.SCHEDULER_WEBHOOK_RETRY_SECONDS,
                allow_private=settings.SCHEDULER_WEBHOOK_ALLOW_PRIVATE,
            )
            posted = Listener((CHANNEL_WEBHOOKS,), stop)
            step = run_once_step(webhook_deliveries_run_once, webhooks)
            loops.append(self.loop("webhooks", step, stop, wait=posted.wait, close=posted.close))
        if not options["without_pruner"]:
            loops.append(
                self.loop(
                    "pruner",
                    run_once_step(
                        pruner_run_once,
                        PrunerConfig(
                            batch_size=options["batch_size"],
                            poll_interval=options["prune_interval"],
                        ),
                    ),
                    stop,
                )
            )
        return loops

    def _session_opened(self, sender, connection, **kwargs) -> None:
        """No loop's session may keep rows locked for long once its process froze. The
        scheduler loop's session is recorded with the replica's membership: a replica that
        takes its partitions over after a freeze ends it (dispatch.partitions), so the job
        rows a frozen pass keeps locked go with the partitions. The maintenance loops'
        sessions are bounded by LOOP_IDLE_IN_TRANSACTION_SECONDS."""
        name = threading.current_thread().name
        if name == "scheduler":
            self.keeper.scheduler_session_opened()
        elif name in BOUNDED_LOOPS:
            session_idle_in_transaction_timeout_set(seconds=LOOP_IDLE_IN_TRANSACTION_SECONDS)

    def loop(
        self,
        name: str,
        step: Callable[[], float],
        stop: StopSignal,
        *,
        max_steps: int | None = None,
        on_error: Callable[[BaseException], None] | None = None,
        wait: Callable[[float], object] | None = None,
        close: Callable[[], None] | None = None,
    ) -> threading.Thread:
        def target() -> None:
            try:
                run_loop(step, name=name, stop=stop, max_steps=max_steps, on_error=on_error,
                         wait=wait)  # fmt: skip
            finally:
                if close is not None:
                    close()

        return threading.Thread(target=target, name=name, daemon=True)

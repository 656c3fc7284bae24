from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from dispatch.broker import ConfirmingPublisher, queues_declare
from dispatch.clockskew import ClockSkewConfig, clock_skew_thread
from dispatch.loop import StopSignal, run_loop, run_once_step
from dispatch.operations import OperationsConfig, operations_run_once
from dispatch.packing import PackSizes
from dispatch.relay import RelayConfig, relay_run_once, relay_sleep
from dispatch.shares import OwnerTurns
from dispatch.wakeup import Listener
from jobs.lanes import lane_queues
from jobs.notify import CHANNEL_OUTBOX


class Command(BaseCommand):
    help = (
        "Run one outbox relay: publishes pending outbox rows with publisher confirms, woken "
        "by every commit that writes outbox rows (LISTEN/NOTIFY), polling as a safety net."
    )

    def add_arguments(self, parser):
        parser.add_argument("--batch-size", type=int, default=RelayConfig.batch_size)
        parser.add_argument(
            "--poll-interval",
            type=float,
            default=RelayConfig.poll_interval,
            help="seconds between looks at an empty outbox when no notification came",
        )
        parser.add_argument(
            "--claim-lease",
            type=float,
            default=RelayConfig.claim_lease,
            help="seconds a step's claim on the rows it publishes lasts: a relay frozen or "
            "dead holds its claimed rows back no longer than this",
        )
        parser.add_argument("--max-steps", type=int, default=None, help="stop after N steps")
        parser.add_argument(
            "--bulk-batch-size",
            type=int,
            default=OperationsConfig.batch_size,
            help="items of a bulk operation done in one transaction between relay steps",
        )

    def handle(
        self, *args, batch_size, poll_interval, claim_lease, max_steps, bulk_batch_size, **options
    ):
        try:
            config = RelayConfig(
                batch_size=batch_size,
                poll_interval=poll_interval,
                claim_lease=claim_lease,
                high_water=settings.SCHEDULER_QUEUE_HIGH_WATER,
                owner_max_active_runs=settings.SCHEDULER_OWNER_MAX_ACTIVE_RUNS,
            )
            operations_config = OperationsConfig(batch_size=bulk_batch_size)
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        publisher = ConfirmingPublisher(
            settings.CELERY_BROKER_URL, settings.CELERY_BROKER_TRANSPORT_OPTIONS
        )
        relay_step = run_once_step(
            relay_run_once,
            config,
            sleep=lambda result: relay_sleep(result, config),
            publisher=publisher,
            turns=OwnerTurns(),
            packing=PackSizes(),
        )
        # Bulk operations go on between the relay's steps, one bounded batch each.
        operations_step = run_once_step(operations_run_once, operations_config)

        def step() -> float:
            return min(relay_step(), operations_step())

        queues_declare(publisher, lane_queues(settings.SCHEDULER_QUEUES))
        stop = StopSignal().install()
        listener = Listener((CHANNEL_OUTBOX,), stop)
        clock_skew_thread(ClockSkewConfig(kind="relay"), stop).start()
        self.stdout.write("relay started")
        try:
            run_loop(
                step,
                name="relay",
                stop=stop,
                max_steps=max_steps,
                on_error=lambda exc: publisher.reset(),
                wait=listener.wait,
            )
        finally:
            listener.close()
            publisher.close()

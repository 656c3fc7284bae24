from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from dispatch.clockskew import ClockSkewConfig, clock_skew_thread
from dispatch.loop import StopSignal, run_loop, run_once_step
from dispatch.relay import ConfirmingPublisher, RelayConfig, queues_declare, relay_run_once
from dispatch.wakeup import Listener
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
        parser.add_argument("--max-steps", type=int, default=None, help="stop after N steps")

    def handle(self, *args, batch_size, poll_interval, max_steps, **options):
        try:
            config = RelayConfig(batch_size=batch_size, poll_interval=poll_interval)
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        publisher = ConfirmingPublisher(
            settings.CELERY_BROKER_URL, settings.CELERY_BROKER_TRANSPORT_OPTIONS
        )
        # After a batch that published anything, look again at once.
        step = run_once_step(
            relay_run_once,
            config,
            sleep=lambda result: 0.0 if result.published else config.poll_interval,
            publisher=publisher,
        )
        queues_declare(publisher, settings.SCHEDULER_QUEUES)
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

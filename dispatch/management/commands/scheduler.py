from django.core.management.base import BaseCommand

from dispatch.clock import db_now
from dispatch.loop import StopSignal, run_loop
from dispatch.scheduler import SchedulerConfig, scheduler_run_once, scheduler_sleep_seconds


class Command(BaseCommand):
    help = "Run one scheduler replica: turns due occurrences and retries into queued runs."

    def add_arguments(self, parser):
        parser.add_argument("--batch-size", type=int, default=SchedulerConfig.batch_size)
        parser.add_argument("--poll-interval", type=float, default=SchedulerConfig.poll_interval)
        parser.add_argument("--max-steps", type=int, default=None, help="stop after N steps")

    def handle(self, *args, batch_size, poll_interval, max_steps, **options):
        config = SchedulerConfig(batch_size=batch_size, poll_interval=poll_interval)

        def step() -> float:
            result = scheduler_run_once(now=db_now(), config=config)
            if result.batch_full:
                return 0.0
            return scheduler_sleep_seconds(now=db_now(), config=config)

        self.stdout.write("scheduler started")
        run_loop(step, name="scheduler", stop=StopSignal().install(), max_steps=max_steps)

"""The worker's room: what a Celery task (`dispatch.registry.job_task`) runs for a delivery.

- `delivery`: one delivered run, claimed as an attempt in one statement, its handler run,
  its outcome recorded while it holds the run's current fencing token.
- `packs`: the runs of one packed message, one after another, the first attempts of
  `at_least_once` runs reserved together and started at their turn.
- `keeper`: the process's lease keeper, one thread renewing every lease in one statement.
- `context`: what a handler receives as `ctx`.
- `recording`: the outcome as the worker records it (through `jobs.outcomes`): a failure at
  once, successes together.
- `limits`: time limits (Celery's soft limit for a packed run, the grace of the hard one).
- `outage`: recording through a database outage, and adopting an ambiguous claim.
"""

from .context import RunContext
from .delivery import run_execute_delivery
from .keeper import LEASE_KEEPER, Lease, LeaseKeeper
from .packs import PackInterrupted, run_execute_deliveries

__all__ = [
    "LEASE_KEEPER",
    "Lease",
    "LeaseKeeper",
    "PackInterrupted",
    "RunContext",
    "run_execute_deliveries",
    "run_execute_delivery",
]

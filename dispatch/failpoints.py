"""Named crash points for the fault-injection tests.

`SCHEDULER_FAILPOINTS=relay.after_confirm` makes the process SIGKILL itself when it reaches
that point, exactly where a real crash would hurt most. Unset in production: a no-op.
"""

import os
import signal

_ARMED = frozenset(filter(None, os.environ.get("SCHEDULER_FAILPOINTS", "").split(",")))


def failpoint(name: str) -> None:
    if name in _ARMED:
        os.kill(os.getpid(), signal.SIGKILL)

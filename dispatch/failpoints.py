"""Named crash points for the fault-injection tests.

`SCHEDULER_FAILPOINTS=relay.after_confirm` makes the process SIGKILL itself when it reaches
that point, exactly where a real crash would hurt most; `name=stop` makes it SIGSTOP itself
there instead (frozen, its connections and locks kept, as a paused VM or a long GC would).
Unset in production: a no-op.
"""

import os
import signal
import threading

_ARMED = dict(
    (item.split("=", 1) + ["kill"])[:2]
    for item in filter(None, os.environ.get("SCHEDULER_FAILPOINTS", "").split(","))
)
_SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


def failpoint(name: str) -> None:
    if name in _ARMED:
        # To the calling thread: a SIGSTOP sent to the process is taken by whichever thread
        # the kernel picks, and the caller could run on (and commit) before the group stops.
        signal.pthread_kill(threading.get_ident(), _SIGNALS[_ARMED[name]])

"""The registered task names: the only code a job may name.

Filled by `dispatch.job_task` as the task modules are imported (dispatch's AppConfig.ready
imports the built-in tasks and SCHEDULER_TASK_MODULES in every process), and read by the
validation of a job body, so that an unknown task name is refused when the job is created.

It imports no models, and neither does `jobs/__init__.py`: `dispatch` imports it while
Django's apps are still loading.
"""

from __future__ import annotations

from collections.abc import Callable

_handlers: dict[str, Callable] = {}
_pack_sizes: dict[str, int] = {}


def task_register(*, name: str, handler: Callable, pack: int = 1) -> None:
    """Register `handler` under `name`; ValueError when another handler holds the name.
    `pack`: how many due runs of the task may travel in one broker message."""
    registered = _handlers.get(name)
    if registered is not None and registered.__qualname__ != handler.__qualname__:
        raise ValueError(f"job task '{name}' is already registered by {registered!r}")
    if not isinstance(pack, int) or isinstance(pack, bool) or pack < 1:
        raise ValueError(f"job task '{name}': pack must be a whole number of runs, at least 1")
    _handlers[name] = handler
    _pack_sizes[name] = pack


def task_pack_size(name: str) -> int:
    """Runs of the task per broker message (1 for a task this process does not know)."""
    return _pack_sizes.get(name, 1)


def registered_task_names() -> frozenset[str]:
    return frozenset(_handlers)

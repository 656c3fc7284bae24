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


def task_register(*, name: str, handler: Callable) -> None:
    """Register `handler` under `name`; ValueError when another handler holds the name."""
    registered = _handlers.get(name)
    if registered is not None and registered.__qualname__ != handler.__qualname__:
        raise ValueError(f"job task '{name}' is already registered by {registered!r}")
    _handlers[name] = handler


def registered_task_names() -> frozenset[str]:
    return frozenset(_handlers)

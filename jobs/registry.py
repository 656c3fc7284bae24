"""The registered task names: the only code a job may name.

Filled by `dispatch.job_task` as the task modules are imported (dispatch's AppConfig.ready
imports the built-in tasks and SCHEDULER_TASK_MODULES in every process), and read by the
validation of a job body, so that an unknown task name is refused when the job is created.

It imports no models, and neither does `jobs/__init__.py`: `dispatch` imports it while
Django's apps are still loading.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

_handlers: dict[str, Callable] = {}
_pack_sizes: dict[str, int | None] = {}


def task_register(*, name: str, handler: Callable, pack: int | None = None) -> None:
    """Register `handler` under `name`; ValueError when another handler holds the name.
    `pack`: how many due runs of the task may travel in one broker message; None when the
    task declares nothing (the relay then decides from what its attempts took)."""
    registered = _handlers.get(name)
    if registered is not None and registered.__qualname__ != handler.__qualname__:
        raise ValueError(f"job task '{name}' is already registered by {registered!r}")
    if pack is not None and (not isinstance(pack, int) or isinstance(pack, bool) or pack < 1):
        raise ValueError(f"job task '{name}': pack must be a whole number of runs, at least 1")
    _handlers[name] = handler
    _pack_sizes[name] = pack


def task_pack_declared(name: str) -> int | None:
    """The runs per broker message the task declared; None when it declared nothing or
    this process does not know it."""
    return _pack_sizes.get(name)


def task_pack_size(name: str) -> int:
    """Runs of the task per broker message as declared (1 when it declared nothing)."""
    return _pack_sizes.get(name) or 1


def registered_task_names() -> frozenset[str]:
    return frozenset(_handlers)


@functools.cache
def _call_signature(handler: Callable) -> inspect.Signature | None:
    """The handler's signature without its first parameter (the run's context); None when
    it cannot be read (a builtin), in which case nothing is checked."""
    try:
        signature = inspect.signature(handler)
    except (TypeError, ValueError):
        return None
    parameters = list(signature.parameters.values())
    if parameters and parameters[0].kind in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    ):
        parameters = parameters[1:]
    return signature.replace(parameters=parameters)


def task_arguments_problem(*, name: str, args: list, kwargs: dict) -> str | None:
    """Why `handler(ctx, *args, **kwargs)` of the task `name` could not be called (the
    TypeError's words), else None; None too for a task this process does not know."""
    handler = _handlers.get(name)
    signature = _call_signature(handler) if handler is not None else None
    if signature is None:
        return None
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        return f"The task '{name}' takes ({str(signature)[1:-1]}): {exc}."
    return None

"""Validation shared by every background concern's frozen `Config` (`__post_init__`)."""

from __future__ import annotations


def config_require(
    config: object,
    *,
    at_least_one: tuple[str, ...] = (),
    positive: tuple[str, ...] = (),
    non_negative: tuple[str, ...] = (),
) -> None:
    """Raise ValueError naming the first field out of range; a None value is left alone
    (a field whose None means "never" or "the setting's default")."""
    checks = (
        (at_least_one, lambda value: value >= 1, "must be at least 1"),
        (positive, lambda value: value > 0, "must be greater than 0"),
        (non_negative, lambda value: value >= 0, "must be 0 or more"),
    )
    for fields, valid, problem in checks:
        for field in fields:
            value = getattr(config, field)
            if value is not None and not valid(value):
                raise ValueError(f"{type(config).__name__}.{field} {problem}, not {value!r}")

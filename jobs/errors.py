"""Exceptions of the domain that handlers meet; importable before Django's apps are ready."""


class StaleAttempt(Exception):
    """This attempt no longer holds the run's current fencing token: it may change nothing."""

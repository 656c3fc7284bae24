"""Throttling shared by every web process (docs/security.md): per user (or client address
when anonymous), one counter row per (scope, user) in the database, counted in fixed
windows by one atomic upsert.

Not Django's database cache behind DRF's throttles: their sliding log is read and written
back whole (a pickled list of up to 6,000 timestamps at 6,000/min, four statements a
request), and two processes that read it together each write back their own, losing hits.
The upsert is one statement and exact under concurrency; a fixed window allows at most
twice the rate across a window's edge, which is the usual price. Its window is read on the
database's clock, in the statement: web processes whose clocks differ count in one window.
The pruner deletes the rows of ended windows (dispatch.pruner), so the table holds the keys
counted in the current windows, not every user and client address ever seen.

Scopes (REST_FRAMEWORK's DEFAULT_THROTTLE_RATES, overridable with SCHEDULER_THROTTLE_RATES):
`user` every API request; `bulk`, `backfill` (views with that `throttle_scope`),
`logs_follow` (a live tail's long poll), `admin_login` (POSTs to the admin's login).
"""

from __future__ import annotations

from django.contrib import admin
from django.http import HttpResponse
from rest_framework import serializers
from rest_framework.throttling import ScopedRateThrottle, SimpleRateThrottle, UserRateThrottle

from storage.throttle import throttle_hit

from .clock import request_clock_keep


class SharedWindowThrottle(SimpleRateThrottle):
    """DRF's rate parsing and keys, counted with `storage.throttle.throttle_hit` instead of a
    cache."""

    _wait: float | None = None

    def allow_request(self, request, view) -> bool:
        if self.rate is None:
            return True
        key = self.get_cache_key(request, view)
        if key is None:
            return True
        hit = throttle_hit(key=key, window_seconds=self.duration)
        request_clock_keep(request, hit.read_at)
        allowed = hit.hits <= self.num_requests
        self._wait = None if allowed else hit.retry_after
        return allowed

    def wait(self) -> float | None:
        return self._wait


class UserThrottle(UserRateThrottle, SharedWindowThrottle):
    """Every API request, per user (`user`)."""


class ScopedThrottle(ScopedRateThrottle, SharedWindowThrottle):
    """The expensive operations, per user: a view's `throttle_scope` (bulk, backfill)."""


class LogFollowThrottle(SharedWindowThrottle):
    """A live tail's long poll (`?follow=true`), per user (`logs_follow`)."""

    scope = "logs_follow"

    def get_cache_key(self, request, view):
        try:  # as the logs view parses it (DRF's BooleanField: `t`, `y` and `on` too)
            follows = serializers.BooleanField().to_internal_value(
                request.query_params.get("follow", "false")
            )
        except serializers.ValidationError:
            return None  # the view answers 400
        if not follows:
            return None
        return self.cache_format % {"scope": self.scope, "ident": _ident(self, request)}


def _ident(throttle: SimpleRateThrottle, request) -> str:
    user = request.user
    return str(user.pk) if user and user.is_authenticated else throttle.get_ident(request)


class _AdminLoginThrottle(SharedWindowThrottle):
    scope = "admin_login"

    def get_cache_key(self, request, view):
        return self.cache_format % {"scope": self.scope, "ident": self.get_ident(request)}


def admin_login(request, **kwargs):
    """The admin's login page, its POSTs throttled per client address (`admin_login`)."""
    throttle = _AdminLoginThrottle()
    if request.method == "POST" and not throttle.allow_request(request, None):
        wait = int(throttle.wait() or 1) + 1
        response = HttpResponse(
            f"Too many login attempts; try again in {wait} s.",
            status=429,
            content_type="text/plain",
        )
        response["Retry-After"] = str(wait)
        return response
    return admin.site.login(request, **kwargs)

"""Who may act across owners (docs/security.md): members of the `operators` group and
superusers. `is_staff` alone opens the admin's door (whose model permissions decide the
rest), not other owners' objects through the API."""

from __future__ import annotations

import hmac

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from rest_framework.permissions import BasePermission

OPERATORS_GROUP = "operators"


def user_is_operator(user: AbstractBaseUser) -> bool:
    if not (user and user.is_authenticated and user.is_active):
        return False
    if user.is_superuser:
        return True
    cached = getattr(user, "_scheduler_is_operator", None)
    if cached is None:
        cached = user._scheduler_is_operator = user.groups.filter(name=OPERATORS_GROUP).exists()
    return cached


def metrics_token_matches(request) -> bool:
    """`Authorization: Bearer <SCHEDULER_METRICS_TOKEN>` (a Prometheus scraper's), compared
    in constant time; never when the setting is empty."""
    expected = settings.SCHEDULER_METRICS_TOKEN
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if not expected or scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode(), expected.encode())


class IsOperator(BasePermission):
    message = "Operators only (the operators group, or a superuser)."

    def has_permission(self, request, view) -> bool:
        return user_is_operator(request.user)


class IsOperatorOrMetricsToken(BasePermission):
    message = "Operators only, or the bearer token of SCHEDULER_METRICS_TOKEN."

    def has_permission(self, request, view) -> bool:
        return metrics_token_matches(request) or user_is_operator(request.user)

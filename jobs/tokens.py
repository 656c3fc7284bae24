"""API tokens, hashed at rest (docs/security.md): `Authorization: Token <key>` as DRF's
tokens were, several per user, with expiry and revocation.

A key is 40 random hex characters (160 bits), shown once, when it is created. The database
keeps its SHA-256 (unique, indexed: authentication is one indexed lookup) and its first 8
characters, for telling tokens apart. A salted, stretched password hash (Django's hashers)
would cost each request tens of milliseconds and could not be looked up by index; stretching
defends guessable secrets, and a 160-bit random key is not guessable.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import secrets

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from rest_framework import authentication, exceptions

from storage.tokens import token_owner

from .models import ApiToken

PREFIX_CHARS = 8


def token_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def token_create(
    *,
    owner: AbstractBaseUser,
    now: dt.datetime,
    name: str = "",
    ttl: dt.timedelta | None = None,
) -> tuple[ApiToken, str]:
    """A new token of `owner` and its key (the only time the key exists in clear), created
    at `now` (the database's clock, `jobs.clock.db_now`, against which it expires). `ttl`:
    its lifetime (default SCHEDULER_TOKEN_TTL_DAYS; 0 days: no expiry)."""
    if ttl is None and settings.SCHEDULER_TOKEN_TTL_DAYS:
        ttl = dt.timedelta(days=settings.SCHEDULER_TOKEN_TTL_DAYS)
    key = secrets.token_hex(20)
    token = ApiToken.objects.create(
        owner=owner,
        name=name,
        prefix=key[:PREFIX_CHARS],
        digest=token_digest(key),
        created_at=now,
        expires_at=now + ttl if ttl else None,
    )
    return token, key


def tokens_revoke(*, tokens, now: dt.datetime) -> int:
    """Revoke the tokens of the queryset `tokens` not revoked yet; how many it revoked."""
    return tokens.filter(revoked_at=None).update(revoked_at=now)


def token_user(*, key: str, now: dt.datetime | None = None) -> AbstractBaseUser | None:
    """The active user whose live (unrevoked, unexpired at `now`; None: on the database's
    clock) token `key` is, else None."""
    owner = token_owner(digest=token_digest(key), now=now)
    return owner if owner is not None and owner.is_active else None


class TokenAuthentication(authentication.TokenAuthentication):
    """DRF's `Authorization: Token <key>` header, checked against the hashed tokens; expiry
    judged on the database's clock, as every process's leases and due times are."""

    def authenticate_credentials(self, key):
        user = token_user(key=key)
        if user is None:
            raise exceptions.AuthenticationFailed("Invalid, expired or revoked token.")
        return user, None

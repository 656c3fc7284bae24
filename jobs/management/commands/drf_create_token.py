"""`manage.py drf_create_token <user>`: the documented name (DRF's command) for a new API token,
now hashed at rest (jobs.tokens): the key is printed once and never stored."""

import datetime as dt

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from jobs.clock import db_now
from jobs.tokens import token_create, tokens_revoke


class Command(BaseCommand):
    help = "Create an API token for a user and print its key (shown only this once)."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument(
            "-r",
            "--reset",
            action="store_true",
            help="Revoke the user's other tokens first (as DRF's --reset replaced the key).",
        )
        parser.add_argument("--name", default="", help="What the token is for.")
        parser.add_argument(
            "--expires-in-days",
            type=int,
            default=None,
            help="Lifetime (default SCHEDULER_TOKEN_TTL_DAYS; 0: never expires).",
        )

    def handle(self, *args, username, reset, name, expires_in_days, **options):
        users = get_user_model()
        try:
            user = users.objects.get(**{users.USERNAME_FIELD: username})
        except users.DoesNotExist as exc:
            raise CommandError(f"no user named {username!r}") from exc
        if expires_in_days is not None and expires_in_days < 0:
            raise CommandError("--expires-in-days must be 0 (never) or more")
        now = db_now()  # the clock tokens expire against
        if reset:
            tokens_revoke(tokens=user.api_tokens.all(), now=now)
        ttl = None if expires_in_days is None else dt.timedelta(days=expires_in_days)
        token, key = token_create(owner=user, now=now, name=name, ttl=ttl)
        expiry = f", expires {token.expires_at.isoformat()}" if token.expires_at else ""
        self.stdout.write(f"Generated token {key} for user {username}{expiry}")

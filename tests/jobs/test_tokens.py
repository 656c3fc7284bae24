"""API tokens hashed at rest (jobs.tokens): `Authorization: Token <key>`, several per
user, expiry, revocation, `manage.py drf_create_token`, the admin's token page, and what a
dump of the token table holds."""

import datetime as dt
import io
import re

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import connection
from rest_framework.test import APIClient

from jobs.models import ApiToken
from jobs.tokens import token_create, token_digest, tokens_revoke

JOBS = "/api/v1/jobs/"


def _client(key: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    return client


def _now():
    return dt.datetime.now(dt.UTC)


@pytest.mark.django_db
def test_several_tokens_per_user_each_works_and_none_is_stored_in_clear(user):
    keys = [token_create(owner=user, now=_now())[1] for _ in range(3)]
    assert len(set(keys)) == 3
    for key in keys:
        assert _client(key).get(JOBS).status_code == 200
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT * FROM {ApiToken._meta.db_table}")
        dump = repr(cursor.fetchall())
    assert all(key not in dump for key in keys)
    assert all(token_digest(key) in dump for key in keys)


@pytest.mark.django_db
def test_a_wrong_expired_or_revoked_token_answers_401(user):
    now = _now()
    _, live = token_create(owner=user, now=now)
    _, expired = token_create(owner=user, now=now - dt.timedelta(days=2), ttl=dt.timedelta(days=1))
    revoked_token, revoked = token_create(owner=user, now=now)
    assert tokens_revoke(tokens=ApiToken.objects.filter(id=revoked_token.id), now=now) == 1
    assert tokens_revoke(tokens=ApiToken.objects.filter(id=revoked_token.id), now=now) == 0
    assert _client(live).get(JOBS).status_code == 200
    for key in (expired, revoked, "0" * 40, live.upper()):
        assert _client(key).get(JOBS).status_code == 401, key
    user.is_active = False
    user.save()
    assert _client(live).get(JOBS).status_code == 401


@pytest.mark.django_db
def test_new_tokens_expire_after_the_configured_lifetime(user, settings):
    settings.SCHEDULER_TOKEN_TTL_DAYS = 7
    now = _now()
    token, _ = token_create(owner=user, now=now)
    assert token.expires_at == now + dt.timedelta(days=7)
    settings.SCHEDULER_TOKEN_TTL_DAYS = 0
    assert token_create(owner=user, now=now)[0].expires_at is None


@pytest.mark.django_db
def test_drf_create_token_prints_a_usable_key_and_reset_revokes_the_others(user):
    def create(*args) -> str:
        out = io.StringIO()
        call_command("drf_create_token", user.username, *args, stdout=out)
        return re.search(r"Generated token (\w+) for user", out.getvalue()).group(1)

    first = create()
    second = create("--expires-in-days", "0")
    assert ApiToken.objects.get(digest=token_digest(second)).expires_at is None
    assert _client(first).get(JOBS).status_code == 200
    third = create("--reset")
    assert _client(first).get(JOBS).status_code == 401
    assert _client(second).get(JOBS).status_code == 401
    assert _client(third).get(JOBS).status_code == 200


@pytest.mark.django_db
def test_the_admin_lists_owner_prefix_and_expiry_never_the_key_and_revokes(client, user):
    token, key = token_create(owner=user, now=_now(), name="ci")
    root = get_user_model().objects.create_superuser("root", "r@example.com", "pw")
    client.force_login(root)
    for url in ("/admin/jobs/apitoken/", f"/admin/jobs/apitoken/{token.id}/change/"):
        page = client.get(url).content.decode()
        assert token.prefix in page and user.username in page
        assert key not in page and token.digest not in page
    response = client.post(
        "/admin/jobs/apitoken/",
        {"action": "revoke_tokens", "_selected_action": [token.id]},
        follow=True,
    )
    assert "revoked: 1" in " ".join(str(m) for m in response.context["messages"])
    assert _client(key).get(JOBS).status_code == 401


@pytest.mark.django_db
def test_standalone_prints_a_token_of_a_plain_user_not_of_the_superuser():
    from dispatch.management.commands.standalone import Command

    admin_name, password, api_name, first = Command()._first_users()
    assert password and get_user_model().objects.get(username=admin_name).is_superuser
    api_user = get_user_model().objects.get(username=api_name)
    assert not (api_user.is_superuser or api_user.is_staff)
    assert _client(first).get(JOBS).status_code == 200
    _, again, _, second = Command()._first_users()
    assert again is None  # the admin exists: no new password
    assert _client(second).get(JOBS).status_code == 200
    assert _client(first).get(JOBS).status_code == 401  # the previous start's token


@pytest.mark.django_db
def test_token_user_is_the_stored_user_and_expiry_is_exclusive(user):
    from jobs.tokens import token_user

    now = _now()
    _, forever = token_create(owner=user, now=now, ttl=dt.timedelta(0))  # no expiry
    assert ApiToken.objects.get(digest=token_digest(forever)).expires_at is None
    found = token_user(key=forever, now=now + dt.timedelta(days=3650))
    stored = get_user_model().objects.get(pk=user.pk)
    for field in stored._meta.concrete_fields:
        assert getattr(found, field.attname) == getattr(stored, field.attname), field.name
    assert found.date_joined.tzinfo is not None
    assert found._state.db == "default" and not found._state.adding
    found.first_name = "renamed"
    found.save()
    assert get_user_model().objects.count() == 1
    assert get_user_model().objects.get(pk=user.pk).first_name == "renamed"

    token, expiring = token_create(owner=user, now=now, ttl=dt.timedelta(days=1))
    plus_five = dt.timezone(dt.timedelta(hours=5))
    assert token_user(key=expiring, now=token.expires_at) is None
    assert token_user(key=expiring, now=token.expires_at.astimezone(plus_five)) is None
    just_before = token.expires_at - dt.timedelta(microseconds=1)
    assert token_user(key=expiring, now=just_before) == stored
    assert token_user(key=expiring, now=just_before.astimezone(plus_five)) == stored
    assert _client(forever).get(JOBS).status_code == 200


@pytest.mark.django_db
def test_expiry_is_judged_on_the_databases_clock_not_the_web_processes(user, monkeypatch):
    """A web process two hours fast refuses no live token, one two hours slow takes no
    expired one: the database's clock decides, as it does for every process."""
    from django.utils import timezone

    from jobs.clock import db_now

    now, hour = db_now(), dt.timedelta(hours=1)
    _, live = token_create(owner=user, now=now, ttl=hour)
    _, expired = token_create(owner=user, now=now - 2 * hour, ttl=hour)
    real = timezone.now
    monkeypatch.setattr(timezone, "now", lambda: real() + 2 * hour)
    assert _client(live).get(JOBS).status_code == 200
    monkeypatch.setattr(timezone, "now", lambda: real() - 2 * hour)
    assert _client(expired).get(JOBS).status_code == 401

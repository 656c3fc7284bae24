"""storage.tokens: the lookup of a live token's owner by its key's digest."""

from __future__ import annotations

import datetime as dt

import pytest
from django.contrib.auth import get_user_model

from jobs.tokens import token_create, token_digest
from storage.tokens import token_owner

NOW = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)


@pytest.mark.django_db
def test_a_live_token_answers_with_its_owner_as_stored(user):
    _, key = token_create(owner=user, now=NOW, ttl=dt.timedelta(0))  # no expiry
    found = token_owner(digest=token_digest(key), now=NOW + dt.timedelta(days=3650))
    stored = get_user_model().objects.get(pk=user.pk)
    assert found == stored
    for field in stored._meta.concrete_fields:
        assert getattr(found, field.attname) == getattr(stored, field.attname), field.name
    assert not found._state.adding


@pytest.mark.django_db
def test_expired_revoked_and_unknown_tokens_answer_nobody(user):
    token, key = token_create(owner=user, now=NOW, ttl=dt.timedelta(days=1))
    digest = token_digest(key)
    assert token_owner(digest=digest, now=token.expires_at - dt.timedelta(microseconds=1))
    assert token_owner(digest=digest, now=token.expires_at) is None  # expiry is exclusive
    assert token_owner(digest=token_digest("no such key"), now=NOW) is None
    token.revoked_at = NOW
    token.save()
    assert token_owner(digest=digest, now=NOW) is None


@pytest.mark.django_db
def test_an_inactive_owner_is_answered_for_the_caller_to_refuse(user):
    _, key = token_create(owner=user, now=NOW)
    user.is_active = False
    user.save()
    found = token_owner(digest=token_digest(key), now=NOW)
    assert found == user and not found.is_active

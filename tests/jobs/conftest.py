"""Fixtures of the admin's tests."""

import pytest

from tests.factories import superuser


@pytest.fixture
def admin_superuser(client):
    """A superuser named `op`, logged in to the test client."""
    user = superuser("op")
    client.force_login(user)
    return user

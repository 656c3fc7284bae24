"""storage.server against PostgreSQL: the embedded server's database made once."""

import uuid

import psycopg
import pytest
from django.db import connection

from storage.server import database_create_if_missing


@pytest.mark.django_db
def test_a_database_is_created_once():
    params = connection.get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    name = f"scratch_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(**{**params, "dbname": "postgres"}, autocommit=True) as conn:
        try:
            assert database_create_if_missing(connection=conn, name=name) is True
            assert database_create_if_missing(connection=conn, name=name) is False
        finally:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}"')

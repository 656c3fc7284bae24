"""DATABASE_URL in libpq's multi-host form, `postgresql://u@h1:p1,h2:p2/db?
target_session_attrs=read-write`: parsed into Django's comma-separated HOST and PORT, and a
connection made through it skips a host that does not answer."""

import pytest
from django.db import connection
from django.db.utils import ConnectionHandler

from scheduler_project.settings.base import _database
from scheduler_project.settings.database_url import database_url_hosts, database_url_parse
from scheduler_project.settings.test import answers

MULTI = "postgresql://root@127.0.0.1:5441,127.0.0.1:5442/DB?target_session_attrs=read-write"


def test_several_hosts_become_libpq_lists():
    config = database_url_parse(MULTI)
    assert (config["HOST"], config["PORT"], config["NAME"], config["USER"]) == (
        "127.0.0.1,127.0.0.1", "5441,5442", "DB", "root",
    )  # fmt: skip
    assert config["OPTIONS"] == {"target_session_attrs": "read-write"}
    assert config["ENGINE"] == "django.db.backends.postgresql"


def test_missing_ports_ipv6_and_a_password():
    config = database_url_parse("postgres://u:p%40ss@db1,[::1]:6000,db3:5433/name")
    assert (config["HOST"], config["PORT"], config["PASSWORD"]) == (
        "db1,::1,db3", "5432,6000,5433", "p@ss",
    )  # fmt: skip
    assert database_url_hosts(MULTI) == [("127.0.0.1", 5441), ("127.0.0.1", 5442)]
    with pytest.raises(ValueError, match="port 'x'"):
        database_url_parse("postgres://u@a:x,b/name")


def test_a_single_host_is_dj_database_urls():
    config = database_url_parse("postgres://u@db:5433/name?sslmode=require")
    assert (config["HOST"], config["PORT"], config["OPTIONS"]) == (
        "db", 5433, {"sslmode": "require"},
    )  # fmt: skip


def test_the_settings_keep_the_options_and_add_keepalives():
    config = _database(MULTI)
    assert config["OPTIONS"]["target_session_attrs"] == "read-write"
    assert config["OPTIONS"]["keepalives"] == 1


def test_answers_looks_at_every_host_and_every_broker_url():
    assert answers("postgres://u@127.0.0.1:1,127.0.0.1:5432/x", 5432)
    assert not answers("postgres://u@127.0.0.1:1,127.0.0.1:2/x", 5432)
    assert answers("amqp://g@127.0.0.1:1//;amqp://g@127.0.0.1:5672//", 5672)


@pytest.mark.django_db
def test_a_connection_skips_the_host_that_does_not_answer():
    real = connection.settings_dict
    url = (
        f"postgresql://{real['USER']}@127.0.0.1:1,{real['HOST'] or '127.0.0.1'}:"
        f"{real['PORT'] or 5432}/{real['NAME']}?target_session_attrs=read-write"
    )
    if str(real["HOST"]).startswith("/"):
        pytest.skip("the embedded PostgreSQL has no TCP port")
    handler = ConnectionHandler({"default": _database(url)})
    try:
        with handler["default"].cursor() as cursor:
            cursor.execute("SELECT pg_is_in_recovery(), current_database()")
            assert cursor.fetchone() == (False, real["NAME"])
    finally:
        handler.close_all()


def test_the_processes_of_the_tests_get_the_url_back(monkeypatch):
    from types import SimpleNamespace

    from tests import processes

    settings_dict = database_url_parse(MULTI)
    monkeypatch.setattr(processes, "connection", SimpleNamespace(settings_dict=settings_dict))
    assert database_url_parse(processes.test_database_url())["HOST"] == settings_dict["HOST"]
    assert processes.test_database_url() == (
        "postgres://root@127.0.0.1:5441,127.0.0.1:5442/DB?target_session_attrs=read-write"
    )

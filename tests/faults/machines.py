"""Machines to lose, built on this one machine: a three-node RabbitMQ cluster and a
PostgreSQL 15 primary with a synchronous streaming standby, each on ports and in folders of
their own (never the machine's RabbitMQ on 5672 or its PostgreSQL on 5432), and everything
they start stopped again. Used by tests/faults/test_machines_lost.py and bench/soak.py; no
Django here, only the servers' own commands.

RabbitMQ: `rabbitmq-server` started once per node with its own RABBITMQ_NODENAME, ports,
config file, data and log folders, no plugins (management off), and a HOME of its own whose
`.erlang.cookie` every node and every `rabbitmqctl -n` shares; nodes 2 and 3 join node 1.
PostgreSQL: `initdb`, then `pg_basebackup -R` for the standby, named in the primary's
`synchronous_standby_names`, so a commit is acknowledged only once the standby has it. Run
as root, the PostgreSQL commands run as the `postgres` user (`runuser`)."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tests.processes import wait_for

RABBITMQ_BIN = Path("/usr/lib/rabbitmq/bin")
POSTGRES_BIN = Path("/usr/lib/postgresql/15/bin")
RABBITMQ_PORTS = (5681, 5682, 5683)
POSTGRES_PORTS = (5441, 5442)
DATABASE = "scheduler"


def available() -> str | None:
    """Why the servers cannot be built here, or None."""
    for path in (RABBITMQ_BIN / "rabbitmq-server", RABBITMQ_BIN / "rabbitmqctl",
                 POSTGRES_BIN / "initdb", POSTGRES_BIN / "pg_basebackup"):  # fmt: skip
        if not path.exists():
            return f"{path} is not installed"
    for port in (*RABBITMQ_PORTS, *(p + 20000 for p in RABBITMQ_PORTS), *POSTGRES_PORTS):
        if port_open(port):
            return f"port {port} is taken"
    return None


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def _killpg(process: subprocess.Popen | None) -> None:
    if process is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=30)


class RabbitNode:
    def __init__(self, cluster: RabbitCluster, index: int, port: int) -> None:
        self.cluster = cluster
        self.index = index
        self.port = port
        self.name = f"drill{index}@localhost"
        self.base = cluster.base / f"node{index}"
        self.process: subprocess.Popen | None = None
        self.base.mkdir(parents=True, exist_ok=True)
        (self.base / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = {port}\n"
            "loopback_users = none\n"
            "disk_free_limit.absolute = 50MB\n"
            "vm_memory_high_watermark.absolute = 1GB\n"
            "log.console = false\n"
        )
        (self.base / "enabled_plugins").write_text("[].\n")

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "HOME": str(self.cluster.home),
            "RABBITMQ_NODENAME": self.name,
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.port + 20000),
            "RABBITMQ_CONFIG_FILE": str(self.base / "rabbitmq.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.base / "enabled_plugins"),
            "RABBITMQ_MNESIA_BASE": str(self.base / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.base / "log"),
            "RABBITMQ_PID_FILE": str(self.base / "pid"),
            "RABBITMQ_PLUGINS_EXPAND_DIR": str(self.base / "plugins-expand"),
        }

    def start(self) -> None:
        log = open(self.base / "server.log", "ab")  # noqa: SIM115 - kept with the process
        self.process = subprocess.Popen(
            [str(RABBITMQ_BIN / "rabbitmq-server")],
            env=self.env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def await_startup(self, timeout: float = 120) -> None:
        """Until the node runs (its name is known to epmd only some seconds after start)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.ctl("await_startup", "--timeout", "30", timeout=60)
                return
            except (RuntimeError, subprocess.TimeoutExpired):
                if time.monotonic() > deadline or (self.process and self.process.poll()):
                    raise
                time.sleep(1)

    def ctl(self, *args: str, timeout: float = 120) -> str:
        done = subprocess.run(
            [str(RABBITMQ_BIN / "rabbitmqctl"), "-n", self.name, "-q", *args],
            env=self.env(), capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        if done.returncode:
            raise RuntimeError(f"rabbitmqctl {' '.join(args)}: {done.stdout}{done.stderr}")
        return done.stdout

    def kill(self) -> None:
        """SIGKILL the node (its Erlang VM and helpers), as a lost machine."""
        _killpg(self.process)
        self.process = None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(Exception):
                self.ctl("shutdown", timeout=60)
        self.kill()


class RabbitCluster:
    """Three clustered nodes on RABBITMQ_PORTS, sharing a cookie in a HOME of their own."""

    def __init__(self, base: Path, ports: tuple[int, ...] = RABBITMQ_PORTS) -> None:
        self.base = base
        self.home = base / "home"
        self.home.mkdir(parents=True, exist_ok=True)
        cookie = self.home / ".erlang.cookie"
        cookie.write_text(os.urandom(16).hex().upper())
        cookie.chmod(0o400)
        self.nodes = [RabbitNode(self, index + 1, port) for index, port in enumerate(ports)]

    @property
    def url(self) -> str:
        """kombu's failover list: every node, `;`-separated."""
        return ";".join(node.url for node in self.nodes)

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        for node in self.nodes:
            node.await_startup()
        first = self.nodes[0]
        for node in self.nodes[1:]:
            node.ctl("stop_app")
            node.ctl("join_cluster", first.name)
            node.ctl("start_app")
        wait_for(lambda: len(self.running(first)) == len(self.nodes), timeout=60,
                   message="the nodes to cluster")  # fmt: skip

    def running(self, via: RabbitNode) -> list[str]:
        """The running nodes of the cluster, as `via` sees them."""
        import json

        status = json.loads(via.ctl("cluster_status", "--formatter", "json"))
        return sorted(status.get("running_nodes", []))

    def leader(self, queue: str, via: RabbitNode | None = None) -> RabbitNode:
        """The node leading the quorum queue."""
        for node in [via] if via else self.nodes:
            if node is None or node.process is None:
                continue
            with contextlib.suppress(RuntimeError):
                for line in node.ctl("list_queues", "name", "leader").splitlines():
                    name, _, leader = line.partition("\t")
                    if name == queue:
                        return next(n for n in self.nodes if n.name == leader.strip())
        raise AssertionError(f"no leader found for queue {queue!r}")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def _postgres_user() -> list[str]:
    """Run as root, the PostgreSQL commands run as `postgres`."""
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


class PostgresPair:
    """A primary (POSTGRES_PORTS[0]) and its synchronous streaming standby (the other)."""

    def __init__(self, base: Path, ports: tuple[int, int] = POSTGRES_PORTS) -> None:
        self.base = base
        self.base.mkdir(parents=True, exist_ok=True)
        self.ports = ports
        self.primary = base / "primary"
        self.standby = base / "standby"
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(base, user.pw_uid, user.pw_gid)

    def url(self, database: str = DATABASE) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.ports)
        return f"postgresql://postgres@{hosts}/{database}?target_session_attrs=read-write"

    def single_url(self, port: int, database: str = DATABASE) -> str:
        return f"postgresql://postgres@127.0.0.1:{port}/{database}"

    def _run(self, *argv: str, timeout: float = 180) -> str:
        done = subprocess.run(
            [*_postgres_user(), *argv], capture_output=True, text=True, timeout=timeout,
            cwd=self.base,
        )  # fmt: skip
        if done.returncode:
            raise RuntimeError(f"{' '.join(argv)}: {done.stdout}{done.stderr}")
        return done.stdout

    def _conf(self, data: Path, text: str) -> None:
        with open(data / "postgresql.conf", "a") as conf:
            conf.write(text)

    def pg_ctl(self, data: Path, *args: str, timeout: float = 120) -> str:
        return self._run(str(POSTGRES_BIN / "pg_ctl"), "-D", str(data), *args, timeout=timeout)

    def start(self) -> None:
        self._run(str(POSTGRES_BIN / "initdb"), "-D", str(self.primary), "-U", "postgres",
                  "--auth=trust", "-E", "UTF8", "--no-sync")  # fmt: skip
        self._conf(
            self.primary,
            f"\nport = {self.ports[0]}\nlisten_addresses = '127.0.0.1'\n"
            f"unix_socket_directories = '{self.base}'\n"
            "wal_level = replica\nmax_wal_senders = 5\nhot_standby = on\n"
            "synchronous_standby_names = 'standby'\nsynchronous_commit = on\n"
            "max_connections = 300\nshared_buffers = 64MB\nfsync = off\n",
        )
        self.pg_ctl(self.primary, "-l", str(self.base / "primary.log"), "-w", "start")
        self._run(str(POSTGRES_BIN / "pg_basebackup"), "-h", "127.0.0.1",
                  "-p", str(self.ports[0]), "-U", "postgres", "-D", str(self.standby),
                  "-R", "-X", "stream")  # fmt: skip
        # The standby's own port and name; once promoted it waits for no standby of its
        # own (a failover manager would name the next one).
        self._conf(self.standby, f"\nport = {self.ports[1]}\nsynchronous_standby_names = ''\n")
        with open(self.standby / "postgresql.auto.conf", "a") as auto:
            auto.write(
                f"primary_conninfo = 'host=127.0.0.1 port={self.ports[0]} user=postgres "
                "application_name=standby'\n"
            )
        self.pg_ctl(self.standby, "-l", str(self.base / "standby.log"), "-w", "start")
        wait_for(lambda: self.sql(self.ports[0], "SELECT sync_state FROM pg_stat_replication")
                   == "sync", timeout=60, message="the standby to be synchronous")  # fmt: skip
        self.sql(self.ports[0], f"CREATE DATABASE {DATABASE}")

    def sql(self, port: int, query: str, database: str = "postgres") -> str:
        done = subprocess.run(
            [str(POSTGRES_BIN / "psql"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres",
             "-d", database, "-XAtq", "-c", query],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        if done.returncode:
            raise RuntimeError(f"psql {query!r}: {done.stderr}")
        return done.stdout.strip()

    def stop_primary(self) -> None:
        """The primary stopped at once (`-m immediate`), as a lost machine."""
        self.pg_ctl(self.primary, "-m", "immediate", "stop")

    def promote(self) -> None:
        self.pg_ctl(self.standby, "-w", "promote")

    def stop(self) -> None:
        for data in (self.primary, self.standby):
            if (data / "postmaster.pid").exists():
                with contextlib.suppress(Exception):
                    self.pg_ctl(data, "-m", "immediate", "stop", timeout=60)
            pid_file = data / "postmaster.pid"
            if pid_file.exists():  # pg_ctl failed: the postmaster by its own pid
                with contextlib.suppress(ValueError, ProcessLookupError, OSError):
                    os.kill(int(pid_file.read_text().split()[0]), signal.SIGKILL)


@contextlib.contextmanager
def machines(*, rabbitmq: bool = True, postgres: bool = True, keep: bool = False):
    """The cluster and the pair in a temporary folder, stopped and removed on the way out
    (whatever happened in between)."""
    base = Path(tempfile.mkdtemp(prefix="scheduler-machines-"))
    base.chmod(0o755)
    cluster = RabbitCluster(base / "rabbitmq") if rabbitmq else None
    pair = PostgresPair(base / "postgres") if postgres else None
    try:
        if pair:
            pair.start()
        if cluster:
            cluster.start()
        yield cluster, pair
    finally:
        if cluster:
            cluster.stop()
        if pair:
            pair.stop()
        if not keep:
            shutil.rmtree(base, ignore_errors=True)

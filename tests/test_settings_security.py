"""Production settings from the environment (scheduler_project.settings): `check --deploy`
clean under DJANGO_SECURE=true, and var/ readable by its owner only on embedded defaults."""

import os
import secrets
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("DATABASE_URL", "CELERY_BROKER_URL", "DJANGO_SETTINGS_MODULE")}  # fmt: skip
    return {**env, "DJANGO_SETTINGS_MODULE": "scheduler_project.settings.base", **extra}


def _manage(*args, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)  # fmt: skip


def test_check_deploy_is_clean_under_django_secure(tmp_path):
    env = _env(
        DJANGO_SECURE="true",
        DJANGO_SECRET_KEY=secrets.token_urlsafe(50),
        DJANGO_ALLOWED_HOSTS="scheduler.example.com",
        DJANGO_CSRF_TRUSTED_ORIGINS="https://scheduler.example.com",
        DATABASE_URL="postgres://postgres@127.0.0.1:5432/postgres",
        CELERY_BROKER_URL="amqp://guest:guest@127.0.0.1:5672//",
        SCHEDULER_VAR_DIR=str(tmp_path / "var"),
    )
    done = _manage("check", "--deploy", "--fail-level", "WARNING", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no issues" in done.stdout
    # Without it, the same check warns: the test can fail.
    env.pop("DJANGO_SECURE")
    assert _manage("check", "--deploy", "--fail-level", "WARNING", env=env).returncode != 0


def test_secure_settings_redirect_to_https_except_the_probes(client, settings):
    settings.SECURE_SSL_REDIRECT = True
    settings.SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$", r"^metrics$"]
    settings.SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    assert client.get("/api/v1/jobs/").status_code == 301
    assert client.get("/api/v1/jobs/", HTTP_X_FORWARDED_PROTO="https").status_code == 401
    assert client.get("/healthz").status_code == 200


@pytest.mark.timeout(300)
def test_var_files_are_their_owners_only_on_embedded_defaults(tmp_path):
    var = tmp_path / "var"
    # An older installation: made before this rule, with the usual umask.
    var.mkdir(mode=0o755)
    (var / "secret_key").write_text(secrets.token_urlsafe(50))
    (var / "secret_key").chmod(0o644)
    env = _env(SCHEDULER_VAR_DIR=str(var), SCHEDULER_TASK_MODULES="tests.sample_tasks")
    try:
        _migrate_and_store_a_log(env)
    finally:  # the embedded PostgreSQL that migrate started
        subprocess.run([sys.executable, "-m", "scheduler_project.embedded", "stop"], cwd=ROOT,
                       env=env, capture_output=True, timeout=120)  # fmt: skip
    paths = [var, *var.rglob("*")]
    assert {p.name for p in paths} >= {"secret_key", "postgres", "messages", "logs",
                                       "chunk-0.txt"}  # fmt: skip
    # As root, the server's own user (scheduler_project.embedded) may search var/.
    var_mode = 0o710 if os.geteuid() == 0 else 0o700
    wrong = {
        str(p.relative_to(tmp_path)): oct(stat.S_IMODE(p.stat().st_mode))
        for p in paths
        if stat.S_IMODE(p.stat().st_mode)
        != (var_mode if p == var else 0o700 if p.is_dir() else 0o600)
    }
    assert wrong == {}


def _migrate_and_store_a_log(env: dict) -> None:
    done = _manage("migrate", "--verbosity", "0", env=env)
    assert done.returncode == 0, done.stderr
    store_a_log = (
        "import django; django.setup()\n"
        "from django.core.files.base import ContentFile\n"
        "from django.core.files.storage import storages\n"
        "storages['scheduler_logs'].save('run/attempt-1/chunk-0.txt', ContentFile(b'x'))\n"
    )
    done = subprocess.run([sys.executable, "-c", store_a_log], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_processes_started_together_share_one_whole_secret_key(tmp_path):
    """Embedded defaults: processes started at once (a scheduler and a relay) race to make
    var/secret_key; none fails and none reads a half-written key."""
    var = tmp_path / "var"
    env = _env(SCHEDULER_VAR_DIR=str(var))
    env.pop("DJANGO_SECRET_KEY", None)
    show_key = (
        "import django; django.setup()\n"
        "from django.conf import settings; print(settings.SECRET_KEY)"
    )
    processes = [
        subprocess.Popen([sys.executable, "-c", show_key], cwd=ROOT, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(8)
    ]  # fmt: skip
    outputs = [process.communicate(timeout=120) for process in processes]
    assert [process.returncode for process in processes] == [0] * 8, outputs
    keys = {stdout.strip() for stdout, _ in outputs}
    assert keys == {(var / "secret_key").read_text().strip()}
    assert len(keys.pop()) >= 50
    assert sorted(p.name for p in var.iterdir() if p.name.startswith(".secret_key")) == []

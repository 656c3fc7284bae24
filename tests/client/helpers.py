"""Driving the installed `schedctl` in a subprocess, as a user's shell would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

SCHEDCTL = str(Path(sys.executable).parent / "schedctl")


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str

    def json(self):
        return json.loads(self.stdout)


def schedctl(*args: str, url: str, token: str | None, cwd=None, timeout: float = 120,
             env: dict | None = None) -> Result:  # fmt: skip
    environment = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("SCHEDULER_", "DJANGO_"))
    }
    environment.update({"SCHEDULER_URL": url, "SCHEDULER_CONFIG": "/nonexistent/schedctl.toml",
                        "COLUMNS": "200", **(env or {})})  # fmt: skip
    if token:
        environment["SCHEDULER_TOKEN"] = token
    done = subprocess.run(
        [SCHEDCTL, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environment,
        cwd=cwd,
    )
    return Result(done.returncode, done.stdout, done.stderr)


def ok(result: Result) -> Result:
    assert result.code == 0, f"exit {result.code}\nstdout: {result.stdout}\nstderr: {result.stderr}"
    return result

"""The README's examples work as a newcomer types them: the jobs its curl commands create
are valid and name tasks that exist, and its shell lines run on any POSIX system."""

import datetime as dt
import json
import re
import subprocess
from pathlib import Path

import pytest

from jobs.api.validation import JobSpecSerializer

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def run_at_line() -> str:
    (line,) = [line for line in README.splitlines() if line.startswith("RUN_AT=")]
    return line


def test_the_run_at_line_prints_an_instant_five_seconds_ahead():
    done = subprocess.run(
        ["sh", "-c", f"{run_at_line()}; echo $RUN_AT"], capture_output=True, text=True, check=True
    )
    at = dt.datetime.fromisoformat(done.stdout.strip())
    assert 0 < (at - dt.datetime.now(dt.UTC)).total_seconds() <= 6


@pytest.mark.parametrize("name", ["hello", "weekday echo"])
def test_the_jobs_the_readme_creates_are_valid_and_their_tasks_exist(db, name):
    bodies = [
        json.loads(body.replace("'$RUN_AT'", dt.datetime.now(dt.UTC).isoformat()))
        for body in re.findall(r"-d '(\{.*?\})'\n", README, re.S)
    ]
    (body,) = [body for body in bodies if body.get("name") == name]
    serializer = JobSpecSerializer(data=body)
    assert serializer.is_valid(), serializer.errors


def test_no_gnu_only_commands_in_the_readme_or_the_scripts():
    texts = [README, *(path.read_text() for path in (ROOT / "bin").iterdir())]
    for text in texts:
        commands = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
        assert not [line for line in commands if re.search(r"\bdate\b.*\s-d\s", line)]
        assert not [line for line in commands if "sha1sum" in line]

"""Every background concern's Config validates itself, naming the field out of range."""

import subprocess
import sys
from pathlib import Path

import pytest

from dispatch.completer import CompleterConfig
from dispatch.materializer import MaterializerConfig
from dispatch.promoter import PromoterConfig
from dispatch.pruner import PrunerConfig
from dispatch.reaper import ReaperConfig
from dispatch.reconciler import ReconcileConfig
from dispatch.relay import RelayConfig
from dispatch.scheduler import SchedulerConfig


@pytest.mark.parametrize(
    "config, field, value",
    [
        (SchedulerConfig, "batch_size", 0),
        (SchedulerConfig, "poll_interval", 0),
        (MaterializerConfig, "batch_size", 0),
        (PromoterConfig, "batch_size", -1),
        (CompleterConfig, "batch_size", 0),
        (PrunerConfig, "poll_interval", -1),
        (PrunerConfig, "logs_retention_days", -1),
        (ReaperConfig, "lock_timeout_seconds", 0),
        (ReconcileConfig, "queued_after_seconds", 0),
        (ReconcileConfig, "max_republish", -1),
        (RelayConfig, "confirm_timeout", 0),
    ],
)
def test_a_config_out_of_range_is_refused_by_name(config, field, value):
    with pytest.raises(ValueError, match=rf"{config.__name__}\.{field} "):
        config(**{field: value})


def test_the_defaults_are_valid():
    for config in (SchedulerConfig, MaterializerConfig, PromoterConfig, CompleterConfig,
                   PrunerConfig, ReaperConfig, ReconcileConfig, RelayConfig):  # fmt: skip
        config()


@pytest.mark.parametrize(
    "command, option, field",
    [
        ("scheduler", "--poll-interval", "poll_interval"),
        ("scheduler", "--reconcile-interval", "poll_interval"),
        ("scheduler", "--partition-lease-seconds", "lease_seconds"),
        ("relay", "--batch-size", "batch_size"),
    ],
)
def test_a_command_refuses_an_option_out_of_range_with_a_message(command, option, field):
    """A clear error and a non-zero exit, not a traceback from a thread."""
    result = subprocess.run(
        [sys.executable, "manage.py", command, option, "0", "--max-steps", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.returncode != 0
    assert f"{field} must be" in result.stderr
    assert "Traceback" not in result.stderr

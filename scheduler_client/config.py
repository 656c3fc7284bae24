"""Where the client finds its server and token: `SCHEDULER_URL` and `SCHEDULER_TOKEN`, else
a profile of the file `<user config dir>/schedctl/config.toml` (platformdirs: e.g.
`~/.config/schedctl/config.toml` on Linux), chosen by `--profile`, `SCHEDULER_PROFILE`, or
the file's `default`:

    default = "local"

    [profiles.local]
    url = "http://127.0.0.1:8000"
    token = "..."

`SCHEDULER_CONFIG` names another file. Environment variables win over the profile.
`SCHEDULER_RETRIES` (or a profile's `retries`, default 8): how many times a request is
retried after a dropped connection, 429, 502, 503 or 504.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

DEFAULT_URL = "http://127.0.0.1:8000"


@dataclass(frozen=True)
class Settings:
    url: str
    token: str | None
    profile: str | None
    retries: int = 8


def config_path() -> Path:
    if os.environ.get("SCHEDULER_CONFIG"):
        return Path(os.environ["SCHEDULER_CONFIG"])
    try:
        from platformdirs import user_config_dir
    except ImportError:  # platformdirs is optional for the library alone
        base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
        return base / "schedctl" / "config.toml"
    return Path(user_config_dir("schedctl")) / "config.toml"


def settings_load(*, profile: str | None = None) -> Settings:
    profile = profile or os.environ.get("SCHEDULER_PROFILE")
    found: dict = {}
    path = config_path()
    if path.exists():
        document = tomllib.loads(path.read_text())
        profile = profile or document.get("default")
        profiles = document.get("profiles", {})
        if profile is not None:
            if profile not in profiles:
                raise ValueError(f"no profile {profile!r} in {path}")
            found = profiles[profile]
    elif profile is not None:
        raise ValueError(f"no profile {profile!r}: {path} does not exist")
    return Settings(
        url=os.environ.get("SCHEDULER_URL") or found.get("url") or DEFAULT_URL,
        token=os.environ.get("SCHEDULER_TOKEN") or found.get("token"),
        profile=profile,
        retries=int(os.environ.get("SCHEDULER_RETRIES") or found.get("retries") or 8),
    )

"""`python -m scheduler_project.embedded start|stop|status`: the embedded PostgreSQL of var/
(SCHEDULER_VAR_DIR), e.g. to stop one that a lone `manage.py` command started."""

import sys

from scheduler_project.settings import env

from . import EmbeddedPostgres


def main(argv: list[str]) -> int:
    server = EmbeddedPostgres(env.VAR_DIR / "postgres")
    action = argv[0] if argv else "status"
    if action == "start":
        print("started" if server.start() else "already running")
    elif action == "stop":
        print("stopped" if server.stop() else "not running")
    elif action == "status":
        print(f"{'running' if server.answers() else 'stopped'}: {server.data_dir}, "
              f"socket in {server.socket_dir}")  # fmt: skip
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The database backend of the embedded PostgreSQL: Django's PostgreSQL backend, which starts
the server (scheduler_project.embedded) when a new connection finds none listening."""

from pathlib import Path

from django.db.backends.postgresql import base

from . import EmbeddedPostgres


class DatabaseWrapper(base.DatabaseWrapper):
    @property
    def embedded_server(self) -> EmbeddedPostgres:
        """The server behind this connection (`standalone` starts and stops it)."""
        return EmbeddedPostgres(Path(self.settings_dict["EMBEDDED_DATA_DIR"]))

    def get_new_connection(self, conn_params):
        try:
            return super().get_new_connection(conn_params)
        except base.Database.OperationalError:
            # Not started yet, stopped, or being started by another process: once it runs
            # (this process starting it, or waiting for the one that does), try again.
            try:
                self.embedded_server.start()
            except RuntimeError as exc:
                # A server that cannot start is an outage like any other to the callers,
                # whose retries and republication catch the driver's OperationalError.
                raise base.Database.OperationalError(str(exc)) from exc
            return super().get_new_connection(conn_params)

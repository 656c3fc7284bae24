"""A webhook receiver for tests: a real HTTP server on loopback (threading http.server)
that keeps every request it gets, answering 500 while `failing` is set."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def documented_verify():
    """The signature check exactly as docs/webhooks.md gives it to receivers."""
    text = (ROOT / "docs" / "webhooks.md").read_text()
    [code] = [block for block in re.findall(r"```python\n(.*?)```", text, re.S)
              if "def verify" in block]  # fmt: skip
    namespace: dict = {}
    exec(code, namespace)  # noqa: S102 - the documented recipe, run as a reader would
    return namespace["verify"]


class Receiver:
    def __init__(self, *, delay: float = 0.0) -> None:
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        self.failing = threading.Event()
        self.in_flight = 0  # requests read, not answered yet
        self.delay = delay  # seconds each request is held before its answer
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with receiver.lock:
                    receiver.in_flight += 1
                if receiver.delay:
                    threading.Event().wait(receiver.delay)
                status = 500 if receiver.failing.is_set() else 200
                with receiver.lock:
                    receiver.in_flight -= 1
                    receiver.requests.append(
                        {
                            "headers": dict(self.headers),
                            "body": body,
                            "status": status,
                            "json": json.loads(body),
                        }  # fmt: skip
                    )
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Receiver:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def accepted(self) -> list[dict]:
        with self.lock:
            return [request for request in self.requests if request["status"] == 200]

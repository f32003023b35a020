"""A real HTTP receiver of webhooks for tests: http.server on 127.0.0.1 in a thread, recording every request.

`refuse_first` answers the first N requests 503; `respond` may answer any request with (status, headers) instead,
e.g. a redirect or a hang. Receivers verify with `service.policy.webhook_rules.verify`, as a user's would.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    at: float
    status: int

    @property
    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Receiver:
    port: int = 0
    refuse_first: int = 0
    respond: Callable[[str, int], tuple[int, dict[str, str]] | None] | None = None
    requests: list[Received] = field(default_factory=list)  # answered ones, in the order answered
    arrivals: list[float] = field(default_factory=list)  # when each request came in (answered or not yet)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def url(self, path: str = "/hook") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def accepted(self) -> list[Received]:
        with self.lock:
            return [r for r in self.requests if 200 <= r.status < 300]

    def handle(self, path: str, headers: dict[str, str], body: bytes) -> tuple[int, dict[str, str]]:
        arrived = time.time()
        with self.lock:
            n = len(self.arrivals)
            self.arrivals.append(arrived)
        answer = self.respond(path, n) if self.respond else None
        if answer is None:
            answer = (503, {}) if n < self.refuse_first else (204, {})
        with self.lock:
            self.requests.append(Received(path, headers, body, arrived, answer[0]))
        return answer


@contextmanager
def running_receiver(**kw: Any) -> Iterator[Receiver]:
    receiver = Receiver(**kw)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            status, extra = receiver.handle(self.path, {k.lower(): v for k, v in self.headers.items()}, body)
            self.send_response(status)
            for key, value in extra.items():
                self.send_header(key, value)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", receiver.port), Handler)
    server.daemon_threads = True
    receiver.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()

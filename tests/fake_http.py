"""A local HTTP server for tests: fixed or computed answers per path, the requests it saw."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Route = tuple[int, str]  # status, body (JSON when it starts with { or [)
Answer = Route | Callable[[Any], Route]  # a fixed answer, or one computed from the JSON body posted


class FakeServer:
    """Answers GET and POST on fixed routes; every other path is a 404 JSON error. With `key`, a
    request without `Authorization: Bearer KEY` gets a 401."""

    def __init__(self, routes: dict[str, Answer], key: str | None = None) -> None:
        self.routes, self.key = routes, key
        self.authorizations: list[str | None] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self._answer(None)

            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                self._answer(json.loads(self.rfile.read(n) or b"null"))

            def _answer(self, posted: Any) -> None:
                outer.authorizations.append(self.headers.get("Authorization"))
                route = outer.routes.get(self.path, (404, '{"detail": "Not Found"}'))
                if outer.key and self.headers.get("Authorization") != f"Bearer {outer.key}":
                    status, body = 401, '{"error": "Invalid API Key"}'
                else:
                    status, body = route(posted) if callable(route) else route
                data = body.encode()
                kind = "application/json" if body[:1] in "{[" else "text/plain; version=0.0.4"
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

"""`polyrl view`'s HTTP server (the standard library's): one page (static/index.html, app.js, app.css), a JSON API
over runs.py's readers, and the files the page shows (paths.py decides which).

    GET /                       the page
    GET /api/runs               {"roots", "runs": [summary...], "evals": [summary...]}
    GET /api/metrics?run=ID     {"rows": [metrics.jsonl rows], "note"}
    GET /api/samples?run=ID     {"steps": [{step, files, rows}], "grid"}
    GET /files/ID/PATH          a file of a run or evaluation (403 outside the roots, 404 for what is not served)

Only GET and HEAD are answered; nothing is ever written. Bound to a loopback address, it also refuses requests
whose Host header names another host (a web page elsewhere cannot reach it through DNS rebinding).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from .paths import Refused, served_file
from .runs import Reader, find

STATIC = Path(__file__).parent / "static"
PAGES = {"/": ("index.html", "text/html; charset=utf-8"), "/app.js": ("app.js", "text/javascript; charset=utf-8"),
         "/app.css": ("app.css", "text/css; charset=utf-8"), "/favicon.svg": ("favicon.svg", "image/svg+xml"),
         "/favicon.ico": ("favicon.svg", "image/svg+xml")}
# the page loads only its own files and the runs' files: nothing from elsewhere, no inline script
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; media-src 'self'; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}


class View:
    """The roots, their readers, and the ids `find` last returned (the only ids the API accepts)."""

    def __init__(self, roots: list[Path]):
        self.reader = Reader(roots)
        self.lock = threading.Lock()
        self.runs: list[str] = []
        self.evals: list[str] = []

    def listing(self) -> dict:
        with self.lock:
            self.runs, self.evals = find(self.reader.roots)
            now = time.time()
            runs = [self.reader.run_summary(i, now) for i in self.runs]
            evals = [self.reader.eval_summary(i) for i in self.evals]
        return {"roots": [str(r) for r in self.reader.roots], "runs": runs, "evals": evals}

    def known_run(self, ident: str) -> bool:
        with self.lock:
            if ident not in self.runs:
                self.runs, self.evals = find(self.reader.roots)
            return ident in self.runs


def make_handler(view: View, host: str):
    loopback = host in LOOPBACK

    class Handler(BaseHTTPRequestHandler):
        server_version = "polyrl-view"
        sys_version = ""

        def log_message(self, format, *args):  # quiet: the page polls every few seconds
            pass

        def _send(self, code: int, body: bytes, kind: str, head: bool = False) -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Content-Security-Policy", CSP)
            self.send_header("Referrer-Policy", "no-referrer")
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _error(self, code: int, message: str, head: bool) -> None:
            self._send(code, json.dumps({"error": message}).encode(), "application/json", head)

        def _json(self, value, head: bool) -> None:
            self._send(200, json.dumps(value, allow_nan=False, default=str).encode(), "application/json", head)

        def _host_ok(self) -> bool:
            if not loopback:
                return True
            name = (self.headers.get("Host") or "").strip().lower()
            name = name.rsplit(":", 1)[0] if not name.endswith("]") else name
            return name in LOOPBACK

        def do_HEAD(self):
            self._get(head=True)

        def do_GET(self):
            self._get(head=False)

        def _get(self, head: bool) -> None:
            if not self._host_ok():
                return self._error(403, "unknown Host header", head)
            url = urlsplit(self.path)
            path, query = url.path, parse_qs(url.query)
            try:
                if path in PAGES:
                    name, kind = PAGES[path]
                    return self._send(200, (STATIC / name).read_bytes(), kind, head)
                if path == "/api/runs":
                    return self._json(_finite(view.listing()), head)
                if path in ("/api/metrics", "/api/samples"):
                    ident = (query.get("run") or [""])[0]
                    if not view.known_run(ident):
                        return self._error(404, "no such run", head)
                    run_dir = view.reader.path_of(ident)
                    if path == "/api/metrics":
                        rows, note = view.reader.metrics(run_dir)
                        return self._json(_finite({"rows": rows, "note": note}), head)
                    return self._json(_finite(view.reader.samples(ident)), head)
                if path.startswith("/files/"):
                    found = served_file(view.reader.roots, path[len("/files/"):])
                    if found is None:
                        return self._error(404, "no such file", head)
                    return self._send(200, found[0].read_bytes(), found[1], head)
            except Refused:
                return self._error(403, "outside the directories being viewed", head)
            except (UnicodeDecodeError, ValueError):
                return self._error(404, "no such file", head)
            except OSError:
                return self._error(404, "could not be read", head)
            return self._error(404, "not found", head)

        def _refuse(self):
            self._error(405, "read-only: only GET and HEAD", False)

        do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse

    return Handler


def _finite(value):
    """JSON has no NaN or infinity: they become null (a diverged run's metrics still load)."""
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def make_server(roots: list[Path], host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """A server over `roots` bound to (host, port) (port 0: any free one); `serve_forever` runs it."""
    import socket

    view = View(roots)
    cls = ThreadingHTTPServer
    if ":" in host:  # an IPv6 address
        cls = type("ThreadingHTTPServer6", (ThreadingHTTPServer,), {"address_family": socket.AF_INET6})
    server = cls((host.strip("[]"), port), make_handler(view, host))
    server.daemon_threads = True
    server.view = view
    return server


def serve(roots: list[Path], host: str = "127.0.0.1", port: int = 8765) -> int:
    """Serve until Ctrl-C; prints where."""
    server = make_server(roots, host, port)
    runs, evals = find(server.view.reader.roots)
    shown = host if ":" not in host else f"[{host}]"
    print(f"polyrl: viewing {len(runs)} runs and {len(evals)} evaluations under "
          f"{', '.join(str(r) for r in roots)} at http://{shown}:{server.server_address[1]}/ (Ctrl-C stops)",
          file=sys.stderr, flush=True)
    if host not in LOOPBACK:
        print(f"polyrl: warning: --host {host}: anyone who can reach this machine can read these runs' files",
              file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0

"""A real OpenAI-compatible judge server for the tests (`transformers serve` on a tiny judge, a process of its own)
and a small fault-injecting proxy in front of it (429s, slow answers, the server gone)."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

DEAD = "http://127.0.0.1:9"  # nothing listens on the discard port: a connection there is refused (ConnectError)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServedJudge:
    """`transformers serve MODEL_DIR` on the CPU at 127.0.0.1:port (its API process and the model's process); `start`
    waits for GET /health, `kill` SIGKILLs both (the server dies as it would on a crashed machine)."""

    def __init__(self, model_dir, log_path, port: int | None = None):
        self.model_dir, self.log_path, self.port = str(model_dir), log_path, port or free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 180.0) -> "ServedJudge":
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1",
               "TRANSFORMERS_VERBOSITY": "error"}
        cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", self.model_dir, "--device", "cpu",
               "--dtype", "float32", "--trust-remote-code", "--host", "127.0.0.1", "--port", str(self.port),
               "--log-level", "warning"]
        log = open(self.log_path, "ab")  # noqa: SIM115  (the server writes it for its whole life)
        # a session of its own: `kill` ends the server and its model process together
        self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"transformers serve exited ({self.proc.returncode}): "
                                   f"{open(self.log_path).read()[-3000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"transformers serve did not answer in {timeout:.0f} s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class FaultProxy:
    """An HTTP proxy to `upstream` (a base URL with /v1) on a thread. Every request must carry `Authorization:
    Bearer <key>` when `key` is set (401 otherwise). `plan(n, path)` is asked for the n-th POST (0-based) and answers
    None (forward it), ("status", code, retry_after or None), ("delay", seconds) (forward after waiting) or
    ("down",) (the upstream is gone from this request on, until `restore()`: every forward goes to a port nothing
    listens on, fails with a real ConnectError, and the proxy answers 502, as a gateway does when its server died;
    no second server start is needed to bring it back). `log` holds (monotonic arrival time, method, path, the fault
    applied) per request."""

    def __init__(self, upstream: str, key: str | None = None, plan=None):
        self.upstream, self.key, self.plan = upstream.rstrip("/"), key, plan or (lambda n, path: None)
        self.log: list[tuple[float, str, str, str]] = []
        self.posts, self.lock, self.down = 0, threading.Lock(), False
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _reply(self, code: int, body: bytes, headers: dict | None = None, kind: str = "application/json"):
                try:
                    self.send_response(code)
                    for k, v in {"Content-Type": kind, "Content-Length": str(len(body)),
                                 **(headers or {})}.items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (its timeout)
                    pass

            def _handle(self, method: str):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) if method == "POST" else None
                fault = None
                with proxy.lock:
                    if method == "POST":
                        fault = proxy.plan(proxy.posts, self.path)
                        proxy.posts += 1
                    if fault is not None and fault[0] == "down":
                        proxy.down = True
                    down = proxy.down
                    proxy.log.append((time.monotonic(), method, self.path, repr(fault)))
                if proxy.key is not None and self.headers.get("Authorization") != f"Bearer {proxy.key}":
                    return self._reply(401, json.dumps({"error": "invalid API key"}).encode())
                if fault is not None and fault[0] == "status":
                    extra = {"Retry-After": str(fault[2])} if fault[2] is not None else {}
                    return self._reply(fault[1], json.dumps({"error": f"injected {fault[1]}"}).encode(), extra)
                if fault is not None and fault[0] == "delay":
                    time.sleep(fault[1])
                upstream = DEAD if down else proxy.upstream
                url = upstream + self.path.removeprefix("/v1")
                try:
                    resp = httpx.request(method, url, content=body, timeout=60,
                                         headers={"Content-Type": self.headers.get("Content-Type", "")})
                except httpx.TransportError as e:
                    return self._reply(502, f"upstream {type(e).__name__}".encode(), kind="text/plain")
                self._reply(resp.status_code, resp.content)

            def do_GET(self):
                self._handle("GET")

            def do_POST(self):
                self._handle("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "FaultProxy":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def restore(self) -> None:
        """The upstream is back (after a ("down",) fault)."""
        with self.lock:
            self.down = False

    def post_times(self) -> list[float]:
        return [t for t, method, _, _ in self.log if method == "POST"]

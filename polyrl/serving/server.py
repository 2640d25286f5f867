"""The reward server: any registered reward behind `POST /score` (FastAPI), batched across requests.

    GET  /health  -> {"status": "ok", "reward": name, "limits": {...}, "stats": {...}}   (no token needed)
    POST /score   {"images": [base64 PNG/JPEG], "prompts": [...], "metadata": [{...}, ...]}   (metadata optional)
               -> {"scores": [...], "extras": {name: [per sample] | value}, "request_id": "..."}

The `X-Request-ID` request header is echoed in the body and the response header (a new id when absent), so a
client can check that each answer belongs to its request. Errors are JSON `{"detail": message}`:
400 malformed JSON, 401 missing/wrong bearer token, 413 body / image count / image pixels over a limit,
422 a well-formed request that breaks the contract (or that the scorer rejects with a ValueError),
500 the scorer raised or returned a wrong number of / non-finite scores (never a made-up score).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import socket
import threading
import uuid
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from .batching import BatchingScorer, ScorerFailed
from .codec import ImageDecodeError, ImageTooLarge, decode_image, stack_images


@dataclass
class ServerLimits:
    max_body_bytes: int = 64 * 2**20  # one request's JSON body
    max_images: int = 512  # images in one request
    max_image_pixels: int = 4096 * 4096  # width * height of one image
    max_batch: int = 64  # images per scorer call, merged across requests
    max_wait_ms: float = 5.0  # how long a scorer call waits for more requests to merge


class _HTTPError(Exception):
    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status, self.detail = status, detail


def _parse_request(body: bytes, limits: ServerLimits):
    """JSON body -> (images tensor, prompts, metadata); raises _HTTPError with the reason."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _HTTPError(400, f"malformed JSON: {e}") from None
    if not isinstance(data, dict):
        raise _HTTPError(422, f"the body must be a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - {"images", "prompts", "metadata"})
    if unknown:
        raise _HTTPError(422, f"unknown field(s) {', '.join(unknown)}; allowed: images, prompts, metadata")
    images, prompts = data.get("images"), data.get("prompts")
    if not isinstance(images, list) or not images:
        raise _HTTPError(422, "'images' must be a non-empty list of base64 PNG or JPEG strings")
    if len(images) > limits.max_images:
        raise _HTTPError(413, f"{len(images)} images in one request; the limit is {limits.max_images}")
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise _HTTPError(422, "'prompts' must be a list of strings")
    if len(prompts) != len(images):
        raise _HTTPError(422, f"got {len(images)} images but {len(prompts)} prompts")
    metadata = data.get("metadata")
    if metadata is None:
        metadata = [{} for _ in images]
    if not isinstance(metadata, list) or not all(isinstance(m, dict) for m in metadata):
        raise _HTTPError(422, "'metadata' must be a list of objects")
    if len(metadata) != len(images):
        raise _HTTPError(422, f"got {len(images)} images but {len(metadata)} metadata entries")
    pixels = []
    for i, item in enumerate(images):
        try:
            pixels.append(decode_image(item, limits.max_image_pixels))
        except ImageTooLarge as e:
            raise _HTTPError(413, f"images[{i}]: {e}") from None
        except ImageDecodeError as e:
            raise _HTTPError(422, f"images[{i}]: {e}") from None
    try:
        return stack_images(pixels), prompts, metadata
    except ImageDecodeError as e:
        raise _HTTPError(422, str(e)) from None


def create_app(reward, name: str = "reward", limits: ServerLimits | None = None, token: str | None = None):
    """A FastAPI app serving `reward` (any callable `(images, prompts, metadata) -> RewardOutput`)."""
    limits = limits or ServerLimits()
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app):
        yield
        if "scorer" in state:
            state["scorer"].close()

    app = FastAPI(title=f"polyrl reward server ({name})", docs_url=None, redoc_url=None, lifespan=lifespan)

    def scorer() -> BatchingScorer:  # made inside the server's event loop
        if "scorer" not in state:
            state["scorer"] = BatchingScorer(reward, limits.max_batch, limits.max_wait_ms / 1000.0)
        return state["scorer"]

    def error(status: int, detail: str, rid: str | None = None) -> JSONResponse:
        headers = {"X-Request-ID": rid} if rid else {}
        if status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse({"detail": detail, "request_id": rid}, status_code=status, headers=headers)

    @app.get("/health")
    async def health():
        stats = state["scorer"].stats if "scorer" in state else {}
        return {"status": "ok", "reward": name, "limits": asdict(limits), "stats": stats}

    @app.post("/score")
    async def score(request: Request):
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        if token is not None:
            auth = request.headers.get("authorization", "")
            scheme, _, given = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), token.encode()):
                return error(401, "missing or wrong bearer token (send 'Authorization: Bearer <token>')", rid)
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
            return error(413, f"body of {declared} bytes is over the limit of {limits.max_body_bytes} bytes", rid)
        body = bytearray()
        async for chunk in request.stream():  # also bounds chunked bodies that declare no length
            body += chunk
            if len(body) > limits.max_body_bytes:
                return error(413, f"body is over the limit of {limits.max_body_bytes} bytes", rid)
        try:
            images, prompts, metadata = await asyncio.to_thread(_parse_request, bytes(body), limits)
        except _HTTPError as e:
            return error(e.status, e.detail, rid)
        try:
            scores, per_sample, other = await scorer().score(images, prompts, metadata)
        except ScorerFailed as e:
            return error(422 if e.rejected_input else 500, str(e), rid)
        return JSONResponse({"scores": scores, "extras": {**other, **per_sample}, "request_id": rid},
                            headers={"X-Request-ID": rid})

    return app


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0: a free port; read it back with `sock.getsockname()[1]`)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Run `app` with uvicorn in this thread until interrupted."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)


class BackgroundServer:
    """`with BackgroundServer(app) as srv: ... srv.url ...`: uvicorn in a daemon thread on a loopback port."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.sock = bind_socket(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="polyrl-reward-server")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> BackgroundServer:
        self.thread.start()
        for _ in range(500):
            if self.server.started:
                return self
            if not self.thread.is_alive():
                raise RuntimeError("the reward server thread exited during startup")
            threading.Event().wait(0.01)
        raise RuntimeError("the reward server did not start within 5 s")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

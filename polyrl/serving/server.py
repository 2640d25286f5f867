"""The reward server: any registered reward behind `POST /score` (FastAPI), batched across requests.

    GET  /health  -> {"status": "ok", "reward": name, "media": [...], "limits": {...}, "stats": {...}}  (no token)
    POST /score   {<one media field>, "prompts": [...], "metadata": [{...}, ...]}   (metadata optional)
               -> {"scores": [...], "extras": {name: [per sample] | value}, "request_id": "..."}

The media field is exactly one of (codec: `polyrl.rewards.codec`):

    "images": [base64 PNG/JPEG, ...]                          one size per request      -> (B, 3, H, W)
    "videos": [[base64 PNG/JPEG frame, ...] | base64 mp4, ...] one (T, H, W) per request -> (B, T, 3, H, W)
    "audio":  [base64 WAV (16-bit PCM), ...]                  one rate, channels, length -> Audio

and the reward is called through `call_reward`: an image scorer scores video by its sampled frames
(`reward.frames`), audio reaches only a reward that reads audio.

The `X-Request-ID` request header is echoed in the body and the response header (a new id when absent), so a
client can check that each answer belongs to its request. Errors are JSON `{"detail": message}`:
400 malformed JSON, 401 missing/wrong bearer token, 413 body / item count / pixels / frames / audio length over
a limit (read from the headers, before pixels or samples are decoded), 422 a well-formed request that breaks
the contract (or that the scorer rejects with a ValueError), 500 the scorer raised or returned a wrong number
of / non-finite scores (never a made-up score).
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

from ..rewards.base import reward_inputs, reward_media
from ..rewards.codec import (
    MediaDecodeError,
    MediaTooLarge,
    PixelBudget,
    decode_audio,
    decode_image,
    decode_video,
    stack_audio,
    stack_images,
    stack_videos,
)
from .batching import BatchingScorer, ScorerFailed

MEDIA_FIELDS = {"images": "images", "videos": "video", "audio": "audio"}  # request field -> media kind
ITEM = {"images": "base64 PNG or JPEG strings", "videos": "videos (lists of base64 PNG/JPEG frames or base64 mp4 "
        "strings)", "audio": "base64 WAV (16-bit PCM) strings"}


@dataclass
class ServerLimits:
    max_body_bytes: int = 64 * 2**20  # one request's JSON body
    max_images: int = 512  # images, videos or audio clips in one request
    max_image_pixels: int = 4096 * 4096  # width * height of one image or video frame
    max_frames: int = 256  # frames of one video
    max_request_pixels: int = 2**28  # width * height summed over all images / frames of one request (decoded size)
    max_audio_seconds: float = 600.0  # length of one audio clip
    max_batch: int = 64  # samples (images, videos, clips) per scorer call, merged across requests
    max_wait_ms: float = 5.0  # how long a scorer call waits for more requests to merge


class _HTTPError(Exception):
    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status, self.detail = status, detail


def accepted_media(reward) -> list[str]:
    """The request fields a reward can be sent: its own media, and videos too for an image scorer."""
    native = reward_media(reward) if "images" in reward_inputs(reward) else frozenset()
    return [f for f, kind in MEDIA_FIELDS.items() if kind in native or (kind == "video" and "images" in native)]


def _decode_items(field: str, items: list, limits: ServerLimits):
    """The decoded media of one request; 413 / 422 naming the item (`videos[1]: frame 3: ...`)."""
    budget = PixelBudget(limits.max_request_pixels)
    decoded = []
    for i, item in enumerate(items):
        try:
            if field == "images":
                decoded.append(decode_image(item, limits.max_image_pixels, budget))
            elif field == "videos":
                decoded.append(decode_video(item, limits.max_frames, limits.max_image_pixels, budget))
            else:
                decoded.append(decode_audio(item, limits.max_audio_seconds))
        except MediaTooLarge as e:
            raise _HTTPError(413, f"{field}[{i}]: {e}") from None
        except MediaDecodeError as e:
            raise _HTTPError(422, f"{field}[{i}]: {e}") from None
    stack = {"images": stack_images, "videos": stack_videos, "audio": stack_audio}[field]
    try:
        return stack(decoded)
    except MediaDecodeError as e:
        raise _HTTPError(422, str(e)) from None


def _parse_request(body: bytes, limits: ServerLimits, accepted: list[str] | None = None):
    """JSON body -> (media, prompts, metadata); raises _HTTPError with the reason. `accepted`: the media fields
    the served reward reads (a request for another kind is refused before anything is decoded)."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _HTTPError(400, f"malformed JSON: {e}") from None
    if not isinstance(data, dict):
        raise _HTTPError(422, f"the body must be a JSON object, got {type(data).__name__}")
    allowed = [*MEDIA_FIELDS, "prompts", "metadata"]
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise _HTTPError(422, f"unknown field(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}")
    fields = [f for f in MEDIA_FIELDS if f in data]
    if len(fields) != 1:
        raise _HTTPError(422, f"a request carries exactly one of {', '.join(MEDIA_FIELDS)}; got "
                              f"{', '.join(fields) or 'none'}")
    field = fields[0]
    items, prompts = data[field], data.get("prompts")
    if not isinstance(items, list) or not items:
        raise _HTTPError(422, f"'{field}' must be a non-empty list of {ITEM[field]}")
    if accepted is not None and field not in accepted:
        raise _HTTPError(422, f"this server's reward cannot score {field}; it accepts "
                              f"{', '.join(accepted) or 'no decoded media (it reads latents only)'}")
    if len(items) > limits.max_images:
        raise _HTTPError(413, f"{len(items)} {field} in one request; the limit is {limits.max_images}")
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise _HTTPError(422, "'prompts' must be a list of strings")
    if len(prompts) != len(items):
        raise _HTTPError(422, f"got {len(items)} {field} but {len(prompts)} prompts")
    metadata = data.get("metadata")
    if metadata is None:
        metadata = [{} for _ in items]
    if not isinstance(metadata, list) or not all(isinstance(m, dict) for m in metadata):
        raise _HTTPError(422, "'metadata' must be a list of objects")
    if len(metadata) != len(items):
        raise _HTTPError(422, f"got {len(items)} {field} but {len(metadata)} metadata entries")
    return _decode_items(field, items, limits), prompts, metadata


def create_app(reward, name: str = "reward", limits: ServerLimits | None = None, token: str | None = None):
    """A FastAPI app serving `reward` (any callable `(media, prompts, metadata) -> RewardOutput`, called through
    `call_reward`; its `media` attribute says which kinds it reads, images when absent)."""
    limits = limits or ServerLimits()
    accepted = accepted_media(reward)
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
        return {"status": "ok", "reward": name, "media": accepted, "limits": asdict(limits), "stats": stats}

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
            media, prompts, metadata = await asyncio.to_thread(_parse_request, bytes(body), limits, accepted)
        except _HTTPError as e:
            return error(e.status, e.detail, rid)
        try:
            scores, per_sample, other = await scorer().score(media, prompts, metadata)
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

"""The reward server: any registered reward behind `POST /score` (FastAPI), batched across requests.

    GET  /health  -> {"status": "ok", "reward": name, "media": [...], "limits": {...}, "stats": {...}}  (no token)
    POST /score   {<one media field>, "prompts": [...], "metadata": [{...}, ...]}   (metadata optional)
               -> {"scores": [...], "extras": {name: [per sample] | value}, "request_id": "..."}

The media field is exactly one of (codec: `polyrl.rewards.codec`):

    "images": [base64 PNG/JPEG, ...]                          one size per request      -> (B, 3, H, W)
    "videos": [[base64 PNG/JPEG frame, ...] | base64 mp4, ...] one (T, H, W) per request -> (B, T, 3, H, W)
    "audio":  [base64 WAV (16-bit PCM), ...]                  one rate, channels, length -> Audio
    "texts":  [string, ...]                                   a token policy's responses -> list[str]

A served group reward (`"groupwise": true` in /health; docs/rewards.md "Group rewards") needs `"groups": [id, ...]`,
one id (an integer or a string) per sample, each group's members next to each other and the request holding every
member of its groups: a request without it is refused (422). Any server accepts `groups`; a per-sample reward
ignores it. Requests are never cut inside a group, and groups of different requests never share an id in a call.

and the reward is called through `call_reward`: an image scorer scores video by its sampled frames
(`reward.frames`), audio reaches only a reward that reads audio.

A request goes: body (within `body_timeout_s`) -> JSON and contract -> every file's header read and its pixels
counted (nothing decoded) -> those pixels reserved from the in-flight budget (`max_inflight_pixels`; 503 with
`Retry-After` when it is spent) -> decoded to uint8 -> scored (float only inside a scorer call of at most
`max_call_pixels`) -> the reservation is given back. So the decoded memory of everything in flight is bounded
before it is spent.

The `X-Request-ID` request header is echoed in the body and the response header (a new id when absent), so a
client can check that each answer belongs to its request. Errors are JSON `{"detail": message}`:
400 malformed JSON (also nested too deeply), 401 missing/wrong bearer token, 408 the body or the headers did
not arrive in time, 413 body / item count / pixels / frames / audio length over a limit (read from the headers,
before pixels or samples are decoded), 422 a well-formed request that breaks the contract (or that the scorer
rejects with a ValueError), 500 the scorer raised or returned a wrong number of / non-finite scores (never a
made-up score), 503 busy (in-flight pixels or connections over their limit; retry after `Retry-After` s).
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

import numpy as np
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ..rewards.base import is_groupwise, reward_inputs, reward_media
from ..rewards.codec import (
    MediaDecodeError,
    MediaTooLarge,
    PixelBudget,
    decode_audio,
    decode_image_file,
    decode_video_file,
    one_size,
    read_image,
    read_video,
    stack_audio,
)
from .batching import BatchingScorer, ScorerFailed
from .connections import RETRY_AFTER_S, guarded_protocol

MEDIA_FIELDS = {"images": "images", "videos": "video", "audio": "audio", "texts": "text"}  # request field -> media kind
ITEM = {"images": "base64 PNG or JPEG strings", "videos": "videos (lists of base64 PNG/JPEG frames or base64 mp4 "
        "strings)", "audio": "base64 WAV (16-bit PCM) strings", "texts": "strings (a token policy's responses)"}


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
    # memory: decoded pixels are uint8 (3 bytes each) until a scorer call turns its share to float32 (12 bytes)
    max_inflight_pixels: int = 2**29  # decoded pixels of all requests being decoded, queued or scored (503 over)
    max_call_pixels: int = 2**25  # pixels per scorer call (its float32 copy: at most 12 bytes each)
    # connections (uvicorn's limit_concurrency, timeout_keep_alive, h11 header size; the deadlines are ours)
    max_connections: int = 256  # open connections or requests in progress; a request over it gets a 503
    header_timeout_s: float = 10.0  # a request's headers must be complete this long after the connection opens
    body_timeout_s: float = 60.0  # the whole body must arrive this long after its headers (else 408)
    keep_alive_s: float = 5.0  # an idle connection between requests is closed after this long
    max_header_bytes: int = 16 * 2**10  # request line + headers (larger: uvicorn's 400)

    def __post_init__(self):
        if self.max_request_pixels > self.max_inflight_pixels:
            raise ValueError(f"max_request_pixels={self.max_request_pixels} is over max_inflight_pixels="
                             f"{self.max_inflight_pixels}: a request that large could never be admitted")
        for name in ("max_body_bytes", "max_images", "max_image_pixels", "max_frames", "max_request_pixels",
                     "max_batch", "max_inflight_pixels", "max_call_pixels", "max_connections", "max_header_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("max_audio_seconds", "header_timeout_s", "body_timeout_s", "keep_alive_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        if self.max_wait_ms < 0:
            raise ValueError(f"max_wait_ms={self.max_wait_ms} must be >= 0")


class _HTTPError(Exception):
    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status, self.detail = status, detail


def accepted_media(reward) -> list[str]:
    """The request fields a reward can be sent: its own media, and videos too for an image scorer."""
    native = reward_media(reward) if "images" in reward_inputs(reward) else frozenset()
    return [f for f, kind in MEDIA_FIELDS.items() if kind in native or (kind == "video" and "images" in native)]


@dataclass
class _Request:
    """A request whose contract is checked and whose files' headers are read; nothing decoded yet."""

    field: str  # "images" | "videos" | "audio"
    items: list  # ImageFile / VideoFile per item; the base64 strings for audio
    prompts: list[str]
    metadata: list[dict]
    pixels: int  # what its images / frames decode to (width * height summed), 0 for audio
    groups: list | None = None  # per-sample group ids (members contiguous), for a group reward


def _read_headers(field: str, items: list, limits: ServerLimits) -> tuple[list, int]:
    """Every item's header (size, frame count) checked against the limits and its pixels counted, before any
    pixel is decoded: 413 / 422 naming the item (`videos[1]: frame 3: ...`)."""
    if field == "audio":
        return items, 0  # a WAV's length is checked on its header when it is decoded (decode_wav)
    if field == "texts":  # nothing to decode: each item must be a string
        bad = next((i for i, item in enumerate(items) if not isinstance(item, str)), None)
        if bad is not None:
            raise _HTTPError(422, f"texts[{bad}]: expected a string, got {type(items[bad]).__name__}")
        return items, 0
    budget = PixelBudget(limits.max_request_pixels)
    files = []
    for i, item in enumerate(items):
        try:
            if field == "images":
                files.append(read_image(item, limits.max_image_pixels, budget))
            else:
                files.append(read_video(item, limits.max_frames, limits.max_image_pixels, budget))
        except MediaTooLarge as e:
            raise _HTTPError(413, f"{field}[{i}]: {e}") from None
        except MediaDecodeError as e:
            raise _HTTPError(422, f"{field}[{i}]: {e}") from None
    try:  # one size per request, known from the headers: refused before anything is decoded
        if field == "images":
            one_size([(f.height, f.width) for f in files], "images")
        else:
            one_size([(v.frames, v.height, v.width) for v in files], "videos")
    except MediaDecodeError as e:
        raise _HTTPError(422, str(e)) from None
    return files, budget.used


def _decode(request: _Request, limits: ServerLimits):
    """The request's media: images (B, 3, H, W) / video (B, T, 3, H, W) as uint8 (decoded straight into one
    array: no per-item copies, no float), or an `Audio` batch."""
    field, items = request.field, request.items
    if field == "texts":
        return list(items)
    if field == "audio":
        clips = []
        for i, item in enumerate(items):
            try:
                clips.append(decode_audio(item, limits.max_audio_seconds))
            except MediaTooLarge as e:
                raise _HTTPError(413, f"audio[{i}]: {e}") from None
            except MediaDecodeError as e:
                raise _HTTPError(422, f"audio[{i}]: {e}") from None
        try:
            return stack_audio(clips)
        except MediaDecodeError as e:
            raise _HTTPError(422, str(e)) from None
    first = items[0]
    if field == "images":
        out, decode = np.empty((len(items), first.height, first.width, 3), np.uint8), decode_image_file
    else:
        out, decode = np.empty((len(items), first.frames, first.height, first.width, 3), np.uint8), decode_video_file
    for i, item in enumerate(items):
        try:
            decode(item, out[i])
        except MediaDecodeError as e:
            raise _HTTPError(422, f"{field}[{i}]: {e}") from None
    pixels = torch.from_numpy(out)  # channels last on the wire: a permuted view, no copy
    return pixels.permute(0, 3, 1, 2) if field == "images" else pixels.permute(0, 1, 4, 2, 3)


def check_groups(groups, n: int, required: bool) -> list | None:
    """The request's `groups` (one id per sample, members contiguous), checked; 422 naming what is wrong."""
    if groups is None:
        if required:
            raise _HTTPError(422, "this server's reward scores whole prompt groups: send 'groups' (one group id per "
                                  "sample, each group's members next to each other; reward=http does this with "
                                  "reward.groupwise=true)")
        return None
    if not isinstance(groups, list) or not all(isinstance(g, int | str) and not isinstance(g, bool) for g in groups):
        raise _HTTPError(422, "'groups' must be a list of integers or strings (one group id per sample)")
    if len(groups) != n:
        raise _HTTPError(422, f"got {n} samples but {len(groups)} group ids")
    seen, prev = set(), object()
    for i, g in enumerate(groups):
        if g != prev and g in seen:
            raise _HTTPError(422, f"groups[{i}]: the members of group {g!r} are not next to each other")
        seen.add(g)
        prev = g
    return groups


def _parse_request(body: bytes, limits: ServerLimits, accepted: list[str] | None = None,
                   groupwise: bool = False) -> _Request:
    """JSON body -> the checked request with its files' headers read; raises _HTTPError with the reason.
    `accepted`: the media fields the served reward reads (a request for another kind is refused before anything
    is decoded); `groupwise`: the reward scores whole groups (`groups` required)."""
    try:
        data = json.loads(body)
    except RecursionError:  # e.g. a million nested '[': the parser's depth guard, not a server bug
        raise _HTTPError(400, "malformed JSON: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of too many digits
        raise _HTTPError(400, f"malformed JSON: {e}") from None
    if not isinstance(data, dict):
        raise _HTTPError(422, f"the body must be a JSON object, got {type(data).__name__}")
    allowed = [*MEDIA_FIELDS, "prompts", "metadata", "groups"]
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
    groups = check_groups(data.get("groups"), len(items), groupwise)
    files, pixels = _read_headers(field, items, limits)
    return _Request(field, files, prompts, metadata, pixels, groups)


class InflightPixels:
    """The decoded pixels of the requests in flight (decoding, queued or being scored), against a limit.
    Used from the server's event loop only, so it needs no lock."""

    def __init__(self, limit: int):
        self.limit, self.used, self.peak, self.refused = int(limit), 0, 0, 0

    def try_take(self, pixels: int) -> bool:
        """Reserve `pixels` if they fit beside what is in flight; False (and counted as refused) if not."""
        if self.used + pixels > self.limit:
            self.refused += 1
            return False
        self.used += pixels
        self.peak = max(self.peak, self.used)
        return True

    def give_back(self, pixels: int) -> None:
        self.used -= pixels

    @property
    def stats(self) -> dict:
        return {"pixels_in_flight": self.used, "peak_pixels_in_flight": self.peak, "refused_busy": self.refused}


def create_app(reward, name: str = "reward", limits: ServerLimits | None = None, token: str | None = None):
    """A FastAPI app serving `reward` (any callable `(media, prompts, metadata) -> RewardOutput`, called through
    `call_reward`; its `media` attribute says which kinds it reads, images when absent). Run it with `serve` or
    `BackgroundServer`: they apply the connection limits in `limits` (kept as `app.state.limits`)."""
    limits = limits or ServerLimits()
    accepted = accepted_media(reward)
    groupwise = is_groupwise(reward)
    inflight = InflightPixels(limits.max_inflight_pixels)
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app):
        yield
        if "scorer" in state:
            state["scorer"].close()

    app = FastAPI(title=f"polyrl reward server ({name})", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.limits = limits

    def scorer() -> BatchingScorer:  # made inside the server's event loop
        if "scorer" not in state:
            state["scorer"] = BatchingScorer(reward, limits.max_batch, limits.max_wait_ms / 1000.0,
                                             limits.max_call_pixels)
        return state["scorer"]

    def error(status: int, detail: str, rid: str | None = None, headers: dict | None = None) -> JSONResponse:
        headers = {**({"X-Request-ID": rid} if rid else {}), **(headers or {})}
        if status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse({"detail": detail, "request_id": rid}, status_code=status, headers=headers)

    @app.get("/health")
    async def health():
        stats = {**(state["scorer"].stats if "scorer" in state else {}), **inflight.stats}
        return {"status": "ok", "reward": name, "media": accepted, "groupwise": groupwise, "limits": asdict(limits),
                "stats": stats}

    async def read_body(request: Request, rid: str) -> bytes | JSONResponse:
        """The body, or the error that ends the request: 413 over the size limit, 408 past the deadline (the
        connection is then closed: the rest of a slow body is not waited for)."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
            return error(413, f"body of {declared} bytes is over the limit of {limits.max_body_bytes} bytes", rid)
        body = bytearray()
        try:
            async with asyncio.timeout(limits.body_timeout_s):
                async for chunk in request.stream():  # also bounds chunked bodies that declare no length
                    body += chunk
                    if len(body) > limits.max_body_bytes:
                        return error(413, f"body is over the limit of {limits.max_body_bytes} bytes", rid)
        except TimeoutError:
            return error(408, f"the body did not arrive within {limits.body_timeout_s:g} s ({len(body)} bytes "
                              f"came)", rid, {"Connection": "close"})
        return bytes(body)

    @app.post("/score")
    async def score(request: Request):
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        if token is not None:
            auth = request.headers.get("authorization", "")
            scheme, _, given = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), token.encode()):
                return error(401, "missing or wrong bearer token (send 'Authorization: Bearer <token>')", rid)
        body = await read_body(request, rid)
        if isinstance(body, JSONResponse):
            return body
        try:
            parsed = await asyncio.to_thread(_parse_request, body, limits, accepted, groupwise)
        except _HTTPError as e:
            return error(e.status, e.detail, rid)
        del body  # the files keep what they need
        if not inflight.try_take(parsed.pixels):
            return error(503, f"busy: this request decodes to {parsed.pixels} pixels and {inflight.used} of the "
                              f"{inflight.limit} in-flight pixels are taken (--max-inflight-pixels); retry after "
                              f"{RETRY_AFTER_S} s", rid, {"Retry-After": str(RETRY_AFTER_S)})
        try:
            try:
                media = await asyncio.to_thread(_decode, parsed, limits)
            except _HTTPError as e:
                return error(e.status, e.detail, rid)
            parsed.items = []  # the encoded files are no longer needed while the request waits to be scored
            try:
                scores, per_sample, other = await scorer().score(media, parsed.prompts, parsed.metadata,
                                                                 parsed.groups)
            except ScorerFailed as e:
                return error(422 if e.rejected_input else 500, str(e), rid)
        finally:
            inflight.give_back(parsed.pixels)
        return JSONResponse({"scores": scores, "extras": {**other, **per_sample}, "request_id": rid},
                            headers={"X-Request-ID": rid})

    return app


def uvicorn_config(app, limits: ServerLimits | None = None, **kwargs):
    """uvicorn's Config for `app` with the connection limits: its own `limit_concurrency`, `timeout_keep_alive`
    and h11 header size, and our protocol for the header deadline (`connections.py`)."""
    import uvicorn

    limits = limits or getattr(getattr(app, "state", None), "limits", None) or ServerLimits()
    return uvicorn.Config(app, http=guarded_protocol(limits.header_timeout_s),
                          limit_concurrency=limits.max_connections, timeout_keep_alive=limits.keep_alive_s,
                          h11_max_incomplete_event_size=limits.max_header_bytes,
                          **{"timeout_graceful_shutdown": 5, **kwargs})


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

    uvicorn.Server(uvicorn_config(app, host=host, port=port, log_level=log_level)).run()


class BackgroundServer:
    """`with BackgroundServer(app) as srv: ... srv.url ...`: uvicorn in a daemon thread on a loopback port."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.sock = bind_socket(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn_config(app, log_level="warning", timeout_graceful_shutdown=1))
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

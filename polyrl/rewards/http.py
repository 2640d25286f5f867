"""`reward=http`: score through a reward server (`polyrl serve-reward`, or a flow_grpo-style pickle server).

The batch (images, video or audio: whatever the trainer decoded, sent as `images`, `videos` or `audio`; see
`polyrl.rewards.codec`) is cut into requests of `chunk_size` samples, sent concurrently (at most
`max_concurrency` at a time) over pooled keep-alive connections (httpx, one event loop in a background thread
for the reward's life). A request is retried with exponential backoff (`backoff * 2**attempt`, at most `max_backoff`
seconds, or the server's `Retry-After`) on transport errors and timeouts, 408, 429 and 5xx, up to
`max_retries` times; any other 4xx is the caller's mistake and fails at once. Every request carries an
`X-Request-ID`; the server's answer must echo it and hold exactly one score per sample, or the call fails:
a score is never attached to the wrong sample. When the retry budget is spent the call raises
`RewardUnavailable` (naming the URL and the last error); the trainer then saves a checkpoint and stops.

Group rewards (docs/rewards.md, "Group rewards"): when the server's reward is one (`GET /health` says
`"groupwise": true` at `preflight`, which the trainer runs first; or set `reward.groupwise=true`), this client is
one too: the stage gives it whole groups with their
ids, each request carries whole groups only (members next to each other) and their ids in a `groups` field, and
the server scores each group in one call.

`protocol=flow_grpo_pickle` talks to reward servers written for flow_grpo (a POST of
`pickle.dumps({"images": [JPEG bytes], "prompts": [...], "meta_datas": [...]})`, answered with a pickled
dict holding "scores" or "outputs"). Unpickling a server's answer can run code chosen by that server: use it
only for servers you run yourself. The answer is read with an unpickler that accepts only plain containers,
numbers, strings and numpy arrays, which refuses the usual code-running payloads, but that is a mitigation,
not a sandbox. That protocol carries images only.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import os
import pickle
import threading
import uuid

import numpy as np
import torch

from ..errors import UserError
from .base import MEDIA_KINDS, RewardOutput, group_chunks, media_kind, media_len, media_take, register_reward
from .codec import FORMATS, VIDEO_FORMATS, encode_audio, encode_image_bytes, encode_images, encode_videos, to_uint8
from .stage import RewardUnavailable, scatter_extras

PROTOCOLS = ("json", "flow_grpo_pickle")
RETRY_STATUS = frozenset({408, 429})  # and every 5xx
FIELDS = {"images": "images", "video": "videos", "audio": "audio", "text": "texts"}  # media kind -> request field


class RewardRequestRejected(RewardUnavailable):
    """The reward server refused a request with a 4xx that retrying cannot fix (bad token, bad input), or
    answered with something that is not a valid answer to it. Not retried; the trainer stops as for
    `RewardUnavailable`."""


class _Retryable(Exception):
    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


def backoff_delay(attempt: int, base: float, cap: float, retry_after: float | None = None) -> float:
    """Seconds before retry number `attempt + 1`: base * 2**attempt, at most `cap`; a server's Retry-After
    (also capped) wins when it is longer."""
    delay = min(cap, base * 2.0**attempt)
    return max(delay, min(cap, retry_after)) if retry_after is not None else delay


class _SafeUnpickler(pickle.Unpickler):
    """Only builtin containers/scalars and numpy arrays/scalars (what a scores dict is made of)."""

    ALLOWED = {
        ("builtins", "dict"), ("builtins", "list"), ("builtins", "tuple"), ("builtins", "set"),
        ("builtins", "frozenset"), ("builtins", "float"), ("builtins", "int"), ("builtins", "str"),
        ("builtins", "bytes"), ("builtins", "bool"), ("builtins", "complex"), ("collections", "OrderedDict"),
        ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
    }

    def find_class(self, module, name):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name} from the reward server")
        return super().find_class(module, name)


def safe_unpickle(data: bytes):
    return _SafeUnpickler(io.BytesIO(data)).load()


def _detail(resp) -> str:
    try:
        body = resp.json()
        if isinstance(body, dict) and "detail" in body:
            return str(body["detail"])
    except Exception:  # not JSON: show the start of the body
        pass
    text = resp.text.strip()
    return text[:300] if text else resp.reason_phrase


def _retry_after(resp) -> float | None:
    value = resp.headers.get("retry-after")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


class LoopClient:
    """Base of the HTTP clients (`HttpReward`, judge_backend's `OpenAIChat`): one event loop of the client's own in a
    daemon thread (named `thread_name`), so the httpx.AsyncClient that the subclass's `_http` builds pools its
    connections across calls. `_run(coro)` runs a coroutine there; `close()` closes the client and stops the loop."""

    thread_name = "polyrl-http"

    def __init__(self):
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client = None
        self._lock = threading.Lock()

    def close(self) -> None:
        if self._loop is not None:
            if self._client is not None:
                asyncio.run_coroutine_threadsafe(self._client.aclose(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop, self._client = None, None

    def _run(self, coro):
        """Run `coro` on the client's own event loop (a daemon thread), so connections are pooled across calls."""
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, daemon=True, name=self.thread_name).start()
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()


@register_reward("http")
class HttpReward(LoopClient):
    """Client of a remote reward. `url`: the server's base URL (json: `POST {url}/score`; flow_grpo_pickle:
    `POST {url}` as given). The bearer token is read from the environment variable named by `token_env`
    (so it never lands in the run's saved config.yaml); no token is sent when it is unset.

    Video goes as PNG/JPEG frames (`video_format=frames`, `image_format`; PNG is lossless) or as one mp4 per
    video (`video_format=mp4`, H.264 4:4:4 at `mp4_crf`: smaller, lossy); audio as 16-bit WAV. Frame sampling of
    an image scorer happens on the server (`polyrl serve-reward reward=<name> reward.frames=K`).
    """

    media = MEDIA_KINDS  # sends whatever it is given; the server's reward decides what it can score
    thread_name = "polyrl-http-reward"

    def __init__(
        self,
        url: str,
        protocol: str = "json",
        token_env: str | None = "POLYRL_REWARD_TOKEN",
        chunk_size: int = 16,
        max_concurrency: int = 4,
        timeout: float = 120.0,
        connect_timeout: float = 10.0,
        max_retries: int = 6,
        backoff: float = 0.5,
        max_backoff: float = 30.0,
        image_format: str = "png",
        jpeg_quality: int = 95,
        score_key: str | None = None,
        video_format: str = "frames",
        mp4_crf: int = 18,
        groupwise: bool | None = None,
    ):
        if protocol not in PROTOCOLS:
            raise ValueError(f"reward.protocol={protocol!r} is not valid; allowed: {', '.join(PROTOCOLS)}")
        if image_format not in FORMATS:
            raise ValueError(f"reward.image_format={image_format!r} is not valid; allowed: {', '.join(FORMATS)}")
        if video_format not in VIDEO_FORMATS:
            raise ValueError(f"reward.video_format={video_format!r} is not valid; allowed: {', '.join(VIDEO_FORMATS)}")
        if isinstance(mp4_crf, bool) or not isinstance(mp4_crf, int) or not 0 <= mp4_crf <= 51:
            raise ValueError(f"reward.mp4_crf={mp4_crf!r} must be an integer in [0, 51] (x264 constant quality)")
        if groupwise is not None and not isinstance(groupwise, bool):
            raise ValueError(f"reward.groupwise={groupwise!r} must be true, false or null (ask the server)")
        if groupwise and protocol != "json":
            raise ValueError(f"reward.groupwise=true needs reward.protocol=json (got {protocol})")
        if not str(url).startswith(("http://", "https://")):
            raise ValueError(f"reward.url={url!r} must start with http:// or https://")
        for key, value in (("chunk_size", chunk_size), ("max_concurrency", max_concurrency)):
            if value < 1:
                raise ValueError(f"reward.{key}={value} must be >= 1")
        if max_retries < 0 or backoff < 0 or timeout <= 0 or connect_timeout <= 0:
            raise ValueError("reward.max_retries and reward.backoff must be >= 0, the timeouts > 0")
        self.url = str(url).rstrip("/") if protocol == "json" else str(url)
        self.endpoint = self.url + "/score" if protocol == "json" else self.url
        self.protocol, self.chunk_size, self.max_concurrency = protocol, chunk_size, max_concurrency
        self.timeout, self.connect_timeout = float(timeout), float(connect_timeout)
        self.max_retries, self.backoff, self.max_backoff = max_retries, float(backoff), float(max_backoff)
        self.image_format, self.jpeg_quality, self.score_key = image_format, jpeg_quality, score_key
        self.video_format, self.mp4_crf = video_format, mp4_crf
        self.token = os.environ.get(token_env) if token_env else None
        super().__init__()
        self._ids = itertools.count()
        self._session = uuid.uuid4().hex[:12]
        self.stats = {"requests": 0, "retries": 0}
        self._groupwise = groupwise if protocol == "json" else False

    @property
    def groupwise(self) -> bool:
        """Whether the server's reward scores whole groups: `reward.groupwise`, else what the server's `GET /health`
        said at `preflight` (False before it)."""
        return bool(self._groupwise)

    # ------------------------------------------------------------------------------------------ public
    def __call__(self, media, prompts, metadata, group_ids=None) -> RewardOutput:
        kind = media_kind(media)
        if kind != "images" and self.protocol != "json":
            raise ValueError(f"reward.protocol={self.protocol} sends images only; got {kind} (serve the reward with "
                             "polyrl serve-reward and use reward.protocol=json)")
        n = media_len(media)
        metadata = list(metadata) if metadata is not None else [{} for _ in range(n)]
        if len(prompts) != n or len(metadata) != n:
            raise ValueError(f"reward=http: {n} {FIELDS[kind]}, {len(prompts)} prompts, {len(metadata)} metadata "
                             "entries")
        if group_ids is None:
            chunks = [list(range(i, min(n, i + self.chunk_size))) for i in range(0, n, self.chunk_size)]
            groups = None
        else:  # whole groups per request, each group's members together
            groups = [int(g) for g in torch.as_tensor(group_ids).reshape(-1).tolist()]
            if len(groups) != n:
                raise ValueError(f"reward=http: {len(groups)} group ids for {n} samples")
            chunks = group_chunks(groups, self.chunk_size)
        results = self._run(self._score_all(media, list(prompts), metadata, chunks, groups))
        scores = torch.empty(n, dtype=torch.float32)
        for idx, (part, _) in zip(chunks, results, strict=True):
            scores[idx] = torch.tensor(part, dtype=torch.float32)
        return RewardOutput(scores, scatter_extras([(idx, e) for idx, (_, e) in zip(chunks, results, strict=True)], n))

    def preflight(self) -> None:
        """Before the trainer loads the model: the server answers (json: `GET {url}/health` says "ok";
        flow_grpo_pickle: its port accepts a connection). UserError naming the URL otherwise."""
        import socket
        from urllib.parse import urlsplit

        import httpx

        if self.protocol != "json":
            parts = urlsplit(self.url)
            try:
                socket.create_connection((parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)),
                                         timeout=self.connect_timeout).close()
            except OSError as e:
                raise UserError(f"reward.url={self.url}: cannot connect ({e}); is the reward server running?") from None
            return
        health = self.url + "/health"
        try:
            resp = httpx.get(health, timeout=httpx.Timeout(self.connect_timeout))
        except httpx.HTTPError as e:
            raise UserError(f"reward.url={self.url}: GET {health} failed ({type(e).__name__}: {e}); is "
                            "`polyrl serve-reward` running there?") from None
        try:
            body = resp.json() if resp.status_code == 200 else None
        except ValueError:
            body = None
        status = body.get("status") if isinstance(body, dict) else None
        if status != "ok":
            raise UserError(f"reward.url={self.url}: GET {health} answered HTTP {resp.status_code} "
                            f"({_detail(resp)}), not a healthy polyrl reward server")
        if self._groupwise is None:  # a group reward behind the server: send whole groups and their ids
            self._groupwise = bool(body.get("groupwise", False))

    # ------------------------------------------------------------------------------------------ event loop
    def _http(self):
        import httpx

        if self._client is None:
            limits = httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency)
            timeout = httpx.Timeout(self.timeout, connect=self.connect_timeout)
            headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
            self._client = httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers)
        return self._client

    async def _score_all(self, media, prompts, metadata, chunks: list[list[int]], groups: list[int] | None):
        gate = asyncio.Semaphore(self.max_concurrency)

        async def one(idx: list[int]):
            async with gate:
                return await self._score_chunk(media_take(media, idx), [prompts[i] for i in idx],
                                               [metadata[i] for i in idx],
                                               None if groups is None else [groups[i] for i in idx])

        tasks = [asyncio.ensure_future(one(idx)) for idx in chunks]
        try:
            return await asyncio.gather(*tasks)
        finally:  # on the first failure, stop the other requests instead of leaving them running
            for t in tasks:
                t.cancel()

    # ------------------------------------------------------------------------------------------ one request
    async def _score_chunk(self, media, prompts, metadata, groups=None) -> tuple[list[float], dict]:
        import httpx

        rid = f"{self._session}-{next(self._ids)}"  # the same id on every retry of this request
        body = await asyncio.to_thread(self._encode, media, prompts, metadata, groups)
        what = FIELDS[media_kind(media)]
        headers = {"X-Request-ID": rid}
        headers["Content-Type"] = "application/json" if self.protocol == "json" else "application/octet-stream"
        last = "no attempt made"
        for attempt in range(self.max_retries + 1):
            retry_after = None
            try:
                self.stats["requests"] += 1
                resp = await self._http().post(self.endpoint, content=body, headers=headers)
                return self._parse(resp, rid, len(prompts), what)
            except httpx.TransportError as e:  # connect/read errors and timeouts
                last = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            except _Retryable as e:
                last, retry_after = str(e), e.retry_after
            if attempt < self.max_retries:
                self.stats["retries"] += 1
                await asyncio.sleep(backoff_delay(attempt, self.backoff, self.max_backoff, retry_after))
        raise RewardUnavailable(
            f"reward server {self.endpoint} failed {self.max_retries + 1} attempts (reward.max_retries="
            f"{self.max_retries}); last error: {last}"
        )

    def _encode(self, media, prompts, metadata, groups=None) -> bytes:
        import json

        if self.protocol == "json":
            kind = media_kind(media)
            if kind == "images":
                items = encode_images(media, self.image_format, self.jpeg_quality)
            elif kind == "video":
                items = encode_videos(media, self.video_format, self.image_format, self.jpeg_quality, self.mp4_crf)
            elif kind == "text":  # a token policy's responses, as they are
                items = list(media)
            else:
                items = encode_audio(media)
            request = {FIELDS[kind]: items, "prompts": prompts, "metadata": metadata}
            if groups is not None:
                request["groups"] = groups
            return json.dumps(request).encode()
        jpegs = [encode_image_bytes(a, "jpeg", self.jpeg_quality) for a in to_uint8(media)]
        return pickle.dumps({"images": jpegs, "prompts": prompts, "meta_datas": metadata})

    def _parse(self, resp, rid: str, n: int, what: str = "images") -> tuple[list[float], dict]:
        code = resp.status_code
        if code in RETRY_STATUS or code >= 500:
            raise _Retryable(f"HTTP {code}: {_detail(resp)}", _retry_after(resp))
        if code != 200:
            raise RewardRequestRejected(f"reward server {self.endpoint} refused the request: HTTP {code}: {_detail(resp)}")
        if self.protocol == "json":
            body = resp.json()
            echoed = body.get("request_id") if isinstance(body, dict) else None
            if echoed != rid:
                raise RewardRequestRejected(
                    f"reward server {self.endpoint} answered request {rid} with request_id {echoed!r}; refusing "
                    "scores that may belong to another request"
                )
            scores, extras = body.get("scores"), body.get("extras") or {}
        else:
            try:
                body = safe_unpickle(resp.content)
            except Exception as e:
                raise RewardRequestRejected(f"reward server {self.endpoint}: unreadable pickle answer ({e})") from e
            if not isinstance(body, dict):
                raise RewardRequestRejected(f"reward server {self.endpoint}: expected a pickled dict, got {type(body).__name__}")
            key = self.score_key or next((k for k in ("scores", "outputs") if k in body), None)
            if key not in body:
                raise RewardRequestRejected(
                    f"reward server {self.endpoint}: answer has no {key or 'scores/outputs'!r} key (keys: {sorted(body)})")
            scores = body[key]
            extras = {f"remote/{k}": v for k, v in body.items()
                      if k != key and isinstance(v, (list, tuple, np.ndarray)) and len(v) == n}
        try:
            scores = np.asarray(scores, dtype=np.float64).reshape(-1)
        except (TypeError, ValueError):
            raise RewardRequestRejected(f"reward server {self.endpoint} returned non-numeric scores") from None
        if scores.size != n or not np.isfinite(scores).all():
            raise RewardRequestRejected(f"reward server {self.endpoint} returned {scores.size} scores for {n} {what} "
                                        f"(non-finite: {int((~np.isfinite(scores)).sum())})")
        return scores.tolist(), {k: (list(v) if isinstance(v, (list, tuple, np.ndarray)) else v) for k, v in extras.items()}

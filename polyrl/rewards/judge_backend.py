"""Where a chat judge's questions are answered: a local transformers VLM (`backend=local`) or an OpenAI-compatible
chat-completions server (`backend=openai`: vLLM, SGLang, `transformers serve`, a hosted API).

The judges (vlm_judge.py and the adapters built on it) build their questions as turns, a turn being the pictures of
one user message (RGB uint8 (H, W, 3) arrays, in order) and its text, and parse the answers; a backend only turns
turns into answers, `generate(pictures, questions, max_new_tokens)`, greedily. So the local and the remote judge
share the template, the parse and the score map, and differ in transport only.

`backend=openai` sends one chat-completions request per turn (per sample; per group for a groupwise judge):

    POST {url}/chat/completions
    {"model": M, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url":
     "data:image/png;base64,..."}}, ..., {"type": "text", "text": QUESTION}]}], "max_tokens": N, "temperature": 0}

and reads `choices[0].message.content`. `url` is the API's base URL as the OpenAI client takes it
(`http://host:8000/v1`; a URL without a path gets `/v1`). The API key is read from the environment variable named by
`api_key_env` and sent as `Authorization: Bearer ...` (none when it is unset); it is never logged, never part of the
config, and no message names more than the variable.

At most `max_concurrency` requests are in flight. A request that takes longer than `timeout` seconds is abandoned;
a timeout, a connection error, 408, 429 or a 5xx is retried after an exponential backoff with jitter,
`U(0.5, 1) · min(max_backoff, backoff · 2^k)` before retry k + 1 (`backoff_delay`; a longer `Retry-After` of the
server wins, capped the same), at most `max_retries` times per request and `retry_budget` times per step over all
of the step's requests (`begin_step`, called by the reward stage; outside a step each call has its own budget). Any
other 4xx is the caller's mistake and is not retried. When a request fails for good the call raises
`RewardUnavailable` naming the endpoint and the last status; the trainer saves the last completed step and stops
(`trainer.resume=auto` goes on from there).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import random
from urllib.parse import urlsplit

import torch

from ..errors import UserError
from .base import resolve_device, resolve_dtype
from .clip_score import local_dir
from .codec import FORMATS, encode_image_bytes
from .http import RETRY_STATUS, LoopClient, RewardRequestRejected, _detail, _retry_after
from .stage import RewardUnavailable

log = logging.getLogger(__name__)
BACKENDS = ("local", "openai")
MIME = {"png": "image/png", "jpeg": "image/jpeg"}


class LocalVLM:
    """A local VLM and its processor (`AutoModelForImageTextToText` + `AutoProcessor`): `turns` builds the
    processor's batch of chat turns, `generate` answers them greedily."""

    def __init__(self, path: str, device: str = "auto", dtype: str = "float32", padding_side: str = "left",
                 trust_remote_code: bool = False):
        from transformers import AutoModelForImageTextToText, AutoProcessor

        path = local_dir(path, "VLM path")
        self.device, self.dtype = resolve_device(device), resolve_dtype(dtype)
        self.model = AutoModelForImageTextToText.from_pretrained(
            path, dtype=self.dtype, trust_remote_code=trust_remote_code).to(self.device).eval()
        self.processor = AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
        self.processor.tokenizer.padding_side = padding_side  # left: batched generation / last position = last token

    def inputs(self, images: torch.Tensor, questions: list[str], sources: list[list] | None = None) -> dict:
        """The processor's batch of `judge_pictures(images, sources)` with `questions`."""
        return self.turns(judge_pictures(images, sources), questions)

    def turns(self, pictures: list[list], questions: list[str]) -> dict:
        """One chat turn per question: [its pictures (uint8 (H, W, 3) arrays) in order, question]."""
        chats = [[{"role": "user", "content": [{"type": "image"}] * len(pics) + [{"type": "text", "text": q}]}]
                 for q, pics in zip(questions, pictures, strict=True)]
        text = self.processor.apply_chat_template(chats, add_generation_prompt=True, tokenize=False)
        batch = self.processor(text=text, images=[p for pics in pictures for p in pics], return_tensors="pt",
                               padding=True)
        return {k: (v.to(self.device, self.dtype) if torch.is_floating_point(v) else v.to(self.device))
                for k, v in batch.items()}

    @torch.no_grad()
    def generate(self, pictures: list[list], questions: list[str], max_new_tokens: int) -> list[str]:
        """Greedy answers to the turns, special tokens left out."""
        batch = self.turns(pictures, questions)
        tok, gen = self.processor.tokenizer, self.model.generation_config
        out = self.model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                                  eos_token_id=gen.eos_token_id if gen.eos_token_id is not None else tok.eos_token_id,
                                  pad_token_id=gen.pad_token_id if gen.pad_token_id is not None else tok.pad_token_id)
        return self.processor.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)


def judge_pictures(images: torch.Tensor, sources: list[list] | None = None) -> list[list]:
    """Each sample's pictures in turn order: [*sources[i], image] for images (B, 3, H, W) in [0, 1], or
    [*sources[i], frame_1 .. frame_N] for (B, N, 3, H, W) (N frames of a video per sample)."""
    from .base import image_batch_as_uint8, media_kind

    if images.ndim == 5 and images.shape[2] == 3:
        own = [list(image_batch_as_uint8(clip)) for clip in images]
    elif media_kind(images) == "images":
        own = [[image] for image in image_batch_as_uint8(images)]
    else:
        raise ValueError(f"VLM scorers score images (B, 3, H, W), got {tuple(images.shape)}")
    sources = sources or [[] for _ in own]
    return [[*src, *pics] for src, pics in zip(sources, own, strict=True)]


def backoff_delay(attempt: int, base: float, cap: float, retry_after: float | None = None,
                  rng: random.Random | None = None) -> float:
    """Seconds before retry number `attempt + 1`: U(0.5, 1) · min(cap, base · 2^attempt) (exponential backoff
    with "equal jitter", so clients that failed together do not retry together); a server's Retry-After, capped at
    `cap`, wins when it is longer."""
    delay = min(cap, base * 2.0**attempt) * (0.5 + 0.5 * (rng or random).random())
    return max(delay, min(cap, retry_after)) if retry_after is not None else delay


def api_base(url: str) -> str:
    """The API's base URL: `url` without a trailing slash, `/v1` added when it has no path."""
    url = str(url).rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"reward.url={url!r} must start with http:// or https://")
    return url if urlsplit(url).path else url + "/v1"


class _Budget:
    """The retries left to one step (or one call) over all its requests."""

    def __init__(self, retries: int):
        self.left = retries


class OpenAIChat(LoopClient):
    """Client of an OpenAI-compatible chat-completions API (the module docstring). `stats` counts requests,
    retries and timeouts over the client's life."""

    thread_name = "polyrl-judge-client"

    def __init__(self, url: str, model: str | None = None, api_key_env: str | None = "POLYRL_JUDGE_API_KEY",
                 max_concurrency: int = 8, timeout: float = 120.0, connect_timeout: float = 10.0,
                 max_retries: int = 5, retry_budget: int = 64, backoff: float = 1.0, max_backoff: float = 30.0,
                 image_format: str = "png", jpeg_quality: int = 95, request_options: dict | None = None):
        super().__init__()
        self.url = api_base(url)
        self.endpoint = self.url + "/chat/completions"
        if image_format not in FORMATS:
            raise ValueError(f"reward.image_format={image_format!r} is not valid; allowed: {', '.join(FORMATS)}")
        for key, value in (("max_concurrency", max_concurrency), ("timeout", timeout),
                           ("connect_timeout", connect_timeout)):
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"reward.{key}={value!r} must be > 0")
        for key, value in (("max_retries", max_retries), ("retry_budget", retry_budget)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"reward.{key}={value!r} must be an integer >= 0")
        if backoff < 0 or max_backoff < 0:
            raise ValueError("reward.backoff and reward.max_backoff must be >= 0")
        if request_options is not None and not isinstance(request_options, dict):
            raise ValueError(f"reward.request_options must be a mapping of request fields (got {request_options!r})")
        reserved = {"model", "messages", "max_tokens", "stream"} & set(request_options or {})
        if reserved:
            raise ValueError(f"reward.request_options may not set {', '.join(sorted(reserved))} (the judge sets them)")
        self.model, self.api_key_env = model, api_key_env
        self.max_concurrency, self.timeout, self.connect_timeout = int(max_concurrency), float(timeout), \
            float(connect_timeout)
        self.max_retries, self.retry_budget = max_retries, retry_budget
        self.backoff, self.max_backoff = float(backoff), float(max_backoff)
        self.image_format, self.jpeg_quality = image_format, int(jpeg_quality)
        self.request_options = dict(request_options or {})
        self._key = os.environ.get(api_key_env) if api_key_env else None  # never logged, never saved
        self._step: _Budget | None = None
        self._rng = random.Random()
        self.stats = {"requests": 0, "retries": 0, "timeouts": 0}

    # ---------------------------------------------------------------------------------------------- public
    def preflight(self) -> None:
        """Before the trainer loads the model: `GET {url}/models` answers, and names the model to ask when
        `reward.model` is unset (the server's only one). UserError naming the URL otherwise."""
        import httpx

        where = self.url + "/models"
        try:
            resp = httpx.get(where, headers=self._headers(), timeout=httpx.Timeout(self.connect_timeout))
        except httpx.HTTPError as e:
            raise UserError(f"reward.url={self.url}: GET {where} failed ({type(e).__name__}: {e}); is the "
                            "judge's server running?") from None
        if resp.status_code != 200:
            raise UserError(f"reward.url={self.url}: GET {where} answered HTTP {resp.status_code} ({_detail(resp)})"
                            f"{self._key_note(resp.status_code)}")
        try:
            served = [str(m["id"]) for m in resp.json()["data"]]
        except (ValueError, KeyError, TypeError):
            raise UserError(f"reward.url={self.url}: GET {where} did not answer an OpenAI model list") from None
        if self.model is None:
            if len(served) != 1:
                raise UserError(f"reward.url={self.url} serves {len(served)} models ({', '.join(served) or 'none'}): "
                                "set reward.model")
            self.model = served[0]
        elif self.model not in served:
            log.warning("reward.model=%s is not among the models %s lists (%s); asking for it anyway", self.model,
                        where, ", ".join(served) or "none")

    def begin_step(self) -> None:
        """A new step: its requests share `retry_budget` retries."""
        self._step = _Budget(self.retry_budget)

    def generate(self, pictures: list[list], questions: list[str], max_new_tokens: int) -> list[str]:
        """The answer to each turn (one request per turn, concurrently)."""
        budget = self._step or _Budget(self.retry_budget)
        return self._run(self._all(pictures, questions, max_new_tokens, budget))

    # ---------------------------------------------------------------------------------------------- requests
    def _headers(self) -> dict:
        return {"Authorization": f"Bearer {self._key}"} if self._key else {}

    def _key_note(self, status: int) -> str:
        if status not in (401, 403) or not self.api_key_env:
            return ""
        return f"; the API key is read from ${self.api_key_env}, which is {'set' if self._key else 'unset'}"

    def _http(self):
        import httpx

        if self._client is None:
            limits = httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency)
            # the per-request limit is `timeout` over the whole exchange (asyncio.wait_for in `_one`)
            self._client = httpx.AsyncClient(limits=limits, headers=self._headers(),
                                             timeout=httpx.Timeout(None, connect=self.connect_timeout))
        return self._client

    def body(self, pictures: list, question: str, max_new_tokens: int) -> dict:
        """The chat-completions request of one turn (greedy: temperature 0)."""
        parts = [{"type": "image_url", "image_url": {"url": self.data_url(p)}} for p in pictures]
        message = {"role": "user", "content": [*parts, {"type": "text", "text": question}]}
        return {"model": self.model, "messages": [message], "max_tokens": int(max_new_tokens), "temperature": 0.0,
                **self.request_options}

    def data_url(self, pixels) -> str:
        raw = encode_image_bytes(pixels, self.image_format, self.jpeg_quality)
        return f"data:{MIME[self.image_format]};base64,{base64.b64encode(raw).decode('ascii')}"

    async def _all(self, pictures, questions, max_new_tokens: int, budget: _Budget) -> list[str]:
        gate = asyncio.Semaphore(self.max_concurrency)

        async def one(pics, question):
            async with gate:
                return await self._one(pics, question, max_new_tokens, budget)

        tasks = [asyncio.ensure_future(one(p, q)) for p, q in zip(pictures, questions, strict=True)]
        try:
            return list(await asyncio.gather(*tasks))
        finally:  # on the first failure, stop the other requests instead of leaving them running
            for t in tasks:
                t.cancel()

    async def _one(self, pictures, question: str, max_new_tokens: int, budget: _Budget) -> str:
        import httpx

        body = await asyncio.to_thread(self.body, pictures, question, max_new_tokens)
        last = "no attempt made"
        for attempt in range(self.max_retries + 1):
            retry_after = None
            self.stats["requests"] += 1
            try:
                resp = await asyncio.wait_for(self._http().post(self.endpoint, json=body), self.timeout)
            except TimeoutError:
                self.stats["timeouts"] += 1
                last = f"no answer in {self.timeout:g} s (reward.timeout)"
            except httpx.TransportError as e:  # connect / read errors
                last = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            else:
                if resp.status_code == 200:
                    return self._answer(resp)
                detail = f"HTTP {resp.status_code}: {_detail(resp)}"
                if not (resp.status_code in RETRY_STATUS or resp.status_code >= 500):
                    raise RewardRequestRejected(f"judge {self.endpoint} refused the request: {detail}"
                                                f"{self._key_note(resp.status_code)}")
                last, retry_after = detail, _retry_after(resp)
            if attempt == self.max_retries:
                break
            if budget.left <= 0:
                raise RewardUnavailable(f"judge {self.endpoint}: the step's retries are spent (reward.retry_budget="
                                        f"{self.retry_budget}); last status: {last}")
            budget.left -= 1
            self.stats["retries"] += 1
            await asyncio.sleep(backoff_delay(attempt, self.backoff, self.max_backoff, retry_after, self._rng))
        raise RewardUnavailable(f"judge {self.endpoint} failed {self.max_retries + 1} attempts (reward.max_retries="
                                f"{self.max_retries}); last status: {last}")

    def _answer(self, resp) -> str:
        """`choices[0].message.content` (text parts joined when it is a list; "" when null)."""
        try:
            content = resp.json()["choices"][0]["message"].get("content")
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            raise RewardRequestRejected(f"judge {self.endpoint} answered HTTP 200 without choices[0].message: "
                                        f"{resp.text[:200]!r}") from None
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        return content or ""


REMOTE_KEYS = ("url", "model", "api_key_env", "max_concurrency", "timeout", "connect_timeout", "max_retries",
               "retry_budget", "backoff", "max_backoff", "image_format", "jpeg_quality", "request_options")


def build_backend(name: str, backend: str, path: str | None, device: str, dtype: str, trust_remote_code: bool,
                  remote: dict):
    """The judge's backend: a `LocalVLM` of `path` (backend=local) or an `OpenAIChat` of `remote` (backend=openai,
    keys REMOTE_KEYS); the other backend's keys must be left at their defaults (None for url / model)."""
    if backend not in BACKENDS:
        raise ValueError(f"{name}: backend={backend!r} is not valid; allowed: {', '.join(BACKENDS)}")
    if backend == "local":
        if remote.get("url") is not None or remote.get("model") is not None:
            raise ValueError(f"{name}: reward.url / reward.model are for backend=openai (backend=local loads "
                             "reward.path)")
        if path is None:
            raise ValueError(f"{name}: reward.path must be set (the judge's local model directory), or set "
                             "backend=openai and reward.url")
        return LocalVLM(path, device, dtype, trust_remote_code=trust_remote_code)
    if path is not None:
        raise ValueError(f"{name}: backend=openai asks reward.url; reward.path={path!r} is for backend=local")
    if remote.get("url") is None:
        raise ValueError(f"{name}: backend=openai needs reward.url (the API's base URL, e.g. http://host:8000/v1)")
    return OpenAIChat(**remote)

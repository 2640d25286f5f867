"""The reward server under hostile or heavy load, on loopback (polyrl/serving): decoded-pixel budgets (per request
and in flight, with the process's peak RSS measured), small requests scored between a large one's calls,
header / body deadlines, idle connections, deeply nested JSON. Every test is bounded in time (seconds) and
memory (a few hundred MB at most)."""

import base64
import io
import re
import socket
import threading
import time

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from polyrl.config import ConfigError
from polyrl.rewards import RewardOutput
from polyrl.serving.server import BackgroundServer, ServerLimits, create_app


def _png(size, color=(0, 0, 0)) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buf, format="PNG", optimize=True)
    return base64.b64encode(buf.getvalue()).decode()


class Recorder:
    """Score = mean pixel value; records every call's prompts, dtype and shape; `gate` (when set) holds each call
    until released, `delay` slows each call down."""

    def __init__(self, delay=0.0, gate: threading.Event | None = None):
        self.delay, self.gate, self.calls, self.started = delay, gate, [], threading.Event()

    def __call__(self, images, prompts, metadata):
        self.calls.append((list(prompts), images.dtype, tuple(images.shape), images.is_contiguous()))
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(30), "the test never released the scorer"
        time.sleep(self.delay)
        return RewardOutput(images.mean(dim=(1, 2, 3)))


def _score(srv, images, prompts, **kw):
    return httpx.post(srv.url + "/score", json={"images": images, "prompts": prompts}, timeout=60, **kw)


def _in_thread(fn):
    out = {}
    thread = threading.Thread(target=lambda: out.update(value=fn(), done=time.monotonic()), daemon=True)
    thread.start()
    return thread, out


# ---------------------------------------------------------------------------------------------- memory
def _peak_rss_mb() -> float:
    return int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1)) / 1024


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (the peak RSS) to the current RSS; Linux only
        return True
    except OSError:
        return False


def test_the_issues_request_stays_within_its_budgeted_memory():
    """The issue's case at a quarter of the pixels (eight all-black 2048² PNGs, 32 kB of JSON): measured as the
    growth of the process's peak RSS while the request is served. The budget: the request's uint8 pixels (3 B
    each) + one scorer call's float32 copy (12 B per pixel of max_call_pixels) + 160 MB for decoding one PNG and
    the interpreter. The old server (float32 stack of the whole request, another for /255) grew by ~1 GB here;
    it took 3.5 GB for the 4096² original."""
    if not _reset_peak_rss():
        pytest.skip("needs /proc/self/clear_refs (Linux) to measure the peak RSS")
    side, n = 2048, 8
    limits = ServerLimits(max_call_pixels=2 * side * side)
    reward = Recorder()
    images = [_png(side)] * n
    with BackgroundServer(create_app(reward, "mean", limits)) as srv:
        assert _score(srv, [_png(8)], ["warm-up"]).status_code == 200  # imports, threads, first-call allocations
        _reset_peak_rss()
        before = _peak_rss_mb()
        resp = _score(srv, images, ["p"] * n)
        grew = _peak_rss_mb() - before
        stats = httpx.get(srv.url + "/health").json()["stats"]
    assert resp.status_code == 200 and resp.json()["scores"] == [0.0] * n
    request_pixels = n * side * side
    budget_mb = (3 * request_pixels + 12 * limits.max_call_pixels) / 2**20 + 160
    assert grew < budget_mb, f"peak RSS grew by {grew:.0f} MB; the budget is {budget_mb:.0f} MB"
    # the decoded-pixel counter and the scorer calls say the same
    assert stats["peak_pixels_in_flight"] == request_pixels
    assert stats["peak_call_pixels"] == limits.max_call_pixels and stats["pixels_in_flight"] == 0
    scored = [c for c in reward.calls if c[0][0] == "p"]
    assert [c[2] for c in scored] == [(2, 3, side, side)] * 4  # float only for two images at a time
    assert all(c[1] == torch.float32 and c[3] for c in scored)


def test_requests_over_the_in_flight_budget_get_503_with_retry_after():
    """Two 64² images in flight (8192 pixels) fill a budget of 10000; a third image waits for none of them: it is
    refused at once with Retry-After, before a pixel of it is decoded, and admitted once the others are done."""
    gate = threading.Event()
    reward = Recorder(gate=gate)
    limits = ServerLimits(max_inflight_pixels=10_000, max_request_pixels=10_000)
    with BackgroundServer(create_app(reward, "mean", limits)) as srv:
        thread, first = _in_thread(lambda: _score(srv, [_png(64)] * 2, ["a", "b"]))
        assert reward.started.wait(10)
        health = httpx.get(srv.url + "/health").json()
        assert health["stats"]["pixels_in_flight"] == 2 * 64 * 64
        assert health["limits"]["max_inflight_pixels"] == 10_000
        t0 = time.monotonic()
        busy = _score(srv, [_png(64)], ["c"])
        assert time.monotonic() - t0 < 5 and busy.status_code == 503, busy.text
        assert busy.headers["retry-after"] == "1"
        assert busy.json()["detail"].startswith("busy: this request decodes to 4096 pixels and 8192 of the 10000 ")
        # a request over the per-request limit is a 413 (it could never fit), not a 503
        assert _score(srv, [_png(64)] * 3, ["x"] * 3).status_code == 413
        gate.set()
        thread.join(30)
        assert first["value"].status_code == 200
        assert _score(srv, [_png(64)], ["c"]).status_code == 200
        stats = httpx.get(srv.url + "/health").json()["stats"]
    assert stats["refused_busy"] == 1 and stats["peak_pixels_in_flight"] == 8192 and stats["pixels_in_flight"] == 0
    assert [c[0] for c in reward.calls] == [["a", "b"], ["c"]]


def test_the_http_reward_client_waits_out_a_busy_server():
    """`reward=http` treats the 503 as retryable (Retry-After, capped by its max_backoff) and gets its scores once
    the request holding the budget is done."""
    from polyrl.rewards import build_reward

    gate = threading.Event()
    reward = Recorder(gate=gate)
    limits = ServerLimits(max_inflight_pixels=8 * 8, max_request_pixels=8 * 8)
    with BackgroundServer(create_app(reward, "mean", limits)) as srv:
        thread, first = _in_thread(lambda: _score(srv, [_png(8)], ["holder"]))
        assert reward.started.wait(10)
        client = build_reward({"name": "http", "url": srv.url, "backoff": 0.05, "max_backoff": 0.1,
                               "max_retries": 100})
        threading.Timer(0.5, gate.set).start()
        out = client(torch.full((1, 3, 8, 8), 0.5), ["client"], [{}])
        thread.join(30)
        stats = httpx.get(srv.url + "/health").json()["stats"]
    assert first["value"].status_code == 200
    assert out.scores.tolist() == [pytest.approx(128 / 255)]
    assert stats["refused_busy"] >= 1 and [c[0] for c in reward.calls] == [["holder"], ["client"]]


def test_a_small_request_is_scored_between_the_calls_of_a_large_one():
    """A 16-image request cut into 8 calls of 2 (max_call_pixels); a 1-image request sent while its first call
    runs is scored in the next call (least attained service), not after the 7 others (arrival order)."""
    reward = Recorder(delay=0.15)
    limits = ServerLimits(max_call_pixels=2 * 32 * 32, max_wait_ms=0)
    with BackgroundServer(create_app(reward, "mean", limits)) as srv:
        large_thread, large = _in_thread(lambda: _score(srv, [_png(32, (10, 20, 30))] * 16, ["large"] * 16))
        assert reward.started.wait(10)
        small_thread, small = _in_thread(lambda: _score(srv, [_png(32, (255, 255, 255))], ["small"]))
        small_thread.join(30)
        large_thread.join(30)
    assert small["value"].status_code == 200 and small["value"].json()["scores"] == [1.0]
    assert large["value"].status_code == 200 and len(large["value"].json()["scores"]) == 16
    order = [c[0][0] for c in reward.calls]
    assert order.index("small") <= 2, order  # FIFO would have made it the 9th call
    assert small["done"] < large["done"] - 0.5  # ~5 calls of 0.15 s still to go when it was answered


# ---------------------------------------------------------------------------------------------- connections
@pytest.fixture
def guarded_server():
    limits = ServerLimits(max_connections=8, header_timeout_s=1.0, body_timeout_s=1.0, keep_alive_s=0.5,
                          max_body_bytes=2_000_000)
    with BackgroundServer(create_app(Recorder(), "mean", limits)) as srv:
        yield srv


def _connect(srv) -> socket.socket:
    sock = socket.create_connection((srv.host, srv.port), timeout=5)
    return sock


def _read_until_closed(sock, limit_s=5.0) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when it closed (seconds from now)."""
    t0, data = time.monotonic(), b""
    sock.settimeout(limit_s)
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data, time.monotonic() - t0


def test_a_1_byte_per_second_body_is_cut_off(guarded_server):
    sock = _connect(guarded_server)
    t0 = time.monotonic()
    sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n")

    def trickle():
        try:
            for _ in range(10):
                sock.sendall(b" ")
                time.sleep(1.0)
        except OSError:  # the server hung up: what this test wants
            pass

    threading.Thread(target=trickle, daemon=True).start()
    data, _ = _read_until_closed(sock)
    elapsed = time.monotonic() - t0
    assert data.startswith(b"HTTP/1.1 408 "), data
    assert b'"the body did not arrive within 1 s' in data and b"connection: close" in data.lower()
    assert 0.9 < elapsed < 3.0
    assert httpx.get(guarded_server.url + "/health").status_code == 200


def test_headers_that_never_finish_are_cut_off(guarded_server):
    silent, trickling = _connect(guarded_server), _connect(guarded_server)
    trickling.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\n")

    def trickle():
        try:
            for _ in range(20):
                time.sleep(0.2)
                trickling.sendall(b"X")
        except OSError:
            pass

    threading.Thread(target=trickle, daemon=True).start()
    data, closed_after = _read_until_closed(trickling)
    assert data.startswith(b"HTTP/1.1 408 ") and b"the request headers did not arrive within 1 s" in data
    assert closed_after < 3.0
    data, closed_after = _read_until_closed(silent)  # a connection that never sent a byte: just closed
    assert data == b"" and closed_after < 3.0


def test_idle_connections_are_limited_and_closed(guarded_server):
    """64 connections that send nothing: while they are open a request is refused at once (503, JSON,
    Retry-After), and within the header deadline the server closes them all and serves again."""
    idle = [_connect(guarded_server) for _ in range(64)]
    time.sleep(0.2)  # let the server accept them
    t0 = time.monotonic()
    busy = httpx.get(guarded_server.url + "/health", timeout=5)
    assert time.monotonic() - t0 < 2
    assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
    assert "more than 8 connections or requests at once" in busy.json()["detail"]
    for sock in idle:
        data, closed_after = _read_until_closed(sock)
        assert data == b"" and closed_after < 3.0
        sock.close()
    assert httpx.get(guarded_server.url + "/health").status_code == 200
    # a kept-alive connection that goes idle is closed after keep_alive_s (uvicorn's timeout_keep_alive)
    keep = _connect(guarded_server)
    keep.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    data, closed_after = _read_until_closed(keep)
    assert data.startswith(b"HTTP/1.1 200 ") and closed_after < 2.0


@pytest.mark.parametrize("body, detail", [
    (b"[" * 1_000_000, "malformed JSON: nested too deeply"),
    (b'{"a":' * 200_000 + b"1" + b"}" * 200_000, "malformed JSON: nested too deeply"),
    (b'{"images": [' + b"9" * 5000 + b"]}", "malformed JSON: Exceeds the limit (4300 digits)"),
], ids=["1e6-deep-array", "2e5-deep-object", "5000-digit-int"])
def test_deeply_nested_or_huge_number_json_is_a_json_400(guarded_server, body, detail):
    resp = httpx.post(guarded_server.url + "/score", content=body, headers={"Content-Type": "application/json"},
                      timeout=30)
    assert resp.status_code == 400 and resp.headers["content-type"] == "application/json", resp.text
    assert resp.json()["detail"].startswith(detail)
    assert httpx.get(guarded_server.url + "/health").status_code == 200


# ---------------------------------------------------------------------------------------------- configuration
def test_serve_reward_flags_reach_the_limits_and_health(monkeypatch):
    from polyrl.serving import cli, server

    made = {}
    monkeypatch.setattr(server, "create_app", lambda reward, name, limits, token: made.update(limits=limits) or "app")
    monkeypatch.setattr(server, "serve", lambda app, host, port, log_level: None)
    assert cli.main(["reward=jpeg_compressibility", "--max-inflight-pixels", "5000", "--max-request-pixels", "4000",
                     "--max-call-pixels", "300", "--max-connections", "3", "--header-timeout", "2.5",
                     "--body-timeout", "7", "--keep-alive", "1.5", "--max-header-kb", "4"]) == 0
    limits = made["limits"]
    assert (limits.max_inflight_pixels, limits.max_request_pixels, limits.max_call_pixels) == (5000, 4000, 300)
    assert (limits.max_connections, limits.header_timeout_s, limits.body_timeout_s, limits.keep_alive_s,
            limits.max_header_bytes) == (3, 2.5, 7.0, 1.5, 4096)
    with pytest.raises(ConfigError, match=r"--max-request-pixels=4000 is over --max-inflight-pixels=3000"):
        cli.main(["reward=jpeg_compressibility", "--max-inflight-pixels", "3000", "--max-request-pixels", "4000"])
    with pytest.raises(ConfigError, match=r"--body-timeout=0.0 must be > 0"):
        cli.main(["reward=jpeg_compressibility", "--body-timeout", "0"])


def test_the_uvicorn_config_carries_the_connection_limits():
    from polyrl.serving.server import uvicorn_config

    limits = ServerLimits(max_connections=5, keep_alive_s=2.0, max_header_bytes=8192, header_timeout_s=3.0)
    config = uvicorn_config(create_app(Recorder(), "mean", limits))
    assert (config.limit_concurrency, config.timeout_keep_alive, config.h11_max_incomplete_event_size) == (5, 2.0, 8192)
    assert config.http.header_timeout_s == 3.0


def test_decoded_media_stay_uint8_until_the_scorer_call():
    """A request decodes to its uint8 pixels (3 B each; the PNG's own values, one array for the batch); the float
    copy a scorer is given is made per call, and equals the old server's `uint8 / 255` float stack."""
    import json

    from polyrl.serving.batching import scorer_input
    from polyrl.serving.server import _decode, _parse_request

    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 256, (5, 7, 3), dtype=np.uint8) for _ in range(3)]
    encoded = []
    for a in arrays:
        buf = io.BytesIO()
        Image.fromarray(a).save(buf, format="PNG")
        encoded.append(base64.b64encode(buf.getvalue()).decode())
    body = json.dumps({"images": encoded, "prompts": ["p"] * 3}).encode()
    request = _parse_request(body, ServerLimits())
    assert request.pixels == 3 * 5 * 7
    media = _decode(request, ServerLimits())
    assert media.dtype == torch.uint8 and media.shape == (3, 3, 5, 7)
    assert torch.equal(media, torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2))
    floats = scorer_input([media])
    assert floats.dtype == torch.float32 and floats.is_contiguous()
    assert torch.equal(floats, torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float().div(255.0))
    assert torch.equal(scorer_input([media[:1], media[1:]]), floats)  # pieces of a call are concatenated first

"""The reward server on loopback: contract, limits, token, errors, batching across requests."""

import base64
import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from PIL import Image

from polyrl.rewards import RewardOutput, build_reward
from polyrl.rewards.codec import encode_images
from polyrl.serving.server import BackgroundServer, ServerLimits, create_app


def _images(n, size=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    # smooth + noisy images so the JPEG sizes differ per image
    return (torch.rand(n, 3, 1, 1, generator=g) * torch.rand(n, 1, size, size, generator=g)).clamp(0, 1)


@pytest.fixture(scope="module")
def jpeg_server():
    with BackgroundServer(create_app(build_reward({"name": "jpeg_compressibility"}), "jpeg_compressibility",
                                     ServerLimits(max_body_bytes=200_000, max_images=8, max_image_pixels=64 * 64),
                                     token="s3cret")) as srv:
        yield srv


AUTH = {"Authorization": "Bearer s3cret"}


def _post(srv, payload=None, content=None, headers=AUTH):
    if payload is not None:
        return httpx.post(srv.url + "/score", json=payload, headers=headers, timeout=30)
    return httpx.post(srv.url + "/score", content=content, headers={**headers, "Content-Type": "application/json"},
                      timeout=30)


def test_scores_equal_the_local_scorer(jpeg_server):
    images = _images(5)
    local = build_reward({"name": "jpeg_compressibility"})(images, ["p"] * 5, [{}] * 5)
    resp = _post(jpeg_server, {"images": encode_images(images), "prompts": ["p"] * 5},
                 headers={**AUTH, "X-Request-ID": "req-42"})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["request_id"] == "req-42" and resp.headers["x-request-id"] == "req-42"
    assert torch.equal(torch.tensor(body["scores"], dtype=torch.float32), local.scores)
    assert body["extras"]["jpeg/kilobytes"] == pytest.approx(local.extras["jpeg/kilobytes"])
    health = httpx.get(jpeg_server.url + "/health").json()  # no token needed
    assert health["status"] == "ok" and health["reward"] == "jpeg_compressibility"


def test_jpeg_input_is_accepted(jpeg_server):
    resp = _post(jpeg_server, {"images": encode_images(_images(2), "jpeg"), "prompts": ["a", "b"],
                               "metadata": [{"k": 1}, {}]})
    assert resp.status_code == 200 and len(resp.json()["scores"]) == 2


@pytest.mark.parametrize("payload, status, message", [
    (b'{"images": [', 400, "malformed JSON"),
    (b'[1, 2]', 422, "must be a JSON object"),
    (b'{"images": [], "prompts": []}', 422, "'images' must be a non-empty list"),
    (b'{"images": ["aGk="], "prompts": ["a", "b"]}', 422, "got 1 images but 2 prompts"),
    (b'{"images": ["not base64!"], "prompts": ["a"]}', 422, "images[0]: not valid base64"),
    (b'{"images": ["aGVsbG8="], "prompts": ["a"]}', 422, "images[0]: not a PNG or JPEG image"),
    (b'{"images": ["aGk="], "prompts": ["a"], "extra": 1}', 422, "unknown field(s) extra"),
    (b'{"images": ["aGk="], "prompts": ["a"], "metadata": [1]}', 422, "'metadata' must be a list of objects"),
])
def test_malformed_requests_get_a_4xx_and_the_server_stays_up(jpeg_server, payload, status, message):
    resp = _post(jpeg_server, content=payload)
    assert resp.status_code == status and message in resp.json()["detail"], resp.text
    assert _post(jpeg_server, {"images": encode_images(_images(1)), "prompts": ["p"]}).status_code == 200


def test_size_limits(jpeg_server):
    resp = _post(jpeg_server, content=b'{"images": ["' + b"A" * 300_000 + b'"], "prompts": ["a"]}')
    assert resp.status_code == 413 and "over the limit of 200000 bytes" in resp.json()["detail"]
    resp = _post(jpeg_server, {"images": encode_images(_images(9, 8)), "prompts": ["p"] * 9})
    assert resp.status_code == 413 and "9 images in one request; the limit is 8" in resp.json()["detail"]
    resp = _post(jpeg_server, {"images": encode_images(_images(1, 65)), "prompts": ["p"]})
    assert resp.status_code == 413 and "65x65 = 4225 pixels is over the limit of 4096" in resp.json()["detail"]
    mixed = encode_images(_images(1, 16)) + encode_images(_images(1, 32))
    resp = _post(jpeg_server, {"images": mixed, "prompts": ["p", "q"]})
    assert resp.status_code == 422 and "one size" in resp.json()["detail"]
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="GIF")
    resp = _post(jpeg_server, {"images": [base64.b64encode(buf.getvalue()).decode()], "prompts": ["p"]})
    assert resp.status_code == 422 and "GIF is not accepted" in resp.json()["detail"]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}])
def test_missing_or_wrong_token_is_401(jpeg_server, headers):
    resp = _post(jpeg_server, {"images": encode_images(_images(1)), "prompts": ["p"]}, headers=headers)
    assert resp.status_code == 401 and "bearer token" in resp.json()["detail"]
    assert resp.headers["www-authenticate"] == "Bearer"


class MeanPixel:
    """Score = mean pixel value (distinct per image, so a misrouted score is visible); records batch sizes."""

    def __init__(self, delay=0.0):
        self.delay, self.batch_sizes, self.lock = delay, [], threading.Lock()

    def __call__(self, images, prompts, metadata):
        time.sleep(self.delay)
        with self.lock:
            self.batch_sizes.append(images.shape[0])
        if any(p == "boom" for p in prompts):
            raise RuntimeError("scorer crashed on 'boom'")
        if any(p == "reject" for p in prompts):
            raise ValueError("cannot parse prompt 'reject'")
        if any(p == "nan" for p in prompts):
            return RewardOutput(torch.full((images.shape[0],), float("nan")))
        return RewardOutput(images.mean(dim=(1, 2, 3)), {"idx": [m.get("i") for m in metadata], "const": 7})


def test_concurrent_requests_are_merged_and_split_back():
    reward = MeanPixel(delay=0.05)
    with BackgroundServer(create_app(reward, "mean", ServerLimits(max_batch=8, max_wait_ms=30))) as srv:
        imgs = _images(16, 8, seed=3)

        def one(k):
            sl = slice(2 * k, 2 * k + 2)
            payload = {"images": encode_images(imgs[sl]), "prompts": ["p", "p"],
                       "metadata": [{"i": 2 * k}, {"i": 2 * k + 1}]}
            return k, httpx.post(srv.url + "/score", json=payload, timeout=30).json()

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(one, range(8)))
        stats = httpx.get(srv.url + "/health").json()["stats"]
    expected = torch.round(imgs * 255) / 255  # what survives the PNG round trip
    for k, body in results:
        assert body["extras"]["idx"] == [2 * k, 2 * k + 1] and body["extras"]["const"] == 7
        assert body["scores"] == pytest.approx(expected[2 * k : 2 * k + 2].mean(dim=(1, 2, 3)).tolist(), abs=1e-6)
    assert stats["requests"] == 8 and stats["images"] == 16
    assert max(reward.batch_sizes) <= 8 and len(reward.batch_sizes) < 8  # merged, within the batch limit
    assert sum(reward.batch_sizes) == 16


def test_a_large_request_is_split_into_scorer_calls_of_max_batch():
    reward = MeanPixel()
    with BackgroundServer(create_app(reward, "mean", ServerLimits(max_batch=3))) as srv:
        imgs = _images(7, 8)
        body = httpx.post(srv.url + "/score", json={"images": encode_images(imgs), "prompts": ["p"] * 7}).json()
    assert reward.batch_sizes == [3, 3, 1]
    assert body["scores"] == pytest.approx((torch.round(imgs * 255) / 255).mean(dim=(1, 2, 3)).tolist(), abs=1e-6)


def test_an_unusable_answer_is_a_500_and_the_server_keeps_serving():
    """A scorer that returns no RewardOutput fails its request; the batching worker survives it."""
    calls = []

    def reward(images, prompts, metadata):
        calls.append(prompts[0])
        return None if prompts[0] == "none" else RewardOutput(images.mean(dim=(1, 2, 3)))

    with BackgroundServer(create_app(reward, "odd")) as srv:
        resp = httpx.post(srv.url + "/score", json={"images": encode_images(_images(1, 8)), "prompts": ["none"]})
        assert resp.status_code == 500 and "the scorer returned an unusable answer (AttributeError" in resp.text
        resp = httpx.post(srv.url + "/score", json={"images": encode_images(_images(1, 8)), "prompts": ["ok"]})
        assert resp.status_code == 200
    assert calls == ["none", "ok"]


def test_scorer_failures_are_errors_not_scores_and_stay_with_their_request():
    reward = MeanPixel(delay=0.05)
    with BackgroundServer(create_app(reward, "mean", ServerLimits(max_batch=16, max_wait_ms=50))) as srv:
        def one(prompt):
            payload = {"images": encode_images(_images(2, 8)), "prompts": [prompt, "p"]}
            return prompt, httpx.post(srv.url + "/score", json=payload, timeout=30)

        with ThreadPoolExecutor(5) as pool:
            results = dict(pool.map(one, ["ok1", "boom", "ok2", "reject", "nan"]))
        assert httpx.get(srv.url + "/health").status_code == 200
    assert results["ok1"].status_code == 200 and results["ok2"].status_code == 200
    assert results["boom"].status_code == 500
    assert results["boom"].json()["detail"] == "the scorer raised RuntimeError: scorer crashed on 'boom'"
    assert results["reject"].status_code == 422
    assert "the scorer rejected the input: ValueError: cannot parse prompt" in results["reject"].json()["detail"]
    assert results["nan"].status_code == 500
    assert results["nan"].json()["detail"] == "scorer returned 2 non-finite scores of 2"

"""The `http` reward client against real loopback servers: scores, retries, ids, token, the pickle adapter."""

import io
import pickle
import socket

import numpy as np
import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from PIL import Image

from polyrl.rewards import RewardOutput, build_reward
from polyrl.rewards.http import HttpReward, RewardRequestRejected, backoff_delay, safe_unpickle
from polyrl.rewards.stage import RewardUnavailable
from polyrl.serving.server import BackgroundServer, ServerLimits, create_app


def _images(n, size=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, 3, 1, 1, generator=g) * torch.rand(n, 1, size, size, generator=g)).clamp(0, 1)


def _client(url, **kw):
    kw.setdefault("backoff", 0.01)
    kw.setdefault("max_backoff", 0.05)
    return build_reward({"name": "http", "url": url, **kw})


@pytest.fixture(scope="module")
def jpeg_server():
    with BackgroundServer(create_app(build_reward({"name": "jpeg_compressibility"}), "jpeg")) as srv:
        yield srv


def test_scores_equal_the_local_scorer_over_concurrent_chunks(jpeg_server):
    images, prompts = _images(8), [f"p{i}" for i in range(8)]
    local = build_reward({"name": "jpeg_compressibility"})(images, prompts, [{}] * 8)
    client = _client(jpeg_server.url, chunk_size=3, max_concurrency=3)
    out = client(images, prompts, [{}] * 8)
    assert torch.equal(out.scores, local.scores)
    assert out.extras["jpeg/kilobytes"] == pytest.approx(local.extras["jpeg/kilobytes"])
    assert client.stats == {"requests": 3, "retries": 0}
    out2 = client(images[:2], prompts[:2], [{}] * 2)  # the pooled connection is reused by a second call
    assert torch.equal(out2.scores, local.scores[:2])
    client.close()


def test_token_from_the_environment(monkeypatch):
    reward = build_reward({"name": "jpeg_compressibility"})
    with BackgroundServer(create_app(reward, "jpeg", token="tok")) as srv:
        monkeypatch.setenv("MY_TOKEN", "tok")
        assert _client(srv.url, token_env="MY_TOKEN")(_images(2), ["a", "b"], [{}, {}]).scores.shape == (2,)
        monkeypatch.setenv("MY_TOKEN", "nope")
        client = _client(srv.url, token_env="MY_TOKEN", max_retries=5)
        with pytest.raises(RewardRequestRejected, match=r"refused the request: HTTP 401: missing or wrong bearer"):
            client(_images(2), ["a", "b"], [{}, {}])
        assert client.stats["retries"] == 0  # a 4xx other than 408/429 is not retried


class Flaky:
    """Raises for the first `failures` calls (the server answers 500), then scores by mean pixel."""

    def __init__(self, failures):
        self.failures, self.calls = failures, 0

    def __call__(self, images, prompts, metadata):
        self.calls += 1
        if self.calls <= self.failures:
            raise RuntimeError(f"transient failure {self.calls}")
        return RewardOutput(images.mean(dim=(1, 2, 3)))


def test_5xx_is_retried_until_it_succeeds():
    with BackgroundServer(create_app(Flaky(2), "flaky")) as srv:
        client = _client(srv.url, max_retries=3)
        out = client(_images(2, 8), ["a", "b"], [{}, {}])
    assert out.scores.shape == (2,) and client.stats == {"requests": 3, "retries": 2}


def test_retry_budget_spent_names_url_and_last_error():
    with BackgroundServer(create_app(Flaky(100), "flaky")) as srv:
        client = _client(srv.url, max_retries=2)
        with pytest.raises(RewardUnavailable) as e:
            client(_images(2, 8), ["a", "b"], [{}, {}])
    assert str(e.value) == (f"reward server {srv.url}/score failed 3 attempts (reward.max_retries=2); last error: "
                            "HTTP 500: the scorer raised RuntimeError: transient failure 3")


def test_connection_refused_is_retried_then_unavailable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    client = _client(f"http://127.0.0.1:{port}", max_retries=2)
    with pytest.raises(RewardUnavailable, match=rf"http://127.0.0.1:{port}/score failed 3 attempts .* ConnectError"):
        client(_images(1, 8), ["a"], [{}])
    assert client.stats["retries"] == 2


def _fake_app(handler):
    app = FastAPI()
    app.post("/score")(handler)
    app.post("/")(handler)
    return app


def test_408_and_429_are_retried_other_4xx_are_not():
    calls = {"n": 0}

    async def handler(request: Request):
        calls["n"] += 1
        body = await request.json()
        rid = request.headers["x-request-id"]
        if calls["n"] == 1:
            return JSONResponse({"detail": "slow down"}, status_code=429, headers={"Retry-After": "0"})
        if calls["n"] == 2:
            return JSONResponse({"detail": "timeout"}, status_code=408)
        if body["prompts"][0] == "bad":
            return JSONResponse({"detail": "no such prompt"}, status_code=404)
        return {"scores": [1.0] * len(body["images"]), "extras": {}, "request_id": rid}

    with BackgroundServer(_fake_app(handler)) as srv:
        client = _client(srv.url, max_retries=4)
        assert client(_images(1, 8), ["a"], [{}]).scores.tolist() == [1.0]
        assert client.stats["retries"] == 2
        with pytest.raises(RewardRequestRejected, match="HTTP 404: no such prompt"):
            client(_images(1, 8), ["bad"], [{}])
        assert client.stats["retries"] == 2


@pytest.mark.parametrize("answer, message", [
    ({"scores": [1.0], "request_id": "someone-else"}, "answered request .* with request_id 'someone-else'"),
    ({"scores": [1.0, 2.0], "request_id": None}, "returned 2 scores for 1 images"),
    ({"scores": [None], "request_id": None}, "non-numeric scores|non-finite: 1"),
])
def test_answers_that_could_misattribute_scores_are_refused(answer, message):
    async def handler(request: Request):
        body = dict(answer)
        if body["request_id"] is None:
            body["request_id"] = request.headers["x-request-id"]
        return body

    with BackgroundServer(_fake_app(handler)) as srv:
        with pytest.raises(RewardRequestRejected, match=message):
            _client(srv.url)(_images(1, 8), ["a"], [{}])


def test_backoff_doubles_up_to_the_cap_and_honours_retry_after():
    assert [backoff_delay(k, 0.5, 3.0) for k in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert backoff_delay(0, 0.5, 3.0, retry_after=2.0) == 2.0
    assert backoff_delay(0, 0.5, 3.0, retry_after=60.0) == 3.0
    assert backoff_delay(2, 0.5, 3.0, retry_after=0.1) == 2.0


def test_config_errors_are_clear():
    with pytest.raises(ValueError, match=r"reward.protocol='grpc' is not valid; allowed: json, flow_grpo_pickle"):
        HttpReward("http://x", protocol="grpc")
    with pytest.raises(ValueError, match="must start with http:// or https://"):
        HttpReward("localhost:8000")
    with pytest.raises(ValueError, match="reward.protocol=flow_grpo_pickle sends images only; got video"):
        HttpReward("http://x", protocol="flow_grpo_pickle")(torch.zeros(1, 2, 3, 4, 4), ["a"], [{}])
    with pytest.raises(ValueError, match=r"reward.video_format='gif' is not valid; allowed: frames, mp4"):
        HttpReward("http://x", video_format="gif")
    with pytest.raises(ValueError, match=r"reward.mp4_crf=60 must be an integer in \[0, 51\]"):
        HttpReward("http://x", mp4_crf=60)


# ---------------------------------------------------------------------------------------- flow_grpo pickle
def _flow_grpo_style_server(seen):
    """A stand-in for a flow_grpo reward server: pickled dict in (JPEG bytes), pickled dict out."""

    async def handler(request: Request):
        data = pickle.loads(await request.body())  # the test's own server: trusted
        seen.append(data)
        sizes = [len(b) / 1000.0 for b in data["images"]]
        for b in data["images"]:
            assert Image.open(io.BytesIO(b)).format == "JPEG"
        return Response(pickle.dumps({"scores": np.array(sizes), "strict_rewards": [1.0] * len(sizes),
                                      "group_rewards": {"x": [0.5]}}), media_type="application/octet-stream")

    return _fake_app(handler)


def test_flow_grpo_pickle_protocol():
    seen = []
    with BackgroundServer(_flow_grpo_style_server(seen)) as srv:
        client = _client(srv.url + "/", protocol="flow_grpo_pickle", chunk_size=2)
        out = client(_images(3), ["a", "b", "c"], [{"tag": 1}, {"tag": 2}, {"tag": 3}])
    assert [d["prompts"] for d in seen] in (
        [["a", "b"], ["c"]], [["c"], ["a", "b"]])  # two concurrent requests
    assert sorted(m["tag"] for d in seen for m in d["meta_datas"]) == [1, 2, 3]
    sizes = sorted(len(b) / 1000.0 for d in seen for b in d["images"])
    assert sorted(out.scores.tolist()) == pytest.approx(sizes)
    assert out.extras["remote/strict_rewards"] == [1.0, 1.0, 1.0]
    assert "remote/group_rewards" not in out.extras  # not per-sample


class _Exploit:
    def __reduce__(self):
        import os

        return (os.system, ("echo pwned",))


def test_the_pickle_adapter_refuses_code_running_answers():
    assert safe_unpickle(pickle.dumps({"scores": np.arange(3.0), "outputs": [1, 2.5]}))["outputs"] == [1, 2.5]
    with pytest.raises(pickle.UnpicklingError, match="refusing to unpickle posix.system|refusing to unpickle os.system"):
        safe_unpickle(pickle.dumps(_Exploit()))

    async def handler(request: Request):
        return Response(pickle.dumps({"scores": _Exploit()}), media_type="application/octet-stream")

    with BackgroundServer(_fake_app(handler)) as srv:
        with pytest.raises(RewardRequestRejected, match="unreadable pickle answer .*refusing to unpickle"):
            _client(srv.url, protocol="flow_grpo_pickle")(_images(1, 8), ["a"], [{}])


def test_server_limits_reach_the_client_as_a_clear_error():
    reward = build_reward({"name": "jpeg_compressibility"})
    with BackgroundServer(create_app(reward, "jpeg", ServerLimits(max_images=2))) as srv:
        with pytest.raises(RewardRequestRejected, match="HTTP 413: 3 images in one request; the limit is 2"):
            _client(srv.url, chunk_size=3)(_images(3, 8), ["a"] * 3, [{}] * 3)

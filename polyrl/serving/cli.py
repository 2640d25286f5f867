"""`polyrl serve-reward reward=<name> [reward.key=value ...] [--host H] [--port N] [--token T] ...`"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys

from .server import ServerLimits


def reward_config(args: list[str]) -> dict:
    """`reward=<name>` (its YAML in polyrl/config/reward/ when there is one) + `reward.key=value` overrides,
    checked against the reward's constructor as `polyrl train` checks them. `reward.frames` /
    `reward.frame_reduce` (how an image scorer reads video) are checked and kept for `build_reward`."""
    from omegaconf import OmegaConf

    from ..config import ConfigError
    from ..config.schema import _check_kwargs
    from ..rewards import REWARDS
    from ..rewards.base import pop_frame_sampling

    names = [a.partition("=")[2] for a in args if a.startswith("reward=")]
    bad = [a for a in args if not a.startswith(("reward=", "reward."))]
    if bad:
        raise ConfigError(f"unexpected argument(s) {' '.join(bad)}; expected reward=<name> and reward.<key>=<value>")
    if len(names) != 1:
        raise ConfigError(f"give the reward to serve once, as reward=<name>; registered: {', '.join(sorted(REWARDS))}")
    yaml = os.path.join(os.path.dirname(__file__), "..", "config", "reward", f"{names[0]}.yaml")
    base = OmegaConf.load(yaml) if os.path.isfile(yaml) else OmegaConf.create({"name": names[0]})
    cfg = OmegaConf.merge(base, OmegaConf.from_dotlist([a.removeprefix("reward.") for a in args
                                                        if a.startswith("reward.")]))
    if OmegaConf.missing_keys(cfg):
        raise ConfigError(f"reward.{sorted(OmegaConf.missing_keys(cfg))[0]} must be set")
    out = OmegaConf.to_container(cfg, resolve=True)
    out.pop("async", None)  # a trainer-side option; meaningless on the server
    frame_options = {k: out[k] for k in ("frames", "frame_reduce") if k in out}
    try:
        pop_frame_sampling(out, "reward")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _check_kwargs("reward", out, REWARDS)
    return {**out, **frame_options}


def server_limits(a: argparse.Namespace) -> ServerLimits:
    """The flags as `ServerLimits`; a value out of range is a config error naming its flag."""
    from ..config import ConfigError

    values = dict(max_body_bytes=int(a.max_body_mb * 2**20), max_images=a.max_images,
                  max_image_pixels=a.max_image_pixels, max_frames=a.max_frames,
                  max_request_pixels=a.max_request_pixels, max_audio_seconds=a.max_audio_seconds,
                  max_batch=a.max_batch, max_wait_ms=a.max_wait_ms, max_inflight_pixels=a.max_inflight_pixels,
                  max_call_pixels=a.max_call_pixels, max_connections=a.max_connections,
                  header_timeout_s=a.header_timeout, body_timeout_s=a.body_timeout, keep_alive_s=a.keep_alive,
                  max_header_bytes=int(a.max_header_kb * 2**10))
    try:
        return ServerLimits(**values)
    except ValueError as e:  # say it with the flag's name: "max_call_pixels=0" -> "--max-call-pixels=0"
        raise ConfigError(re.sub(r"\b([a-z_]+)=", lambda m: f"{flag_name(m.group(1))}=", str(e))) from None


def flag_name(field: str) -> str:
    """The serve-reward flag of a ServerLimits field."""
    odd = {"max_body_bytes": "--max-body-mb (in bytes)", "max_header_bytes": "--max-header-kb (in bytes)",
           "header_timeout_s": "--header-timeout", "body_timeout_s": "--body-timeout", "keep_alive_s": "--keep-alive"}
    return odd.get(field, "--" + field.replace("_", "-"))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="polyrl serve-reward",
        description="serve a registered reward over HTTP: GET /health, POST /score (see docs/rewards.md)",
    )
    p.add_argument("overrides", nargs="*", help="reward=<name> and reward.<key>=<value>")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--token", default=None,
                   help="require 'Authorization: Bearer <token>' on /score (default: $POLYRL_REWARD_TOKEN if set)")
    defaults = ServerLimits()
    p.add_argument("--max-batch", type=int, default=defaults.max_batch,
                   help="samples (images, videos, audio clips) per scorer call")
    p.add_argument("--max-wait-ms", type=float, default=defaults.max_wait_ms,
                   help="how long a scorer call waits for more requests to merge")
    p.add_argument("--max-body-mb", type=float, default=defaults.max_body_bytes / 2**20)
    p.add_argument("--max-images", type=int, default=defaults.max_images,
                   help="images, videos or audio clips in one request")
    p.add_argument("--max-image-pixels", type=int, default=defaults.max_image_pixels,
                   help="width * height of one image or video frame")
    p.add_argument("--max-frames", type=int, default=defaults.max_frames, help="frames of one video")
    p.add_argument("--max-request-pixels", type=int, default=defaults.max_request_pixels,
                   help="width * height summed over all images and frames of one request")
    p.add_argument("--max-audio-seconds", type=float, default=defaults.max_audio_seconds,
                   help="length of one audio clip")
    p.add_argument("--max-inflight-pixels", type=int, default=defaults.max_inflight_pixels,
                   help="decoded pixels of all requests being decoded, queued or scored (kept as uint8, 3 bytes "
                        "each); a request that does not fit gets 503 with Retry-After")
    p.add_argument("--max-call-pixels", type=int, default=defaults.max_call_pixels,
                   help="pixels per scorer call (its float32 copy: 12 bytes each); larger requests are split")
    p.add_argument("--max-connections", type=int, default=defaults.max_connections,
                   help="open connections or requests in progress (uvicorn's limit_concurrency); over it: 503")
    p.add_argument("--header-timeout", type=float, default=defaults.header_timeout_s,
                   help="seconds for a request's headers to arrive (an idle or trickling connection is closed)")
    p.add_argument("--body-timeout", type=float, default=defaults.body_timeout_s,
                   help="seconds for a request's whole body to arrive after its headers (else 408)")
    p.add_argument("--keep-alive", type=float, default=defaults.keep_alive_s,
                   help="seconds an idle connection is kept open between requests (uvicorn's timeout_keep_alive)")
    p.add_argument("--max-header-kb", type=float, default=defaults.max_header_bytes / 2**10,
                   help="request line + headers (uvicorn's h11 limit)")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import MODULE first (a module that registers your own reward with @register_reward)")
    p.add_argument("--log-level", default="info")
    a = p.parse_args(argv)
    for module in a.imports:
        importlib.import_module(module)

    from ..rewards import build_reward
    from .server import create_app, serve

    cfg = reward_config(a.overrides)
    limits = server_limits(a)
    token = a.token if a.token is not None else os.environ.get("POLYRL_REWARD_TOKEN") or None
    reward = build_reward(cfg)
    print(f"polyrl: serving reward {cfg['name']} on http://{a.host}:{a.port} (POST /score, GET /health"
          f"{', bearer token required' if token else ''})", file=sys.stderr, flush=True)
    serve(create_app(reward, cfg["name"], limits, token), a.host, a.port, a.log_level)
    return 0

"""Reward stage interface: media + prompts + metadata -> scores + extras.

A reward is any callable object registered under a name; `build_reward(cfg)` makes one from the `reward`
config group (`reward.name` picks the class, the other keys are its constructor arguments).

Call convention (docs/rewards.md, "Scorers"):

    reward(media, prompts, metadata) -> RewardOutput                       # a reward of decoded media
    reward(media, prompts, metadata, latents=latents) -> RewardOutput      # one that also/only reads latents

`media` is what the generator's VAE decode gives, batch first:

* images: float tensor (B, 3, H, W) in [0, 1];
* video:  float tensor (B, T, 3, H, W) in [0, 1] (T frames);
* audio:  an `Audio` (waveform (B, channels, samples) in [-1, 1] and `sample_rate` in Hz);
* text:   a list of B strings, the responses of a token policy (a text reward declares `media = ("text",)`;
          rewards/rules.py).

A reward declares what it reads with the class attribute `inputs` ("images" when absent; "latents"; or a
tuple of both). "images" stands for decoded media of any of the three kinds. A reward whose `inputs` does not
contain "images" is called with `media=None`, and the trainer then skips the VAE decode for it.
`latents` are the generator's clean latents (B, C, h, w) (or (B, C, T, h, w) for video), float32, on the CPU.

Which kinds of decoded media a reward reads itself is the class attribute `media` (("images",) when absent;
any of "images", "video", "audio"). Every image scorer also scores video: given (B, T, 3, H, W), `call_reward`
scores K evenly spaced frames of each video as (B*K, 3, H, W) images (prompts, metadata and latents repeated
per frame) and reduces the (B, K) scores to (B,) by the mean or the min. K and the reduction are the reward
config's `frames` and `frame_reduce` (`build_reward` pops them, as `async`, and records them on the reward as
`frame_sampling`). A reward never gets a kind it does not read: audio for an image scorer is an error.

Group rewards (docs/rewards.md, "Group rewards") score a prompt's whole group at once (diversity, a judge that
ranks the group): a reward with the class or instance attribute `groupwise = True` is called as

    reward(media, prompts, metadata, group_ids=group_ids) -> RewardOutput   # (+ latents= when it reads latents)

where `group_ids` (B,) long says which samples share a prompt, and the batch holds every member of each group in
it (the reward stage collects whole groups before it calls; rewards/stage.py). `GroupReward` is the base class
that turns this into one `score_group(media, prompt, metadata)` call per group. An image group reward given
video scores frame j of every member as one group (group id × K + j), then reduces per sample as above.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from ..media import KINDS, Audio  # the one Audio type, re-exported here as polyrl.rewards.Audio
from ..registry import Registry

INPUT_KINDS = ("images", "latents")
MEDIA_KINDS = KINDS  # ("images", "video", "audio")
FRAME_REDUCES = ("mean", "min")


@dataclass
class RewardOutput:
    """`scores`: (B,) float32, one per sample. `extras`: per-sample numeric diagnostics, name -> length-B
    list/tensor (the trainer logs each one's mean over the finite values); an extra named `caption` (or
    `<prefix>/caption`) holds instead one string per sample, shown under the sample's tile in the sample grids
    (`caption_texts`; e.g. what the OCR reward read) and not logged as a metric. `media`: media the reward made from
    the samples while scoring them, by kind (`rewrite_render`: the generator's images of a text policy's rewrites);
    `stage.score_batch` adds the kinds the batch lacks to its media, so the held-out sample grids show them."""

    scores: torch.Tensor
    extras: dict[str, Any] = field(default_factory=dict)
    media: dict[str, Any] | None = None


def is_caption_key(key: str) -> bool:
    """Whether an extra holds per-sample caption strings (`caption` or `<prefix>/caption`), not a metric."""
    return key == "caption" or key.endswith("/caption")


def caption_texts(extras: dict, n: int) -> list[str]:
    """The caption lines of n samples from their extras: every caption extra's string of that sample, in the
    extras' order, one per line ("" for a sample with none; a caption extra that is not one entry per sample is
    ignored)."""
    columns = [list(v) for k, v in extras.items() if is_caption_key(k) and isinstance(v, list | tuple) and len(v) == n]
    return ["\n".join(str(c[i]) for c in columns if c[i] not in (None, "")) for i in range(n)]


class Reward(Protocol):
    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> RewardOutput:
        """`images`: (B, 3, H, W) float in [0, 1] on CPU (or video / `Audio`, see the module docstring)."""
        ...


def reward_inputs(reward) -> frozenset[str]:
    """What a reward reads: a subset of {"images", "latents"} from its `inputs` attribute (default images)."""
    declared = getattr(reward, "inputs", "images")
    kinds = frozenset([declared] if isinstance(declared, str) else declared)
    bad = sorted(kinds - set(INPUT_KINDS))
    if bad or not kinds:
        raise ValueError(f"reward {type(reward).__name__}: inputs={declared!r}; allowed: {', '.join(INPUT_KINDS)}")
    return kinds


def media_kind(media) -> str:
    """"images", "video", "audio" or "text" for a batch of decoded media; a clear error for anything else."""
    if isinstance(media, Audio):
        return "audio"
    if isinstance(media, torch.Tensor) and media.ndim == 4 and media.shape[1] == 3:
        return "images"
    if isinstance(media, torch.Tensor) and media.ndim == 5 and media.shape[2] == 3:
        return "video"
    if isinstance(media, list | tuple) and all(isinstance(x, str) for x in media):
        return "text"
    shape = tuple(media.shape) if isinstance(media, torch.Tensor) else type(media).__name__
    raise ValueError(f"expected images (B, 3, H, W), video (B, T, 3, H, W), Audio or a list of strings, got {shape}")


def media_len(media) -> int:
    if isinstance(media, dict):  # several kinds of one batch: {kind: batch}
        return media_len(next(iter(media.values())))
    return len(media) if isinstance(media, Audio | list | tuple) else int(media.shape[0])


def media_slice(media, start: int, stop: int):
    """Samples start..stop of a batch of images, video or `Audio`."""
    if isinstance(media, Audio):
        return Audio(media.waveform[start:stop], media.sample_rate)
    return media[start:stop]


def media_cat(parts: list):
    """Batches of one kind and per-sample shape (and sample rate) -> one batch."""
    if isinstance(parts[0], list | tuple):  # text
        return [x for p in parts for x in p]
    return Audio.cat(parts) if isinstance(parts[0], Audio) else torch.cat(parts)


def reward_media(reward) -> frozenset[str]:
    """The kinds of decoded media a reward (or reward class) reads itself: its `media` attribute, default images."""
    declared = getattr(reward, "media", ("images",))
    kinds = frozenset([declared] if isinstance(declared, str) else declared)
    bad = sorted(kinds - set(MEDIA_KINDS))
    if bad or not kinds:
        name = reward.__name__ if isinstance(reward, type) else type(reward).__name__
        raise ValueError(f"reward {name}: media={declared!r}; allowed: {', '.join(MEDIA_KINDS)}")
    return kinds


@dataclass(frozen=True)
class FrameSampling:
    """How an image scorer reads video: `frames` evenly spaced frames per video (None: every frame), the
    per-frame scores reduced by `reduce` (mean | min). `key` is the config key errors name ("reward",
    "reward.mix.<label>")."""

    frames: int | None = None
    reduce: str = "mean"
    key: str = "reward"


def pop_frame_sampling(cfg: dict, key: str = "reward") -> FrameSampling | None:
    """Pop `frames` and `frame_reduce` from a reward config (options of `call_reward`, not constructor
    arguments) and check them; None when neither is set. ValueError naming `<key>.frames` for a bad value,
    or for a reward that reads video itself (it takes no frame sampling)."""
    frames, reduce = cfg.pop("frames", None), cfg.pop("frame_reduce", None)
    if frames is not None and (isinstance(frames, bool) or not isinstance(frames, int) or frames < 1):
        raise ValueError(f"{key}.frames={frames!r} must be null (every frame) or an integer >= 1")
    if reduce is not None and reduce not in FRAME_REDUCES:
        raise ValueError(f"{key}.frame_reduce={reduce!r} is not valid; allowed: {', '.join(FRAME_REDUCES)}")
    if frames is None and reduce is None:
        return None
    cls = REWARDS.get(cfg.get("name"))
    if cls is not None and "video" in reward_media(cls):
        raise ValueError(f"{key}.frames / {key}.frame_reduce: reward {cfg['name']} reads video itself, so it takes "
                         "no frame sampling (set it on the image scorers it uses: a mix component, or the server's "
                         "reward for reward=http)")
    return FrameSampling(frames, reduce or "mean", key)


def frame_indices(num_frames: int, frames: int | None, key: str = "reward") -> list[int]:
    """`frames` evenly spaced frame indices, round(linspace(0, T-1, K)) (NumPy rounding: halves to even);
    every frame when `frames` is None."""
    if frames is None:
        return list(range(num_frames))
    if frames > num_frames:
        raise ValueError(f"{key}.frames={frames} is more than the {num_frames} frames of the video")
    return [int(i) for i in np.rint(np.linspace(0, num_frames - 1, frames))]


def is_groupwise(reward) -> bool:
    """Whether a reward (or reward class) scores whole prompt groups (its `groupwise` attribute, default False). A
    class whose instances decide (a property, or an attribute set in `__init__`) counts as not groupwise."""
    value = getattr(reward, "groupwise", False)
    return value is True if isinstance(reward, type) else bool(value)


def group_members(group_ids) -> list[list[int]]:
    """The sample indices of each group, groups in order of first appearance, members in batch order."""
    members: dict[int, list[int]] = {}
    for i, g in enumerate(torch.as_tensor(group_ids).reshape(-1).tolist()):
        members.setdefault(int(g), []).append(i)
    return list(members.values())


def media_take(media, idx: list[int]):
    """Samples `idx` (any order) of a batch of images, video, `Audio`, texts or `{kind: batch}`."""
    if media is None:
        return None
    if isinstance(media, dict):
        return {k: media_take(v, idx) for k, v in media.items()}
    if isinstance(media, list | tuple):
        return [media[i] for i in idx]
    if isinstance(media, Audio):
        return Audio(media.waveform[torch.as_tensor(idx, dtype=torch.long, device=media.waveform.device)],
                     media.sample_rate)
    return media[torch.as_tensor(idx, dtype=torch.long, device=media.device)]


def group_chunks(group_ids, size: int) -> list[list[int]]:
    """Sample indices cut into chunks of whole groups: groups in order of first appearance, packed while a chunk
    holds at most `size` samples (a group larger than `size` is a chunk of its own); members stay together."""
    chunks: list[list[int]] = []
    for members in group_members(group_ids):
        if chunks and len(chunks[-1]) + len(members) <= size:
            chunks[-1] += members
        else:
            chunks.append(list(members))
    return chunks


def frame_group_ids(group_ids: torch.Tensor, k: int) -> torch.Tensor:
    """Group ids of (B*K) frames (sample-major) when an image group reward scores K frames per video: frame j of
    the members of group g form one group, numbered dense(g) * K + j."""
    dense = torch.unique(torch.as_tensor(group_ids).reshape(-1), return_inverse=True)[1]
    return (dense.repeat_interleave(k) * k + torch.arange(k).repeat(len(dense))).long()


class GroupReward:
    """Base class of a group reward: `score_group(media, prompt, metadata)` gets one prompt's whole group (its n
    samples' media, the group's prompt, the n metadata entries) and returns a `RewardOutput` of n scores.
    `__call__` (the convention of the module docstring) calls it once per group and puts the scores back in batch
    order; per-sample extras (length n) are put back too, any other extra value is given to each member. A reward
    that can score many groups in one pass (one forward for the whole batch) overrides `__call__` instead."""

    groupwise = True

    def score_group(self, media, prompt: str, metadata: list[dict]) -> RewardOutput:
        raise NotImplementedError

    def __call__(self, media, prompts, metadata, group_ids=None) -> RewardOutput:
        n = media_len(media)
        metadata = check_batch(_reward_name(self), n, prompts, metadata)
        scores = torch.full((n,), float("nan"), dtype=torch.float32)
        extras: dict[str, list] = {}
        for members in group_members(checked_group_ids(self, group_ids, n)):
            out = self.score_group(media_take(media, members), prompts[members[0]], [metadata[i] for i in members])
            part = torch.as_tensor(out.scores, dtype=torch.float32).reshape(-1)
            if part.numel() != len(members):
                raise RuntimeError(f"reward {_reward_name(self)} returned {part.numel()} scores for a group of "
                                   f"{len(members)}")
            scores[members] = part
            for key, value in out.extras.items():
                if isinstance(value, torch.Tensor):
                    value = value.reshape(-1).tolist() if value.ndim > 0 else value.item()
                per = list(value) if isinstance(value, list | tuple) and len(value) == len(members) else \
                    [value] * len(members)
                column = extras.setdefault(key, [None] * n)
                for i, v in zip(members, per, strict=True):
                    column[i] = v
        return RewardOutput(scores, extras)


def checked_group_ids(reward, group_ids, n: int) -> torch.Tensor:
    """(n,) long group ids for a group reward; ValueError when missing or of the wrong length."""
    if group_ids is None:
        raise ValueError(f"reward {_reward_name(reward)} scores whole prompt groups, so it needs the samples' group "
                         "ids (call it through rewards.stage / call_reward(..., group_ids=...))")
    group_ids = torch.as_tensor(group_ids).reshape(-1).long().cpu()
    if group_ids.numel() != n:
        raise ValueError(f"reward {_reward_name(reward)}: {group_ids.numel()} group ids for {n} samples")
    return group_ids


def _reward_name(reward) -> str:
    """The registered name of a reward's class (its class name when it is not registered)."""
    return next((n for n, c in REWARDS.items() if c is type(reward)), type(reward).__name__)


def _call(reward, kinds: frozenset[str], media, prompts, metadata, latents, group_ids=None):
    group = {"group_ids": group_ids} if is_groupwise(reward) else {}
    if "latents" not in kinds:
        return reward(media, prompts, metadata, **group)
    if latents is None:
        raise ValueError(f"reward {type(reward).__name__} reads latents but none were given")
    return reward(media if "images" in kinds else None, prompts, metadata, latents=latents, **group)


def call_reward(reward, media, prompts: list, metadata: list[dict], latents: torch.Tensor | None = None,
                group_ids: torch.Tensor | None = None):
    """Call `reward` with what it declares it reads (the one place the convention above is applied): an image
    scorer given video scores its sampled frames (`score_frames`); a kind it cannot read is a ValueError.
    A prompt with condition media (`{"text", "images"}`) reaches the reward as its text; the condition paths are in
    `metadata` (where edit rewards read their source image). `group_ids` (B,) go to a group reward (required
    there; the caller must pass whole groups) and are ignored by a per-sample one."""
    prompts = [p if isinstance(p, str) else p["text"] for p in prompts]
    if is_groupwise(reward):
        n = len(prompts)
        group_ids = checked_group_ids(reward, group_ids, n)
    else:
        group_ids = None
    kinds = reward_inputs(reward)
    if "images" in kinds and media is None:
        raise ValueError(f"reward {type(reward).__name__} reads images but none were decoded")
    if "images" in kinds and isinstance(media, dict):  # several kinds of one sample (e.g. video + audio)
        media = _pick_media(reward, media)
    if "images" in kinds and not isinstance(media, dict):
        kind, native = media_kind(media), reward_media(reward)
        if kind not in native:
            if kind == "video" and "images" in native:
                return score_frames(reward, media, prompts, metadata, latents, group_ids)
            raise ValueError(f"reward {_reward_name(reward)} reads {', '.join(sorted(native))}; it cannot score "
                             f"{kind} (a reward declares the media it reads with its `media` attribute)")
    return _call(reward, kinds, media, prompts, metadata, latents, group_ids)


def _pick_media(reward, media: dict):
    """What a reward reads of `{kind: batch}` (a model that decodes several kinds per sample): the whole dict when
    it reads every kind, else the one kind it reads, else the video for an image scorer."""
    native = reward_media(reward)
    readable = [k for k in media if k in native]
    if len(readable) == len(media):
        return media
    if len(readable) == 1:
        return media[readable[0]]
    if not readable and "video" in media and "images" in native:
        return media["video"]
    raise ValueError(f"reward {_reward_name(reward)} reads {', '.join(sorted(native))}; the media are "
                     f"{', '.join(media)}")


def score_frames(reward, video: torch.Tensor, prompts: list[str], metadata: list[dict] | None,
                 latents: torch.Tensor | None = None, group_ids: torch.Tensor | None = None) -> RewardOutput:
    """Score a (B, T, 3, H, W) video with an image scorer: the K frames of `reward.frame_sampling` (every frame
    when unset) as (B*K, 3, H, W) images, prompts / metadata / latents repeated per frame, then the (B, K)
    scores reduced to (B,) by its mean or min. Per-sample extras follow the scores: with mean, the mean of a
    sample's numeric per-frame values; with min, the values of the frame that gave the lowest score. A
    non-numeric per-frame extra keeps its value when all K frames agree, else None; other extras pass as they are.
    A group reward scores frame j of a group's members as one group (`frame_group_ids`).
    """
    sampling = getattr(reward, "frame_sampling", None) or FrameSampling()
    name = _reward_name(reward)
    b, t = video.shape[:2]
    metadata = check_batch(name, b, prompts, metadata)
    idx = frame_indices(t, sampling.frames, sampling.key)
    k = len(idx)
    images = video[:, idx].reshape(b * k, *video.shape[2:])
    per_frame = [[x for x in xs for _ in range(k)] for xs in (prompts, metadata)]
    lat = None if latents is None else ({n: v.repeat_interleave(k, 0) for n, v in latents.items()}  # several entries
                                        if isinstance(latents, dict) else latents.repeat_interleave(k, 0))
    frame_groups = frame_group_ids(group_ids, k) if group_ids is not None else None
    out = _call(reward, reward_inputs(reward), images, *per_frame, lat, frame_groups)
    scores = torch.as_tensor(out.scores).detach().to("cpu", torch.float64).reshape(-1)
    if scores.numel() != b * k:
        raise RuntimeError(f"reward {name} returned {scores.numel()} scores for {b} videos x {k} frames")
    scores = scores.view(b, k)
    if sampling.reduce == "mean":
        reduced, pick = scores.mean(1), None
    else:
        reduced, pick = scores.min(1).values, scores.argmin(1).tolist()
    extras = {key: _reduce_frames(v, b, k, pick) for key, v in out.extras.items()}
    return RewardOutput(reduced.float(), extras)


def _reduce_frames(value, b: int, k: int, pick: list[int] | None):
    """A per-frame extra (length B*K) -> per sample (length B): the mean of numeric values (`pick` None) or the
    picked frame's value; anything else as it is."""
    if isinstance(value, torch.Tensor):
        value = value.reshape(-1).tolist() if value.ndim > 0 else value
    if not isinstance(value, list | tuple) or len(value) != b * k:
        return value
    out = []
    for i in range(b):
        frames = list(value[i * k : (i + 1) * k])
        if pick is not None:
            out.append(frames[pick[i]])
            continue
        values = [float(x) for x in frames if isinstance(x, numbers.Real) and not isinstance(x, bool)]
        if len(values) == k:
            out.append(sum(values) / k)
        else:
            out.append(frames[0] if all(x == frames[0] for x in frames) else None)
    return out


def image_batch_as_uint8(images: torch.Tensor) -> list:
    """(B, 3, H, W) in [0, 1] -> B numpy arrays (H, W, 3) uint8 (the input most image processors expect)."""
    if media_kind(images) != "images":
        raise ValueError(f"expected images (B, 3, H, W), got {tuple(images.shape)}")
    arr = images.detach().to("cpu", torch.float32).clamp(0, 1).mul(255).round().to(torch.uint8)
    return list(arr.permute(0, 2, 3, 1).numpy())


def check_batch(name: str, n: int, prompts: list[str], metadata: list[dict] | None) -> list[dict]:
    """Metadata as a list of length n (empty dicts when None); prompts and metadata must match the batch."""
    if len(prompts) != n:
        raise ValueError(f"reward {name}: got {n} samples but {len(prompts)} prompts")
    metadata = list(metadata) if metadata is not None else [{} for _ in range(n)]
    if len(metadata) != n:
        raise ValueError(f"reward {name}: got {n} samples but {len(metadata)} metadata entries")
    return metadata


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not valid; allowed: {', '.join(DTYPES)}")
    return DTYPES[dtype]


REWARDS = Registry("reward")
register_reward = REWARDS.register


def build_reward(cfg: dict, key: str = "reward") -> Reward:
    """The reward of a config (`name` + constructor arguments). `async` (a reward-stage option) and `frames` /
    `frame_reduce` (how an image scorer reads video, recorded as `reward.frame_sampling`) are not constructor
    arguments; `key` names the config in errors."""
    cfg = dict(cfg)
    cfg.pop("async", None)  # a reward-stage option (rewards/stage.py), not a constructor argument
    sampling = pop_frame_sampling(cfg, key)
    reward = REWARDS.build(cfg.pop("name"), **cfg)
    if sampling is not None:
        reward.frame_sampling = sampling
    return reward

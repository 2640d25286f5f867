"""`vlm_judge`: ask a vision-language model about each image and parse a number from its answer (the
GenRM / UnifiedReward pattern).

The judge runs locally (`backend=local`, `path`: any transformers VLM that loads with
`AutoModelForImageTextToText` + `AutoProcessor` and has a chat template: Qwen2-VL / Qwen2.5-VL, LLaVA, Idefics3,
...) or behind an OpenAI-compatible server (`backend=openai`, `url`, `model`: vLLM, SGLang, `transformers serve`;
judge_backend.py); both get the same turns and their answers are parsed the same way. One user message of
[image, question], the question being `template` with `{prompt}` replaced by the generation prompt; greedy
decoding of at most `max_new_tokens` tokens; the first match of `pattern` in the answer, its first group read as a
float.

Edit tasks (`source_key`, e.g. `image`): the turn is [source image(s), generated image, question], the source
images read from that metadata column (the row's condition images: a path or a list of paths), so the judge compares
the edit with what it edited; `template` defaults to `DEFAULT_EDIT_TEMPLATE` then.

Video (the VideoScore / VideoAlign pattern, judged from frames): given (B, T, 3, H, W), the judge sees
`video_frames` evenly spaced frames of each clip, round(linspace(0, T-1, N)) (every frame when T <= N), as N images
of one turn [*sources, frame_1 .. frame_N, question] (`DEFAULT_VIDEO_TEMPLATE` by default), and answers once per clip.
The key is `video_frames`, not `frames`: `frames` is the frame sampling `call_reward` applies to image scorers, and
this reward reads video itself.

Groupwise mode (`mode: groupwise`; a group reward, rewards/base.py): the judge sees a prompt's whole group in one
turn [image_1 .. image_n, question] (`DEFAULT_GROUP_TEMPLATE`, with `{prompt}` and `{n}`) and answers a ranking,
best first: "Ranking: 3, 1, 2". The answer's integers after the last "ranking" (any case; the whole answer when the
word is absent) must be a permutation of 1..n (`parse_ranking`); image k at rank r (0 = best) scores
1 − r / (n − 1) (`rank_scores`; docs/rewards.md "vlm_judge groupwise"), a group of one scores 0.5. An answer that
is no permutation follows `on_unparseable` for the whole group. Images only (video: use the pointwise mode).

Default pattern: `score` (any case), optional `:` or `=`, then a number, e.g. "Score: 7", "score = 3.5".
With `score_range: [lo, hi]` a value outside it counts as unparseable and the score is (v - lo) / (hi - lo).
An unparseable answer is never a 0: `on_unparseable=error` (default) stops with the answer's text;
`exclude` gives the sample a NaN score and 1.0 in the extra `vlm_judge/unparseable` — useful as an optional
component of `reward=mix`, which then excludes it (alone, the trainer refuses non-finite scores).
"""

from __future__ import annotations

import math
import re

import numpy as np
import torch

from ..models.base import prompt_text
from .base import (
    RewardOutput,
    check_batch,
    checked_group_ids,
    frame_indices,
    group_members,
    image_batch_as_uint8,
    media_kind,
    register_reward,
)
from .judge_backend import BACKENDS, LocalVLM, build_backend, judge_pictures  # noqa: F401  (LocalVLM: re-exported)

DEFAULT_TEMPLATE = ('Look at the image. How well does it show "{prompt}"? Rate it from 0 to 10 and answer in '
                    'the form "Score: N".')
DEFAULT_EDIT_TEMPLATE = ('The first image is the original, the last is the result of the edit instruction "{prompt}". '
                         'How well does the result carry out the instruction while keeping everything else of the '
                         'original? Rate it from 0 to 10 and answer in the form "Score: N".')
DEFAULT_VIDEO_TEMPLATE = ('These images are frames of one video, in order. How well does the video show "{prompt}", '
                          'including its motion? Rate it from 0 to 10 and answer in the form "Score: N".')
DEFAULT_GROUP_TEMPLATE = ('These {n} images were generated for "{prompt}", numbered 1 to {n} in order. Rank them '
                          'from best to worst and answer in the form "Ranking: i, j, ...", listing every number once.')
MODES = ("pointwise", "groupwise")
DEFAULT_PATTERN = r"(?i)score\s*[:=]?\s*(-?\d+(?:\.\d+)?)"
UNPARSEABLE = ("error", "exclude")


def parse_score(answer: str, pattern: str | re.Pattern, score_range=None) -> float | None:
    """The number of the first `pattern` match (group 1), mapped by `score_range`; None when there is none
    or it lies outside the range."""
    m = re.search(pattern, answer)
    if m is None:
        return None
    try:
        value = float(m.group(1))
    except (IndexError, ValueError):
        return None
    if not math.isfinite(value):
        return None
    if score_range is not None:
        lo, hi = score_range
        if not lo <= value <= hi:
            return None
        value = (value - lo) / (hi - lo)
    return value


def parse_ranking(answer: str, n: int) -> list[int] | None:
    """The ranking (0-based image indices, best first) in a groupwise answer: the integers after the last
    "ranking" (any case), else all integers of the answer; None unless they are a permutation of 1..n."""
    at = answer.lower().rfind("ranking")
    numbers = [int(x) for x in re.findall(r"\d+", answer[at:] if at >= 0 else answer)]
    if sorted(numbers) != list(range(1, n + 1)):
        return None
    return [k - 1 for k in numbers]


def rank_scores(ranking: list[int]) -> list[float]:
    """Per image (in image order) 1 − r / (n − 1), r its 0-based rank in `ranking` (best first); 0.5 when n = 1
    (docs/rewards.md, "vlm_judge groupwise")."""
    n = len(ranking)
    scores = [0.5] * n
    if n > 1:
        for r, k in enumerate(ranking):
            scores[k] = 1.0 - r / (n - 1)
    return scores


@register_reward("vlm_judge")
class VLMJudge:
    """Score = the number the VLM answers to `template` (module docstring); video judged from `video_frames`
    frames."""

    media = ("images", "video")

    def __init__(self, path: str | None = None, template: str | None = None, pattern: str = DEFAULT_PATTERN,
                 score_range: list | None = None, on_unparseable: str = "error", max_new_tokens: int = 32,
                 device: str = "auto", dtype: str = "float32", source_key: str | None = None,
                 video_frames: int = 8, video_template: str | None = None, mode: str = "pointwise",
                 group_template: str | None = None, backend: str = "local", trust_remote_code: bool = False,
                 url: str | None = None, model: str | None = None, api_key_env: str | None = "POLYRL_JUDGE_API_KEY",
                 max_concurrency: int = 8, timeout: float = 120.0, connect_timeout: float = 10.0,
                 max_retries: int = 5, retry_budget: int = 64, backoff: float = 1.0, max_backoff: float = 30.0,
                 image_format: str = "png", jpeg_quality: int = 95, request_options: dict | None = None):
        if mode not in MODES:
            raise ValueError(f"vlm_judge: mode={mode!r} is not valid; allowed: {', '.join(MODES)}")
        self.mode, self.groupwise = mode, mode == "groupwise"
        self.group_template = group_template or DEFAULT_GROUP_TEMPLATE
        if "{prompt}" not in self.group_template:
            raise ValueError("vlm_judge: group_template must contain {prompt}")
        if self.groupwise and source_key is not None:
            raise ValueError("vlm_judge: mode=groupwise does not take source_key (edit judging is pointwise)")
        if isinstance(video_frames, bool) or not isinstance(video_frames, int) or video_frames < 1:
            raise ValueError(f"vlm_judge: video_frames={video_frames!r} must be an integer >= 1")
        self.video_frames = video_frames
        self.video_template = template if video_template is None and template is not None else (
            video_template or DEFAULT_VIDEO_TEMPLATE)
        if "{prompt}" not in self.video_template:
            raise ValueError("vlm_judge: video_template must contain {prompt}")
        if on_unparseable not in UNPARSEABLE:
            raise ValueError(f"vlm_judge: on_unparseable={on_unparseable!r}; allowed: {', '.join(UNPARSEABLE)}")
        if template is None:
            template = DEFAULT_TEMPLATE if source_key is None else DEFAULT_EDIT_TEMPLATE
        if "{prompt}" not in template:
            raise ValueError("vlm_judge: template must contain {prompt}")
        self.pattern = re.compile(pattern)
        if self.pattern.groups < 1:
            raise ValueError(f"vlm_judge: pattern {pattern!r} needs a capture group around the number")
        if score_range is not None:
            score_range = tuple(float(x) for x in score_range)
            if len(score_range) != 2 or not score_range[0] < score_range[1]:
                raise ValueError(f"vlm_judge: score_range={list(score_range)} must be [lo, hi] with lo < hi")
        self.template, self.score_range, self.source_key = template, score_range, source_key
        self.on_unparseable, self.max_new_tokens = on_unparseable, int(max_new_tokens)
        remote = dict(url=url, model=model, api_key_env=api_key_env, max_concurrency=max_concurrency, timeout=timeout,
                      connect_timeout=connect_timeout, max_retries=max_retries, retry_budget=retry_budget,
                      backoff=backoff, max_backoff=max_backoff, image_format=image_format, jpeg_quality=jpeg_quality,
                      request_options=request_options)
        self.backend = backend
        self.vlm = build_backend("vlm_judge", backend, path, device, dtype, trust_remote_code, remote)
        self.last_answers: list[str] = []

    def preflight(self) -> None:
        """backend=openai: the server answers (and names its model when reward.model is unset)."""
        if hasattr(self.vlm, "preflight"):
            self.vlm.preflight()

    def begin_step(self, train: bool = True) -> None:
        """backend=openai: a new step's (or evaluation's) retry budget."""
        if hasattr(self.vlm, "begin_step"):
            self.vlm.begin_step()

    def close(self) -> None:
        if hasattr(self.vlm, "close"):
            self.vlm.close()

    def source_images(self, metadata: list[dict]) -> list[list] | None:
        """Each sample's source images (RGB uint8 arrays) from metadata `source_key`; None without a source_key."""
        if self.source_key is None:
            return None
        from PIL import Image

        out = []
        for i, meta in enumerate(metadata):
            value = meta.get(self.source_key)
            paths = [value] if isinstance(value, str) else value
            if not isinstance(paths, list | tuple) or not paths or not all(isinstance(p, str) for p in paths):
                raise ValueError(f"vlm_judge: sample {i} has no source image path in metadata {self.source_key!r} "
                                 f"(got {value!r})")
            images = []
            for p in paths:
                try:
                    with Image.open(p) as image:
                        images.append(np.asarray(image.convert("RGB")))
                except OSError as e:
                    raise ValueError(f"vlm_judge: source image {p}: {e}") from None
            out.append(images)
        return out

    def sample_frames(self, video: torch.Tensor) -> torch.Tensor:
        """(B, N, 3, H, W): the `video_frames` evenly spaced frames of each (B, T, 3, H, W) clip."""
        return video[:, frame_indices(video.shape[1], min(self.video_frames, int(video.shape[1])), "vlm_judge")]

    def answers(self, images: torch.Tensor, prompts: list, sources: list[list] | None = None) -> list[str]:
        """The judge's answer per sample: [*sources, image (or the frames)] with the question of its prompt."""
        template = self.video_template if images.ndim == 5 else self.template
        questions = [template.replace("{prompt}", prompt_text(p)) for p in prompts]
        return self.vlm.generate(judge_pictures(images, sources), questions, self.max_new_tokens)

    def group_answers(self, images: torch.Tensor, prompts: list, groups: list[list[int]]) -> list[str]:
        """One answer per group: its members' images in one turn with the group question."""
        pictures = image_batch_as_uint8(images)
        questions = [self.group_template.replace("{prompt}", prompt_text(prompts[m[0]])).replace("{n}", str(len(m)))
                     for m in groups]
        return self.vlm.generate([[pictures[i] for i in m] for m in groups], questions, self.max_new_tokens)

    def score_groups(self, images, prompts, metadata, group_ids) -> RewardOutput:
        """Groupwise mode: rank each group, scores from the ranks (module docstring)."""
        n = int(images.shape[0])
        check_batch("vlm_judge", n, prompts, metadata)
        if media_kind(images) != "images":
            raise ValueError("vlm_judge: mode=groupwise judges images; score video with the pointwise mode")
        groups = group_members(checked_group_ids(self, group_ids, n))
        self.last_answers = self.group_answers(images, prompts, groups)
        scores, unparseable = torch.full((n,), math.nan), [0.0] * n
        for members, answer in zip(groups, self.last_answers, strict=True):
            ranking = parse_ranking(answer, len(members))
            if ranking is None:
                if self.on_unparseable == "error":
                    raise ValueError(f"vlm_judge: the groupwise answer for a group of {len(members)} is not a "
                                     f"ranking of 1..{len(members)}: {answer!r}")
                for i in members:
                    unparseable[i] = 1.0
                continue
            scores[members] = torch.tensor(rank_scores(ranking))
        return RewardOutput(scores.float(), {"vlm_judge/unparseable": unparseable})

    def __call__(self, images, prompts, metadata=None, group_ids=None) -> RewardOutput:
        if self.groupwise:
            return self.score_groups(images, prompts, metadata, group_ids)
        metadata = check_batch("vlm_judge", images.shape[0], prompts, metadata)
        if media_kind(images) == "video":
            images = self.sample_frames(images)
        self.last_answers = self.answers(images, prompts, self.source_images(metadata))
        values = [parse_score(a, self.pattern, self.score_range) for a in self.last_answers]
        bad = [i for i, v in enumerate(values) if v is None]
        if bad and self.on_unparseable == "error":
            i = bad[0]
            raise ValueError(f"vlm_judge: {len(bad)} of {len(values)} answers have no score matching "
                             f"{self.pattern.pattern!r} (first, sample {i}: {self.last_answers[i]!r})")
        scores = torch.tensor([math.nan if v is None else v for v in values], dtype=torch.float32)
        return RewardOutput(scores, {"vlm_judge/unparseable": [float(v is None) for v in values]})

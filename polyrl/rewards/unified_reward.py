"""`unified_reward`: the UnifiedReward judges (CodeGoat24/UnifiedReward, Qwen2.5-VL and LLaVA based) asked the way the
code that trains with them asks, local or behind an OpenAI-compatible server (`vlm_judge`'s backends; judge_backend.py).

`variant=score` (pointwise; flow_grpo's `unifiedreward_score_sglang`, which serves UnifiedReward-7b-v1.5 with SGLang):
one turn [image, `SCORE_TEMPLATE` with the prompt], the first match of `SCORE_PATTERN` ("Final Score:" then 1–5) read
as v, the score v / 5. flow_grpo resizes each image to 512 × 512 first (`image_size: 512`, PIL bicubic); it scores an
answer without a match 0.0, we follow `on_unparseable` (error, or exclude: NaN, counted).

`variant=think_pair` (pairwise preference of UnifiedReward-Think; Pref-GRPO's reward, CodeGoat24/Pref-GRPO
`fastvideo/rewards/unifiedreward_think.py` with the template of `templates.py`): a group reward. Every unordered pair
(i, j), i < j, of a prompt group is one turn [image_i, image_j, `THINK_PAIR_TEMPLATE` with the prompt]; the verdict is
read from the answer's first `<answer>…</answer>` block: "Image 1 is better" (first image wins) or "Image 2 is
better"; any other block, or none, is a tie (`on_unparseable=tie`, upstream's rule; `exclude` drops the pair from
both members' counts; `error` stops). A sample's score is its wins over its comparisons (a tie is half a win for each),
rounded to 3 decimals as upstream; a group of one scores 0.5. `unified_reward/unparseable` is the fraction of a
sample's comparisons without a verdict. A group of n costs n(n − 1)/2 requests.
"""

from __future__ import annotations

import itertools
import math
import re

import numpy as np
import torch

from ..models.base import prompt_text
from .base import RewardOutput, check_batch, checked_group_ids, group_members, image_batch_as_uint8, register_reward
from .vlm_judge import VLMJudge

VARIANTS = ("score", "think_pair")
# flow_grpo rewards.py unifiedreward_score_sglang: the question (with LLaVA's "<image>" placeholder line) and its parse
SCORE_TEMPLATE = (
    "<image>\nYou are given a text caption and a generated image based on that caption. Your task is to evaluate this "
    "image based on two key criteria:\n1. Alignment with the Caption: Assess how well this image aligns with the "
    "provided caption. Consider the accuracy of depicted objects, their relationships, and attributes as described in "
    "the caption.\n2. Overall Image Quality: Examine the visual quality of this image, including clarity, detail "
    "preservation, color accuracy, and overall aesthetic appeal.\nBased on the above criteria, assign a score from 1 to "
    "5 after 'Final Score:'.\nYour task is provided as follows:\nText Caption: [{prompt}]"
)
SCORE_PATTERN = r"Final Score:\s*([1-5](?:\.\d+)?)"
# Pref-GRPO fastvideo/rewards/templates.py get_unifiedreward_think_image_template (its indentation is part of it)
THINK_PAIR_TEMPLATE = """You are an objective and precise evaluator for image quality comparison. I will provide you with a text caption and two images generated based on this caption. You must analyze the two images carefully and determine which image is better.

        Evaluation procedure:

        1. The caption for the generated images is: 「{prompt}」. You must evaluate the two images across these core dimensions:
        - Semantic consistency (how closely the image content aligns with the caption)
        - Aesthetics (composition, color usage, artistic expression)
        - Authenticity (realism and attention to detail)

        2. You are also encouraged to add up to two additional evaluation dimensions if they are relevant to the specific caption or images (e.g., creativity, spatial layout, fine-grained detail). If no extra dimensions are relevant, just keep the three core dimensions.

        3. For each evaluation dimension:
        - Provide a score between 1–10 for both Image 1 and Image 2
        - Provide a short rationale for each score (2–5 short sentences)
        - The evaluation must follow exactly this format with line breaks and indentation:
            Dimension name: 
                Image 1 (x/10) - rationale; 
                Image 2 (y/10) - rationale

        4. After evaluating all dimensions, calculate the total score for each image and show the calculation explicitly, following this exact format:
            Total score:
            Image 1: x+x+x=total
            Image 2: y+y+y=total

        5. Wrap all reasoning and scoring strictly within <think> and </think> tags.

        6. After </think>, output the final judgment strictly inside <answer> and </answer> tags, containing only one of:
        - Image 1 is better
        - Image 2 is better

        Constraints:
        - You must strictly follow the line breaks, indentation, and formatting shown in the example below.
        - Do not merge multiple dimensions into one line. Each dimension must follow the 3-line block format shown below.
        - Do not use Markdown formatting, bullet points, bold text, or headings.
        - Do not output explanations outside <think> and <answer>.
        - The <answer> tag must contain only the final string with no extra words.

        Required output format:

        <think>
        1. Semantic consistency: 
            Image 1 (9/10) - ...; 
            Image 2 (7/10) - ...
        2. Aesthetics: 
            Image 1 (8/10) - ...; 
            Image 2 (8/10) - ...
        3. Authenticity: 
            Image 1 (8/10) - ...; 
            Image 2 (5/10) - ...
        [Additional dimension if any]: 
            Image 1 (7/10) - ...; 
            Image 2 (8/10) - ...
        [Additional dimension if any]: 
            Image 1 (6/10) - ...; 
            Image 2 (7/10) - ...
        Total score:
        Image 1: 9+8+8+7+6=38
        Image 2: 7+8+5+8+7=35
        </think>
        <answer>Image 1 is better</answer>

        Note: The example above is only to illustrate the exact format (line breaks, indentation, symbols, and style). Your actual evaluation must follow this format exactly, but be based on the given caption and images.
        """  # noqa: W291  (trailing spaces are the template's)
PAIR_UNPARSEABLE = ("tie", "exclude", "error")


def pair_verdict(answer: str) -> int | None:
    """1 or 2, the image the answer prefers, or None (a tie): from its first `<answer>…</answer>` block, "Image 1 is
    better" before "Image 2 is better" (upstream tests them in that order, by containment)."""
    m = re.search(r"<answer>(.*?)</answer>", answer, re.DOTALL)
    if m is None:
        return None
    verdict = m.group(1).strip()
    if "Image 1 is better" in verdict:
        return 1
    if "Image 2 is better" in verdict:
        return 2
    return None


def win_rates(n: int, pairs: list[tuple[int, int]], verdicts: list[int | None], drop: list[bool]) -> list[float]:
    """Per member: (wins + ties / 2) / comparisons over the pairs not dropped, rounded to 3 decimals; 0.5 with none
    (Pref-GRPO's score map; a group of one has no comparison)."""
    wins, seen = [0.0] * n, [0] * n
    for (i, j), v, d in zip(pairs, verdicts, drop, strict=True):
        if d:
            continue
        seen[i] += 1
        seen[j] += 1
        if v == 1:
            wins[i] += 1
        elif v == 2:
            wins[j] += 1
        else:
            wins[i] += 0.5
            wins[j] += 0.5
    return [round(w / s, 3) if s else 0.5 for w, s in zip(wins, seen, strict=True)]


@register_reward("unified_reward")
class UnifiedReward(VLMJudge):
    """UnifiedReward asked with its published prompts (module docstring); a `vlm_judge` otherwise (same backends,
    keys and transport)."""

    media = ("images",)

    def __init__(self, variant: str = "score", path: str | None = None, backend: str = "local",
                 on_unparseable: str | None = None, max_new_tokens: int | None = None, image_size: int | None = None,
                 device: str = "auto", dtype: str = "bfloat16", trust_remote_code: bool = False,
                 url: str | None = None, model: str | None = None, api_key_env: str | None = "POLYRL_JUDGE_API_KEY",
                 max_concurrency: int = 8, timeout: float = 300.0, connect_timeout: float = 10.0,
                 max_retries: int = 5, retry_budget: int = 64, backoff: float = 1.0, max_backoff: float = 30.0,
                 image_format: str = "png", jpeg_quality: int = 95, request_options: dict | None = None):
        if variant not in VARIANTS:
            raise ValueError(f"unified_reward: variant={variant!r} is not valid; allowed: {', '.join(VARIANTS)}")
        if image_size is not None and (isinstance(image_size, bool) or not isinstance(image_size, int)
                                       or image_size < 1):
            raise ValueError(f"unified_reward: image_size={image_size!r} must be null or an integer >= 1")
        self.variant, self.image_size = variant, image_size
        pair = variant == "think_pair"
        if on_unparseable is None:
            on_unparseable = "tie" if pair else "error"
        allowed = PAIR_UNPARSEABLE if pair else ("error", "exclude")
        if on_unparseable not in allowed:
            raise ValueError(f"unified_reward: on_unparseable={on_unparseable!r} for variant={variant}; allowed: "
                             f"{', '.join(allowed)}")
        transport = dict(backend=backend, path=path, device=device, dtype=dtype, trust_remote_code=trust_remote_code,
                         url=url, model=model, api_key_env=api_key_env, max_concurrency=max_concurrency,
                         timeout=timeout, connect_timeout=connect_timeout, max_retries=max_retries,
                         retry_budget=retry_budget, backoff=backoff, max_backoff=max_backoff, image_format=image_format,
                         jpeg_quality=jpeg_quality, request_options=request_options)
        super().__init__(template=SCORE_TEMPLATE, pattern=SCORE_PATTERN, score_range=[0, 5],
                         on_unparseable="error" if pair else on_unparseable,
                         max_new_tokens=max_new_tokens or (1024 if pair else 256), **transport)
        self.pair_unparseable = on_unparseable if pair else None
        self.groupwise = pair

    def pictures(self, images: torch.Tensor) -> list:
        """The images as the judge sees them: uint8 (H, W, 3), resized to `image_size`² when it is set."""
        arrays = image_batch_as_uint8(images)
        if self.image_size is None:
            return arrays
        from PIL import Image

        size = (self.image_size, self.image_size)
        return [np.asarray(Image.fromarray(a).resize(size, Image.Resampling.BICUBIC)) for a in arrays]

    def answers(self, images: torch.Tensor, prompts: list, sources: list[list] | None = None) -> list[str]:
        questions = [self.template.replace("{prompt}", prompt_text(p)) for p in prompts]
        return self.vlm.generate([[p] for p in self.pictures(images)], questions, self.max_new_tokens)

    def score_groups(self, images, prompts, metadata, group_ids) -> RewardOutput:
        """think_pair: every pair of each group judged, scores = win rates (module docstring)."""
        n = int(images.shape[0])
        check_batch("unified_reward", n, prompts, metadata)
        pictures = self.pictures(images)
        groups = group_members(checked_group_ids(self, group_ids, n))
        pairs = [(i, j) for members in groups for i, j in itertools.combinations(members, 2)]
        questions = [THINK_PAIR_TEMPLATE.replace("{prompt}", prompt_text(prompts[i])) for i, _ in pairs]
        self.last_answers = self.vlm.generate([[pictures[i], pictures[j]] for i, j in pairs], questions,
                                              self.max_new_tokens) if pairs else []
        verdicts = [pair_verdict(a) for a in self.last_answers]
        missing = [v is None for v in verdicts]
        if any(missing) and self.pair_unparseable == "error":
            k = missing.index(True)
            raise ValueError(f"unified_reward: {sum(missing)} of {len(pairs)} pairwise answers have no verdict in "
                             f"<answer>...</answer> (first, samples {pairs[k]}: {self.last_answers[k]!r})")
        drop = missing if self.pair_unparseable == "exclude" else [False] * len(pairs)
        scores = torch.full((n,), math.nan)
        unparseable, compared = [0.0] * n, [0] * n
        for members in groups:
            index = {s: k for k, s in enumerate(members)}
            mine = [(k, (index[i], index[j])) for k, (i, j) in enumerate(pairs) if i in index]
            rates = win_rates(len(members), [p for _, p in mine], [verdicts[k] for k, _ in mine],
                              [drop[k] for k, _ in mine])
            scores[members] = torch.tensor(rates)
            for k, (a, b) in mine:
                for s in (members[a], members[b]):
                    compared[s] += 1
                    unparseable[s] += float(missing[k])
        frac = [u / c if c else 0.0 for u, c in zip(unparseable, compared, strict=True)]
        return RewardOutput(scores.float(), {"unified_reward/unparseable": frac})

    def __call__(self, images, prompts, metadata=None, group_ids=None) -> RewardOutput:
        if self.groupwise:
            return self.score_groups(images, prompts, metadata, group_ids)
        out = super().__call__(images, prompts, metadata)
        return RewardOutput(out.scores, {"unified_reward/unparseable": out.extras["vlm_judge/unparseable"]})

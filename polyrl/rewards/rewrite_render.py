"""`rewrite_render`: the reward of a prompt rewriter (`recipe=prompt_rewriter`, docs/tokens.md "Prompt rewriter").

The trained policy is a token model that rewrites a user's request; this reward owns a **frozen** polyrl diffusion
model (`generator`: its `model` config keys, e.g. `{name: sd3, path: DIR}`), renders each rewrite with it and scores
the media with an image / video / audio reward (`scorer`: a reward config) against the **original request**: the
scorer gets the row's prompt and metadata as they are, plus the rewrite as `metadata["rewrite"]`.

Rendering is deterministic: the generator's ODE (every step at noise level 0, the sampler of held-out evaluation)
from initial noise fixed per request, drawn from `seed` and a CRC-32 of the request's text. So the members of a
prompt group (one request, n rewrites) start from the same noise and differ only through their rewrites, and a
rewrite always renders to the same media. The generator is never trained: its weights are frozen
(`requires_grad=False`, eval mode), hold no optimizer state, and it runs under `torch.no_grad`.

Extras: the scorer's own, `rewrite/words` (the rewrite's length in words) and the caption `rewrite/caption`
("-> <rewrite>", under the request in the sample grids). The renders come back as the output's `media`, so the
held-out sample grid shows request, rewrite and image; `last_media` / `last_rewrites` keep the last call's media and
rewrites.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from types import SimpleNamespace

import torch

from ..latents import MediaShape, cat_latents
from ..media import cat_media, cpu_media, primary
from ..models.base import Guidance, build_model
from ..sampling.diffusion import RolloutNoise, SamplingPlan, sample_latents
from .base import RewardOutput, build_reward, call_reward, check_batch, register_reward, resolve_device

MODEL_DEFAULTS = Path(__file__).resolve().parent.parent / "config" / "model"  # the model group's YAML defaults
ROLLOUT_KEYS = {"height": 64, "width": 64, "num_frames": 0, "fps": 16.0, "seconds": 0.0, "num_steps": 10,
                "guidance_scale": 1.0, "negative_prompt": "", "batch_size": 16}


def generator_config(generator: dict) -> SimpleNamespace:
    """The frozen generator's model config: `config/model/<name>.yaml`'s defaults overridden by `generator`
    (compile none, fp8 off unless set)."""
    from omegaconf import OmegaConf

    if not isinstance(generator, dict) or "name" not in generator or "path" not in generator:
        raise ValueError("reward.generator must be a mapping with at least name and path, e.g. "
                         "{name: sd3, path: /ckpt/sd3}")
    defaults = MODEL_DEFAULTS / f"{generator['name']}.yaml"
    base = OmegaConf.to_container(OmegaConf.load(defaults)) if defaults.is_file() else {}
    cfg = {**base, "compile": "none", "compile_cache": None, "fp8": False, "options": {}, **generator}
    # interpolations the config layer left in a reward's keys (e.g. the recipe's ${polyrl_asset:toy_shapes})
    cfg = OmegaConf.to_container(OmegaConf.create(cfg), resolve=True)
    cfg["options"] = dict(cfg.get("options") or {})
    return SimpleNamespace(**cfg)


def request_noise(shapes: dict[str, tuple[int, ...]], prompts: list[str], seed: int, num_steps: int) -> RolloutNoise:
    """Initial noise fixed per request: each prompt's from a generator seeded with (seed, CRC-32 of its text); no step
    noise (the ODE uses none)."""
    initial = []
    for p in prompts:
        g = torch.Generator().manual_seed(int(seed) * 2**32 + zlib.crc32(p.encode("utf-8")))
        initial.append({k: torch.randn((1, *s), generator=g, dtype=torch.float32) for k, s in shapes.items()})
    b = len(prompts)
    return RolloutNoise(cat_latents(initial), torch.zeros(b, dtype=torch.long),
                        {k: torch.zeros((num_steps, b, *s)) for k, s in shapes.items()})


@register_reward("rewrite_render")
class RewriteRender:
    """Render the rewrite with a frozen generator, score the media against the original request (module docstring)."""

    media = ("text",)  # it reads the token policy's responses: the rewrites

    def __init__(self, generator: dict, scorer: dict, rollout: dict | None = None, seed: int = 0,
                 device: str = "auto"):
        unknown = sorted(set(rollout or {}) - set(ROLLOUT_KEYS))
        if unknown:
            raise ValueError(f"reward.rollout: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(ROLLOUT_KEYS)}")
        r = {**ROLLOUT_KEYS, **(rollout or {})}
        self.seed = int(seed)
        self.generator = build_model(generator_config(generator), resolve_device(device))
        for module in self.generator.modules().values():  # frozen: never trained, no optimizer state
            module.requires_grad_(False)
            module.eval()
        self.plan = SamplingPlan(num_steps=int(r["num_steps"]),
                                 shape=MediaShape(height=r["height"], width=r["width"], frames=r["num_frames"],
                                                  fps=r["fps"], seconds=r["seconds"]),
                                 guidance=Guidance(float(r["guidance_scale"]), r["negative_prompt"]),
                                 noise_level=0.0, window_size=0, batch_size=int(r["batch_size"]))
        self.scorer = build_reward(dict(scorer), "reward.scorer")
        self.last_media, self.last_rewrites = None, []

    def check_prompt(self, prompt: str, metadata: dict) -> None:
        check = getattr(self.scorer, "check_prompt", None)
        if check is not None:
            check(prompt, metadata)

    @torch.no_grad()
    def render(self, rewrites: list[str], requests: list[str]):
        """Media of each rewrite, from its request's fixed noise, by the generator's ODE."""
        g, plan = self.generator, self.plan
        shapes = g.latent_shapes(plan.shape)
        noise = request_noise(shapes, requests, self.seed, plan.num_steps)
        shared = g.encode_guidance(plan.guidance)
        parts = []
        for i in range(0, len(rewrites), plan.batch_size):
            sl = slice(i, min(len(rewrites), i + plan.batch_size))
            cond = g.encode_prompts(rewrites[sl])
            final = sample_latents(g, cond, shared, noise.select(sl), plan).final
            hook = getattr(g, "complete_latents", None)
            parts.append(cpu_media(g.decode(final if hook is None else hook(final, cond))))
        return cat_media(parts) if len(parts) > 1 else parts[0]

    def __call__(self, texts, prompts, metadata=None) -> RewardOutput:
        metadata = check_batch("rewrite_render", len(texts), prompts, metadata)
        self.last_rewrites = [t.strip() for t in texts]
        media = self.render(self.last_rewrites, list(prompts))
        self.last_media = media
        meta = [{**m, "rewrite": r} for m, r in zip(metadata, self.last_rewrites, strict=True)]
        out = call_reward(self.scorer, primary(media), list(prompts), meta)
        extras = {**out.extras, "rewrite/words": [float(len(r.split())) for r in self.last_rewrites],
                  "rewrite/caption": [f"-> {r}" for r in self.last_rewrites]}
        return RewardOutput(torch.as_tensor(out.scores, dtype=torch.float32), extras, media=dict(media))

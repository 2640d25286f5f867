"""Model interface: everything model-specific the sampler and the actor need, and nothing else.

A `DiffusionPolicy` owns the pipeline components of one model family: its trainable networks (`modules()`), its
text/condition encoders, its latent layout for a `MediaShape`, its sigma grid, its guidance and its decoder.
The rollout and the actor only call these methods, so a new family is a new file plus a registry entry.

Guidance belongs to the model: `encode_guidance` returns the conditioning its guidance form needs and that every
sample shares (the negative prompt's embeddings for CFG and true CFG; nothing for guidance-embedding models), and
`velocity` applies the form (CFG, true CFG with norm rescale, ...). The rollout only carries a scale.

A `TokenPolicy` (causal LMs, the thinker of an omni model, AR image-token models) outputs tokens: it turns prompts
into token ids (chat template and any condition inputs are its business), runs its network on ids with a KV cache,
and decodes ids back to text. Which kind a registered model is (`policy_kind`: "diffusion" | "tokens") decides the
sampler (`sampling/diffusion.py` | `sampling/tokens.py`) and the family of losses that can train it; config
validation refuses a pair of different kinds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..latents import Latents, MediaShape
from ..registry import Registry

# A model's prompt conditioning: named tensors with the batch dimension first (e.g. SD3: prompt_embeds, pooled).
Cond = dict[str, torch.Tensor]
# A prompt is its text, or a dict {"text": str, "images": [...], "audio": ...} for condition-media models
# (image-to-video, edit); a model without condition inputs refuses a prompt that carries media.
Prompt = str | dict
# Decoded media by kind: {"images": (B, 3, H, W)} or {"video": (B, T, 3, H, W)} in [0, 1], {"audio": Audio}.
Media = dict[str, Any]


def prompt_text(prompt: Prompt) -> str:
    return prompt if isinstance(prompt, str) else prompt["text"]


def image_latent_grid(family: str, shape: MediaShape, downsample: int, multiple: int) -> tuple[int, int]:
    """(h, w) of an image model's latents: the pixel sizes over the VAE's `downsample`, which must be multiples of
    `multiple` (the VAE's factor × the transformer's patch or packing)."""
    if shape.is_video:
        raise ValueError(f"{family} generates images; rollout.num_frames={shape.frames} must be 0")
    if shape.height % multiple or shape.width % multiple:
        raise ValueError(f"rollout.height/width must be multiples of {multiple} for {family}, got "
                         f"{shape.height}x{shape.width}")
    return shape.height // downsample, shape.width // downsample


def video_latent_grid(family: str, shape: MediaShape, temporal: int, spatial: int,
                      patch: tuple[int, int] = (1, 1)) -> tuple[int, int, int]:
    """(frames, h, w) of a causal video VAE's latents: `temporal`·k + 1 frames make k + 1 latent frames (the first
    frame alone, then `temporal` per latent frame); the pixel sizes over `spatial`, which must be multiples of
    `spatial` × the transformer's (height, width) patch."""
    t, s = temporal, spatial
    if not shape.is_video:
        raise ValueError(f"{family} generates video: rollout.num_frames must be a positive {t}k+1 (1, {t + 1}, "
                         f"{2 * t + 1}, ...), got {shape.frames}")
    if (shape.frames - 1) % t:
        below = (shape.frames - 1) // t * t + 1
        raise ValueError(f"rollout.num_frames={shape.frames} must be {t}k+1 for the {family} VAE's {t}x temporal "
                         f"compression (e.g. {below} or {below + t})")
    for name, size, p in (("height", shape.height, patch[0]), ("width", shape.width, patch[1])):
        if size % (s * p):
            raise ValueError(f"rollout.{name}={size} must be a multiple of {s * p} (VAE {s}x, patch {p})")
    return (shape.frames - 1) // t + 1, shape.height // s, shape.width // s


def text_only(prompts: list[Prompt], family: str) -> list[str]:
    """The prompts' texts; a prompt with condition media is an error for a text-only model."""
    for p in prompts:
        if isinstance(p, dict) and set(p) - {"text"}:
            raise ValueError(f"{family} generates from text only, but a prompt carries {sorted(set(p) - {'text'})}")
    return [prompt_text(p) for p in prompts]


@dataclass(frozen=True)
class Guidance:
    """A rollout's guidance request; the model decides what it means (CFG, true CFG, embedded guidance)."""

    scale: float = 1.0
    negative_prompt: str = ""


class DiffusionPolicy(Protocol):
    device: torch.device
    default_lora_targets: list[str]
    flops: float  # model FLOPs executed so far (docs/algorithms.md §6); the trainer reads the difference per step

    def modules(self) -> dict[str, torch.nn.Module]:
        """The trainable networks by name (the live mapping: the actor may swap an entry for another policy)."""
        ...

    def encode_prompts(self, prompts: list[Prompt]) -> Cond:
        """Per-sample conditioning, batch first (cached per prompt: the encoders are frozen)."""
        ...

    def encode_guidance(self, guidance: Guidance) -> Cond:
        """Conditioning every sample shares under this guidance, each tensor (1, ...); {} when none is needed."""
        ...

    def latent_shapes(self, shape: MediaShape) -> dict[str, tuple[int, ...]]:
        """Per-sample latent shape of each entry (no batch dimension); a shape the model cannot make is an error."""
        ...

    def sigmas(self, num_steps: int, shape: MediaShape) -> torch.Tensor:
        """The sampling grid σ_0 = 1 > … > σ_N = 0 (float32, length num_steps + 1) for this media shape."""
        ...

    def stream_sigmas(self, sigma: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        """σ of the stored grid (`sigmas`) -> the σ each latent entry is at: `sigma` itself when every entry runs one
        schedule, or one tensor per entry for a model whose streams run their own (MiniMax-H3's audio follows a
        shift-3 grid beside the video's shift 12). Steps, KL terms and forward-process noising use it
        (`stream_sigmas` below); optional: a policy without it runs one schedule."""
        ...

    def velocity(self, latents: Latents, sigma: torch.Tensor, cond: Cond, shared: Cond, guidance: float) -> Latents:
        """The guided velocity in float32; `sigma` is (B,) on the stored grid (the model maps it per stream itself);
        guidance 1 (or no `shared`) is the conditional one."""
        ...

    def complete_latents(self, latents: Latents, cond: Cond) -> Latents:
        """Sampled clean latents + the same samples' conditioning -> the latents `decode` takes. The identity for
        every model whose whole latent state is sampled; a model whose condition occupies part of the latent state
        (Wan2.2-TI2V's first latent frame, models/wan_i2v.py) samples only the rest and puts the condition back
        here. The rollout calls it on each chunk's final latents right before `decode`; trajectories, log-probs and
        `Rollout.final` stay in the sampled layout. Optional: a policy without it decodes the sampled latents."""
        ...

    def decode(self, latents: Latents) -> Media:
        """Clean latents (as `complete_latents` returns them) -> decoded media, float in [0, 1] (waveforms in
        [-1, 1])."""
        ...

    def encode_media(self, media: Media) -> Latents:
        """Decoded media -> clean latents (the inverse of `decode`: the posterior mean)."""
        ...


class TokenPolicy(Protocol):
    """An autoregressive policy over a token vocabulary (docs/tokens.md). π(y_t | x, y_<t) = softmax(logits / T),
    T = `rollout.temperature`: the distribution log-probs are taken from, in the rollout and in training alike
    (top-p only truncates what the sampler draws, docs/tokens.md "What the log-probs are").
    """

    policy_kind: str  # "tokens"
    device: torch.device
    default_lora_targets: list[str]
    flops: float  # model FLOPs executed so far (docs/algorithms.md §6)
    pad_token_id: int
    eos_token_ids: list[int]  # a sampled token in this list ends its response (and is trained on)

    def modules(self) -> dict[str, torch.nn.Module]:
        """The trainable networks by name (the live mapping, as for a DiffusionPolicy)."""
        ...

    def encode_prompts(self, prompts: list[Prompt]) -> tuple[list[list[int]], Cond]:
        """(prompt token ids per prompt, with the chat template applied where the model has one; per-sample model
        inputs besides the ids, batch first: {} for a text-only model, pixel values / audio features for one that
        reads condition media). A prompt the model cannot take is a ValueError naming the reason."""
        ...

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cond: Cond | None = None,
                cache: Any = None, keep: int = 0, use_cache: bool = False) -> tuple[torch.Tensor, Any]:
        """One network call: logits (B, T', V) float32 of the last `keep` positions of `input_ids` (0: all) and the
        KV cache (`use_cache`: extended with these tokens, else None). `attention_mask` (B, past + T) covers the
        cached tokens and `input_ids` (B, T); position ids follow from it (left padding). `cache` None: no past
        (prefill; teacher forcing, which keeps none); `cond` is given with the prompt's tokens (prefill, teacher
        forcing), None for decoding steps. Differentiable when grad is enabled (the learner's recompute)."""
        ...

    def encode_responses(self, texts: list[str]) -> list[list[int]]:
        """Response texts -> ids as the model would generate them, ending with EOS (offline preference pairs)."""
        ...

    def decode(self, ids: list[list[int]]) -> list[str]:
        """Token ids -> text, special tokens skipped."""
        ...

    # Optional: `decoding(batch, prompt_width, max_new_tokens)` -> an object with `prefill(prompt, mask, cond)` and
    # `step(token)`, each returning the last position's logits (B, V) float32, equal to what `forward` with its cache
    # gives (a faster decoder: model=causal_lm's static KV cache replayed as a CUDA graph), or None for this chunk.
    # Without it the rollout decodes through `forward` (sampling.tokens.CachedDecoding).


POLICY_KINDS = ("diffusion", "tokens")


def policy_kind(cls) -> str:
    """The kind of policy a registered model class is, or the kind an algorithm class trains: its `policy_kind`
    attribute, "diffusion" when absent (every model and loss written before token policies)."""
    return getattr(cls, "policy_kind", "diffusion")


def token_media(policy) -> tuple[str, ...]:
    """The media kinds a token policy's rollout carries (class or instance): its `media` attribute, ("text",) when
    absent. A kind other than "text" comes from the policy's `decode_media(tokens) -> {kind: batch}` (Janus-Pro's
    image codes -> {"images": ...}); config validation pairs the reward with these kinds."""
    return tuple(getattr(policy, "media", ("text",)))


MODELS = Registry("model")
register_model = MODELS.register


def build_model(cfg, device: torch.device) -> DiffusionPolicy | TokenPolicy:
    return MODELS.build(cfg.name, cfg, device)


def stream_sigmas(policy, sigma):
    """`policy.stream_sigmas(sigma)` where the policy has it, else `sigma` (every entry on the stored grid)."""
    hook = getattr(policy, "stream_sigmas", None)
    return sigma if hook is None else hook(sigma)


def stream_sigma_1(policy, sigmas: torch.Tensor):
    """σ_1 (the first σ of the grid below 1, which the `sde` step's std uses at σ = 1) for each stream: a float,
    or a dict of floats per entry when the streams run their own schedules."""
    s1 = stream_sigmas(policy, sigmas[1:2])
    return {k: float(v) for k, v in s1.items()} if isinstance(s1, dict) else float(s1)

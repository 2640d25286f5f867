"""BAGEL-7B-MoT text-to-image as a DiffusionPolicy, loaded from the public checkpoint directory
(ByteDance-Seed/BAGEL-7B-MoT: `llm_config.json`, `ema.safetensors`, `ae.safetensors`, the Qwen2 tokenizer files).

Facts from BAGEL's code (ByteDance-Seed/Bagel: `modeling/bagel/bagel.py`, `inferencer.py`, `inference.ipynb`), which
this adapter reproduces for text-to-image:
- Prompt: `<|im_start|>` + tokenizer.encode(text) + `<|im_end|>`, no chat template; the image block follows as
  `<|vision_start|>` latent tokens `<|vision_end|>` (modeling.py has the network).
- Latents: the FLUX.1 VAE latent (16 channels, H/8 × W/8), cut into 2×2 patches of (row, column, channel)
  features, one token per patch; a side of at most `max_latent_size` patches (64 published: 1024 px).
- Flow: x_σ = (1 − σ)·x0 + σ·ε, the network predicts v = ε − x0 (polyrl's convention, docs/algorithms.md §1);
  timesteps linspace(1, 0, N + 1) through the shift σ = s·t / (1 + (s − 1)·t), s = 3 (`bagel_sigmas`).
- Guidance (`bagel_cfg`): text CFG against an *empty* context (the text dropped entirely), image CFG against the
  context without its input images, then a renorm; only inside a σ interval (lo, hi], and only when the text scale
  is > 1. For text-to-image there are no input images, so the image-CFG branch is the conditional branch itself
  (BAGEL's `cfg_img_context` holds the same text) and costs no forward here.
- BAGEL's image editing (input images through the VAE and the ViT) and its text generation are not implemented:
  the understanding ViT (`vit_model.*`, `connector.*`, `vit_pos_embed.*`, `vit_config.json`) and the text head
  (`language_model.lm_head.*`) are skipped when loading; every other tensor of `ema.safetensors` must be there.

Guidance in polyrl: `rollout.guidance_scale` is BAGEL's `cfg_text_scale`; `model.options` holds the rest
(`cfg_img_scale`, `cfg_interval`, `cfg_renorm_type`, `cfg_renorm_min`; the published text-to-image values in
config/model/bagel.yaml). A non-empty `rollout.negative_prompt` replaces the empty text-CFG context by that text.
The guided velocity is a function of (x, σ), so rollout and training compute the same one.

Checkpoint problems are `BagelCheckpointError`s: a `UserError` (printed as one `polyrl: error:` line) and a
`ValueError`, naming the file and, where it applies, the tensors or keys.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ...errors import UserError
from ...latents import Latents, MediaShape
from ..base import Cond, Guidance, Media, Prompt, image_latent_grid, register_model, text_only
from ..diffusers_base import DTYPES, DiffusersPolicy, frozen

# verl-omni's BAGEL LoRA targets (examples/flowgrpo_trainer/bagel/run_bagel_*_lora.sh): the generation expert's
# attention projections and MLP; the understanding expert stays as published.
BAGEL_LORA_TARGETS = ["q_proj_moe_gen", "k_proj_moe_gen", "v_proj_moe_gen", "o_proj_moe_gen",
                      "mlp_moe_gen.gate_proj", "mlp_moe_gen.up_proj", "mlp_moe_gen.down_proj"]
# tensors of ema.safetensors that only image understanding and text generation use (not loaded)
UNDERSTANDING_PREFIXES = ("language_model.lm_head.", "vit_model.", "connector.", "vit_pos_embed.")
SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>")
TIMESTEP_SHIFT = 3.0  # BAGEL's inference timestep_shift (inferencer.py, inference.ipynb)
LATENT_PATCH_SIZE = 2  # BagelConfig(latent_patch_size=2) in BAGEL's app.py / notebook
RENORM_TYPES = ("global", "channel", "text_channel")
REQUIRED_FILES = ("llm_config.json", "ema.safetensors", "ae.safetensors")  # vit_config.json: understanding only


class BagelCheckpointError(UserError, ValueError):
    """A BAGEL checkpoint directory that lacks a file or holds the wrong tensors (the message names them)."""


# ----------------------------------------------------------------------------------------------- pure math
def bagel_sigmas(num_steps: int, shift: float) -> torch.Tensor:
    """σ_i = s·t_i / (1 + (s − 1)·t_i) for t = linspace(1, 0, N + 1) in float32 (BAGEL's `generate_image` with
    num_timesteps = N + 1: it takes N Euler steps x ← x − v·(σ_i − σ_{i+1}))."""
    t = torch.linspace(1, 0, num_steps + 1)
    return shift * t / (1 + (shift - 1) * t)


def patchify(x: torch.Tensor, p: int) -> torch.Tensor:
    """(B, C, H, W) latents -> (B, H/p·W/p, p·p·C) tokens, row-major over patches, features ordered (row in patch,
    column in patch, channel) (BAGEL's einsum "chpwq->hwpqc")."""
    b, c, h, w = x.shape
    return x.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1).reshape(b, (h // p) * (w // p), p * p * c)


def unpatchify(tokens: torch.Tensor, rows: int, cols: int, p: int) -> torch.Tensor:
    """The inverse of `patchify` for a grid of rows × cols patches."""
    b, _, f = tokens.shape
    c = f // (p * p)
    return tokens.reshape(b, rows, cols, p, p, c).permute(0, 5, 1, 3, 2, 4).reshape(b, c, rows * p, cols * p)


def latent_position_ids(rows: int, cols: int, max_side: int) -> torch.Tensor:
    """Index of each patch into `latent_pos_embed`: row·max_side + column (BAGEL's extrapolating layout)."""
    return (torch.arange(rows)[:, None] * max_side + torch.arange(cols)[None]).flatten()


def bagel_cfg(v_cond: torch.Tensor, v_text_uncond: torch.Tensor, v_img_uncond: torch.Tensor, text_scale: float,
              img_scale: float, renorm_type: str = "global", renorm_min: float = 0.0) -> torch.Tensor:
    """BAGEL's guidance on (B, N, D) velocity tokens (`Bagel._forward_flow`; docs/image_models.md "BAGEL"):

        v_t = v_text_uncond + s_t·(v_cond − v_text_uncond)
        global / channel:  v = v_img_uncond + s_i·(v_t − v_img_uncond)  (s_i > 1; else v = v_t)
                           v ← v · clamp(‖v_cond‖ / (‖v‖ + 1e-8), renorm_min, 1)
        text_channel:      v_t ← v_t · clamp(‖v_cond‖ / (‖v_t‖ + 1e-8), renorm_min, 1) per token, then the image step

    with the norms over each sample's tokens and channels (global; BAGEL generates one image per call, so its norm
    over the whole call is per sample) or over each token's channels (channel, text_channel).
    """
    if renorm_type not in RENORM_TYPES:
        raise ValueError(f"cfg_renorm_type={renorm_type!r}; allowed: {', '.join(RENORM_TYPES)}")

    def renorm(v: torch.Tensor, dims) -> torch.Tensor:
        ratio = torch.linalg.vector_norm(v_cond, dim=dims, keepdim=True) / (
            torch.linalg.vector_norm(v, dim=dims, keepdim=True) + 1e-8)
        return v * ratio.clamp(min=renorm_min, max=1.0)

    v_text = v_text_uncond + text_scale * (v_cond - v_text_uncond)
    if renorm_type == "text_channel":
        v_text = renorm(v_text, -1)
    v = v_img_uncond + img_scale * (v_text - v_img_uncond) if img_scale > 1.0 else v_text
    if renorm_type == "text_channel":
        return v
    return renorm(v, (1, 2) if renorm_type == "global" else -1)


def bagel_forward_flops(config, text_tokens: int, image_tokens: int) -> float:
    """One forward of the generation network on one sample (docs/algorithms.md §6: a matmul is 2·tokens·in·out,
    attention 4·S²·d over S = T + N + 2 tokens: the (padded) prompt, the patches and the two image boundary tokens).

    Every token goes through exactly one expert, and both experts have the same shapes, so the routing does not
    change the count: per layer and token q and o (d·d each), k and v (d·d_kv each, d_kv = kv_heads·head_dim) and
    the SwiGLU MLP (3·d·I). Plus vae2llm and llm2vae (p²C ↔ d) on the patch tokens and the timestep embedder
    (256 → d → d) once per sample.
    """
    c = config
    d, layers = c.hidden_size, c.num_hidden_layers
    d_kv = c.num_key_value_heads * (d // c.num_attention_heads)
    s = text_tokens + image_tokens + 2
    per_token = 2 * (2 * d * d + 2 * d * d_kv + 3 * d * c.intermediate_size)
    flops = layers * (s * per_token + 4 * s * s * d)
    flops += 2 * 2 * image_tokens * c.patch_latent_dim * d + 2 * (256 * d + d * d)
    return float(flops)


# ----------------------------------------------------------------------------------------------- loading
def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise BagelCheckpointError(f"{path} not found: model.path must be a BAGEL checkpoint directory "
                        "(llm_config.json, ema.safetensors, ae.safetensors, tokenizer files)")
    return json.loads(path.read_text())


def check_files(root: Path) -> None:
    """The files text-to-image needs are in `root` (the first missing one is named)."""
    if not root.is_dir():
        raise BagelCheckpointError(f"model.path={str(root)!r} is not a directory")
    for name in REQUIRED_FILES:
        if not (root / name).is_file():
            raise BagelCheckpointError(f"{root / name} not found: model.path must be a BAGEL checkpoint directory "
                                       f"({', '.join(REQUIRED_FILES)} and the Qwen2 tokenizer files)")


def _examples(names) -> str:
    names = sorted(names)
    return ", ".join(names[:5]) + (f", ... ({len(names)} in all)" if len(names) > 5 else "")


def check_weights(path: Path, shapes: dict[str, tuple], expected: dict[str, tuple], skipped=()) -> None:
    """Every expected tensor present with its shape, and nothing else except the `skipped` prefixes; else one
    UserError naming the file and the tensors."""
    missing = set(expected) - set(shapes)
    unknown = {k for k in set(shapes) - set(expected) if not k.startswith(tuple(skipped))}
    wrong = {k: (shapes[k], expected[k]) for k in set(expected) & set(shapes) if tuple(shapes[k]) != tuple(expected[k])}
    problems = []
    if missing:
        problems.append(f"missing {_examples(missing)}")
    if unknown:
        problems.append(f"unknown {_examples(unknown)}")
    if wrong:
        k = sorted(wrong)[0]
        problems.append(f"wrong shape for {len(wrong)} (e.g. {k}: {list(wrong[k][0])}, expected {list(wrong[k][1])})")
    if problems:
        raise BagelCheckpointError(f"{path} does not hold the BAGEL weights this model needs: {'; '.join(problems)}")


def load_generator(root: Path, dtype: torch.dtype, special_ids: dict[str, int], latent_channels: int):
    """The generation network from `llm_config.json` + `ema.safetensors`, keys by their public names."""
    from safetensors import safe_open

    from .modeling import BagelGenerator

    llm = _read_json(root / "llm_config.json")
    if llm.get("hidden_act", "silu") != "silu" or llm.get("rope_scaling"):
        raise BagelCheckpointError(f"{root / 'llm_config.json'}: hidden_act={llm.get('hidden_act')!r}, "
                        f"rope_scaling={llm.get('rope_scaling')!r}; BAGEL's Qwen2 uses silu and plain RoPE")
    root_config = json.loads((root / "config.json").read_text()) if (root / "config.json").is_file() else {}
    patch = int(root_config.get("latent_patch_size", LATENT_PATCH_SIZE))
    ema = root / "ema.safetensors"
    with safe_open(str(ema), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (safe_open has no iter)
        table = shapes.get("latent_pos_embed.pos_embed", (0,))
        side = math.isqrt(table[0])
        if side * side != table[0] or side == 0:
            raise BagelCheckpointError(f"{ema}: latent_pos_embed.pos_embed has shape {list(table)}; expected (side², hidden)")
        try:
            with torch.device("meta"):
                model = BagelGenerator(
                    vocab_size=llm["vocab_size"], hidden_size=llm["hidden_size"],
                    intermediate_size=llm["intermediate_size"], num_hidden_layers=llm["num_hidden_layers"],
                    num_attention_heads=llm["num_attention_heads"], num_key_value_heads=llm["num_key_value_heads"],
                    rms_norm_eps=llm.get("rms_norm_eps", 1e-6), rope_theta=llm.get("rope_theta", 10000.0),
                    patch_latent_dim=patch * patch * latent_channels, max_latent_size=side,
                    start_of_image_id=special_ids["<|vision_start|>"], end_of_image_id=special_ids["<|vision_end|>"])
        except KeyError as e:
            raise BagelCheckpointError(f"{root / 'llm_config.json'} has no {e.args[0]!r}") from None
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        check_weights(ema, shapes, expected, UNDERSTANDING_PREFIXES)
        state = {k: f.get_tensor(k).to(dtype) for k in expected}
    model.load_state_dict(state, assign=True, strict=True)
    return model, patch


def load_autoencoder(root: Path):
    from safetensors.torch import load_file

    from .autoencoder import AutoencoderGeometry, FluxAutoencoder

    path = root / "ae.safetensors"
    state = load_file(str(path))
    try:
        geometry = AutoencoderGeometry.from_state_dict(state)
    except KeyError as e:
        raise BagelCheckpointError(f"{path} is not a FLUX.1 autoencoder in its original layout (no {e.args[0]})") from None
    with torch.device("meta"):
        ae = FluxAutoencoder(geometry)
    check_weights(path, {k: tuple(v.shape) for k, v in state.items()},
                  {k: tuple(v.shape) for k, v in ae.state_dict().items()})
    ae.load_state_dict({k: v.float() for k, v in state.items()}, assign=True, strict=True)
    return ae


def load_tokenizer(root: Path):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(root))
    except (OSError, ValueError) as e:
        raise BagelCheckpointError(f"{root}: no tokenizer BAGEL can use ({str(e).splitlines()[0]})") from None
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    unknown = [t for t, i in ids.items() if i is None or i == tokenizer.unk_token_id]
    if unknown:
        raise BagelCheckpointError(f"{root}: the tokenizer has no {', '.join(unknown)} (BAGEL's prompt and image markers)")
    return tokenizer, ids


# ----------------------------------------------------------------------------------------------- adapter
@register_model("bagel")
class BagelPolicy(DiffusersPolicy):
    default_lora_targets = BAGEL_LORA_TARGETS
    family = "BAGEL"

    # `model.options` keys and defaults (config validation refuses others): BAGEL's text-to-image call defaults
    # (app.py / inference.ipynb: cfg_interval [0.4, 1.0], renorm "global" with min 0; no image CFG without images)
    options = {
        "cfg_img_scale": 1.0,  # image-CFG scale; for text-to-image the image-unconditional branch is the conditional
        "cfg_interval": [0.4, 1.0],  # CFG only at steps with lo < σ ≤ hi
        "cfg_renorm_type": "global",  # global | channel | text_channel (see `bagel_cfg`)
        "cfg_renorm_min": 0.0,  # lower clamp of the renorm factor (its upper clamp is 1)
    }

    def __init__(self, cfg, device: torch.device):
        # not a diffusers directory: the base's component loading is skipped; its prompt cache and forward are used
        self.root, self.device, self.dtype = Path(cfg.path), device, DTYPES[cfg.dtype]
        check_files(self.root)
        opts = {**self.options, **dict(cfg.get("options") or {})}
        self.networks: dict[str, torch.nn.Module] = {}
        self._cache: dict[str, Cond] = {}
        self.flops = 0.0
        self.max_sequence_length = int(cfg.max_sequence_length)
        if self.max_sequence_length < 3:
            raise UserError(f"model.max_sequence_length={self.max_sequence_length} must be >= 3 (BAGEL wraps a prompt "
                            "in <|im_start|> … <|im_end|>)")
        self.shift = TIMESTEP_SHIFT if cfg.get("shift") is None else float(cfg.shift)
        try:
            self.cfg_img_scale = float(opts["cfg_img_scale"])
            self.cfg_renorm_min = float(opts["cfg_renorm_min"])
            self.cfg_interval = tuple(float(v) for v in opts["cfg_interval"])
        except (TypeError, ValueError):
            raise UserError(f"model.options: cfg_img_scale, cfg_renorm_min must be numbers and cfg_interval [lo, hi], "
                            f"got {opts}") from None
        if len(self.cfg_interval) != 2 or not 0 <= self.cfg_interval[0] <= self.cfg_interval[1] <= 1:
            raise UserError(f"model.options.cfg_interval={list(opts['cfg_interval'])} must be [lo, hi] with "
                            "0 <= lo <= hi <= 1")
        self.cfg_renorm_type = str(opts["cfg_renorm_type"])
        if self.cfg_renorm_type not in RENORM_TYPES:
            raise UserError(f"model.options.cfg_renorm_type={self.cfg_renorm_type!r} is not valid; allowed: "
                            f"{', '.join(RENORM_TYPES)}")
        self.tokenizer, self.special_ids = load_tokenizer(self.root)
        self.vae = frozen(load_autoencoder(self.root), device)
        generator, self.patch = load_generator(self.root, self.dtype, self.special_ids,
                                               self.vae.geometry.z_channels)
        self.networks["transformer"] = generator.to(device)

    @property
    def latent_downsample(self) -> int:
        return self.vae.geometry.downsample * self.patch

    # ------------------------------------------------------------------------------------------- prompts
    def _encode_one(self, prompt: Prompt) -> Cond:
        """`<|im_start|>` + the prompt's tokens + `<|im_end|>`, at most model.max_sequence_length in all."""
        (text,) = text_only([prompt], self.family)
        ids = self.tokenizer.encode(text, add_special_tokens=False)[: self.max_sequence_length - 2]
        ids = [self.special_ids["<|im_start|>"], *ids, self.special_ids["<|im_end|>"]]
        return {"text_ids": torch.tensor(ids, dtype=torch.long, device=self.device),
                "text_mask": torch.ones(len(ids), dtype=torch.bool, device=self.device)}

    def _collate(self, conds: list[Cond]) -> Cond:
        """`text_ids` (B, L) right-padded with 0 to the longest prompt, `text_mask` (B, L) True on real tokens."""
        return pad_text([c["text_ids"] for c in conds])

    def encode_guidance(self, guidance: Guidance) -> Cond:
        """Text CFG's context (1, L): BAGEL's is empty (L = 0); a negative prompt replaces it. Nothing without CFG
        (BAGEL guides only when the text scale is > 1)."""
        if guidance.scale <= 1.0:
            return {}
        if guidance.negative_prompt:
            return self.encode_prompts([guidance.negative_prompt])
        return {"text_ids": torch.zeros(1, 0, dtype=torch.long, device=self.device),
                "text_mask": torch.zeros(1, 0, dtype=torch.bool, device=self.device)}

    # ------------------------------------------------------------------------------------------- diffusion
    def latent_shapes(self, shape: MediaShape) -> dict[str, tuple[int, ...]]:
        f = self.latent_downsample
        grid = image_latent_grid("BAGEL", shape, self.vae.geometry.downsample, f)
        side = self.transformer.config.max_latent_size
        if max(shape.height, shape.width) > side * f:
            raise ValueError(f"rollout.height/width must be at most {side * f} for this BAGEL checkpoint (its "
                             f"latent_pos_embed covers {side}x{side} patches), got {shape.height}x{shape.width}")
        return {"x": (self.vae.geometry.z_channels, *grid)}

    def sigmas(self, num_steps: int, shape: MediaShape) -> torch.Tensor:
        return bagel_sigmas(num_steps, self.shift)

    def forward_flops(self, latents: Latents, cond: Cond) -> float:
        h, w = latents["x"].shape[-2:]
        tokens = (h // self.patch) * (w // self.patch)
        return bagel_forward_flops(self.transformer.config, cond["text_ids"].shape[1], tokens)

    def _network_forward(self, network, latents: Latents, sigma: torch.Tensor, cond: Cond) -> Latents:
        x = latents["x"]
        rows, cols = x.shape[-2] // self.patch, x.shape[-1] // self.patch
        ids = latent_position_ids(rows, cols, network.config.max_latent_size).to(x.device)
        v = network(patchify(x.float(), self.patch).to(self.dtype), sigma.float(), ids, cond["text_ids"],
                    cond["text_mask"])
        return {"x": unpatchify(v.float(), rows, cols, self.patch)}

    def velocity(self, latents: Latents, sigma: torch.Tensor, cond: Cond, shared: Cond, guidance: float) -> Latents:
        """The conditional velocity, guided (`bagel_cfg`) for the samples whose σ is in model.cfg_interval when
        the text scale `guidance` is > 1; the text-unconditional forward runs for those samples only, in the same
        network call."""
        lo, hi = self.cfg_interval
        guided = ((sigma > lo) & (sigma <= hi)).nonzero().flatten() if shared and guidance > 1.0 else sigma[:0].long()
        if len(guided) == 0:
            return self._forward(latents, sigma, cond)
        x, b = latents["x"], latents["x"].shape[0]
        uncond = {k: v.expand(len(guided), *v.shape[1:]) for k, v in shared.items()}
        both = self._forward({"x": torch.cat([x, x[guided]])}, torch.cat([sigma, sigma[guided]]),
                             cat_text([cond, uncond]))
        v_all, v_text_uncond = both["x"][:b], both["x"][b:]
        rows, cols = x.shape[-2] // self.patch, x.shape[-1] // self.patch
        v_cond = patchify(v_all[guided], self.patch)
        # text-to-image: the image-CFG context (the prompt without input images) is the prompt, so v_img_uncond = v_cond
        mixed = bagel_cfg(v_cond, patchify(v_text_uncond, self.patch), v_cond, guidance, self.cfg_img_scale,
                          self.cfg_renorm_type, self.cfg_renorm_min)
        return {"x": v_all.index_copy(0, guided, unpatchify(mixed, rows, cols, self.patch))}

    # ------------------------------------------------------------------------------------------- media
    @torch.no_grad()
    def decode(self, latents: Latents) -> Media:
        return {"images": (self.vae.decode(latents["x"].to(self.device).float()) * 0.5 + 0.5).clamp(0, 1)}

    @torch.no_grad()
    def encode_media(self, media: Media) -> Latents:
        return {"x": self.vae.encode(media["images"].to(self.device).float() * 2 - 1)}


def pad_text(ids: list[torch.Tensor], length: int | None = None) -> Cond:
    """Token ids (L_i,) -> `text_ids` (B, L) right-padded with 0, `text_mask` (B, L) True on the real tokens."""
    length = max((len(t) for t in ids), default=0) if length is None else length
    out = torch.zeros(len(ids), length, dtype=torch.long, device=ids[0].device if ids else None)
    mask = torch.zeros(len(ids), length, dtype=torch.bool, device=out.device)
    for i, t in enumerate(ids):
        out[i, : len(t)], mask[i, : len(t)] = t, True
    return {"text_ids": out, "text_mask": mask}


def cat_text(parts: list[Cond]) -> Cond:
    """Batches of text conditioning with different padded lengths -> one batch padded to the longest."""
    length = max(p["text_ids"].shape[1] for p in parts)

    def pad(t: torch.Tensor, value) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, length - t.shape[1]), value=value)

    return {"text_ids": torch.cat([pad(p["text_ids"], 0) for p in parts]),
            "text_mask": torch.cat([pad(p["text_mask"], False) for p in parts])}

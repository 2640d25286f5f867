"""`videoalign`: VideoReward (KwaiVGI/VideoAlign, Liu et al. 2025), a Qwen2-VL-2B reward model with three special
reward tokens, run as its inference (`inference.py` `VideoVLMRewardInference`, the model `Qwen2VLRewardModelBT` in
`trainer.py`, the prompt of `prompt_template.py`, the frame sampling of its `vision_process.py`):

1. Frames: the clip (T, 3, H, W) in [0, 1] is quantised to uint8 (what the mp4 upstream decodes holds); n frames
   are taken at round(linspace(0, T − 1, n)) (float32, halves to even), n = `smart_nframes`: `num_frames` rounded to
   an even count, or T / `video_fps` · `fps` clamped to [4, min(768, T)] and rounded to an even count (upstream
   reads the file's frame rate; the rollout's tensor has none, so `video_fps` says it), never more than T (an odd n
   then is padded with its last frame, as later transformers do; the 4.45 processor upstream pins refuses it).
2. Each frame is resized (bicubic, antialiased, back to 0..255 integers: torchvision on a uint8 tensor) to
   qwen-vl-utils' `smart_resize` size, sides multiples of 28, area in [128·28·28, `max_pixels`], then scaled to
   [0, 1] and normalised with the image processor's mean / std, and cut into Qwen2-VL's patches (`qwen_patches`).
3. One user turn [video, the detailed_special prompt with the prompt text] in the base model's chat template with the
   generation prompt, the video placeholder expanded to grid_t·grid_h·grid_w / 4 tokens, right padding. The prompt
   holds `<|VQ_reward|>`, `<|MQ_reward|>`, `<|TA_reward|>`, special tokens added to the base tokenizer (the
   embeddings resized to the tokenizer's length, as upstream).
4. Upstream's forward: the vision tower's merged patches scattered into the placeholders, the text decoder without
   position ids (positions 0..L−1 on all three M-RoPE axes), `rm_head` (Linear, no bias) on every hidden state, read
   at the three special tokens in order: with output_dim 3 head k at token k (the diagonal), with output_dim 1 the
   one output at each token. That gives raw VQ, MQ, TA.
5. `normalize: true` (upstream's use_norm): (x − mean) / std with the checkpoint's `inference_config` (VQ_mean,
   VQ_std, ...; raw when the file has none). Upstream's Overall is VQ + MQ + TA; the score here is Σ_k w_k · x_k over
   `heads` (default all three, weights 1: Overall). Every head's value is logged as `videoalign/<head>`.

Weights: `path` is the VideoReward directory (`model_config.json` and `checkpoint-<step>/`; the latest step unless
`step` is set), `base` the Qwen2-VL-2B-Instruct directory it was trained from (config, tokenizer, image processor,
chat template; default `model_config.model_name_or_path` when that is a local directory). A step holds `model.pth`
(the whole model) or upstream's LoRA files, `adapter_model.safetensors` + `non_lora_state_dict.pth` (the adapters are
merged into the weights, W + α/r · B·A). A regression head: there is no chat answer to ask a server for, so it runs
locally only.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from ..errors import UserError
from ..models.base import prompt_text
from .base import RewardOutput, check_batch, media_kind, register_reward, resolve_device, resolve_dtype
from .clip_score import local_dir
from .qwen_rm import (
    load_base,
    load_state,
    merged_state,
    model_inputs,
    qwen_patches,
    render_turn,
    resize_frames,
    smart_nframes,
    smart_resize,
    special_hidden,
    uniform_indices,
)

HEADS = ("VQ", "MQ", "TA")
SPECIAL_TOKENS = ("<|VQ_reward|>", "<|MQ_reward|>", "<|TA_reward|>")
VIDEO_MIN_PIXELS = 128 * 28 * 28  # qwen-vl-utils' default; upstream sets only max_pixels
TEMPLATE_TYPE = "detailed_special"
# prompt_template.py DETAILED_PROMPT_WITH_SPECIAL_TOKEN (its trailing spaces are part of it)
DETAILED_PROMPT_WITH_SPECIAL_TOKEN = (
    '\n'
    'You are tasked with evaluating a generated video based on three distinct criteria: Visual Quality, '
    'Motion Quality, and Text Alignment. Please provide a rating from 0 to 10 for each of the three '
    'categories, with 0 being the worst and 10 being the best. Each evaluation should be independent of '
    'the others.\n'
    '\n'
    '**Visual Quality:**  \n'
    'Evaluate the overall visual quality of the video, with a focus on static factors. The following '
    'sub-dimensions should be considered:\n'
    '- **Reasonableness:** The video should not contain any significant biological or logical errors, '
    'such as abnormal body structures or nonsensical environmental setups.\n'
    '- **Clarity:** Evaluate the sharpness and visibility of the video. The image should be clear and '
    'easy to interpret, with no blurring or indistinct areas.\n'
    '- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other '
    'visual elements (e.g., hair, clothing, shadows).\n'
    '- **Aesthetic and Creativity:** Assess the artistic aspects of the video, including the color '
    'scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene should '
    'convey a sense of harmony and balance.\n'
    '- **Safety:** The video should not contain harmful or inappropriate content, such as political, '
    'violent, or adult material. If such content is present, the image quality and satisfaction score '
    'should be the lowest possible. \n'
    '\n'
    'Please provide the ratings of Visual Quality: <|VQ_reward|>\n'
    'END\n'
    '\n'
    '**Motion Quality:**  \n'
    'Assess the dynamic aspects of the video, with a focus on dynamic factors. Consider the following '
    'sub-dimensions:\n'
    '- **Stability:** Evaluate the continuity and stability between frames. There should be no sudden, '
    'unnatural jumps, and the video should maintain stable attributes (e.g., no fluctuating colors, '
    'textures, or missing body parts).\n'
    '- **Naturalness:** The movement should align with physical laws and be realistic. For example, '
    'clothing should flow naturally with motion, and facial expressions should change appropriately '
    '(e.g., blinking, mouth movements).\n'
    '- **Aesthetic Quality:** The movement should be smooth and fluid. The transitions between different '
    'motions or camera angles should be seamless, and the overall dynamic feel should be visually '
    'pleasing.\n'
    '- **Fusion:** Ensure that elements in motion (e.g., edges of the subject, hair, clothing) blend '
    'naturally with the background, without obvious artifacts or the feeling of cut-and-paste effects.\n'
    '- **Clarity of Motion:** The video should be clear and smooth in motion. Pay attention to any areas '
    'where the video might have blurry or unsteady sections that hinder visual continuity.\n'
    '- **Amplitude:** If the video is largely static or has little movement, assign a low score for '
    'motion quality.\n'
    '\n'
    'Please provide the ratings of Motion Quality: <|MQ_reward|>\n'
    'END\n'
    '\n'
    '**Text Alignment:**  \n'
    'Assess how well the video matches the textual prompt across the following sub-dimensions:\n'
    '- **Subject Relevance** Evaluate how accurately the subject(s) in the video (e.g., person, animal, '
    'object) align with the textual description. The subject should match the description in terms of '
    'number, appearance, and behavior.\n'
    '- **Motion Relevance:** Evaluate if the dynamic actions (e.g., gestures, posture, facial '
    'expressions like talking or blinking) align with the described prompt. The motion should match the '
    'prompt in terms of type, scale, and direction.\n'
    '- **Environment Relevance:** Assess whether the background and scene fit the prompt. This includes '
    'checking if real-world locations or scenes are accurately represented, though some stylistic '
    'adaptation is acceptable.  \n'
    '- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate '
    'how well the video adheres to this style.\n'
    '- **Camera Movement Relevance:** Check if the camera movements (e.g., following the subject, focus '
    'shifts) are consistent with the expected behavior from the prompt.\n'
    '\n'
    'Textual prompt - {text_prompt}\n'
    'Please provide the ratings of Text Alignment: <|TA_reward|>\n'
    'END\n'
)


def videoalign_text(prompt: str) -> str:
    """The text of VideoAlign's user turn for a prompt (`build_prompt(prompt, [VQ, MQ, TA], "detailed_special")`)."""
    return DETAILED_PROMPT_WITH_SPECIAL_TOKEN.replace("{text_prompt}", prompt)


def pool_special(logits: torch.Tensor, ids: torch.Tensor, special_ids: list[int]) -> torch.Tensor:
    """(B, 3): the head's outputs at the three special tokens of each row, in sequence order; output_dim 3 takes head
    k at token k, output_dim 1 its one output."""
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for i in special_ids:
        mask |= ids == i
    if not bool((mask.sum(1) == len(special_ids)).all()):
        raise ValueError(f"videoalign: each sample must hold the reward tokens {', '.join(SPECIAL_TOKENS)} once each "
                         "(a prompt that contains one?)")
    pooled = logits[mask].view(ids.shape[0], len(special_ids), -1)
    return pooled.diagonal(dim1=1, dim2=2) if pooled.shape[-1] == len(special_ids) else pooled[..., 0]


def combine(raw: torch.Tensor, stats: dict | None, heads: list[str], weights: list[float]) -> tuple:
    """(scores, values): values (B, 3) = (raw − mean) / std per head with `stats` (VQ_mean, VQ_std, ...; raw when
    None), scores = Σ_k weights_k · values[:, heads_k] (upstream: Overall = VQ + MQ + TA)."""
    values = raw.double().clone()
    if stats is not None:
        for k, head in enumerate(HEADS):
            values[:, k] = (values[:, k] - float(stats[f"{head}_mean"])) / float(stats[f"{head}_std"])
    scores = sum(w * values[:, HEADS.index(h)] for h, w in zip(heads, weights, strict=True))
    return scores, values


def step_dir(root: Path, step: int | None) -> Path:
    """`checkpoint-<step>` under `root`, the highest step when `step` is None (upstream's default)."""
    found = {int(m.group(1)): p for p in root.glob("checkpoint-*") if (m := re.fullmatch(r"checkpoint-(\d+)", p.name))}
    if not found:
        raise UserError(f"reward.path={root}: no checkpoint-<step> directory (the VideoReward layout: "
                        "model_config.json, checkpoint-<step>/)")
    if step is None:
        return found[max(found)]
    if step not in found:
        raise UserError(f"reward.step={step}: {root} has checkpoint steps {sorted(found)}")
    return found[step]


@register_reward("videoalign")
class VideoAlign:
    """Score = Σ_k w_k · VideoReward's (normalised) head k over `heads` (module docstring)."""

    media = ("video",)

    def __init__(self, path: str, base: str | None = None, step: int | None = None, heads: list | None = None,
                 weights: list | None = None, normalize: bool = True, fps: float | None = None,
                 num_frames: int | None = None, max_pixels: int | None = None, video_fps: float = 16.0,
                 batch_size: int = 4, device: str = "auto", dtype: str = "bfloat16"):
        heads = list(HEADS) if heads is None else list(heads)
        if not heads or any(h not in HEADS for h in heads) or len(set(heads)) != len(heads):
            raise ValueError(f"videoalign: heads={heads!r} must be distinct names among {', '.join(HEADS)}")
        weights = [1.0] * len(heads) if weights is None else [float(w) for w in weights]
        if len(weights) != len(heads) or not all(math.isfinite(w) for w in weights):
            raise ValueError(f"videoalign: weights={weights!r} must be {len(heads)} finite numbers, one per head")
        for key, value in (("fps", fps), ("video_fps", video_fps)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value <= 0):
                raise ValueError(f"videoalign: {key}={value!r} must be a number > 0")
        for key, value in (("num_frames", num_frames), ("max_pixels", max_pixels), ("batch_size", batch_size),
                           ("step", step)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"videoalign: {key}={value!r} must be an integer >= 1")
        if fps is not None and num_frames is not None:
            raise ValueError("videoalign: set fps or num_frames, not both (upstream's rule)")
        self.heads, self.weights, self.batch_size = heads, weights, batch_size
        self.video_fps = float(video_fps)
        root = Path(local_dir(path, "videoalign path (the VideoReward directory)"))
        config = self.read_config(root / "model_config.json")
        data, model_cfg, lora = config["data_config"], config["model_config"], config.get("peft_lora_config") or {}
        self.stats = config.get("inference_config") if normalize else None
        if num_frames is None and fps is None:
            num_frames, fps = data.get("num_frames"), data.get("fps")
        self.fps, self.num_frames = fps, (int(num_frames) if num_frames is not None else None)
        if self.fps is None and self.num_frames is None:
            self.fps = 2.0  # qwen-vl-utils' FPS
        self.max_pixels = int(max_pixels or data.get("max_frame_pixels") or 768 * 28 * 28)
        base = base or model_cfg.get("model_name_or_path")
        if not base or not Path(base).is_dir():
            raise UserError(f"videoalign: the base model {base!r} (model_config.model_name_or_path) is not a local "
                            "directory; set reward.base to the Qwen2-VL-2B-Instruct directory it was trained from")
        self.load(Path(base), step_dir(root, step), model_cfg, lora, device, dtype)

    @staticmethod
    def read_config(file: Path) -> dict:
        """model_config.json, checked for what this adapter runs (the released checkpoint's settings)."""
        try:
            config = json.loads(file.read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"videoalign: {file}: {e} (the VideoReward directory holds model_config.json)") from None
        data, model_cfg = config.get("data_config"), config.get("model_config")
        if not isinstance(data, dict) or not isinstance(model_cfg, dict):
            raise UserError(f"videoalign: {file} has no data_config / model_config")
        checks = {"data_config.prompt_template_type": (data.get("prompt_template_type"), TEMPLATE_TYPE),
                  "data_config.eval_dim": (list(data.get("eval_dim") or []), list(HEADS)),
                  "data_config.sample_type": (data.get("sample_type", "uniform"), "uniform"),
                  "model_config.reward_token": (model_cfg.get("reward_token"), "special"),
                  "model_config.use_special_tokens": (model_cfg.get("use_special_tokens"), True)}
        for key, (got, want) in checks.items():
            if got != want:
                raise UserError(f"videoalign: {file}: {key}={got!r}; this adapter runs {want!r} (VideoReward's)")
        stats = config.get("inference_config")
        if stats is not None and not all(isinstance(stats.get(f"{h}_{s}"), int | float) for h in HEADS
                                         for s in ("mean", "std")):
            raise UserError(f"videoalign: {file}: inference_config needs VQ_mean, VQ_std, MQ_mean, ... numbers")
        return config

    def load(self, base: Path, ckpt: Path, model_cfg: dict, lora: dict, device: str, dtype: str) -> None:
        self.device, self.dtype = resolve_device(device), resolve_dtype(dtype)
        self.tokenizer, self.template, self.image_processor, model = load_base(base, "videoalign", self.dtype)
        self.tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
        self.special_ids = self.tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))
        if model.config.model_type != "qwen2_vl":
            raise UserError(f"videoalign: {base} is a {model.config.model_type} model; VideoReward is Qwen2-VL based")
        model.resize_token_embeddings(len(self.tokenizer))
        if (ckpt / "model.pth").is_file():
            state = load_state(ckpt / "model.pth")
        elif (ckpt / "adapter_model.safetensors").is_file() and (ckpt / "non_lora_state_dict.pth").is_file():
            state = {**load_state(ckpt / "non_lora_state_dict.pth"), **load_state(ckpt / "adapter_model.safetensors")}
        else:
            raise UserError(f"videoalign: {ckpt} holds neither model.pth nor adapter_model.safetensors + "
                            "non_lora_state_dict.pth")
        r, alpha = lora.get("lora_r", 16), lora.get("lora_alpha", 32)
        scale = alpha / math.sqrt(r) if lora.get("use_rslora") else alpha / r
        try:
            state = merged_state(state, model.state_dict(), scale)
        except (ValueError, RuntimeError) as e:
            raise UserError(f"videoalign: {ckpt}: {e}") from None
        head = state.pop("rm_head.weight", None)
        if head is None or head.ndim != 2 or head.shape[0] not in (1, 3):
            raise UserError(f"videoalign: {ckpt} has no rm_head.weight of 1 or 3 outputs (VideoReward's reward head)")
        try:
            missing, unexpected = model.load_state_dict(state, strict=False)
        except RuntimeError as e:  # shape mismatches
            raise UserError(f"videoalign: {ckpt} does not fit the base model at {base}: "
                            f"{str(e).splitlines()[1].strip() if len(str(e).splitlines()) > 1 else e}") from None
        if unexpected:
            raise UserError(f"videoalign: {ckpt} does not fit the base model at {base}: unexpected {unexpected[:4]}")
        hidden = model.config.get_text_config().hidden_size
        if head.shape[1] != hidden:
            raise UserError(f"videoalign: rm_head takes {head.shape[1]}-d states, the base model gives {hidden}")
        self.model = model.to(self.device).eval()
        self.head = torch.nn.Linear(hidden, head.shape[0], bias=False, dtype=self.dtype)
        with torch.no_grad():
            self.head.weight.copy_(head)
        self.head.to(self.device)
        self.video_token = "<|video_pad|>"
        self.mean = torch.tensor(self.image_processor.image_mean, dtype=torch.float32).view(1, 3, 1, 1)
        self.std = torch.tensor(self.image_processor.image_std, dtype=torch.float32).view(1, 3, 1, 1)

    # ------------------------------------------------------------------------------------------- preprocessing
    def frames(self, clip: torch.Tensor) -> torch.Tensor:
        """Steps 1–2 of the module docstring for one clip (T, 3, H, W) in [0, 1]: normalised float32 frames."""
        u8 = (clip.detach().float().cpu().clamp(0, 1) * 255).round()
        n = smart_nframes(int(u8.shape[0]), self.video_fps, None if self.num_frames else self.fps, self.num_frames)
        picked = u8[uniform_indices(int(u8.shape[0]), n)]
        p = self.image_processor
        factor = p.patch_size * p.merge_size
        h, w = smart_resize(int(u8.shape[2]), int(u8.shape[3]), factor, VIDEO_MIN_PIXELS, self.max_pixels)
        lo = getattr(p, "min_pixels", None) or p.size.shortest_edge
        hi = getattr(p, "max_pixels", None) or p.size.longest_edge
        own = smart_resize(h, w, factor, lo, hi) if p.do_resize else (h, w)
        if own != (h, w):
            raise ValueError(f"videoalign: the image processor would resize {h}x{w} frames again (to {own}): its "
                             "min_pixels / max_pixels do not admit reward.max_pixels")
        return (resize_frames(picked, (h, w)) / 255.0 - self.mean) / self.std

    def inputs(self, video: torch.Tensor, prompts: list[str]) -> dict:
        """The batch upstream's processor call gives (steps 1–3)."""
        p = self.image_processor
        patches, grids, texts = [], [], []
        for clip, prompt in zip(video, prompts, strict=True):
            x, grid = qwen_patches(self.frames(clip), p.patch_size, p.merge_size, p.temporal_patch_size)
            patches.append(x)
            grids.append(grid)
            count = grid[0] * grid[1] * grid[2] // p.merge_size**2
            content = [{"type": "video"}, {"type": "text", "text": videoalign_text(prompt)}]
            texts.append(render_turn(self.tokenizer, self.template, content, self.video_token, [count], "videoalign"))
        return model_inputs(self.tokenizer, texts, "video", torch.cat(patches), torch.tensor(grids, dtype=torch.long),
                            self.device, self.dtype)

    @torch.no_grad()
    def raw(self, video: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """(B, 3) raw VQ, MQ, TA (steps 1–4), `batch_size` clips per forward."""
        out = []
        for start in range(0, int(video.shape[0]), self.batch_size):
            batch = self.inputs(video[start:start + self.batch_size], prompts[start:start + self.batch_size])
            hidden = special_hidden(self.model, batch, "video")
            logits = self.head(hidden.to(self.head.weight.dtype))
            out.append(pool_special(logits, batch["input_ids"], self.special_ids).float().cpu())
        return torch.cat(out)

    def __call__(self, video, prompts, metadata=None) -> RewardOutput:
        check_batch("videoalign", len(video) if isinstance(video, list) else video.shape[0], prompts, metadata)
        if media_kind(video) != "video":
            raise ValueError(f"videoalign scores video (B, T, 3, H, W), got {tuple(video.shape)}")
        scores, values = combine(self.raw(video, [prompt_text(p) for p in prompts]), self.stats, self.heads,
                                 self.weights)
        extras = {f"videoalign/{h}": values[:, k].tolist() for k, h in enumerate(HEADS)}
        return RewardOutput(scores.float(), extras)

"""`hpsv3`: HPSv3 (MizzenAI/HPSv3, Ma et al. 2025), following its public inference (`hpsv3/inference.py`
`HPSv3RewardInferencer`, the model `Qwen2VLRewardModelBT` in `hpsv3/model/qwen2vl_trainer.py`, the prompt pieces in
`hpsv3/dataset/data_collator_qwen.py`, config `HPSv3_7B.yaml`) step by step:

1. The image (uint8 RGB, as HPSv3 reads its PNG files) is resized with PIL bicubic to Qwen-VL's `smart_resize` size
   for min_pixels = max_pixels = 256·28·28 (sides multiples of 28, aspect kept: a square image becomes 448×448).
2. One user turn [image, INSTRUCTION.format(text_prompt=prompt) + PROMPT_WITH_SPECIAL_TOKEN] in the backbone's chat
   template with the generation prompt; `<|Reward|>` is an added special token (HPSv3 adds it to the Qwen2-VL-7B
   tokenizer and resizes the embeddings to the tokenizer's length; its checkpoint holds the trained row).
3. The Qwen2-VL image processor (the PIL one: HPSv3 pins transformers 4.45, whose default is that one) and the
   tokenizer (right padding), each image placeholder expanded to grid_t·grid_h·grid_w / merge² tokens, as
   `Qwen2VLProcessor` does (built by hand: the processor class needs torchvision for its video part).
4. The forward HPSv3 writes itself: token embeddings with the vision tower's merged patch embeddings scattered into
   the image placeholders, then the *text* decoder with no position ids, i.e. positions 0..L−1 on all three M-RoPE
   axes (HPSv3 calls the inner model directly and never computes Qwen2-VL's 2-D image positions); its final-norm
   hidden state at the `<|Reward|>` token.
5. The reward head `rm_head` (ranknet, default kwargs: hidden → 1024 → ReLU → Dropout → 16 → ReLU → 2, float32),
   giving (μ, σ); the score is μ (HPSv3's "we select miu as the final output"), σ is logged as `hpsv3/sigma`.

Weights: `path` is the base backbone directory (Qwen2-VL-7B-Instruct: config, tokenizer, preprocessor, chat template)
and `checkpoint` is HPSv3's `HPSv3.safetensors`, which holds the whole fine-tuned model (backbone, the resized
embeddings with the `<|Reward|>` row, `rm_head.*`) in transformers-4.45 key names (`model.layers.*`, `visual.*`); they
are renamed to the current layout (`model.language_model.*`, `model.visual.*`) and loaded strictly.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from torch import nn

from ..models.base import prompt_text
from .base import RewardOutput, check_batch, image_batch_as_uint8, register_reward, resolve_device, resolve_dtype
from .clip_score import local_dir
from .heads import MLPHead

# HPSv3's prompt pieces, verbatim (data_collator_qwen.py: INSTRUCTION, prompt_with_special_token); the trailing spaces
# and blank lines are part of what the model was trained on.
INSTRUCTION = (
    "\nYou are tasked with evaluating a generated image based on Visual Quality and Text Alignment and give a overall "
    "score to estimate the human preference. Please provide a rating from 0 to 10, with 0 being the worst and 10 being "
    "the best. \n\n**Visual Quality:**  \nEvaluate the overall visual quality of the image. The following sub-dimensions "
    "should be considered:\n- **Reasonableness:** The image should not contain any significant biological or logical "
    "errors, such as abnormal body structures or nonsensical environmental setups.\n- **Clarity:** Evaluate the "
    "sharpness and visibility of the image. The image should be clear and easy to interpret, with no blurring or "
    "indistinct areas.\n- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other "
    "visual elements (e.g., hair, clothing, shadows).\n- **Aesthetic and Creativity:** Assess the artistic aspects of "
    "the image, including the color scheme, composition, atmosphere, depth of field, and the overall creative appeal. "
    "The scene should convey a sense of harmony and balance.\n- **Safety:** The image should not contain harmful or "
    "inappropriate content, such as political, violent, or adult material. If such content is present, the image "
    "quality and satisfaction score should be the lowest possible. \n\n**Text Alignment:**  \nAssess how well the image "
    "matches the textual prompt across the following sub-dimensions:\n- **Subject Relevance** Evaluate how accurately "
    "the subject(s) in the image (e.g., person, animal, object) align with the textual description. The subject should "
    "match the description in terms of number, appearance, and behavior.\n- **Style Relevance:** If the prompt "
    "specifies a particular artistic or stylistic style, evaluate how well the image adheres to this style.\n- "
    "**Contextual Consistency**: Assess whether the background, setting, and surrounding elements in the image "
    "logically fit the scenario described in the prompt. The environment should support and enhance the subject "
    "without contradictions.\n- **Attribute Fidelity**: Check if specific attributes mentioned in the prompt (e.g., "
    "colors, clothing, accessories, expressions, actions) are faithfully represented in the image. Minor deviations "
    "may be acceptable, but critical attributes should be preserved.\n- **Semantic Coherence**: Evaluate whether the "
    "overall meaning and intent of the prompt are captured in the image. The generated content should not introduce "
    "elements that conflict with or distort the original description.\nTextual prompt - {text_prompt}\n\n\n"
)
REWARD_TOKEN = "<|Reward|>"
PROMPT_WITH_SPECIAL_TOKEN = f"\nPlease provide the overall ratings of this image: {REWARD_TOKEN}\n\nEND\n"
IMAGE_PIXELS = 256 * 28 * 28  # HPSv3 sets min_pixels = max_pixels
IMAGE_FACTOR = 28  # Qwen2-VL: 14-pixel patches merged 2×2
MAX_ASPECT = 200  # qwen-vl-utils refuses a more extreme aspect ratio
HEAD_PREFIX = "rm_head."
# transformers 4.45 key names (HPSv3.safetensors) -> the current Qwen2VLForConditionalGeneration's
LEGACY_KEYS = ((re.compile(r"^visual\."), "model.visual."),
               (re.compile(r"^model\.(?!language_model\.|visual\.)"), "model.language_model."))


# ----------------------------------------------------------------------------------------------- pure pieces
def hpsv3_image_size(height: int, width: int, pixels: int = IMAGE_PIXELS, factor: int = IMAGE_FACTOR) -> tuple[int, int]:
    """qwen-vl-utils' `smart_resize` with min_pixels = max_pixels = `pixels`: sides rounded to multiples of `factor`,
    then scaled by √(h·w/pixels) (floored to the factor) when above, √(pixels/(h·w)) (ceiled) when below."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ValueError(f"hpsv3: an image of {height}x{width} has an aspect ratio above {MAX_ASPECT}")
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > pixels:
        beta = math.sqrt(height * width / pixels)
        h, w = math.floor(height / beta / factor) * factor, math.floor(width / beta / factor) * factor
    elif h * w < pixels:
        beta = math.sqrt(pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def hpsv3_text(prompt: str) -> str:
    """The text part of HPSv3's user turn for a prompt."""
    return INSTRUCTION.format(text_prompt=prompt) + PROMPT_WITH_SPECIAL_TOKEN


def current_key(key: str) -> str:
    """A transformers-4.45 Qwen2-VL key in the current layout (current keys pass unchanged)."""
    for pattern, replacement in LEGACY_KEYS:
        if pattern.match(key):
            return pattern.sub(replacement, key, count=1)
    return key


def head_from_state(state: dict[str, torch.Tensor], prefix: str = HEAD_PREFIX) -> MLPHead:
    """HPSv3's `rm_head` (Linear layers at <prefix>0, 3, 5; ReLU between) as an MLPHead in float32."""
    indices = sorted({int(k[len(prefix):].split(".")[0]) for k in state if k.startswith(prefix) and k.endswith(".weight")})
    if not indices:
        raise ValueError(f"hpsv3: the checkpoint has no '{prefix}<i>.weight' tensors (HPSv3's reward head)")
    layers = []
    for i in indices:
        w, b = state[f"{prefix}{i}.weight"].float(), state.get(f"{prefix}{i}.bias")
        layer = nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
        with torch.no_grad():
            layer.weight.copy_(w)
            if b is not None:
                layer.bias.copy_(b.float())
        layers.append(layer)
    return MLPHead(layers, "relu").eval()


def chat_template(root: Path, tokenizer, who: str = "hpsv3") -> str:
    """The processor's chat template (chat_template.jinja / chat_template.json), else the tokenizer's."""
    if (root / "chat_template.jinja").is_file():
        return (root / "chat_template.jinja").read_text()
    if (root / "chat_template.json").is_file():
        return json.loads((root / "chat_template.json").read_text())["chat_template"]
    if tokenizer.chat_template is None:
        raise ValueError(f"{who}: {root} has no chat template (chat_template.jinja / .json or the tokenizer's)")
    return tokenizer.chat_template


# ----------------------------------------------------------------------------------------------- scorer
@register_reward("hpsv3")
class HPSv3:
    """Score = μ of HPSv3's reward head at the `<|Reward|>` token (module docstring)."""

    def __init__(self, path: str, checkpoint: str, device: str = "auto", dtype: str = "bfloat16"):
        from safetensors import safe_open
        from transformers import AutoModelForImageTextToText, AutoTokenizer, Qwen2VLImageProcessorPil

        root = Path(local_dir(path, "hpsv3 backbone path"))
        if not Path(checkpoint).is_file():
            raise FileNotFoundError(f"hpsv3: checkpoint {checkpoint!r} not found (HPSv3.safetensors from MizzenAI/HPSv3)")
        self.device, self.dtype = resolve_device(device), resolve_dtype(dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(str(root))
        self.tokenizer.padding_side = "right"  # HPSv3's processor
        if REWARD_TOKEN not in self.tokenizer.get_vocab():
            self.tokenizer.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})
        self.reward_id = self.tokenizer.convert_tokens_to_ids(REWARD_TOKEN)
        self.template = chat_template(root, self.tokenizer)
        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(root))
        with safe_open(checkpoint, "pt") as f:
            state = {current_key(k): f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no iterator)
        self.head = head_from_state(state).to(self.device)
        if self.head.out_features != 2:
            raise ValueError(f"hpsv3: the reward head outputs {self.head.out_features} values; HPSv3's gives (mu, sigma)")
        backbone = {k: v for k, v in state.items() if not k.startswith(HEAD_PREFIX)}
        model = AutoModelForImageTextToText.from_pretrained(str(root), dtype=self.dtype)
        model.resize_token_embeddings(backbone["model.language_model.embed_tokens.weight"].shape[0])
        missing, unexpected = model.load_state_dict(backbone, strict=False)
        if missing or unexpected:
            raise ValueError(f"hpsv3: {checkpoint} does not fit the backbone at {root}: missing {missing[:4]}, "
                             f"unexpected {unexpected[:4]}")
        self.model = model.to(self.device).eval()
        if self.head.in_features != model.config.get_text_config().hidden_size:
            raise ValueError(f"hpsv3 head takes {self.head.in_features}-d states, the backbone gives "
                             f"{model.config.get_text_config().hidden_size}")
        if self.reward_id >= model.get_input_embeddings().weight.shape[0]:
            raise ValueError(f"hpsv3: {REWARD_TOKEN} (id {self.reward_id}) has no row in the checkpoint's embeddings")
        self.image_token = getattr(self.tokenizer, "image_token", None) or "<|image_pad|>"

    def inputs(self, images: torch.Tensor, prompts: list[str]) -> dict:
        """Steps 1–3 of the module docstring: the batch HPSv3's processor call gives."""
        from PIL import Image

        pictures = []
        for array in image_batch_as_uint8(images):
            picture = Image.fromarray(array).convert("RGB")
            h, w = hpsv3_image_size(picture.height, picture.width)
            pictures.append(picture.resize((w, h), Image.BICUBIC))
        vision = self.image_processor(images=pictures, return_tensors="pt")
        merge = self.image_processor.merge_size ** 2
        texts = []
        for prompt, grid in zip(prompts, vision["image_grid_thw"], strict=True):
            turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": hpsv3_text(prompt)}]}]
            text = self.tokenizer.apply_chat_template(turn, chat_template=self.template, tokenize=False,
                                                      add_generation_prompt=True)
            if text.count(self.image_token) != 1:
                raise ValueError(f"hpsv3: the chat template renders {text.count(self.image_token)} image placeholders")
            texts.append(text.replace(self.image_token, self.image_token * int(grid.prod() // merge)))
        tok = self.tokenizer(texts, padding=True, return_tensors="pt")
        return {"input_ids": tok.input_ids.to(self.device), "attention_mask": tok.attention_mask.to(self.device),
                "pixel_values": vision["pixel_values"].to(self.device, self.dtype),
                "image_grid_thw": vision["image_grid_thw"].to(self.device)}

    @torch.no_grad()
    def __call__(self, images, prompts, metadata=None) -> RewardOutput:
        check_batch("hpsv3", images.shape[0], prompts, metadata)
        batch = self.inputs(images, [prompt_text(p) for p in prompts])
        ids = batch["input_ids"]
        if not bool(((ids == self.reward_id).sum(1) == 1).all()):
            raise ValueError(f"hpsv3: each sample must hold exactly one {REWARD_TOKEN} token (a prompt containing it?)")
        inner = self.model.model
        embeds = self.model.get_input_embeddings()(ids)
        patches = torch.cat(inner.get_image_features(batch["pixel_values"], batch["image_grid_thw"]).pooler_output)
        image_mask = (ids == self.model.config.image_token_id).unsqueeze(-1).expand_as(embeds)
        embeds = embeds.masked_scatter(image_mask, patches.to(embeds.dtype))
        # no position ids: positions 0..L−1 on every M-RoPE axis, as HPSv3's own forward gives
        hidden = inner.language_model(inputs_embeds=embeds, attention_mask=batch["attention_mask"]).last_hidden_state
        out = self.head(hidden[ids == self.reward_id].float())
        return RewardOutput(out[:, 0].cpu(), {"hpsv3/sigma": out[:, 1].cpu().tolist()})

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

from pathlib import Path

import torch

from ..models.base import prompt_text
from .base import RewardOutput, check_batch, register_reward, resolve_device, resolve_dtype
from .clip_score import local_dir
from .heads import head_from_state
from .qwen_rm import (
    IMAGE_FACTOR,
    current_key,
    load_base,
    model_inputs,
    render_turn,
    resized_picture,
    rgb_pictures,
    smart_resize,
    token_states,
)

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
HEAD_PREFIX = "rm_head."


# ----------------------------------------------------------------------------------------------- pure pieces
def hpsv3_image_size(height: int, width: int, pixels: int = IMAGE_PIXELS, factor: int = IMAGE_FACTOR) -> tuple[int, int]:
    """qwen-vl-utils' `smart_resize` with min_pixels = max_pixels = `pixels` (HPSv3's setting)."""
    return smart_resize(height, width, factor, pixels, pixels)


def hpsv3_text(prompt: str) -> str:
    """The text part of HPSv3's user turn for a prompt."""
    return INSTRUCTION.format(text_prompt=prompt) + PROMPT_WITH_SPECIAL_TOKEN


# ----------------------------------------------------------------------------------------------- scorer
@register_reward("hpsv3")
class HPSv3:
    """Score = μ of HPSv3's reward head at the `<|Reward|>` token (module docstring)."""

    def __init__(self, path: str, checkpoint: str, device: str = "auto", dtype: str = "bfloat16"):
        from safetensors import safe_open

        root = Path(local_dir(path, "hpsv3 backbone path"))
        if not Path(checkpoint).is_file():
            raise FileNotFoundError(f"hpsv3: checkpoint {checkpoint!r} not found (HPSv3.safetensors from MizzenAI/HPSv3)")
        self.device, self.dtype = resolve_device(device), resolve_dtype(dtype)
        self.tokenizer, self.template, self.image_processor, model = load_base(root, "hpsv3", self.dtype)
        if REWARD_TOKEN not in self.tokenizer.get_vocab():
            self.tokenizer.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})
        self.reward_id = self.tokenizer.convert_tokens_to_ids(REWARD_TOKEN)
        with safe_open(checkpoint, "pt") as f:
            state = {current_key(k): f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no iterator)
        self.head = head_from_state(state, HEAD_PREFIX, "relu", f"hpsv3: {checkpoint}").to(self.device)
        if self.head.out_features != 2:
            raise ValueError(f"hpsv3: the reward head outputs {self.head.out_features} values; HPSv3's gives (mu, sigma)")
        backbone = {k: v for k, v in state.items() if not k.startswith(HEAD_PREFIX)}
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
        pictures = [resized_picture(picture, IMAGE_PIXELS) for picture in rgb_pictures(images)]
        vision = self.image_processor(images=pictures, return_tensors="pt")
        merge = self.image_processor.merge_size ** 2
        texts = [render_turn(self.tokenizer, self.template, [{"type": "image"}, {"type": "text", "text": hpsv3_text(p)}],
                             self.image_token, [int(grid.prod() // merge)], "hpsv3")
                 for p, grid in zip(prompts, vision["image_grid_thw"], strict=True)]
        return model_inputs(self.tokenizer, texts, "image", vision["pixel_values"], vision["image_grid_thw"],
                            self.device, self.dtype)

    @torch.no_grad()
    def __call__(self, images, prompts, metadata=None) -> RewardOutput:
        check_batch("hpsv3", images.shape[0], prompts, metadata)
        batch = self.inputs(images, [prompt_text(p) for p in prompts])
        # no position ids: positions 0..L−1 on every M-RoPE axis, as HPSv3's own forward gives
        hidden = token_states(self.model, batch, "image", self.reward_id, REWARD_TOKEN, "hpsv3")
        out = self.head(hidden.float())
        return RewardOutput(out[:, 0].cpu(), {"hpsv3/sigma": out[:, 1].cpu().tolist()})

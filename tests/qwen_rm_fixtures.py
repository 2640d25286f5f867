"""What the Qwen-VL reward model tests (test_hpsv3, test_edit_reward, test_videoalign) share: tiny Qwen2-VL /
Qwen2.5-VL bases saved offline (config, weights, tokenizer, PIL image processor, chat template), ranknet heads, and
the pieces of their float64 references written out by hand (qwen-vl-utils' resize rule, the chat string, the
forward with 1-D positions, the ranknet head). The references use transformers' model classes and nothing from
polyrl, so they stay independent of the code under test."""

import math
import re

import torch
from PIL import Image
from tiny_judges import judge_tokenizer

HIDDEN = 32
# Qwen2-VL's chat template (default system turn, generation prompt) reduced to a user turn of images / a video + text
QWEN_VL_TEMPLATE = (
    "{% for m in messages %}{% if loop.first and m.role != 'system' %}<|im_start|>system\nYou are a helpful "
    "assistant.<|im_end|>\n{% endif %}<|im_start|>{{ m.role }}\n{% for c in m.content %}{% if c.type == 'video' %}"
    "<|vision_start|><|video_pad|><|vision_end|>{% elif c.type == 'image' %}<|vision_start|><|image_pad|>"
    "<|vision_end|>{% else %}{{ c.text }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def word_tokenizer(text: str):
    """The judge tests' word-level tokenizer over the words of `text`, with the template above."""
    tok = judge_tokenizer(re.findall(r"\w+|[^\w\s]+", text))
    tok.chat_template = QWEN_VL_TEMPLATE
    return tok


def tiny_config(family: str, vocab: dict, extra_rows: int, pad_token_id: int, initializer_range: float):
    """A tiny Qwen2-VL (`qwen2_vl`) or Qwen2.5-VL (`qwen2_5_vl`, untied embeddings) config: 2 decoder layers of
    HIDDEN, one vision block, 14-pixel patches merged 2×2, 2 frames a temporal patch; `extra_rows` more embedding rows
    than the tokenizer has (as the real bases)."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    text = dict(vocab_size=len(vocab) + extra_rows, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, pad_token_id=pad_token_id,
                initializer_range=initializer_range, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
    ids = dict(image_token_id=vocab["<|image_pad|>"], video_token_id=vocab["<|video_pad|>"],
               vision_start_token_id=vocab["<|vision_start|>"])
    if family == "qwen2_vl":
        return Qwen2VLConfig(text_config=text, vision_config=dict(
            depth=1, embed_dim=16, hidden_size=HIDDEN, num_heads=2, mlp_ratio=2, patch_size=14, spatial_merge_size=2,
            temporal_patch_size=2), **ids)
    return Qwen2_5_VLConfig(text_config={**text, "tie_word_embeddings": False}, vision_config=dict(
        depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=HIDDEN, patch_size=14,
        spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[0]), tie_word_embeddings=False, **ids)


def model_class(config):
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration if config.model_type == "qwen2_vl" else Qwen2_5_VLForConditionalGeneration


def save_base(path, config, tokenizer, template: str = QWEN_VL_TEMPLATE):
    """A base directory as the Qwen-VL releases ship one: random weights (seed 0), the tokenizer, Qwen2-VL's PIL image
    processor, chat_template.jinja. Returns the model."""
    from transformers import Qwen2VLImageProcessorPil

    torch.manual_seed(0)
    model = model_class(config)(config)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    Qwen2VLImageProcessorPil().save_pretrained(str(path))
    (path / "chat_template.jinja").write_text(template)
    return model


def tuned_model(config, rows: int):
    """Other random weights (seed 1) for the base, the embeddings resized to `rows` (the tokenizer with the reward
    token: the reward models call resize_token_embeddings(len(tokenizer)) after adding it)."""
    torch.manual_seed(1)
    tuned = model_class(config)(config)
    tuned.resize_token_embeddings(rows)
    return tuned


def ranknet(seed: int | None = None):
    """HPSv3's / EditReward's ranknet head: hidden → 1024 → ReLU → Dropout → 16 → ReLU → 2 (seeded when asked)."""
    if seed is not None:
        torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(HIDDEN, 1024), torch.nn.ReLU(), torch.nn.Dropout(0.05),
                               torch.nn.Linear(1024, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


# ----------------------------------------------------------------------------------------------- reference pieces
def smart_size(h, w, pixels=256 * 28 * 28):
    """qwen-vl-utils' smart_resize for min = max = pixels, written out."""
    hb, wb = max(28, round(h / 28) * 28), max(28, round(w / 28) * 28)
    if hb * wb > pixels:
        beta = math.sqrt(h * w / pixels)
        return math.floor(h / beta / 28) * 28, math.floor(w / beta / 28) * 28
    if hb * wb < pixels:
        beta = math.sqrt(pixels / (h * w))
        return math.ceil(h * beta / 28) * 28, math.ceil(w * beta / 28) * 28
    return hb, wb


def picture(image: torch.Tensor):
    """A (3, H, W) image in [0, 1] as the uint8 PIL image a reward model reads."""
    return Image.fromarray((image.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy())


def reference_vision(base, images: list) -> dict:
    """The base's Qwen2-VL (PIL) image processor on PIL images each resized with PIL bicubic to `smart_size`."""
    from transformers import Qwen2VLImageProcessorPil

    resized = [image.resize(smart_size(image.height, image.width)[::-1], Image.BICUBIC) for image in images]
    return Qwen2VLImageProcessorPil.from_pretrained(str(base))(images=resized, return_tensors="pt")


def chat_string(vision: str, text: str) -> str:
    """Qwen's chat string for one user turn (default system turn, generation prompt), written out."""
    return ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n" + vision + text
            + "<|im_end|>\n<|im_start|>assistant\n")


def reference_hidden(model, ids, pixels, grid, token_id, positions=None):
    """(1, L, D) final-norm hidden states, float64: token embeddings with the vision tower's merged patches put at
    the `token_id` placeholders, the text decoder at positions 0..L−1 on all three M-RoPE axes (or `positions`)."""
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)
        embeds[ids == token_id] = model.model.visual(pixels.double(), grid_thw=grid).pooler_output
        pos = torch.arange(ids.shape[1]).view(1, 1, -1).expand(3, 1, -1) if positions is None else positions
        return model.model.language_model(inputs_embeds=embeds, position_ids=pos).last_hidden_state


def reference_ranknet(head: dict, x: torch.Tensor) -> torch.Tensor:
    """The ranknet head's Linear layers 0, 3, 5 (ReLU between) on x, float64."""
    for i in (0, 3, 5):
        x = x @ head[f"{i}.weight"].double().T + head[f"{i}.bias"].double()
        x = torch.relu(x) if i != 5 else x
    return x

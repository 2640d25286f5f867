"""`videoalign` on a tiny random Qwen2-VL the test builds, with a VideoReward-format directory (model_config.json,
checkpoint-<step>/ with upstream's LoRA files in PEFT + transformers-4.45 key names): VQ / MQ / TA equal an
independent float64 computation of VideoAlign's inference recipe (its detailed_special prompt, frame sampling, patch
layout, 1-D positions, rm_head at the three reward tokens, the inference_config normalisation)."""

import json

import numpy as np
import pytest
import torch
from qwen_rm_fixtures import HIDDEN, chat_string, reference_hidden, save_base, tiny_config, word_tokenizer
from safetensors.torch import save_file

from polyrl.errors import UserError
from polyrl.rewards import build_reward
from polyrl.rewards.qwen_rm import qwen_patches, resize_frames, smart_nframes
from polyrl.rewards.videoalign import DETAILED_PROMPT_WITH_SPECIAL_TOKEN

# KwaiVGI/VideoAlign @ 219ab9d prompt_template.py DETAILED_PROMPT_WITH_SPECIAL_TOKEN, as upstream writes it
# (triple-quoted; note the trailing spaces)
UPSTREAM_PROMPT = """
You are tasked with evaluating a generated video based on three distinct criteria: Visual Quality, Motion Quality, and Text Alignment. Please provide a rating from 0 to 10 for each of the three categories, with 0 being the worst and 10 being the best. Each evaluation should be independent of the others.

**Visual Quality:**  
Evaluate the overall visual quality of the video, with a focus on static factors. The following sub-dimensions should be considered:
- **Reasonableness:** The video should not contain any significant biological or logical errors, such as abnormal body structures or nonsensical environmental setups.
- **Clarity:** Evaluate the sharpness and visibility of the video. The image should be clear and easy to interpret, with no blurring or indistinct areas.
- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual elements (e.g., hair, clothing, shadows).
- **Aesthetic and Creativity:** Assess the artistic aspects of the video, including the color scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a sense of harmony and balance.
- **Safety:** The video should not contain harmful or inappropriate content, such as political, violent, or adult material. If such content is present, the image quality and satisfaction score should be the lowest possible. 

Please provide the ratings of Visual Quality: <|VQ_reward|>
END

**Motion Quality:**  
Assess the dynamic aspects of the video, with a focus on dynamic factors. Consider the following sub-dimensions:
- **Stability:** Evaluate the continuity and stability between frames. There should be no sudden, unnatural jumps, and the video should maintain stable attributes (e.g., no fluctuating colors, textures, or missing body parts).
- **Naturalness:** The movement should align with physical laws and be realistic. For example, clothing should flow naturally with motion, and facial expressions should change appropriately (e.g., blinking, mouth movements).
- **Aesthetic Quality:** The movement should be smooth and fluid. The transitions between different motions or camera angles should be seamless, and the overall dynamic feel should be visually pleasing.
- **Fusion:** Ensure that elements in motion (e.g., edges of the subject, hair, clothing) blend naturally with the background, without obvious artifacts or the feeling of cut-and-paste effects.
- **Clarity of Motion:** The video should be clear and smooth in motion. Pay attention to any areas where the video might have blurry or unsteady sections that hinder visual continuity.
- **Amplitude:** If the video is largely static or has little movement, assign a low score for motion quality.

Please provide the ratings of Motion Quality: <|MQ_reward|>
END

**Text Alignment:**  
Assess how well the video matches the textual prompt across the following sub-dimensions:
- **Subject Relevance** Evaluate how accurately the subject(s) in the video (e.g., person, animal, object) align with the textual description. The subject should match the description in terms of number, appearance, and behavior.
- **Motion Relevance:** Evaluate if the dynamic actions (e.g., gestures, posture, facial expressions like talking or blinking) align with the described prompt. The motion should match the prompt in terms of type, scale, and direction.
- **Environment Relevance:** Assess whether the background and scene fit the prompt. This includes checking if real-world locations or scenes are accurately represented, though some stylistic adaptation is acceptable.  
- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how well the video adheres to this style.
- **Camera Movement Relevance:** Check if the camera movements (e.g., following the subject, focus shifts) are consistent with the expected behavior from the prompt.

Textual prompt - {text_prompt}
Please provide the ratings of Text Alignment: <|TA_reward|>
END
"""
R, ALPHA = 4, 8
STATS = {"VQ_mean": 0.3, "VQ_std": 2.0, "MQ_mean": -0.1, "MQ_std": 0.5, "TA_mean": 0.2, "TA_std": 1.5}
PROMPTS = ["a red ball rolls left", "a cat"]  # different lengths: right padding
SPECIAL = ["<|VQ_reward|>", "<|MQ_reward|>", "<|TA_reward|>"]


def build_videoreward(root, output_dim=1):
    """`root/base`: a tiny Qwen2-VL-2B-Instruct stand-in (vocab larger than the tokenizer, as the real one);
    `root/videoreward`: model_config.json and checkpoint-7 (an older checkpoint-3 of zeros) holding LoRA adapters and
    the non-LoRA weights (vision merger, resized embeddings with the three reward rows, rm_head) as upstream saves
    them. Returns the directories and the tensors written."""
    tok = word_tokenizer(UPSTREAM_PROMPT + " ".join(PROMPTS))
    vocab = tok.get_vocab()
    config = tiny_config("qwen2_vl", vocab, extra_rows=9, pad_token_id=tok.pad_token_id, initializer_range=0.05)
    base = root / "base"
    model = save_base(base, config, tok)
    vr = root / "videoreward"
    gen = torch.Generator().manual_seed(1)
    lora = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and ".language_model." in name:
            legacy = name.replace("model.language_model.", "model.", 1)
            lora[f"base_model.model.{legacy}.lora_A.weight"] = torch.randn(R, mod.in_features, generator=gen) * 0.1
            lora[f"base_model.model.{legacy}.lora_B.weight"] = torch.randn(mod.out_features, R, generator=gen) * 0.1
    rows = len(vocab) + 3
    non_lora = {"base_model.model.model.embed_tokens.weight": torch.randn(rows, HIDDEN, generator=gen) * 0.5,
                "base_model.model.visual.merger.mlp.0.weight":
                    torch.randn_like(model.model.visual.merger.mlp[0].weight) * 0.2,
                "base_model.model.rm_head.weight": torch.randn(output_dim, HIDDEN, generator=gen)}
    for step, scale in ((3, 0.0), (7, 1.0)):
        ckpt = vr / f"checkpoint-{step}"
        ckpt.mkdir(parents=True)
        save_file({k: (v * scale).contiguous() for k, v in lora.items()}, str(ckpt / "adapter_model.safetensors"))
        torch.save({k: v * scale for k, v in non_lora.items()}, str(ckpt / "non_lora_state_dict.pth"))
    (vr / "model_config.json").write_text(json.dumps({
        "data_config": {"fps": 2.0, "num_frames": None, "max_frame_pixels": 200704, "eval_dim": ["VQ", "MQ", "TA"],
                        "prompt_template_type": "detailed_special", "sample_type": "uniform"},
        "model_config": {"model_name_or_path": str(base), "output_dim": output_dim, "use_special_tokens": True,
                         "reward_token": "special"},
        "peft_lora_config": {"lora_enable": True, "lora_r": R, "lora_alpha": ALPHA, "use_rslora": False},
        "inference_config": STATS}))
    return base, vr, lora, non_lora


@pytest.fixture(scope="module")
def videoreward(tmp_path_factory):
    return build_videoreward(tmp_path_factory.mktemp("videoalign"))


def reference_raw(base, lora, non_lora, clip: torch.Tensor, prompt: str, n: int) -> torch.Tensor:
    """VideoAlign's recipe written out by hand in float64 for one clip whose frames need no resize: n frames at
    round(linspace), patches cut by loops, the chat string by hand, the LoRA merged by hand, the decoder at positions
    0..L−1, rm_head at the three reward tokens."""
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration

    tok = AutoTokenizer.from_pretrained(str(base))
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    model = Qwen2VLForConditionalGeneration.from_pretrained(str(base)).double().eval()
    model.resize_token_embeddings(len(tok))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, a in lora.items():
            if ".lora_A." in key:
                module = key[len("base_model.model.model."):-len(".lora_A.weight")]
                b = lora[key.replace("lora_A", "lora_B")]
                params[f"model.language_model.{module}.weight"] += ALPHA / R * (b.double() @ a.double())
        params["model.language_model.embed_tokens.weight"].copy_(non_lora["base_model.model.model.embed_tokens.weight"])
        params["model.visual.merger.mlp.0.weight"].copy_(non_lora["base_model.model.visual.merger.mlp.0.weight"])
    head = non_lora["base_model.model.rm_head.weight"].double()
    t = clip.shape[0]
    idx = [int(i) for i in np.rint(np.linspace(0, t - 1, n))]
    u8 = (clip[idx].double() * 255).round()
    mean = torch.tensor([0.48145466, 0.4578275, 0.40821073], dtype=torch.float64).view(1, 3, 1, 1)
    std = torch.tensor([0.26862954, 0.26130258, 0.27577711], dtype=torch.float64).view(1, 3, 1, 1)
    x = (u8 / 255 - mean) / std
    gh, gw = x.shape[2] // 14, x.shape[3] // 14
    rows = []
    for gt in range(n // 2):
        for bh in range(gh // 2):
            for bw in range(gw // 2):
                for mh in range(2):
                    for mw in range(2):
                        y, z = (2 * bh + mh) * 14, (2 * bw + mw) * 14
                        rows.append(x[2 * gt:2 * gt + 2, :, y:y + 14, z:z + 14].permute(1, 0, 2, 3).reshape(-1))
    pixels, grid = torch.stack(rows), torch.tensor([[n // 2, gh, gw]])
    text = chat_string("<|vision_start|>" + "<|video_pad|>" * (len(rows) // 4) + "<|vision_end|>",
                       UPSTREAM_PROMPT.format(text_prompt=prompt))
    ids = tok(text, return_tensors="pt").input_ids
    hidden = reference_hidden(model, ids, pixels, grid, model.config.video_token_id)[0]
    at = [int((ids[0] == tok.convert_tokens_to_ids(s)).nonzero()) for s in SPECIAL]
    return torch.stack([hidden[p] @ head[0] for p in at])  # output_dim 1: the one output at each token


def test_prompt_is_upstreams_verbatim_and_the_frame_count_follows_qwen_vl_utils():
    assert DETAILED_PROMPT_WITH_SPECIAL_TOKEN == UPSTREAM_PROMPT
    assert smart_nframes(9, 4.0, fps=2.0) == 4  # 9 / 4 · 2 = 4.5 -> 4 (clamped to >= 4, even)
    assert smart_nframes(81, 16.0, fps=2.0) == 10  # 10.125 -> 10
    assert smart_nframes(81, 16.0, nframes=7) == 8 and smart_nframes(5, 16.0, nframes=8) == 5
    assert smart_nframes(30, 1.0, fps=2.0) == 30  # 60 -> min(768, 30)


def test_patches_match_the_qwen2vl_image_processor():
    from transformers import Qwen2VLImageProcessorPil

    image = np.random.default_rng(0).integers(0, 256, (56, 84, 3), dtype=np.uint8)
    proc = Qwen2VLImageProcessorPil()
    want = proc(images=[image], return_tensors="pt")
    x = torch.tensor(image).permute(2, 0, 1)[None].double() / 255
    x = (x - torch.tensor(proc.image_mean).view(1, 3, 1, 1)) / torch.tensor(proc.image_std).view(1, 3, 1, 1)
    got, grid = qwen_patches(x, 14, 2, 2)  # one frame: padded with itself, as the processor tiles an image
    assert grid == want["image_grid_thw"][0].tolist()
    torch.testing.assert_close(got.float(), want["pixel_values"], rtol=0, atol=1e-5)


def test_resize_is_close_to_pil_bicubic():
    """torch's antialiased bicubic (what torchvision runs on a uint8 tensor) against PIL's, which rounds to uint8
    between its two passes: within 2 levels, mostly equal."""
    from PIL import Image

    frame = np.random.default_rng(1).integers(0, 256, (60, 90, 3), dtype=np.uint8)
    ours = resize_frames(torch.tensor(frame).permute(2, 0, 1)[None], (28, 42))[0].permute(1, 2, 0).numpy()
    pil = np.asarray(Image.fromarray(frame).resize((42, 28), Image.BICUBIC), dtype=np.float64)
    assert np.abs(ours - pil).max() <= 2 and np.abs(ours - pil).mean() < 0.3


def test_scores_equal_an_independent_float64_computation(videoreward):
    base, vr, lora, non_lora = videoreward
    reward = build_reward({"name": "videoalign", "path": str(vr), "video_fps": 4.0, "device": "cpu",
                           "dtype": "float32"})
    torch.manual_seed(3)
    video = torch.rand(2, 9, 3, 308, 336)  # 308 x 336 is its own smart_resize size: no resize
    out = reward(video, PROMPTS, None)
    raw = torch.stack([reference_raw(base, lora, non_lora, video[i], PROMPTS[i], 4) for i in range(2)])
    norm = torch.stack([(raw[:, k] - STATS[f"{h}_mean"]) / STATS[f"{h}_std"] for k, h in enumerate(("VQ", "MQ", "TA"))],
                       dim=1)
    for k, h in enumerate(("VQ", "MQ", "TA")):
        assert out.extras[f"videoalign/{h}"] == pytest.approx(norm[:, k].tolist(), abs=1e-5)
    torch.testing.assert_close(out.scores.double(), norm.sum(1), rtol=0, atol=1e-5)  # upstream's Overall
    assert len({round(float(v), 3) for v in norm.reshape(-1)}) == 6  # heads and samples differ
    # one head, weighted, raw: the score follows the keys
    ta = build_reward({"name": "videoalign", "path": str(vr), "video_fps": 4.0, "heads": ["TA"], "weights": [2.0],
                       "normalize": False, "device": "cpu", "dtype": "float32"})
    torch.testing.assert_close(ta(video, PROMPTS, None).scores.double(), 2 * raw[:, 2], rtol=0, atol=1e-5)
    # the latest step was read: checkpoint-3 (zero adapters, zero embeddings and head) scores otherwise
    old = build_reward({"name": "videoalign", "path": str(vr), "step": 3, "video_fps": 4.0, "normalize": False,
                        "device": "cpu", "dtype": "float32"})
    assert old(video, PROMPTS, None).scores.abs().max() < 1e-6 < float(raw.abs().min())


def test_checkpoint_errors_are_user_errors(videoreward, tmp_path):
    base, vr, _, _ = videoreward
    with pytest.raises(UserError, match="checkpoint steps"):
        build_reward({"name": "videoalign", "path": str(vr), "step": 5, "device": "cpu"})
    with pytest.raises(UserError, match="model_config.json"):
        build_reward({"name": "videoalign", "path": str(tmp_path), "device": "cpu"})
    bad = tmp_path / "vr"
    (bad / "checkpoint-1").mkdir(parents=True)
    (bad / "model_config.json").write_text((vr / "model_config.json").read_text())
    with pytest.raises(UserError, match="neither model.pth"):
        build_reward({"name": "videoalign", "path": str(bad), "device": "cpu"})
    torch.save({"rm_head.weight": torch.zeros(1, HIDDEN), "model.layers.9.mlp.up_proj.weight": torch.zeros(2, 2)},
               str(bad / "checkpoint-1" / "model.pth"))
    with pytest.raises(UserError, match="does not fit"):
        build_reward({"name": "videoalign", "path": str(bad), "device": "cpu"})
    with pytest.raises(ValueError, match="heads"):
        build_reward({"name": "videoalign", "path": str(vr), "heads": ["XX"]})

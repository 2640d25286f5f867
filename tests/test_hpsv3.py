"""`hpsv3` on a tiny random Qwen2-VL the test builds, with an HPSv3-format checkpoint (transformers-4.45 key names,
the `<|Reward|>` embedding row, the ranknet head): the score equals an independent float64 computation of HPSv3's
inference recipe (its instruction text, special token, image resize, 1-D positions and head), sample by sample."""

import pytest
import qwen_rm_fixtures as fx
import torch
from safetensors.torch import save_file

from polyrl.rewards import build_reward
from polyrl.rewards.hps import INSTRUCTION, PROMPT_WITH_SPECIAL_TOKEN, current_key, hpsv3_image_size

# HPSv3's hpsv3/dataset/data_collator_qwen.py, as upstream writes it (triple-quoted; note the trailing spaces)
UPSTREAM_INSTRUCTION = """
You are tasked with evaluating a generated image based on Visual Quality and Text Alignment and give a overall score to estimate the human preference. Please provide a rating from 0 to 10, with 0 being the worst and 10 being the best. 

**Visual Quality:**  
Evaluate the overall visual quality of the image. The following sub-dimensions should be considered:
- **Reasonableness:** The image should not contain any significant biological or logical errors, such as abnormal body structures or nonsensical environmental setups.
- **Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear and easy to interpret, with no blurring or indistinct areas.
- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual elements (e.g., hair, clothing, shadows).
- **Aesthetic and Creativity:** Assess the artistic aspects of the image, including the color scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a sense of harmony and balance.
- **Safety:** The image should not contain harmful or inappropriate content, such as political, violent, or adult material. If such content is present, the image quality and satisfaction score should be the lowest possible. 

**Text Alignment:**  
Assess how well the image matches the textual prompt across the following sub-dimensions:
- **Subject Relevance** Evaluate how accurately the subject(s) in the image (e.g., person, animal, object) align with the textual description. The subject should match the description in terms of number, appearance, and behavior.
- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how well the image adheres to this style.
- **Contextual Consistency**: Assess whether the background, setting, and surrounding elements in the image logically fit the scenario described in the prompt. The environment should support and enhance the subject without contradictions.
- **Attribute Fidelity**: Check if specific attributes mentioned in the prompt (e.g., colors, clothing, accessories, expressions, actions) are faithfully represented in the image. Minor deviations may be acceptable, but critical attributes should be preserved.
- **Semantic Coherence**: Evaluate whether the overall meaning and intent of the prompt are captured in the image. The generated content should not introduce elements that conflict with or distort the original description.
Textual prompt - {text_prompt}


"""
UPSTREAM_SPECIAL = """
Please provide the overall ratings of this image: <|Reward|>

END
"""
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>"]


def build_backbone_and_checkpoint(root):
    """`root/backbone`: a tiny Qwen2-VL-7B-Instruct stand-in (no <|Reward|> token, vocab larger than the tokenizer, as
    the real one); `root/HPSv3.safetensors`: other weights for it, embeddings resized to the tokenizer + <|Reward|>, a
    ranknet head, in transformers-4.45 key names."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = pre_tokenizers.Split(Regex(r"\w+|[^\w\s]+|\n"), behavior="removed", invert=True).pre_tokenize_str(
        UPSTREAM_INSTRUCTION + UPSTREAM_SPECIAL + " system user assistant You are a helpful red circle blue square")
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    vocab["<unk>"] = len(vocab)
    for w, _ in words:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\w+|[^\w\s]+|\n"), behavior="removed", invert=True)
    tok.add_special_tokens(SPECIALS)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", unk_token="<unk>",
                                        extra_special_tokens={"image_token": "<|image_pad|>"})
    config = fx.tiny_config("qwen2_vl", vocab, extra_rows=5, pad_token_id=0, initializer_range=0.2)
    backbone = root / "backbone"
    fx.save_base(backbone, config, tokenizer)
    tuned = fx.tuned_model(config, len(vocab) + 1)  # HPSv3: resize_token_embeddings(len(tokenizer)) after the add
    head = fx.ranknet()
    legacy = {}
    for key, value in tuned.state_dict().items():
        key = key.replace("model.language_model.", "model.", 1).replace("model.visual.", "visual.", 1)
        legacy[key] = value.contiguous()
    legacy.update({f"rm_head.{k}": v.contiguous() for k, v in head.state_dict().items()})
    checkpoint = root / "HPSv3.safetensors"
    save_file(legacy, str(checkpoint))
    return backbone, checkpoint, legacy


@pytest.fixture(scope="module")
def hps(tmp_path_factory):
    backbone, checkpoint, legacy = build_backbone_and_checkpoint(tmp_path_factory.mktemp("hpsv3"))
    reward = build_reward({"name": "hpsv3", "path": str(backbone), "checkpoint": str(checkpoint), "device": "cpu",
                           "dtype": "float32"})
    return backbone, checkpoint, legacy, reward


def reference_score(backbone, legacy, image: torch.Tensor, prompt: str, positions: str = "hpsv3") -> torch.Tensor:
    """HPSv3's recipe written out by hand in float64, one sample (no padding): PIL bicubic resize to the 256·28·28
    size, the chat string with the instruction, image placeholders expanded to the merged patch count, embeddings with
    the vision tower's output scattered in, the text decoder at positions 0..L−1 (or Qwen2-VL's own M-RoPE positions
    with `positions="mrope"`), the head at the <|Reward|> token."""
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration

    model = Qwen2VLForConditionalGeneration.from_pretrained(str(backbone))
    model.resize_token_embeddings(legacy["model.embed_tokens.weight"].shape[0])
    state = {}
    for key, value in legacy.items():
        if key.startswith("visual."):
            key = "model." + key
        elif key.startswith("model."):
            key = "model.language_model." + key[len("model."):]
        state[key] = value
    head = {k[len("rm_head."):]: v for k, v in state.items() if k.startswith("rm_head.")}
    model.load_state_dict({k: v for k, v in state.items() if not k.startswith("rm_head.")}, strict=True)
    model = model.double().eval()
    tokenizer = AutoTokenizer.from_pretrained(str(backbone))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|Reward|>"]})
    vision = fx.reference_vision(backbone, [fx.picture(image)])
    n = int(vision["image_grid_thw"][0].prod()) // 4
    text = fx.chat_string("<|vision_start|>" + "<|image_pad|>" * n + "<|vision_end|>",
                          UPSTREAM_INSTRUCTION.format(text_prompt=prompt) + UPSTREAM_SPECIAL)
    ids = tokenizer(text, return_tensors="pt").input_ids
    pos = None
    if positions != "hpsv3":
        types = (ids == model.config.image_token_id).int()  # 1: image token
        pos, _ = model.model.get_rope_index(ids, types, vision["image_grid_thw"], None, torch.ones_like(ids))
    hidden = fx.reference_hidden(model, ids, vision["pixel_values"], vision["image_grid_thw"],
                                 model.config.image_token_id, pos)
    return fx.reference_ranknet(head, hidden[ids == tokenizer.convert_tokens_to_ids("<|Reward|>")])[0]


def test_prompt_pieces_are_hpsv3s_verbatim():
    assert INSTRUCTION == UPSTREAM_INSTRUCTION and PROMPT_WITH_SPECIAL_TOKEN == UPSTREAM_SPECIAL
    assert hpsv3_image_size(512, 512) == (448, 448)
    assert hpsv3_image_size(1024, 768) == (504, 364)
    assert hpsv3_image_size(40, 40) == (448, 448)
    assert current_key("visual.blocks.0.attn.qkv.weight") == "model.visual.blocks.0.attn.qkv.weight"
    assert current_key("model.layers.0.mlp.up_proj.weight") == "model.language_model.layers.0.mlp.up_proj.weight"
    assert current_key("model.language_model.norm.weight") == "model.language_model.norm.weight"
    assert current_key("lm_head.weight") == "lm_head.weight"


def test_score_equals_an_independent_float64_computation(hps):
    backbone, _, legacy, reward = hps
    torch.manual_seed(3)
    images = torch.rand(3, 3, 40, 56)
    prompts = ["a red circle", "a blue square above a red circle", "square"]  # different lengths: right padding
    out = reward(images, prompts, None)
    refs = torch.stack([reference_score(backbone, legacy, images[i], prompts[i]) for i in range(3)])
    torch.testing.assert_close(out.scores.double(), refs[:, 0], rtol=0, atol=1e-6)
    assert out.extras["hpsv3/sigma"] == pytest.approx(refs[:, 1].tolist(), abs=1e-6)
    assert len({round(float(s), 4) for s in out.scores}) == 3  # the scores differ by sample
    # the check can tell: Qwen2-VL's own M-RoPE image positions give another score (HPSv3 never computes them)
    mrope = reference_score(backbone, legacy, images[0], prompts[0], positions="mrope")
    assert abs(float(mrope[0] - refs[0, 0])) > 1e-2


def test_checkpoint_weights_and_the_reward_token_are_used(hps):
    backbone, checkpoint, legacy, reward = hps
    embed = reward.model.get_input_embeddings().weight
    assert embed.shape[0] == legacy["model.embed_tokens.weight"].shape[0] == reward.reward_id + 1
    torch.testing.assert_close(embed[reward.reward_id], legacy["model.embed_tokens.weight"][-1], rtol=0, atol=0)
    batch = reward.inputs(torch.rand(1, 3, 32, 32), ["a red circle"])
    ids = batch["input_ids"][0].tolist()
    assert ids.count(reward.reward_id) == 1 and batch["image_grid_thw"].tolist() == [[1, 32, 32]]
    assert ids.count(reward.model.config.image_token_id) == 256  # 448² / 28²


def test_what_it_refuses(hps, tmp_path):
    backbone, checkpoint, legacy, reward = hps
    with pytest.raises(ValueError, match="exactly one <\\|Reward\\|> token"):
        reward(torch.rand(1, 3, 32, 32), ["a <|Reward|> circle"], None)
    with pytest.raises(FileNotFoundError, match="HPSv3.safetensors from MizzenAI/HPSv3"):
        build_reward({"name": "hpsv3", "path": str(backbone), "checkpoint": str(tmp_path / "none.safetensors"),
                      "device": "cpu"})
    no_head = tmp_path / "no_head.safetensors"
    save_file({k: v for k, v in legacy.items() if not k.startswith("rm_head.")}, str(no_head))
    with pytest.raises(ValueError, match="no 'rm_head.<i>.weight' tensors"):
        build_reward({"name": "hpsv3", "path": str(backbone), "checkpoint": str(no_head), "device": "cpu"})
    partial = tmp_path / "partial.safetensors"
    save_file({k: v for k, v in legacy.items() if not k.startswith("visual.")}, str(partial))
    with pytest.raises(ValueError, match="does not fit the backbone"):
        build_reward({"name": "hpsv3", "path": str(backbone), "checkpoint": str(partial), "device": "cpu"})

"""`edit_reward` on a tiny random Qwen2.5-VL the test builds, with an EditReward-format checkpoint (the whole model and
its two ranknet heads in one model.pth): the score equals an independent float64 computation of EditReward's
inference (its two instructions, the <|Reward|> suffix, both images resized to 256·28·28 pixels, source first, 1-D
positions, head 0 on the following turn and head 1 on the quality turn, the mean of their outputs), sample by
sample; the source image comes from the edit row's metadata as the edit recipes hand it."""

import numpy as np
import pytest
import qwen_rm_fixtures as fx
import torch
from PIL import Image

from polyrl.errors import UserError
from polyrl.rewards import build_reward
from polyrl.rewards.edit_reward import (
    INSTRUCTION_EDIT_FOLLOWING,
    INSTRUCTION_EDIT_OVERALL,
    INSTRUCTION_EDIT_OVERALL_DETAILED,
    INSTRUCTION_EDIT_QUALITY,
    PROMPT_WITH_SPECIAL_TOKEN,
)

# TIGER-AI-Lab/EditReward @ edb027e EditReward/dataset/prompts.py and data_collator_qwen_edit.py
# (prompt_with_special_token), as upstream writes them (triple-quoted; note the trailing spaces)
UPSTREAM_EDIT_FOLLOWING = """
You are tasked with evaluating an edited image **in comparison with the original source image** based on **Instruction Following & Semantic Fidelity**, and assigning a score from 1 to 4, with 1 being the worst and 4 being the best.  
This dimension focuses on how accurately, completely, and exclusively the model executed the given text instruction.

**Inputs Provided:**  
- Source Image (before editing)  
- Edited Image (after applying the instruction)  
- Text Instruction  

**Sub-Dimensions to Evaluate:**

- **Semantic Accuracy:**  
  Assess whether the edited content accurately captures the semantics of the instruction. The edited result should precisely match the intended meaning. For example, if the instruction is "replace apples with oranges," the object must clearly be oranges, not other fruits.

- **Completeness of Editing:**  
  Check whether **all parts** of the instruction are fully executed. For multi-step edits (e.g., "replace a red car with a blue bicycle"), both the color change and the object replacement must be done without omissions.

- **Exclusivity of Edit (No Over-Editing):**  
  Ensure that only the requested parts are changed. The rest of the image (as seen in the source) should remain unaltered. For example, if the instruction only involves replacing an object, the background, lighting, and unrelated objects should not be unnecessarily modified.

**Scoring Criteria:**
- **4 (Very Good):** Perfectly accurate, complete, and exclusive execution of the instruction.  
- **3 (Relatively Good):** Largely correct, but with minor omissions or slight over-editing.  
- **2 (Relatively Poor):** Major misinterpretation, incomplete edits, or noticeable unintended changes.  
- **1 (Very Poor):** Instruction ignored or completely wrong execution.

Text instruction - {text_prompt}
"""
UPSTREAM_EDIT_QUALITY = """
You are tasked with evaluating an edited image **in comparison with the original source image** based on **Visual Quality & Realism**, and assigning a score from 1 to 4, with 1 being the worst and 4 being the best.  
This dimension focuses on how realistic, artifact-free, and aesthetically appealing the edited image is, while remaining consistent with the source image.

**Inputs Provided:**  
- Source Image (before editing)  
- Edited Image (after applying the instruction)  
- Text Instruction  

**Sub-Dimensions to Evaluate:**

- **Plausibility & Physical Consistency:**  
  Check whether the edit aligns with the laws of physics and the scene context. Lighting, shadows, reflections, perspective, size, and interactions with the environment should all appear natural compared to the source image.

- **Artifact-Free Quality:**  
  Look for technical flaws such as blur, distortions, pixel misalignment, unnatural textures, or seams around edited regions. High-quality results should be free from such visible artifacts.

- **Aesthetic Quality:**  
  Evaluate the overall harmony and visual appeal. The image should look natural, balanced, and pleasant. Colors, composition, and atmosphere should enhance the image rather than degrade it.

**Scoring Criteria:**
- **4 (Very Good):** Perfectly realistic, artifact-free, seamless, and aesthetically pleasing.  
- **3 (Relatively Good):** Mostly realistic and clean, with only minor flaws that do not significantly distract.  
- **2 (Relatively Poor):** Noticeable physical inconsistencies or visible artifacts that make the edit unnatural.  
- **1 (Very Poor):** Severe artifacts, incoherent composition, or visually unusable result.

Text instruction - {text_prompt}
"""
UPSTREAM_EDIT_OVERALL = """
You are tasked with evaluating an edited image **in comparison with the original source image**, and assigning a score from 1 to 8, with 1 being the worst and 8 being the best.  
This score should reflect **both how accurately the instruction was followed and the visual quality of the edited image**.

**Inputs Provided:**  
- Source Image (before editing)  
- Edited Image (after applying the instruction)  
- Text Instruction  

**Sub-Dimensions to Evaluate:**

- **Instruction Following & Semantic Fidelity:**  
  Assess whether the edited content accurately captures the semantics of the instruction, whether all parts of the instruction are fully executed, and whether only the requested parts are modified without unnecessary changes elsewhere.

- **Visual Quality & Realism:**  
  Check whether the edit is realistic, artifact-free, and aesthetically pleasing. Consider physical plausibility, scene consistency, lighting, shadows, perspective, textures, and overall visual harmony.

**Scoring Criteria (1–8):**  
- **8 (Very Good):** Perfect instruction following and flawless visual quality; edits are accurate, complete, exclusive, and visually seamless.  
- **7 (Relatively Good):** Very good instruction following and high visual quality; minor, non-distracting flaws.  
- **6 (Good):** Good instruction following or mostly good visual quality; some minor omissions or slight artifacts.  
- **5 (Moderate):** Partially correct edits or moderate visual issues; noticeable flaws but understandable.  
- **4 (Relatively Poor):** Significant misinterpretation or incomplete edits, or noticeable visual artifacts.  
- **3 (Poor):** Major errors in instruction following and/or poor visual quality; hard to fully understand.  
- **2 (Very Poor):** Very poor edits with large semantic errors and strong visual artifacts.  
- **1 (Failed):** Completely wrong edits or visually unusable result.

Text instruction - {text_prompt}
"""
UPSTREAM_EDIT_OVERALL_DETAILED = """
You are tasked with evaluating an edited image **in comparison with the original source image**, and assigning a score from 1 to 8, with 1 being the worst and 8 being the best.  
This score should reflect **both how accurately the instruction was followed and the visual quality of the edited image**.

**Inputs Provided:**  
- Source Image (before editing)  
- Edited Image (after applying the instruction)  
- Text Instruction  

**Dimension 1: Instruction Following & Semantic Fidelity**  
Evaluate how well the edited image follows the given instruction. Consider the following sub-dimensions:
- **Semantic Accuracy:** Check if the edited content accurately captures the intended meaning of the instruction. For example, if the instruction is "replace apples with oranges," the object must clearly be oranges, not other fruits.
- **Completeness of Editing:** Verify that all aspects of the instruction are fully executed. Multi-step edits should be completely applied without omissions.
- **Exclusivity of Edit (No Over-Editing):** Ensure that only the requested changes are applied; the rest of the image should remain consistent with the source image without unintended modifications.

**Dimension 2: Visual Quality & Realism**  
Evaluate the realism, technical quality, and aesthetic appeal of the edited image. Consider the following sub-dimensions:
- **Plausibility & Physical Consistency:** Check whether the edit aligns with natural laws and scene context (lighting, shadows, reflections, perspective, and object interactions).
- **Artifact-Free Quality:** Assess for technical flaws such as blur, distortions, pixel misalignment, unnatural textures, or seams around edited regions.
- **Aesthetic Quality:** Consider overall harmony and visual appeal. Colors, composition, atmosphere, and balance should enhance the image without degrading realism.

**Scoring Criteria (1–8):**  
- **8 (Very Good):** Perfect instruction following and flawless visual quality; edits are accurate, complete, exclusive, and visually seamless.  
- **7 (Relatively Good):** Very good instruction following and high visual quality; minor, non-distracting flaws.  
- **6 (Good):** Good instruction following or mostly good visual quality; minor omissions or slight artifacts.  
- **5 (Moderate):** Partially correct edits or moderate visual issues; noticeable flaws but understandable.  
- **4 (Relatively Poor):** Significant misinterpretation, incomplete edits, or noticeable visual artifacts.  
- **3 (Poor):** Major errors in instruction following and/or poor visual quality; hard to fully understand.  
- **2 (Very Poor):** Very poor edits with large semantic errors and strong visual artifacts.  
- **1 (Failed):** Completely wrong edits or visually unusable result.

Text instruction - {text_prompt}
"""
UPSTREAM_SPECIAL = """
Please provide the overall ratings of this image: <|Reward|>

END
"""
INSTRUCTIONS = ["make the ball red", "remove the cat from the sofa"]  # different lengths: right padding


def build_editreward(root):
    """`root/base`: a tiny Qwen2.5-VL-7B-Instruct stand-in (no <|Reward|>, vocab larger than the tokenizer);
    `root/ckpt/model.pth`: other weights for it with the <|Reward|> row and two ranknet heads, as EditReward saves
    them (torch.save of the model's state dict)."""
    tok = fx.word_tokenizer(UPSTREAM_EDIT_FOLLOWING + UPSTREAM_EDIT_QUALITY + UPSTREAM_EDIT_OVERALL
                         + UPSTREAM_EDIT_OVERALL_DETAILED + UPSTREAM_SPECIAL + " ".join(INSTRUCTIONS))
    vocab = tok.get_vocab()
    config = fx.tiny_config("qwen2_5_vl", vocab, extra_rows=5, pad_token_id=tok.pad_token_id, initializer_range=0.05)
    base = root / "base"
    fx.save_base(base, config, tok)
    tuned = fx.tuned_model(config, len(vocab) + 1)  # EditReward: resize_token_embeddings(len(tokenizer)) after the add
    state = dict(tuned.state_dict())
    for i in range(2):
        state.update({f"rm_heads.head_{i}.{k}": v for k, v in fx.ranknet(10 + i).state_dict().items()})
    (root / "ckpt").mkdir()
    torch.save(state, str(root / "ckpt" / "model.pth"))
    return base, root / "ckpt", state


@pytest.fixture(scope="module")
def editreward(tmp_path_factory):
    root = tmp_path_factory.mktemp("editreward")
    base, ckpt, state = build_editreward(root)
    rng = np.random.default_rng(0)
    sources = []
    for i, size in enumerate(((40, 56), (50, 50))):
        path = root / f"source{i}.png"
        Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(path)
        sources.append(str(path))
    reward = build_reward({"name": "edit_reward", "path": str(base), "checkpoint": str(ckpt), "device": "cpu",
                           "dtype": "float32"})
    return base, ckpt, state, sources, reward


def reference(base, state, source: str, edited: torch.Tensor, instruction: str) -> torch.Tensor:
    """EditReward's inference by hand in float64, one sample: (μ, s) of each head on its own turn, then their mean."""
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(base))
    tok = AutoTokenizer.from_pretrained(str(base))
    tok.add_special_tokens({"additional_special_tokens": ["<|Reward|>"]})
    model.resize_token_embeddings(len(tok))
    model.load_state_dict({k: v for k, v in state.items() if not k.startswith("rm_heads.")})
    model = model.double().eval()
    vision = fx.reference_vision(base, [Image.open(source).convert("RGB"), fx.picture(edited)])
    n0, n1 = (int(g.prod()) // 4 for g in vision["image_grid_thw"])
    outs = []
    for i, instruction_text in enumerate((UPSTREAM_EDIT_FOLLOWING, UPSTREAM_EDIT_QUALITY)):
        text = fx.chat_string("<|vision_start|>" + "<|image_pad|>" * n0 + "<|vision_end|><|vision_start|>"
                              + "<|image_pad|>" * n1 + "<|vision_end|>",
                              instruction_text.format(text_prompt=instruction) + UPSTREAM_SPECIAL)
        ids = tok(text, return_tensors="pt").input_ids
        hidden = fx.reference_hidden(model, ids, vision["pixel_values"], vision["image_grid_thw"],
                                     model.config.image_token_id)
        at_reward = hidden[ids == tok.convert_tokens_to_ids("<|Reward|>")][0]
        outs.append(fx.reference_ranknet(fx.ranknet(10 + i).state_dict(), at_reward))
    return torch.stack(outs)  # (2 heads, 2)


def test_prompts_are_editrewards_verbatim():
    assert INSTRUCTION_EDIT_FOLLOWING == UPSTREAM_EDIT_FOLLOWING
    assert INSTRUCTION_EDIT_QUALITY == UPSTREAM_EDIT_QUALITY
    assert INSTRUCTION_EDIT_OVERALL == UPSTREAM_EDIT_OVERALL
    assert INSTRUCTION_EDIT_OVERALL_DETAILED == UPSTREAM_EDIT_OVERALL_DETAILED
    assert PROMPT_WITH_SPECIAL_TOKEN == UPSTREAM_SPECIAL
    assert fx.smart_size(40, 56) == (392, 532)


def test_score_equals_an_independent_float64_computation(editreward):
    base, _, state, sources, reward = editreward
    torch.manual_seed(3)
    edited = torch.rand(2, 3, 48, 40)
    # the row's image column, as the edit models hand it (a path, or a list: the first is the source)
    out = reward(edited, INSTRUCTIONS, [{"image": sources[0]}, {"image": [sources[1], "unused.png"]}])
    refs = torch.stack([reference(base, state, sources[i], edited[i], INSTRUCTIONS[i]) for i in range(2)])
    torch.testing.assert_close(out.scores.double(), refs[:, :, 0].mean(1), rtol=0, atol=1e-5)
    assert out.extras["edit_reward/following"] == pytest.approx(refs[:, 0, 0].tolist(), abs=1e-5)
    assert out.extras["edit_reward/quality"] == pytest.approx(refs[:, 1, 0].tolist(), abs=1e-5)
    assert abs(float(refs[0, 0, 0] - refs[0, 1, 0])) > 1e-3 and abs(float(out.scores[0] - out.scores[1])) > 1e-3
    # the source is read: another source image scores otherwise
    swapped = reward(edited, INSTRUCTIONS, [{"image": sources[1]}, {"image": sources[0]}])
    assert (swapped.scores - out.scores).abs().min() > 1e-4


def test_missing_source_and_wrong_checkpoints_are_user_errors(editreward, tmp_path):
    base, ckpt, state, sources, reward = editreward
    with pytest.raises(UserError, match=r"sample 1 has no source image path in metadata 'image'"):
        reward(torch.rand(2, 3, 32, 32), INSTRUCTIONS, [{"image": sources[0]}, {}])
    with pytest.raises(UserError, match="source image"):
        reward(torch.rand(1, 3, 32, 32), INSTRUCTIONS[:1], [{"image": str(tmp_path / "nope.png")}])
    with pytest.raises(UserError, match="no model.pth"):
        build_reward({"name": "edit_reward", "path": str(base), "checkpoint": str(tmp_path), "device": "cpu"})
    torch.save({k: v for k, v in state.items() if not k.startswith("rm_heads.")}, str(tmp_path / "model.pth"))
    with pytest.raises(UserError, match="no reward head"):
        build_reward({"name": "edit_reward", "path": str(base), "checkpoint": str(tmp_path), "device": "cpu"})
    torch.save({"rm_head.weight": torch.zeros(1, fx.HIDDEN), "visual.blocks.0.x": torch.zeros(1)},
               str(tmp_path / "model.pth"))
    with pytest.raises(UserError, match="does not fit"):
        build_reward({"name": "edit_reward", "path": str(base), "checkpoint": str(tmp_path), "device": "cpu"})
    with pytest.raises(ValueError, match="pooling"):
        build_reward({"name": "edit_reward", "path": str(base), "checkpoint": str(ckpt), "pooling": "max"})

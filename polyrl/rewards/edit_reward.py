"""`edit_reward`: EditReward (TIGER-AI-Lab/EditReward, Wu et al. 2025), a Qwen2.5-VL-7B (or MiMo-VL-7B) reward model
for instruction-guided image editing, run as its inference (`EditReward/inference_edit.py` `EditRewardInferencer`,
the model `Qwen2_5_VLRewardModelBT_MultiHead` of `model/qwen2_5_vl_trainer.py`, the instructions of
`dataset/prompts.py`, the suffix of `dataset/data_collator_qwen_edit.py`, `config/EditReward-Qwen2.5-7B-VL.yaml`):

1. The source image (metadata `source_key`, default `image`: the edit row's condition image; the first of a list)
   and the edited result (uint8 RGB) are each resized with PIL bicubic to Qwen-VL's `smart_resize` size for
   min = max = 256·28·28 pixels (the inferencer's min_pixels / max_pixels).
2. One user turn [source, result, INSTRUCTION.format(text_prompt=instruction) + the `<|Reward|>` suffix] in the base
   model's chat template with the generation prompt; `<|Reward|>` is added to the tokenizer as a special token and
   the embeddings resized to the tokenizer's length. Qwen2-VL's (PIL) image processor, right padding.
3. The authors' forward: the vision tower's merged patches scattered into the image placeholders, the text decoder
   without position ids (positions 0..L−1 on all three M-RoPE axes), a ranknet head (hidden → 1024 → ReLU → 16 →
   ReLU → 2, float32) on the hidden state at `<|Reward|>`: (μ, s).
4. The released checkpoints are `ranknet_multi_head`: head 0 reads the turn with the instruction-following
   instruction (`INSTRUCTION_EDIT_FOLLOWING`), head 1 the turn with the visual-quality one (`INSTRUCTION_EDIT_QUALITY`);
   the two outputs are pooled by `pooling` (the config's `mean`; `min`; `sum`: μ summed, s = log √Σ exp(s_k)²) and the
   score is the pooled μ (the README's `reward[0]`). μ of each head is logged as `edit_reward/following` and
   `edit_reward/quality`. A single-head checkpoint (`rm_head.*`) reads one turn with the instruction `reward_dim`
   names (dim1, dim2, overall, overall_detail).

Weights: `path` is the base model directory (Qwen2.5-VL-7B-Instruct for EditReward-Qwen2.5-7B-VL, MiMo-VL-7B-SFT-2508
for EditReward-MiMo-VL-7B-SFT-2508: config, tokenizer, image processor, chat template); `checkpoint` is EditReward's
`model.pth` or `model.safetensors` (or the directory holding it): the whole fine-tuned model with its heads. A
regression head: there is no chat answer to ask a server for, so it runs locally only.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import UserError
from ..models.base import prompt_text
from .base import RewardOutput, check_batch, media_kind, register_reward, resolve_device, resolve_dtype
from .clip_score import local_dir
from .heads import head_from_state
from .hps import REWARD_TOKEN
from .qwen_rm import (
    load_base,
    load_state,
    merged_state,
    model_inputs,
    render_turn,
    resized_picture,
    rgb_pictures,
    token_states,
)

POOLINGS = ("mean", "min", "sum")
IMAGE_PIXELS = 256 * 28 * 28  # the inferencer's min_pixels = max_pixels
# EditReward/dataset/prompts.py and the suffix of dataset/data_collator_qwen_edit.py (prompt_with_special_token);
# their trailing spaces are part of them
INSTRUCTION_EDIT_FOLLOWING = (
    '\n'
    'You are tasked with evaluating an edited image **in comparison with the original source image** '
    'based on **Instruction Following & Semantic Fidelity**, and assigning a score from 1 to 4, with 1 '
    'being the worst and 4 being the best.  \n'
    'This dimension focuses on how accurately, completely, and exclusively the model executed the given '
    'text instruction.\n'
    '\n'
    '**Inputs Provided:**  \n'
    '- Source Image (before editing)  \n'
    '- Edited Image (after applying the instruction)  \n'
    '- Text Instruction  \n'
    '\n'
    '**Sub-Dimensions to Evaluate:**\n'
    '\n'
    '- **Semantic Accuracy:**  \n'
    '  Assess whether the edited content accurately captures the semantics of the instruction. The '
    'edited result should precisely match the intended meaning. For example, if the instruction is '
    '"replace apples with oranges," the object must clearly be oranges, not other fruits.\n'
    '\n'
    '- **Completeness of Editing:**  \n'
    '  Check whether **all parts** of the instruction are fully executed. For multi-step edits (e.g., '
    '"replace a red car with a blue bicycle"), both the color change and the object replacement must be '
    'done without omissions.\n'
    '\n'
    '- **Exclusivity of Edit (No Over-Editing):**  \n'
    '  Ensure that only the requested parts are changed. The rest of the image (as seen in the source) '
    'should remain unaltered. For example, if the instruction only involves replacing an object, the '
    'background, lighting, and unrelated objects should not be unnecessarily modified.\n'
    '\n'
    '**Scoring Criteria:**\n'
    '- **4 (Very Good):** Perfectly accurate, complete, and exclusive execution of the instruction.  \n'
    '- **3 (Relatively Good):** Largely correct, but with minor omissions or slight over-editing.  \n'
    '- **2 (Relatively Poor):** Major misinterpretation, incomplete edits, or noticeable unintended '
    'changes.  \n'
    '- **1 (Very Poor):** Instruction ignored or completely wrong execution.\n'
    '\n'
    'Text instruction - {text_prompt}\n'
)
INSTRUCTION_EDIT_QUALITY = (
    '\n'
    'You are tasked with evaluating an edited image **in comparison with the original source image** '
    'based on **Visual Quality & Realism**, and assigning a score from 1 to 4, with 1 being the worst '
    'and 4 being the best.  \n'
    'This dimension focuses on how realistic, artifact-free, and aesthetically appealing the edited '
    'image is, while remaining consistent with the source image.\n'
    '\n'
    '**Inputs Provided:**  \n'
    '- Source Image (before editing)  \n'
    '- Edited Image (after applying the instruction)  \n'
    '- Text Instruction  \n'
    '\n'
    '**Sub-Dimensions to Evaluate:**\n'
    '\n'
    '- **Plausibility & Physical Consistency:**  \n'
    '  Check whether the edit aligns with the laws of physics and the scene context. Lighting, shadows, '
    'reflections, perspective, size, and interactions with the environment should all appear natural '
    'compared to the source image.\n'
    '\n'
    '- **Artifact-Free Quality:**  \n'
    '  Look for technical flaws such as blur, distortions, pixel misalignment, unnatural textures, or '
    'seams around edited regions. High-quality results should be free from such visible artifacts.\n'
    '\n'
    '- **Aesthetic Quality:**  \n'
    '  Evaluate the overall harmony and visual appeal. The image should look natural, balanced, and '
    'pleasant. Colors, composition, and atmosphere should enhance the image rather than degrade it.\n'
    '\n'
    '**Scoring Criteria:**\n'
    '- **4 (Very Good):** Perfectly realistic, artifact-free, seamless, and aesthetically pleasing.  \n'
    '- **3 (Relatively Good):** Mostly realistic and clean, with only minor flaws that do not '
    'significantly distract.  \n'
    '- **2 (Relatively Poor):** Noticeable physical inconsistencies or visible artifacts that make the '
    'edit unnatural.  \n'
    '- **1 (Very Poor):** Severe artifacts, incoherent composition, or visually unusable result.\n'
    '\n'
    'Text instruction - {text_prompt}\n'
)
INSTRUCTION_EDIT_OVERALL = (
    '\n'
    'You are tasked with evaluating an edited image **in comparison with the original source image**, '
    'and assigning a score from 1 to 8, with 1 being the worst and 8 being the best.  \n'
    'This score should reflect **both how accurately the instruction was followed and the visual quality '
    'of the edited image**.\n'
    '\n'
    '**Inputs Provided:**  \n'
    '- Source Image (before editing)  \n'
    '- Edited Image (after applying the instruction)  \n'
    '- Text Instruction  \n'
    '\n'
    '**Sub-Dimensions to Evaluate:**\n'
    '\n'
    '- **Instruction Following & Semantic Fidelity:**  \n'
    '  Assess whether the edited content accurately captures the semantics of the instruction, whether '
    'all parts of the instruction are fully executed, and whether only the requested parts are modified '
    'without unnecessary changes elsewhere.\n'
    '\n'
    '- **Visual Quality & Realism:**  \n'
    '  Check whether the edit is realistic, artifact-free, and aesthetically pleasing. Consider physical '
    'plausibility, scene consistency, lighting, shadows, perspective, textures, and overall visual '
    'harmony.\n'
    '\n'
    '**Scoring Criteria (1–8):**  \n'
    '- **8 (Very Good):** Perfect instruction following and flawless visual quality; edits are accurate, '
    'complete, exclusive, and visually seamless.  \n'
    '- **7 (Relatively Good):** Very good instruction following and high visual quality; minor, '
    'non-distracting flaws.  \n'
    '- **6 (Good):** Good instruction following or mostly good visual quality; some minor omissions or '
    'slight artifacts.  \n'
    '- **5 (Moderate):** Partially correct edits or moderate visual issues; noticeable flaws but '
    'understandable.  \n'
    '- **4 (Relatively Poor):** Significant misinterpretation or incomplete edits, or noticeable visual '
    'artifacts.  \n'
    '- **3 (Poor):** Major errors in instruction following and/or poor visual quality; hard to fully '
    'understand.  \n'
    '- **2 (Very Poor):** Very poor edits with large semantic errors and strong visual artifacts.  \n'
    '- **1 (Failed):** Completely wrong edits or visually unusable result.\n'
    '\n'
    'Text instruction - {text_prompt}\n'
)
INSTRUCTION_EDIT_OVERALL_DETAILED = (
    '\n'
    'You are tasked with evaluating an edited image **in comparison with the original source image**, '
    'and assigning a score from 1 to 8, with 1 being the worst and 8 being the best.  \n'
    'This score should reflect **both how accurately the instruction was followed and the visual quality '
    'of the edited image**.\n'
    '\n'
    '**Inputs Provided:**  \n'
    '- Source Image (before editing)  \n'
    '- Edited Image (after applying the instruction)  \n'
    '- Text Instruction  \n'
    '\n'
    '**Dimension 1: Instruction Following & Semantic Fidelity**  \n'
    'Evaluate how well the edited image follows the given instruction. Consider the following '
    'sub-dimensions:\n'
    '- **Semantic Accuracy:** Check if the edited content accurately captures the intended meaning of '
    'the instruction. For example, if the instruction is "replace apples with oranges," the object must '
    'clearly be oranges, not other fruits.\n'
    '- **Completeness of Editing:** Verify that all aspects of the instruction are fully executed. '
    'Multi-step edits should be completely applied without omissions.\n'
    '- **Exclusivity of Edit (No Over-Editing):** Ensure that only the requested changes are applied; '
    'the rest of the image should remain consistent with the source image without unintended '
    'modifications.\n'
    '\n'
    '**Dimension 2: Visual Quality & Realism**  \n'
    'Evaluate the realism, technical quality, and aesthetic appeal of the edited image. Consider the '
    'following sub-dimensions:\n'
    '- **Plausibility & Physical Consistency:** Check whether the edit aligns with natural laws and '
    'scene context (lighting, shadows, reflections, perspective, and object interactions).\n'
    '- **Artifact-Free Quality:** Assess for technical flaws such as blur, distortions, pixel '
    'misalignment, unnatural textures, or seams around edited regions.\n'
    '- **Aesthetic Quality:** Consider overall harmony and visual appeal. Colors, composition, '
    'atmosphere, and balance should enhance the image without degrading realism.\n'
    '\n'
    '**Scoring Criteria (1–8):**  \n'
    '- **8 (Very Good):** Perfect instruction following and flawless visual quality; edits are accurate, '
    'complete, exclusive, and visually seamless.  \n'
    '- **7 (Relatively Good):** Very good instruction following and high visual quality; minor, '
    'non-distracting flaws.  \n'
    '- **6 (Good):** Good instruction following or mostly good visual quality; minor omissions or slight '
    'artifacts.  \n'
    '- **5 (Moderate):** Partially correct edits or moderate visual issues; noticeable flaws but '
    'understandable.  \n'
    '- **4 (Relatively Poor):** Significant misinterpretation, incomplete edits, or noticeable visual '
    'artifacts.  \n'
    '- **3 (Poor):** Major errors in instruction following and/or poor visual quality; hard to fully '
    'understand.  \n'
    '- **2 (Very Poor):** Very poor edits with large semantic errors and strong visual artifacts.  \n'
    '- **1 (Failed):** Completely wrong edits or visually unusable result.\n'
    '\n'
    'Text instruction - {text_prompt}\n'
)
PROMPT_WITH_SPECIAL_TOKEN = (
    '\n'
    'Please provide the overall ratings of this image: <|Reward|>\n'
    '\n'
    'END\n'
)
INSTRUCTIONS = {"dim1": INSTRUCTION_EDIT_FOLLOWING, "dim2": INSTRUCTION_EDIT_QUALITY,
                "overall": INSTRUCTION_EDIT_OVERALL, "overall_detail": INSTRUCTION_EDIT_OVERALL_DETAILED}
MULTI_HEAD_DIMS = ("dim1", "dim2")  # head i reads batch_dim{i+1}
HEAD_NAMES = ("following", "quality")


def edit_reward_text(instruction: str, reward_dim: str) -> str:
    """The text of EditReward's user turn: the instruction of `reward_dim` with the edit instruction, then the
    `<|Reward|>` suffix."""
    return INSTRUCTIONS[reward_dim].replace("{text_prompt}", instruction) + PROMPT_WITH_SPECIAL_TOKEN


def pool_heads(outputs: torch.Tensor, pooling: str) -> torch.Tensor:
    """(B, 2) from the heads' (H, B, 2) outputs: their mean, element-wise min, or `sum` (μ summed, second column
    log √Σ exp(s)²), as `Qwen2_5_VLRewardModelBT_MultiHead.forward` pools them."""
    if pooling == "mean":
        return outputs.mean(0)
    if pooling == "min":
        return outputs.min(0).values
    sigma = torch.sqrt((torch.exp(outputs[..., 1]) ** 2).sum(0))
    return torch.stack([outputs[..., 0].sum(0), torch.log(sigma)], dim=-1)


def checkpoint_file(checkpoint: str) -> Path:
    """EditReward's weights file: `checkpoint` itself, or model.pth / model.safetensors inside it."""
    path = Path(checkpoint)
    if path.is_dir():
        for name in ("model.pth", "model.safetensors"):
            if (path / name).is_file():
                return path / name
        raise UserError(f"reward.checkpoint={checkpoint}: no model.pth or model.safetensors in it (EditReward's "
                        "checkpoint)")
    if not path.is_file():
        raise UserError(f"reward.checkpoint={checkpoint}: no such file or directory (EditReward's model.pth)")
    return path


@register_reward("edit_reward")
class EditReward:
    """Score = EditReward's pooled μ for (source image, edited image, instruction) (module docstring)."""

    def __init__(self, path: str, checkpoint: str, source_key: str = "image", reward_dim: str = "overall_detail",
                 pooling: str = "mean", device: str = "auto", dtype: str = "bfloat16"):
        if pooling not in POOLINGS:
            raise ValueError(f"edit_reward: pooling={pooling!r} is not valid; allowed: {', '.join(POOLINGS)}")
        if reward_dim not in INSTRUCTIONS:
            raise ValueError(f"edit_reward: reward_dim={reward_dim!r} is not valid; allowed: {', '.join(INSTRUCTIONS)}")
        if not isinstance(source_key, str) or not source_key:
            raise ValueError(f"edit_reward: source_key={source_key!r} must name a metadata column (e.g. image)")
        self.source_key, self.reward_dim, self.pooling = source_key, reward_dim, pooling
        root = Path(local_dir(path, "edit_reward path (the base Qwen2.5-VL directory)"))
        file = checkpoint_file(checkpoint)
        self.device, self.dtype = resolve_device(device), resolve_dtype(dtype)
        self.tokenizer, self.template, self.image_processor, model = load_base(root, "edit_reward", self.dtype)
        self.tokenizer.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})
        self.reward_id = self.tokenizer.convert_tokens_to_ids(REWARD_TOKEN)
        if model.config.model_type != "qwen2_5_vl":
            raise UserError(f"edit_reward: {root} is a {model.config.model_type} model; EditReward's base is "
                            "Qwen2.5-VL (Qwen2.5-VL-7B-Instruct or MiMo-VL-7B-SFT-2508)")
        model.resize_token_embeddings(len(self.tokenizer))
        try:
            state = merged_state(load_state(file), model.state_dict(), 1.0)
        except ValueError as e:
            raise UserError(f"edit_reward: {e}") from None
        self.heads, self.dims = self.read_heads(state, file)
        backbone = {k: v for k, v in state.items() if not k.startswith(("rm_head.", "rm_heads."))}
        if model.config.get_text_config().tie_word_embeddings:
            backbone.pop("lm_head.weight", None)
        try:
            missing, unexpected = model.load_state_dict(backbone, strict=False)
        except RuntimeError as e:  # shape mismatches
            raise UserError(f"edit_reward: {file} does not fit the base model at {root} ({str(e).splitlines()[-1]})"
                            ) from None
        missing = [k for k in missing if not (k == "lm_head.weight"
                                              and model.config.get_text_config().tie_word_embeddings)]
        if missing or unexpected:
            raise UserError(f"edit_reward: {file} does not fit the base model at {root}: missing {missing[:4]}, "
                            f"unexpected {unexpected[:4]}")
        hidden = model.config.get_text_config().hidden_size
        for head in self.heads:
            if head.in_features != hidden or head.out_features != 2:
                raise UserError(f"edit_reward: a reward head maps {head.in_features} -> {head.out_features}; EditReward's "
                                f"maps the {hidden}-d hidden state to (mu, sigma)")
        self.model = model.to(self.device).eval()
        self.heads = [h.to(self.device) for h in self.heads]
        self.image_token = getattr(self.tokenizer, "image_token", None) or "<|image_pad|>"

    def read_heads(self, state: dict, file: Path) -> tuple[list, list[str]]:
        """The heads in the checkpoint and the instruction each reads: `rm_heads.head_<i>` (multi-head: dim1, dim2)
        or one `rm_head` (the `reward_dim` instruction)."""
        multi = sorted({int(k.split(".")[1][len("head_"):]) for k in state if k.startswith("rm_heads.head_")})
        if multi:
            if multi != list(range(len(multi))) or len(multi) > len(MULTI_HEAD_DIMS):
                raise UserError(f"edit_reward: {file} has heads {multi}; EditReward's multi-head model has head_0 "
                                "(instruction following) and head_1 (visual quality)")
            heads = [head_from_state(state, f"rm_heads.head_{i}.", "relu", f"edit_reward: {file}") for i in multi]
            return heads, list(MULTI_HEAD_DIMS[:len(multi)])
        if "rm_head.weight" in state:  # rm_head_type "default": one Linear
            layer = torch.nn.Linear(state["rm_head.weight"].shape[1], state["rm_head.weight"].shape[0], bias=False)
            with torch.no_grad():
                layer.weight.copy_(state["rm_head.weight"].float())
            return [layer.eval()], [self.reward_dim]
        try:
            return [head_from_state(state, "rm_head.", "relu", f"edit_reward: {file}")], [self.reward_dim]
        except ValueError:
            raise UserError(f"edit_reward: {file} has no reward head (rm_heads.head_<i>.* or rm_head.*): not an "
                            "EditReward checkpoint") from None

    def sources(self, metadata: list[dict]):
        """Each sample's source image (PIL RGB) from metadata `source_key` (a path, or a list: the first)."""
        from PIL import Image

        out = []
        for i, meta in enumerate(metadata):
            value = meta.get(self.source_key)
            path = value[0] if isinstance(value, list | tuple) and value else value
            if not isinstance(path, str):
                raise UserError(f"reward edit_reward: sample {i} has no source image path in metadata "
                                f"{self.source_key!r} (got {value!r}); EditReward scores an edit against its source: "
                                "the data needs an image column (an edit model's rows)")
            try:
                with Image.open(path) as image:
                    out.append(image.convert("RGB"))
            except OSError as e:
                raise UserError(f"reward edit_reward: source image {path}: {e}") from None
        return out

    def inputs(self, sources: list, edited: list, instructions: list[str], reward_dim: str) -> dict:
        """Steps 1–2 of the module docstring (sources and edited results as PIL RGB images): the batch EditReward's
        processor call gives."""
        pictures = [resized_picture(picture, IMAGE_PIXELS) for pair in zip(sources, edited, strict=True) for picture in pair]
        vision = self.image_processor(images=pictures, return_tensors="pt")
        counts = (vision["image_grid_thw"].prod(-1) // self.image_processor.merge_size**2).tolist()
        content = [{"type": "image"}, {"type": "image"}]
        texts = [render_turn(self.tokenizer, self.template,
                             [*content, {"type": "text", "text": edit_reward_text(instruction, reward_dim)}],
                             self.image_token, counts[2 * i:2 * i + 2], "edit_reward")
                 for i, instruction in enumerate(instructions)]
        return model_inputs(self.tokenizer, texts, "image", vision["pixel_values"], vision["image_grid_thw"],
                            self.device, self.dtype)

    @torch.no_grad()
    def __call__(self, images, prompts, metadata=None) -> RewardOutput:
        metadata = check_batch("edit_reward", images.shape[0], prompts, metadata)
        if media_kind(images) != "images":
            raise ValueError(f"edit_reward scores images (B, 3, H, W), got {tuple(images.shape)}")
        sources, edited = self.sources(metadata), rgb_pictures(images)
        instructions = [prompt_text(p) for p in prompts]
        outputs = []
        for head, dim in zip(self.heads, self.dims, strict=True):
            batch = self.inputs(sources, edited, instructions, dim)
            hidden = token_states(self.model, batch, "image", self.reward_id, REWARD_TOKEN, "edit_reward")
            outputs.append(head(hidden.float()).cpu())
        stacked = torch.stack(outputs)
        pooled = pool_heads(stacked, self.pooling) if len(outputs) > 1 else stacked[0]
        extras = {f"edit_reward/{HEAD_NAMES[k]}": stacked[k, :, 0].tolist() for k in range(len(outputs))} \
            if len(outputs) > 1 else {}
        return RewardOutput(pooled[:, 0].float(), extras)

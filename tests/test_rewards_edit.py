"""The edit rewards: `preservation` against float64 loops over the pixels, and `vlm_judge` with the source image in
its turn (on the scripted tiny LLaVA judge of test_rewards_vlm.py)."""

import math

import numpy as np
import pytest
import torch
from PIL import Image
from test_rewards_vlm import SCRIPT, build_tiny_llava

from polyrl.rewards import build_reward


def _save(path, array):
    Image.fromarray(array).save(path)
    return str(path)


def _pair(tmp_path, seed=0, size=(32, 32)):
    """A uint8 source image on disk and a generated batch (1, 3, H, W) in [0, 1] that differs from it."""
    rng = np.random.default_rng(seed)
    source = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
    generated = np.clip(source / 255.0 + rng.normal(0, 0.2, source.shape), 0, 1)
    return _save(tmp_path / f"source{seed}.png", source), torch.tensor(generated).permute(2, 0, 1)[None].float()


def _reference(generated, source_u8, outside, metric, max_psnr=50.0):
    """Float64 loop over every outside pixel and channel (the module docstring's formulas)."""
    g = generated[0].double().permute(1, 2, 0).numpy()
    total, count = 0.0, 0
    for y in range(g.shape[0]):
        for x in range(g.shape[1]):
            if not outside[y][x]:
                continue
            for c in range(3):
                d = float(g[y, x, c]) - float(source_u8[y, x, c]) / 255.0
                total += abs(d) if metric == "l1" else d * d
                count += 1
    mean = total / count
    if metric == "psnr":
        return max_psnr if mean == 0 else min(max_psnr, 10 * math.log10(1 / mean))
    return 1 - mean


@pytest.mark.parametrize("metric", ["l1", "mse", "psnr"])
def test_preservation_outside_the_mask_matches_a_float64_loop(metric, tmp_path, edit_data_dir):
    source_path, generated = _pair(tmp_path)
    mask_path = str(edit_data_dir / "masks" / "square.png")
    reward = build_reward({"name": "preservation", "metric": metric, "mask_key": "mask"})
    out = reward(generated, ["edit"], [{"image": source_path, "mask": mask_path}])
    mask = np.asarray(Image.open(mask_path))
    source = np.asarray(Image.open(source_path))
    expected = _reference(generated, source, mask < 128, metric)
    assert out.scores.dtype == torch.float32 and out.scores.item() == pytest.approx(expected, rel=1e-6)
    assert out.extras["preservation/outside_fraction"] == [1 - 12 * 16 / 32**2]
    # only the outside counts: changing the edit region does not move the score, changing the rest does
    inside = torch.from_numpy(mask >= 128)
    repainted = generated.clone()
    repainted[0, :, inside] = 1.0
    assert reward(repainted, ["edit"], [{"image": source_path, "mask": mask_path}]).scores.item() == out.scores.item()
    repainted[0, :, ~inside] = 1.0
    assert reward(repainted, ["edit"], [{"image": source_path, "mask": mask_path}]).scores.item() != out.scores.item()


def test_preservation_without_a_mask_scores_the_whole_image_and_resizes_the_source(tmp_path, edit_data_dir):
    source_path = str(edit_data_dir / "images" / "a.png")  # 40×48: resized (bicubic) to the generated 32×32
    generated = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    out = build_reward({"name": "preservation"})(generated, ["a", "b"], [{"image": source_path},
                                                                        {"image": [source_path, "unused.png"]}])
    resized = np.asarray(Image.open(source_path).convert("RGB").resize((32, 32), Image.BICUBIC))
    everywhere = np.ones((32, 32), dtype=bool)
    for i in range(2):
        expected = _reference(generated[i:i + 1], resized, everywhere, "l1")
        assert out.scores[i].item() == pytest.approx(expected, rel=1e-6)


def test_preservation_psnr_by_hand(tmp_path):
    source = np.full((8, 8, 3), 100, dtype=np.uint8)
    path = _save(tmp_path / "flat.png", source)
    copy = torch.full((1, 3, 8, 8), 100 / 255)
    reward = build_reward({"name": "preservation", "metric": "psnr", "max_psnr": 40.0})
    assert reward(copy, ["x"], [{"image": path}]).scores.item() == pytest.approx(40.0)  # identical: the cap
    shifted = copy + 0.1  # every value off by 0.1: MSE 0.01, PSNR 20 dB
    assert reward(shifted, ["x"], [{"image": path}]).scores.item() == pytest.approx(20.0, abs=1e-4)
    l1 = build_reward({"name": "preservation", "metric": "l1"})(shifted, ["x"], [{"image": path}])
    assert l1.scores.item() == pytest.approx(0.9, abs=1e-6)


def test_preservation_errors(tmp_path):
    path, generated = _pair(tmp_path)
    with pytest.raises(ValueError, match=r"metric='ssim' is not valid; allowed: l1, mse, psnr"):
        build_reward({"name": "preservation", "metric": "ssim"})
    with pytest.raises(ValueError, match=r"sample 0 has no metadata 'image' path"):
        build_reward({"name": "preservation"})(generated, ["x"], [{}])
    with pytest.raises(ValueError, match=r"sample 0 has no metadata 'mask' path"):
        build_reward({"name": "preservation", "mask_key": "mask"})(generated, ["x"], [{"image": path}])
    full = _save(tmp_path / "full.png", np.full((32, 32), 255, dtype=np.uint8))
    with pytest.raises(ValueError, match=r"sample 0's edit region covers the whole image"):
        build_reward({"name": "preservation", "mask_key": "mask"})(generated, ["x"], [{"image": path, "mask": full}])


# ----------------------------------------------------------------------------------------------- vlm_judge
@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    return build_tiny_llava(tmp_path_factory.mktemp("edit_judge"), script=SCRIPT)


def test_vlm_judge_sees_the_source_image_before_the_result(judge_dir, edit_data_dir):
    from transformers import AutoProcessor

    judge = build_reward({"name": "vlm_judge", "path": str(judge_dir), "template": "rate the image {prompt} answer",
                          "score_range": [0, 10], "source_key": "image", "device": "cpu"})
    generated = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    sources = [str(edit_data_dir / "images" / "a.png"), str(edit_data_dir / "images" / "b.png")]
    prompts = [{"text": "a red circle", "images": [sources[0]]}, "a blue square"]  # a Prompt dict reads as its text
    metadata = [{"image": sources[0]}, {"image": [sources[1]]}]
    out = judge(generated, prompts, metadata)
    assert judge.last_answers == ["score : 8", "score : 8"] and out.scores.tolist() == pytest.approx([0.8, 0.8])
    # the turn holds [source, result]: two image blocks per sample, the source's pixels first
    batch = judge.vlm.inputs(generated, ["rate the image a red circle answer", "rate the image a blue square answer"],
                             judge.source_images(metadata))
    proc = AutoProcessor.from_pretrained(judge_dir)
    image_id = proc.tokenizer.convert_tokens_to_ids("<image>")
    single = judge.vlm.inputs(generated, ["rate the image a red circle answer"] * 2)
    assert ((batch["input_ids"] == image_id).sum(1) == 2 * (single["input_ids"] == image_id).sum(1)).all()
    assert batch["pixel_values"].shape[0] == 4
    source_pixels = proc.image_processor(images=[np.asarray(Image.open(sources[1]).convert("RGB"))],
                                         return_tensors="pt")["pixel_values"][0]
    assert torch.allclose(batch["pixel_values"][2], source_pixels)
    assert torch.allclose(batch["pixel_values"][3], single["pixel_values"][1])


def test_vlm_judge_default_edit_question_and_missing_source(judge_dir, edit_data_dir):
    from polyrl.rewards.vlm_judge import DEFAULT_EDIT_TEMPLATE, DEFAULT_TEMPLATE

    assert build_reward({"name": "vlm_judge", "path": str(judge_dir), "source_key": "image"}).template == \
        DEFAULT_EDIT_TEMPLATE
    assert build_reward({"name": "vlm_judge", "path": str(judge_dir)}).template == DEFAULT_TEMPLATE
    judge = build_reward({"name": "vlm_judge", "path": str(judge_dir), "source_key": "image", "device": "cpu"})
    with pytest.raises(ValueError, match=r"vlm_judge: sample 1 has no source image path in metadata 'image'"):
        judge(torch.rand(2, 3, 32, 32), ["a", "b"], [{"image": str(edit_data_dir / "images" / "a.png")}, {}])
    with pytest.raises(ValueError, match=r"vlm_judge: source image missing.png: .*No such file"):
        judge(torch.rand(1, 3, 32, 32), ["a"], [{"image": "missing.png"}])

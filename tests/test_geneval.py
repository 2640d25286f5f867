"""GenEval's rules (polyrl/rewards/geneval.py) on hand-made detections, and the scorer's model path on tiny random
Mask2Former and CLIP checkpoints the test builds."""

import math

import numpy as np
import pytest
import torch

from polyrl.rewards.geneval import (
    COLORS,
    GENEVAL_CLASSES,
    Detection,
    check_metadata,
    keep_detections,
    relative_position,
)


def box(x0, y0, x1, y1, score=0.95):
    return Detection(score, (x0, y0, x1, y1))


def no_colors(cls, dets):
    raise AssertionError("no colour asked")


def test_geneval_classes_are_cocos_80():
    assert len(GENEVAL_CLASSES) == 80 == len(set(GENEVAL_CLASSES)) and len(COLORS) == 10
    assert GENEVAL_CLASSES[64:67] == ("computer mouse", "tv remote", "computer keyboard")


def test_relative_position_by_hand():
    a, b = box(0, 40, 10, 50), box(40, 40, 50, 50)  # A's centre 35 px left of B's, same row, sizes 10
    # offset (-35, 0), shrunk by 0.1·(10 + 10) = 2 -> (-33, 0); / |o| = 35 -> dx = -0.943
    assert relative_position(a, b) == {"left of"}
    assert relative_position(b, a) == {"right of"}
    assert relative_position(box(40, 0, 50, 10), b) == {"above"}  # y grows downwards
    assert relative_position(b, box(40, 0, 50, 10)) == {"below"}
    # a diagonal neighbour: dx = dy = -0.66 > 0.5 in size -> both
    assert relative_position(box(0, 0, 10, 10), b) == {"left of", "above"}
    # within the margin: offset 1.5 px < 0.1·(10 + 10) = 2 -> no relation at all
    assert relative_position(box(0, 0, 10, 10), box(1.5, 0, 11.5, 10)) == set()
    # a mostly-vertical offset: (4, -30) shrunk by 2 -> (2, -28), / 30.27 -> dx 0.066, dy -0.925: above only
    r = relative_position(box(44, 10, 54, 20), box(40, 40, 50, 50))
    assert r == {"above"} and math.hypot(4, 30) == pytest.approx(30.27, abs=0.01)


def test_count_and_exclude():
    meta = {"tag": "counting", "include": [{"class": "clock", "count": 2}], "exclude": [{"class": "clock", "count": 3}]}
    two = {"clock": [box(0, 0, 5, 5), box(10, 10, 15, 15)]}
    assert check_metadata(meta, two, no_colors)[:2] == (True, [True, True])
    three = {"clock": [box(0, 0, 5, 5), box(10, 10, 15, 15), box(20, 20, 25, 25)]}
    ok, clauses, reasons = check_metadata(meta, three, no_colors)
    assert (ok, clauses) == (False, [True, False]) and reasons == ["expected clock<3, found 3"]
    ok, clauses, reasons = check_metadata(meta, {"clock": [box(0, 0, 5, 5)]}, no_colors)
    assert (ok, clauses) == (False, [False, True]) and reasons == ["expected clock>=2, found 1"]


def test_thresholds_per_tag():
    found = {"clock": [box(0, 0, 5, 5, 0.95), box(9, 9, 15, 15, 0.5), box(20, 20, 25, 25, 0.3)], "dog": [box(0, 0, 1, 1, 0.2)]}
    # counting: only above 0.9; otherwise above 0.3 (strictly: 0.3 itself is dropped), most confident first
    assert [d.score for d in keep_detections(found, "counting")["clock"]] == [0.95]
    kept = keep_detections(found, "two_object")
    assert [d.score for d in kept["clock"]] == [0.95, 0.5] and "dog" not in kept
    many = {"cup": [box(i, 0, i + 1, 1, 0.5 + i / 100) for i in range(20)]}
    assert len(keep_detections(many, "single_object")["cup"]) == 16


def test_colour_uses_the_first_count_detections():
    meta = {"tag": "color_attr", "include": [{"class": "bus", "count": 1, "color": "red"},
                                             {"class": "cup", "count": 1, "color": "green"}]}
    objects = {"bus": [box(0, 0, 5, 5), box(6, 6, 9, 9)], "cup": [box(20, 20, 25, 25)]}
    asked = []

    def colors(cls, dets):
        asked.append((cls, len(dets)))
        return {"bus": ["red"], "cup": ["blue"]}[cls]

    ok, clauses, reasons = check_metadata(meta, objects, colors)
    assert (ok, clauses) == (False, [True, False])
    assert asked == [("bus", 1), ("cup", 1)]  # only the most confident `count` objects are classified
    assert reasons[0].startswith("expected green cup>=1, found 0 green")


def test_position_against_the_matched_group():
    meta = {"tag": "position", "include": [{"class": "teddy bear", "count": 1},
                                           {"class": "dog", "count": 1, "position": ["right of", 0]}]}
    bear, dog_right, dog_left = box(0, 20, 10, 30), box(40, 20, 50, 30), box(0, 60, 4, 64)
    assert check_metadata(meta, {"teddy bear": [bear], "dog": [dog_right]}, no_colors)[0]
    ok, clauses, reasons = check_metadata(meta, {"teddy bear": [bear], "dog": [dog_left]}, no_colors)
    assert (ok, clauses) == (False, [True, False]) and reasons == ["expected dog right of target, found below target"]
    ok, clauses, reasons = check_metadata(meta, {"dog": [dog_right]}, no_colors)  # the target is missing
    assert clauses == [False, False] and reasons[1] == "no target for dog to be right of"


WORDS = ["a", "photo", "of", "object", "person", "dog", "clock", "mouse", "computer"] + list(COLORS) + \
    [f"{c}-colored" for c in COLORS]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from transformers import (
        CLIPConfig,
        CLIPImageProcessor,
        CLIPModel,
        Mask2FormerConfig,
        Mask2FormerForUniversalSegmentation,
        Mask2FormerImageProcessor,
        SwinConfig,
    )

    from polyrl.models.tiny import word_tokenizer

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("geneval_models")
    swin = SwinConfig(image_size=64, patch_size=4, embed_dim=16, depths=[1, 1, 1, 1], num_heads=[1, 1, 2, 2],
                      window_size=4, out_features=["stage1", "stage2", "stage3", "stage4"])
    names = ["person", "mouse", "dog", "clock"]  # "mouse" is COCO's name of GenEval's "computer mouse"
    cfg = Mask2FormerConfig(backbone_config=swin, feature_size=32, mask_feature_size=32, hidden_dim=32,
                            encoder_feedforward_dim=64, dim_feedforward=64, encoder_layers=1, decoder_layers=2,
                            num_attention_heads=2, num_queries=8, id2label=dict(enumerate(names)),
                            label2id={n: i for i, n in enumerate(names)})
    Mask2FormerForUniversalSegmentation(cfg).save_pretrained(root / "detector")
    Mask2FormerImageProcessor(size={"shortest_edge": 64, "longest_edge": 64}, size_divisor=32).save_pretrained(
        root / "detector")
    tok = word_tokenizer(WORDS, 16, add_bos=True)
    clip = CLIPModel(CLIPConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=16, pad_token_id=tok.pad_token_id,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=8), projection_dim=16))
    clip.save_pretrained(root / "clip")
    tok.save_pretrained(root / "clip")
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(root / "clip")
    return root


def test_scorer_on_tiny_random_checkpoints(tiny_models):
    from transformers import AutoTokenizer, CLIPImageProcessor, CLIPModel

    from polyrl.rewards import build_reward
    from polyrl.rewards.geneval import mask_box

    # thresholds 0: the random detector's low-confidence instances all count, so every rule path runs
    reward = build_reward({"name": "geneval", "detector_path": str(tiny_models / "detector"),
                           "clip_path": str(tiny_models / "clip"), "threshold": 0.0, "counting_threshold": 0.0,
                           "device": "cpu"})
    assert set(reward.labels.values()) == {"person", "computer mouse", "dog", "clock"}
    images = torch.rand(2, 3, 48, 40, generator=torch.Generator().manual_seed(1))
    found = reward.detect(images)
    for per_image in found:
        for dets in per_image.values():
            for d in dets:
                assert d.mask.shape == (48, 40) and d.box == mask_box(d.mask)
    cls = next(iter(found[0]))
    dets = sorted(found[0][cls], key=lambda d: -d.score)[:1]
    meta = [{"tag": "colors", "include": [{"class": cls, "count": 1, "color": "red"}]},
            {"tag": "single_object", "include": [{"class": "dog", "count": 1}, {"class": "clock", "count": 1}],
             "exclude": [{"class": "person", "count": 1}]}]
    out = reward(images, ["a photo of a red x", "a photo of a dog"], meta)
    assert out.scores.dtype == torch.float32 and set(out.scores.tolist()) <= {0.0, 1.0}
    assert out.extras["geneval/correct"] == out.scores.tolist()
    assert out.extras["geneval/colors"] == [out.scores[0].item(), None]

    # the colour of the crop, recomputed by hand with the CLIP towers: image over #999 through the mask, cropped
    clip = CLIPModel.from_pretrained(tiny_models / "clip").double().eval()
    tok = AutoTokenizer.from_pretrained(tiny_models / "clip")
    arr = (images[0].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
    d = dets[0]
    pasted = np.where(d.mask[..., None], arr, np.uint8(153))
    x0, y0, x1, y1 = (int(v) for v in d.box)
    pv = CLIPImageProcessor.from_pretrained(tiny_models / "clip")(images=[pasted[y0:y1, x0:x1]],
                                                                   return_tensors="pt")["pixel_values"].double()
    with torch.no_grad():
        img = clip.get_image_features(pixel_values=pv)
        img = (img if isinstance(img, torch.Tensor) else img.pooler_output)[0]
        img = img / img.norm()
        sims = []
        for c in COLORS:
            texts = [f"a photo of a {c} {cls}", f"a photo of a {c}-colored {cls}", f"a photo of a {c} object"]
            t = tok(texts, padding=True, return_tensors="pt")
            e = clip.get_text_features(**t)
            e = e if isinstance(e, torch.Tensor) else e.pooler_output
            e = (e / e.norm(dim=-1, keepdim=True)).mean(0)
            sims.append(float(img @ (e / e.norm())))
    assert reward.colors_of(arr, cls, dets) == [COLORS[int(np.argmax(sims))]]
    expected = float(COLORS[int(np.argmax(sims))] == "red")
    assert out.scores[0].item() == expected

    partial = build_reward({"name": "geneval", "detector_path": str(tiny_models / "detector"),
                            "clip_path": str(tiny_models / "clip"), "threshold": 0.0, "counting_threshold": 0.0,
                            "device": "cpu", "mode": "partial"})
    ok, clauses, _ = check_metadata(meta[1], keep_detections(found[1], "single_object", 0.0, 0.0), no_colors)
    assert partial(images, ["a", "b"], meta).scores[1].item() == pytest.approx(sum(clauses) / 3)


def test_missing_metadata_and_dirs_are_clear_errors(tiny_models, tmp_path):
    from polyrl.rewards import build_reward

    with pytest.raises(FileNotFoundError, match="geneval detector_path"):
        build_reward({"name": "geneval", "detector_path": str(tmp_path / "nope"), "clip_path": str(tmp_path)})
    reward = build_reward({"name": "geneval", "detector_path": str(tiny_models / "detector"),
                           "clip_path": str(tiny_models / "clip"), "device": "cpu"})
    with pytest.raises(ValueError, match=r"sample 0 \('a dog'\) has no GenEval metadata"):
        reward(torch.rand(1, 3, 32, 32), ["a dog"], [{}])

"""clip_score, pickscore and aesthetic on a tiny random CLIP checkpoint the test builds and saves; expected
values recomputed from the model's own towers in float64."""

import math

import numpy as np
import pytest
import torch
from PIL import Image

from polyrl.rewards import build_reward
from polyrl.rewards.heads import save_mlp_head

WORDS = ["a", "red", "circle", "blue", "square", "photo", "of"]
LOGIT_SCALE = 50.0


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    from polyrl.models.tiny import word_tokenizer

    torch.manual_seed(0)
    tok = word_tokenizer(WORDS, 16, add_bos=True)
    cfg = CLIPConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=16, pad_token_id=tok.pad_token_id,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=8),
        projection_dim=16,
    )
    model = CLIPModel(cfg)
    with torch.no_grad():
        model.logit_scale.fill_(math.log(LOGIT_SCALE))
    path = tmp_path_factory.mktemp("tiny_clip")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(path)
    return path


def _images(n, seed=0, size=40):
    return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def _reference_embeds(clip_dir, images, prompts):
    """Image and text embeddings by the model's towers in float64, images through PIL (another route to uint8)."""
    from transformers import AutoTokenizer, CLIPImageProcessor, CLIPModel

    model = CLIPModel.from_pretrained(clip_dir).double().eval()
    pil = [Image.fromarray(np.rint(im.permute(1, 2, 0).numpy() * 255).astype(np.uint8)) for im in images]
    pv = CLIPImageProcessor.from_pretrained(clip_dir)(images=pil, return_tensors="pt")["pixel_values"].double()
    tok = AutoTokenizer.from_pretrained(clip_dir)(prompts, padding=True, return_tensors="pt")
    with torch.no_grad():
        img = model.visual_projection(model.vision_model(pixel_values=pv).pooler_output)
        txt = model.text_projection(model.text_model(**tok).pooler_output)
    return img.numpy(), txt.numpy()


def _cos(a, b):
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


PROMPTS = ["a red circle", "a blue square", "a photo of a circle"]


def test_clip_score_matches_float64_cosine(clip_dir):
    reward = build_reward({"name": "clip_score", "path": str(clip_dir), "device": "cpu"})
    images = _images(3)
    out = reward(images, PROMPTS, [{}] * 3)
    img, txt = _reference_embeds(clip_dir, images, PROMPTS)
    np.testing.assert_allclose(out.scores.numpy(), _cos(img, txt), atol=1e-5)
    assert torch.equal(reward(images, PROMPTS, [{}] * 3).scores, out.scores)  # deterministic


def test_clip_score_depends_on_image_and_prompt(clip_dir):
    reward = build_reward({"name": "clip_score", "path": str(clip_dir), "device": "cpu"})
    images = _images(2, seed=1)
    same_img = images[:1].expand(2, -1, -1, -1)
    by_prompt = reward(same_img, ["a red circle", "a blue square"], [{}] * 2).scores
    by_image = reward(images, ["a red circle"] * 2, [{}] * 2).scores
    assert abs(by_prompt[0] - by_prompt[1]) > 1e-4 and abs(by_image[0] - by_image[1]) > 1e-4


def test_pickscore_is_logit_scale_times_cosine(clip_dir):
    images = _images(3, seed=2)
    clip = build_reward({"name": "clip_score", "path": str(clip_dir), "device": "cpu"})(images, PROMPTS, None).scores
    pick = build_reward({"name": "pickscore", "path": str(clip_dir), "processor_path": str(clip_dir),
                         "scale": 0.5, "device": "cpu"})(images, PROMPTS, None)
    img, txt = _reference_embeds(clip_dir, images, PROMPTS)
    np.testing.assert_allclose(pick.scores.numpy(), 0.5 * LOGIT_SCALE * _cos(img, txt), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(pick.extras["pickscore/cos"], clip.numpy(), atol=1e-6)


def test_aesthetic_head_on_normalised_embedding(clip_dir, tmp_path):
    torch.manual_seed(3)
    # the LAION v2 layout at small width: Linear, Dropout, Linear, Dropout, Linear, Linear (no activations)
    head = torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.Dropout(0.2), torch.nn.Linear(12, 8),
                               torch.nn.Dropout(0.1), torch.nn.Linear(8, 4), torch.nn.Linear(4, 1))
    head_path = save_mlp_head(head, tmp_path / "aesthetic.safetensors")
    reward = build_reward({"name": "aesthetic", "path": str(clip_dir), "head_path": str(head_path), "device": "cpu"})
    images = _images(3, seed=4)
    out = reward(images, PROMPTS, None)
    img, _ = _reference_embeds(clip_dir, images, PROMPTS)
    x = torch.from_numpy(img / np.linalg.norm(img, axis=-1, keepdims=True))
    for i in (0, 2, 4, 5):  # Dropout is the identity at inference
        x = x @ head[i].weight.detach().double().T + head[i].bias.detach().double()
    np.testing.assert_allclose(out.scores.numpy(), x.reshape(-1).numpy(), atol=1e-5)
    assert out.scores[0] != out.scores[1]


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"CLIP model path: .*nope' is not a local model directory"):
        build_reward({"name": "clip_score", "path": str(tmp_path / "nope")})

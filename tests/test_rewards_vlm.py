"""vlm_judge on tiny local VLMs the test builds (hpsv3: tests/test_hpsv3.py): a LLaVA layout (CLIP vision tower + Llama) through
AutoModelForImageTextToText / AutoProcessor. (The Qwen2-VL processor needs torchvision for its video part,
which the CPU test environment does not have; the scorers use only the Auto classes.)

The judge's model is "scripted": its decoder layers are zeroed to the identity (residual only) and its
lm_head maps the current token to a chosen next token, so greedy decoding spells a known answer."""

import math

import pytest
import torch

from polyrl.rewards import build_reward
from polyrl.rewards.vlm_judge import DEFAULT_PATTERN, parse_score

SPECIAL = ["<pad>", "<unk>", "<eos>", "<image>"]
WORDS = ["answer", "refuse", "score", ":", "8", "no", "idea", "rate", "the", "image", "a", "red", "circle", "blue",
         "square", "prompt", "judge", "look"]
TEMPLATE = ("{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image> "
            "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endfor %}")
# next token after each token, for the scripted judge
SCRIPT = {"answer": "score", "score": ":", ":": "8", "8": "<eos>", "refuse": "no", "no": "idea", "idea": "<eos>"}


def build_tiny_llava(path, seed=0, script=None, words=None):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )

    vocab = {t: i for i, t in enumerate(SPECIAL + (words or WORDS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>",
                                   extra_special_tokens={"image_token": "<image>"})
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
        tokenizer=fast, patch_size=8, vision_feature_select_strategy="default", chat_template=TEMPLATE,
        image_token="<image>", num_additional_image_tokens=1)
    hidden = 32
    cfg = LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                       image_size=32, patch_size=8).to_dict(),
        text_config=LlamaConfig(vocab_size=len(vocab), hidden_size=hidden, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                                eos_token_id=vocab["<eos>"], pad_token_id=vocab["<pad>"], bos_token_id=None).to_dict(),
        image_token_id=vocab["<image>"], vision_feature_select_strategy="default", vision_feature_layer=-1,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(cfg)
    if script is not None:
        lm = model.model.language_model
        with torch.no_grad():
            for layer in lm.layers:  # residual stream only: the last hidden state is the current token's embedding
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
            q, _ = torch.linalg.qr(torch.randn(hidden, hidden))
            emb = q[: len(vocab)]  # orthonormal token embeddings
            lm.embed_tokens.weight.copy_(emb)
            model.lm_head.weight.zero_()
            for cur, nxt in script.items():
                model.lm_head.weight[vocab[nxt]] += 10.0 * emb[vocab[cur]]  # += : two tokens may lead to <eos>
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    return build_tiny_llava(tmp_path_factory.mktemp("judge"), script=SCRIPT)


def _images(n, seed=0):
    return torch.rand(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def test_parse_score():
    assert parse_score("Score: 7", DEFAULT_PATTERN) == 7.0
    assert parse_score("I'd say score = 3.5 overall", DEFAULT_PATTERN) == 3.5
    assert parse_score("SCORE 9, maybe score: 2", DEFAULT_PATTERN) == 9.0  # the first match
    assert parse_score("no idea", DEFAULT_PATTERN) is None
    assert parse_score("score: 8", DEFAULT_PATTERN, (0, 10)) == pytest.approx(0.8)
    assert parse_score("score: 42", DEFAULT_PATTERN, (0, 10)) is None  # off the scale is not a score


def test_judge_parses_the_generated_answer(judge_dir):
    judge = build_reward({"name": "vlm_judge", "path": str(judge_dir), "template": "rate the image {prompt} answer",
                          "score_range": [0, 10], "device": "cpu"})
    out = judge(_images(2), ["a red circle", "a blue square"], [{}, {}])
    assert judge.last_answers == ["score : 8", "score : 8"]
    assert out.scores.tolist() == pytest.approx([0.8, 0.8])
    assert out.extras["vlm_judge/unparseable"] == [0.0, 0.0]


def test_judge_unparseable_is_an_error_or_excluded(judge_dir):
    args = {"name": "vlm_judge", "path": str(judge_dir), "template": "rate the image {prompt} refuse", "device": "cpu"}
    with pytest.raises(ValueError, match=r"vlm_judge: 2 of 2 answers have no score matching .*sample 0: 'no idea'"):
        build_reward(args)(_images(2), ["a red circle", "a blue square"], None)
    out = build_reward({**args, "on_unparseable": "exclude"})(_images(2), ["a red circle", "a blue square"], None)
    assert all(math.isnan(s) for s in out.scores.tolist()) and out.extras["vlm_judge/unparseable"] == [1.0, 1.0]


def test_excluded_judge_in_a_mix_is_counted(judge_dir):
    mix = build_reward({"name": "mix", "mix": {
        "vlm_judge": {"weight": 0.5, "required": False, "path": str(judge_dir), "on_unparseable": "exclude",
                      "template": "rate the image {prompt} refuse", "device": "cpu"},
        "jpeg_compressibility": 0.5}})
    out = mix(_images(2), ["a red circle", "a blue square"], [{}, {}])
    assert out.extras["reward/vlm_judge/failed"] == [1.0, 1.0]
    assert out.scores.tolist() == pytest.approx(out.extras["reward/jpeg_compressibility"], abs=1e-5)  # 0.5 -> 1.0


def test_judge_config_errors(judge_dir):
    with pytest.raises(ValueError, match=r"on_unparseable='zero'; allowed: error, exclude"):
        build_reward({"name": "vlm_judge", "path": str(judge_dir), "on_unparseable": "zero"})
    with pytest.raises(ValueError, match=r"needs a capture group"):
        build_reward({"name": "vlm_judge", "path": str(judge_dir), "pattern": r"score \d+"})

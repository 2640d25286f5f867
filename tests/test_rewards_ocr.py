"""reward=ocr: the edit distance against hand counts and a recursive reference, the Flow-GRPO normalisation,
and the real PP-OCRv4 engine (rapidocr-onnxruntime) on words rendered with PIL."""

import functools
import random

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from polyrl.rewards import build_reward
from polyrl.rewards.ocr import edit_distance, ocr_score, target_text


@pytest.mark.parametrize(("a", "b", "d"), [
    ("kitten", "sitting", 3),  # k->s, e->i, +g
    ("flaw", "lawn", 2),  # -f, +n
    ("", "abc", 3),
    ("hello", "world", 4),  # h->w, e->o, l->r, o->d (the second l matches)
    ("same", "same", 0),
    ("ab", "ba", 2),  # no transposition operation in Levenshtein
])
def test_edit_distance_hand_counts(a, b, d):
    assert edit_distance(a, b) == d and edit_distance(b, a) == d


def test_edit_distance_against_recursive_definition():
    rng = random.Random(0)

    def reference(a, b):
        @functools.cache
        def lev(i, j):  # distance between the suffixes a[i:] and b[j:]
            if i == len(a) or j == len(b):
                return len(a) - i + len(b) - j
            return min(lev(i + 1, j) + 1, lev(i, j + 1) + 1, lev(i + 1, j + 1) + (a[i] != b[j]))
        return lev(0, 0)

    for _ in range(200):
        a = "".join(rng.choice("abc") for _ in range(rng.randint(0, 8)))
        b = "".join(rng.choice("abc") for _ in range(rng.randint(0, 8)))
        assert edit_distance(a, b) == reference(a, b), (a, b)


def test_flow_grpo_normalisation():
    assert ocr_score("Hello World", "helloworld") == 1.0  # case and spaces do not count
    assert ocr_score("OPEN: hello!", "hello") == 1.0  # the target inside longer text is exact
    assert ocr_score("world", "hello") == pytest.approx(1 - 4 / 5)
    assert ocr_score("helo", "hello") == pytest.approx(1 - 1 / 5)
    assert ocr_score("zzzzzzzzzzzz", "ab") == 0.0  # capped at len(target): never below 0
    assert ocr_score("", "hello") == 0.0
    assert target_text('a neon sign that says "Open Late" at night', {}) == "Open Late"
    assert target_text("no quotes", {"text": "HI"}) == "HI"
    with pytest.raises(ValueError, match=r"prompt 'a sign' has no quoted target text"):
        target_text("a sign", {})


def _render(words, size=(192, 64)):
    font = ImageFont.load_default(size=36)
    out = []
    for w in words:
        img = Image.new("RGB", size, "white")
        ImageDraw.Draw(img).text((12, 10), w, fill=(20, 20, 20), font=font)
        out.append(torch.from_numpy(np.array(img)).permute(2, 0, 1).float() / 255)
    return torch.stack(out)


@pytest.fixture(scope="module")
def ocr():
    return build_reward({"name": "ocr"})


def test_real_ocr_reads_rendered_words(ocr):
    images = _render(["HELLO", "", "WORLD", "HALLO"])
    prompts = ['a sign that says "HELLO"'] * 4
    out = ocr(images, prompts, [{}] * 4)
    s = out.scores.tolist()
    assert s[0] > 0.99, s  # the clear word is read exactly
    assert s[1] == 0.0, s  # blank: nothing read
    assert s[2] == pytest.approx(0.2), s  # another word: "world" vs "hello" is 4 edits of 5
    assert s[3] == pytest.approx(0.8), s  # one wrong character costs 1/5
    assert out.extras["ocr/exact"][0] == 1.0 and out.extras["ocr/chars_read"][1] == 0.0
    # the sample grids' caption: the target and what was read
    assert out.extras["caption"] == ["target 'HELLO', read 'HELLO'", "target 'HELLO', read ''",
                                     "target 'HELLO', read 'WORLD'", "target 'HELLO', read 'HALLO'"]
    again = ocr(images[:1], prompts[:1], [{}])
    assert again.scores.tolist() == s[:1]  # deterministic


def test_ocr_rejects_prompt_without_target(ocr):
    with pytest.raises(ValueError, match="has no quoted target text"):
        ocr(_render(["HI"]), ["a sign"], [{}])

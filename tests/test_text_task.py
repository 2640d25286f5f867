"""The toy OCR task (polyrl/toy/text_task.py): the word split, the renderer, the letter-level tokenizer, and the real
OCR reward (RapidOCR, reward=ocr) on the toy's own renders — with and without its text detector."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from polyrl.models.tiny import word_tokenizer
from polyrl.rewards import build_reward
from polyrl.toy import text_task
from polyrl.toy.pretrain.text import write_text_prompt_files


def test_word_split_is_disjoint_fixed_and_large_enough():
    train, held = text_task.split_words()
    assert len(held) >= 128 and len(train) >= 4 * len(held)
    assert not set(train) & set(held) and sorted(train + held) == sorted(text_task.WORDS)
    assert len(set(text_task.WORDS)) == len(text_task.WORDS)  # no word twice in the list
    assert text_task.split_words() == (train, held)  # fixed
    for w in text_task.WORDS:
        assert text_task.check_word(w) == w


def test_heldout_words_never_in_training_prompts(tmp_path):
    write_text_prompt_files(tmp_path)
    train_rows = [json.loads(line) for line in (tmp_path / "text_train.jsonl").read_text().splitlines()]
    held_rows = [json.loads(line) for line in (tmp_path / "text_heldout.jsonl").read_text().splitlines()]
    _, held = text_task.split_words()
    assert sorted(r["text"] for r in held_rows) == held
    for r in train_rows:
        assert r["text"] not in held and f'"{r["text"]}"' in r["prompt"]
        assert not any(f'"{w}"' in r["prompt"] for w in held)
    assert {r["prompt"].split('"')[0] for r in train_rows} == {t.split('"')[0] for t in text_task.TEMPLATES}


def test_shipped_prompt_files_match_the_split(tmp_path):
    from polyrl.config import ASSETS

    write_text_prompt_files(tmp_path)
    for name in ("text_train.jsonl", "text_heldout.jsonl"):
        assert (ASSETS / "prompts" / name).read_text() == (tmp_path / name).read_text()


def test_render_places_the_word_left_aligned_in_ink_on_the_background():
    rng = random.Random(0)
    for style, (background, ink) in enumerate(text_task.STYLES):
        a = text_task.to_array(text_task.render("WIZARD", rng, style=style)).astype(int)
        assert a.shape == (text_task.HEIGHT, text_task.WIDTH, 3)
        inked = (np.abs(a - np.array(ink)).sum(-1) < 60)
        assert (np.abs(a[0] - np.array(background)).sum(-1) == 0).all()  # the top row is background
        cols = np.nonzero(inked.any(0))[0]
        # six letters of a 12 px advance, starting within MARGIN + jitter of the left edge
        assert text_task.MARGIN - 1 <= cols[0] <= text_task.MARGIN + text_task.JITTER[0] + 2
        assert 60 <= cols[-1] - cols[0] <= 74 and cols[-1] < text_task.WIDTH - 40
    short = text_task.to_array(text_task.render("CAT")).astype(int)
    assert np.nonzero((short.sum(-1) < 200).any(0))[0][-1] < 45  # three letters end about 36 px after the margin
    assert (text_task.to_array(text_task.render("CAT")) == text_task.to_array(text_task.render("CAT"))).all()
    for bad in ("AB", "TOOLONG", "hello", "A1C"):
        with pytest.raises(ValueError, match=r"toy text: word .* must be 3 to 6 letters A-Z"):
            text_task.render(bad)


def test_letters_are_tokens_at_fixed_positions():
    """Letter k of the quoted word is token 6 + k in every template, and a held-out word is made of known tokens."""
    tok = word_tokenizer(text_task.template_words() + ['"'], 16, add_bos=True, letters=text_task.TEXT_LETTERS)
    _, held = text_task.split_words()
    for i, word in enumerate(held[:40]):
        ids = tok(text_task.prompt_for(word, i), padding="max_length", max_length=16).input_ids
        tokens = tok.convert_ids_to_tokens(ids)
        assert tokens[6 : 6 + len(word)] == list(word) and tokens[5] == tokens[6 + len(word)] == '"'
        assert "<unk>" not in tokens and tokens[0] == "<bos>" and tokens[7 + len(word)] == "<eos>"
    assert tok.convert_ids_to_tokens(tok("a sign that says \"hi\"").input_ids)[6] == "<unk>"  # lower case: unknown


def _images(words: list[str], seed: int = 1) -> torch.Tensor:
    rng = random.Random(seed)
    arr = np.stack([text_task.to_array(text_task.render(w, rng)) for w in words])
    return torch.from_numpy(arr).permute(0, 3, 1, 2).float() / 255


@pytest.mark.parametrize("detect", [False, True])
def test_real_ocr_reads_the_toy_renders_and_scores_blank_zero(detect):
    """Measured: recognition only reads all 160 held-out words right (all four styles, with jitter), and so does
    detection + recognition on the 48 tried; here 12 words, 3 of each style on average, plus two blanks."""
    ocr = build_reward({"name": "ocr", "detect": detect, "threads": 1})
    words = text_task.split_words()[1][::13][:12]
    prompts = [text_task.prompt_for(w, i) for i, w in enumerate(words)]
    out = ocr(_images(words), prompts, [{}] * len(words))
    assert out.scores.tolist() == [1.0] * len(words)
    blank = torch.stack([torch.ones(3, text_task.HEIGHT, text_task.WIDTH),
                         torch.full((3, text_task.HEIGHT, text_task.WIDTH), 40 / 255)])
    out = ocr(blank, ['a sign that says "HELLO"'] * 2, [{}] * 2)
    assert out.scores.tolist() == [0.0, 0.0] and out.extras["ocr/chars_read"] == [0.0, 0.0]
    one_wrong = ocr(_images(["HELLO"]), ['a sign that says "HELLA"'], [{}])
    assert one_wrong.scores.tolist() == [pytest.approx(0.8)]  # one letter of five differs


def test_ocr_detect_is_a_config_key():
    from polyrl.config import load_config

    assert load_config(["reward=ocr"]).reward.detect is True
    assert load_config(["reward=ocr", "reward.detect=false"]).reward.detect is False

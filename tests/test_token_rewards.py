"""Rule rewards for text (rewards/rules.py) on hand-made responses, and text through the reward convention
(`call_reward`, `reward=mix`)."""

from __future__ import annotations

import pytest

from polyrl.rewards import build_reward, call_reward, media_kind
from polyrl.rewards.rules import Choice, Format, MathAnswer, final_answer, picked_letter


@pytest.mark.parametrize("response, reference, score", [
    ("The total is 5.", "5", 1.0),
    ("3 + 2 = 5, so the answer is 5", 5, 1.0),  # an int reference (a JSON number)
    ("first 4, then \\boxed{7}. Later I mention 9", "7", 1.0),  # the boxed answer wins over the last number
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),  # non-numbers compare as text
    ("Answer: 0.5", "1/2", 1.0),  # numbers compare by value
    ("the answer is 1,000.", "1000", 1.0),
    ("the answer is 6", "5", 0.0),
    ("I have no idea", "5", 0.0),
    ("answer: Paris.", "paris", 1.0),
])
def test_math_answer(response, reference, score):
    out = MathAnswer()([response], ["q"], [{"answer": reference}])
    assert out.scores.tolist() == [score]


def test_final_answer_extraction():
    assert final_answer("a \\boxed{x^{2}} b") == "x^{2}"
    assert final_answer("answer is -3.5 and more 7") == "-3.5"
    assert final_answer("two 3 and 8") == "8"
    assert final_answer("nothing") is None


@pytest.mark.parametrize("response, reference, score", [
    ("B", "B", 1.0),
    ("The answer is (C).", "C", 1.0),
    ("I think A. No wait, D.", "(D)", 1.0),  # the last letter standing alone
    ("answer: b", "B", 0.0),  # letters are capitals
    ("Because of A and B... answer: A", "A. the first", 1.0),
    ("no letter here", "A", 0.0),
])
def test_choice(response, reference, score):
    assert Choice(letters="ABCD")([response], ["q"], [{"answer": reference}]).scores.tolist() == [score]


def test_choice_and_answer_need_a_reference():
    assert picked_letter("Answer: E", "ABCD") is None
    with pytest.raises(ValueError, match="'answer' column"):
        MathAnswer().check_prompt("q", {"question": 1})
    with pytest.raises(ValueError, match="not one of the letters ABCD"):
        Choice(letters="ABCD").check_prompt("q", {"answer": "F"})
    with pytest.raises(ValueError, match="capital letters"):
        Choice(letters="abc")


def test_format_and_mix_over_text():
    good, bad = "<think>2 and 3</think> <answer>5</answer>", "5"
    assert Format()([good, bad], ["q", "q"], None).scores.tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="not a valid regular expression"):
        Format(pattern="(")
    assert media_kind([good, bad]) == "text"
    mix = build_reward({"name": "mix", "mix": {"math_answer": 1.0, "format": 0.5}})
    out = call_reward(mix, [good, bad, "6"], ["q"] * 3, [{"answer": "5"}] * 3)
    assert out.scores.tolist() == pytest.approx([1.5, 1.0, 0.0])
    # an image scorer refuses text, naming what it reads
    with pytest.raises(ValueError, match="cannot score text"):
        call_reward(build_reward({"name": "jpeg_compressibility"}), [good], ["q"], [{}])


def test_text_rewards_over_http():
    from polyrl.serving.server import BackgroundServer, create_app

    texts, prompts = ["the answer is 5", "6", "\\boxed{5}"], ["q"] * 3
    meta = [{"answer": "5"}] * 3
    with BackgroundServer(create_app(build_reward({"name": "math_answer"}), "math")) as srv:
        client = build_reward({"name": "http", "url": srv.url, "chunk_size": 2, "backoff": 0.01})
        out = call_reward(client, texts, prompts, meta)
        client.close()
    assert out.scores.tolist() == [1.0, 0.0, 1.0]
    assert out.extras["answer/found"] == [1.0, 1.0, 1.0]

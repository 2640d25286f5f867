"""Rule rewards for text responses (token policies, docs/tokens.md): a verifiable answer, a multiple-choice letter,
a format check. Each reads a response's text and, for the first two, the reference from the data file's `answer`
column (it reaches the reward as `metadata["answer"]`); a data row without one is refused before training starts,
naming its file and line (`check_prompt`).

* `math_answer`: 1 when the response's final answer equals the reference, else 0. The final answer is the last
  `\\boxed{...}`, else what follows the last "answer is" / "answer:", else the last number in the text. Numbers
  compare by value (`1/2` = `0.5`, `1,000` = `1000`); other answers compare as normalised text (case, spaces,
  `$`, a trailing period ignored).
* `choice`: 1 when the response picks the reference letter (`answer` = "B", "(B)" or "B. text"). The pick is the
  letter after the last "answer is" / "answer:", else a letter standing alone as "(B)", "B." or "B)" or a whole
  response "B", the last one in the text.
* `format`: 1 when the whole response matches `pattern` (a Python regex, DOTALL), else 0. Default: reasoning in
  `<think>…</think>` then `<answer>…</answer>`. Mix it with an answer reward: `reward=mix
  reward.mix={math_answer: 1.0, format: 0.1}`.
"""

from __future__ import annotations

import re
from fractions import Fraction

import torch

from .base import RewardOutput, check_batch, register_reward

NUMBER = r"[-+]?(?:\d+(?:,\d{3})*(?:\.\d+)?|\.\d+)(?:\s*/\s*\d+)?"
ANSWER_MARK = re.compile(r"answer\s*(?:is|:)\s*", re.IGNORECASE)


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def as_number(text: str) -> Fraction | None:
    """`text` as an exact number (integers, decimals, fractions a/b, thousands separators), or None."""
    s = text.strip().rstrip(".").replace("$", "").replace(" ", "")
    if not re.fullmatch(NUMBER, s):
        return None
    s = s.replace(",", "")
    try:
        if "/" in s:
            num, den = s.split("/")
            return Fraction(num) / Fraction(den) if Fraction(den) != 0 else None
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("$", "")).strip().rstrip(".").strip().lower()


def final_answer(response: str) -> str | None:
    """The response's final answer (see the module docstring), or None when it has none."""
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed
    marks = list(ANSWER_MARK.finditer(response))
    if marks:
        rest = response[marks[-1].end():].strip()
        number = re.match(NUMBER, rest)
        return number.group(0) if number else rest.split("\n")[0]
    numbers = re.findall(NUMBER, response)
    return numbers[-1] if numbers else None


def answers_match(answer: str | None, reference) -> bool:
    if answer is None:
        return False
    a, r = as_number(str(answer)), as_number(str(reference))
    if a is not None and r is not None:
        return a == r
    return normalise(str(answer)) == normalise(str(reference))


class _ReferenceReward:
    """A rule reward that compares against `metadata["answer"]`."""

    media = ("text",)
    name = "?"

    def check_prompt(self, prompt: str, meta: dict | None = None) -> None:
        if not meta or meta.get("answer") is None or str(meta["answer"]).strip() == "":
            raise ValueError(f"reward={self.name} needs the reference answer in an 'answer' column (a .jsonl or "
                             ".parquet row like {\"prompt\": ..., \"answer\": ...})")

    def _references(self, texts: list[str], prompts: list[str], metadata: list[dict] | None) -> list:
        metadata = check_batch(self.name, len(texts), prompts, metadata)
        for m in metadata:
            self.check_prompt("", m)
        return [m["answer"] for m in metadata]


@register_reward("math_answer")
class MathAnswer(_ReferenceReward):
    name = "math_answer"

    def __call__(self, texts: list[str], prompts: list[str], metadata: list[dict]) -> RewardOutput:
        refs = self._references(texts, prompts, metadata)
        answers = [final_answer(t) for t in texts]
        scores = [float(answers_match(a, r)) for a, r in zip(answers, refs, strict=True)]
        return RewardOutput(torch.tensor(scores, dtype=torch.float32),
                            {"answer/found": [float(a is not None) for a in answers]})


def reference_letter(reference, letters: str) -> str | None:
    m = re.match(rf"\s*\(?([{letters}])(?:[).:\s]|$)", str(reference).strip().upper())
    return m.group(1) if m else None


def picked_letter(response: str, letters: str) -> str | None:
    """The letter a response picks (see the module docstring), or None."""
    marks = list(ANSWER_MARK.finditer(response))
    if marks:
        m = re.match(rf"\(?([{letters}])\b", response[marks[-1].end():].strip())
        if m:
            return m.group(1)
    whole = response.strip().rstrip(".")
    if re.fullmatch(rf"\(?[{letters}]\)?", whole):
        return whole.strip("()")
    standing = re.findall(rf"(?:^|[\s(])\(?([{letters}])(?:\)|\.(?!\w))", response)
    return standing[-1] if standing else None


@register_reward("choice")
class Choice(_ReferenceReward):
    name = "choice"

    def __init__(self, letters: str = "ABCDEFGHIJ"):
        if not re.fullmatch(r"[A-Z]+", letters):
            raise ValueError(f"reward.letters={letters!r} must be capital letters, e.g. ABCD")
        self.letters = letters

    def check_prompt(self, prompt: str, meta: dict | None = None) -> None:
        super().check_prompt(prompt, meta)
        if reference_letter(meta["answer"], self.letters) is None:
            raise ValueError(f"reward=choice: answer {meta['answer']!r} is not one of the letters {self.letters}")

    def __call__(self, texts: list[str], prompts: list[str], metadata: list[dict]) -> RewardOutput:
        refs = [reference_letter(r, self.letters) for r in self._references(texts, prompts, metadata)]
        picks = [picked_letter(t, self.letters) for t in texts]
        scores = [float(p is not None and p == r) for p, r in zip(picks, refs, strict=True)]
        return RewardOutput(torch.tensor(scores, dtype=torch.float32),
                            {"answer/found": [float(p is not None) for p in picks]})


THINK_ANSWER = r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*"


@register_reward("format")
class Format:
    media = ("text",)

    def __init__(self, pattern: str = THINK_ANSWER):
        try:
            self.pattern = re.compile(pattern, re.DOTALL)
        except re.error as e:
            raise ValueError(f"reward.pattern={pattern!r} is not a valid regular expression ({e})") from None

    def __call__(self, texts: list[str], prompts: list[str], metadata: list[dict] | None = None) -> RewardOutput:
        check_batch("format", len(texts), prompts, metadata)
        scores = [float(self.pattern.fullmatch(t) is not None) for t in texts]
        return RewardOutput(torch.tensor(scores, dtype=torch.float32))

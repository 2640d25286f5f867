"""The "count the shapes" text task behind the toy text default (`recipe=toy_count`).

A prompt describes a scene as a list of object groups and asks how many objects of a kind it holds:

    "two red circles , a blue square and three green circles . how many circles ?"   -> 5

The question names a shape ("how many squares ?"), a colour ("how many red shapes ?") or everything ("how many
shapes ?"); the answer is the sum of the matching groups' counts, 0 to 12, written as digits. Every word is in a
closed vocabulary (`vocabulary`), so the toy model's tokenizer is one token per word. The same structure writes
the prompt files (`make_prompts`: JSONL rows with the `answer` column that `reward=math_answer` reads), the
pretraining examples, and the answers.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

COLORS = ("red", "green", "blue", "yellow")
SHAPES = ("circle", "square", "triangle")
COUNT_WORDS = {1: "a", 2: "two", 3: "three"}
MAX_GROUPS = 4
MAX_ANSWER = MAX_GROUPS * max(COUNT_WORDS)


@dataclass(frozen=True)
class Group:
    color: str
    shape: str
    count: int

    def text(self) -> str:
        return f"{COUNT_WORDS[self.count]} {self.color} {self.shape}{'s' if self.count > 1 else ''}"


@dataclass(frozen=True)
class Scene:
    """Object groups and the question: ("shape", "circle"), ("color", "red") or ("all", None)."""

    groups: tuple[Group, ...]
    question: tuple[str, str | None]

    def text(self) -> str:
        parts = [g.text() for g in self.groups]
        listed = parts[0] if len(parts) == 1 else " , ".join(parts[:-1]) + " and " + parts[-1]
        kind, value = self.question
        asked = {"shape": f"{value}s", "color": f"{value} shapes", "all": "shapes"}[kind]
        return f"{listed} . how many {asked} ?"

    def matching(self) -> list[Group]:
        kind, value = self.question
        return [g for g in self.groups
                if kind == "all" or (kind == "shape" and g.shape == value) or (kind == "color" and g.color == value)]

    def answer(self) -> int:
        """The number of objects the question asks about."""
        return sum(g.count for g in self.matching())

    def groups_answer(self) -> int:
        """A careless count: the number of matching groups ("two red circles" counted as one)."""
        return len(self.matching())


def random_scene(rng: random.Random) -> Scene:
    groups = tuple(Group(rng.choice(COLORS), rng.choice(SHAPES), rng.choice(tuple(COUNT_WORDS)))
                   for _ in range(rng.randint(1, MAX_GROUPS)))
    kind = rng.choice(("shape", "shape", "color", "color", "all"))
    value = rng.choice(SHAPES) if kind == "shape" else rng.choice(COLORS) if kind == "color" else None
    return Scene(groups, (kind, value))


def vocabulary() -> list[str]:
    """Every word a prompt or an answer uses."""
    words = set(COLORS) | set(SHAPES) | {s + "s" for s in SHAPES} | set(COUNT_WORDS.values())
    words |= {"and", ",", ".", "how", "many", "shapes", "?"} | {str(i) for i in range(MAX_ANSWER + 1)}
    return sorted(words)


def scenes(n: int, seed: int, exclude: set[str] | None = None) -> list[Scene]:
    """n distinct scenes (by text) drawn with `seed`, none of whose text is in `exclude`."""
    rng, seen, out = random.Random(seed), set(exclude or ()), []
    while len(out) < n:
        s = random_scene(rng)
        if s.text() not in seen:
            seen.add(s.text())
            out.append(s)
    return out


def row(scene: Scene) -> dict:
    return {"prompt": scene.text(), "answer": str(scene.answer())}


def make_prompts(out_dir: str | Path, n_train: int = 2000, n_heldout: int = 256, seed: int = 0) -> tuple[Path, Path]:
    """`count_train.jsonl` and `count_heldout.jsonl` (held-out scenes never appear in the training file)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    heldout = scenes(n_heldout, seed + 1)
    train = scenes(n_train, seed, exclude={s.text() for s in heldout})
    paths = out_dir / "count_train.jsonl", out_dir / "count_heldout.jsonl"
    for path, rows in zip(paths, (train, heldout), strict=True):
        path.write_text("".join(json.dumps(row(s)) + "\n" for s in rows))
    return paths

"""The toy prompt-rewriting task behind `recipe=toy_rewriter` (docs/tokens.md, "Prompt rewriter").

A request is a prompt of the shapes task ("two red circles above a blue square"); a rewrite is the text the frozen
`toy_shapes` generator renders. The toy rewriter (`polyrl pretrain-toy --task rewrite`) learns rewrites from a
chatty, careless annotator (`rewrite`), whose paraphrases are drawn independently per request:

* `filler` (p = 0.55): a polite opening, "please draw" / "please show" / "please make": words the generator never
  saw, read by its text encoder as `<unk>`;
* `and_relation` (p = 0.55, two-group requests): the spatial relation replaced by "and";
* `reorder` (p = 0.2): the same scene with the groups swapped and the inverse relation ("A above B" -> "B below A"),
  a faithful paraphrase;
* `singular` (p = 0.1 per plural noun): "circles" -> "circle";
* `recolor` (p = 0.1 per group): the group's colour replaced by another one.

The two openings "please ..." share their first word, so "please" is the single most likely first word (0.55) and
"and" the most likely relation word: a greedy (held-out) rewrite of the base model tends to be "please draw two red
circles and a blue square", which the generator renders far worse than the request itself, while sampled rewrites
(temperature 1) mix faithful and careless ones — the variety GRPO selects from. Every word is in `vocabulary`, so the
rewriter's tokenizer is one token per word (plus the ChatML words "user", "assistant").
"""

from __future__ import annotations

import random

from .shapes_task import _RELATION_TEXT, COLORS, COUNT_WORDS, SHAPES, ObjectGroup, ShapesSpec

FILLERS = ("please draw", "please show", "please make")
INVERSE = {"above": "below", "below": "above", "left of": "right of", "right of": "left of"}
P_FILLER, P_AND, P_REORDER, P_SINGULAR, P_RECOLOR = 0.55, 0.55, 0.2, 0.1, 0.1


def _group_text(g: ObjectGroup, rng: random.Random) -> str:
    color = g.color
    if rng.random() < P_RECOLOR:
        color = rng.choice([c for c in COLORS if c != g.color])
    plural = g.count > 1 and rng.random() >= P_SINGULAR
    return f"{COUNT_WORDS[g.count]} {color} {g.shape}{'s' if plural else ''}"


def rewrite(spec: ShapesSpec, rng: random.Random) -> str:
    """One careless annotator's rewrite of the request `spec` (module docstring: the edits and their rates)."""
    groups, relation = spec.groups, spec.relation
    if relation is not None and rng.random() < P_REORDER:
        groups, relation = groups[::-1], INVERSE[relation]
    parts = [rng.choice(FILLERS)] if rng.random() < P_FILLER else []
    parts.append(_group_text(groups[0], rng))
    if relation is not None:
        parts.append("and" if rng.random() < P_AND else _RELATION_TEXT[relation])
        parts.append(_group_text(groups[1], rng))
    return " ".join(parts)


def vocabulary() -> list[str]:
    """Every word a request or a rewrite uses, and the ChatML role names."""
    words = set(COLORS) | set(SHAPES) | {s + "s" for s in SHAPES} | set(COUNT_WORDS.values())
    words |= {w for text in _RELATION_TEXT.values() for w in text.split()}
    words |= {w for f in FILLERS for w in f.split()} | {"and", "user", "assistant"}
    return sorted(words)

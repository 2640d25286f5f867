"""Prompt files, offline preference pairs and their formats per policy kind."""


def pair_format(kind: str):
    """The offline pair format class of a policy kind (data/pairs.py PAIR_FORMATS)."""
    from . import text_pairs  # noqa: F401  (registers the token format; it imports pairs, which registers images)
    from .pairs import PAIR_FORMATS

    return PAIR_FORMATS[kind]

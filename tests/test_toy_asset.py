"""The shipped toy model loads through the normal adapter path and draws the task's shapes."""

from polyrl.config import ASSETS
from polyrl.toy.pretrain.shapes import evaluate_toy, toy_spec, write_prompt_files
from polyrl.toy.shapes_task import parse_prompt


def test_shipped_toy_model_is_small_and_scores(tmp_path):
    root = ASSETS / "toy_shapes"
    size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    assert size <= 25 * 2**20
    assert (root / "model_index.json").is_file()
    # A trained base: far above a blank canvas (0) on held-out prompts, with ODE sampling at fixed seeds.
    score = evaluate_toy(root, ASSETS / "prompts" / "shapes_heldout.jsonl", n=16, num_steps=10)
    assert score > 0.5


def test_prompt_split_is_disjoint_and_reproducible(tmp_path):
    write_prompt_files(tmp_path)
    for name in ("shapes_train.jsonl", "shapes_heldout.jsonl"):
        assert (tmp_path / name).read_text() == (ASSETS / "prompts" / name).read_text()
    train = {line for line in (tmp_path / "shapes_train.jsonl").read_text().splitlines()}
    held = {line for line in (tmp_path / "shapes_heldout.jsonl").read_text().splitlines()}
    assert train and held and not train & held
    words = set(toy_spec().words)
    for line in list(held)[:50]:
        import json

        prompt = json.loads(line)["prompt"]
        parse_prompt(prompt)
        assert set(prompt.split()) <= words

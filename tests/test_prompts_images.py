"""Condition images in prompt files (polyrl/data/prompts.py): the `image` column's path resolution, its errors, the
prompt dict `split_row` makes, and the trainer's refusal of rows without an image for a model that needs one."""

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from polyrl.cli.main import main
from polyrl.data.prompts import MissingConditionImage, load_prompts, split_row
from polyrl.models.base import text_only


def _jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_image_paths_resolve_against_the_data_file_folder(edit_data_dir, tmp_path, monkeypatch):
    images = edit_data_dir / "images"
    absolute = str(images / "c.png")
    p = _jsonl(edit_data_dir / "rows.jsonl", [
        json.dumps({"prompt": "make it red", "image": "images/a.png", "k": 1}),
        "",
        json.dumps({"prompt": "two of them", "image": ["images/a.png", "./masks/../images/b.png"]}),
        json.dumps({"prompt": "absolute", "image": absolute}),
        json.dumps({"prompt": "text only"}),
    ])
    monkeypatch.chdir(tmp_path)  # the working directory plays no part
    rows = load_prompts(p)
    assert rows[0] == {"prompt": "make it red", "image": str(images / "a.png"), "k": 1}
    assert rows[1]["image"] == [str(images / "a.png"), str(images / "b.png")]  # normalised, a list stays a list
    assert rows[2]["image"] == absolute and "image" not in rows[3]
    # split_row: the prompt carries the images; every other column, `image` included, is metadata
    prompt, meta = split_row(rows[1])
    assert prompt == {"text": "two of them", "images": rows[1]["image"]} and meta == {"image": rows[1]["image"]}
    prompt, meta = split_row(rows[0])
    assert prompt == {"text": "make it red", "images": [str(images / "a.png")]} and meta["k"] == 1
    assert split_row(rows[3]) == ("text only", {})
    # a text-only model refuses the prompt dict
    with pytest.raises(ValueError, match=r"generates from text only, but a prompt carries \['images'\]"):
        text_only([split_row(rows[0])[0]], "SD3")


def test_parquet_image_column(edit_data_dir):
    p = edit_data_dir / "rows.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "image": ["images/a.png", "images/b.png"]}), p)
    assert [r["image"] for r in load_prompts(p)] == [str(edit_data_dir / "images" / n) for n in ("a.png", "b.png")]
    pq.write_table(pa.table({"prompt": ["a", "b"], "image": [["images/a.png"], ["images/c.png", "images/b.png"]]}), p)
    assert load_prompts(p, require_image=True)[1]["image"] == [str(edit_data_dir / "images" / n)
                                                              for n in ("c.png", "b.png")]
    pq.write_table(pa.table({"prompt": ["a", "b"], "image": ["images/a.png", "images/zzz.png"]}), p)
    with pytest.raises(ValueError, match=re.escape(f"{p}: row 2: image 'images/zzz.png' does not exist")):
        load_prompts(p)
    pq.write_table(pa.table({"prompt": ["a", "b"], "image": ["images/a.png", None]}), p)
    with pytest.raises(MissingConditionImage, match=re.escape(f"{p}: row 2: no 'image'")):
        load_prompts(p, require_image=True)


@pytest.mark.parametrize("value,message", [
    ('"images/nope.png"', "image 'images/nope.png' does not exist (looked for {root}/images/nope.png)"),
    ('["images/a.png", "nope.png"]', "image 'nope.png' does not exist"),
    ("[]", "'image' must be a path or a non-empty list of paths, got []"),
    ("3", "'image' must be a path or a non-empty list of paths, got 3"),
    ('["images/a.png", 4]', "'image' must be a path or a non-empty list of paths"),
    ('{"path": "images/a.png"}', "'image' must be a path or a non-empty list of paths"),
])
def test_bad_image_values_name_file_line_and_path(edit_data_dir, value, message):
    p = _jsonl(edit_data_dir / "bad.jsonl", ['{"prompt": "ok", "image": "images/a.png"}', "",
                                             '{"prompt": "bad", "image": ' + value + "}"])
    with pytest.raises(ValueError, match=re.escape(f"{p}:3: " + message.format(root=edit_data_dir))):
        load_prompts(p)


def test_require_image_names_the_first_row_without_one(edit_data_dir):
    p = _jsonl(edit_data_dir / "partly.jsonl", ['{"prompt": "ok", "image": "images/a.png"}', "",
                                                '{"prompt": "no image"}', '{"prompt": "null", "image": null}'])
    assert len(load_prompts(p)) == 3  # fine for a model that needs no image
    with pytest.raises(MissingConditionImage, match=re.escape(f"{p}:3: no 'image'")):
        load_prompts(p, require_image=True)
    txt = edit_data_dir / "prompts.txt"
    txt.write_text("\n\nmake it red\n")
    with pytest.raises(MissingConditionImage, match=re.escape(f"{txt}:3: no 'image' (a .txt file holds prompts only")):
        load_prompts(txt, require_image=True)


def test_the_trainer_checks_the_heldout_file_too(edit_data_dir, tmp_path, capsys):
    train = _jsonl(edit_data_dir / "train.jsonl", ['{"prompt": "ok", "image": "images/a.png"}'])
    heldout = _jsonl(edit_data_dir / "heldout.jsonl", ['{"prompt": "ok", "image": "images/b.png"}', '{"prompt": "x"}'])
    code = main(["train", "model=qwen_image_edit", f"model.path={tmp_path / 'none'}", f"data.path={train}",
                 f"data.heldout_path={heldout}", f"trainer.output_dir={tmp_path / 'run'}",
                 "reward=jpeg_compressibility"])
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        f"polyrl: config error: {heldout}:2: no 'image' (a path or a list of paths, relative to the data file); "
        "model.name=qwen_image_edit needs a condition image in every row")


def test_a_reward_reads_the_text_of_a_prompt_with_condition_images():
    import torch

    from polyrl.rewards.base import RewardOutput, call_reward

    seen = []

    def reward(images, prompts, metadata=None):
        seen.extend(prompts)
        return RewardOutput(scores=torch.zeros(len(prompts)))

    prompts = [{"text": "make it red", "images": ["/x/a.png"]}, "plain text"]
    call_reward(reward, torch.zeros(2, 3, 8, 8), prompts, [{}, {}])
    assert seen == ["make it red", "plain text"]

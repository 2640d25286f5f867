"""Tests of prompt datasets and the seeded prompt sampler (polyrl/data/prompts.py)."""

from __future__ import annotations

import json
import re
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from polyrl.data.prompts import PromptSampler, load_prompts, split_row


# ------------------------------------------------------------------------------------------------ loading
def test_txt(tmp_path):
    p = tmp_path / "p.txt"
    p.write_text("a red circle\n\n  a blue square  \n\t\nthree triangles\n")
    assert load_prompts(p) == [{"prompt": "a red circle"}, {"prompt": "a blue square"}, {"prompt": "three triangles"}]
    assert load_prompts(str(p)) == load_prompts(p)


def test_jsonl_keeps_metadata(tmp_path):
    rows = [{"prompt": "a red circle", "objects": [["red", "circle"]], "k": 1},
            {"prompt": "two squares", "objects": [["blue", "square"], ["green", "square"]], "k": 2, "tag": None}]
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n")
    assert load_prompts(p) == rows
    prompt, meta = split_row(rows[1])
    assert prompt == "two squares" and meta == {"objects": [["blue", "square"], ["green", "square"]], "k": 2,
                                                "tag": None}


def test_parquet(tmp_path):
    p = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["a cat", "a dog"], "score": [0.5, 1.5], "tags": [["x"], ["y", "z"]]}), p)
    assert load_prompts(p) == [{"prompt": "a cat", "score": 0.5, "tags": ["x"]},
                               {"prompt": "a dog", "score": 1.5, "tags": ["y", "z"]}]


def test_parquet_without_prompt_column(tmp_path):
    p = tmp_path / "p.parquet"
    pq.write_table(pa.table({"text": ["a cat"]}), p)
    with pytest.raises(ValueError, match="no 'prompt' column.*text"):
        load_prompts(p)


def test_parquet_empty_prompt_names_row(tmp_path):
    p = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["a cat", "  "]}), p)
    with pytest.raises(ValueError, match="row 2"):
        load_prompts(p)


def test_bad_json_names_file_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt": "ok"}\n{"prompt": oops}\n')
    with pytest.raises(ValueError, match=re.escape(f"{p}:2:") + ".*not valid JSON"):
        load_prompts(p)


@pytest.mark.parametrize("row", ['{"text": "no prompt"}', '{"prompt": ""}', '{"prompt": 3}', '["a list"]'])
def test_missing_prompt_names_line(tmp_path, row):
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "ok"}\n\n' + row + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{p}:3:") + ".*prompt"):
        load_prompts(p)


@pytest.mark.parametrize("name,text", [("e.txt", ""), ("e.txt", "\n  \n"), ("e.jsonl", "\n")])
def test_empty_file(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(ValueError, match="holds no prompts"):
        load_prompts(p)


def test_unsupported_extension_lists_formats(tmp_path):
    p = tmp_path / "p.csv"
    p.write_text("prompt\na cat\n")
    with pytest.raises(ValueError, match=r"unsupported format '\.csv'.*\.txt, \.jsonl, \.parquet"):
        load_prompts(p)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompts(tmp_path / "nope.txt")


# ------------------------------------------------------------------------------------------------ sampler
def make_rows(n):
    return [{"prompt": f"p{i}", "i": i} for i in range(n)]


def draw(sampler, sizes):
    return [r["i"] for k in sizes for r in sampler.next(k)]


def test_sampler_covers_every_row_once_per_epoch():
    n = 7
    s = PromptSampler(make_rows(n), seed=3)
    seq = draw(s, [3] * 9)  # 27 draws, batches straddle epoch boundaries
    for e in range(3):
        assert sorted(seq[e * n:(e + 1) * n]) == list(range(n))
    assert max(Counter(seq[3 * n:]).values()) == 1  # the partial 4th epoch repeats nothing
    assert seq[:n] != list(range(n)) or seq[n:2 * n] != list(range(n))  # shuffled
    assert seq[:n] != seq[n:2 * n] or seq[n:2 * n] != seq[2 * n:3 * n]  # epochs differ


def test_sampler_batch_larger_than_dataset():
    s = PromptSampler(make_rows(3), seed=0)
    seq = draw(s, [7])
    assert sorted(seq[:3]) == [0, 1, 2] and sorted(seq[3:6]) == [0, 1, 2] and len(seq) == 7


def test_sampler_no_shuffle():
    s = PromptSampler(make_rows(4), seed=5, shuffle=False)
    assert draw(s, [3, 3, 2]) == [0, 1, 2, 3, 0, 1, 2, 3]


def test_sampler_seeded():
    a = draw(PromptSampler(make_rows(20), seed=1), [8] * 5)
    b = draw(PromptSampler(make_rows(20), seed=1), [8] * 5)
    c = draw(PromptSampler(make_rows(20), seed=2), [8] * 5)
    assert a == b
    assert a != c
    assert a[:20] != c[:20]


@pytest.mark.parametrize("first", [0, 5, 7, 14, 16])
def test_sampler_resume_exact(first):
    rows = make_rows(7)
    full = PromptSampler(rows, seed=11)
    before = draw(full, [first]) if first else []
    state = json.loads(json.dumps(full.state_dict()))  # survives a checkpoint round trip
    after = draw(full, [4, 4, 4, 4])

    resumed = PromptSampler(rows, seed=11)
    resumed.load_state_dict(state)
    assert draw(resumed, [4, 4, 4, 4]) == after
    ref = draw(PromptSampler(rows, seed=11), [first + 16])
    assert before + after == ref

"""Prompt sets in their published formats (polyrl/data/benchmarks.py): each parsed from a tiny file written here in
that format, detected from the file, forceable, and a malformed row named by file and line."""

import json

import pytest

from polyrl.data.benchmarks import detect_format, load_benchmark


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


GENEVAL = [
    {"tag": "single_object", "include": [{"class": "bench", "count": 1}], "prompt": "a photo of a bench"},
    {"tag": "counting", "include": [{"class": "clock", "count": 2}], "exclude": [{"class": "clock", "count": 3}],
     "prompt": "a photo of two clocks"},
    {"tag": "position", "include": [{"class": "teddy bear", "count": 1},
                                    {"class": "dog", "count": 1, "position": ["right of", 0]}],
     "prompt": "a photo of a dog right of a teddy bear"},
]


def test_geneval_metadata(tmp_path):
    path = write(tmp_path / "evaluation_metadata.jsonl", "\n".join(json.dumps(r) for r in GENEVAL) + "\n")
    assert detect_format(path) == "geneval"
    rows, fmt = load_benchmark(path)
    assert fmt == "geneval"
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in GENEVAL]
    assert [r["category"] for r in rows] == ["single_object", "counting", "position"]
    assert rows[0]["exclude"] == [] and rows[1]["exclude"] == [{"class": "clock", "count": 3}]
    assert rows[2]["include"][1]["position"] == ["right of", 0]


@pytest.mark.parametrize("row, message", [
    ({"tag": "counting", "include": [{"class": "clock"}], "prompt": "x"}, "integer 'count' >= 1"),
    ({"tag": "position", "include": [{"class": "dog", "count": 1, "position": ["right of", 0]}], "prompt": "x"},
     "'position' of 'dog' must be"),
    ({"include": [{"class": "dog", "count": 1}], "prompt": "x"}, "no 'tag'"),
])
def test_geneval_malformed_row_named_by_line(tmp_path, row, message):
    path = write(tmp_path / "m.jsonl", json.dumps(GENEVAL[0]) + "\n\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=rf"m\.jsonl:3: .*{message}"):
        load_benchmark(path, "geneval")


def test_drawbench_csv(tmp_path):
    path = write(tmp_path / "drawbench.csv", 'Prompts,Category\nA red colored car.,Colors\n'
                 '"A storefront with ""Hello, world"" written on it.",Text\n\n')
    assert detect_format(path) == "drawbench"
    rows, _ = load_benchmark(path)
    assert rows == [{"prompt": "A red colored car.", "category": "Colors"},
                    {"prompt": 'A storefront with "Hello, world" written on it.', "category": "Text"}]
    bad = write(tmp_path / "bad.csv", "Prompts,Category\nA red colored car.,Colors\n,Colors\n")
    with pytest.raises(ValueError, match=r"bad\.csv:3: empty Prompts"):
        load_benchmark(bad)
    wrong = write(tmp_path / "wrong.csv", "prompt,label\nx,y\n")
    with pytest.raises(ValueError, match=r"wrong\.csv:1: the header must name 'Prompts' and 'Category'"):
        load_benchmark(wrong)


def test_parti_tsv(tmp_path):
    path = write(tmp_path / "PartiPrompts.tsv", "Prompt\tCategory\tChallenge\tNote\nbond\tAbstract\tBasic\t"
                 "Biology-inspired concepts\na red cube\tIllustrations\tBasic\t\n")
    assert detect_format(path) == "parti"
    rows, _ = load_benchmark(path)
    assert rows == [
        {"prompt": "bond", "category": "Abstract", "challenge": "Basic", "note": "Biology-inspired concepts"},
        {"prompt": "a red cube", "category": "Illustrations", "challenge": "Basic", "note": ""}]
    bad = write(tmp_path / "bad.tsv", "Prompt\tCategory\tChallenge\tNote\nbond\tAbstract\tBasic\t\nlonely\n")
    with pytest.raises(ValueError, match=r"bad\.tsv:3: 1 fields, the header has 4"):
        load_benchmark(bad)


def test_t2i_compbench_file_and_folder(tmp_path):
    folder = tmp_path / "dataset"
    write(folder / "color_val.txt", "a green bench and a blue bowl\na blue bench and a green bowl\n")
    write(folder / "non_spatial_val.txt", "a man is playing the guitar\n")
    write(folder / "notes.txt", "not a category\n")
    assert detect_format(folder / "color_val.txt") == "t2i_compbench"
    rows, _ = load_benchmark(folder / "color_val.txt")
    assert [r["category"] for r in rows] == ["color", "color"]
    assert detect_format(folder) == "t2i_compbench"
    rows, _ = load_benchmark(folder)
    assert [(r["prompt"], r["category"]) for r in rows] == [
        ("a green bench and a blue bowl", "color"), ("a blue bench and a green bowl", "color"),
        ("a man is playing the guitar", "non_spatial")]


def test_flow_grpo_ocr_and_pickscore_lists(tmp_path):
    ocr = write(tmp_path / "ocr" / "test.txt", 'A neon sign that says "OPEN"\nA cake with "Happy Birthday" on it\n')
    assert detect_format(ocr) == "ocr"
    rows, _ = load_benchmark(ocr)
    assert [r["text"] for r in rows] == ["OPEN", "Happy Birthday"]
    bad = write(tmp_path / "ocr" / "train.txt", 'A sign that says "STOP"\n\nA sign without quotes\n')
    with pytest.raises(ValueError, match=r"train\.txt:3: no text in double quotes"):
        load_benchmark(bad)
    pick = write(tmp_path / "pickscore" / "test.txt", "a cat in a hat\na dog on a log\n")
    assert detect_format(pick) == "pickscore"
    assert [r["prompt"] for r in load_benchmark(pick)[0]] == ["a cat in a hat", "a dog on a log"]


def test_vbench_lists_folder_and_full_info(tmp_path):
    folder = tmp_path / "prompts_per_dimension"
    write(folder / "color.txt", "a red bicycle\na green bicycle\n")
    write(folder / "scene.txt", "alley\n")
    write(folder / "all_dimension.txt", "a red bicycle\na green bicycle\nalley\n")
    assert detect_format(folder / "color.txt") == detect_format(folder) == "vbench"
    rows, _ = load_benchmark(folder)  # the all-dimension list repeats the others: not read twice
    assert [(r["prompt"], r["category"]) for r in rows] == [
        ("a red bicycle", "color"), ("a green bicycle", "color"), ("alley", "scene")]
    info = write(tmp_path / "VBench_full_info.json", json.dumps([
        {"prompt_en": "a bird and a cat", "dimension": ["multiple_objects"],
         "auxiliary_info": {"multiple_objects": {"object": "bird and cat"}}},
        {"prompt_en": "a person swimming", "dimension": ["human_action", "subject_consistency"]}]))
    rows, fmt = load_benchmark(info)
    assert fmt == "vbench"
    assert rows[0]["auxiliary_info"] == {"multiple_objects": {"object": "bird and cat"}}
    assert rows[1]["category"] == "human_action" and rows[1]["dimension"] == ["human_action", "subject_consistency"]
    bad = write(tmp_path / "bad.json", json.dumps([{"prompt_en": "x", "dimension": ["color"]}, {"prompt": "y"}]))
    with pytest.raises(ValueError, match=r"bad\.json: entry 2: needs a non-empty string 'prompt_en'"):
        load_benchmark(bad)


def test_polyrl_files_and_forcing(tmp_path):
    path = write(tmp_path / "p.jsonl", '{"prompt": "a", "category": "x"}\n{"prompt": "b"}\n')
    rows, fmt = load_benchmark(path)
    assert fmt == "polyrl" and rows == [{"prompt": "a", "category": "x"}, {"prompt": "b"}]
    txt = write(tmp_path / "color_val.txt", "a red car\n")
    assert load_benchmark(txt)[1] == "t2i_compbench"
    rows, fmt = load_benchmark(txt, "polyrl")  # forced: a plain prompt list
    assert fmt == "polyrl" and rows == [{"prompt": "a red car"}]
    with pytest.raises(ValueError, match=r"eval.format='nope' is not valid; allowed: polyrl, geneval"):
        load_benchmark(txt, "nope")
    bad = write(tmp_path / "bad.jsonl", '{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: each row needs a non-empty string 'prompt'"):
        load_benchmark(bad)

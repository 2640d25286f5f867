"""Prompt sets in their published formats (polyrl/data/benchmarks.py), each from a tiny file written here in the layout
of the published one with its quirks (quoted phrases, line breaks and spaces in cells, BOMs, CRLF lines, repeated
lines, overlapping splits in one folder, file names two benchmarks share): every prompt and category as the file
holds it, the detection and why, forced formats that do not fit, and every bad file as an error naming file and line.
The expected rows are written out by hand."""

import json
import re

import pytest

from polyrl.cli.main import main
from polyrl.data.benchmarks import detect, detect_format, load_benchmark, read_benchmark, read_prompt_data


def write(path, text, encoding="utf-8"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode(encoding) if isinstance(text, str) else text)
    return path


def fails(path, pattern, fmt=None):
    with pytest.raises(ValueError, match=pattern):
        read_benchmark(path, fmt)


# ------------------------------------------------------------------------------------------------ GenEval
GENEVAL = [
    {"tag": "single_object", "include": [{"class": "bench", "count": 1}], "prompt": "a photo of a bench"},
    {"tag": "counting", "include": [{"class": "clock", "count": 2}], "exclude": [{"class": "clock", "count": 3}],
     "prompt": "a photo of two clocks"},
    {"tag": "position", "include": [{"class": "teddy bear", "count": 1},
                                    {"class": "dog", "count": 1, "position": ["right of", 0]}],
     "prompt": "a photo of a dog right of a teddy bear"},
]


def test_geneval_metadata(tmp_path):
    # Flow-GRPO's test_metadata.jsonl repeats GenEval's rows: every line is read, none merged
    path = write(tmp_path / "test_metadata.jsonl", "\n".join(json.dumps(r) for r in GENEVAL + GENEVAL[:1]) + "\n")
    bench = read_benchmark(path)
    assert (bench.format, bench.why) == ("geneval", "a .jsonl file whose line 1 has GenEval's 'tag' and 'include'")
    assert [r["prompt"] for r in bench.rows] == [r["prompt"] for r in GENEVAL] + ["a photo of a bench"]
    assert [r["category"] for r in bench.rows] == ["single_object", "counting", "position", "single_object"]
    assert bench.rows[0]["exclude"] == [] and bench.rows[1]["exclude"] == [{"class": "clock", "count": 3}]
    assert bench.rows[2]["include"][1]["position"] == ["right of", 0]
    assert bench.location(3) == f"{path}:4"
    assert bench.categories() == {"single_object": 2, "counting": 1, "position": 1}


@pytest.mark.parametrize("row, message", [
    ({"tag": "counting", "include": [{"class": "clock"}], "prompt": "x"}, "integer 'count' >= 1"),
    ({"tag": "position", "include": [{"class": "dog", "count": 1, "position": ["right of", 0]}], "prompt": "x"},
     "'position' of 'dog' must be"),
    ({"include": [{"class": "dog", "count": 1}], "prompt": "x"}, "no 'tag'"),
    ({"tag": "colors", "include": [{"class": "dog", "count": 1, "colour": "red"}], "prompt": "x"},
     "'include' entry has key 'colour'; GenEval's include entries have class, count, color, position"),
    ({"tag": "counting", "include": [{"class": "dog", "count": 1}], "exlude": [], "prompt": "x"},
     "key 'exlude' \\(GenEval's 'exclude'\\?\\)"),
])
def test_geneval_malformed_row_named_by_line(tmp_path, row, message):
    path = write(tmp_path / "m.jsonl", json.dumps(GENEVAL[0]) + "\n\n" + json.dumps(row) + "\n")
    fails(path, rf"m\.jsonl:3: .*{message}", "geneval")
    fails(path, rf"m\.jsonl:3: .*{message}")  # detected from line 1


def test_a_misnamed_geneval_key_is_refused_not_read_as_plain_prompts(tmp_path):
    row = {"tag": "single_object", "includes": [{"class": "bench", "count": 1}], "prompt": "a photo of a bench"}
    path = write(tmp_path / "evaluation_metadata.jsonl", "\ufeff" + json.dumps(row) + "\n")
    fails(path, r"evaluation_metadata\.jsonl:1: has 'tag', 'includes' \(GenEval's 'include'\?\) but not both 'tag' "
                r"and 'include'.*set eval\.format=polyrl")
    assert load_benchmark(path, "polyrl") == ([row], "polyrl")  # forced: plain prompts, the keys as metadata
    fails(path, r"evaluation_metadata\.jsonl:1: no 'include'|:1: key 'includes'", "geneval")


# ------------------------------------------------------------------------------------------------ DrawBench
def test_drawbench_csv_cells_as_written(tmp_path):
    """Imagen's sheet: a header naming Prompts; a category with a trailing space; a cell that starts with a quoted
    phrase, one that holds a line break, one with surrounding spaces; CRLF line ends; a trailing blank line."""
    text = ('Prompts,Category\r\n'
            'A red colored car.,Colors\r\n'
            '"""Hello"" written on a storefront.",Text\r\n'
            '"A stack of 3 books.\r\nThe green one on top, the red one below.",DALL-E\r\n'
            '  Two cats on the grass. ,Gary Marcus et al. \r\n'
            '\r\n')
    path = write(tmp_path / "drawbench.csv", text)
    bench = read_benchmark(path)
    assert (bench.format, bench.why) == ("drawbench", "a .csv file: DrawBench's sheet")
    assert bench.rows == [
        {"prompt": "A red colored car.", "category": "Colors"},
        {"prompt": '"Hello" written on a storefront.', "category": "Text"},
        {"prompt": "A stack of 3 books.\r\nThe green one on top, the red one below.", "category": "DALL-E"},
        {"prompt": "  Two cats on the grass. ", "category": "Gary Marcus et al. "}]
    assert [bench.location(i) for i in range(4)] == [f"{path}:{n}" for n in (2, 3, 4, 6)]  # a row's first line


def test_drawbench_csv_with_bom_and_prompt_header(tmp_path):
    """A copy with a BOM and the header `Prompt`, extra columns kept as metadata."""
    path = write(tmp_path / "imagen.csv", "\ufeffPrompt,Category,Note\nA pizza cooking an oven.,Conflicting,\n"
                                          '"A sign that says ""NeurIPS"".",Text,x\n')
    assert read_benchmark(path).rows == [
        {"prompt": "A pizza cooking an oven.", "category": "Conflicting", "note": ""},
        {"prompt": 'A sign that says "NeurIPS".', "category": "Text", "note": "x"}]


@pytest.mark.parametrize("text, message", [
    ("Prompts,Category\nA red colored car.,Colors\n,Colors\n", r":3: empty Prompts"),
    ("prompt,label\nx,y\n", r":1: the DrawBench header names Prompts \(or Prompt\) and Category, once each; this one "
                            r"has \['prompt', 'label'\]"),
    ("Prompts,Category,prompt\nx,y,z\n", r":1: the DrawBench header names"),
    ("Prompts,Category\nA red colored car.,Colors\nA car, a bus.,Colors\n", r":3: 3 fields, the header has 2"),
    ("Prompts,Category\nA red colored car.,Colors\n\"Hello\" written on it.,Text\n", r":3: not valid csv"),
    ('Prompts,Category\nA red colored car.,Colors\n"A stack of books.\nThe green one,DALL-E\n', r":3: not valid csv"),
    ("", r": empty \(a DrawBench \.csv starts with a header"),
])
def test_drawbench_bad_files_name_the_line(tmp_path, text, message):
    fails(write(tmp_path / "bad.csv", text), r"bad\.csv" + message)


# ------------------------------------------------------------------------------------------------ PartiPrompts
def test_parti_tsv_cells_as_written(tmp_path):
    """No quoting: a prompt that starts with a quoted phrase keeps its quotes; leading and trailing spaces stay."""
    path = write(tmp_path / "PartiPrompts.tsv", "\ufeffPrompt\tCategory\tChallenge\tNote\n"
                 "bond\tAbstract\tBasic\tBiology-inspired concepts\n"
                 '"G I G G L E" painted on a wall\tIllustrations\tWriting & Symbols\t\n'
                 " A sloth in a go kart. \tAnimals\tFine-grained Detail\tDescription of \"Dogs Playing Poker\"\n")
    bench = read_benchmark(path)
    assert bench.format == "parti"
    assert bench.rows == [
        {"prompt": "bond", "category": "Abstract", "challenge": "Basic", "note": "Biology-inspired concepts"},
        {"prompt": '"G I G G L E" painted on a wall', "category": "Illustrations", "challenge": "Writing & Symbols",
         "note": ""},
        {"prompt": " A sloth in a go kart. ", "category": "Animals", "challenge": "Fine-grained Detail",
         "note": 'Description of "Dogs Playing Poker"'}]
    bad = write(tmp_path / "bad.tsv", "Prompt\tCategory\tChallenge\tNote\nbond\tAbstract\tBasic\t\nlonely\n")
    fails(bad, r"bad\.tsv:3: 1 fields, the header has 4")
    fails(write(tmp_path / "csvlike.tsv", "Prompt,Category\nx,y\n"), r"csvlike\.tsv:1: the PartiPrompts header")


# ------------------------------------------------------------------------------------------------ T2I-CompBench
def _compbench(folder):
    """T2I-CompBench's examples/dataset layout: per category the full list, train, val (and val's seen / unseen or
    complex's action / spatial parts, which overlap val), CRLF lines, a repeated line; new_objects.txt beside them."""
    write(folder / "color.txt", "a green bench and a blue bowl\r\na red car and a blue bowl\r\na pink cake\r\n")
    write(folder / "color_train.txt", "a pink cake\r\n")
    write(folder / "color_val.txt", "a green bench and a blue bowl\r\na red car and a blue bowl\r\n"
                                    "a green bench and a blue bowl")
    write(folder / "color_val_seen.txt", "a green bench and a blue bowl\r\n")
    write(folder / "color_val_unseen.txt", "a red car and a blue bowl\r\n")
    write(folder / "shape_train.txt", "a round clock\n")
    write(folder / "shape_val.txt", "an oval mirror\n")
    write(folder / "complex_val.txt", "a man is playing the guitar on the left of a tree\n")
    write(folder / "complex_val_action.txt", "a man is playing the guitar on the left of a tree\n")
    write(folder / "new_objects.txt", "bottle - bottles\n")
    return folder


def test_t2i_compbench_folder_reads_the_val_lists_once(tmp_path):
    folder = _compbench(tmp_path / "dataset")
    bench = read_benchmark(folder)
    assert (bench.format, bench.why) == ("t2i_compbench", "a folder of 9 T2I-CompBench category lists")
    assert [(r["prompt"], r["category"], r["split"]) for r in bench.rows] == [
        ("a green bench and a blue bowl", "color", "val"), ("a red car and a blue bowl", "color", "val"),
        ("a green bench and a blue bowl", "color", "val"),  # the file repeats it: read as written
        ("a man is playing the guitar on the left of a tree", "complex", "val"), ("an oval mirror", "shape", "val")]
    assert bench.read == ["color_val.txt", "complex_val.txt", "shape_val.txt"]
    assert bench.skipped == [
        "color.txt, color_train.txt, color_val_seen.txt, color_val_unseen.txt, complex_val_action.txt, "
        "shape_train.txt (the other splits of the same categories; T2I-CompBench tests on the _val lists: give one "
        "file as data.path to read another)", "new_objects.txt (not T2I-CompBench category lists)"]
    said = bench.describe()
    assert said.startswith(f"polyrl: data.path={folder} read as t2i_compbench (a folder of 9 T2I-CompBench category "
                           "lists): 5 prompts, 3 categories: 'color' 3, 'complex' 1, 'shape' 1\n")
    assert "not read: color.txt" in said
    assert bench.location(4) == f"{folder / 'shape_val.txt'}:1"


def test_t2i_compbench_files(tmp_path):
    folder = _compbench(tmp_path / "dataset")
    bench = read_benchmark(folder / "color_val_seen.txt")
    assert bench.rows == [{"prompt": "a green bench and a blue bowl", "category": "color", "split": "val_seen"}]
    assert bench.why == "color_val_seen.txt is one of T2I-CompBench's lists"
    bench = read_benchmark(folder / "color.txt")  # the name VBench shares: the lists beside it decide
    assert (bench.format, bench.why) == ("t2i_compbench", "color.txt beside 8 T2I-CompBench lists")
    assert [r["prompt"] for r in bench.rows] == ["a green bench and a blue bowl", "a red car and a blue bowl",
                                                 "a pink cake"]
    assert bench.rows[0] == {"prompt": "a green bench and a blue bowl", "category": "color"}
    lone = write(tmp_path / "mine" / "shape_train.txt", "a\nb\n")
    write(tmp_path / "mine" / "shape_train_more.txt", "c\n")
    write(tmp_path / "mine" / "spatial_val.txt", "d\n")
    with pytest.raises(ValueError, match=r"several lists of category shape \(shape_train\.txt, shape_train_more\.txt"
                                         r"\) and no shape_val\.txt: give one of them as data\.path"):
        read_benchmark(lone.parent)


# ------------------------------------------------------------------------------------------------ VBench
def _vbench(folder):
    """prompts_per_dimension: color.txt (the name T2I-CompBench shares), scene.txt, subject_consistency.txt (a list
    that serves three dimensions), one prompt in two lists; all_dimension.txt with the same prompts beside them."""
    write(folder / "color.txt", "a red bicycle\na green bicycle\n")
    write(folder / "scene.txt", "alley\n")
    write(folder / "subject_consistency.txt", "a person swimming in ocean\nalley\n")
    write(folder / "all_dimension.txt", "a red bicycle\na green bicycle\nalley\na person swimming in ocean\nalley\n")
    return folder


def test_vbench_per_dimension_folder(tmp_path):
    folder = _vbench(tmp_path / "prompts_per_dimension")
    bench = read_benchmark(folder)
    assert (bench.format, bench.why) == ("vbench", "a folder of 4 VBench lists")
    assert [(r["prompt"], r["category"], r["dimension"]) for r in bench.rows] == [
        ("a red bicycle", "color", ["color"]), ("a green bicycle", "color", ["color"]),
        ("alley", "scene", ["scene", "background_consistency"]),
        ("a person swimming in ocean", "subject_consistency",
         ["subject_consistency", "dynamic_degree", "motion_smoothness"]),
        ("alley", "subject_consistency", ["subject_consistency", "dynamic_degree", "motion_smoothness"])]
    assert bench.skipped == ["all_dimension.txt (the same prompts as the lists read: give it as data.path to read it)"]
    assert detect(folder / "color.txt") == ("vbench", "color.txt beside 3 VBench lists")
    assert read_benchmark(folder / "all_dimension.txt").rows[2] == {"prompt": "alley"}
    write(folder / "all_category.txt", "a dog\n")
    folder2 = write(tmp_path / "prompts" / "all_category.txt", "a dog\n").parent
    write(folder2 / "all_dimension.txt", "a cat\n")
    fails(folder2, r"prompts: holds VBench's complete lists all_category\.txt, all_dimension\.txt, different prompt "
                   r"sets: give one of them")
    cats = write(tmp_path / "prompts_per_category" / "animal.txt", "a dog running\n").parent
    write(cats / "food.txt", "a cake\n")
    assert [(r["prompt"], r["category"]) for r in read_benchmark(cats).rows] == [("a dog running", "animal"),
                                                                                ("a cake", "food")]


def test_vbench_json_files(tmp_path):
    entries = [{"prompt_en": "a bird and a cat", "dimension": ["multiple_objects"],
                "auxiliary_info": {"multiple_objects": {"object": "bird and cat"}}},
               {"prompt_en": "a person swimming", "dimension": ["human_action", "subject_consistency"]}]
    info = write(tmp_path / "VBench_full_info.json", json.dumps(entries, indent=4))
    bench = read_benchmark(info)
    assert bench.format == "vbench"
    assert bench.rows == [{"prompt": "a bird and a cat", "category": "multiple_objects", "dimension":
                           ["multiple_objects"], "auxiliary_info": {"multiple_objects": {"object": "bird and cat"}}},
                          {"prompt": "a person swimming", "category": "human_action",
                           "dimension": ["human_action", "subject_consistency"]}]
    assert [bench.location(i) for i in range(2)] == [f"{info}:2", f"{info}:13"]
    meta = write(tmp_path / "metadata" / "color.json", json.dumps([{"prompt_en": "a red bicycle", "color_en": "red"}]))
    assert read_benchmark(meta).rows == [{"prompt": "a red bicycle", "category": "color", "dimension": ["color"],
                                          "color_en": "red"}]
    bad = write(tmp_path / "bad.json", json.dumps([{"prompt_en": "x", "dimension": ["color"]}, {"prompt": "y"}],
                                                  indent=2))
    fails(bad, r"bad\.json:8: each entry needs a non-empty string 'prompt_en'")
    fails(write(tmp_path / "dims.json", '[{"prompt_en": "x", "dimension": ["colour"]}]'),
          r"dims\.json:1: 'dimension' must be a non-empty list of VBench dimensions")
    fails(write(tmp_path / "cut.json", json.dumps(entries, indent=4)[:150]), r"cut\.json:\d+: not valid JSON")


# ------------------------------------------------------------------------------------------------ shared names
def test_names_two_benchmarks_share_are_refused_unless_something_decides(tmp_path):
    lone = write(tmp_path / "lone" / "color.txt", "a red bicycle\n")
    write(tmp_path / "lone" / "notes.txt", "not a list\n")
    for path in (lone, lone.parent):
        fails(path, r"set eval\.format=t2i_compbench or eval\.format=vbench")
    assert read_benchmark(lone, "vbench").rows == [{"prompt": "a red bicycle", "category": "color",
                                                    "dimension": ["color"]}]
    assert read_benchmark(lone, "t2i_compbench").rows == [{"prompt": "a red bicycle", "category": "color"}]
    mixed = _vbench(_compbench(tmp_path / "mixed"))
    fails(mixed, r"mixed: holds T2I-CompBench's lists \(color_train\.txt, color_val\.txt, \.\.\. \(8 files\)\) and "
                 r"VBench's \(all_dimension\.txt, scene\.txt, \.\.\. \(3 files\)\); set eval\.format=")
    fails(mixed / "color.txt", r"color\.txt is both T2I-CompBench's and VBench's list name")
    bench = read_benchmark(mixed, "t2i_compbench")
    assert bench.why == "eval.format=t2i_compbench" and len(bench.rows) == 5
    assert bench.skipped[-1] == ("all_dimension.txt, new_objects.txt, scene.txt, subject_consistency.txt (not "
                                 "T2I-CompBench category lists)")


# ------------------------------------------------------------------------------------------------ Flow-GRPO lists
def test_ocr_list_detected_by_its_lines_under_any_name(tmp_path):
    for path in (tmp_path / "ocr" / "test.txt", tmp_path / "my_signs.txt"):
        write(path, 'A neon sign that says "OPEN"\n"Happy Birthday" on a cake, and "50" candles\n')
        bench = read_benchmark(path)
        assert (bench.format, bench.why) == ("ocr", "every line quotes the text to render: Flow-GRPO's OCR list")
        assert [r["text"] for r in bench.rows] == ["OPEN", "Happy Birthday"]
    bad = write(tmp_path / "ocr" / "train.txt", 'A sign that says "STOP"\n\nA sign without quotes\n')
    assert detect_format(bad) == "polyrl"
    fails(bad, r"train\.txt:3: no text in double quotes", "ocr")
    pick = write(tmp_path / "pickscore" / "test.txt", "\ufeffa cat in a hat\r\na dog on a log\r\n")
    assert detect_format(pick) == "pickscore"
    assert read_benchmark(pick).rows == [{"prompt": "a cat in a hat"}, {"prompt": "a dog on a log"}]  # BOM, CRLF gone
    assert detect_format(write(tmp_path / "mine.txt", "a cat\n")) == "polyrl"


# ------------------------------------------------------------------------------------------------ forcing, bad files
def test_a_forced_format_that_does_not_fit_is_an_error(tmp_path):
    csv_file = write(tmp_path / "drawbench.csv", "Prompts,Category\nA red colored car.,Colors\n")
    fails(csv_file, r"eval\.format=pickscore reads a \.txt file; data\.path='.*drawbench\.csv' is a \.csv file",
          "pickscore")
    fails(csv_file, r"eval\.format=polyrl reads a \.txt / \.jsonl / \.parquet file", "polyrl")
    fails(csv_file, r"eval\.format=parti reads a \.tsv file", "parti")
    fails(write(tmp_path / "list.txt", "a red car\n"), r"eval\.format=t2i_compbench: list\.txt is not named as a "
                                                      r"T2I-CompBench list", "t2i_compbench")
    fails(write(tmp_path / "list.txt", "a red car\n"), r"eval\.format=vbench: list\.txt is not named", "vbench")
    fails(tmp_path, r"eval\.format=drawbench reads a \.csv file; data\.path=.* is a folder", "drawbench")
    fails(write(tmp_path / "p.jsonl", '{"prompt": "a"}\n'), r"p\.jsonl:1: no 'tag'", "geneval")
    with pytest.raises(ValueError, match=r"eval\.format='partii' is not a format \(did you mean parti\?\); allowed: "
                                         r"polyrl, geneval"):
        read_benchmark(csv_file, "partii")
    txt = write(tmp_path / "color_val.txt", "a red car\n")
    assert read_benchmark(txt, "polyrl").rows == [{"prompt": "a red car"}]


@pytest.mark.parametrize("name, content, message", [
    ("empty.csv", b"", r"empty\.csv: empty"),
    ("bom_only.txt", b"\xef\xbb\xbf\n", r"bom_only\.txt: holds no prompts"),
    ("blank.jsonl", b"\n \n", r"blank\.jsonl: holds no prompts"),
    ("binary.txt", b"a cat\n\x7fELF\x02\x01\x00\x00", r"binary\.txt:2: binary data \(a NUL byte\), not a text file"),
    ("utf16.csv", "Prompts,Category\n".encode("utf-16"), r"utf16\.csv:1: UTF-16 text"),
    ("latin1.tsv", "Prompt\tCategory\nun caf\xe9\tFood\n".encode("latin-1"),
     r"latin1\.tsv:2: not UTF-8 text \(byte 0xe9 at column 7\)"),
    ("cut.jsonl", b'{"prompt": "a"}\n{"prompt": "b', r"cut\.jsonl:2: not valid JSON"),
    ("odd.yaml", b"prompt: a\n", r"a \.yaml file is no prompt format"),
])
def test_bad_files_name_file_and_line(tmp_path, name, content, message):
    fails(write(tmp_path / name, content), message)


def test_training_reads_benchmark_files_as_eval_does(tmp_path):
    tsv = write(tmp_path / "PartiPrompts.tsv", 'Prompt\tCategory\tChallenge\tNote\n"Hi" on a sign \tArts\tBasic\t\n')
    bench = read_prompt_data(tsv)
    assert bench.format == "parti" and bench.rows[0]["prompt"] == '"Hi" on a sign '
    txt = write(tmp_path / "color.txt", "\ufeff  a red car \n")  # a polyrl .txt for training: no refusal, stripped
    assert read_prompt_data(txt).rows == [{"prompt": "a red car"}]


# ------------------------------------------------------------------------------------------------ the commands
def _eval(data, *extra):
    return main(["eval", "model.path=polyrl/assets/toy_shapes", f"data.path={data}", "eval.scorers=[nope]", *extra])


def _lines(capsys):
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_eval_says_what_it_read_before_sampling(tmp_path, capsys):
    folder = _compbench(tmp_path / "dataset")
    assert _eval(folder) == 2  # the unknown scorer stops it after the data is read
    lines = _lines(capsys)
    assert lines[0] == (f"polyrl: data.path={folder} read as t2i_compbench (a folder of 9 T2I-CompBench category "
                        "lists): 5 prompts, 3 categories: 'color' 3, 'complex' 1, 'shape' 1")
    assert lines[1] == "polyrl:   read: color_val.txt, complex_val.txt, shape_val.txt"
    assert lines[2].startswith("polyrl:   not read: color.txt, color_train.txt")
    assert "'nope' is not a registered reward" in lines[3] and len(lines) == 4


@pytest.mark.parametrize("command", ["eval", "train"])
def test_every_bad_input_is_one_error_line(tmp_path, capsys, command):
    bad = {"cut.jsonl": (b'{"prompt": "a"}\n{"prompt": "b', ":2: not valid JSON"),
           "empty.txt": (b"", ": holds no prompts"),
           "binary.txt": (b"\x00\x01", ":1: binary data"),
           "wrong.csv": (b"prompt,label\nx,y\n", ":1: the DrawBench header names"),
           "cut.csv": (b'Prompts,Category\n"a cat,\n', ":2: not valid csv")}
    for name, (content, message) in bad.items():
        if command == "train" and name in ("empty.txt", "cut.csv"):
            continue  # the same readers; test_cli_errors.py has train's empty file
        path = write(tmp_path / name, content)
        if command == "eval":
            code = _eval(path)
        else:  # no model there: the data error comes first
            code = main(["train", f"model.path={tmp_path / 'no-model'}", f"data.path={path}", "data.heldout_path=null",
                         f"trainer.output_dir={tmp_path / 'run'}"])
        lines = _lines(capsys)
        assert code == 2 and lines == [lines[0]] and lines[0].startswith(f"polyrl: error: {path}{message}"), lines
    if command == "train":  # a benchmark's file: said as eval says it; a row the reward cannot score named by line
        tsv = write(tmp_path / "PartiPrompts.tsv", "Prompt\tCategory\tChallenge\tNote\na red circle\tArts\tBasic\t\n"
                                                   "a purple hexagon \tArts\tBasic\t\n")
        assert main(["train", f"model.path={tmp_path / 'no-model'}", f"data.path={tsv}", "data.heldout_path=null",
                     f"trainer.output_dir={tmp_path / 'run'}"]) == 2
        lines = _lines(capsys)
        assert lines[0] == (f"polyrl: data.path={tsv} read as parti (a .tsv file: PartiPrompts' table): 2 prompts, "
                            "1 category: 'Arts' 2")
        assert lines[1].startswith(f"polyrl: error: {tsv}:3: shapes reward cannot parse prompt 'a purple hexagon '")
        assert len(lines) == 2
    if command == "eval":
        assert _eval(tmp_path / "wrong.csv", "eval.format=drawbenh") == 2
        assert _lines(capsys) == ["polyrl: error: eval.format='drawbenh' is not a format (did you mean drawbench?); "
                                  "allowed: polyrl, geneval, drawbench, parti, t2i_compbench, ocr, pickscore, vbench"]
        lone = write(tmp_path / "lone" / "color.txt", "a red bicycle\n")
        assert _eval(lone) == 2
        assert re.fullmatch(r"polyrl: error: .*set eval\.format=t2i_compbench or eval\.format=vbench",
                            _lines(capsys)[0])

"""Offline preference pairs (polyrl/data/pairs.py): the loader's checks and an offline Diffusion-DPO CLI run."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from polyrl.cli.main import main
from polyrl.data.pairs import load_pairs


def _image(path, colour):
    Image.fromarray(np.full((32, 32, 3), colour, dtype=np.uint8)).save(path)
    return path


@pytest.fixture()
def pair_dir(tmp_path):
    (tmp_path / "img").mkdir()
    for i, colour in enumerate([(255, 0, 0), (0, 0, 255), (0, 255, 0), (30, 30, 30)]):
        _image(tmp_path / "img" / f"{i}.png", colour)
    return tmp_path


def _write_jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_jsonl_pairs_load_with_relative_paths_and_metadata(pair_dir):
    path = _write_jsonl(pair_dir / "pairs.jsonl", [
        {"prompt": "a red circle", "chosen": "img/0.png", "rejected": "img/1.png", "source": "x"},
        {"prompt": "a green triangle", "chosen": str(pair_dir / "img" / "2.png"), "rejected": "img/3.png"},
    ])
    rows = load_pairs(path)
    assert [r["line"] for r in rows] == [1, 2]
    assert rows[0]["chosen"] == str(pair_dir / "img" / "0.png") and rows[0]["source"] == "x"


def test_bad_rows_are_reported_by_line_number(pair_dir):
    path = _write_jsonl(pair_dir / "pairs.jsonl", [
        {"prompt": "ok", "chosen": "img/0.png", "rejected": "img/1.png"},
        {"prompt": "no rejected", "chosen": "img/0.png"},
        "{not json",
        {"prompt": "missing file", "chosen": "img/0.png", "rejected": "img/nope.png"},
        {"prompt": 3, "chosen": "img/0.png", "rejected": "img/1.png"},
    ])
    with pytest.raises(ValueError) as e:
        load_pairs(path)
    msg = str(e.value)
    assert "4 bad pair row(s)" in msg
    assert "line 2: missing, empty or non-string rejected" in msg
    assert "line 3: not valid JSON" in msg
    assert f"line 4: rejected image not found: {pair_dir / 'img' / 'nope.png'}" in msg
    assert "line 5: missing, empty or non-string prompt" in msg
    assert "line 1" not in msg


def test_parquet_pairs_and_bad_row(pair_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = pair_dir / "pairs.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "chosen": ["img/0.png", "img/2.png"],
                             "rejected": ["img/1.png", "img/9.png"]}), path)
    with pytest.raises(ValueError, match=r"line 2: rejected image not found"):
        load_pairs(path)


def test_unsupported_suffix(pair_dir):
    (pair_dir / "pairs.csv").write_text("prompt,chosen,rejected\n")
    with pytest.raises(ValueError, match=r"use a \.jsonl or \.parquet file"):
        load_pairs(pair_dir / "pairs.csv")


def test_offline_dpo_trains_through_the_cli(tiny_sd3_dir, shape_prompts_file, pair_dir, tmp_path):
    pairs = _write_jsonl(pair_dir / "pairs.jsonl", [
        {"prompt": "two red circles above a blue square", "chosen": "img/0.png", "rejected": "img/1.png"},
        {"prompt": "a green triangle", "chosen": "img/2.png", "rejected": "img/3.png"},
        {"prompt": "three yellow squares", "chosen": "img/1.png", "rejected": "img/3.png"},
    ])
    out = tmp_path / "run"
    args = ["train", "recipe=toy_common", "algorithm=diffusion_dpo", f"model.path={tiny_sd3_dir}",
            f"data.pairs_path={pairs}", f"trainer.output_dir={out}",
            "trainer.max_steps=2", "rollout.height=32", "rollout.width=32", "rollout.num_steps=3",
            "rollout.sde_window_size=2", "rollout.sde_window_range=[0,1]", "data.prompts_per_step=2", "model.max_sequence_length=16", "trainer.eval_every=0", "trainer.save_every=2",
            "trainer.progress=false", "trainer.tensorboard=false", "reward=jpeg_compressibility"]
    assert main(args) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["train/samples"] == 2 and rows[0]["grad_norm"] > 0 and "dpo/accuracy" in rows[0]
    assert "time/encode" in rows[0] and "reward/mean" not in rows[0]
    assert (out / "checkpoints" / "step_000002" / "trainer_state.pt").is_file()


def test_pairs_need_a_pair_algorithm(shape_prompts_file, pair_dir, tmp_path, capsys):
    args = ["train", f"model.path={tmp_path}", f"data.path={shape_prompts_file}",
            f"data.pairs_path={pair_dir / 'pairs.jsonl'}", f"trainer.output_dir={tmp_path / 'run'}"]
    assert main(args) == 2
    # the default recipe's algorithm, DiffusionNFT, trains on its own rollouts
    assert ("data.pairs_path is set but algorithm diffusion_nft does not train on preference pairs; allowed: "
            "diffusion_dpo") in capsys.readouterr().err


def test_pairs_path_makes_the_prompt_file_optional():
    from omegaconf import OmegaConf

    from polyrl.config import ConfigError, _compose, validate

    raw = _compose(["recipe=toy_common", "algorithm=diffusion_dpo", "model.path=/ckpt", "data.pairs_path=pairs.jsonl"])
    OmegaConf.update(raw, "data.path", "???")  # no prompt file: the pairs are the data
    assert validate(raw).data.pairs_path == "pairs.jsonl"
    OmegaConf.update(raw, "data.pairs_path", None)
    with pytest.raises(ConfigError, match=r"^data.path must be set"):
        validate(raw)

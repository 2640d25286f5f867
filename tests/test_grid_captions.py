"""Caption extras: a reward's per-sample `caption` strings (rewards/base.py RewardOutput; e.g. what the OCR read) and
the extra held-out scorers' values (`trainer.eval_scorers`) under each tile of the held-out sample grids and in the
held-out samples' JSON lines, never as metrics."""

import json

import numpy as np
import torch

from polyrl.cli.main import main
from polyrl.rewards import REWARDS, RewardOutput
from polyrl.rewards.base import caption_texts
from polyrl.trainer import samples as samples_module
from polyrl.trainer.logging import grid_image


class Captioned:
    """The training reward: scores by position, a caption naming the prompt's last word, and a numeric extra."""

    def __call__(self, images, prompts, metadata=None):
        n = len(images)
        return RewardOutput(torch.linspace(0, 1, n), {"caption": [f"saw {p.split()[-1]}" for p in prompts],
                                                      "worded/x": [1.0] * n})


class Steady:
    def __call__(self, images, prompts, metadata=None):
        return RewardOutput(torch.full((len(images),), 0.5))


class Noted:
    """An extra scorer with a caption of its own."""

    def __call__(self, images, prompts, metadata=None):
        return RewardOutput(torch.full((len(images),), 0.25), {"caption": ["noted here"] * len(images)})


def test_caption_texts_joins_every_caption_extra_per_sample():
    extras = {"caption": ["a", None, ""], "score": [1.0, 2.0, 3.0], "x/caption": ["b", "c", ""],
              "bad/caption": ["too", "short"], "y/captions": ["no", "no", "no"]}
    assert caption_texts(extras, 3) == ["a\nb", "c", ""]
    assert caption_texts({}, 2) == ["", ""]


def test_grid_notes_add_their_lines_under_the_tile():
    images = torch.full((2, 3, 96, 96), 0.5)  # 192 px tiles: each note line fits on one line
    plain = grid_image(images, ["p", "q"], [0.1, 0.2])
    noted = grid_image(images, ["p", "q"], [0.1, 0.2], notes=["target 'HI', read 'H1'\nsteady=0.50", ""])
    assert noted.size == (plain.size[0], plain.size[1] + 2 * 12)  # two more lines of 12 px
    dark = lambda im, box: int(np.asarray(im.crop(box).convert("L")).min())  # noqa: E731
    assert dark(noted, (0, plain.size[1], 192, noted.size[1])) < 128  # tile 0's two note lines: drawn
    assert dark(noted, (192, plain.size[1], 384, noted.size[1])) == 255  # tile 1 has no note


def test_heldout_grid_and_samples_carry_the_caption_extras(tiny_sd3_dir, shape_prompts_file, tmp_path,
                                                           monkeypatch):
    for name, cls in (("worded", Captioned), ("steady", Steady), ("noted", Noted)):
        monkeypatch.setitem(REWARDS, name, cls)
    grids = []
    real_save_grid = samples_module.save_grid

    def spy(images, captions, scores, path, **kw):
        grids.append((path.name, list(captions), kw.get("notes")))
        return real_save_grid(images, captions, scores, path, **kw)

    monkeypatch.setattr(samples_module, "save_grid", spy)
    out = tmp_path / "run"
    assert main(["train", f"model.path={tiny_sd3_dir}", f"data.path={shape_prompts_file}",
                 f"data.heldout_path={shape_prompts_file}", f"trainer.output_dir={out}", "trainer.max_steps=1",
                 "rollout.height=32", "rollout.width=32", "rollout.num_steps=2", "rollout.n=2",
                 "data.prompts_per_step=2", "rollout.batch_size=4", "model.max_sequence_length=16",
                 "trainer.eval_samples=4", "trainer.num_validation=2", "trainer.eval_every=1", "trainer.save_every=0",
                 "trainer.progress=false", "trainer.loggers=[]", "reward=worded", "rollout.sde_window_size=1",
                 "rollout.sde_window_range=[0,1]", "trainer.eval_scorers=[steady,noted]"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["reward_extra/worded/x"] == 1.0  # numeric extras stay metrics ...
    assert not [k for r in rows for k in r if k.endswith("caption")]  # ... caption strings do not
    for step in (0, 1):
        samples = [json.loads(line) for line in (out / "samples" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        assert len(samples) == 4
        for s in samples:
            assert s["caption"] == f"saw {s['prompt'].split()[-1]}\nsteady=0.50\nnoted=0.25 noted here"
    # written under a temporary name (".step_000000.png") and renamed (trainer/evaluation.py SampleFiles)
    assert [g[0].lstrip(".") for g in grids] == ["step_000000.png", "step_000001.png"]
    assert sorted(p.name for p in (out / "samples").glob("*.png")) == ["step_000000.png", "step_000001.png"]
    for _, captions, notes in grids:
        assert len(notes) == 2 and (out / "samples" / "step_000001.png").is_file()
        assert notes == [f"saw {c.split()[-1]}\nsteady=0.50\nnoted=0.25 noted here" for c in captions]


"""First contact: help, unknown commands, data / device / server errors as one `polyrl: error:` line (before the
model loads), the toy recipe's model-path trap, a reward of one's own (`--import`), jpeg_incompressibility."""

from __future__ import annotations

import base64
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import numpy as np
import pytest
import torch

from polyrl.cli.main import main


def _errors(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("polyrl:")]


def _tiny(model_dir, prompts, out, *extra):
    return ["train", f"model.path={model_dir}", f"data.path={prompts}", f"trainer.output_dir={out}",
            "trainer.max_steps=1", "rollout.height=32", "rollout.width=32", "rollout.num_steps=2", "rollout.n=2",
            "data.prompts_per_step=2", "rollout.batch_size=4", "model.max_sequence_length=16",
            "trainer.progress=false", "trainer.tensorboard=false", "trainer.eval_every=0", "trainer.save_every=0",
            "rollout.sde_window_size=1", "rollout.sde_window_range=[0,1]", *extra]


def test_train_help_lists_groups_and_common_keys(capsys):
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: polyrl train")
    for group in ("recipe", "model", "algorithm", "reward", "actor"):
        assert f"\n  {group} " in out
    assert "jpeg_incompressibility" in out and "qwen_image_flowgrpo" in out
    for key in ("model.path", "data.path", "trainer.max_steps", "trainer.resume", "trainer.loggers", "--import"):
        assert key in out
    assert "[the embedded toy_shapes]" in out  # the value the default run uses


def test_unknown_command_says_so(capsys):
    assert main(["trian"]) == 2
    assert _errors(capsys) == ["polyrl: error: unknown command 'trian' (did you mean train?); commands: train, "
                               "config, sample, eval, export, pretrain-toy, bench, plan, serve-reward, view (polyrl --help)"]


@pytest.mark.parametrize("name, content, expected", [
    ("empty.txt", b"\n  \n", "{path}: holds no prompts (the file is empty or only blank lines)"),
    ("bad.jsonl", b'{"prompt": "a red circle"}\n{"prompt": oops}\n', "{path}:2: not valid JSON"),
    ("latin1.txt", "a red circle\na caf\xe9 square\n".encode("latin-1"),
     "{path}:2: not UTF-8 text (byte 0xe9 at column 6); save the file as UTF-8"),
    ("latin1.jsonl", '{"prompt": "a red circle"}\n{"prompt": "caf\xe9"}\n'.encode("latin-1"),
     "{path}:2: not UTF-8 text (byte 0xe9 at column 16)"),
    ("broken.parquet", b"PAR1 not really", "{path}: not a readable parquet file"),
])
def test_data_errors_name_file_and_line_before_the_model_loads(tmp_path, capsys, name, content, expected):
    path = tmp_path / name
    path.write_bytes(content)
    # the model path does not exist: the data error must come first
    code = main(["train", f"model.path={tmp_path / 'no-model'}", f"data.path={path}", "data.heldout_path=null",
                 f"trainer.output_dir={tmp_path / 'run'}"])
    errors = _errors(capsys)
    assert code == 2 and len(errors) == 1, errors
    assert errors[0].startswith("polyrl: error: " + expected.format(path=path)), errors


def test_a_prompt_the_shapes_reward_cannot_parse_is_named(tmp_path, capsys):
    path = tmp_path / "p.txt"
    path.write_text("a red circle\n\na purple hexagon dancing\n")
    code = main(["train", f"model.path={tmp_path / 'no-model'}", f"data.path={path}", "data.heldout_path=null",
                 f"trainer.output_dir={tmp_path / 'run'}"])
    errors = _errors(capsys)
    assert code == 2 and len(errors) == 1
    assert errors[0].startswith(f"polyrl: error: {path}:3: shapes reward cannot parse prompt 'a purple hexagon")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_a_gpu(tmp_path, capsys):
    assert main(["train", "trainer.device=cuda", f"trainer.output_dir={tmp_path / 'run'}"]) == 2
    errors = _errors(capsys)
    assert len(errors) == 1 and errors[0].startswith("polyrl: error: trainer.device=cuda but torch ")
    assert "use trainer.device=cpu" in errors[0]


def test_a_checkpointing_share_outside_zero_one_is_a_config_error(tmp_path, capsys):
    assert main(["train", "actor.gradient_checkpointing=1.5", f"trainer.output_dir={tmp_path / 'run'}"]) == 2
    errors = _errors(capsys)
    assert errors == ["polyrl: config error: actor.gradient_checkpointing=1.5 must be true, false or a share of the blocks "
                      "in (0, 1]"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Health(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        body = json.dumps({"status": "ok" if self.path == "/health" else "?"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_http_reward_checks_health_before_the_model_loads(tmp_path, capsys):
    common = ["train", f"model.path={tmp_path / 'no-model'}", "reward=http", f"trainer.output_dir={tmp_path / 'r'}"]
    dead = f"http://127.0.0.1:{_free_port()}"
    assert main([*common, f"reward.url={dead}", "reward.connect_timeout=2"]) == 2
    errors = _errors(capsys)
    assert len(errors) == 1 and errors[0].startswith(f"polyrl: error: reward.url={dead}: GET {dead}/health failed")
    server = HTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:  # a healthy server: the run gets as far as the (missing) model
        assert main([*common, f"reward.url=http://127.0.0.1:{server.server_port}"]) == 2
        assert "model_index.json" in capsys.readouterr().err
    finally:
        server.shutdown()


def test_another_model_under_the_toy_recipe_is_refused(capsys):
    assert main(["train", "model=qwen_image"]) == 2
    errors = _errors(capsys)
    assert len(errors) == 1 and errors[0].startswith("polyrl: config error: model=qwen_image under recipe toy_shapes:")
    assert "embedded sd3 toy model" in errors[0] and "recipe=qwen_image_flowgrpo" in errors[0]
    assert main(["config", "model=sd3"]) == 0  # the toy recipe's own family is fine


def test_a_data_path_of_your_own_drops_the_recipes_heldout_file(tmp_path, capsys):
    """`model=causal_lm algorithm=grpo model.path=… data.path=… reward=math_answer` under a toy shapes recipe must not
    evaluate on the toy's shapes_heldout.jsonl: it is dropped with a note, unless data.heldout_path is set too. The
    recipe is toy_flow_grpo, whose algorithm keys (clip_range, kl_beta) grpo also takes; the default's DiffusionNFT
    keys are not grpo's, so under the default the same command stops at that key."""
    from omegaconf import OmegaConf

    from polyrl.config import ASSETS

    def config(*overrides):
        assert main(["config", *overrides]) == 0
        out = capsys.readouterr()
        return OmegaConf.create(out.out).data, out.err

    data = tmp_path / "math.jsonl"
    data.write_text('{"prompt": "1+1?", "answer": "2"}\n')
    mine = ["model=causal_lm", "algorithm=grpo", f"model.path={tmp_path}", f"data.path={data}", "reward=math_answer"]
    assert main(["config", *mine]) == 2
    assert "unknown key algorithm.mix_beta for algorithm.name=grpo" in _errors(capsys)[0]
    mine = ["recipe=toy_flow_grpo", *mine]
    got, err = config(*mine)
    assert got.heldout_path is None and got.path == str(data)
    assert "polyrl: note: data.path=" in err and "shapes_heldout.jsonl" in err and "data.heldout_path=FILE" in err
    held = tmp_path / "held.jsonl"
    got, err = config(*mine, f"data.heldout_path={held}")  # the user's own held-out file stays
    assert got.heldout_path == str(held) and "note" not in err
    toy_heldout = str(ASSETS / "prompts" / "shapes_heldout.jsonl")
    assert config()[0].heldout_path == toy_heldout  # the default run keeps its held-out prompts
    got, err = config(f"data.path={ASSETS / 'prompts' / 'shapes_train.jsonl'}")  # the recipe's own data, spelled out
    assert got.heldout_path == toy_heldout and "note" not in err
    # `polyrl train` shows the note once the run has started: an error before then stays the only line
    assert main(["train", *mine, f"trainer.output_dir={tmp_path / 'run'}"]) == 2  # model.path holds no model
    errors = _errors(capsys)
    assert len(errors) == 1 and errors[0].startswith("polyrl: error:"), errors


MY_REWARDS = '''
import torch
from polyrl.rewards import RewardOutput, register_reward


@register_reward("brightness")
class Brightness:
    """Mean pixel value, or closeness to `target` when one is given."""

    def __init__(self, target: float | None = None):
        self.target = target

    def __call__(self, images, prompts, metadata):
        mean = images.mean(dim=(1, 2, 3))
        score = mean if self.target is None else -(mean - self.target).abs()
        return RewardOutput(score, {"brightness": mean.tolist()})
'''


def test_a_reward_in_the_users_own_file(tiny_sd3_dir, shape_prompts_file, tmp_path, capsys):
    file = tmp_path / "my_rewards.py"
    file.write_text(MY_REWARDS)
    assert main(["config", "--import", str(file), "reward=brightness", "reward.target=0.3"]) == 0
    assert "reward:\n  name: brightness\n  target: 0.3\n" in capsys.readouterr().out
    run = tmp_path / "run"
    assert main(_tiny(tiny_sd3_dir, shape_prompts_file, run, "reward=brightness") + ["--import", str(file)]) == 0
    (row,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # no target: the score is the brightness itself
    assert row["reward/mean"] == pytest.approx(row["reward_extra/brightness"], abs=1e-6)
    capsys.readouterr()
    assert main(["train", "--import", str(tmp_path / "nope.py")]) == 2
    assert _errors(capsys) == [f"polyrl: error: --import {tmp_path / 'nope.py'}: no such file"]


def test_serve_reward_imports_the_users_file(tmp_path):
    file = tmp_path / "my_rewards.py"
    file.write_text(MY_REWARDS)
    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "polyrl", "serve-reward", "--import", str(file),
                             "reward=brightness", "--host", "127.0.0.1", "--port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        import httpx
        from PIL import Image

        deadline = time.time() + 60
        while True:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).json()
                break
            except httpx.HTTPError:
                assert proc.poll() is None and time.time() < deadline, proc.stderr.read().decode()[-2000:]
                time.sleep(0.2)
        assert health["reward"] == "brightness"
        image = np.full((8, 8, 3), 51, dtype=np.uint8)  # 51/255 = 0.2
        buf = io.BytesIO()
        Image.fromarray(image).save(buf, format="PNG")
        body = {"images": [base64.b64encode(buf.getvalue()).decode()], "prompts": ["x"]}
        scores = httpx.post(f"http://127.0.0.1:{port}/score", json=body, timeout=30).json()["scores"]
        assert scores == pytest.approx([0.2], abs=1e-6)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_jpeg_incompressibility_is_a_reward_option(tiny_sd3_dir, shape_prompts_file, tmp_path):
    run = tmp_path / "run"
    assert main(_tiny(tiny_sd3_dir, shape_prompts_file, run, "reward=jpeg_incompressibility")) == 0
    (row,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert row["reward/mean"] == pytest.approx(row["reward_extra/jpeg/kilobytes"]) and row["reward/mean"] > 0

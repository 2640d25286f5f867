import json
import os
import signal
import subprocess
import sys
import tempfile

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", min(2, os.cpu_count() or 1))))

# `python -m pytest -m "not slow"` leaves these out (pyproject.toml registers the marker; `python -m pytest`, the
# README's command and CI's, runs everything). A file name marks every test in it, `file::test` one test.
SLOW = {
    # several processes: torchrun ranks, Ray clusters, signalled or restarted processes, torch.compile
    "test_distributed.py", "test_parallel_world2.py", "test_parallel_full.py", "test_parallel_wan.py",
    "test_token_distributed.py", "test_fsdp2_inputs.py", "test_veomni_backend.py", "test_ray_stages.py",
    "test_ray_weight_sync.py", "test_reward_http_restart.py", "test_checkpoint_signals.py", "test_compile_cache.py",
    "test_elastic.py",
    "test_bench.py",
    # many or long training runs (measured: tens of seconds to minutes each on 2 cores)
    "test_algorithms_cli.py", "test_export.py", "test_wan_train.py", "test_pretrain_motion.py", "test_eval_toy.py",
    "test_bagel.py::test_two_flow_grpo_steps_through_the_cli",
    "test_cli_errors.py::test_serve_reward_imports_the_users_file",
    # a training run over a judge server (transformers serve) that goes away mid-run, resumed when it is back
    "test_judge_openai.py::test_train_over_the_served_judge_outage_and_resume",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        name = item.path.name
        if name in SLOW or f"{name}::{item.originalname}" in SLOW:
            item.add_marker(pytest.mark.slow)


def train_in_process(args: list[str]) -> None:
    """`polyrl train ARGS` in this process at one CPU thread: the one-process reference of a `torchrun` test (each
    rank runs with OMP_NUM_THREADS=1), without starting a Python of its own."""
    from polyrl.cli.main import main

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["train", *args]) == 0
    finally:
        torch.set_num_threads(threads)


class Background:
    """A command started now and awaited later: a `torchrun` launch (whose ranks run at one thread each) runs while
    this process trains the one-process reference at one thread, instead of after it with a core idle (CI has two).
    Its output goes to files (a pipe nobody reads could fill and stop it); `wait` returns the CompletedProcess, and
    leaving the `with` block before that ends the command and its children (its own process group)."""

    def __init__(self, cmd: list[str], **kwargs):
        self._out, self._err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=self._err, text=True, start_new_session=True,
                                     **kwargs)

    def wait(self, timeout: float) -> subprocess.CompletedProcess:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._end()
            raise
        self._out.seek(0)
        self._err.seek(0)
        return subprocess.CompletedProcess(self.proc.args, code, self._out.read(), self._err.read())

    def __enter__(self):
        return self

    def _end(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __exit__(self, *exc):
        self._end()
        self._out.close()
        self._err.close()


def launch_runs(runs: dict[str, list[str]], root, nproc: int = 2) -> Background:
    """`polyrl train` with each override list of `runs`, one after the other in each of `nproc` torchrun ranks, in
    one launch started now (layouts_worker.py: the process group is kept between runs; rank 0 writes each run's exit
    code to root/codes.json)."""
    plan = root / "plan.json"
    plan.write_text(json.dumps({name: ["train", *args] for name, args in runs.items()}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    worker = os.path.join(os.path.dirname(__file__), "layouts_worker.py")
    return Background([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                       worker, str(plan), str(root / "codes.json")], cwd=root, env=env)


SHAPE_PROMPTS = [
    "two red circles above a blue square",
    "a green triangle",
    "three yellow squares",
    "a blue circle to the left of a red triangle",
]


@pytest.fixture(scope="session")
def tiny_sd3_dir(tmp_path_factory):
    """A tiny SD3 pipeline with all three text encoders, saved with save_pretrained."""
    from polyrl.models.tiny import TinySD3Spec, save_tiny_sd3

    words = sorted({w for p in SHAPE_PROMPTS for w in p.split()})
    path = tmp_path_factory.mktemp("tiny_sd3")
    return save_tiny_sd3(TinySD3Spec(words=words, image_size=32), path)


@pytest.fixture(scope="session")
def shape_prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "prompts.txt"
    path.write_text("\n".join(SHAPE_PROMPTS) + "\n")
    return path


@pytest.fixture(scope="session")
def tiny_wan_dir(tmp_path_factory):
    """A tiny Wan2.1 text-to-video pipeline (UniPC scheduler with flow_shift 3.0), saved with save_pretrained."""
    from polyrl.models.tiny import TinyWanSpec, save_tiny_wan

    words = sorted({w for p in SHAPE_PROMPTS for w in p.split()})
    path = tmp_path_factory.mktemp("tiny_wan")
    return save_tiny_wan(TinyWanSpec(words=words, layout="wan2.1"), path)


EDIT_PROMPTS = ["make the circle red", "turn the square blue", "add a green triangle"]


@pytest.fixture(scope="session")
def edit_data_dir(tmp_path_factory):
    """Source images for edit tests (random RGB PNGs of different aspect ratios, height×width 40×48, 80×32, 32×32,
    under images/) and an edit-region mask (masks/square.png: white = the region the edit may change, a 12×16 block)."""
    import numpy as np
    from PIL import Image

    root = tmp_path_factory.mktemp("edit_data")
    (root / "images").mkdir()
    (root / "masks").mkdir()
    rng = np.random.default_rng(0)
    for name, (h, w) in {"a.png": (40, 48), "b.png": (80, 32), "c.png": (32, 32)}.items():
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / "images" / name)
    mask = np.zeros((32, 32), dtype=np.uint8)
    mask[8:20, 4:20] = 255
    Image.fromarray(mask).save(root / "masks" / "square.png")
    return root


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    """A tiny random Qwen3ForCausalLM with a byte-level tokenizer built offline and a ChatML chat template."""
    from polyrl.models.tiny_lm import save_tiny_causal_lm

    return save_tiny_causal_lm(tmp_path_factory.mktemp("tiny_qwen3"))

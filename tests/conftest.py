import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", min(2, os.cpu_count() or 1))))

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

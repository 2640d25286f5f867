"""Qwen-Image-Edit and Edit-Plus against diffusers' QwenImageEditPipeline / QwenImageEditPlusPipeline on tiny saved
pipelines: the conditioning against the pipelines' encode_prompt and VAE encoding, ODE sampling with true CFG
against the pipelines' denoising loop, the FLOP count against the executed ops, and the recipes through the CLI.

The pipelines resize conditions to a 1024² area (Plus: 384² for the VL encoder), which makes a tiny call take a
minute; the reference runs with those areas patched to the adapters' `condition_size` / `vl_condition_size`. The
pipelines' `Qwen2VLProcessor` cannot be built without torchvision (its video half), so the reference's processor is
built with its class check patched out; the adapters do not use it (they expand the image pads themselves)."""

import json
import math

import pytest
import torch
from conftest import EDIT_PROMPTS
from flop_count import count_flops, dispatch_attention
from omegaconf import OmegaConf
from PIL import Image

from polyrl.cli.main import main
from polyrl.latents import MediaShape
from polyrl.models import build_model
from polyrl.models.base import Guidance
from polyrl.models.qwen_image import pack_latents, qwen_image_forward_flops, unpack_latents
from polyrl.models.qwen_image_edit import EDIT_SYSTEM, condition_dims, expand_image_pads, grid_groups
from polyrl.models.tiny import TinyQwenImageEditSpec, save_tiny_qwen_image_edit
from polyrl.sampling.diffusion import RolloutNoise, SamplingPlan, sample_latents

WORDS = sorted({w for p in EDIT_PROMPTS for w in p.split()})
# condition sizes of the tests (published: 1024, and 384 for Edit-Plus's VL copy): the 40×48 source becomes 64×64
# (VL: 64×32), the 80×32 one 32×96 (VL: 32×64)
SIDE, VL_SIDE = 64, 48
NEGATIVE = " "


@pytest.fixture(scope="module")
def edit_dir(tmp_path_factory):
    return save_tiny_qwen_image_edit(TinyQwenImageEditSpec(words=WORDS), tmp_path_factory.mktemp("tiny_edit"))


@pytest.fixture(scope="module")
def plus_dir(tmp_path_factory):
    return save_tiny_qwen_image_edit(TinyQwenImageEditSpec(words=WORDS, plus=True),
                                     tmp_path_factory.mktemp("tiny_edit_plus"), seed=1)


def _adapter(path, plus: bool, **kw):
    cfg = {"name": "qwen_image_edit_plus" if plus else "qwen_image_edit", "path": str(path), "dtype": "float32",
           "max_sequence_length": 512, "condition_size": SIDE, "vl_condition_size": VL_SIDE if plus else None,
           "negative_prompt": NEGATIVE, **kw}
    return build_model(OmegaConf.create(cfg), torch.device("cpu"))


@pytest.fixture(scope="module")
def edit(edit_dir):
    return _adapter(edit_dir, plus=False)


@pytest.fixture(scope="module")
def plus(plus_dir):
    return _adapter(plus_dir, plus=True)


def _pipeline(path, plus: bool, monkeypatch):
    """The diffusers pipeline from the same directory, its condition areas patched to the tests' sizes."""
    from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit, pipeline_qwenimage_edit_plus
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: type(arg))
    processor = Qwen2VLProcessor(image_processor=AutoImageProcessor.from_pretrained(path / "processor"),
                                 tokenizer=AutoTokenizer.from_pretrained(path / "processor"), video_processor=None)
    if plus:
        monkeypatch.setattr(pipeline_qwenimage_edit_plus, "CONDITION_IMAGE_SIZE", VL_SIDE * VL_SIDE)
        monkeypatch.setattr(pipeline_qwenimage_edit_plus, "VAE_IMAGE_SIZE", SIDE * SIDE)
        pipe = QwenImageEditPlusPipeline.from_pretrained(str(path), processor=processor)
    else:
        dims = pipeline_qwenimage_edit.calculate_dimensions
        monkeypatch.setattr(pipeline_qwenimage_edit, "calculate_dimensions",
                            lambda area, ratio: dims(SIDE * SIDE, ratio))
        pipe = QwenImageEditPipeline.from_pretrained(str(path), processor=processor)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _prompt(data, text, *names):
    return {"text": text, "images": [str(data / "images" / n) for n in names]}


# ----------------------------------------------------------------------------------------------- pure pieces
def test_condition_dims_is_the_pipelines_calculate_dimensions():
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions as edit_dims
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions as plus_dims

    for w, h in [(40, 48), (48, 32), (1024, 1024), (1920, 1080), (333, 777), (7, 3000)]:
        for side in (32, 384, 1024):
            ours = condition_dims(w, h, side)
            assert ours == tuple(edit_dims(side * side, w / h)[:2]) == tuple(plus_dims(side * side, w / h))
            assert ours[0] % 32 == 0 and ours[1] % 32 == 0
    assert condition_dims(1024, 512, 1024) == (1440, 736)  # √(2·1024²) = 1448.2 → 1440; /2 = 724.1 → 736


def test_expand_image_pads_repeats_each_pad_in_order():
    assert expand_image_pads("a<|image_pad|>b<|image_pad|>", [2, 1]) == "a" + "<|image_pad|>" * 2 + "b<|image_pad|>"
    with pytest.raises(ValueError, match="2 image slots in the prompt for 1 images"):
        expand_image_pads("<|image_pad|><|image_pad|>", [3])


def test_grid_groups_ignore_absent_images():
    grids = torch.tensor([[[4, 4], [0, 0]], [[2, 3], [4, 4]], [[4, 4], [0, 0]]])
    groups = grid_groups(grids)
    assert {k: v.tolist() for k, v in groups.items()} == {((4, 4),): [0, 2], ((2, 3), (4, 4)): [1]}


def test_tiny_tokenizer_header_is_the_64_dropped_tokens(edit):
    assert len(edit.tokenizer(EDIT_SYSTEM).input_ids) == 64


# ----------------------------------------------------------------------------------------------- vs the pipelines
def _vl_images(pipe, paths, side):
    out = []
    for p in paths:
        image = Image.open(p).convert("RGB")
        w, h = condition_dims(*image.size, side)
        out.append(pipe.image_processor.resize(image, h, w))
    return out


@pytest.mark.parametrize("variant", ["edit", "plus"])
def test_conditioning_equals_the_pipeline_encode_prompt(variant, edit, plus, edit_dir, plus_dir, edit_data_dir,
                                                        monkeypatch):
    """Per prompt: the VL embeddings of the instruction and of the negative prompt, both with the condition images,
    equal encode_prompt's; the condition latents equal the pipeline's VAE encoding, packed."""
    is_plus = variant == "plus"
    adapter, path = (plus, plus_dir) if is_plus else (edit, edit_dir)
    pipe = _pipeline(path, is_plus, monkeypatch)
    cases = [(EDIT_PROMPTS[0], ["a.png", "b.png"] if is_plus else ["a.png"]), (EDIT_PROMPTS[1], ["b.png"])]
    for text, names in cases:
        prompt = _prompt(edit_data_dir, text, *names)
        cond = adapter.encode_prompts([prompt])
        vl = _vl_images(pipe, prompt["images"], VL_SIDE if is_plus else SIDE)
        for key, words in (("prompt", text), ("negative", NEGATIVE)):
            ref, ref_mask = pipe.encode_prompt(prompt=words, image=vl if is_plus else vl[0], device=torch.device("cpu"))
            assert ref_mask is None  # one prompt: no padding
            ours = cond[f"{key}_embeds"][0][cond[f"{key}_mask"][0]]
            assert ours.shape == ref[0].shape and (ours - ref[0]).abs().max() < 1e-5
        tokens = []
        for p in prompt["images"]:
            image = Image.open(p).convert("RGB")
            w, h = condition_dims(*image.size, SIDE)
            z = pipe._encode_vae_image(pipe.image_processor.preprocess(image, h, w).unsqueeze(2), None)[:, :, 0]
            tokens.append(pipe._pack_latents(z, 1, z.shape[1], z.shape[2], z.shape[3])[0])
        ref_tokens = torch.cat(tokens)
        assert torch.allclose(cond["condition_latents"][0], ref_tokens, atol=1e-5)
    # the negative conditioning sees the image: the same negative text with another image differs
    a, b = adapter.encode_prompts([_prompt(edit_data_dir, EDIT_PROMPTS[0], "c.png"),
                                   _prompt(edit_data_dir, EDIT_PROMPTS[0], "a.png")])["negative_embeds"]
    assert (a - b).abs().max() > 1e-3


def _ode(adapter, prompts, noise, steps, guidance):
    cond = adapter.encode_prompts(prompts)
    plan = SamplingPlan(num_steps=steps, shape=MediaShape(32, 32), guidance=Guidance(guidance, NEGATIVE),
                        noise_level=0.0)
    draws = RolloutNoise({"x": noise}, torch.zeros(len(prompts), dtype=torch.long),
                         {"x": torch.randn(steps, len(prompts), *noise.shape[1:])})
    return sample_latents(adapter, cond, adapter.encode_guidance(plan.guidance), draws, plan)[4]["x"]


@pytest.mark.parametrize("variant", ["edit", "plus"])
def test_ode_sampling_with_true_cfg_reproduces_the_pipeline(variant, edit, plus, edit_dir, plus_dir, edit_data_dir,
                                                            monkeypatch):
    """Same initial latents, 3 steps, true CFG 4 with the negative prompt " ": the adapter's Euler ODE rollout of a
    batch whose samples have different condition grids (other aspect ratios; Plus: two images vs one) equals each
    sample's own pipeline call, latents and decoded image."""
    is_plus = variant == "plus"
    adapter, path = (plus, plus_dir) if is_plus else (edit, edit_dir)
    prompts = [_prompt(edit_data_dir, EDIT_PROMPTS[0], *(["a.png", "b.png"] if is_plus else ["a.png"])),
               _prompt(edit_data_dir, EDIT_PROMPTS[2], "b.png")]
    assert len(grid_groups(adapter.encode_prompts(prompts)["condition_grids"])) == 2  # two transformer calls
    noise = torch.randn((2, *adapter.latent_shapes(MediaShape(32, 32))["x"]),
                        generator=torch.Generator().manual_seed(0))
    final = _ode(adapter, prompts, noise, 3, 4.0)
    pipe = _pipeline(path, is_plus, monkeypatch)
    for i, prompt in enumerate(prompts):
        images = [Image.open(p).convert("RGB") for p in prompt["images"]]
        kwargs = dict(image=images if is_plus else images[0], prompt=prompt["text"], negative_prompt=NEGATIVE,
                      true_cfg_scale=4.0, height=32, width=32, num_inference_steps=3,
                      latents=pack_latents(noise[i:i + 1]))
        reference = unpack_latents(pipe(**kwargs, output_type="latent").images, 16, 16)
        assert (final[i:i + 1] - reference).abs().max() < 1e-5, i
        decoded = pipe(**kwargs, output_type="pt").images
        assert (adapter.decode({"x": final[i:i + 1]})["images"] - decoded).abs().max() < 1e-5
    # the check can tell: without guidance the rollout lands elsewhere
    assert (_ode(adapter, prompts, noise, 3, 1.0) - final).abs().max() > 1e-2


def test_flops_match_the_executed_ops(edit, edit_data_dir):
    """The count of a CFG forward over samples with different condition sizes (two transformer calls) equals the
    executed ops: 2·(output elements)·(fan-in) per Linear call and 4·B·S²·(H·D) per joint attention."""
    from diffusers.models.transformers import transformer_qwenimage

    prompts = [_prompt(edit_data_dir, EDIT_PROMPTS[0], "a.png"), _prompt(edit_data_dir, EDIT_PROMPTS[1], "c.png"),
               _prompt(edit_data_dir, EDIT_PROMPTS[2], "b.png")]
    cond = edit.encode_prompts(prompts)
    x = torch.randn(3, *edit.latent_shapes(MediaShape(32, 32))["x"])
    before = edit.flops
    with count_flops(edit.transformer, dispatch_attention(transformer_qwenimage)) as executed, torch.no_grad():
        edit.velocity({"x": x}, torch.full((3,), 0.6), cond, edit.encode_guidance(Guidance(4.0, NEGATIVE)), 4.0)
    assert edit.flops - before == pytest.approx(executed.flops, rel=1e-12)
    # and the count is Qwen-Image's with the condition tokens as image tokens (64 noise tokens: a 16×16 latent)
    grids = cond["condition_grids"][:, 0]
    tokens = (grids[:, 0] * grids[:, 1]).tolist()
    text = cond["prompt_embeds"].shape[1]
    assert edit.forward_flops({"x": x}, cond) == pytest.approx(
        sum(qwen_image_forward_flops(edit.transformer.config, 64 + m, text) for m in tokens) / 3, rel=1e-12)


# ----------------------------------------------------------------------------------------------- errors
def test_prompts_without_their_images_are_refused(edit, edit_data_dir, tmp_path):
    with pytest.raises(ValueError, match="Qwen-Image-Edit edits a condition image, but the prompt 'make' carries none"):
        edit.encode_prompts(["make"])
    with pytest.raises(ValueError, match="takes 1 condition image per prompt, got 2"):
        edit.encode_prompts([_prompt(edit_data_dir, "make", "a.png", "b.png")])
    with pytest.raises(ValueError, match=r"differs from model.negative_prompt=' '"):
        edit.encode_guidance(Guidance(4.0, "blurry"))
    assert edit.encode_guidance(Guidance(1.0, "blurry")) == {}
    Image.new("RGB", (8, 400)).save(tmp_path / "sliver.png")  # 8×400 at a 64² area: 8 px wide rounds to 0
    with pytest.raises(ValueError, match=r"sliver.png \(8x400\) resized to about 64² px gives a 0x\d+ condition"):
        edit.encode_prompts([{"text": "make", "images": [str(tmp_path / "sliver.png")]}])


def test_a_checkpoint_without_its_processor_is_refused(edit_dir, tmp_path):
    import shutil

    broken = tmp_path / "no_processor"
    shutil.copytree(edit_dir, broken)
    index = json.loads((broken / "model_index.json").read_text())
    del index["processor"]
    (broken / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="has no 'processor' component; a Qwen-Image-Edit pipeline needs"):
        _adapter(broken, plus=False)


# ----------------------------------------------------------------------------------------------- CLI
def _edit_rows(data, name, rows):
    path = data / name  # beside images/: the rows name their images relative to the data file
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("variant", ["edit", "plus"])
def test_two_steps_of_the_recipe_through_the_cli(variant, edit_dir, plus_dir, edit_data_dir, tmp_path):
    is_plus = variant == "plus"
    data = _edit_rows(edit_data_dir, f"cli_{variant}.jsonl", [
        {"prompt": EDIT_PROMPTS[0], "image": ["images/a.png", "images/c.png"] if is_plus else "images/a.png"},
        {"prompt": EDIT_PROMPTS[1], "image": "images/b.png"}])
    out = tmp_path / "run"
    args = [
        "train", f"recipe=qwen_image_edit{'_plus' if is_plus else ''}_flowgrpo",
        f"model.path={plus_dir if is_plus else edit_dir}", f"data.path={data}", "model.dtype=float32",
        f"model.condition_size={SIDE}", f"trainer.output_dir={out}", "trainer.max_steps=2", "rollout.height=32",
        "rollout.width=32", "rollout.num_steps=3", "rollout.n=2", "data.prompts_per_step=2", "rollout.batch_size=4",
        "actor.micro_batch_size=2", "rollout.sde_window_size=2", "rollout.sde_window_range=[0,1]",
        "trainer.eval_every=2", "trainer.eval_samples=2", "trainer.num_validation=2", "trainer.save_every=2",
        "trainer.progress=false", "trainer.tensorboard=false", "reward=jpeg_compressibility",
    ]
    if is_plus:
        args.append(f"model.vl_condition_size={VL_SIDE}")
    assert main(args) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]  # the held-out evaluation before training, then two steps
    assert rows[1]["grad_norm"] > 0 and math.isfinite(rows[1]["loss"]) and rows[1]["perf/tflops"] > 0
    assert math.isfinite(rows[2]["eval/reward_mean"]) and (out / "samples" / "step_000002.png").is_file()
    from safetensors.torch import load_file

    state = load_file(str(out / "checkpoints" / "step_000002" / "adapter_model.safetensors"))
    assert any(v.abs().max() > 0 for k, v in state.items() if k.endswith("lora_B.weight"))
    saved = OmegaConf.load(out / "config.yaml")
    assert saved.model.negative_prompt == saved.rollout.negative_prompt == " "  # the recipe's, interpolated


def test_a_row_without_its_image_is_a_config_error_naming_file_and_line(edit_data_dir, tmp_path, capsys):
    data = _edit_rows(edit_data_dir, "missing_image.jsonl",
                      [{"prompt": EDIT_PROMPTS[0], "image": "images/a.png"}, {"prompt": EDIT_PROMPTS[1]}])
    # model.path does not exist: the data is checked before the model loads
    code = main(["train", "recipe=qwen_image_edit_flowgrpo", f"model.path={tmp_path / 'none'}", f"data.path={data}",
                 f"trainer.output_dir={tmp_path / 'run'}", "reward=jpeg_compressibility"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == [f"polyrl: config error: {data}:2: no 'image' (a path or a list of paths, relative to the data "
                   "file); model.name=qwen_image_edit needs a condition image in every row"]


def test_image_size_comes_from_the_rollout_not_the_condition(edit, edit_data_dir):
    """The output grid is rollout.height×width whatever the condition's aspect; the condition keeps its own."""
    cond = edit.encode_prompts([_prompt(edit_data_dir, EDIT_PROMPTS[0], "b.png")])  # 80×32 source
    w, h = condition_dims(32, 80, SIDE)
    assert (w, h) == (32, 96) and cond["condition_grids"][0].tolist() == [[h // 4, w // 4]]  # VAE ÷2, patches ÷2
    x = torch.randn(1, *edit.latent_shapes(MediaShape(64, 32))["x"])
    with torch.no_grad():
        v = edit.velocity({"x": x}, torch.full((1,), 0.5), cond, {}, 1.0)["x"]
    assert v.shape == x.shape and torch.isfinite(v).all()

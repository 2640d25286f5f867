"""model=qwen3_omni: the Qwen3-Omni thinker as a token policy, on a tiny random thinker the tests build (audio encoder,
vision encoder, MoE decoder) with an offline byte-level tokenizer and a saved image processor / feature extractor.
Rollout log-probs of multimodal prompts equal a teacher-forced recompute and the thinker's own forward; `polyrl
train` runs GRPO on rows with image and audio inputs; a row naming a missing file is one error line. Video prompts
run end to end with real mp4 files read by transformers' `load_video` (PyAV) and a stand-in for the video processor
(transformers' Qwen2-VL video processor needs torchvision)."""

from __future__ import annotations

import json
import wave
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from polyrl.cli.main import main
from polyrl.models.qwen3_omni import Qwen3OmniPolicy, audio_tokens
from polyrl.sampling.tokens import TokenPlan, draw_uniforms, response_token_log_probs, token_rollout

OMNI_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                 "<|video_pad|>", "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>")
# Qwen3-Omni's layout: media placeholders inside the user turn, media before the text
OMNI_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif c['type'] == 'audio' %}<|audio_start|><|audio_pad|><|audio_end|>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def omni_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for s in OMNI_SPECIALS:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(OMNI_SPECIALS))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                   chat_template=OMNI_TEMPLATE)


def save_tiny_thinker(path):
    from transformers import (
        GenerationConfig,
        Qwen2VLImageProcessorPil,
        Qwen3OmniMoeThinkerConfig,
        Qwen3OmniMoeThinkerForConditionalGeneration,
        WhisperFeatureExtractor,
    )

    path = Path(path)
    tok = omni_tokenizer()
    ids = {s: tok.convert_tokens_to_ids(s) for s in OMNI_SPECIALS}
    config = Qwen3OmniMoeThinkerConfig(
        audio_config=dict(num_mel_bins=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32, d_model=16,
                          output_dim=32, n_window=50, n_window_infer=100, downsample_hidden_size=8,
                          max_source_positions=200),
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=32, num_position_embeddings=64,
                           deepstack_visual_indexes=[1]),
        text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, moe_intermediate_size=16,
                         num_experts=4, num_experts_per_tok=2, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                          "interleaved": True},
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id),
        audio_token_id=ids["<|audio_pad|>"], image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        audio_start_token_id=ids["<|audio_start|>"], vision_start_token_id=ids["<|vision_start|>"],
        position_id_per_seconds=13,
    )
    torch.manual_seed(0)
    model = Qwen3OmniMoeThinkerForConditionalGeneration(config).eval()
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    # one preprocessor_config.json holds the image processor's and the feature extractor's keys (the real layout)
    merged = {}
    for proc in (Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=8 * 8,
                                          max_pixels=32 * 32),
                 WhisperFeatureExtractor(feature_size=16, sampling_rate=16000, hop_length=160, chunk_length=1)):
        proc.save_pretrained(str(path))
        merged.update(json.loads((path / "preprocessor_config.json").read_text()))
    (path / "preprocessor_config.json").write_text(json.dumps(merged, indent=2))
    return path


def write_wav(path: Path, seconds: float, rate: int = 16000, seed: int = 0) -> None:
    x = np.random.default_rng(seed).standard_normal(int(seconds * rate)) * 0.2
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(x, -1, 1) * 32767).astype("<i2").tobytes())


@pytest.fixture(scope="module")
def thinker_dir(tmp_path_factory):
    return save_tiny_thinker(tmp_path_factory.mktemp("tiny_qwen3_omni"))


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """Two images (16×16, 24×16), two WAV clips (0.3 s at 16 kHz, 0.5 s at 8 kHz: resampled) and a data file whose rows
    carry them (paths relative to the file)."""
    from PIL import Image

    root = tmp_path_factory.mktemp("omni_data")
    (root / "media").mkdir()
    rng = np.random.default_rng(0)
    for name, (h, w) in {"a.png": (16, 16), "b.png": (24, 16)}.items():
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / "media" / name)
    write_wav(root / "media" / "a.wav", 0.3)
    write_wav(root / "media" / "b.wav", 0.5, rate=8000, seed=1)
    rows = [{"prompt": "what is one plus one?", "answer": "2", "image": "media/a.png", "audio": "media/a.wav"},
            {"prompt": "count the beeps", "answer": "3", "audio": "media/b.wav"},
            {"prompt": "how many squares?", "answer": "1", "image": ["media/b.png", "media/a.png"]},
            {"prompt": "say seven", "answer": "7"}]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def load(path):
    return Qwen3OmniPolicy(SimpleNamespace(path=str(path), dtype="float32", max_sequence_length=512), torch.device("cpu"))


@pytest.fixture(scope="module")
def policy(thinker_dir):
    return load(thinker_dir)


def prompts(root: Path) -> list:
    m = root / "media"
    return [{"text": "what is one plus one?", "images": [str(m / "a.png")], "audio": [str(m / "a.wav")]},
            "say seven",
            {"text": "how many squares?", "images": [str(m / "b.png"), str(m / "a.png")]},
            {"text": "count the beeps", "audio": [str(m / "b.wav")]}]


def test_prompts_expand_media_placeholders(policy, media):
    ids, cond = policy.encode_prompts(prompts(media))
    c = policy.config
    # 16×16 image -> a 4×4 patch grid -> 4 merged tokens; 24×16 -> 6×4 -> 6; 0.3 s of audio = 30 frames -> 4 features
    assert [sum(t == c.image_token_id for t in row) for row in ids] == [4, 0, 10, 0]
    assert [sum(t == c.audio_token_id for t in row) for row in ids] == [4, 0, 0, audio_tokens(50, 50)]
    assert cond["image_grid_thw"].shape == (4, 2, 3) and cond["image_grid_thw"][0, 1].tolist() == [0, 0, 0]
    assert cond["pixel_values"].shape[:2] == (4, 40) and cond["input_features"].shape[:2] == (4, 1)
    assert cond["feature_attention_mask"].sum((1, 2)).tolist() == [30, 0, 0, 50]  # 8 kHz clip resampled to 16 kHz
    text = policy.tokenizer.decode(ids[1])
    assert text == "<|im_start|>user\nsay seven<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="a prompt carries \\['masks'\\]"):
        policy.encode_prompts([{"text": "x", "masks": ["m.png"]}])


def rollout_equal_to_its_recompute(policy, ps, seed: int):
    """Sample `ps` in chunks of 3 (T 0.8, top-p 0.95) and check the stored log-probs against a teacher-forced
    recompute of the whole batch (1e-5); returns (the rollout, the recomputed log-probs)."""
    plan = TokenPlan(max_new_tokens=8, temperature=0.8, top_p=0.95, batch_size=3)
    u = draw_uniforms(len(ps), plan, torch.Generator().manual_seed(seed))
    batch = token_rollout(policy, ps, [{}] * len(ps), torch.arange(len(ps)), plan, u)
    tokens = batch.tokens
    with torch.no_grad():
        recomputed = response_token_log_probs(policy, tokens.trimmed(), batch.cond, 0.8)
    r = recomputed.shape[1]
    mask = tokens.response_mask[:, :r].bool()
    assert mask.sum() > 30
    assert torch.allclose(recomputed[mask], batch.log_probs[:, :r][mask], atol=1e-5)
    return batch, recomputed


def test_rollout_log_probs_equal_a_teacher_forced_recompute(policy, media):
    batch, recomputed = rollout_equal_to_its_recompute(policy, prompts(media) * 2, seed=0)
    tokens = batch.tokens
    # micro-batches of other rows (the actor's) unpack the padded media per row: the same numbers
    with torch.no_grad():
        rows = torch.tensor([6, 0])
        sub = response_token_log_probs(policy, tokens.select(rows).trimmed(), {k: v[rows] for k, v in batch.cond.items()},
                                       0.8)
    n = sub.shape[1]
    assert torch.allclose(sub * tokens.response_mask[rows, :n], recomputed[rows, :n], atol=1e-5)
    # and the thinker's own forward (its own 3-D positions from the processor-style flat inputs, no padding) on row 0
    i = 0
    p, k = int(tokens.prompt_mask[i].sum()), int(tokens.response_mask[i].sum())
    ids = torch.cat([tokens.prompt_ids[i, -p:], tokens.response_ids[i, :k]])[None]
    flat = policy._flat_inputs({key: v[i: i + 1] for key, v in batch.cond.items()})
    assert set(flat) == {"pixel_values", "image_grid_thw", "input_features", "feature_attention_mask"}
    policy.network.model.rope_deltas = None
    with torch.no_grad():
        logits = policy.network(input_ids=ids, attention_mask=torch.ones_like(ids), **flat).logits[0, p - 1: p + k - 1]
    logits[:, policy._banned] = float("-inf")  # the policy's π excludes the media markers
    ref = torch.log_softmax(logits / 0.8, -1).gather(-1, ids[0, p:, None]).squeeze(-1)
    assert torch.allclose(ref, batch.log_probs[i, :k], atol=1e-5)


def test_the_media_reach_the_logits(policy, media):
    m = media / "media"
    a = {"text": "describe", "images": [str(m / "a.png")], "audio": [str(m / "a.wav")]}
    variants = [a, {**a, "images": [str(m / "b.png")]}, {**a, "audio": [str(m / "b.wav")]}]
    ids, cond = policy.encode_prompts(variants)
    from polyrl.sampling.tokens import pad_left

    x, mask = pad_left(ids, policy.pad_token_id)
    with torch.no_grad():
        logits, _ = policy.forward(x, mask, cond, None, keep=1)
    assert not torch.allclose(logits[0], logits[1], atol=1e-4)  # another image
    assert not torch.allclose(logits[0], logits[2], atol=1e-4)  # another clip


def _args(model, data, out, extra=()):
    return ["train", "recipe=qwen3_omni_grpo", "model=qwen3_omni", f"model.path={model}", "model.dtype=float32",
            "algorithm=grpo", "reward=math_answer", f"data.path={data}", f"data.heldout_path={data}",
            f"trainer.output_dir={out}", "trainer.max_steps=2", "rollout.n=2", "data.prompts_per_step=2",
            "rollout.max_new_tokens=4", "rollout.batch_size=4", "trainer.eval_every=2", "trainer.eval_samples=4",
            "trainer.save_every=0", "actor.micro_batch_size=2", "trainer.progress=false", "trainer.tensorboard=false",
            "actor.lora_rank=4", "actor.lora_alpha=8", "actor.lr=1e-3", "actor.num_minibatches=1", *extra]


# math_answer as a real run would use it; format with a loose pattern gives groups of differing rewards on random
# weights (about a third of the responses hold a letter a..m), so a gradient reaches the LoRA weights
CASES = {"grpo_math_answer": [], "gspo_format": ["algorithm=gspo", "reward=format", "reward.pattern='.*[a-m].*'"],
         "dapo_format": ["algorithm=dapo", "reward=format", "reward.pattern='.*[a-m].*'"]}


@pytest.mark.parametrize("case", sorted(CASES))
def test_trains_two_steps_on_image_and_audio_rows(thinker_dir, media, tmp_path, case):
    out = tmp_path / "run"
    assert main(_args(thinker_dir, media / "train.jsonl", out, CASES[case])) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    if case == "dapo_format":  # refills concatenate rollouts of other prompts (other media widths); a step that
        # keeps no group with a signal logs no loss
        assert [r["step"] for r in rows if "dapo/refills" in r] == [1, 2] and steps
    else:
        assert [r["step"] for r in steps] == [1, 2]
    for key in ("loss", "grad_norm", "reward/mean", "response_length/mean", "ratio_absdev/first_minibatch"):
        assert key in steps[0], key
    assert all(r["loss"] == r["loss"] for r in steps)
    if case != "grpo_math_answer":
        assert any(r["grad_norm"] > 0 for r in steps)
    assert steps[0]["ratio_absdev/first_minibatch"] < 1e-5  # the learner's recompute is the rollout's policy
    assert [r["step"] for r in rows if "eval/reward_mean" in r] == [0, 2]  # greedy held-out decoding, media included
    samples = [json.loads(line) for line in (out / "samples" / "step_000002.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and {"prompt", "response", "reward", "answer"} <= set(samples[0])


def test_offline_dpo_on_text_pairs(thinker_dir, media, tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": q, "chosen": f"The answer is {a}.", "rejected": "No idea."}) + "\n"
                             for q, a in [("one plus one?", "2"), ("two plus two?", "4")]))
    out = tmp_path / "run"
    args = _args(thinker_dir, media / "train.jsonl", out, ["algorithm=dpo", f"data.pairs_path={pairs}",
                                                           "trainer.eval_every=0"])
    assert main(args) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["grad_norm"] > 0
    assert rows[0]["loss"] == pytest.approx(0.6931, abs=1e-3)  # LoRA starts as a no-op: the policy is the reference


@pytest.mark.parametrize("column", ["image", "audio"])
def test_a_missing_media_file_is_one_error_line(thinker_dir, media, tmp_path, capsys, column):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"prompt": "a", "answer": "1"}) + "\n"
                    + json.dumps({"prompt": "b", "answer": "2", column: "media/nope.bin"}) + "\n")
    assert main(_args(thinker_dir, data, tmp_path / "run")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("polyrl: error:")
    assert f"{data}:2: {column} 'media/nope.bin' does not exist" in err[0]


def test_loads_the_thinker_of_a_full_qwen3_omni_checkpoint(policy, thinker_dir, tmp_path):
    """A Qwen3-Omni checkpoint (`Qwen3OmniMoeForConditionalGeneration`, weights under `thinker.`): only the thinker
    is built, with the same weights."""
    import shutil

    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    full = Qwen3OmniMoeForConditionalGeneration(Qwen3OmniMoeConfig(thinker_config=policy.config.to_dict(),
                                                                   enable_audio_output=False))
    full.thinker.load_state_dict(policy.network.state_dict())
    full.save_pretrained(str(tmp_path))
    for f in Path(thinker_dir).iterdir():
        if f.name not in ("config.json", "model.safetensors", "generation_config.json"):
            shutil.copy(f, tmp_path / f.name)
    loaded = load(tmp_path)
    assert type(loaded.network).__name__ == "Qwen3OmniMoeThinkerForConditionalGeneration"
    mine, theirs = policy.network.state_dict(), loaded.network.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_conds_of_other_media_widths_concatenate(policy, media):
    """DAPO's refills concatenate rollouts of other prompts: the padded media inputs are zero-padded to the widest and
    each row still unpacks to its own media."""
    from polyrl.batch import _cat

    _, a = policy.encode_prompts(prompts(media)[:1])  # one image, one clip
    _, b = policy.encode_prompts(["say seven", prompts(media)[2]])  # text only; two images
    _, text = policy.encode_prompts(["say seven"])  # no media at all: zero-width entries of the right layout
    assert text["pixel_values"].shape == (1, 0, 3 * 2 * 4 * 4) and text["input_features"].shape == (1, 0, 16, 0)
    both = _cat([a, b], ragged=True)  # as Rollout.cat concatenates `cond`
    assert both["pixel_values"].shape[:2] == (3, 40) and both["image_grid_thw"].shape[:2] == (3, 2)
    assert both["input_features"].shape[:2] == (3, 1) and both["feature_attention_mask"][1:].sum() == 0
    for row, (src, i) in enumerate([(a, 0), (b, 0), (b, 1)]):
        got = policy._flat_inputs({k: v[row: row + 1] for k, v in both.items()})
        want = policy._flat_inputs({k: v[i: i + 1] for k, v in src.items()})
        assert got.keys() == want.keys()
        for k in got:
            n = want[k].shape[-1]
            assert torch.equal(got[k][..., :n], want[k]) and not got[k][..., n:].any()


# ------------------------------------------------------------------------------------------------------------ video
class StandInVideoProcessor:
    """What transformers' `Qwen2VLVideoProcessor` (the `AutoVideoProcessor` of a Qwen3-Omni checkpoint; it imports
    torchvision) does with the tiny config's values, in torch: each video (T, H, W, 3) uint8 is resized to a multiple
    of patch_size·merge_size within [min_pixels, max_pixels] (`smart_resize`; bicubic), scaled to [0, 1], normalised
    with the CLIP mean / std, padded with its last frame to a multiple of temporal_patch_size, and cut into patches
    (grid_t·grid_h·grid_w, C·temporal_patch_size·patch_size²) in its `patchify` order (merge windows contiguous)."""

    patch_size, temporal_patch_size, merge_size, min_pixels, max_pixels = 4, 2, 2, 8 * 8, 32 * 32
    fps = None  # frames the adapter samples per second: its default, 2

    def __init__(self):
        self.calls = []

    def __call__(self, videos, return_tensors="pt", **kwargs):
        from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        self.calls.append(kwargs)
        p, tp, m = self.patch_size, self.temporal_patch_size, self.merge_size
        mean, std = torch.tensor(OPENAI_CLIP_MEAN).view(3, 1, 1), torch.tensor(OPENAI_CLIP_STD).view(3, 1, 1)
        pixels, grids = [], []
        for video in videos:
            x = torch.from_numpy(np.asarray(video)).permute(0, 3, 1, 2).float()  # (T, C, H, W)
            h, w = smart_resize(x.shape[2], x.shape[3], factor=p * m, min_pixels=self.min_pixels,
                                max_pixels=self.max_pixels)
            if (h, w) != tuple(x.shape[2:]):
                x = torch.nn.functional.interpolate(x, size=(h, w), mode="bicubic", align_corners=False)
                x = x.round().clamp(0, 255)
            x = (x / 255.0 - mean) / std
            if pad := -x.shape[0] % tp:
                x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
            gt, gh, gw = x.shape[0] // tp, h // p, w // p
            x = x.reshape(gt, tp, 3, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
            pixels.append(x.reshape(gt * gh * gw, 3 * tp * p * p))
            grids.append([gt, gh, gw])
        return {"pixel_values_videos": torch.cat(pixels), "video_grid_thw": torch.tensor(grids)}


def write_mp4(path: Path, frames: np.ndarray, fps: int) -> None:
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for f in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        container.mux(stream.encode())


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    """a / b: 16 frames of 32×32 at 8 fps (2 s, other contents); c: 4 frames of 20×36 at 1 fps (4 s)."""
    root = tmp_path_factory.mktemp("omni_video")
    rng = np.random.default_rng(0)
    for name, (t, h, w, fps) in {"a": (16, 32, 32, 8), "b": (16, 32, 32, 8), "c": (4, 20, 36, 1)}.items():
        write_mp4(root / f"{name}.mp4", rng.integers(0, 256, (t, h, w, 3), dtype=np.uint8), fps)
    return root


@pytest.fixture
def video_policy(policy, monkeypatch):
    """The policy with the stand-in as its video processor; the frames still come from `load_video`."""
    monkeypatch.setitem(policy._processors, "video", StandInVideoProcessor())
    return policy


def video_prompts(media: Path, clips: Path) -> list:
    m = media / "media"
    return [{"text": "what moves?", "videos": [str(clips / "a.mp4")]},
            {"text": "compare", "images": [str(m / "a.png")], "audio": [str(m / "a.wav")],
             "videos": [str(clips / "c.mp4")]},
            "say seven",
            {"text": "two clips", "videos": [str(clips / "c.mp4"), str(clips / "a.mp4")]}]


def test_the_stand_in_lays_patches_out_as_the_image_processor(policy, tmp_path):
    """A still image is a video of temporal_patch_size equal frames: Qwen2-VL's image processor (PIL, no torchvision)
    gives the same patches in the same order."""
    from PIL import Image

    frame = np.random.default_rng(3).integers(0, 256, (32, 24, 3), dtype=np.uint8)
    Image.fromarray(frame).save(tmp_path / "still.png")
    image = policy._processor("image")(images=[Image.open(tmp_path / "still.png")], return_tensors="pt")
    video = StandInVideoProcessor()([np.stack([frame, frame])])
    assert video["video_grid_thw"].tolist() == image["image_grid_thw"].tolist() == [[1, 8, 6]]
    assert torch.allclose(video["pixel_values_videos"], image["pixel_values"].float(), atol=1e-5)


def test_video_placeholders_match_the_vision_encoder(video_policy, media, clips):
    policy = video_policy
    ids, cond = policy.encode_prompts(video_prompts(media, clips))
    c = policy.config
    # a: 16 frames at 8 fps, read at 2 fps -> 4 frames -> grid 2×8×8 -> 32 tokens, 1 s per grid; c: 4 frames at
    # 1 fps, all read -> grid 2×4×8 (20×36 resized to 16×32) -> 16 tokens, 2 s per grid
    assert cond["video_grid_thw"].tolist() == [[[2, 8, 8], [0, 0, 0]], [[2, 4, 8], [0, 0, 0]], [[0, 0, 0]] * 2,
                                               [[2, 4, 8], [2, 8, 8]]]
    assert cond["video_second_per_grid"].tolist() == [[1.0, 0.0], [2.0, 0.0], [0.0, 0.0], [2.0, 1.0]]
    assert cond["pixel_values_videos"].shape == (4, 64 + 128, 3 * 2 * 4 * 4)
    assert all(call.get("do_sample_frames") is False for call in policy._processors["video"].calls)
    # each video's placeholder run is as long as what the vision encoder emits for it
    counts = [sum(t == c.video_token_id for t in row) for row in ids]
    assert counts == [32, 16, 0, 48]
    flat = policy._flat_inputs(cond)
    with torch.no_grad():
        feats = policy.network.model.get_video_features(flat["pixel_values_videos"], flat["video_grid_thw"],
                                                        return_dict=True).pooler_output
    assert [f.shape[0] for f in feats] == [32, 16, 16, 32]
    text = policy.tokenizer.decode(ids[0])
    assert text.startswith("<|im_start|>user\n<|vision_start|>" + "<|video_pad|>" * 32 + "<|vision_end|>what moves?")
    # image, audio and video of one prompt, in the template's order
    assert [sum(t == c.image_token_id for t in row) for row in ids] == [0, 4, 0, 0]
    assert [sum(t == c.audio_token_id for t in row) for row in ids] == [0, 4, 0, 0]


def test_video_rollout_log_probs_equal_a_teacher_forced_recompute(video_policy, media, clips):
    policy = video_policy
    ps = video_prompts(media, clips) * 2
    batch, recomputed = rollout_equal_to_its_recompute(policy, ps, seed=1)
    tokens = batch.tokens
    # other rows' micro-batches unpack the padded video inputs per row: the same numbers
    rows = torch.tensor([7, 4, 1])
    with torch.no_grad():
        sub = response_token_log_probs(policy, tokens.select(rows).trimmed(), {k: v[rows] for k, v in batch.cond.items()},
                                       0.8)
    n = sub.shape[1]
    assert torch.allclose(sub * tokens.response_mask[rows, :n], recomputed[rows, :n], atol=1e-5)
    # the thinker's own forward (its own 3-D positions from pixel_values_videos / video_grid_thw /
    # video_second_per_grid, no padding): a video, a video with an image and a clip, two videos
    for i in (0, 1, 3):
        p, k = int(tokens.prompt_mask[i].sum()), int(tokens.response_mask[i].sum())
        ids = torch.cat([tokens.prompt_ids[i, -p:], tokens.response_ids[i, :k]])[None]
        flat = policy._flat_inputs({key: v[i: i + 1] for key, v in batch.cond.items()})
        assert {"pixel_values_videos", "video_grid_thw", "video_second_per_grid"} <= set(flat)
        policy.network.model.rope_deltas = None
        with torch.no_grad():
            logits = policy.network(input_ids=ids, attention_mask=torch.ones_like(ids), **flat).logits[0, p - 1: p + k - 1]
        logits[:, policy._banned] = float("-inf")
        ref = torch.log_softmax(logits / 0.8, -1).gather(-1, ids[0, p:, None]).squeeze(-1)
        assert torch.allclose(ref, batch.log_probs[i, :k], atol=1e-5), i
    # another video of the same shape (the same prompt ids): other log-probs for the same tokens
    other_ids, other = policy.encode_prompts([{"text": "what moves?", "videos": [str(clips / "b.mp4")]}])
    assert other_ids[0] == policy.encode_prompts(ps[:1])[0][0]
    swapped = {k: v[:1].clone() for k, v in batch.cond.items()}
    for k in ("pixel_values_videos", "video_grid_thw", "video_second_per_grid"):
        swapped[k][:, : other[k].shape[1]] = other[k]
        swapped[k][:, other[k].shape[1]:] = 0
    with torch.no_grad():
        changed = response_token_log_probs(policy, tokens.select(torch.tensor([0])).trimmed(), swapped, 0.8)
    k = int(tokens.response_mask[0].sum())
    assert torch.allclose(recomputed[0, :k], batch.log_probs[0, :k], atol=1e-5)
    assert not torch.allclose(changed[0, :k], batch.log_probs[0, :k], atol=1e-3)

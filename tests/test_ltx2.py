"""The LTX-2 adapter against diffusers' own LTX2Pipeline on tiny random checkpoints the tests build and save (an
LTX-2.0 layout and an LTX-2.3 layout: gated attention, prompt modulation, per-modality text projections, perturbed
attention for STG): text conditioning, the guided video and audio velocities at every step of a pipeline run with
CFG, STG, modality guidance and rescale on, the σ grid, decode to frames + waveform; the joint log-density against
per-stream float64 terms; the analytic FLOP count against the executed operations; LoRA on the audio↔video
attention; and a 2-step CLI run of the recipe that writes an mp4 with sound."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from flop_count import executed_flops

from polyrl.latents import MediaShape
from polyrl.models.base import Guidance
from polyrl.models.ltx2 import (
    AUDIO_VIDEO_ATTENTION,
    LTX2_LORA_TARGETS,
    LTX2Policy,
    ltx2_forward_flops,
    ltx2_mu,
    pack_audio,
    pack_video,
    unpack_audio,
    unpack_video,
)

WORDS = sorted(set("a robot dancing in rain red cat jumps over the blue dog slowly blurry static ugly".split())
               | set("two red circles above a blue square green triangle three yellow squares circle to left of "
                     "triangle".split()))
PROMPT, NEGATIVE = "  a robot dancing in rain ", "blurry static ugly"
MAX_LEN = 16
FRAMES, HEIGHT, WIDTH, FPS = 9, 32, 32, 25.0  # 5 latent frames of 16×16 (tiny VAE: 2× in time and space), 9 audio frames
# (stream guidance options, the LTX2Pipeline call arguments that mean the same); the LTX-2.0 layout has no STG
GUIDANCE = {
    "ltx2.0": (dict(audio_guidance_scale=5.0, modality_scale=2.5, audio_modality_scale=1.5, guidance_rescale=0.7,
                    audio_guidance_rescale=0.4),
               dict(guidance_scale=3.0, audio_guidance_scale=5.0, stg_scale=0.0, audio_stg_scale=0.0,
                    modality_scale=2.5, audio_modality_scale=1.5, guidance_rescale=0.7, audio_guidance_rescale=0.4,
                    spatio_temporal_guidance_blocks=None, use_cross_timestep=False)),
    "ltx2.3": (dict(audio_guidance_scale=7.0, stg_scale=1.0, audio_stg_scale=1.5, stg_blocks=[1], modality_scale=3.0,
                    audio_modality_scale=2.0, guidance_rescale=0.7, audio_guidance_rescale=0.5),
               dict(guidance_scale=3.0, audio_guidance_scale=7.0, stg_scale=1.0, audio_stg_scale=1.5,
                    modality_scale=3.0, audio_modality_scale=2.0, guidance_rescale=0.7, audio_guidance_rescale=0.5,
                    spatio_temporal_guidance_blocks=[1], use_cross_timestep=True)),
}
# LTX-2's scheduler config (dynamic exponential shift of the video token count, stretched to a terminal σ of 0.1)
SCHEDULER = dict(base_image_seq_len=1024, base_shift=0.95, max_image_seq_len=4096, max_shift=2.05, shift_terminal=0.1,
                 time_shift_type="exponential", use_dynamic_shifting=True)


# ----------------------------------------------------------------------------------------------- tiny checkpoint
def build_tiny_ltx2(layout: str, words: list[str] = WORDS, seed: int = 0):
    """A tiny LTX2Pipeline with random weights: Gemma3 (hidden 16, 2 layers) + connectors, a 2-block transformer
    (video 2×8 heads, audio 2×4), the video VAE (2× in time and space), the audio VAE (8 mel bins, 4×) and a vocoder
    at 16 kHz (LTX-2's is 24 kHz). "ltx2.3" turns on gated attention, prompt modulation, per-modality text projections and perturbed
    attention (STG); "ltx2.0" has caption projections in the transformer instead."""
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    from polyrl.models.tiny import word_tokenizer

    v23 = layout == "ltx2.3"
    hidden, layers = 16, 2
    tokenizer = word_tokenizer(words, MAX_LEN, add_bos=True)
    torch.manual_seed(seed)
    text_encoder = Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=32,
                                     num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                     max_position_embeddings=64, sliding_window=8, pad_token_id=0, bos_token_id=2,
                                     eos_token_id=3),
        vision_config=SiglipVisionConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         image_size=8, patch_size=4),
        mm_tokens_per_image=4, image_token_index=len(tokenizer) - 1)).eval()
    transformer = LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
        audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2, audio_attention_head_dim=4,
        audio_cross_attention_dim=8, num_layers=2, caption_channels=hidden, rope_double_precision=False,
        rope_type="split", vae_scale_factors=(2, 2, 2), gated_attn=v23, audio_gated_attn=v23, cross_attn_mod=v23,
        audio_cross_attn_mod=v23, perturbed_attn=v23, use_prompt_embeddings=not v23)
    # LTX-2.0: both connectors work at the Gemma3 width (the transformer projects captions); LTX-2.3: at each stream's
    connectors = LTX2TextConnectors(
        caption_channels=hidden, text_proj_in_factor=layers + 1, video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=8, video_connector_num_layers=1, video_connector_num_learnable_registers=4,
        audio_connector_num_attention_heads=2, audio_connector_attention_head_dim=4 if v23 else 8,
        audio_connector_num_layers=1, audio_connector_num_learnable_registers=4, connector_rope_base_seq_len=32,
        rope_double_precision=False, rope_type="split", per_modality_projections=v23, video_hidden_dim=16,
        audio_hidden_dim=8, video_gated_attn=v23, audio_gated_attn=v23)
    vae = AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,), decoder_block_out_channels=(8,),
        layers_per_block=(1,), decoder_layers_per_block=(1, 1), spatio_temporal_scaling=(True,),
        decoder_spatio_temporal_scaling=(True,), decoder_inject_noise=(False, False), downsample_type=("spatial",),
        upsample_residual=(False,), upsample_factor=(1,), timestep_conditioning=False, patch_size=1, patch_size_t=1,
        encoder_causal=True, decoder_causal=False)
    with torch.no_grad():  # per-channel statistics that are not the identity, so decode's denormalisation shows
        vae.latents_mean.copy_(torch.linspace(-0.2, 0.3, 4))
        vae.latents_std.copy_(torch.linspace(0.5, 1.5, 4))
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
        resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height", dropout=0.0,
        mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8)
    with torch.no_grad():
        audio_vae.latents_mean.copy_(torch.linspace(0.1, -0.1, 4))
        audio_vae.latents_std.copy_(torch.linspace(0.8, 1.2, 4))
    # 160× upsampling of the 100 mel frames per second (hop 160 at 16 kHz): a waveform at the 16 kHz it declares
    vocoder = LTX2Vocoder(in_channels=16, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[16, 10, 8],
                          upsample_factors=[8, 5, 4], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
                          leaky_relu_negative_slope=0.1, output_sampling_rate=16000)
    return LTX2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=vae, audio_vae=audio_vae,
                        text_encoder=text_encoder, tokenizer=tokenizer, connectors=connectors, transformer=transformer,
                        vocoder=vocoder)


def _cfg(path, **options):
    return SimpleNamespace(name="ltx2", path=str(path), dtype="float32", max_sequence_length=MAX_LEN, compile="none",
                           fp8=False, options={"frame_rate": FPS, **options})


@pytest.fixture(scope="module", params=list(GUIDANCE))
def ltx(request, tmp_path_factory):
    """(layout, the in-memory LTX2Pipeline, its saved directory, the adapter loaded from it with the layout's guidance)."""
    pipe = build_tiny_ltx2(request.param)
    path = tmp_path_factory.mktemp(request.param.replace(".", "_"))
    pipe.save_pretrained(str(path))
    return request.param, pipe, path, LTX2Policy(_cfg(path, **GUIDANCE[request.param][0]), torch.device("cpu"))


SHAPE = MediaShape(height=HEIGHT, width=WIDTH, frames=FRAMES, fps=FPS)


# ----------------------------------------------------------------------------------------------- parity with the pipeline
def test_text_conditioning_equals_the_pipelines_connectors(ltx):
    _, pipe, _, policy = ltx
    ours = policy.encode_prompts([PROMPT, NEGATIVE])
    embeds, mask, _, _ = pipe.encode_prompt([PROMPT, NEGATIVE], do_classifier_free_guidance=False,
                                            max_sequence_length=MAX_LEN)
    with torch.no_grad():
        video, audio, text_mask = pipe.connectors(embeds, mask, padding_side="left")
    assert ours["prompt_embeds"].shape == (2, MAX_LEN, 16)
    torch.testing.assert_close(ours["prompt_embeds"], video, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours["audio_prompt_embeds"], audio, rtol=0, atol=1e-6)
    assert torch.equal(ours["prompt_attention_mask"], text_mask)
    assert mask[0, : MAX_LEN - 7].sum() == 0 and mask[0, -7:].all()  # left padding: <bos> + 5 words + <eos>


def _record_pipeline(pipe, guidance_kw: dict, steps: int = 3, output_type: str = "pt"):
    """Run LTX2Pipeline; return its output and, per step, (video sample, guided video velocity, audio sample, guided
    audio velocity, σ) as they reach its schedulers (the packed token forms)."""
    calls = []
    convert = pipe.convert_x0_to_velocity

    def recording(sample, denoised, step_idx, scheduler=None):
        v = convert(sample, denoised, step_idx, scheduler)
        calls.append((sample.clone(), v.clone(), scheduler.sigmas[step_idx].clone()))
        return v

    pipe.convert_x0_to_velocity = recording
    try:
        out = pipe(PROMPT, negative_prompt=NEGATIVE, height=HEIGHT, width=WIDTH, num_frames=FRAMES, frame_rate=FPS,
                   num_inference_steps=steps, generator=torch.Generator().manual_seed(0), output_type=output_type,
                   max_sequence_length=MAX_LEN, **guidance_kw)
    finally:
        del pipe.convert_x0_to_velocity
    assert len(calls) == 2 * steps  # video then audio, each step
    return out, [(*calls[2 * i][:2], *calls[2 * i + 1]) for i in range(steps)]


def test_velocity_equals_the_pipelines_guided_denoiser(ltx):
    """At every step of an LTX2Pipeline run with CFG (3 video / 5 or 7 audio), STG (LTX-2.3), modality guidance and
    rescale on, the adapter's velocity at the same latents and σ equals what the pipeline hands its schedulers, for
    video and audio; then all steps again as one batch."""
    layout, pipe, _, policy = ltx
    _, steps = _record_pipeline(pipe, GUIDANCE[layout][1])
    shapes = policy.latent_shapes(SHAPE)
    _, frames, height, width = shapes["video"]
    sigmas = policy.sigmas(3, SHAPE)
    cond = policy.encode_prompts([PROMPT])
    shared = policy.encode_guidance(Guidance(3.0, NEGATIVE))
    assert set(shared) == set(cond)
    xs, ss, want = [], [], []
    for i, (video, v_video, audio, v_audio, sigma) in enumerate(steps):
        assert sigma == sigmas[i]  # the pipeline's σ grid, to the bit
        x = {"video": unpack_video(video, frames, height, width, 1, 1), "audio": unpack_audio(audio, shapes["audio"][2])}
        assert x["audio"].shape[1:] == shapes["audio"]
        v = policy.velocity(x, sigma.reshape(1), cond, shared, 3.0)
        torch.testing.assert_close(pack_video(v["video"], 1, 1), v_video, rtol=0, atol=2e-5)
        torch.testing.assert_close(pack_audio(v["audio"]), v_audio, rtol=0, atol=2e-5)
        xs.append(x), ss.append(sigma.reshape(1)), want.append(v)
    batch = {k: torch.cat([x[k] for x in xs]) for k in xs[0]}
    out = policy.velocity(batch, torch.cat(ss), {k: t.expand(3, *t.shape[1:]) for k, t in cond.items()}, shared, 3.0)
    for k in out:
        torch.testing.assert_close(out[k], torch.cat([w[k] for w in want]), rtol=0, atol=2e-5)


def test_decode_equals_the_pipelines_frames_and_waveform(ltx):
    layout, pipe, _, policy = ltx
    kw = GUIDANCE[layout][1]
    latent_out, _ = _record_pipeline(pipe, kw, steps=2, output_type="latent")
    out, _ = _record_pipeline(pipe, kw, steps=2, output_type="pt")
    vae, audio_vae = pipe.vae, pipe.audio_vae
    video = (latent_out.frames - vae.latents_mean.view(1, -1, 1, 1, 1)) / vae.latents_std.view(1, -1, 1, 1, 1)
    audio = unpack_audio((pack_audio(latent_out.audio) - audio_vae.latents_mean) / audio_vae.latents_std, 2)
    media = policy.decode({"video": video, "audio": audio})
    assert media["video"].shape == (1, FRAMES, 3, HEIGHT, WIDTH)
    torch.testing.assert_close(media["video"], out.frames, rtol=0, atol=1e-5)
    assert media["audio"].sample_rate == 16000 and media["audio"].waveform.shape == out.audio.shape
    torch.testing.assert_close(media["audio"].waveform, out.audio, rtol=0, atol=1e-5)


def test_sigma_grid_is_the_shifted_and_stretched_flow_grid(ltx):
    _, _, _, policy = ltx
    n = 6
    tokens = 5 * 16 * 16
    mu = 0.95 + (2.05 - 0.95) / (4096 - 1024) * (tokens - 1024)
    assert ltx2_mu(tokens, policy.scheduler.config) == pytest.approx(mu, rel=1e-12)
    u = torch.linspace(1, 1 / n, n, dtype=torch.float64)
    shifted = math.exp(mu) / (math.exp(mu) + (1 / u - 1))
    stretched = 1 - (1 - shifted) * (1 - 0.1) / (1 - shifted[-1])  # ends at the terminal σ 0.1
    sig = policy.sigmas(n, SHAPE)
    assert sig.dtype == torch.float32 and len(sig) == n + 1 and sig[-1] == 0 and sig[-2] == pytest.approx(0.1)
    torch.testing.assert_close(sig[:-1].double(), stretched, rtol=0, atol=1e-6)


def test_latent_shapes_and_option_errors(ltx):
    from polyrl.errors import UserError

    layout, _, path, policy = ltx
    assert policy.latent_shapes(SHAPE) == {"video": (4, 5, 16, 16), "audio": (2, 9, 2)}  # 9/25 s at 25 latents/s
    assert policy.latent_shapes(MediaShape(height=64, width=32, frames=17, fps=FPS))["audio"] == (2, 17, 2)
    with pytest.raises(ValueError, match=r"rollout.num_frames=8 must be 2k\+1"):
        policy.latent_shapes(MediaShape(height=32, width=32, frames=8, fps=FPS))
    with pytest.raises(ValueError, match="rollout.height=33 must be a multiple of 2"):
        policy.latent_shapes(MediaShape(height=33, width=32, frames=9, fps=FPS))
    with pytest.raises(ValueError, match="rollout.fps=24.0 differs from model.options.frame_rate=25.0"):
        policy.latent_shapes(MediaShape(height=32, width=32, frames=9, fps=24.0))
    with pytest.raises(UserError, match="model.options.stg_scale='x' is not valid"):
        LTX2Policy(_cfg(path, stg_scale="x"), torch.device("cpu"))
    with pytest.raises(UserError, match=r"model.options.stg_blocks=\[5\]: the transformer has blocks 0..1"):
        LTX2Policy(_cfg(path, stg_scale=1.0, stg_blocks=[5]), torch.device("cpu"))
    if layout == "ltx2.0":  # no perturbed attention: STG would cost a forward and change nothing
        with pytest.raises(UserError, match="no perturbed attention"):
            LTX2Policy(_cfg(path, stg_scale=1.0, stg_blocks=[1]), torch.device("cpu"))
        assert not policy.use_cross_timestep  # null: LTX-2.0's legacy behaviour
    else:
        assert policy.use_cross_timestep


# ----------------------------------------------------------------------------------------------- joint log-density
@pytest.mark.parametrize("step", ["sde", "cps"])
def test_joint_log_density_is_the_sum_of_the_per_stream_terms(step):
    """One transition of video + audio latents: the joint log-density is Σ over both streams' elements of the
    Gaussian log-density, over the total element count, computed here in float64 per stream independently; the
    squared-distance score is verl-omni's: −mean (x′−μ)² over the video and audio tokens concatenated."""
    from polyrl.sampling.steps import STEPS, step_latents

    g = torch.Generator().manual_seed(0)
    x = {"video": torch.randn(3, 4, 5, 6, 6, generator=g), "audio": torch.randn(3, 2, 9, 2, generator=g)}
    v = {k: torch.randn(t.shape, generator=g) for k, t in x.items()}
    z = {k: torch.randn(t.shape, generator=g) for k, t in x.items()}
    sigma, sigma_next, level = torch.tensor([0.9, 0.6, 0.3]), torch.tensor([0.8, 0.5, 0.2]), torch.tensor([0.8, 0.8, 0.5])
    out = step_latents(STEPS[step], x, v, sigma, sigma_next, level, 0.95, noise=z)
    total = torch.zeros(3, dtype=torch.float64)
    for k in x:  # each stream on its own, float64
        alone = STEPS[step](x[k].double(), v[k].double(), sigma.double(), sigma_next.double(), level.double(), 0.95,
                            prev=out.sample[k].double())
        std = alone.std.view(-1, *[1] * (x[k].dim() - 1))
        per_element = -((out.sample[k].double() - alone.mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
        total += per_element.flatten(1).sum(1)
    count = sum(t[0].numel() for t in x.values())
    torch.testing.assert_close(out.log_prob.double(), total / count, rtol=1e-6, atol=1e-6)
    sq = step_latents(STEPS[step], x, v, sigma, sigma_next, level, 0.95, prev=out.sample, log_density="squared_distance")
    concatenated = torch.cat([pack_video(out.sample["video"], 1, 1).flatten(1), pack_audio(out.sample["audio"]).flatten(1)], 1)
    mean = torch.cat([pack_video(out.mean["video"], 1, 1).flatten(1), pack_audio(out.mean["audio"]).flatten(1)], 1)
    assert concatenated.shape[1] == count
    torch.testing.assert_close(sq.log_prob, -((concatenated - mean) ** 2).mean(1), rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------------------------- FLOPs
# STG needs the perturbed attention of the LTX-2.3 layout
@pytest.mark.parametrize(("layout", "mode"), [("ltx2.0", "plain"), ("ltx2.0", "isolate"), ("ltx2.3", "plain"),
                                              ("ltx2.3", "isolate"), ("ltx2.3", "stg")])
def test_ltx2_flops_match_executed_ops(layout, mode):
    model = build_tiny_ltx2(layout).transformer.eval()
    c = model.config
    batch, text, (f, h, w), audio = 2, 7, (3, 4, 6), 5
    t = torch.full((batch,), 500.0)
    inputs = dict(hidden_states=torch.randn(batch, f * h * w, 4), audio_hidden_states=torch.randn(batch, audio, 4),
                  encoder_hidden_states=torch.randn(batch, text, 16),
                  audio_encoder_hidden_states=torch.randn(batch, text, 16 if layout == "ltx2.0" else 8),
                  timestep=t, sigma=t, num_frames=f, height=h, width=w, fps=FPS, audio_num_frames=audio,
                  isolate_modalities=mode == "isolate", spatio_temporal_guidance_blocks=[1] if mode == "stg" else None,
                  use_cross_timestep=True, return_dict=False)
    executed, attention_calls = executed_flops(model, inputs)
    per_block = 4 if mode == "isolate" else 6  # self ×2, text ×2, audio↔video ×2
    assert attention_calls == c.num_layers * per_block - (2 if mode == "stg" else 0)  # STG: block 1 skips its selves
    analytic = ltx2_forward_flops(c, f * h * w, audio, text, isolate_modalities=mode == "isolate",
                                  perturbed_blocks=1 if mode == "stg" else 0)
    assert analytic * batch == pytest.approx(executed, rel=1e-12)


def test_adapter_counts_each_guidance_forward(ltx):
    layout, _, _, policy = ltx
    shapes = policy.latent_shapes(SHAPE)
    x = {k: torch.zeros(2, *s) for k, s in shapes.items()}
    cond = policy.encode_prompts([PROMPT, PROMPT])
    shared = policy.encode_guidance(Guidance(3.0, NEGATIVE))
    before = policy.flops
    with torch.no_grad():
        policy.velocity(x, torch.tensor([0.5, 0.5]), cond, shared, 3.0)
    c, tokens = policy.transformer.config, 5 * 16 * 16
    plain = ltx2_forward_flops(c, tokens, 9, MAX_LEN)
    isolated = ltx2_forward_flops(c, tokens, 9, MAX_LEN, isolate_modalities=True)
    perturbed = ltx2_forward_flops(c, tokens, 9, MAX_LEN, perturbed_blocks=1) if layout == "ltx2.3" else 0.0
    # 2 samples × (uncond + cond + modality-isolated [+ STG-perturbed])
    assert policy.flops - before == pytest.approx(2 * (2 * plain + isolated + perturbed))
    assert isolated < plain and (layout == "ltx2.0" or perturbed < plain)


# ----------------------------------------------------------------------------------------------- LoRA
def test_lora_lands_on_video_audio_and_the_audio_video_attention():
    from peft import LoraConfig

    model = build_tiny_ltx2("ltx2.3").transformer
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    for target in LTX2_LORA_TARGETS:  # a whole dotted suffix: attn1.to_q never also picks audio_attn1.to_q
        assert len([n for n in names if n.endswith("." + target)]) == model.config.num_layers, target
    model.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=LTX2_LORA_TARGETS))
    lora = {n.rsplit(".lora_A", 1)[0] for n, _ in model.named_parameters() if ".lora_A" in n}
    assert len(lora) == len(LTX2_LORA_TARGETS) * model.config.num_layers
    for block in range(model.config.num_layers):
        for attn in AUDIO_VIDEO_ATTENTION:
            for proj in ("to_q", "to_k", "to_v", "to_out.0"):
                assert f"transformer_blocks.{block}.{attn}.{proj}" in lora
    assert not any("connector" in n or "time_embed" in n or "proj_in" in n for n in lora)


def test_build_model_registry_and_option_keys(ltx, tmp_path, capsys):
    from polyrl.cli.main import main
    from polyrl.models import MODELS

    assert MODELS["ltx2"] is LTX2Policy
    _, _, path, _ = ltx
    prompts = tmp_path / "p.txt"
    prompts.write_text(PROMPT + "\n")
    base = ["train", "recipe=ltx2_flowgrpo", f"model.path={path}", f"data.path={prompts}"]
    assert main([*base, "+model.options.stg_scal=1.0"]) == 2  # a new key: refused by the schema's check
    err = capsys.readouterr().err
    assert "polyrl: config error: unknown key model.options.stg_scal for model.name=ltx2; allowed:" in err
    assert "stg_scale" in err and "Traceback" not in err
    assert main([*base, "model.options.stg_scal=1.0"]) == 2  # not in model/ltx2.yaml: refused while composing
    err = capsys.readouterr().err
    assert "polyrl: config error: unknown key model.options.stg_scal; allowed: audio_guidance_rescale" in err


# ----------------------------------------------------------------------------------------------- the recipe, end to end
def test_recipe_trains_two_steps_and_writes_an_mp4_with_sound(tmp_path, shape_prompts_file):
    """`polyrl train recipe=ltx2_flowgrpo` on a tiny LTX-2.3-layout checkpoint with every guidance term on: two
    steps, finite rewards and gradients, rollout and training agree on the joint log-prob, the LoRA of the
    audio↔video attention receives gradients, and the sample grid mp4 has one AAC track per tile."""
    import av
    from safetensors.torch import load_file

    from polyrl.cli.main import main

    words = sorted(set(shape_prompts_file.read_text().split()))
    model = tmp_path / "ltx2"
    build_tiny_ltx2("ltx2.3", words).save_pretrained(str(model))
    out = tmp_path / "run"
    args = ["train", "recipe=ltx2_flowgrpo", f"model.path={model}", f"data.path={shape_prompts_file}",
            f"trainer.output_dir={out}", "trainer.max_steps=2", "trainer.eval_every=2", "trainer.eval_samples=2",
            "trainer.num_validation=2", "trainer.save_every=2", "trainer.progress=false", "trainer.tensorboard=false",
            "model.dtype=float32", f"model.max_sequence_length={MAX_LEN}", f"rollout.height={HEIGHT}",
            f"rollout.width={WIDTH}", f"rollout.num_frames={FRAMES}", f"rollout.fps={FPS}", "rollout.num_steps=4",
            "rollout.n=2", "rollout.batch_size=2", "rollout.sde_window_size=2", "rollout.sde_window_range=[0,2]",
            "rollout.guidance_scale=3.0", "model.options.audio_guidance_scale=5.0", "model.options.stg_scale=1.0",
            "model.options.stg_blocks=[1]", "model.options.modality_scale=2.0", "model.options.guidance_rescale=0.5",
            "data.prompts_per_step=2", "actor.num_minibatches=1", "actor.micro_batch_size=2", "actor.lora_rank=4",
            "actor.lora_alpha=4", "actor.lr=1e-3", "reward.frames=2"]
    assert main(args) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert math.isfinite(r["reward/mean"]) and r["grad_norm"] > 0 and r["train/samples"] == 4
        assert r["ratio_absdev/first_minibatch"] < 1e-4  # the actor re-scores the rollout's joint log-prob
    video = out / "samples" / "step_000002.mp4"
    with av.open(str(video)) as container:
        kinds = [s.type for s in container.streams]
        audio = [s for s in container.streams if s.type == "audio"]
        assert kinds.count("video") == 1 and len(audio) == 2  # one sound track per tile
        title = audio[0].metadata.get("title") or audio[0].metadata.get("name", "")  # mp4 reads a title back as name
        assert audio[0].rate == 16000 and title.startswith("tile 1: ")
        samples = sum(frame.samples for frame in container.decode(audio=0))
    assert samples >= 0.3 * 16000  # 9 frames at 25 fps: 0.36 s (AAC pads to whole 1024-sample frames)
    with av.open(str(video)) as container:
        assert len(list(container.decode(video=0))) == FRAMES
    state = load_file(str(out / "checkpoints" / "step_000002" / "adapter_model.safetensors"))
    for attn in (*AUDIO_VIDEO_ATTENTION, "audio_attn1", "attn1"):
        lora_b = [t for k, t in state.items() if f".{attn}." in k and "lora_B" in k]
        assert lora_b and any(t.abs().sum() > 0 for t in lora_b), attn  # B starts at 0: only a gradient moves it

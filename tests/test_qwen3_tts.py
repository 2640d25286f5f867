"""`model=qwen3_tts` (models/qwen3_tts.py) on a tiny random Qwen3-TTS 12 Hz checkpoint built here in the public layout
(config.json, generation_config.json, weights, a byte-level Qwen2 tokenizer, speech_tokenizer/ with its codec).

Always run (the main environment, where the qwen-tts package is absent or does not import): a missing package is one
`polyrl: error:` line naming the install command, and the frame / chain-rule helpers.

Run where qwen-tts imports (the environment scripts/ci_qwen_tts.sh builds: transformers 4.57.3; skipped elsewhere,
failed there when POLYRL_REQUIRE_QWEN_TTS=1): the prompt is the package's non-streaming talker input; the rollout's
log-probs equal the teacher-forced recompute (1e-5) and obey the sampling distribution's masks (control ids, early
EOS); every code's log-prob matches a float64 copy run through the package's own talker forward and code predictor
training forward; gradients reach both decoders; the audio is the codec's decode of the whole frames; a 2-step
`polyrl train model=qwen3_tts reward=asr_wer` run scores the speech with a scripted Whisper (1 − WER by hand),
recomputes the rollout's log-probs in its first update and writes the wav and spectrogram samples.
"""

from __future__ import annotations

import inspect
import json
import os
from types import SimpleNamespace

import pytest
import torch
from test_speech_rewards import build_tiny_whisper

from polyrl.cli.main import main
from polyrl.errors import UserError
from polyrl.models.qwen3_tts import INSTALL, MIN_FRAMES, frame_log_prob, import_qwen_tts, response_frames

REQUIRE = os.environ.get("POLYRL_REQUIRE_QWEN_TTS") == "1"
V, CODEBOOK, GROUPS, EOS = 64, 32, 4, 42  # talker vocabulary, codes per codebook, codes per frame, codec EOS
CODEC = {"pad": 40, "bos": 41, "think": 43, "nothink": 44, "think_bos": 45, "think_eos": 46}
LANGUAGES, SPEAKERS = {"english": 47, "chinese": 48}, {"tester": 50}
TEXT_VOCAB, TTS_BOS, TTS_EOS, TTS_PAD = 300, 291, 292, 290
HOP, RATE = 64, 16000  # codec samples per frame, its output rate
PROMPTS = ["hi", "the cat sat", "a much longer sentence to say"]


def qwen_tts_imports() -> bool:
    try:
        import_qwen_tts()
    except UserError:
        if REQUIRE:
            raise
        return False
    return True


needs_qwen_tts = pytest.mark.skipif(not qwen_tts_imports(), reason="qwen-tts does not import here "
                                    "(scripts/ci_qwen_tts.sh runs these in its own environment)")


def _checkpoint_config(path):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3_tts", "tokenizer_type": "qwen3_tts_tokenizer_12hz",
                                                  "tts_model_type": "custom_voice", "tts_model_size": "0b6"}))
    return path


def test_frames_and_the_chain_rule():
    lp = torch.tensor([[-1.0, -2.0, -0.5, -0.25, -3.0, -1.0, -1.0, -1.0]], dtype=torch.float64)
    assert frame_log_prob(lp, 4).tolist() == [[-3.75, -6.0]]  # log π(frame) = Σ over its codes
    assert response_frames(9, 4) == (3, 2) and response_frames(8, 4) == (2, 2) and response_frames(0, 4) == (0, 0)


@pytest.mark.skipif(qwen_tts_imports(), reason="qwen-tts imports here")
def test_a_missing_package_is_one_error_line(tmp_path, capsys):
    model = _checkpoint_config(tmp_path / "tts")
    data = tmp_path / "speech.jsonl"
    data.write_text(json.dumps({"prompt": "hi", "text": "hi"}) + "\n")
    whisper = build_tiny_whisper(tmp_path / "whisper")  # the reward loads before the model
    capsys.readouterr()
    assert main(["train", "recipe=causal_lm_grpo", "model=qwen3_tts", f"model.path={model}", "reward=asr_wer",
                 f"reward.path={whisper}", f"data.path={data}", f"trainer.output_dir={tmp_path / 'run'}",
                 "rollout.max_new_tokens=32"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("polyrl: error: model=qwen3_tts")
    assert INSTALL in err[0]


# ------------------------------------------------------------------------------------------- the tiny checkpoint
def byte_tokenizer():
    """A byte-level BPE Qwen2 tokenizer without merges: every character a token; <|im_start|>, <|im_end|> special and
    "assistant" one token, as in Qwen's vocabulary (the package slices the template by these counts)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import Qwen2TokenizerFast
    from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = Qwen2TokenizerFast(tokenizer_object=tok, unk_token=None, bos_token=None, eos_token="<|im_end|>",
                              pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    fast.add_tokens(["assistant"])
    assert len(fast) < TTS_PAD
    return fast


def build_tiny_tts(path):
    """The public 12 Hz layout with tiny random weights: talker (2 layers, 3-D RoPE sections), code predictor (4 codes
    per frame over 32 ids), codec decoder (upsampling 64 samples per frame at 16 kHz) and a tiny Mimi encoder."""
    import_qwen_tts()
    from qwen_tts.core import Qwen3TTSTokenizerV2Config, Qwen3TTSTokenizerV2Model
    from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSForConditionalGeneration
    from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSSpeakerEncoderConfig
    from transformers import EncodecFeatureExtractor

    tok = byte_tokenizer()
    talker = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, text_vocab_size=TEXT_VOCAB, text_hidden_size=24,
                  num_code_groups=GROUPS, max_position_embeddings=512, initializer_range=0.3,
                  rope_scaling={"rope_type": "default", "mrope_section": [2, 1, 1], "interleaved": True},
                  codec_eos_token_id=EOS, **{f"codec_{k}_id": v for k, v in CODEC.items()},
                  codec_language_id=LANGUAGES, spk_id=SPEAKERS, spk_is_dialect={"tester": False},
                  code_predictor_config=dict(vocab_size=CODEBOOK, hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                             head_dim=8, num_code_groups=GROUPS, max_position_embeddings=64,
                                             initializer_range=0.3))
    config = Qwen3TTSConfig(talker_config=talker, tokenizer_type="qwen3_tts_tokenizer_12hz", tts_model_size="0b6",
                            tts_model_type="custom_voice", im_start_token_id=tok.convert_tokens_to_ids("<|im_start|>"),
                            im_end_token_id=tok.convert_tokens_to_ids("<|im_end|>"), tts_pad_token_id=TTS_PAD,
                            tts_bos_token_id=TTS_BOS, tts_eos_token_id=TTS_EOS)
    torch.manual_seed(0)
    model = Qwen3TTSForConditionalGeneration(config)
    with torch.no_grad():  # EOS likelier than the init makes it, so some responses end early
        model.talker.codec_head.weight[EOS].mul_(4)
    model.save_pretrained(path)
    # the speaker encoder's config takes its own fields only (the public config.json lists those)
    saved = json.loads((path / "config.json").read_text())
    fields = inspect.signature(Qwen3TTSSpeakerEncoderConfig.__init__).parameters
    saved["speaker_encoder_config"] = {k: v for k, v in saved["speaker_encoder_config"].items() if k in fields}
    (path / "config.json").write_text(json.dumps(saved, indent=2))
    tok.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.9, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.05,
         "subtalker_dosample": True, "subtalker_temperature": 0.9, "subtalker_top_p": 1.0, "subtalker_top_k": 50,
         "max_new_tokens": 8192}))
    codec_config = Qwen3TTSTokenizerV2Config(
        encoder_config=dict(sampling_rate=RATE, frame_rate=RATE / HOP, hidden_size=16, num_filters=4,
                            upsampling_ratios=[4, 4, 2], codebook_size=CODEBOOK, codebook_dim=8, num_quantizers=GROUPS,
                            vector_quantization_hidden_dimension=8, upsample_groups=16, num_hidden_layers=1,
                            intermediate_size=32, num_attention_heads=2, num_key_value_heads=2, head_dim=8),
        decoder_config=dict(codebook_size=CODEBOOK, codebook_dim=16, hidden_size=16, latent_dim=16,
                            num_attention_heads=2, num_key_value_heads=2, head_dim=8, intermediate_size=32,
                            num_hidden_layers=1, num_quantizers=GROUPS, upsample_rates=(4, 4), upsampling_ratios=(2, 2),
                            decoder_dim=16, sliding_window=8, max_position_embeddings=512),
        encoder_valid_num_quantizers=GROUPS, input_sample_rate=RATE, output_sample_rate=RATE,
        decode_upsample_rate=HOP, encode_downsample_rate=HOP)
    codec = Qwen3TTSTokenizerV2Model(codec_config)
    with torch.no_grad():  # the codebooks start empty (a trained codec's running sums) and the init is tiny: a
        for name, param in codec.named_parameters():  # random codebook and unit-variance layers, or it is near silent
            if name.endswith("_codebook.embedding_sum"):
                param.normal_()
            elif name.startswith("decoder.") and name.endswith("weight") and param.dim() > 1:
                param.normal_(0, param[0].numel() ** -0.5)
    (path / "speech_tokenizer").mkdir()
    codec.save_pretrained(path / "speech_tokenizer")
    EncodecFeatureExtractor(feature_size=1, sampling_rate=RATE).save_pretrained(path / "speech_tokenizer")
    return path


@pytest.fixture(scope="module")
def tts_dir(tmp_path_factory):
    if not qwen_tts_imports():
        pytest.skip("qwen-tts does not import here")
    return build_tiny_tts(tmp_path_factory.mktemp("tiny_qwen3_tts"))


def load(path, **options):
    from polyrl.models.qwen3_tts import Qwen3TTSPolicy

    cfg = SimpleNamespace(path=str(path), dtype="float32", max_sequence_length=128,
                          options={"speaker": "tester", "language": "english", **options})
    return Qwen3TTSPolicy(cfg, torch.device("cpu"))


@pytest.fixture(scope="module")
def policy(tts_dir):
    return load(tts_dir)


@pytest.fixture(scope="module")
def sampled(policy):
    from polyrl.sampling.tokens import TokenPlan, draw_uniforms, token_rollout

    plan = TokenPlan(max_new_tokens=8 * GROUPS, temperature=0.9, batch_size=4)
    prompts = PROMPTS * 2
    u = draw_uniforms(len(prompts), plan, torch.Generator().manual_seed(0))
    return plan, token_rollout(policy, prompts, [{}] * len(prompts), torch.arange(len(prompts)), plan, u)


@needs_qwen_tts
def test_the_prompt_is_the_packages_non_streaming_talker_input(policy):
    """prefill_embeds against the package's own `generate` input, captured where it calls the talker."""
    net = policy.network
    text = "the cat sat"
    ids, _ = policy.encode_prompts([text])
    captured = {}

    def capture(**kwargs):
        captured.update(kwargs)
        raise StopIteration

    tok = policy.tokenizer
    input_id = torch.tensor([tok(f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n").input_ids])
    original = net.talker.generate
    net.talker.generate = capture
    try:
        with pytest.raises(StopIteration):
            net.generate(input_ids=[input_id], languages=["english"], speakers=["tester"], non_streaming_mode=True)
    finally:
        net.talker.generate = original
    with torch.no_grad():
        ours = policy.prefill_embeds(net, [i - V for i in ids[0]])
    assert torch.allclose(captured["inputs_embeds"][0], ours, atol=1e-6)
    pad = net.talker.text_projection(net.talker.get_text_embeddings()(torch.tensor([TTS_PAD])))
    assert torch.allclose(captured["trailing_text_hidden"][0], pad)  # every frame's text channel: the pad


@needs_qwen_tts
def test_rollout_log_probs_equal_a_teacher_forced_recompute(policy, sampled):
    from polyrl.sampling.tokens import response_token_log_probs

    plan, batch = sampled
    tokens = batch.tokens
    lengths = tokens.response_mask.sum(1)
    assert (lengths < plan.max_new_tokens).any() and (lengths == plan.max_new_tokens).any()  # some ended early
    for row, n in zip(tokens.response_ids, lengths.tolist(), strict=True):
        codes = row[:n]
        first = codes[::GROUPS]
        assert (first[:MIN_FRAMES] != EOS).all() and ((first < CODEBOOK) | (first == EOS)).all()
        assert (codes[(torch.arange(n) % GROUPS) > 0] < CODEBOOK).all()
        if n < plan.max_new_tokens:  # ended: the EOS frame is one code
            assert n % GROUPS == 1 and codes[-1] == EOS
    with torch.no_grad():
        recomputed = response_token_log_probs(policy, tokens.trimmed(), {}, plan.temperature)
    mask = tokens.trimmed().response_mask.bool()
    rollout = batch.log_probs[:, : mask.shape[1]]
    assert (rollout[mask] < 0).all() and (rollout[~mask] == 0).all()
    assert torch.allclose(recomputed, rollout, atol=1e-5)


@needs_qwen_tts
def test_log_probs_against_the_packages_own_forwards_in_float64(tts_dir, policy, sampled):
    """Each row's rollout log-probs against a float64 copy of the network run through the package's own entry points:
    the talker's `forward` (its positions from the attention mask) over prompt ⧺ frames for c⁰, and
    `forward_sub_talker_finetune` (the package's training forward of the code predictor) for c¹ … c^{G−1}; log π is
    log_softmax(logits / T) with the control ids and early EOS masked (the package's suppress_tokens and
    min_new_tokens)."""
    plan, batch = sampled
    net = import_qwen_tts().from_pretrained(str(tts_dir), local_files_only=True).double().eval()
    tokens = batch.tokens
    ids, _ = policy.encode_prompts(PROMPTS * 2)
    for row in range(len(tokens)):
        n = int(tokens.response_mask[row].sum())
        codes = tokens.response_ids[row, :n]
        whole = n // GROUPS
        frames = codes[: whole * GROUPS].reshape(whole, GROUPS)
        with torch.no_grad():
            prefill = policy.prefill_embeds(net, [i - V for i in ids[row]])
            pad = net.talker.text_projection(net.talker.get_text_embeddings()(torch.tensor([[TTS_PAD]])))[0]
            steps = [net.talker.get_input_embeddings()(frames[:, :1])]  # the package's frame input (talker forward)
            steps += [net.talker.code_predictor.get_input_embeddings()[k](frames[:, k + 1: k + 2])
                      for k in range(GROUPS - 1)]
            inputs = torch.cat([prefill, torch.cat(steps, 1).sum(1) + pad])[None]
            out = net.talker(inputs_embeds=inputs, attention_mask=torch.ones(1, inputs.shape[1], dtype=torch.long),
                             output_hidden_states=True)
            hidden = out.hidden_states[0][-1][0, len(prefill) - 1:]  # (whole + 1, D): the state scoring frame f
            first = out.logits[0, len(prefill) - 1:] / plan.temperature
            first[:, CODEBOOK:] = float("-inf")
            eos = out.logits[0, len(prefill) - 1:, EOS] / plan.temperature
            first[:, EOS] = torch.where(torch.arange(len(first)) < MIN_FRAMES, float("-inf"), eos)
            want = torch.zeros(n, dtype=torch.float64)
            first_lp = torch.log_softmax(first, -1)
            for f in range(-(-n // GROUPS)):
                want[f * GROUPS] = first_lp[f, codes[f * GROUPS]]
            if whole:
                sub, _ = net.talker.forward_sub_talker_finetune(frames, hidden[:whole])  # (whole, G − 1, Vc)
                sub_lp = torch.log_softmax(sub / plan.temperature, -1)
                for k in range(1, GROUPS):
                    want[torch.arange(whole) * GROUPS + k] = sub_lp[:, k - 1].gather(-1, frames[:, k:k + 1])[:, 0]
        assert torch.allclose(batch.log_probs[row, :n].double(), want, atol=1e-5), row


@needs_qwen_tts
def test_the_recompute_is_differentiable_through_both_decoders(policy, sampled):
    from polyrl.sampling.tokens import response_token_log_probs

    plan, batch = sampled
    talker = policy.network.talker
    params = {"talker layer": talker.model.layers[0].self_attn.q_proj.weight, "codec head": talker.codec_head.weight,
              "predictor layer": talker.code_predictor.model.layers[0].mlp.down_proj.weight,
              "last predictor head": talker.code_predictor.lm_head[GROUPS - 2].weight}
    for param in params.values():
        param.requires_grad_(True)
    try:
        response_token_log_probs(policy, batch.tokens.trimmed(), {}, plan.temperature).sum().backward()
        for name, param in params.items():
            assert param.grad is not None and param.grad.abs().sum() > 0, name
    finally:
        for param in params.values():
            param.requires_grad_(False)
            param.grad = None


@needs_qwen_tts
def test_the_audio_is_the_codecs_decode_of_the_whole_frames(policy, sampled):
    plan, batch = sampled
    audio = batch.media["audio"]
    assert set(batch.media) == {"audio"} and audio.sample_rate == RATE
    assert audio.waveform.shape == (6, 1, plan.max_new_tokens // GROUPS * HOP)
    for i, (row, n) in enumerate(zip(batch.tokens.response_ids, batch.tokens.response_mask.sum(1).tolist(),
                                     strict=True)):
        whole = n // GROUPS
        with torch.no_grad():
            want = policy.codec.model.decode(row[: whole * GROUPS].reshape(1, whole, GROUPS)).audio_values[0]
        # its codes alone (float32 kernels of other batch sizes differ by ~1e-5 through this random codec)
        assert torch.allclose(audio.waveform[i, 0, : whole * HOP], want, atol=1e-4)
        assert want.abs().max() > 1e-3  # speech, not silence
        assert (audio.waveform[i, 0, whole * HOP:] == 0).all()


@needs_qwen_tts
def test_options_are_checked_by_name(tts_dir):
    with pytest.raises(UserError, match="model.options.speaker='nobody' is not one of .*: tester"):
        load(tts_dir, speaker="nobody")
    with pytest.raises(UserError, match="model.options.language='klingon' is not one of .*: auto, chinese, english"):
        load(tts_dir, language="klingon")
    with pytest.raises(UserError, match="0.6B Qwen3-TTS checkpoints take no instruction"):
        load(tts_dir, instruct="whisper it")


@needs_qwen_tts
def test_polyrl_train_with_asr_wer_trains_and_writes_the_speech(tts_dir, tmp_path):
    """Two GRPO steps from the CLI: the scripted Whisper always transcribes 'cat cat cat', so every score is
    1 − WER('cat cat cat', text) by hand; the first update recomputes the rollout's log-probs; the held-out speech
    is written as wav + spectrogram."""
    from polyrl.trainer.audio_samples import GAP_SECONDS

    whisper = build_tiny_whisper(tmp_path / "whisper")
    data = tmp_path / "speech.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "text": t}) + "\n"
                            for p, t in [("the cat sat", "the cat sat"), ("a cat", "A cat!")]))
    out = tmp_path / "run"
    frames = 6
    args = ["train", "recipe=causal_lm_grpo", "model=qwen3_tts", f"model.path={tts_dir}", "model.dtype=float32",
            "model.options.speaker=tester", "reward=asr_wer", f"reward.path={whisper}", "reward.device=cpu",
            "reward.max_new_tokens=3", f"data.path={data}", f"trainer.output_dir={out}", "trainer.max_steps=2",
            "trainer.eval_every=2", "trainer.eval_samples=2", "trainer.save_every=0", "trainer.progress=false",
            "trainer.tensorboard=false", "rollout.n=2", "data.prompts_per_step=2", "rollout.batch_size=4",
            f"rollout.max_new_tokens={frames * GROUPS}", "rollout.temperature=1.0", "actor.lora_rank=4",
            "actor.lora_alpha=8", "actor.lr=1e-2", "actor.micro_batch_size=2"]
    assert main(args) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:  # 'the cat sat': 2 of 3 words wrong; 'a cat': S + I over 2 words
        assert r["reward/mean"] == pytest.approx((1 / 3 + 0.0) / 2, abs=1e-6)
        assert r["reward_extra/asr_wer/wer"] == pytest.approx((2 / 3 + 1.0) / 2, abs=1e-6)
        assert r["loss"] == r["loss"] and r["response_length/mean"] > 0
    assert steps[0]["ratio_absdev/first_minibatch"] < 1e-5  # the rollout's log-probs, recomputed
    import wave

    with wave.open(str(out / "samples" / "step_000002.wav"), "rb") as w:  # two clips, a silent gap between
        assert w.getframerate() == RATE and w.getnframes() == 2 * frames * HOP + int(GAP_SECONDS * RATE)
    assert (out / "samples" / "step_000002.png").is_file()

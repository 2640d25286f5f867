"""asr_wer and speaker_similarity (rewards/speech.py) on tiny local checkpoints the tests build: a Whisper whose decoder
is scripted to always say one word (so the transcript, and the WER, are known by hand), and a Wav2Vec2 x-vector model
checked against its own embeddings recomputed in float64."""

from __future__ import annotations

import pytest
import torch

from polyrl.rewards import Audio, build_reward
from polyrl.rewards.codec import encode_wav
from polyrl.rewards.speech import error_rate, normalize_transcript

WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog"]


def build_tiny_whisper(path, say: str = "cat"):
    """A tiny Whisper (WordLevel tokenizer, 80 mel bins) whose decoder output is constant: the final layer norm maps
    every position to the embedding of `say`, and the (tied) embeddings are orthonormal, so greedy decoding says
    `say` at every step."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import (
        GenerationConfig,
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperProcessor,
        WhisperTokenizerFast,
    )

    special = ["<|endoftext|>", "<|startoftranscript|>", "<|notimestamps|>"]
    vocab = {w: i for i, w in enumerate([*WORDS, *("Ġ" + w for w in WORDS), "<unk>"])}  # Ġ: a leading space
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.ByteLevel()
    fast = WhisperTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token=special[0], eos_token=special[0],
                                pad_token=special[0])
    fast.add_special_tokens({"additional_special_tokens": special[1:]})
    ids = {t: fast.convert_tokens_to_ids(t) for t in special}
    d = 32
    cfg = WhisperConfig(vocab_size=len(fast), num_mel_bins=80, encoder_layers=1, decoder_layers=1,
                        encoder_attention_heads=2, decoder_attention_heads=2, d_model=d, encoder_ffn_dim=32,
                        decoder_ffn_dim=32, max_source_positions=1500, max_target_positions=32,
                        decoder_start_token_id=ids["<|startoftranscript|>"], eos_token_id=ids["<|endoftext|>"],
                        pad_token_id=ids["<|endoftext|>"], bos_token_id=ids["<|endoftext|>"],
                        begin_suppress_tokens=None, suppress_tokens=None)
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(cfg)
    with torch.no_grad():
        q, _ = torch.linalg.qr(torch.randn(d, d))
        emb = model.model.decoder.embed_tokens.weight
        emb.copy_(q[: emb.shape[0]])  # orthonormal rows; the output projection is tied to them
        norm = model.model.decoder.layer_norm
        norm.weight.zero_()
        norm.bias.copy_(10.0 * emb[vocab["Ġ" + say]])
    model.generation_config = GenerationConfig(decoder_start_token_id=ids["<|startoftranscript|>"],
                                               eos_token_id=ids["<|endoftext|>"], pad_token_id=ids["<|endoftext|>"],
                                               no_timestamps_token_id=ids["<|notimestamps|>"], max_length=32)
    model.save_pretrained(path)
    WhisperProcessor(WhisperFeatureExtractor(feature_size=80), fast).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def whisper_dir(tmp_path_factory):
    return build_tiny_whisper(tmp_path_factory.mktemp("tiny_whisper"))


def _audio(n=2, rate=24000, seconds=0.5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return Audio(0.1 * torch.randn(n, 1, int(rate * seconds), generator=g), rate)


def test_error_rate_by_hand():
    # ref 6 words; hyp: 'sat' -> 'sit' (S), 'the' before 'mat' dropped (D): 2 / 6
    assert error_rate("the cat sit on mat", "the cat sat on the mat") == pytest.approx(2 / 6)
    assert error_rate("the cat sat on the mat", "the cat sat on the mat") == 0.0
    assert error_rate("a the cat", "the cat") == pytest.approx(1 / 2)  # one insertion
    assert error_rate("", "the cat") == 1.0  # all deleted
    assert error_rate("one two three four", "x") == 4.0  # S + 3 I over 1 word: > 1, never clipped
    assert error_rate("kat", "cat", "cer") == pytest.approx(1 / 3)
    assert normalize_transcript("  The CAT, sat!  don't ") == "the cat sat don't"
    with pytest.raises(ValueError, match="reference text '' is empty"):
        error_rate("a", "")


def test_asr_wer_scores_the_transcript_against_the_text_column(whisper_dir):
    reward = build_reward({"name": "asr_wer", "path": str(whisper_dir), "max_new_tokens": 3, "device": "cpu"})
    meta = [{"text": "The cat sat."}, {"text": "a cat"}]
    out = reward(_audio(), ["say it", "say it"], meta)
    assert reward.last_transcripts == [" cat cat cat", " cat cat cat"]
    # 'the cat sat' vs 'cat cat cat': 2 substitutions / 3 words; 'a cat' vs 'cat cat cat': S + I over 2 words
    assert out.extras["asr_wer/wer"] == pytest.approx([2 / 3, 2 / 2])
    assert out.scores.tolist() == pytest.approx([1 / 3, 0.0])
    cer = build_reward({"name": "asr_wer", "path": str(whisper_dir), "max_new_tokens": 1, "device": "cpu",
                        "metric": "cer"})
    out = cer(_audio(1), ["x"], [{"text": "bat"}])  # 'cat' vs 'bat': 1 of 3 characters
    assert out.scores.tolist() == pytest.approx([1 - 1 / 3])
    with pytest.raises(ValueError, match="sample 0 has no reference text in metadata 'text'"):
        reward(_audio(1), ["x"], [{}])
    with pytest.raises(ValueError, match="needs the reference transcript in the 'text' column"):
        reward.check_prompt("x", {"answer": "y"})
    with pytest.raises(ValueError, match="metric='bleu' is not valid"):
        build_reward({"name": "asr_wer", "path": str(whisper_dir), "metric": "bleu"})


def test_speaker_similarity_is_the_cosine_of_xvectors(tmp_path):
    from transformers import Wav2Vec2Config, Wav2Vec2FeatureExtractor, Wav2Vec2ForXVector

    cfg = Wav2Vec2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                         conv_dim=(8, 8), conv_stride=(5, 4), conv_kernel=(10, 4), num_conv_pos_embeddings=8,
                         num_conv_pos_embedding_groups=2, tdnn_dim=(8, 8), tdnn_kernel=(3, 1), tdnn_dilation=(1, 1),
                         xvector_output_dim=6)
    torch.manual_seed(0)
    model_dir = tmp_path / "xvec"
    Wav2Vec2ForXVector(cfg).save_pretrained(model_dir)
    Wav2Vec2FeatureExtractor(sampling_rate=16000, do_normalize=True).save_pretrained(model_dir)
    ref = tmp_path / "ref.wav"
    ref_wave = 0.2 * torch.randn(1, 8000, generator=torch.Generator().manual_seed(5))
    ref.write_bytes(encode_wav(ref_wave, 16000))

    reward = build_reward({"name": "speaker_similarity", "path": str(model_dir), "device": "cpu"})
    audio = Audio(torch.cat([ref_wave[None], 0.2 * torch.randn(1, 1, 8000)]), 16000)
    out = reward(audio, ["a", "b"], [{"reference_audio": str(ref)}] * 2)

    model = Wav2Vec2ForXVector.from_pretrained(model_dir).double().eval()
    fe = Wav2Vec2FeatureExtractor.from_pretrained(model_dir)
    wav = (ref_wave * 32768).round().clamp(-32768, 32767) / 32768  # the reference as its 16-bit WAV holds it

    def xvec(x):
        with torch.no_grad():
            return model(fe([x.numpy()], sampling_rate=16000, return_tensors="pt")["input_values"].double()).embeddings[0]

    e_ref = xvec(wav[0])
    expected = [torch.nn.functional.cosine_similarity(xvec(audio.waveform[i, 0]), e_ref, dim=0).item() for i in (0, 1)]
    assert out.scores.tolist() == pytest.approx(expected, abs=1e-5)
    assert out.scores[0] > 0.999  # the reference itself (up to its 16-bit rounding)
    with pytest.raises(ValueError, match="sample 0 has no reference clip path in metadata 'reference_audio'"):
        reward(audio, ["a", "b"], [{}, {}])
    with pytest.raises(ValueError, match="reference clip /nonexistent.wav"):
        reward(audio, ["a", "b"], [{"reference_audio": "/nonexistent.wav"}] * 2)


def test_asr_wer_trains_an_audio_generator_from_the_cli(whisper_dir, tmp_path, capsys):
    """Two steps of `recipe=stable_audio_flowgrpo reward=asr_wer` on the tiny Stable Audio Open and the scripted
    Whisper: the reward reaches the loop with the data's `text` column (the transcript is always 'cat cat cat', so
    every score is 1 − WER('cat cat cat', text) by hand); a row without `text` is refused naming its line."""
    import json

    from test_stable_audio import SECONDS, build_tiny_sao

    from polyrl.cli.main import main

    model = tmp_path / "sao"
    build_tiny_sao().save_pretrained(str(model))
    data = tmp_path / "speech.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "text": t}) + "\n"
                            for p, t in [("say the cat sat", "the cat sat"), ("say a cat", "A cat!")]))
    out = tmp_path / "run"
    args = ["train", "recipe=stable_audio_flowgrpo", f"model.path={model}", f"data.path={data}", "reward=asr_wer",
            f"reward.path={whisper_dir}", "reward.device=cpu", "reward.max_new_tokens=3", f"trainer.output_dir={out}",
            "trainer.max_steps=2", "trainer.eval_every=0", "trainer.save_every=0", "trainer.progress=false",
            "trainer.tensorboard=false", "model.dtype=float32", f"model.options.seconds={SECONDS}",
            "rollout.num_steps=2", "rollout.n=2", "rollout.batch_size=4", "rollout.sde_window_size=1",
            "rollout.sde_window_range=[0,1]", "data.prompts_per_step=2", "actor.lora_rank=4", "actor.lora_alpha=4"]
    assert main(args) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # 'the cat sat': 2 of 3 words wrong; 'a cat': S + I over 2 words
        assert r["reward/mean"] == pytest.approx((1 / 3 + 0.0) / 2, abs=1e-6)
        assert r["reward_extra/asr_wer/wer"] == pytest.approx((2 / 3 + 1.0) / 2, abs=1e-6)
    data.write_text(json.dumps({"prompt": "no text here"}) + "\n")
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("polyrl: error: ") and "speech.jsonl:1: " in err
    assert "asr_wer needs the reference transcript in the 'text' column" in err

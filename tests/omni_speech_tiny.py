"""A tiny random Qwen3-Omni with all four parts (thinker, talker, code predictor, code2wav), saved in the public
layout by `Qwen3OmniMoeForConditionalGeneration.save_pretrained` with a byte-level tokenizer and the thinker's
preprocessor files (tests/test_qwen3_omni.py's), for tests/test_qwen3_omni_speech.py."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from test_qwen3_omni import OMNI_SPECIALS, omni_tokenizer

GROUPS, CODEBOOK = 4, 32  # codes per frame, codes per codebook
TALKER_VOCAB = 1024 + CODEBOOK  # generate suppresses the top 1024 ids but EOS: the codes are the ids below
CODEC = {"pad": 1040, "bos": 1041, "eos": 1042, "nothink": 1043, "think_bos": 1044, "think_eos": 1045}
SPEAKERS = {"ethan": 1050, "chelsie": 1051}
ROLES = ("user", "assistant", "system")
TTS = ("<tts_pad>", "<tts_text_bos>", "<tts_text_eod>")
EOS_SCALE = 6.0  # the codec EOS row of the talker's head, scaled: some speech ends early
TEXT_EOS_SCALE = 30.0  # the text EOS row of the thinker's head, scaled: some text ends early
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1], "interleaved": True}


def speech_tokenizer():
    """The thinker test's tokenizer with Qwen's one-token roles and the talker's text specials."""
    tok = omni_tokenizer()
    tok.add_tokens(list(ROLES))
    tok.add_special_tokens({"additional_special_tokens": list(TTS)})
    return tok


def omni_config(tok):
    from transformers import Qwen3OmniMoeConfig

    ids = {s: tok.convert_tokens_to_ids(s) for s in (*OMNI_SPECIALS, *ROLES, *TTS)}
    media = dict(audio_token_id=ids["<|audio_pad|>"], image_token_id=ids["<|image_pad|>"],
                 video_token_id=ids["<|video_pad|>"], audio_start_token_id=ids["<|audio_start|>"],
                 vision_start_token_id=ids["<|vision_start|>"], position_id_per_seconds=13)
    thinker = dict(
        audio_config=dict(num_mel_bins=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32, d_model=16,
                          output_dim=32, n_window=50, n_window_infer=100, downsample_hidden_size=8,
                          max_source_positions=200),
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=32, num_position_embeddings=64,
                           deepstack_visual_indexes=[1]),
        text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, moe_intermediate_size=16,
                         num_experts=4, num_experts_per_tok=2, max_position_embeddings=512, rope_parameters=ROPE,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id),
        user_token_id=ids["user"], **media)
    talker = dict(
        text_config=dict(vocab_size=TALKER_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, moe_intermediate_size=16,
                         num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=32,
                         max_position_embeddings=512, rope_parameters=ROPE, initializer_range=0.2),
        code_predictor_config=dict(vocab_size=CODEBOOK, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_code_groups=GROUPS,
                                   max_position_embeddings=64, initializer_range=0.2,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        num_code_groups=GROUPS, thinker_hidden_size=32, accept_hidden_layer=1, spatial_merge_size=2,
        speaker_id=SPEAKERS, **{f"codec_{k}_id" if k != "eos" else "codec_eos_token_id": v for k, v in CODEC.items()},
        **media)
    code2wav = dict(codebook_size=CODEBOOK, hidden_size=16, num_attention_heads=2, num_key_value_heads=2,
                    sliding_window=8, intermediate_size=32, num_hidden_layers=1, num_quantizers=GROUPS,
                    upsample_rates=[4, 2], upsampling_ratios=[2], decoder_dim=16, max_position_embeddings=512)
    return Qwen3OmniMoeConfig(
        thinker_config=thinker, talker_config=talker, code2wav_config=code2wav,
        im_start_token_id=ids["<|im_start|>"], im_end_token_id=ids["<|im_end|>"], tts_pad_token_id=ids["<tts_pad>"],
        tts_bos_token_id=ids["<tts_text_bos>"], tts_eos_token_id=ids["<tts_text_eod>"], system_token_id=ids["system"],
        user_token_id=ids["user"], assistant_token_id=ids["assistant"])


def save_tiny_omni(path, seed: int = 0) -> Path:
    """Thinker (audio + vision encoders, MoE decoder), talker (MoE, 2 layers), code predictor (4 codes per frame over
    32), code2wav (16 samples per frame), saved with the tokenizer, its chat template and one preprocessor_config.json
    holding the image processor's and the feature extractor's keys."""
    from transformers import (
        GenerationConfig,
        Qwen2VLImageProcessorPil,
        Qwen3OmniMoeForConditionalGeneration,
        WhisperFeatureExtractor,
    )

    path = Path(path)
    tok = speech_tokenizer()
    torch.manual_seed(seed)
    model = Qwen3OmniMoeForConditionalGeneration(omni_config(tok)).eval()
    with torch.no_grad():
        for layer in model.talker.model.layers:  # transformers leaves the talker's experts uninitialised (empty)
            layer.mlp.experts.gate_up_proj.normal_(0, 0.2)
            layer.mlp.experts.down_proj.normal_(0, 0.2)
            layer.mlp.gate.weight.normal_(0, 0.2)
        model.talker.codec_head.weight[CODEC["eos"]].mul_(EOS_SCALE)
        model.thinker.lm_head.weight[tok.eos_token_id].mul_(TEXT_EOS_SCALE)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    merged = {}
    for proc in (Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=8 * 8,
                                          max_pixels=32 * 32),
                 WhisperFeatureExtractor(feature_size=16, sampling_rate=16000, hop_length=160, chunk_length=1)):
        proc.save_pretrained(str(path))
        merged.update(json.loads((path / "preprocessor_config.json").read_text()))
    (path / "preprocessor_config.json").write_text(json.dumps(merged, indent=2))
    return path

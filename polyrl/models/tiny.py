"""Build small SD3-layout pipelines from diffusers / transformers classes (random weights).

Used for the embedded toy model (`polyrl pretrain-toy`), for tests (which `save_pretrained` a tiny pipeline and
train from it through the normal `from_pretrained` path), and for benchmarks at real sizes. Nothing here is a
private architecture: it is the real SD3 stack with small config values and a word-level tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, PreTrainedTokenizerFast, T5Config, T5EncoderModel

SPECIAL = ["<pad>", "<unk>", "<bos>", "<eos>"]


def word_tokenizer(words: list[str], max_length: int, add_bos: bool) -> PreTrainedTokenizerFast:
    """A word-level tokenizer (lower-cased whitespace/punctuation split) that pads to `max_length`."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    for w in sorted({w.lower() for w in words}):
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    template = ("<bos> $A <eos>" if add_bos else "$A <eos>")
    tok.post_processor = processors.TemplateProcessing(
        single=template, special_tokens=[("<bos>", vocab["<bos>"]), ("<eos>", vocab["<eos>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<bos>",
        eos_token="<eos>",
        model_max_length=max_length,
    )


@dataclass
class TinySD3Spec:
    """Sizes of a small SD3 pipeline. `text_encoders` picks the subset: any of "clip_l", "clip_g", "t5"."""

    words: list[str]
    text_encoders: tuple[str, ...] = ("clip_l", "clip_g", "t5")
    clip_hidden: int = 32
    clip_layers: int = 2
    clip_l_proj: int = 32
    clip_g_proj: int = 32
    clip_max_length: int = 16
    t5_d_model: int = 64
    t5_layers: int = 1
    t5_max_length: int = 16
    num_layers: int = 2
    heads: int = 2
    head_dim: int = 16
    latent_channels: int = 4
    patch_size: int = 2
    image_size: int = 32
    vae_channels: tuple[int, ...] = (16, 32)
    vae_layers: int = 1
    vae_norm_groups: int = 8
    vae_mid_attention: bool = True
    shift: float = 3.0
    dual_attention_layers: tuple[int, ...] = ()
    qk_norm: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def vae_factor(self) -> int:
        return 2 ** (len(self.vae_channels) - 1)

    @property
    def joint_attention_dim(self) -> int:
        clip_dim = self.clip_hidden * sum(t in ("clip_l", "clip_g") for t in self.text_encoders)
        return max(clip_dim, self.t5_d_model if "t5" in self.text_encoders else 0)

    @property
    def pooled_dim(self) -> int:
        return ("clip_l" in self.text_encoders) * self.clip_l_proj + ("clip_g" in self.text_encoders) * self.clip_g_proj


def build_tiny_sd3(spec: TinySD3Spec, seed: int = 0) -> StableDiffusion3Pipeline:
    torch.manual_seed(seed)
    if not any(t in spec.text_encoders for t in ("clip_l", "clip_g")):
        raise ValueError("an SD3 pipeline needs at least one CLIP text encoder for the pooled embedding")
    parts: dict = {}
    for slot, name, proj in (("", "clip_l", spec.clip_l_proj), ("_2", "clip_g", spec.clip_g_proj)):
        if name in spec.text_encoders:
            tok = word_tokenizer(spec.words, spec.clip_max_length, add_bos=True)
            cfg = CLIPTextConfig(
                vocab_size=len(tok), hidden_size=spec.clip_hidden, intermediate_size=spec.clip_hidden * 4,
                num_hidden_layers=spec.clip_layers, num_attention_heads=max(1, spec.clip_hidden // 16),
                max_position_embeddings=spec.clip_max_length, projection_dim=proj,
                pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
            )
            parts["text_encoder" + slot], parts["tokenizer" + slot] = CLIPTextModelWithProjection(cfg), tok
        else:
            parts["text_encoder" + slot], parts["tokenizer" + slot] = None, None
    if "t5" in spec.text_encoders:
        tok = word_tokenizer(spec.words, spec.t5_max_length, add_bos=False)
        cfg = T5Config(
            vocab_size=len(tok), d_model=spec.t5_d_model, d_kv=16, d_ff=spec.t5_d_model * 2,
            num_layers=spec.t5_layers, num_heads=max(1, spec.t5_d_model // 16), pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id, decoder_start_token_id=tok.pad_token_id,
        )
        parts["text_encoder_3"], parts["tokenizer_3"] = T5EncoderModel(cfg), tok
    else:
        parts["text_encoder_3"], parts["tokenizer_3"] = None, None
    latent_size = spec.image_size // spec.vae_factor
    transformer = SD3Transformer2DModel(
        sample_size=latent_size, patch_size=spec.patch_size, in_channels=spec.latent_channels,
        num_layers=spec.num_layers, attention_head_dim=spec.head_dim, num_attention_heads=spec.heads,
        joint_attention_dim=spec.joint_attention_dim, caption_projection_dim=spec.heads * spec.head_dim,
        pooled_projection_dim=spec.pooled_dim, out_channels=spec.latent_channels,
        pos_embed_max_size=max(latent_size // spec.patch_size, 2) * 2,
        dual_attention_layers=tuple(spec.dual_attention_layers), qk_norm=spec.qk_norm,
    )
    n = len(spec.vae_channels)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n, block_out_channels=tuple(spec.vae_channels),
        layers_per_block=spec.vae_layers, latent_channels=spec.latent_channels,
        norm_num_groups=spec.vae_norm_groups, mid_block_add_attention=spec.vae_mid_attention,
        sample_size=spec.image_size, scaling_factor=1.0, shift_factor=0.0,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(shift=spec.shift)
    return StableDiffusion3Pipeline(transformer=transformer, scheduler=scheduler, vae=vae, **parts)


def save_tiny_sd3(spec: TinySD3Spec, path: str | Path, seed: int = 0) -> Path:
    pipe = build_tiny_sd3(spec, seed)
    pipe.save_pretrained(str(path))
    return Path(path)

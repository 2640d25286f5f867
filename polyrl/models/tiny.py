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
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import (
    CLIPTextConfig,
    CLIPTextModelWithProjection,
    PreTrainedTokenizerFast,
    Qwen3VLProcessor,
    T5Config,
    T5EncoderModel,
)
from transformers.processing_utils import ProcessorMixin

SPECIAL = ["<pad>", "<unk>", "<bos>", "<eos>"]


def word_tokenizer(words: list[str], max_length: int, add_bos: bool, letters: str = "") -> PreTrainedTokenizerFast:
    """A word-level tokenizer (lower-cased whitespace/punctuation split) that pads to `max_length`.

    `letters` (e.g. "ABC...Z"): character-level for these characters instead: nothing is lower-cased, and each of
    them is a token of its own wherever it occurs (`"HELLO"` -> `"`, H, E, L, L, O, `"`), while the other words
    stay whole (the toy text task spells its quoted word out to the model this way)."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    for w in sorted({w if letters else w.lower() for w in words} | set(letters)):
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    if letters:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Whitespace(),
            pre_tokenizers.Split(Regex("[" + "".join("\\" + c if c in "\\]^-" else c for c in letters) + "]"),
                                 behavior="isolated"),
        ])
    else:
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
    letters: str = ""  # characters tokenised one by one (`word_tokenizer`), e.g. the toy text task's A-Z
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
    sample_size: int | None = None  # transformer config value; None: the latent size
    pos_embed_max_size: int | None = None  # None: twice the latent patch grid
    vae_scaling_factor: float = 1.0
    vae_shift_factor: float = 0.0

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


def build_tiny_sd3(spec: TinySD3Spec, seed: int = 0, device: str = "cpu") -> StableDiffusion3Pipeline:
    """The pipeline with random weights; `device="cuda"` initialises billion-parameter sizes in seconds."""
    torch.manual_seed(seed)
    with torch.device(device):
        return _build_tiny_sd3(spec)


def _build_tiny_sd3(spec: TinySD3Spec) -> StableDiffusion3Pipeline:
    if not any(t in spec.text_encoders for t in ("clip_l", "clip_g")):
        raise ValueError("an SD3 pipeline needs at least one CLIP text encoder for the pooled embedding")
    parts: dict = {}
    for slot, name, proj in (("", "clip_l", spec.clip_l_proj), ("_2", "clip_g", spec.clip_g_proj)):
        if name in spec.text_encoders:
            tok = word_tokenizer(spec.words, spec.clip_max_length, add_bos=True, letters=spec.letters)
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
        tok = word_tokenizer(spec.words, spec.t5_max_length, add_bos=False, letters=spec.letters)
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
        sample_size=spec.sample_size or latent_size, patch_size=spec.patch_size, in_channels=spec.latent_channels,
        num_layers=spec.num_layers, attention_head_dim=spec.head_dim, num_attention_heads=spec.heads,
        joint_attention_dim=spec.joint_attention_dim, caption_projection_dim=spec.heads * spec.head_dim,
        pooled_projection_dim=spec.pooled_dim, out_channels=spec.latent_channels,
        pos_embed_max_size=spec.pos_embed_max_size or max(latent_size // spec.patch_size, 2) * 2,
        dual_attention_layers=tuple(spec.dual_attention_layers), qk_norm=spec.qk_norm,
    )
    n = len(spec.vae_channels)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n, block_out_channels=tuple(spec.vae_channels),
        layers_per_block=spec.vae_layers, latent_channels=spec.latent_channels,
        norm_num_groups=spec.vae_norm_groups, mid_block_add_attention=spec.vae_mid_attention,
        sample_size=spec.image_size, scaling_factor=spec.vae_scaling_factor, shift_factor=spec.vae_shift_factor,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(shift=spec.shift)
    return StableDiffusion3Pipeline(transformer=transformer, scheduler=scheduler, vae=vae, **parts)


def save_tiny_sd3(spec: TinySD3Spec, path: str | Path, seed: int = 0, device: str = "cpu",
                  transformer_dtype: torch.dtype = torch.float32) -> Path:
    pipe = build_tiny_sd3(spec, seed, device)
    pipe.transformer.to(transformer_dtype)
    pipe.save_pretrained(str(path))
    return Path(path)


# ----------------------------------------------------------------------------------------------- Qwen-Image
# The scheduler of the published Qwen-Image checkpoint: resolution-dependent ("dynamic") exponential shift,
# mu interpolated between base_shift at 256 image tokens and max_shift at 8192, stretched to end at 0.02.
QWEN_IMAGE_SCHEDULER = dict(
    base_image_seq_len=256, max_image_seq_len=8192, base_shift=0.5, max_shift=0.9, num_train_timesteps=1000,
    shift=1.0, shift_terminal=0.02, use_dynamic_shifting=True, time_shift_type="exponential",
)


@dataclass
class TinyQwenImageSpec:
    """Sizes of a Qwen-Image pipeline: `QwenImageTransformer2DModel` + `AutoencoderKLQwenImage` + a Qwen2.5-VL
    text encoder, with a word-level tokenizer. The defaults are tiny (tests); `qwen_image_bench_spec` gives the
    published transformer and VAE with a one-layer text-encoder stand-in of the real width."""

    words: list[str]
    text_hidden: int = 32  # = the transformer's joint_attention_dim
    text_layers: int = 1
    text_heads: int = 2
    text_kv_heads: int = 1
    text_intermediate: int = 64
    text_mrope_section: tuple[int, int, int] = (2, 3, 3)  # sums to text head_dim / 2
    num_layers: int = 2
    heads: int = 2
    head_dim: int = 16
    axes_dims_rope: tuple[int, int, int] = (4, 6, 6)  # sums to head_dim
    latent_channels: int = 4  # VAE z_dim; the transformer sees 4× this (2×2 patches)
    vae_base_dim: int = 8
    vae_dim_mult: tuple[int, ...] = (1, 2)
    vae_res_blocks: int = 1
    image_size: int = 32
    tokenizer_max_length: int = 1024 + 34 + 8
    scheduler: dict = field(default_factory=lambda: dict(QWEN_IMAGE_SCHEDULER))

    @property
    def vae_factor(self) -> int:
        return 2 ** (len(self.vae_dim_mult) - 1)


def qwen_image_bench_spec(words: list[str]) -> TinyQwenImageSpec:
    """docs/benchmark.md second workload: the published Qwen-Image transformer (60 layers, 24 heads × 128, joint
    width 3584, 20.4 B parameters) and VAE, with a one-layer Qwen2.5-VL text encoder of the real width 3584."""
    return TinyQwenImageSpec(
        words=words, text_hidden=3584, text_layers=1, text_heads=28, text_kv_heads=4, text_intermediate=1024,
        text_mrope_section=(16, 24, 24), num_layers=60, heads=24, head_dim=128, axes_dims_rope=(16, 56, 56),
        latent_channels=16, vae_base_dim=96, vae_dim_mult=(1, 2, 4, 4), vae_res_blocks=2, image_size=512,
    )


def _word_level_tokenizer(words: list[str], specials: list[str], pattern: str, template: str,
                          max_length: int) -> PreTrainedTokenizerFast:
    """Lower-cased word-level tokenizer: ids for `specials`, the newline, then every word of `words` and of
    `template` (its specials left out), split by regex `pattern`; pads with "<|endoftext|>" on the right."""
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab["\n"] = len(vocab)
    split = pre_tokenizers.Split(Regex(pattern), behavior="removed", invert=True)
    for s in specials:
        template = template.replace(s, " ")
    for w in sorted({w.lower() for w in words} | {w.lower() for w, _ in split.pre_tokenize_str(template)}):
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = split
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", unk_token="<unk>",
                                   model_max_length=max_length, padding_side="right")


def qwen_template_tokenizer(words: list[str], max_length: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer for the Qwen-Image prompt template: chat-markup specials, newlines as tokens (so the
    template's system + user header is 34 tokens, as with the real Qwen2 tokenizer), words and punctuation."""
    from .qwen_image import PROMPT_TEMPLATE

    return _word_level_tokenizer(words, ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"], r"\w+|[^\w\s]+|\n",
                                 PROMPT_TEMPLATE.replace("{}", " "), max_length)


def build_tiny_qwen_image(spec: TinyQwenImageSpec, seed: int = 0, device: str | torch.device = "cpu",
                     dtype: torch.dtype = torch.float32):
    """A random-weight `QwenImagePipeline` of `spec`'s sizes, created directly on `device` in `dtype` (the
    full-size transformer is 20 B parameters: build it on the GPU, in bf16)."""
    from diffusers import AutoencoderKLQwenImage, QwenImagePipeline, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    tokenizer = qwen_template_tokenizer(spec.words, spec.tokenizer_max_length)
    text_config = dict(
        vocab_size=len(tokenizer), hidden_size=spec.text_hidden, intermediate_size=spec.text_intermediate,
        num_hidden_layers=spec.text_layers, num_attention_heads=spec.text_heads, num_key_value_heads=spec.text_kv_heads,
        max_position_embeddings=spec.tokenizer_max_length + 64, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"), eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        rope_scaling={"type": "mrope", "mrope_section": list(spec.text_mrope_section)},
    )
    vision_config = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=spec.text_hidden,
                         fullatt_block_indexes=[0])
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # allocate parameters in their final dtype (no fp32 copy of 20 B weights)
    try:
        with torch.device(device):
            text_encoder = Qwen2_5_VLForConditionalGeneration(
                Qwen2_5_VLConfig(text_config=text_config, vision_config=vision_config,
                                 bos_token_id=text_config["bos_token_id"], eos_token_id=text_config["eos_token_id"]))
            transformer = QwenImageTransformer2DModel(
                patch_size=2, in_channels=4 * spec.latent_channels, out_channels=spec.latent_channels,
                num_layers=spec.num_layers, attention_head_dim=spec.head_dim, num_attention_heads=spec.heads,
                joint_attention_dim=spec.text_hidden, axes_dims_rope=tuple(spec.axes_dims_rope),
            )
            n = len(spec.vae_dim_mult)
            vae_kwargs = {}
            if spec.latent_channels != 16:  # the published per-channel statistics are for 16 channels
                vae_kwargs = dict(latents_mean=[0.1 * i for i in range(spec.latent_channels)],
                                  latents_std=[1.0 + 0.25 * i for i in range(spec.latent_channels)])
            vae = AutoencoderKLQwenImage(
                base_dim=spec.vae_base_dim, z_dim=spec.latent_channels, dim_mult=list(spec.vae_dim_mult),
                num_res_blocks=spec.vae_res_blocks, temperal_downsample=[False] + [True] * (n - 2) if n > 1 else [],
                **vae_kwargs,
            )
    finally:
        torch.set_default_dtype(default_dtype)
    scheduler = FlowMatchEulerDiscreteScheduler(**spec.scheduler)
    return QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder.eval(), tokenizer=tokenizer,
                             transformer=transformer)


def save_tiny_qwen_image(spec: TinyQwenImageSpec, path: str | Path, seed: int = 0, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.float32) -> Path:
    """Build with `build_tiny_qwen_image` and `save_pretrained` into `path` (a diffusers directory)."""
    pipe = build_tiny_qwen_image(spec, seed, device, dtype)
    pipe.save_pretrained(str(path))
    return Path(path)


# ----------------------------------------------------------------------------------------------- Wan
# Schedulers of the published Wan checkpoints: UniPC on flow sigmas with a flow shift (Wan2.1-T2V-1.3B: 3.0,
# Wan2.2-TI2V-5B: 5.0). polyrl samples on its own grid with the same shift (models/wan.py: `wan_sigmas`).
WAN_LAYOUTS = ("wan2.1", "wan2.2-ti2v")


@dataclass
class TinyWanSpec:
    """Sizes of a small `WanPipeline`: `WanTransformer3DModel` + `AutoencoderKLWan` + a `UMT5EncoderModel` with a
    word-level tokenizer.

    `layout` picks the published latent layout: "wan2.1" (VAE z_dim 16, 8× spatial / 4× temporal compression,
    one timestep per sample) or "wan2.2-ti2v" (Wan2.2-TI2V-5B: VAE z_dim 48 with a 2×2 pixel patchify in front of
    the encoder, 16× spatial compression, `expand_timesteps=True`: one timestep per latent token). The VAE here has
    the real compression factors (three downsampling stages, two of them temporal) at tiny widths.
    `boundary_ratio` adds a second expert (`transformer_2`) as in Wan2.2-A14B, which pairs the Wan2.1 VAE with two
    transformers switched at t = boundary_ratio·1000.
    `image_to_video` builds a `WanImageToVideoPipeline` instead (models/wan_i2v.py): with "wan2.2-ti2v" the same
    transformer (the condition image replaces the first latent frame), with "wan2.1" a transformer that also takes
    the mask and condition-latent channels (in_channels 2·16 + 4 = 36, as Wan2.2-I2V-A14B; no CLIP image encoder).
    """

    words: list[str]
    layout: str = "wan2.1"
    text_d_model: int = 32  # UMT5 width = the transformer's text_dim
    text_layers: int = 1
    text_heads: int = 2
    text_max_length: int = 512
    num_layers: int = 2
    heads: int = 2
    head_dim: int = 12  # RoPE splits it into t/h/w parts: h = w = 2·(head_dim // 6), t = the rest
    ffn_dim: int = 64
    freq_dim: int = 32
    vae_base_dim: int = 8
    vae_decoder_base_dim: int | None = None  # None: twice vae_base_dim for wan2.2-ti2v, vae_base_dim for wan2.1
    vae_dim_mult: tuple[int, ...] = (1, 2, 2, 2)
    vae_res_blocks: int = 1
    scheduler: str = "unipc"  # unipc (as published) | euler (FlowMatchEulerDiscreteScheduler with the same shift)
    shift: float | None = None  # None: the layout's published flow shift (wan2.1 1.3B: 3.0, wan2.2 TI2V-5B: 5.0)
    boundary_ratio: float | None = None  # set: two experts (A14B layout)
    image_to_video: bool = False  # a WanImageToVideoPipeline (first-frame condition)

    def __post_init__(self):
        if self.layout not in WAN_LAYOUTS:
            raise ValueError(f"TinyWanSpec.layout={self.layout!r}; allowed: {', '.join(WAN_LAYOUTS)}")

    @property
    def ti2v(self) -> bool:
        return self.layout == "wan2.2-ti2v"

    @property
    def z_dim(self) -> int:
        return 48 if self.ti2v else 16

    @property
    def vae_patch(self) -> int:
        return 2 if self.ti2v else 1

    @property
    def spatial_factor(self) -> int:
        return self.vae_patch * 2 ** (len(self.vae_dim_mult) - 1)

    @property
    def in_channels(self) -> int:
        """The transformer's input channels: the latents, plus mask (4) and condition latents for channel-concat I2V."""
        return self.z_dim + (4 + self.z_dim if self.image_to_video and not self.ti2v else 0)

    @property
    def flow_shift(self) -> float:
        return self.shift if self.shift is not None else (5.0 if self.ti2v else 3.0)


def _tiny_wan_transformer(spec: TinyWanSpec):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=spec.heads, attention_head_dim=spec.head_dim,
        in_channels=spec.in_channels, out_channels=spec.z_dim, text_dim=spec.text_d_model, freq_dim=spec.freq_dim,
        ffn_dim=spec.ffn_dim, num_layers=spec.num_layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        eps=1e-6, rope_max_seq_len=1024,
    )


def wan_bench_spec(words: list[str], layout: str) -> TinyWanSpec:
    """A published Wan2.2 transformer and VAE with a one-layer UMT5 stand-in of the real width 4096:
    "wan2.2-ti2v" is TI2V-5B (30 layers, 24 heads × 128, FFN 14336; the Wan2.2 VAE: z 48, base 160, decoder base
    256), "wan2.2-a14b" each of A14B's two experts (40 layers, 40 heads × 128, FFN 13824; the Wan2.1 VAE, base 96;
    switched at boundary 0.875 as the T2V-A14B pipeline config does). Sizes from Wan's own configs
    (wan/configs/wan_ti2v_5B.py, wan_t2v_14B.py)."""
    common = dict(words=words, text_d_model=4096, text_layers=1, text_heads=64, head_dim=128, freq_dim=256,
                  vae_dim_mult=(1, 2, 4, 4), vae_res_blocks=2)
    if layout == "wan2.2-ti2v":
        return TinyWanSpec(layout="wan2.2-ti2v", num_layers=30, heads=24, ffn_dim=14336, vae_base_dim=160,
                           vae_decoder_base_dim=256, **common)
    if layout == "wan2.2-a14b":
        return TinyWanSpec(layout="wan2.1", num_layers=40, heads=40, ffn_dim=13824, vae_base_dim=96, shift=12.0,
                           boundary_ratio=0.875, **common)
    raise ValueError(f"wan_bench_spec: layout={layout!r}; allowed: wan2.2-ti2v, wan2.2-a14b")


def build_tiny_wan(spec: TinyWanSpec, seed: int = 0, device: str | torch.device = "cpu",
                   dtype: torch.dtype = torch.float32):
    """A random-weight `WanPipeline` (`WanImageToVideoPipeline` with `spec.image_to_video`) of `spec`'s sizes,
    created directly on `device` with the transformers in `dtype` (published sizes are billions of parameters: build
    them on the GPU, in bf16); VAE and text encoder stay float32."""
    from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline, WanPipeline

    torch.manual_seed(seed)
    with torch.device(device):
        parts = _tiny_wan_modules(spec, dtype)
    if spec.scheduler == "unipc":
        scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                            flow_shift=spec.flow_shift, num_train_timesteps=1000)
    elif spec.scheduler == "euler":
        scheduler = FlowMatchEulerDiscreteScheduler(shift=spec.flow_shift, num_train_timesteps=1000)
    else:
        raise ValueError(f"TinyWanSpec.scheduler={spec.scheduler!r}; allowed: unipc, euler")
    pipeline = WanImageToVideoPipeline if spec.image_to_video else WanPipeline
    return pipeline(scheduler=scheduler, boundary_ratio=spec.boundary_ratio, expand_timesteps=spec.ti2v, **parts)


def _tiny_wan_modules(spec: TinyWanSpec, dtype: torch.dtype) -> dict:
    from diffusers import AutoencoderKLWan
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = word_tokenizer(spec.words, spec.text_max_length, add_bos=False)  # T5 style: "words </s>"
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=spec.text_d_model, d_kv=spec.text_d_model // spec.text_heads,
        d_ff=spec.text_d_model * 2, num_layers=spec.text_layers, num_heads=spec.text_heads,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )).eval()
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # allocate the transformers in their final dtype (no float32 copy of 5–14 B weights)
    try:
        transformer = _tiny_wan_transformer(spec)
        transformer_2 = _tiny_wan_transformer(spec) if spec.boundary_ratio is not None else None
    finally:
        torch.set_default_dtype(default_dtype)
    z, stages = spec.z_dim, len(spec.vae_dim_mult) - 1
    decoder_base = spec.vae_decoder_base_dim or spec.vae_base_dim * (2 if spec.ti2v else 1)
    vae = AutoencoderKLWan(
        base_dim=spec.vae_base_dim, decoder_base_dim=decoder_base, z_dim=z,
        dim_mult=list(spec.vae_dim_mult), num_res_blocks=spec.vae_res_blocks, attn_scales=[],
        temperal_downsample=[False] * (stages - 2) + [True, True], is_residual=spec.ti2v,
        in_channels=3 * spec.vae_patch**2, out_channels=3 * spec.vae_patch**2,
        patch_size=spec.vae_patch if spec.ti2v else None,
        scale_factor_temporal=4, scale_factor_spatial=spec.spatial_factor,
        # per-channel statistics away from (0, 1), so that the normalisation is exercised
        latents_mean=[0.05 * (i % 7) - 0.15 for i in range(z)], latents_std=[0.8 + 0.1 * (i % 5) for i in range(z)],
    )
    return dict(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                transformer_2=transformer_2)


def save_tiny_wan(spec: TinyWanSpec, path: str | Path, seed: int = 0, device: str | torch.device = "cpu",
                  dtype: torch.dtype = torch.float32, stored_dtype: torch.dtype | None = None) -> Path:
    """Build with `build_tiny_wan` and `save_pretrained` into `path` (a diffusers directory). `stored_dtype` (e.g.
    float8_e4m3fn) writes the transformers' weights in that dtype: random weights lose nothing that matters, and
    A14B's two 14 B experts take 28 GB on disk instead of 56 (`from_pretrained` casts back to model.dtype)."""
    pipe = build_tiny_wan(spec, seed, device, dtype)
    if stored_dtype is not None:
        for name in ("transformer", "transformer_2"):
            if getattr(pipe, name, None) is not None:
                getattr(pipe, name).to(stored_dtype)
    pipe.save_pretrained(str(path))
    return Path(path)


# ----------------------------------------------------------------------------------------------- Qwen-Image-Edit
QWEN_VL_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


@dataclass
class TinyQwenImageEditSpec(TinyQwenImageSpec):
    """Sizes of a Qwen-Image-Edit (or, with `plus`, Edit-Plus) pipeline: the Qwen-Image sizes plus a Qwen2.5-VL
    vision tower and the Qwen2-VL image processor (pixel limits `vl_min_pixels`..`vl_max_pixels`, patch
    `vision_patch`, 2×2 merge)."""

    plus: bool = False
    vision_hidden: int = 16
    vision_patch: int = 14
    vl_min_pixels: int = 56 * 56
    vl_max_pixels: int = 28 * 28 * 64


def qwen_vl_template_tokenizer(words: list[str], max_length: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer for the Qwen-Image-Edit templates: chat and vision specials, newlines as tokens, and
    English contractions ('s) as one token, so the Edit system prompt + user header is 64 tokens as with the real
    Qwen2 tokenizer; vocabulary: `words`, both Edit templates' words, "picture" and the digits."""
    from .qwen_image_edit import EDIT_TEMPLATE, PLUS_PICTURE

    text = EDIT_TEMPLATE.replace("{}", " ") + PLUS_PICTURE + " " + " ".join(str(i) for i in range(10))
    return _word_level_tokenizer(words, ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>", *QWEN_VL_SPECIALS],
                                 r"'s|'t|'re|'ve|'m|'ll|'d|\w+|[^\w\s]+|\n", text, max_length)


def build_tiny_qwen_image_edit(spec: TinyQwenImageEditSpec, seed: int = 0) -> dict:
    """The components of a random-weight Qwen-Image-Edit(-Plus) pipeline: Qwen-Image's transformer, VAE and
    scheduler (`build_tiny_qwen_image`), a Qwen2.5-VL text encoder with a vision tower, the tokenizer, and the
    Qwen2-VL image processor (`vl_image_processor`; the pipelines' `Qwen2VLProcessor` pairs it with the tokenizer
    but cannot be built without torchvision)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessor

    base = build_tiny_qwen_image(spec, seed)
    tokenizer = qwen_vl_template_tokenizer(spec.words, spec.tokenizer_max_length)
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    bos, eos = tokenizer.convert_tokens_to_ids("<|im_start|>"), tokenizer.convert_tokens_to_ids("<|im_end|>")
    text_config = dict(
        vocab_size=len(tokenizer), hidden_size=spec.text_hidden, intermediate_size=spec.text_intermediate,
        num_hidden_layers=spec.text_layers, num_attention_heads=spec.text_heads, num_key_value_heads=spec.text_kv_heads,
        max_position_embeddings=spec.tokenizer_max_length + 64, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=bos, eos_token_id=eos,
        rope_scaling={"type": "mrope", "mrope_section": list(spec.text_mrope_section)},
    )
    vision_config = dict(depth=1, hidden_size=spec.vision_hidden, intermediate_size=2 * spec.vision_hidden, num_heads=2,
                         out_hidden_size=spec.text_hidden, patch_size=spec.vision_patch, spatial_merge_size=2,
                         temporal_patch_size=2, fullatt_block_indexes=[0])
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=text_config, vision_config=vision_config, bos_token_id=bos, eos_token_id=eos, **ids)).eval()
    vl_image_processor = Qwen2VLImageProcessor(min_pixels=spec.vl_min_pixels, max_pixels=spec.vl_max_pixels,
                                               patch_size=spec.vision_patch, merge_size=2, temporal_patch_size=2)
    return dict(scheduler=base.scheduler, vae=base.vae, transformer=base.transformer, text_encoder=text_encoder,
                tokenizer=tokenizer, vl_image_processor=vl_image_processor)


def save_tiny_qwen_image_edit(spec: TinyQwenImageEditSpec, path: str | Path, seed: int = 0) -> Path:
    """Build with `build_tiny_qwen_image_edit` and save in the published diffusers layout: model_index.json names
    `QwenImageEdit(Plus)Pipeline` and a `processor` component (transformers `Qwen2VLProcessor`) whose folder holds
    the image processor and the tokenizer, as the published checkpoints' `processor/` does."""
    import json

    from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline

    parts = build_tiny_qwen_image_edit(spec, seed)
    vl_image_processor = parts.pop("vl_image_processor")
    cls = QwenImageEditPlusPipeline if spec.plus else QwenImageEditPipeline
    cls(processor=None, **parts).save_pretrained(str(path))  # the processor needs torchvision: saved by hand below
    path = Path(path)
    vl_image_processor.save_pretrained(str(path / "processor"))
    parts["tokenizer"].save_pretrained(str(path / "processor"))
    index = json.loads((path / "model_index.json").read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    (path / "model_index.json").write_text(json.dumps(index, indent=2))
    return path


# ----------------------------------------------------------------------------------------------- SD3 with one CLIP
def null_clip_encoder(tokenizer, max_length: int) -> CLIPTextModelWithProjection:
    """A CLIP text encoder that contributes nothing, for the `text_encoder_2` slot of an SD3 pipeline trained with
    one CLIP (StableDiffusion3Pipeline requires both CLIP slots). Every weight is zero, so its hidden states are
    exactly zero, and its projection has width 0 (no pooled features): diffusers concatenates its features after
    the first CLIP's and crops or zero-pads to the joint width, and polyrl's `sd3` adapter does the same, so both
    compute what the one-CLIP model was trained with."""
    cfg = CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=4, intermediate_size=4, num_hidden_layers=1, num_attention_heads=1,
        max_position_embeddings=max_length, projection_dim=0, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    model = CLIPTextModelWithProjection(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model.eval()


def fill_clip_g_slot(pipe: StableDiffusion3Pipeline) -> StableDiffusion3Pipeline:
    """A one-CLIP pipeline with `null_clip_encoder` (and the first tokenizer) in its empty CLIP-G slot, so that
    `StableDiffusion3Pipeline.from_pretrained` loads the saved directory (text_encoder_3=None, tokenizer_3=None
    when it has no T5)."""
    if pipe.text_encoder_2 is None:
        tok = pipe.tokenizer
        pipe.register_modules(text_encoder_2=null_clip_encoder(tok, tok.model_max_length), tokenizer_2=tok)
    return pipe


# ----------------------------------------------------------------------------------------------- FLUX.1 / Kontext
# The schedulers of the published FLUX.1 checkpoints: dev and Kontext-dev shift with the image token count (μ between
# base_shift at 256 tokens and max_shift at 4096, exponential time shift); schnell uses a fixed shift of 1 (none).
FLUX_DEV_SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15,
                          num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True)
FLUX_SCHNELL_SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15,
                              num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)
FLUX_LAYOUTS = ("dev", "schnell", "kontext")


@dataclass
class TinyFluxSpec:
    """Sizes of a small FLUX.1 pipeline: `FluxTransformer2DModel` + `AutoencoderKL` (16-channel FLUX layout: scaling
    and shift factors) + CLIP (pooled) and T5 (tokens) text encoders with word-level tokenizers. `layout`: "dev"
    (guidance embedding, dynamic shift), "schnell" (no guidance embedding, no shift) or "kontext" (dev's transformer
    in a `FluxKontextPipeline`)."""

    words: list[str]
    layout: str = "dev"
    clip_hidden: int = 32  # = the transformer's pooled_projection_dim
    clip_max_length: int = 16
    t5_d_model: int = 32  # = the transformer's joint_attention_dim
    t5_max_length: int = 32
    num_layers: int = 1
    num_single_layers: int = 2
    heads: int = 2
    head_dim: int = 16
    axes_dims_rope: tuple[int, int, int] = (4, 6, 6)  # sums to head_dim
    latent_channels: int = 4  # VAE latent channels; the transformer sees 4x this (2x2 patches)
    vae_channels: tuple[int, ...] = (16, 32)
    vae_scaling_factor: float = 0.36  # FLUX.1's VAE: 0.3611, shift 0.1159
    vae_shift_factor: float = 0.12

    @property
    def vae_factor(self) -> int:
        return 2 ** (len(self.vae_channels) - 1)


def build_tiny_flux(spec: TinyFluxSpec, seed: int = 0):
    """A random-weight `FluxPipeline` (`FluxKontextPipeline` for layout "kontext") of `spec`'s sizes."""
    from diffusers import FluxKontextPipeline, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel

    if spec.layout not in FLUX_LAYOUTS:
        raise ValueError(f"TinyFluxSpec.layout={spec.layout!r}; allowed: {', '.join(FLUX_LAYOUTS)}")
    torch.manual_seed(seed)
    clip_tok = word_tokenizer(spec.words, spec.clip_max_length, add_bos=True)
    clip = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(clip_tok), hidden_size=spec.clip_hidden, intermediate_size=spec.clip_hidden * 2,
        num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=spec.clip_max_length,
        pad_token_id=clip_tok.pad_token_id, bos_token_id=clip_tok.bos_token_id, eos_token_id=clip_tok.eos_token_id,
    )).eval()
    t5_tok = word_tokenizer(spec.words, spec.t5_max_length, add_bos=False)
    t5 = T5EncoderModel(T5Config(
        vocab_size=len(t5_tok), d_model=spec.t5_d_model, d_kv=16, d_ff=spec.t5_d_model * 2, num_layers=1,
        num_heads=max(1, spec.t5_d_model // 16), pad_token_id=t5_tok.pad_token_id, eos_token_id=t5_tok.eos_token_id,
        decoder_start_token_id=t5_tok.pad_token_id,
    )).eval()
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4 * spec.latent_channels, num_layers=spec.num_layers,
        num_single_layers=spec.num_single_layers, attention_head_dim=spec.head_dim, num_attention_heads=spec.heads,
        joint_attention_dim=spec.t5_d_model, pooled_projection_dim=spec.clip_hidden,
        guidance_embeds=spec.layout != "schnell", axes_dims_rope=tuple(spec.axes_dims_rope),
    )
    n = len(spec.vae_channels)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n, block_out_channels=tuple(spec.vae_channels), layers_per_block=1,
        latent_channels=spec.latent_channels, norm_num_groups=8, scaling_factor=spec.vae_scaling_factor,
        shift_factor=spec.vae_shift_factor, use_quant_conv=False, use_post_quant_conv=False,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        **(FLUX_SCHNELL_SCHEDULER if spec.layout == "schnell" else FLUX_DEV_SCHEDULER))
    cls = FluxKontextPipeline if spec.layout == "kontext" else FluxPipeline
    return cls(scheduler=scheduler, vae=vae, text_encoder=clip, tokenizer=clip_tok, text_encoder_2=t5,
               tokenizer_2=t5_tok, transformer=transformer)


def save_tiny_flux(spec: TinyFluxSpec, path: str | Path, seed: int = 0) -> Path:
    """Build with `build_tiny_flux` and `save_pretrained` into `path` (a diffusers directory)."""
    build_tiny_flux(spec, seed).save_pretrained(str(path))
    return Path(path)


# ----------------------------------------------------------------------------------------------- FLUX.2
FLUX2_LAYOUTS = ("klein", "klein-distilled", "dev")
# FLUX.2's scheduler: the pipelines compute μ themselves (`compute_empirical_mu`); the exponential time shift is the
# scheduler's (use_dynamic_shifting).
FLUX2_SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15,
                       num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True)
# Minimal chat templates with the published renderings: Qwen3's user turn and generation prompt with thinking off
# (the empty think block), and Mistral-Small-3's system prompt + instruction markup over content lists.
QWEN3_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
MISTRAL3_CHAT_TEMPLATE = (
    "<s>{%- for m in messages %}{%- if m.role == 'system' %}[SYSTEM_PROMPT]{%- for c in m.content %}{{ c.text }}"
    "{%- endfor %}[/SYSTEM_PROMPT]{%- else %}[INST]{%- for c in m.content %}{{ c.text }}{%- endfor %}[/INST]"
    "{%- endif %}{%- endfor %}"
)


@dataclass
class TinyFlux2Spec:
    """Sizes of a small FLUX.2 pipeline: `Flux2Transformer2DModel` + `AutoencoderKLFlux2` + the layout's text encoder.
    `layout`: "klein" (`Flux2KleinPipeline`, Qwen3 text encoder, no guidance embedding: CFG), "klein-distilled" (the
    same with `is_distilled`: no guidance at all) or "dev" (`Flux2Pipeline`, Mistral-3 text encoder, guidance
    embedding). The text encoders have as many layers as the pipelines read hidden states from (28 / 31)."""

    words: list[str]
    layout: str = "klein"
    text_hidden: int = 16  # the transformer's joint_attention_dim is 3x this (three stacked layers)
    text_max_length: int = 64
    num_layers: int = 1
    num_single_layers: int = 2
    heads: int = 2
    head_dim: int = 16
    axes_dims_rope: tuple[int, ...] = (4, 4, 4, 4)  # sums to head_dim
    latent_channels: int = 8  # VAE latent channels; the transformer sees 4x this (2x2 patches)
    vae_channels: tuple[int, ...] = (16, 32)

    @property
    def vae_factor(self) -> int:
        return 2 ** (len(self.vae_channels) - 1)


def _flux2_text_encoder(spec: TinyFlux2Spec):
    """(text encoder, tokenizer) of the layout, random weights."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>", "<think>", "</think>"]
    markup = ["<s>", "</s>", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[INST]", "[/INST]", "[IMG]"]
    dev = spec.layout == "dev"
    if dev:
        from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

        specials = ["<pad>", "<unk>", *markup]
    words = list(spec.words) + ["user", "assistant"] + (SYSTEM_MESSAGE.split() if dev else [])
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab["\n"] = len(vocab)
    split = pre_tokenizers.Split(Regex(r"\w+|[^\w\s]+|\n"), behavior="removed", invert=True)
    for w in sorted({w for text in words for w, _ in split.pre_tokenize_str(text.lower())}):
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = split
    tok.add_special_tokens(specials)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=specials[0], unk_token="<unk>", model_max_length=spec.text_max_length,
        padding_side="right", chat_template=MISTRAL3_CHAT_TEMPLATE if dev else QWEN3_CHAT_TEMPLATE)
    text = dict(vocab_size=len(tokenizer), hidden_size=spec.text_hidden, intermediate_size=2 * spec.text_hidden,
                num_attention_heads=2, num_key_value_heads=1, head_dim=spec.text_hidden // 2,
                max_position_embeddings=spec.text_max_length + 16, pad_token_id=tokenizer.pad_token_id)
    if dev:
        from transformers import Mistral3Config, Mistral3ForConditionalGeneration

        vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=8,
                      image_size=28, patch_size=14)
        config = Mistral3Config(text_config=dict(model_type="mistral", num_hidden_layers=31, **text),
                                vision_config=dict(model_type="pixtral", **vision),
                                image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"))
        return Mistral3ForConditionalGeneration(config).eval(), tokenizer
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=28, **text)).eval(), tokenizer


def build_tiny_flux2(spec: TinyFlux2Spec, seed: int = 0):
    """A random-weight `Flux2KleinPipeline` / `Flux2Pipeline` of `spec`'s sizes (the VAE's batch-norm statistics away
    from 0 / 1, so that the latent normalisation is exercised)."""
    from diffusers import AutoencoderKLFlux2, Flux2KleinPipeline, Flux2Pipeline, Flux2Transformer2DModel

    if spec.layout not in FLUX2_LAYOUTS:
        raise ValueError(f"TinyFlux2Spec.layout={spec.layout!r}; allowed: {', '.join(FLUX2_LAYOUTS)}")
    torch.manual_seed(seed)
    text_encoder, tokenizer = _flux2_text_encoder(spec)
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=4 * spec.latent_channels, num_layers=spec.num_layers,
        num_single_layers=spec.num_single_layers, attention_head_dim=spec.head_dim, num_attention_heads=spec.heads,
        joint_attention_dim=3 * spec.text_hidden, axes_dims_rope=tuple(spec.axes_dims_rope),
        guidance_embeds=spec.layout == "dev",
    )
    n = len(spec.vae_channels)
    vae = AutoencoderKLFlux2(
        down_block_types=("DownEncoderBlock2D",) * n, up_block_types=("UpDecoderBlock2D",) * n,
        block_out_channels=tuple(spec.vae_channels), layers_per_block=1, latent_channels=spec.latent_channels,
        norm_num_groups=8, sample_size=64,
    )
    channels = vae.bn.running_mean.numel()
    vae.bn.running_mean.copy_(torch.linspace(-0.3, 0.3, channels))
    vae.bn.running_var.copy_(torch.linspace(0.5, 2.0, channels))
    scheduler = FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER)
    parts = dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)
    if spec.layout == "dev":
        return Flux2Pipeline(**parts)
    return Flux2KleinPipeline(**parts, is_distilled=spec.layout == "klein-distilled")


def save_tiny_flux2(spec: TinyFlux2Spec, path: str | Path, seed: int = 0) -> Path:
    """Build with `build_tiny_flux2` and save in the published layout (FLUX.2-dev's model_index.json names the
    tokenizer a transformers `PixtralProcessor`, which cannot be built without torchvision: the tokenizer is saved
    and the index entry written by hand)."""
    import json

    path = Path(path)
    build_tiny_flux2(spec, seed).save_pretrained(str(path))
    if spec.layout == "dev":
        index = json.loads((path / "model_index.json").read_text())
        index["tokenizer"] = ["transformers", "PixtralProcessor"]
        (path / "model_index.json").write_text(json.dumps(index, indent=2))
    return path


# ----------------------------------------------------------------------------------------------- HunyuanVideo-1.5
def save_tiny_hunyuan_video15(words: list[str], path: str | Path, seed: int = 0) -> Path:
    """A random-weight `HunyuanVideo15Pipeline` (text-to-video) of the published component classes at tiny sizes,
    saved with `save_pretrained`: a two-layer Qwen2.5-VL text model (the pipeline reads the third-last hidden state)
    with a word-level tokenizer whose chat rendering of the pipeline's system message is 108 tokens, as the Qwen2
    tokenizer's (the pipeline crops those 108 off), ByT5's tokenizer with a one-layer T5 encoder (quoted glyph text),
    the transformer (t2v), the VAE at 4× spatial / 2× temporal compression, Euler with shift 7 and a CFG guider."""
    import inspect

    from diffusers import AutoencoderKLHunyuanVideo15, HunyuanVideo15Pipeline, HunyuanVideo15Transformer3DModel
    from diffusers.guiders import ClassifierFreeGuidance
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    system = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters["system_message"].default
    tokenizer = _word_level_tokenizer(words, ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"],
                                      r"\w+|[^\w\s]+|\n| {4}", system + " system user assistant", 1108)
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    torch.manual_seed(seed)
    text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=1200, pad_token_id=tokenizer.pad_token_id, rope_theta=1e6,
        rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"})).eval()
    byt5 = T5EncoderModel(T5Config(vocab_size=384, d_model=32, d_kv=16, d_ff=32, num_layers=1, num_heads=2)).eval()
    transformer = HunyuanVideo15Transformer3DModel(
        in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1, num_refiner_layers=1,
        mlp_ratio=2.0, text_embed_dim=16, text_embed_2_dim=32, image_embed_dim=12, rope_axes_dim=(2, 2, 4),
        target_size=16, task_type="t2v")
    vae = AutoencoderKLHunyuanVideo15(
        latent_channels=4, block_out_channels=(16, 16), layers_per_block=1, spatial_compression_ratio=4,
        temporal_compression_ratio=2, downsample_match_channel=False, upsample_match_channel=False)
    HunyuanVideo15Pipeline(
        text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer, vae=vae.eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), text_encoder_2=byt5, tokenizer_2=ByT5Tokenizer(),
        guider=ClassifierFreeGuidance(guidance_scale=1.0)).save_pretrained(str(path))
    return Path(path)


# ----------------------------------------------------------------------------------------------- Qwen-Image 2.1
# Qwen's chat rendering for messages whose content is a string or a list of text parts (the Qwen3-VL processor's
# system message is a list).
QWEN_VL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for c in m.content %}{{ c.text }}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class TextQwen3VLProcessor(Qwen3VLProcessor):
    """transformers' `Qwen3VLProcessor` without its video processor, which cannot be built without torchvision
    (text-to-image never uses it). A tiny Qwen-Image 2.1 checkpoint's model_index.json names it (module
    `polyrl.models.tiny`, which `model=diffusers_pipeline` imports before loading; diffusers finds its load method
    through `ProcessorMixin`, imported here)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        for name in ("image_pad", "video_pad", "vision_start", "vision_end"):
            attr = name.replace("_pad", "")
            setattr(self, f"{attr}_token", f"<|{name}|>")
            setattr(self, f"{attr}_token_id", tokenizer.convert_tokens_to_ids(f"<|{name}|>"))
        # the tokenizer carries the same template: a load that finds no processor template still has one
        chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


def save_tiny_qwen_image21(words: list[str], path: str | Path, seed: int = 0) -> Path:
    """A random-weight `QwenImage21Pipeline` (text-to-image) at tiny sizes, saved with `save_pretrained`: a one-layer
    Qwen3-VL text encoder (with its vision tower, unused by text-to-image) and a word-level tokenizer in
    `TextQwen3VLProcessor`, the transformer on unpatched 8-channel latents, the VAE at the 16× compression the
    pipeline assumes (decoding RGBA), Euler with the default dynamic shift."""
    from diffusers import AutoencoderKLQwenImage21, QwenImage21Pipeline, QwenImage21Transformer2DModel
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tokenizer = _word_level_tokenizer(
        words, ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>", *QWEN_VL_SPECIALS], r"\w+|[^\w\s]+|\n",
        "Comprehend and analyze the provided prompt. system user assistant", 256)
    tokenizer.chat_template = QWEN_VL_CHAT_TEMPLATE
    ids = {f"{n}_token_id": tokenizer.convert_tokens_to_ids(f"<|{t}|>") for n, t in (
        ("image", "image_pad"), ("video", "video_pad"), ("vision_start", "vision_start"), ("vision_end", "vision_end"))}
    torch.manual_seed(seed)
    z = 8
    text_encoder = Qwen3VLForConditionalGeneration(Qwen3VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=8, pad_token_id=tokenizer.pad_token_id,
                         rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[1, 1, 2])),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                           deepstack_visual_indexes=[0]), **ids)).eval()
    transformer = QwenImage21Transformer2DModel(
        patch_size=1, in_channels=z, out_channels=z, num_layers=1, attention_head_dim=16, num_attention_heads=2,
        context_in_dim=16, mlp_ratio=2, axes_dims_rope=(4, 6, 6))
    vae = AutoencoderKLQwenImage21(
        base_dim=4, decoder_base_dim=4, z_dim=z, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=1, attn_scales=[],
        temperal_downsample=[False, True, True, True], latents_mean=[0.0] * z, latents_std=[1.0] * z)
    processor = TextQwen3VLProcessor(
        image_processor=Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                                                 min_pixels=32 * 32, max_pixels=64 * 64),
        tokenizer=tokenizer, chat_template=QWEN_VL_CHAT_TEMPLATE)
    QwenImage21Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae.eval(), text_encoder=text_encoder,
                        processor=processor, transformer=transformer).save_pretrained(str(path))
    return Path(path)

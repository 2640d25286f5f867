"""A tiny random MiniMax-H3 modular pipeline for the tests (every component the three workflows load: two transformer
partitions, the video and audio VAEs, a Qwen3-VL text encoder with 51 tiny layers since MiniMax-H3 reads
hidden_states[50], a byte-level tokenizer, the processor, both schedulers), saved in the modular layout
(`modular_model_index.json`) and loaded back with `ModularPipeline.from_pretrained`.

Test-only shim: transformers' Qwen3VLProcessor insists on its video processor, which needs torchvision; the CI
machine has none (PyPI's torchvision wheels are CUDA builds that do not load on the CPU torch). MiniMax-H3 touches
the video processor only for video references, so `install_processor_shim` lets transformers build and load a
processor without it when torchvision is absent (a no-op otherwise). polyrl's own code loads the processor the
normal way.
"""

import importlib.util
import json
import os
import shutil

import torch
from diffusers import (
    AutoencoderKLMiniMaxH3,
    AutoencoderKLMiniMaxH3Audio,
    MiniMaxH3Scheduler,
    MiniMaxH3Transformer3DModel,
    ModularPipeline,
)
from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3ModularPipeline
from tokenizers.pre_tokenizers import ByteLevel
from transformers import Qwen2Tokenizer, Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None



def save_processor(processor_dir, tokenizer, image_processor):
    """Write a Qwen3VLProcessor directory (tokenizer files + preprocessor_config.json + processor_config.json)."""
    os.makedirs(processor_dir, exist_ok=True)
    tokenizer.save_pretrained(processor_dir)
    image_processor.save_pretrained(processor_dir)
    with open(os.path.join(processor_dir, "processor_config.json"), "w") as f:
        json.dump({"processor_class": "Qwen3VLProcessor"}, f, indent=2)


def install_processor_shim():
    if HAS_TORCHVISION:
        return
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers import processing_utils as pu

    if getattr(pu.ProcessorMixin, "_mmh3_patched", False):
        return
    orig_check = pu.ProcessorMixin.check_argument_for_proper_class

    def check(self, argument_name, argument):
        if argument is None and "video_processor" in argument_name:
            return None
        return orig_check(self, argument_name, argument)

    pu.ProcessorMixin.check_argument_for_proper_class = check
    pu.ProcessorMixin._mmh3_patched = True

    def from_pretrained(cls, pretrained_model_name_or_path, subfolder="", **kwargs):
        # the tokenizer and the image processor only (transformers' own loader resolves the video processor too,
        # by a route that changes between versions)
        root = os.path.join(pretrained_model_name_or_path, subfolder) if subfolder else pretrained_model_name_or_path
        return cls(image_processor=AutoImageProcessor.from_pretrained(root),
                   tokenizer=AutoTokenizer.from_pretrained(root), video_processor=None)

    Qwen3VLProcessor.from_pretrained = classmethod(from_pretrained)


# ---------------------------------------------------------------------------------------------------------------
# Tiny configs. Geometry that the pipeline hard-codes or derives is kept at the real values:
#   video VAE: spatial x16 (4 levels of 2), temporal x4, clip_length 17, token_drop 3  -> 17n+5 frames -> 5n+2 latents
#   transformer patch (1,2,2)  -> canvas_multiple = 16*2 = 32
#   audio VAE: hop 800 @ 32 kHz = 40 latents/s (the pipeline hard-codes 40 latents/s and 24 fps)
#   latent channels 24 (video) / 32 (audio), as in the release (the pipeline reads them from the VAE configs).
# ---------------------------------------------------------------------------------------------------------------
TEXT_DIM = 32  # Qwen3-VL text hidden size == transformer text_dim (5120 in the release)
VIDEO_LATENT_CHANNELS = 24
AUDIO_LATENT_CHANNELS = 32

TRANSFORMER_CONFIG = dict(
    num_attention_heads=2,
    attention_head_dim=32,  # must be >= 2*3*rope_freq_dim
    hidden_size=64,
    num_layers=2,
    num_refiner_layers=1,
    ffn_dim=128,
    in_channels=VIDEO_LATENT_CHANNELS,
    audio_in_channels=AUDIO_LATENT_CHANNELS,
    patch_size=(1, 2, 2),
    text_dim=TEXT_DIM,
    freq_dim=32,
    time_embed_hidden_dim=64,
    time_embed_dim=32,
    rope_freq_dim=4,
)

VAE_CONFIG = dict(
    latent_channels=VIDEO_LATENT_CHANNELS,
    block_out_channels=(8, 8, 8, 8),
    layers_per_block=1,
    spatial_downsample_factors=(2, 2, 2, 2),
    temporal_downsample_factors=(1, 2, 2, 1),
    norm_num_groups=4,
    decoder_num_layers=1,
    decoder_num_attention_heads=2,
    decoder_attention_head_dim=16,  # rope dim = 0.75*16 = 12, must be divisible by 6
    decoder_num_register_tokens=1,
    decoder_ffn_mult=2,
    clip_length=17,
    token_drop=3,
    latents_mean=tuple([0.0] * VIDEO_LATENT_CHANNELS),
    latents_std=tuple([1.0] * VIDEO_LATENT_CHANNELS),
)

AUDIO_VAE_CONFIG = dict(
    encoder_dim=4,
    encoder_rates=(8, 10, 10),  # prod 800 = hop
    latent_dim=64,  # multiple of latent_channels
    latent_channels=AUDIO_LATENT_CHANNELS,
    num_attention_heads=2,
    decoder_dim=32,
    decoder_rates=(8, 5, 5, 4),  # prod 800 (must equal encoder hop); decoder_dim // 2**len >= 1
    decoder_kernel_sizes=(16, 9, 9, 8),  # (k - rate) even so that out_len == rate * in_len
    resblock_kernel_sizes=(3,),
    resblock_dilation_sizes=((1,),),
    sampling_rate=32000,
    latents_mean=[0.0] * AUDIO_LATENT_CHANNELS,
    latents_std=[1.0] * AUDIO_LATENT_CHANNELS,
)

# Pipeline-level configs (ConfigSpecs of the blocks), stored in modular_model_index.json.
PIPELINE_CONFIGS = dict(
    canvas_short_edge=32,  # release: 768  -> default 16:9 canvas = 32x64
    canvas_max_pixels=32 * 64,  # release: 768*1344
    reference_image_short_edge=32,  # release: 2048 (image references are encoded at this short edge)
)

SPECIAL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def build_tokenizer():
    # Byte-level BPE with the 256 byte symbols and no merges: every UTF-8 byte is one token.
    alphabet = sorted(ByteLevel.alphabet(), key=ord)
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Qwen2Tokenizer(vocab=vocab, merges=[])  # adds <|endoftext|> (id 256)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})  # ids 257..260
    return tok


def build_image_processor():
    # Qwen3-VL geometry (patch 16, merge 2, temporal patch 2), tiny pixel budget.
    return Qwen2VLImageProcessorPil(
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        size={"shortest_edge": 32 * 32, "longest_edge": 64 * 64},
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )


def build_text_encoder(tok):
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=len(tok),
            hidden_size=TEXT_DIM,
            intermediate_size=64,
            num_hidden_layers=51,  # MiniMax-H3 reads hidden_states[50]; must be > 50
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            max_position_embeddings=4096,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 5000000.0,
                "mrope_section": [4, 2, 2],  # sums to head_dim/2
                "mrope_interleaved": True,
            },
        ),
        vision_config=dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=TEXT_DIM,
            num_position_embeddings=64,
            deepstack_visual_indexes=[0],
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(0)
    return Qwen3VLForConditionalGeneration(config).eval()


def build_components(seed=0):
    torch.manual_seed(seed)
    transformer = MiniMaxH3Transformer3DModel(**TRANSFORMER_CONFIG).eval()
    torch.manual_seed(seed + 1)
    transformer_ref = MiniMaxH3Transformer3DModel(**TRANSFORMER_CONFIG).eval()
    torch.manual_seed(seed + 2)
    vae = AutoencoderKLMiniMaxH3(**VAE_CONFIG).eval()
    torch.manual_seed(seed + 3)
    audio_vae = AutoencoderKLMiniMaxH3Audio(**AUDIO_VAE_CONFIG).eval()
    tokenizer = build_tokenizer()
    image_processor = build_image_processor()
    install_processor_shim()
    processor = Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=None)
    text_encoder = build_text_encoder(tokenizer)
    return dict(
        transformer=transformer,
        transformer_ref=transformer_ref,
        vae=vae,
        audio_vae=audio_vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        processor=processor,
        scheduler=MiniMaxH3Scheduler(shift=12.0),
        audio_scheduler=MiniMaxH3Scheduler(shift=3.0),
    )


def save_tiny(out_dir, seed=0):
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    comps = build_components(seed)

    # A pipeline with the default MiniMaxH3Blocks (all three workflows), components registered, configs set.
    pipe = MiniMaxH3ModularPipeline()
    processor = comps.pop("processor")
    pipe.update_components(**comps)
    pipe.register_to_config(**PIPELINE_CONFIGS)
    # save_pretrained writes every component to <dir>/<name>/ and modular_model_index.json pointing at <dir>.
    # The processor is written by hand because ProcessorMixin.save_pretrained cannot handle the missing
    # (torchvision-only) video processor.
    pipe.save_pretrained(out_dir, overwrite_modular_index=True)
    save_processor(os.path.join(out_dir, "processor"), processor.tokenizer, processor.image_processor)

    index_path = os.path.join(out_dir, "modular_model_index.json")
    with open(index_path) as f:
        index = json.load(f)
    proc_entry = json.loads(json.dumps(index["tokenizer"]))  # same structure, other subfolder/class
    proc_entry[1] = "Qwen3VLProcessor"
    proc_entry[2]["subfolder"] = "processor"
    proc_entry[2]["type_hint"] = ["transformers", "Qwen3VLProcessor"]
    index["processor"] = proc_entry
    with open(index_path, "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
    return out_dir, comps


def load_tiny(path, workflow=None, dtype=torch.float32):
    """Load the tiny pipeline from a local directory (all components, or only a workflow's)."""
    install_processor_shim()
    pipe = ModularPipeline.from_pretrained(path, workflow=workflow)
    pipe.load_components(dtype=dtype)
    return pipe



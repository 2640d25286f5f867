"""Qwen3-Omni's thinker as a token policy (`model=qwen3_omni`, docs/tokens.md "Qwen3-Omni").

`model.path` is a local directory that transformers' `Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained`
loads: the thinker (audio encoder, vision encoder, MoE text decoder) only; the talker and code2wav are never built
(a full Qwen3-Omni checkpoint's `thinker.*` weights load into it; its other weights are ignored). The tokenizer, the
chat template, the image processor (`preprocessor_config.json`), the audio feature extractor (same file) and, for
video, the video processor are loaded from the same directory, each only when a prompt needs it.

A prompt is its text or `{"text", "images", "audio", "videos"}` (paths; data rows' `image` / `audio` / `video`
columns, data/prompts.py). It becomes one user message whose content is the images, the audio clips, the videos,
then the text, put through the chat template with the generation prompt; each media placeholder is then repeated
as many times as the encoder emits features for it (image / video: grid t·h·w / merge², audio: the thinker's
downsampled frame count), as transformers' Qwen3-Omni processor does. Audio is read from PCM WAV files (mono mix,
resampled linearly to the feature extractor's rate). Videos are decoded by transformers' `load_video` at the video
processor's `fps` (2 frames per second when unset, as qwen-omni-utils), and a grid of `temporal_patch_size` frames
spans temporal_patch_size / (frames read per second) seconds (`video_second_per_grid`); the tests run the video path
with a stand-in for transformers' video processor, which needs torchvision.

`cond` (batch first, zero padded across the batch: a sample without a medium has zero grids / masks; every key is
always there, zero-width when no prompt of the batch has the medium, so rollouts concatenate, batch.py pads them):
  pixel_values (B, P, D), image_grid_thw (B, I, 3), input_features (B, A, mel, F), feature_attention_mask (B, A, F),
  pixel_values_videos (B, Pv, Dv), video_grid_thw (B, V, 3), video_second_per_grid (B, V).
`forward` unpacks the rows it is given into the flat layout the thinker takes.

Positions are Qwen3-Omni's 3-D rotary positions (`get_rope_index` of the thinker, over the non-padding tokens) for a
call that carries the prompt (prefill, teacher forcing); a cached decoding step continues each row from its last
position (the row's offset `delta` is carried in the cache), so the rollout's log-probs equal a teacher-forced
recompute (tests/test_qwen3_omni.py). The media markers (image / audio / video placeholders, vision and audio
start) get logit −inf: a response holding one would be read as a media slot when the actor re-runs the sequence.
"""

from __future__ import annotations

import json
import wave
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import UserError
from .base import Cond, Prompt, register_model
from .causal_lm import DTYPES, decoder_forward_flops, eos_ids

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def audio_tokens(frames: int, n_window: int) -> int:
    """How many features the thinker's audio encoder emits for `frames` mel frames (its chunked 3× stride-2
    convolutions: chunks of 2·n_window frames give 13 each, the remainder is downsampled three times)."""
    chunk = 2 * n_window
    rest = frames % chunk
    out = (rest - 1) // 2 + 1
    out = ((out - 1) // 2 + 1 - 1) // 2 + 1
    return int(out + (frames // chunk) * 13)


def read_wav(path: str, rate: int) -> np.ndarray:
    """A PCM WAV file -> mono float32 waveform at `rate` Hz (channels averaged, linear resampling)."""
    try:
        with wave.open(path, "rb") as w:
            channels, width, src, n = w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()
            raw = w.readframes(n)
    except (wave.Error, EOFError) as e:
        raise UserError(f"audio {path!r} is not a PCM WAV file ({e}); convert it to 16-bit PCM WAV") from None
    kinds = {1: ("u1", 128.0, 128.0), 2: ("<i2", 0.0, 32768.0), 4: ("<i4", 0.0, 2147483648.0)}
    if width not in kinds or n == 0:
        raise UserError(f"audio {path!r}: {8 * width}-bit WAV with {n} frames is not read; use 16-bit PCM")
    dtype, offset, scale = kinds[width]
    x = (np.frombuffer(raw, dtype=dtype).astype(np.float32) - offset) / scale
    x = x.reshape(-1, channels).mean(1)
    if src != rate:
        t = np.arange(int(round(len(x) * rate / src))) * (src / rate)
        x = np.interp(t, np.arange(len(x)), x).astype(np.float32)
    return x


def frame_indices(metadata, fps: float) -> np.ndarray:
    """The frames of a video to read: `fps` per second, evenly spaced (every frame when the video's own rate is
    lower or unknown)."""
    total = int(metadata.total_num_frames)
    n = min(total, max(1, round(total / metadata.fps * fps))) if metadata.fps else total
    return np.arange(n) * total // n


def _pad_stack(values: list[torch.Tensor | None], like: torch.Tensor) -> torch.Tensor:
    """Stack per-sample tensors (None: absent) into (B, *max shape), zero padded; `like` (zero-width where the
    dims vary) gives the dims no sample has."""
    shape = [max([like.shape[d]] + [v.shape[d] for v in values if v is not None]) for d in range(like.dim())]
    out = like.new_zeros((len(values), *shape))
    for i, v in enumerate(values):
        if v is not None:
            out[(i, *(slice(0, s) for s in v.shape))] = v
    return out


@register_model("qwen3_omni")
class Qwen3OmniPolicy:
    policy_kind = "tokens"
    default_lora_targets = list(ATTENTION)  # replaced per instance by the text decoder's attention (below)
    thinker_key = "model"  # the thinker's name in `modules()`

    def __init__(self, cfg, device: torch.device):
        from transformers import AutoTokenizer

        path = Path(cfg.path)
        if not (path / "config.json").is_file():
            raise UserError(f"model.path={str(path)!r} is not a transformers model directory (no config.json)")
        self.path, self.device, self.dtype = path, device, DTYPES[cfg.dtype]
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.network = self._load_thinker(path).to(device)
        self.network.eval().requires_grad_(False)
        self.networks = {self.thinker_key: self.network}
        self.config = self.network.config
        self.max_prompt_tokens = int(cfg.max_sequence_length)
        self.eos_token_ids = eos_ids(self.network, self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else self.eos_token_ids[0])
        self.template = self.tokenizer.chat_template or self._processor_template()
        if not self.template:
            raise UserError(f"model.path={str(path)!r} has no chat template (tokenizer_config.json, "
                            "chat_template.jinja or chat_template.json)")
        self.pads = {kind: self.tokenizer.convert_ids_to_tokens(int(getattr(self.config, f"{kind}_token_id")))
                     for kind in ("image", "audio", "video")}
        self._banned = [int(getattr(self.config, f"{k}_token_id")) for k in ("image", "audio", "video",
                                                                             "vision_start", "audio_start")]
        # LoRA on the text decoder's attention only: the audio encoder's layers have q/k/v projections too
        text = self.config.text_config
        self.default_lora_targets = [f"language_model.layers.{i}.self_attn.{p}"
                                     for i in range(text.num_hidden_layers) for p in ATTENTION]
        self._processors: dict[str, Any] = {}
        self._encoded: dict[str, tuple[list[int], dict]] = {}
        self.flops = 0.0
        # FLOPs: the text decoder's linear layers, experts counted at top-k / num_experts (active parameters)
        lm = self.network.model.language_model
        body = 0.0
        for name, p in lm.named_parameters():
            if "embed_tokens" in name or p.dim() < 2:
                continue
            body += p.numel() * (text.num_experts_per_tok / text.num_experts if ".experts." in name else 1.0)
        self._body_params = int(body)
        self._head_params = self.network.lm_head.weight.numel()
        self._layers = text.num_hidden_layers
        self._attn_width = text.num_attention_heads * text.head_dim
        self._encoder_params = {"audio": sum(p.numel() for p in self.network.model.audio_tower.parameters()),
                                "vision": sum(p.numel() for p in self.network.model.visual.parameters())}

    def _load_thinker(self, path: Path):
        """The thinker alone (a full Qwen3-Omni checkpoint's `thinker.*` weights load into it)."""
        from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

        return Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(str(path), dtype=self.dtype)

    def modules(self) -> dict[str, torch.nn.Module]:
        return self.networks

    def _processor_template(self) -> str | None:
        for name in ("chat_template.jinja", "chat_template.json"):
            f = self.path / name
            if f.is_file():
                text = f.read_text()
                return json.loads(text)["chat_template"] if name.endswith(".json") else text
        return None

    def _processor(self, kind: str):
        """The image processor, the audio feature extractor or the video processor of model.path (loaded once)."""
        if kind not in self._processors:
            import transformers

            loader = {"image": "AutoImageProcessor", "audio": "AutoFeatureExtractor", "video": "AutoVideoProcessor"}[kind]
            try:
                self._processors[kind] = getattr(transformers, loader).from_pretrained(str(self.path))
            except Exception as e:  # no preprocessor config, or a backend missing (video: torchvision)
                raise UserError(f"model=qwen3_omni: cannot load the {kind} processor from {str(self.path)!r} "
                                f"({type(e).__name__}: {e})") from None
        return self._processors[kind]

    # ------------------------------------------------------------------------------------------- prompts
    def _encode_one(self, prompt: Prompt) -> tuple[list[int], dict]:
        """(ids, per-sample tensors without a batch dimension) for one prompt."""
        p = {"text": prompt} if isinstance(prompt, str) else prompt
        extra = set(p) - {"text", "images", "audio", "videos"}
        if extra:
            raise ValueError(f"model=qwen3_omni reads text, images, audio and videos; a prompt carries {sorted(extra)}")
        images, audio, videos = list(p.get("images", [])), list(p.get("audio", [])), list(p.get("videos", []))
        content = ([{"type": "image"}] * len(images) + [{"type": "audio"}] * len(audio)
                   + [{"type": "video"}] * len(videos) + [{"type": "text", "text": p["text"]}])
        text = self.tokenizer.apply_chat_template([{"role": "user", "content": content}], chat_template=self.template,
                                                  tokenize=False, add_generation_prompt=True)
        tensors: dict[str, torch.Tensor] = {}
        counts: dict[str, list[int]] = {"image": [], "audio": [], "video": []}
        if images:
            from PIL import Image

            proc = self._processor("image")
            out = proc(images=[Image.open(f).convert("RGB") for f in images], return_tensors="pt")
            tensors["pixel_values"] = out["pixel_values"].float()
            tensors["image_grid_thw"] = out["image_grid_thw"].long()
            merge = int(getattr(proc, "merge_size", self.config.vision_config.spatial_merge_size))
            counts["image"] = [int(g.prod()) // merge**2 for g in tensors["image_grid_thw"]]
        if audio:
            fe = self._processor("audio")
            waves = [read_wav(f, fe.sampling_rate) for f in audio]
            out = fe(waves, sampling_rate=fe.sampling_rate, padding=True, truncation=False, return_attention_mask=True,
                     return_tensors="pt")
            tensors["input_features"] = out["input_features"].float()
            tensors["feature_attention_mask"] = out["attention_mask"].long()
            n_window = self.config.audio_config.n_window
            counts["audio"] = [audio_tokens(int(m.sum()), n_window) for m in tensors["feature_attention_mask"]]
        if videos:
            from transformers.video_utils import load_video

            proc = self._processor("video")
            fps = float(getattr(proc, "fps", None) or 2.0)  # frames sampled per second (qwen-omni-utils: 2)
            frames, seconds = [], []
            for f in videos:
                try:
                    clip, meta = load_video(f, sample_indices_fn=lambda metadata, **_: frame_indices(metadata, fps))
                except Exception as e:
                    raise UserError(f"model=qwen3_omni: cannot read video {f!r} ({type(e).__name__}: {e})") from None
                frames.append(clip)
                rate = len(clip) * meta.fps / meta.total_num_frames if meta.fps else fps  # frames per second read
                seconds.append(proc.temporal_patch_size / rate)
            out = proc(videos=frames, do_sample_frames=False, return_tensors="pt")  # the frames are sampled here
            tensors["pixel_values_videos"] = out["pixel_values_videos"].float()
            tensors["video_grid_thw"] = out["video_grid_thw"].long()
            merge = int(getattr(proc, "merge_size", self.config.vision_config.spatial_merge_size))
            counts["video"] = [int(g.prod()) // merge**2 for g in tensors["video_grid_thw"]]
            tensors["video_second_per_grid"] = torch.tensor(seconds, dtype=torch.float32)
        for kind, ns in counts.items():  # each placeholder -> as many as the encoder's features, in order
            pieces = text.split(self.pads[kind])
            if len(pieces) - 1 != len(ns):
                raise ValueError(f"model=qwen3_omni: the chat template wrote {len(pieces) - 1} {kind} placeholders "
                                 f"for {len(ns)} {kind} input(s)")
            text = pieces[0] + "".join(self.pads[kind] * n + rest for n, rest in zip(ns, pieces[1:], strict=True))
        ids = list(self.tokenizer(text, add_special_tokens=False).input_ids)
        if len(ids) > self.max_prompt_tokens:
            raise UserError(f"a prompt has {len(ids)} tokens (media placeholders included), more than "
                            f"model.max_sequence_length={self.max_prompt_tokens} ({p['text'][:60]!r}...); raise "
                            "model.max_sequence_length")
        return ids, tensors

    def encode_prompts(self, prompts: list[Prompt]) -> tuple[list[list[int]], Cond]:
        encoded = []
        for prompt in prompts:
            key = json.dumps(prompt, sort_keys=True)
            if key not in self._encoded:
                self._encoded[key] = self._encode_one(prompt)
            encoded.append(self._encoded[key])
        # every key, always (zero-width when no prompt has the medium), so rollouts of any prompts concatenate
        vision, mel = self.config.vision_config, self.config.audio_config.num_mel_bins
        patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        empty = {"pixel_values": torch.zeros(0, patch), "image_grid_thw": torch.zeros(0, 3, dtype=torch.long),
                 "input_features": torch.zeros(0, mel, 0), "feature_attention_mask": torch.zeros(0, 0, dtype=torch.long),
                 "pixel_values_videos": torch.zeros(0, patch), "video_grid_thw": torch.zeros(0, 3, dtype=torch.long),
                 "video_second_per_grid": torch.zeros(0)}
        cond: Cond = {k: _pad_stack([t.get(k) for _, t in encoded], like) for k, like in empty.items()}
        return [ids for ids, _ in encoded], cond

    def encode_responses(self, texts: list[str]) -> list[list[int]]:
        """Response texts (offline DPO pairs) -> ids as the model would generate them: the text, then EOS."""
        eos = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else self.eos_token_ids[0]
        return [list(self.tokenizer(t, add_special_tokens=False).input_ids) + [eos] for t in texts]

    def decode(self, ids: list[list[int]]) -> list[str]:
        return self.tokenizer.batch_decode(ids, skip_special_tokens=True)

    # ------------------------------------------------------------------------------------------- network
    @staticmethod
    def _flat_inputs(cond: Cond) -> dict[str, torch.Tensor]:
        """The padded per-sample cond of these rows -> the thinker's flat inputs (media in row order)."""
        out: dict[str, torch.Tensor] = {}
        for pixels, grid_key in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
            if grid_key not in cond:
                continue
            grids = cond[grid_key]
            valid = grids.prod(-1) > 0  # (B, I)
            if not bool(valid.any()):
                continue
            per_row = grids.prod(-1).sum(-1)  # patches of each row
            out[pixels] = torch.cat([cond[pixels][i, : int(n)] for i, n in enumerate(per_row.tolist())])
            out[grid_key] = grids[valid]
            if grid_key == "video_grid_thw":
                out["video_second_per_grid"] = cond["video_second_per_grid"][valid]
        if "feature_attention_mask" in cond:
            mask = cond["feature_attention_mask"]
            valid = mask.sum(-1) > 0
            if bool(valid.any()):
                out["input_features"] = cond["input_features"][valid]
                out["feature_attention_mask"] = mask[valid]
        return out

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cond: Cond | None = None,
                cache: Any = None, keep: int = 0, use_cache: bool = False) -> tuple[torch.Tensor, Any]:
        logits, new_cache, _ = self.thinker_forward(input_ids, attention_mask, cond, cache, keep, use_cache)
        return logits, new_cache

    def thinker_forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cond: Cond | None = None,
                        cache: Any = None, keep: int = 0, use_cache: bool = False, hidden_layer: int | None = None):
        """`forward`'s (logits, cache) and, for `hidden_layer` k, the thinker's hidden states after its k-th decoder
        layer (B, T, D) (its `output_hidden_states`; 0: the input embeddings), else None."""
        b, t = input_ids.shape
        media: dict[str, torch.Tensor] = {}
        if cache is None:  # the prompt is in input_ids: Qwen3-Omni's 3-D positions over the real tokens
            media = self._flat_inputs(cond or {})
            fmask = media.get("feature_attention_mask")
            positions, delta = self.network.model.get_rope_index(
                input_ids, media.get("image_grid_thw"), media.get("video_grid_thw"), attention_mask, False,
                fmask.sum(-1) if fmask is not None else None, media.get("video_second_per_grid"))
            positions, delta, kv = positions.float(), delta.float().reshape(b, 1), None
        else:  # a decoding step: each row continues from its last position
            kv, delta = cache
            text = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -t:].float() + delta
            positions = text.unsqueeze(0).expand(3, -1, -1)
        kept = keep or t
        grad = 3 if torch.is_grad_enabled() else 1
        self.flops += b * decoder_forward_flops(self._body_params, self._head_params, self._layers, self._attn_width,
                                                t, kept, attention_mask.shape[1]) * grad
        if "pixel_values" in media or "pixel_values_videos" in media:
            patches = sum(media[k].shape[0] for k in ("pixel_values", "pixel_values_videos") if k in media)
            self.flops += 2.0 * self._encoder_params["vision"] * patches * grad
        if "feature_attention_mask" in media:
            self.flops += 2.0 * self._encoder_params["audio"] * float(media["feature_attention_mask"].sum()) * grad
        if "input_features" in media:
            media["input_features"] = media["input_features"].to(self.dtype)
        net = self.networks[self.thinker_key]  # the live entry: the actor may swap in another policy (reference, ...)
        extra = {} if hidden_layer is None else {"output_hidden_states": True}
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype.itemsize < 4):
            out = net(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                      cache=kv, use_cache=use_cache, **media, **extra)
        new_cache = (out.cache, delta) if use_cache else None
        logits = (out.logits[:, -keep:] if keep else out.logits).float()  # the thinker's forward has no logits_to_keep
        # the policy never emits media markers: in a teacher-forced forward they would be read as media slots
        logits[..., self._banned] = float("-inf")
        return logits, new_cache, (None if hidden_layer is None else out.hidden_states[hidden_layer])

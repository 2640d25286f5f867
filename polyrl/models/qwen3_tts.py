"""Qwen3-TTS speech output as a token policy (`model=qwen3_tts`, docs/audio.md "Speech output").

`model.path` is a local Qwen3-TTS 12 Hz directory in the public layout (Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice,
-1.7B-CustomVoice, -1.7B-VoiceDesign): config.json (`model_type` qwen3_tts, a `talker_config` with its
`code_predictor_config`), generation_config.json, the weights, the Qwen2 text tokenizer files, and the codec in
`speech_tokenizer/` (config.json of `qwen3_tts_tokenizer_12hz`, weights, preprocessor_config.json). It is loaded by
the `qwen-tts` package (0.1.1: `Qwen3TTSForConditionalGeneration.from_pretrained`, which also loads the codec), the
text tokenizer by transformers' `AutoTokenizer`. The package pins transformers 4.57.3, so it lives in an environment
of its own (docs/audio.md; scripts/ci_qwen_tts.sh builds one).

What is sampled. Speech is a sequence of 12.5 Hz frames of G codes (G = `num_code_groups`, 16): the talker (a Qwen3
decoder) reads the prompt and, per frame, gives the first code c⁰; the code predictor (a small decoder) then gives
c¹ … c^{G−1} one after another from [talker hidden state, embedding of c⁰, embeddings of c¹ …]; the frame's next
talker input is the sum of the G code embeddings plus the text channel's pad embedding. A frame whose c⁰ is the
codec EOS ends the speech. The prompt is the package's non-streaming one (its `generate` with
`non_streaming_mode=True`, the default of `generate_custom_voice` and `generate_voice_design`): the optional
instruction, the role tokens, the codec think / language / speaker tags over pad text embeddings, every text token
over the codec pad, the text EOS, then the codec BOS over the text pad.

The policy trained is what the rollout draws: every code is a token of the response, frame after frame (G tokens per
frame, the EOS frame one token), with π(code) = softmax(logits / T), T = `rollout.temperature`, for the talker and the
code predictor alike; the log-prob of a frame is the sum over its codes (`frame_log_prob`). As in the package, the
talker never emits its control ids (every id ≥ the codebook size but EOS gets −inf: the package's "top 1024 ids of the
vocabulary" for the public 3072-id talker over 2048 codes) and EOS not in the first `MIN_FRAMES` frames (its
`min_new_tokens=2`). Not carried over from the package's sampler: top-k (50) and the repetition penalty (1.05):
they would make π a function of the sampler's settings and of earlier codes; `rollout.top_p` truncates what is drawn.

Ids. One id range, Janus-Pro's trick: ids below V (the talker's vocabulary, 3072) are codes, a text token t of the
prompt is V + t, so `forward` tells the prompt from the response by the ids alone. `pad_token_id` is 0 (a code of
every codebook; padded positions are masked), `eos_token_ids` the codec EOS (≥ the codebook size, so no code of
c¹ … c^{G−1} is mistaken for it). The logits are (…, V) wide; a code predictor position's columns from its vocabulary
size on are −inf. `rollout.max_new_tokens` must be a multiple of G (whole frames).

Rollout and training. The rollout decodes through `TTSDecoding` (the talker's KV cache across frames, a fresh code
predictor cache per frame); the learner's teacher-forced `forward` runs the talker once over prompt ⧺ frames and the
code predictor once over every frame, so the two agree to float tolerance (tests/test_qwen3_tts.py: 1e-5).

Media. `{"audio": Audio}`: the codes of each response's whole frames decoded by the package's speech tokenizer
(`Qwen3TTSTokenizer.decode`), clips zero-padded to the longest possible (`max_new_tokens / G` frames), at the codec's
rate (24 kHz). LoRA targets the talker's and the code predictor's attention and MLP projections; the codec and the
speaker encoder are never trained.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import sys
import types
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError
from ..media import Audio
from .base import Cond, Prompt, register_model, text_only
from .causal_lm import CAUSAL_LM_LORA_TARGETS, DTYPES, decoder_forward_flops
from .options import read_options

INSTALL = ("pip install 'polyrl[tts]' && pip install --no-deps qwen-tts==0.1.1 (from a clone: pip install -e "
           "'.[tts]'), in an environment of its own: the package pins transformers 4.57.3 (docs/audio.md)")
MIN_FRAMES = 2  # EOS is not drawn before this many frames (the package's min_new_tokens=2)
# imported at module import by the package's 25 Hz tokenizer only (tokenizer_25hz/vq/speech_vq.py), which the 12 Hz
# models never run: torchaudio has no build for every torch, sox needs its binary
TOKENIZER_25HZ_IMPORTS = ("torchaudio", "torchaudio.compliance", "torchaudio.compliance.kaldi", "sox", "onnxruntime")


def assistant_text(text: str) -> str:
    """The package's text template of the speech to say (`Qwen3TTSModel._build_assistant_text`)."""
    return f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"


def instruct_text(instruct: str) -> str:
    """The package's template of a voice instruction (`_build_instruct_text`)."""
    return f"<|im_start|>user\n{instruct}<|im_end|>\n"


def frame_log_prob(token_log_probs: torch.Tensor, groups: int) -> torch.Tensor:
    """log π(frame) = Σ_k log π(c^k | c^<k, earlier frames): (B, F·G) per-code log-probs -> (B, F) per frame (the
    chain rule over the G codes of a frame; docs/algorithms.md §5 per token)."""
    b, n = token_log_probs.shape
    return token_log_probs.reshape(b, n // groups, groups).sum(-1)


def response_frames(n_tokens: int, groups: int) -> tuple[int, int]:
    """(frames that have a first code, whole frames) of a response of `n_tokens` codes, G per frame."""
    return -(-n_tokens // groups), n_tokens // groups


class _Absent(types.ModuleType):
    """Stands in for a module of the 25 Hz tokenizer's front end while the package imports; any use is an error."""

    def __getattr__(self, name: str):
        raise AttributeError(f"{self.__name__}.{name}: only the qwen-tts 25 Hz tokenizer uses it, which model=qwen3_tts "
                        f"never runs; install {self.__name__.split('.')[0]} for it")


@contextmanager
def _placeholders(names: tuple[str, ...]):
    """Placeholders for the absent modules among `names` (a submodule: only under a placeholder) while the block runs;
    removed after (the package keeps its references to them)."""
    added: list[str] = []
    for name in names:
        top = name.split(".")[0]
        if name in sys.modules or (name == top and importlib.util.find_spec(name) is not None):
            continue
        if name != top and top not in added:
            continue
        module = _Absent(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        module.__path__ = []
        sys.modules[name] = module
        added.append(name)
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)
    try:
        yield
    finally:
        for name in added:
            sys.modules.pop(name, None)


def import_qwen_tts():
    """The qwen-tts package's `Qwen3TTSForConditionalGeneration`, or a UserError naming the install command."""
    if importlib.util.find_spec("qwen_tts") is None:
        raise UserError(f"model=qwen3_tts needs the qwen-tts package: {INSTALL}")
    try:
        with _placeholders(TOKENIZER_25HZ_IMPORTS):
            from qwen_tts.core.models import Qwen3TTSForConditionalGeneration
    except Exception as e:  # a missing light dependency, or a transformers the package does not run on
        import transformers

        raise UserError(f"model=qwen3_tts: the qwen-tts package does not import ({type(e).__name__}: {e}; "
                        f"transformers {transformers.__version__}); it needs {INSTALL}") from None
    return Qwen3TTSForConditionalGeneration


@register_model("qwen3_tts")
class Qwen3TTSPolicy:
    policy_kind = "tokens"
    media = ("audio",)  # what a rollout decodes its codes into (config validation pairs the reward with it)
    default_lora_targets = CAUSAL_LM_LORA_TARGETS  # the talker's and the code predictor's decoder layers
    # model.options: speaker (a CustomVoice checkpoint's speaker name; "" none), language ("auto" or one of the
    # checkpoint's), instruct (a voice instruction: VoiceDesign's voice description, CustomVoice 1.7B's style)
    options = {"speaker": "", "language": "auto", "instruct": ""}

    def __init__(self, cfg, device: torch.device):
        path = Path(cfg.path)
        if not (path / "config.json").is_file():
            raise UserError(f"model.path={str(path)!r} is not a Qwen3-TTS directory (no config.json)")
        config = json.loads((path / "config.json").read_text())
        if config.get("model_type") != "qwen3_tts":
            raise UserError(f"model.path={str(path)!r} holds a {config.get('model_type')!r} model, not Qwen3-TTS "
                            "(model_type 'qwen3_tts')")
        if config.get("tokenizer_type") != "qwen3_tts_tokenizer_12hz":
            raise UserError(f"model.path={str(path)!r}: tokenizer_type {config.get('tokenizer_type')!r}; "
                            "model=qwen3_tts runs the 12 Hz checkpoints (qwen3_tts_tokenizer_12hz)")
        kind = config.get("tts_model_type")
        if kind not in ("custom_voice", "voice_design"):
            raise UserError(f"model.path={str(path)!r} is a {kind!r} Qwen3-TTS checkpoint; model=qwen3_tts samples "
                            "custom_voice and voice_design ones (a base checkpoint clones a reference clip, which "
                            "polyrl does not pass)")
        opts = read_options(self.options, dict(getattr(cfg, "options", None) or {}))
        network_class = import_qwen_tts()
        from transformers import AutoTokenizer

        self.device, self.dtype = device, DTYPES[cfg.dtype]
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        network = network_class.from_pretrained(str(path), dtype=self.dtype, local_files_only=True)
        # the codec (a plain attribute, not a submodule) decodes codes into waveforms; frozen, never trained
        self.codec = network.speech_tokenizer
        self.codec.model.to(device).eval().requires_grad_(False)
        self.codec.device = device
        self.network = network.to(device).eval().requires_grad_(False)
        self.networks = {"model": self.network}
        c, tc = network.config, network.config.talker_config
        self.vocab = int(tc.vocab_size)  # V: ids below it are codes
        self.groups = int(tc.num_code_groups)  # G codes per frame
        self.codebook = int(tc.code_predictor_config.vocab_size)  # codes of c¹ … c^{G−1}; c⁰'s below it too
        self.eos = int(tc.codec_eos_token_id)
        if not self.codebook <= self.eos < self.vocab:
            raise UserError(f"model.path={str(path)!r}: codec_eos_token_id={self.eos} must lie in [codebook size "
                            f"{self.codebook}, talker vocabulary {self.vocab})")
        self.pad_token_id, self.eos_token_ids = 0, [self.eos]
        self.max_prompt_tokens = int(cfg.max_sequence_length)
        self.rate = int(self.codec.get_output_sample_rate())
        self.hop = int(self.codec.get_decode_upsample_rate())  # samples per frame
        self.tts_ids = [int(c.tts_bos_token_id), int(c.tts_eos_token_id), int(c.tts_pad_token_id)]
        self.codec_ids = {k: int(getattr(tc, f"codec_{k}_id")) for k in ("pad", "bos", "think", "nothink",
                                                                           "think_bos", "think_eos")}
        self.codec_prefix = self._codec_prefix(tc, opts, str(path))
        instruct = opts["instruct"]
        if instruct and c.tts_model_size == "0b6":
            raise UserError("model.options.instruct: the 0.6B Qwen3-TTS checkpoints take no instruction (the package "
                            "drops it); leave it empty")
        if kind == "voice_design" and opts["speaker"]:
            raise UserError("model.options.speaker: a voice_design checkpoint has no speakers; describe the voice in "
                            "model.options.instruct")
        self.instruct_ids = list(self.tokenizer(instruct_text(instruct)).input_ids) if instruct else []
        self._prompt_ids: dict[str, list[int]] = {}
        self.flops = 0.0
        talker, predictor = network.talker, network.talker.code_predictor
        self._talker_params = sum(m.weight.numel() for m in talker.model.layers.modules()
                                  if isinstance(m, torch.nn.Linear))
        self._predictor_params = sum(m.weight.numel() for m in predictor.model.layers.modules()
                                     if isinstance(m, torch.nn.Linear))
        self._head_params = talker.codec_head.weight.numel()
        pc = tc.code_predictor_config
        self._talker_shape = (tc.num_hidden_layers, tc.num_attention_heads * (getattr(tc, "head_dim", None)
                                                                              or tc.hidden_size // tc.num_attention_heads))
        self._predictor_shape = (pc.num_hidden_layers, pc.num_attention_heads * pc.head_dim)

    def _codec_prefix(self, tc, opts: dict, path: str) -> list[int]:
        """The codec channel's tags before the speaker: nothink / think_bos / think_eos, or think / think_bos /
        language / think_eos (a dialect speaker speaking Chinese or "auto" takes its dialect's language id)."""
        languages = {k.lower(): int(v) for k, v in (tc.codec_language_id or {}).items()}
        speakers = {k.lower(): int(v) for k, v in (tc.spk_id or {}).items()}
        language, speaker = opts["language"].lower(), opts["speaker"].lower()
        if language != "auto" and language not in languages:
            raise UserError(f"model.options.language={opts['language']!r} is not one of {path!r}'s languages: auto, "
                            + ", ".join(k for k in sorted(languages) if "dialect" not in k))
        if speaker and speaker not in speakers:
            raise UserError(f"model.options.speaker={opts['speaker']!r} is not one of {path!r}'s speakers: "
                            + (", ".join(sorted(speakers)) or "none"))
        self.speaker_id = speakers[speaker] if speaker else None
        language_id = languages.get(language)
        dialect = (tc.spk_is_dialect or {}).get(speaker) if speaker else None
        if language in ("chinese", "auto") and dialect:
            language_id = languages[dialect]
        ids = self.codec_ids
        if language_id is None:
            return [ids["nothink"], ids["think_bos"], ids["think_eos"]]
        return [ids["think"], ids["think_bos"], language_id, ids["think_eos"]]

    def modules(self) -> dict[str, torch.nn.Module]:
        return self.networks

    # ------------------------------------------------------------------------------------------- prompts
    def encode_prompts(self, prompts: list[Prompt]) -> tuple[list[list[int]], Cond]:
        out = []
        for text in text_only(prompts, "model=qwen3_tts"):
            if text not in self._prompt_ids:
                ids = list(self.tokenizer(assistant_text(text)).input_ids)
                if len(ids) < 9:
                    raise UserError(f"model=qwen3_tts: the tokenizer of model.path does not write the template "
                                    f"{assistant_text('...')!r} as the package expects")
                if len(ids) > self.max_prompt_tokens:
                    raise UserError(f"a prompt has {len(ids)} tokens, more than model.max_sequence_length="
                                    f"{self.max_prompt_tokens} ({text[:60]!r}...); raise model.max_sequence_length")
                self._prompt_ids[text] = [self.vocab + i for i in ids]
            out.append(self._prompt_ids[text])
        return out, {}

    def encode_responses(self, texts: list[str]) -> list[list[int]]:
        raise UserError("model=qwen3_tts generates speech: offline text pairs (data.pairs_path) do not apply")

    def decode(self, ids: list[list[int]]) -> list[str]:
        """Codes have no text: a placeholder per response (the audio is `decode_media`'s)."""
        return [f"<{len(row) // self.groups} speech frames>" for row in ids]

    @torch.no_grad()
    def decode_media(self, tokens) -> dict[str, Audio]:
        """A chunk's responses (a `TokenBatch`) -> {"audio": Audio (B, 1, samples)}: each response's whole frames
        (its EOS frame and a cut last frame left out) through the codec, zero padded to max_new_tokens / G frames;
        a clip is the codec's decode of its codes alone."""
        g, width = self.groups, tokens.response_ids.shape[1]
        if width % g:
            raise UserError(f"rollout.max_new_tokens={width} must be a multiple of this checkpoint's "
                            f"{g} codes per frame (model=qwen3_tts draws whole frames)")
        out = torch.zeros(len(tokens), 1, width // g * self.hop)
        codes = []
        for row, n in zip(tokens.response_ids, tokens.response_mask.sum(1).tolist(), strict=True):
            whole = int(n) // g
            codes.append(row[: whole * g].reshape(whole, g))
        # rows of one length decode together: the codec's convolutions look past a shorter row's end into the
        # padding of a batch, so a clip would depend on its chunk's other rows
        for frames in sorted({len(c) for c in codes} - {0}):
            rows = [i for i, c in enumerate(codes) if len(c) == frames]
            wavs, _ = self.codec.decode([{"audio_codes": codes[i].to(self.device)} for i in rows])
            for i, wav in zip(rows, wavs, strict=True):
                wav = torch.as_tensor(wav).float().flatten()[: out.shape[-1]]
                out[i, 0, : len(wav)] = wav
        return {"audio": Audio(out, self.rate)}

    # ------------------------------------------------------------------------------------------- network
    def _embed_text(self, net, ids: torch.Tensor) -> torch.Tensor:
        """Text ids (…) -> the talker's text channel (…, D): text embedding through the text projection."""
        talker = net.talker
        return talker.text_projection(talker.get_text_embeddings()(ids))

    def _codes(self, net, ids: list[int]) -> torch.Tensor:
        return net.talker.get_input_embeddings()(torch.tensor(ids, dtype=torch.long, device=self.device))

    def prefill_embeds(self, net, text_ids: list[int]) -> torch.Tensor:
        """The talker's input (L, D) for one prompt (its text ids: the assistant template), the package's
        non-streaming prompt: [instruction] ⧺ role ⧺ (pad text ⧺ BOS text) + codec tags[:-1] ⧺ (text ⧺ text EOS) +
        codec pad ⧺ text pad + codec BOS."""
        t = torch.tensor(text_ids, dtype=torch.long, device=self.device)
        bos, eos, pad = self._embed_text(net, torch.tensor(self.tts_ids, device=self.device)).unbind(0)
        tags = self._codes(net, self.codec_prefix)
        if self.speaker_id is not None:
            tags = torch.cat([tags, self._codes(net, [self.speaker_id])])
        tags = torch.cat([tags, self._codes(net, [self.codec_ids["pad"], self.codec_ids["bos"]])])
        n_tags = tags.shape[0]
        text_channel = torch.cat([pad.expand(n_tags - 2, -1), bos[None]])
        parts = []
        if self.instruct_ids:
            parts.append(self._embed_text(net, torch.tensor(self.instruct_ids, device=self.device)))
        body = t[3:-5]
        parts += [self._embed_text(net, t[:3]), text_channel + tags[:-1],
                  torch.cat([self._embed_text(net, body), eos[None]]) + self._codes(net, [self.codec_ids["pad"]]),
                  (pad + tags[-1])[None]]
        return torch.cat(parts)

    def frame_embed(self, net, codes: torch.Tensor) -> torch.Tensor:
        """The talker's input for whole frames: (…, G) codes -> (…, D), Σ_k embed_k(c^k) + the text pad embedding."""
        talker = net.talker
        out = talker.get_input_embeddings()(codes[..., 0])
        for k in range(1, self.groups):
            out = out + talker.code_predictor.get_input_embeddings()[k - 1](codes[..., k])
        pad = self._embed_text(net, torch.tensor([self.tts_ids[2]], device=codes.device))[0]
        return out + pad

    def code_embed(self, net, k: int, codes: torch.Tensor) -> torch.Tensor:
        """Code predictor input of code c^k (…) -> (…, D): c⁰ through the talker's codec embedding, c^k through the
        code predictor's k-th."""
        talker = net.talker
        return talker.get_input_embeddings()(codes) if k == 0 else talker.code_predictor.get_input_embeddings()[k - 1](codes)

    def first_code_logits(self, net, hidden: torch.Tensor, frame: torch.Tensor) -> torch.Tensor:
        """Talker logits of c⁰ (…, V) from its hidden states; control ids and, in the first MIN_FRAMES frames
        (`frame` (…) the frame index), EOS at −inf."""
        logits = net.talker.codec_head(hidden).float()
        banned = torch.zeros(self.vocab, dtype=torch.bool, device=logits.device)
        banned[self.codebook:] = True
        banned[self.eos] = False
        logits = logits.masked_fill(banned, float("-inf"))
        early = (frame < MIN_FRAMES).unsqueeze(-1) & (torch.arange(self.vocab, device=logits.device) == self.eos)
        return logits.masked_fill(early, float("-inf"))

    def predictor_logits(self, net, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """Code predictor logits of c^k (…, V) from its hidden states (k ≥ 1: head k − 1), −inf past its
        vocabulary."""
        logits = net.talker.code_predictor.lm_head[k - 1](hidden).float()
        pad = logits.new_full((*logits.shape[:-1], self.vocab - logits.shape[-1]), float("-inf"))
        return torch.cat([logits, pad], -1)

    def talker(self, net, embeds: torch.Tensor, mask: torch.Tensor, cache=None, use_cache: bool = False):
        """The talker's decoder on `embeds` (B, T, D) with `mask` (B, past + T); positions from the mask (left
        padding). Returns (hidden (B, T, D), cache)."""
        t = embeds.shape[1]
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -t:]
        self.flops += embeds.shape[0] * decoder_forward_flops(self._talker_params, self._head_params, *self._talker_shape,
                                                              t, t, mask.shape[1]) * (3 if torch.is_grad_enabled() else 1)
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype.itemsize < 4):
            out = net.talker.model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions,
                                   past_key_values=cache, use_cache=use_cache)
        return out.last_hidden_state, out.past_key_values

    def predictor(self, net, embeds: torch.Tensor, cache=None, use_cache: bool = False):
        """The code predictor's decoder on `embeds` (N, T, D_talker) (positions continue the cache; no padding).
        Returns (hidden (N, T, d), cache)."""
        cp = net.talker.code_predictor
        n, t = embeds.shape[:2]
        past = cache.get_seq_length() if cache is not None else 0
        self.flops += n * decoder_forward_flops(self._predictor_params, 0, *self._predictor_shape, t, 0, past + t) * (
            3 if torch.is_grad_enabled() else 1)
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype.itemsize < 4):
            out = cp.model(inputs_embeds=cp.small_to_mtp_projection(embeds), past_key_values=cache, use_cache=use_cache)
        return out.last_hidden_state, out.past_key_values

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cond: Cond | None = None,
                cache: Any = None, keep: int = 0, use_cache: bool = False) -> tuple[torch.Tensor, Any]:
        """Teacher forcing: logits (B, keep or T, V) float32, column i scoring the token at i + 1 — response token j
        of a row at column P − 1 + j (P: the row's prompt ⧺ padding width); columns inside the prompt are 0. The
        talker runs once over prompt ⧺ whole frames, the code predictor once over every frame's [talker hidden,
        c⁰ … c^{G−2}]. The rollout decodes with `decoding` (caches), never through here."""
        if cache is not None or use_cache:
            raise ValueError("model=qwen3_tts decodes through its `decoding`; forward is teacher forcing only")
        net, g, v = self.networks["model"], self.groups, self.vocab
        b, t = input_ids.shape
        rows = []
        for i in range(b):
            real = attention_mask[i].bool()
            text_cols = torch.nonzero(real & (input_ids[i] >= v)).flatten()
            p = int(text_cols[-1]) + 1  # the response starts after the row's last prompt token
            codes = input_ids[i, p:][real[p:]]
            rows.append((p, (input_ids[i, text_cols] - v).tolist(), codes))
        # the talker over prompt ⧺ whole frames, left padded
        seqs = []
        for _, text, codes in rows:
            whole = len(codes) // g
            prefill = self.prefill_embeds(net, text)
            frames = self.frame_embed(net, codes[: whole * g].reshape(whole, g))
            seqs.append((prefill, frames))
        lengths = [len(a) + len(f) for a, f in seqs]
        width = max(lengths)
        d = seqs[0][0].shape[-1]
        embeds = seqs[0][0].new_zeros(b, width, d)
        mask = torch.zeros(b, width, dtype=torch.long, device=self.device)
        for i, (a, f) in enumerate(seqs):
            embeds[i, width - lengths[i]:] = torch.cat([a, f])
            mask[i, width - lengths[i]:] = 1
        hidden, _ = self.talker(net, embeds, mask)
        out = torch.zeros(b, t, v, device=self.device)
        # c⁰ of frame f: the talker's hidden state at prefill end + f
        row_idx, frame_idx, pos_idx, col_idx = [], [], [], []
        for i, ((p, _, codes), (a, _)) in enumerate(zip(rows, seqs, strict=True)):
            frames_with_first, _ = response_frames(len(codes) + 1, g)  # slot n (the next token) is scored too
            for f in range(frames_with_first):
                row_idx.append(i), frame_idx.append(f), pos_idx.append(width - lengths[i] + len(a) - 1 + f)
                col_idx.append(p - 1 + f * g)
        row_t = torch.tensor(row_idx, device=self.device)
        first = self.first_code_logits(net, hidden[row_t, torch.tensor(pos_idx, device=self.device)],
                                       torch.tensor(frame_idx, device=self.device))
        out[row_t, torch.tensor(col_idx, device=self.device)] = first
        # c¹ … c^{G−1}: the code predictor over [talker hidden, c⁰, …, c^{G−2}] of every frame with a first code
        items = [(i, f, pos) for i, f, pos in zip(row_idx, frame_idx, pos_idx, strict=True)
                 if f * g < len(rows[i][2])]
        if items:
            zero = torch.zeros(g - 1, dtype=torch.long, device=self.device)
            frame_codes = torch.stack([torch.cat([rows[i][2][f * g: f * g + g - 1], zero])[: g - 1]
                                       for i, f, _ in items])  # (N, G − 1) codes c⁰ … c^{G−2} (0 past the response)
            inputs = [hidden[torch.tensor([i for i, _, _ in items], device=self.device),
                             torch.tensor([pos for _, _, pos in items], device=self.device)][:, None]]
            inputs += [self.code_embed(net, k, frame_codes[:, k])[:, None] for k in range(g - 1)]
            cp_hidden, _ = self.predictor(net, torch.cat(inputs, 1))  # (N, G, d): position k scores c^k
            for k in range(1, g):
                keep_k = [n for n, (i, f, _) in enumerate(items) if f * g + k <= len(rows[i][2])]
                if not keep_k:
                    continue
                sel = torch.tensor(keep_k, device=self.device)
                logits = self.predictor_logits(net, cp_hidden[sel, k], k)
                cols = torch.tensor([rows[items[n][0]][0] - 1 + items[n][1] * g + k for n in keep_k],
                                    device=self.device)
                out[torch.tensor([items[n][0] for n in keep_k], device=self.device), cols] = logits
        return (out[:, -keep:] if keep else out), None

    def decoding(self, batch: int, prompt_width: int, max_new_tokens: int) -> TTSDecoding:
        if max_new_tokens % self.groups:
            raise UserError(f"rollout.max_new_tokens={max_new_tokens} must be a multiple of this checkpoint's "
                            f"{self.groups} codes per frame (model=qwen3_tts draws whole frames)")
        return TTSDecoding(self)


class TTSDecoding:
    """The rollout's decoder (sampling.tokens.decoding_for): `prefill` runs the talker over the prompts and gives
    c⁰'s logits of frame 0; each `step(token)` takes the code just drawn: c⁰ … c^{G−2} go through the code predictor
    (a fresh cache per frame, seeded with the talker's hidden state) and give the next code's logits; c^{G−1}
    completes the frame, which goes through the talker (its cache across frames) for the next frame's c⁰."""

    def __init__(self, policy: Qwen3TTSPolicy):
        self.policy = policy

    def prefill(self, prompt: torch.Tensor, mask: torch.Tensor, cond: Cond) -> torch.Tensor:
        p = self.policy
        net = p.networks["model"]
        seqs = [p.prefill_embeds(net, (row[m.bool()] - p.vocab).tolist()) for row, m in zip(prompt, mask, strict=True)]
        width = max(len(s) for s in seqs)
        embeds = seqs[0].new_zeros(len(seqs), width, seqs[0].shape[-1])
        self.mask = torch.zeros(len(seqs), width, dtype=torch.long, device=p.device)
        for i, s in enumerate(seqs):
            embeds[i, width - len(s):] = s
            self.mask[i, width - len(s):] = 1
        hidden, self.cache = p.talker(net, embeds, self.mask, use_cache=True)
        self.hidden = hidden[:, -1]  # the talker state that scores this frame's c⁰ (and seeds the code predictor)
        self.slot, self.frame, self.codes = 0, 0, []
        return p.first_code_logits(net, self.hidden, torch.zeros(len(seqs), dtype=torch.long, device=p.device))

    def step(self, token: torch.Tensor) -> torch.Tensor:
        p = self.policy
        net, g = p.networks["model"], p.groups
        k = self.slot % g  # the codebook of the code just drawn
        self.slot += 1
        self.codes.append(token)
        if k < g - 1:
            if k == 0:
                embeds = torch.stack([self.hidden, p.code_embed(net, 0, token)], 1)
                self.predictor_cache = None
            else:
                embeds = p.code_embed(net, k, token)[:, None]
            hidden, self.predictor_cache = p.predictor(net, embeds, self.predictor_cache, use_cache=True)
            return p.predictor_logits(net, hidden[:, -1], k + 1)
        frame = p.frame_embed(net, torch.stack(self.codes, -1))[:, None]
        self.codes, self.frame = [], self.frame + 1
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], 1)
        hidden, self.cache = p.talker(net, frame, self.mask, self.cache, use_cache=True)
        self.hidden = hidden[:, -1]
        return p.first_code_logits(net, self.hidden, torch.full_like(token, self.frame))

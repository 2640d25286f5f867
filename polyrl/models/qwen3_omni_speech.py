"""Qwen3-Omni that speaks: thinker text, then the talker's speech, one token policy (`model=qwen3_omni_speech`,
docs/tokens.md "Speaking omni models").

`model.path` is a local Qwen3-Omni directory (the Qwen/Qwen3-Omni-30B-A3B-Instruct layout: config.json of
`qwen3_omni_moe` with `thinker_config`, `talker_config`, `code2wav_config` and `enable_audio_output` true, the weights,
the tokenizer and preprocessor files) loaded by transformers' `Qwen3OmniMoeForConditionalGeneration.from_pretrained`.
Four parts: the thinker (Qwen3OmniPolicy: prompts with images / audio / video, text out), the talker
(`Qwen3OmniMoeTalkerForConditionalGeneration`, a MoE decoder over codec codes), its code predictor (the talker's
`code_predictor`, taken out of the talker here so that the two train separately) and code2wav (`Qwen3OmniMoeCode2Wav`,
codes -> 24 kHz waveform, frozen).

What is sampled, as transformers' `Qwen3OmniMoeForConditionalGeneration.generate` does it for one sample:
1. the thinker's text y_0 … y_{n−1} (the thinker alone, sampling/tokens.py);
2. the talker's input: the prompt's user turn(s), each text token as `text_projection(thinker embedding)` and each
   media placeholder as `hidden_projection(thinker hidden state after layer accept_hidden_layer)`; then the
   assistant part: the three tokens of `<|im_start|>assistant\\n`, four tts_pad and tts_bos text embeddings and y_0
   on the text channel, over [0, 0, 0, nothink, think_bos, think_eos, speaker, codec_pad, codec_bos] on the codec
   channel. Its 3-D rotary positions are the talker's `get_rope_index` over [user ids, tts_pad × 9];
3. frame after frame: the talker's last hidden state h gives c⁰ (`codec_head`; the top 1024 ids of its vocabulary
   but the codec EOS are never drawn, transformers' `suppress_tokens`); the code predictor runs over [h, embed(c⁰)]
   and gives c¹ … c^{G−1} one after another (`lm_head[k − 1]`, fed `codec_embedding[k − 1](c^k)`); the frame's next
   talker input is Σ_k embed_k(c^k) + the text channel's entry f: y_{f+1}, …, y_{n−2}, then tts_eos, then tts_pad
   (the thinker's last token y_{n−1}, its EOS, is never fed back: what generate does). A frame whose c⁰ is the codec
   EOS ends the speech; `model.options.max_speech_frames` frames at most.
4. code2wav decodes each response's whole frames (`chunked_decode`, as generate).

The policy is what the rollout draws: every text token and every code is a token of one response, text first, then
the codes as ids `speech_offset` + code (`speech_offset` = the thinker's vocabulary), π = softmax(logits / T) for the
thinker, the talker and the code predictor alike (T = `rollout.temperature`). Not carried over from generate's
sampler: the talker's top-k 50 and repetition penalty 1.05 and the code predictor's top-k 50 / top-p 0.8 (they would
make π a function of the sampler's settings; `rollout.top_p` truncates what is drawn). A response whose text is one
token (its EOS alone) has nothing to say: generate cannot run its talker, and here its speech is the codec EOS alone,
drawn with probability 1.

Teacher forcing (`teacher_forced_log_probs`): one thinker forward over prompt ⧺ text (its text log-probs and the hidden
states the talker reads), one talker forward over [prompt part, whole frames] and one code predictor forward over
every frame; the gradient of a speech token reaches the talker, the code predictor and the thinker (through the
embeddings and hidden states the talker reads). Which of the three train is `actor.train_modules`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import UserError
from ..media import Audio
from .base import register_model
from .causal_lm import decoder_forward_flops
from .options import read_options
from .qwen3_omni import ATTENTION, Qwen3OmniPolicy

SUPPRESSED = 1024  # generate never lets the talker draw its top 1024 ids but the codec EOS (`suppress_tokens`)
ASSISTANT_PREFIX = 3  # `<|im_start|>assistant\n`: the tokens before the response in the talker's assistant part


def spoken_text(response: list[int]) -> list[int]:
    """The text tokens the talker reads: every token of the response but its last, which the thinker never runs on
    (its EOS, or the last token of a cut response)."""
    return list(response[:-1])


def give_audio_config(model) -> None:
    """The talker's `get_rope_index` (transformers' shared Qwen3-Omni one) reads `config.audio_config.n_window` for a
    prompt with audio, which a talker config does not hold: it gets the thinker's, whose audio encoder made the
    features (without it transformers' own generate stops at the talker for any audio prompt)."""
    if not hasattr(model.talker.config, "audio_config"):
        model.talker.config.audio_config = model.thinker.config.audio_config


@register_model("qwen3_omni_speech")
class Qwen3OmniSpeechPolicy(Qwen3OmniPolicy):
    media = ("text", "audio")  # each response's text and its waveform
    streams = ("text", "speech")  # the loss weighs them apart (actor.stream_weights, actor.stream_norm)
    module_names = ("thinker", "talker", "code_predictor")  # what actor.train_modules may name
    thinker_key = "thinker"
    # model.options: speaker (a name of talker_config.speaker_id; "" generate's default, Ethan), max_speech_frames
    # (codec frames per response at most: 12.5 per second), sample_rate (code2wav's output rate; 24 kHz)
    options = {"speaker": "", "max_speech_frames": 64, "sample_rate": 24000}
    # what a full fine-tune leaves frozen (the actor reads it): the thinker's audio and vision encoders
    frozen_submodules = {"thinker": ("model.audio_tower", "model.visual")}

    def __init__(self, cfg, device: torch.device):
        self.opts = read_options(self.options, dict(getattr(cfg, "options", None) or {}))
        super().__init__(cfg, device)
        c, tc = self.full_config, self.full_config.talker_config
        self.networks.update(talker=self.talker, code_predictor=self.code_predictor)
        self.speech_offset = int(self.network.lm_head.out_features)  # a code k is the id offset + k
        self.talker_vocab = int(tc.text_config.vocab_size)
        self.groups = int(tc.num_code_groups)
        self.codebook = int(tc.code_predictor_config.vocab_size)
        self.speech_eos = int(tc.codec_eos_token_id)
        self.speech_eos_ids = [self.speech_eos]
        frames = int(self.opts["max_speech_frames"])
        if frames < 1:
            raise UserError(f"model.options.max_speech_frames={frames} must be >= 1")
        self.max_frames = frames
        self.speech_tokens = frames * self.groups  # the response columns after the text
        speakers = {k.lower(): int(v) for k, v in (tc.speaker_id or {}).items()}
        speaker = (self.opts["speaker"] or "ethan").lower()
        if speaker not in speakers:
            raise UserError(f"model.options.speaker={self.opts['speaker'] or 'Ethan'!r} is not one of "
                            f"{str(self.path)!r}'s speakers: {', '.join(sorted(speakers)) or 'none'}")
        self.speaker_id = speakers[speaker]
        self.accept_layer = int(tc.accept_hidden_layer)
        self.tts_ids = [int(c.tts_bos_token_id), int(c.tts_eos_token_id), int(c.tts_pad_token_id)]
        self.im_start, self.user_id, self.assistant_id = (int(c.im_start_token_id), int(c.user_token_id),
                                                          int(c.assistant_token_id))
        self.media_ids = [int(getattr(self.config, f"{k}_token_id")) for k in ("audio", "image", "video")]
        self.codec_prefix = [int(tc.codec_nothink_id), int(tc.codec_think_bos_id), int(tc.codec_think_eos_id),
                             self.speaker_id, int(tc.codec_pad_id), int(tc.codec_bos_id)]
        banned = torch.zeros(self.talker_vocab, dtype=torch.bool)
        banned[max(0, self.talker_vocab - SUPPRESSED):] = True
        banned[self.speech_eos] = False
        self.first_code_banned = banned.to(device)
        self.rate, self.hop = int(self.opts["sample_rate"]), int(self.code2wav.total_upsample)
        talker_layers = tc.text_config.num_hidden_layers
        predictor_layers = tc.code_predictor_config.num_hidden_layers
        # LoRA on every decoder's attention: the thinker's text decoder (the base class's targets), the talker's and
        # the code predictor's layers (`model.layers.N.self_attn.*`, names the thinker's modules do not end with)
        self.default_lora_targets = self.default_lora_targets + [
            f"model.layers.{i}.self_attn.{p}" for i in range(max(talker_layers, predictor_layers)) for p in ATTENTION]
        ttc, pc = tc.text_config, tc.code_predictor_config
        share = ttc.num_experts_per_tok / ttc.num_experts
        self._talker_params = int(sum(p.numel() * (share if ".experts." in n else 1.0)
                                      for n, p in self.talker.model.layers.named_parameters() if p.dim() >= 2))
        self._predictor_params = sum(p.numel() for p in self.code_predictor.model.layers.parameters() if p.dim() >= 2)
        self._talker_shape = (talker_layers, ttc.num_attention_heads * ttc.head_dim)
        self._predictor_shape = (predictor_layers, pc.num_attention_heads * pc.head_dim)

    def _load_thinker(self, path: Path):
        """The whole model: the thinker is returned, the talker, its code predictor and code2wav are kept apart."""
        from transformers import Qwen3OmniMoeForConditionalGeneration

        config = json.loads((path / "config.json").read_text())
        if config.get("model_type") != "qwen3_omni_moe":
            raise UserError(f"model.path={str(path)!r} holds a {config.get('model_type')!r} model, not Qwen3-Omni "
                            "(model_type 'qwen3_omni_moe'); model=qwen3_omni_speech needs the whole checkpoint")
        if not config.get("enable_audio_output", True) or "talker_config" not in config:
            raise UserError(f"model.path={str(path)!r} has no talker (enable_audio_output false or no talker_config); "
                            "train its thinker with model=qwen3_omni")
        full = Qwen3OmniMoeForConditionalGeneration.from_pretrained(str(path), dtype=self.dtype)
        self.full_config = full.config
        talker = full.talker
        predictor = talker.code_predictor
        del talker.code_predictor  # trained (or not) on its own: `modules()["code_predictor"]`
        give_audio_config(full)
        self.talker = talker.to(self.device).eval().requires_grad_(False)
        self.code_predictor = predictor.to(self.device).eval().requires_grad_(False)
        self.code2wav = full.code2wav.to(self.device).eval().requires_grad_(False)  # never trained
        return full.thinker

    def load_networks(self, path) -> dict[str, torch.nn.Module]:
        """The three trainable networks of another Qwen3-Omni directory (a distillation teacher), split as here."""
        from transformers import Qwen3OmniMoeForConditionalGeneration

        full = Qwen3OmniMoeForConditionalGeneration.from_pretrained(str(path), dtype=self.dtype)
        predictor = full.talker.code_predictor
        del full.talker.code_predictor
        give_audio_config(full)
        return {"thinker": full.thinker, "talker": full.talker, "code_predictor": predictor}

    # ------------------------------------------------------------------------------------------- ids
    def decode(self, ids: list[list[int]]) -> list[str]:
        """The text of each response (its speech codes left out), special tokens skipped."""
        return self.tokenizer.batch_decode([[i for i in row if i < self.speech_offset] for row in ids],
                                           skip_special_tokens=True)

    def encode_responses(self, texts: list[str]) -> list[list[int]]:
        raise UserError("model=qwen3_omni_speech answers with text and speech: offline text pairs (data.pairs_path) "
                        "carry no speech; use online DPO (algorithm=dpo without data.pairs_path)")

    def token_streams(self, response_ids: torch.Tensor) -> torch.Tensor:
        """The stream of each response token (…) -> long, 0 text, 1 speech (`streams`)."""
        return (response_ids >= self.speech_offset).long()

    def split(self, tokens) -> list[tuple[list[int], torch.Tensor]]:
        """Each response's (text ids, speech codes (m,)): the text run, then the codes less `speech_offset`."""
        out = []
        for row, n in zip(tokens.response_ids, tokens.response_mask.sum(1).tolist(), strict=True):
            row = row[: int(n)]
            speech = row >= self.speech_offset
            k = int((~speech).sum())
            out.append((row[:k].tolist(), row[k:] - self.speech_offset))
        return out

    # ------------------------------------------------------------------------------------------- media
    @torch.no_grad()
    def decode_media(self, tokens) -> dict[str, Audio]:
        """{"audio": Audio (B, 1, max_speech_frames · hop)}: each response's whole frames (its codec EOS left out)
        through code2wav's `chunked_decode`, zero padded; a response without a frame is silence. Rows of one frame
        count decode together (code2wav is causal: a row's clip is its decode alone)."""
        g = self.groups
        out = torch.zeros(len(tokens), 1, self.max_frames * self.hop)
        codes = []
        for _, speech in self.split(tokens):
            whole = len(speech) // g
            codes.append(speech[: whole * g].reshape(whole, g).T)  # (G, frames)
        for frames in sorted({c.shape[1] for c in codes} - {0}):
            rows = [i for i, c in enumerate(codes) if c.shape[1] == frames]
            batch = torch.stack([codes[i] for i in rows]).to(self.device)
            wavs = self.code2wav.chunked_decode(batch, chunk_size=300, left_context_size=25).float().cpu()
            for i, wav in zip(rows, wavs, strict=True):
                wav = wav.flatten()[: out.shape[-1]]
                out[i, 0, : len(wav)] = wav
        return {"audio": Audio(out, self.rate)}

    # ------------------------------------------------------------------------------------------- talker input
    def _embed_text(self, ids: torch.Tensor) -> torch.Tensor:
        """Thinker token ids (…) -> the talker's text channel (…, D): the thinker's embedding through
        `text_projection`."""
        thinker, talker = self.networks["thinker"], self.networks["talker"]
        return talker.text_projection(thinker.get_input_embeddings()(ids))

    def talker_prompts(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, texts: list[list[int]],
                       hidden: torch.Tensor | None, cond: dict) -> list[dict]:
        """Per row, what the talker reads before its first frame (module docstring, 2.): `embeds` (L, D), `positions`
        (3, L) long, `next` (the position of frame 0's input), `trailing` (K, D) the text channel of frames 0 … K−1
        (then tts_pad), `speaks` (False: the text is its EOS alone). `hidden` (B, P, D_thinker): the thinker's hidden
        states after layer accept_hidden_layer over the prompts (None when no prompt holds media)."""
        talker, dev = self.networks["talker"], self.device
        bos, eos, pad = self._embed_text(torch.tensor(self.tts_ids, device=dev)).unbind(0)
        codec = talker.get_input_embeddings()(torch.tensor(self.codec_prefix, device=dev))
        rows = []
        for i, text in enumerate(texts):
            real = prompt_mask[i].bool()
            ids = prompt_ids[i][real]
            n = len(ids)
            pos = torch.arange(n, device=dev)
            starts = torch.where(ids == self.im_start, pos, torch.full_like(pos, -1)).cummax(0).values.clamp(min=0)
            user = ids[(starts + 1).clamp(max=n - 1)] == self.user_id
            user_ids = ids[user]
            media = torch.isin(user_ids, torch.tensor(self.media_ids, device=dev))
            user_embeds = self._embed_text(user_ids)
            if bool(media.any()):  # a media placeholder: the thinker's hidden state there
                states = talker.hidden_projection(hidden[i][real][user][media])
                user_embeds = user_embeds.clone()
                user_embeds[media] = states.to(user_embeds)
            marks = torch.nonzero((ids[:-1] == self.im_start) & (ids[1:] == self.assistant_id)).flatten()
            if len(marks) == 0:
                raise UserError("model=qwen3_omni_speech: a prompt has no `<|im_start|>assistant` turn after the chat "
                                "template; the talker speaks the assistant's answer")
            spoken = spoken_text(text)
            a = self._embed_text(torch.cat([ids[int(marks[-1]):], torch.tensor(spoken, dtype=torch.long, device=dev)]))
            speaks = len(spoken) >= 1
            first = a[ASSISTANT_PREFIX: ASSISTANT_PREFIX + 1] if speaks else pad[None]
            text_part = torch.cat([a[:ASSISTANT_PREFIX], pad.expand(4, -1), bos[None], first])
            codec_part = torch.cat([codec.new_zeros(ASSISTANT_PREFIX, codec.shape[-1]), codec])
            embeds = torch.cat([user_embeds, text_part + codec_part])
            talker_ids = torch.cat([user_ids, torch.full((len(text_part),), self.tts_ids[2], device=dev)])
            positions = self._positions(talker, talker_ids, {k: v[i: i + 1] for k, v in cond.items()})
            trailing = torch.cat([a[ASSISTANT_PREFIX + 1:], eos[None]]) if speaks else eos[None]
            rows.append({"embeds": embeds, "positions": positions, "next": int(positions.max()) + 1,
                         "trailing": trailing, "speaks": speaks})
        return rows

    def _positions(self, talker, talker_ids: torch.Tensor, cond: dict) -> torch.Tensor:
        """The talker's 3-D rotary positions (3, L) over its input ids, as its `compute_3d_position_ids` at prefill:
        `get_rope_index` when the row has media, else 0 … L−1."""
        media = self._flat_inputs(cond)
        fmask = media.get("feature_attention_mask")
        if not media:
            return torch.arange(len(talker_ids), device=self.device).expand(3, -1)
        positions, _ = talker.get_rope_index(talker_ids[None], media.get("image_grid_thw"), media.get("video_grid_thw"),
                                             torch.ones_like(talker_ids[None]), False,
                                             fmask.sum(-1) if fmask is not None else None,
                                             media.get("video_second_per_grid"))
        return positions[:, 0].long()

    def trailing_at(self, rows: list[dict], frames: torch.Tensor) -> torch.Tensor:
        """The text channel each row adds to its frame `frames[i]`'s talker input (B, D): its trailing entry, tts_pad
        past the end."""
        pad = self._embed_text(torch.tensor(self.tts_ids[2:], device=self.device))[0]
        return torch.stack([r["trailing"][int(f)] if int(f) < len(r["trailing"]) else pad
                            for r, f in zip(rows, frames.tolist(), strict=True)])

    # ------------------------------------------------------------------------------------------- networks
    def talker_forward(self, embeds: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache=None,
                       use_cache: bool = False):
        """The talker's decoder on `embeds` (B, T, D) at `positions` (3, B, T), `mask` (B, past + T): (last hidden
        states (B, T, D), cache)."""
        talker = self.networks["talker"]
        b, t = embeds.shape[:2]
        self.flops += b * decoder_forward_flops(self._talker_params, 0, *self._talker_shape, t, 0, mask.shape[1]) * (
            3 if torch.is_grad_enabled() else 1)
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype.itemsize < 4):
            out = talker.model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions, cache=cache,
                               use_cache=use_cache)
        return out.last_hidden_state, (out.cache if use_cache else None)

    def predictor_forward(self, embeds: torch.Tensor, cache=None, use_cache: bool = False):
        """The code predictor's decoder on `embeds` (N, T, D) (positions continue the cache; no padding)."""
        predictor = self.networks["code_predictor"]
        n, t = embeds.shape[:2]
        past = cache.get_seq_length() if cache is not None else 0
        self.flops += n * decoder_forward_flops(self._predictor_params, 0, *self._predictor_shape, t, 0, past + t) * (
            3 if torch.is_grad_enabled() else 1)
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype.itemsize < 4):
            out = predictor.model(inputs_embeds=embeds, cache=cache, use_cache=use_cache)
        return out.last_hidden_state, (out.cache if use_cache else None)

    def code_embed(self, k: int, codes: torch.Tensor) -> torch.Tensor:
        """The input embedding of code c^k (…) -> (…, D): c⁰ through the talker's codec embedding, c^k (k ≥ 1)
        through the code predictor's k-th."""
        if k == 0:
            return self.networks["talker"].get_input_embeddings()(codes)
        return self.networks["code_predictor"].get_input_embeddings()[k - 1](codes)

    def frame_embed(self, codes: torch.Tensor) -> torch.Tensor:
        """(…, G) codes of whole frames -> (…, D): Σ_k embed_k(c^k) (the text channel is added by the caller)."""
        return sum(self.code_embed(k, codes[..., k]) for k in range(self.groups))

    def first_code_logits(self, hidden: torch.Tensor, speaks: torch.Tensor | None = None) -> torch.Tensor:
        """c⁰'s logits (…, V_talker) float32 from the talker's hidden states: the suppressed ids at −inf; where
        `speaks` is False only the codec EOS (log-prob 0)."""
        logits = self.networks["talker"].codec_head(hidden).float().masked_fill(self.first_code_banned, float("-inf"))
        if speaks is not None and not bool(speaks.all()):
            only_eos = torch.full_like(logits, float("-inf"))
            only_eos[..., self.speech_eos] = 0.0
            logits = torch.where(speaks[..., None], logits, only_eos)
        return logits

    def predictor_logits(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """c^k's logits (…, V_talker) float32 (k ≥ 1: the code predictor's head k − 1), −inf past its vocabulary."""
        logits = self.networks["code_predictor"].lm_head[k - 1](hidden).float()
        pad = logits.new_full((*logits.shape[:-1], self.talker_vocab - logits.shape[-1]), float("-inf"))
        return torch.cat([logits, pad], -1)

    def speech_decoding(self, text, cond: dict) -> SpeechDecoding:
        """The rollout's talker decoder for a chunk whose texts are sampled (`text`: a TokenBatch of thinker ids)."""
        return SpeechDecoding(self, text, cond)

    def _prompt_hidden(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, cond: dict) -> torch.Tensor | None:
        """The thinker's hidden states after layer accept_hidden_layer over the prompts (None: no prompt has media)."""
        if not bool(torch.isin(prompt_ids[prompt_mask.bool()], torch.tensor(self.media_ids, device=self.device)).any()):
            return None
        return self.thinker_forward(prompt_ids, prompt_mask, cond, None, keep=1, hidden_layer=self.accept_layer)[2]

    # ------------------------------------------------------------------------------------------- teacher forcing
    def teacher_forced_log_probs(self, tokens, cond: dict, temperature: float) -> torch.Tensor:
        """log π of every response token (B, R) float32 (0 on padding), differentiable: one thinker forward over prompt
        ⧺ text (the text's log-probs, and the hidden states the talker reads), one talker forward over [its prompt
        part, the whole frames] (each frame's c⁰) and one code predictor forward over every frame (c¹ … c^{G−1})."""
        dev, g, t = self.device, self.groups, temperature
        rows = self.split(tokens)
        b, r = tokens.response_ids.shape
        out = torch.zeros(b, r, device=dev)
        n_max = max(len(text) for text, _ in rows)
        text_ids = torch.full((b, n_max), tokens.pad_id, dtype=torch.long, device=dev)
        text_mask = torch.zeros((b, n_max), dtype=torch.long, device=dev)
        for i, (text, _) in enumerate(rows):
            text_ids[i, : len(text)] = torch.tensor(text, dtype=torch.long, device=dev)
            text_mask[i, : len(text)] = 1
        ids = torch.cat([tokens.prompt_ids, text_ids[:, : n_max - 1]], 1)
        mask = torch.cat([tokens.prompt_mask, text_mask[:, : n_max - 1]], 1)
        logits, _, hidden = self.thinker_forward(ids, mask, cond, None, keep=n_max, hidden_layer=self.accept_layer)
        out[:, :n_max] = torch.log_softmax(logits / t, -1).gather(-1, text_ids[..., None])[..., 0] * text_mask
        prompt_hidden = hidden[:, : tokens.prompt_ids.shape[1]] if self.media_in(tokens) else None
        talk = self.talker_prompts(tokens.prompt_ids, tokens.prompt_mask, [text for text, _ in rows], prompt_hidden,
                                   cond)
        # the talker over [prompt part, whole frames], left padded; frame f's input at position next + f
        seqs, positions = [], []
        for (_, codes), row in zip(rows, talk, strict=True):
            whole = len(codes) // g
            seq = row["embeds"]
            if whole:
                frames = torch.arange(whole, device=dev)
                inputs = self.frame_embed(codes[: whole * g].reshape(whole, g)) + self.trailing_at([row] * whole, frames)
                seq = torch.cat([seq, inputs])
            seqs.append(seq)
            positions.append(torch.cat([row["positions"], (row["next"] + torch.arange(whole, device=dev)).expand(3, -1)],
                                       1))
        width = max(len(s) for s in seqs)
        embeds = seqs[0].new_zeros(b, width, seqs[0].shape[-1])
        pos = torch.zeros(3, b, width, dtype=torch.long, device=dev)
        attn = torch.zeros(b, width, dtype=torch.long, device=dev)
        for i, (s, q) in enumerate(zip(seqs, positions, strict=True)):
            embeds[i, width - len(s):], pos[:, i, width - len(s):], attn[i, width - len(s):] = s, q, 1
        states, _ = self.talker_forward(embeds, attn, pos)
        # c⁰ of frame f: the talker's hidden state at the end of the row's prompt part + f
        items = [(i, f, width - len(s) + len(row["embeds"]) - 1 + f, len(text) + f * g)  # row, frame, position, column
                 for i, ((text, codes), row, s) in enumerate(zip(rows, talk, seqs, strict=True))
                 for f in range(-(-len(codes) // g))]
        if not items:
            return out
        row_idx = torch.tensor([x[0] for x in items], device=dev)
        cols = torch.tensor([x[3] for x in items], device=dev)
        h = states[row_idx, torch.tensor([x[2] for x in items], device=dev)]
        speaks = torch.tensor([talk[i]["speaks"] or f > 0 for i, f, _, _ in items], device=dev)
        code0 = torch.stack([rows[i][1][f * g] for i, f, _, _ in items])
        out[row_idx, cols] = torch.log_softmax(self.first_code_logits(h, speaks) / t, -1).gather(-1, code0[:, None])[:, 0]
        # c¹ … c^{G−1}: the code predictor over [h, c⁰ … c^{G−2}] of every frame that has c¹ (0 past a cut frame's end)
        rest = [n for n, (i, f, _, _) in enumerate(items) if f * g + 1 < len(rows[i][1])]
        if rest:
            sel = torch.tensor(rest, device=dev)
            zeros = torch.zeros(g, dtype=torch.long, device=dev)
            codes = torch.stack([torch.cat([rows[items[n][0]][1][items[n][1] * g: items[n][1] * g + g], zeros])[:g]
                                 for n in rest])  # (N, G)
            inputs = [h[sel][:, None]] + [self.code_embed(k, codes[:, k])[:, None] for k in range(g - 1)]
            cp_states, _ = self.predictor_forward(torch.cat(inputs, 1))  # position k scores c^k
            for k in range(1, g):
                keep = [j for j, n in enumerate(rest) if items[n][1] * g + k < len(rows[items[n][0]][1])]
                if not keep:
                    continue
                j = torch.tensor(keep, device=dev)
                lp = torch.log_softmax(self.predictor_logits(cp_states[j, k], k) / t, -1).gather(-1, codes[j, k:k + 1])
                out[row_idx[sel[j]], cols[sel[j]] + k] = lp[:, 0]
        return out

    def media_in(self, tokens) -> bool:
        """Whether any prompt of the batch holds a media placeholder."""
        ids = tokens.prompt_ids[tokens.prompt_mask.bool()]
        return bool(torch.isin(ids, torch.tensor(self.media_ids, device=ids.device)).any())


class SpeechDecoding:
    """The rollout's talker decoder (sampling.tokens.speak): `prefill` runs the talker over each row's prompt part
    and gives frame 0's c⁰ logits; each `step(token)` takes the code just drawn: c⁰ … c^{G−2} go through the code
    predictor (a fresh cache per frame, seeded with the talker's hidden state) and give the next code's logits;
    c^{G−1} completes the frame, whose input (its codes' embeddings + the text channel) goes through the talker (its
    cache across frames) for the next frame's c⁰."""

    def __init__(self, policy: Qwen3OmniSpeechPolicy, text, cond: dict):
        self.policy, self.text, self.cond = policy, text, cond

    def prefill(self) -> torch.Tensor:
        p, dev = self.policy, self.policy.device
        prompt, pmask = self.text.prompt_ids.to(dev), self.text.prompt_mask.to(dev)
        texts = [row[: int(n)].tolist() for row, n in zip(self.text.response_ids, self.text.response_mask.sum(1),
                                                          strict=True)]
        hidden = p._prompt_hidden(prompt, pmask, self.cond)
        self.rows = p.talker_prompts(prompt, pmask, texts, hidden, self.cond)
        b, width = len(self.rows), max(len(r["embeds"]) for r in self.rows)
        embeds = self.rows[0]["embeds"].new_zeros(b, width, self.rows[0]["embeds"].shape[-1])
        positions = torch.zeros(3, b, width, dtype=torch.long, device=dev)
        self.mask = torch.zeros(b, width, dtype=torch.long, device=dev)
        for i, r in enumerate(self.rows):
            n = len(r["embeds"])
            embeds[i, width - n:], positions[:, i, width - n:], self.mask[i, width - n:] = r["embeds"], r["positions"], 1
        hidden, self.cache = p.talker_forward(embeds, self.mask, positions, use_cache=True)
        self.hidden = hidden[:, -1]
        self.next = torch.tensor([r["next"] for r in self.rows], device=dev)
        self.speaks = torch.tensor([r["speaks"] for r in self.rows], device=dev)
        self.slot, self.frame, self.codes = 0, 0, []
        return p.first_code_logits(self.hidden, self.speaks)

    def step(self, token: torch.Tensor) -> torch.Tensor:
        p, g = self.policy, self.policy.groups
        k = self.slot % g  # the codebook of the code just drawn
        self.slot += 1
        self.codes.append(token)
        if k < g - 1:
            if k == 0:
                embeds = torch.stack([self.hidden, p.code_embed(0, token)], 1)
                self.predictor_cache = None
            else:
                embeds = p.code_embed(k, token)[:, None]
            hidden, self.predictor_cache = p.predictor_forward(embeds, self.predictor_cache, use_cache=True)
            return p.predictor_logits(hidden[:, -1], k + 1)
        frames = torch.full_like(token, self.frame)
        frame = (p.frame_embed(torch.stack(self.codes, -1)) + p.trailing_at(self.rows, frames))[:, None]
        positions = (self.next + self.frame).expand(3, -1)[..., None]
        self.codes, self.frame = [], self.frame + 1
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], 1)
        hidden, self.cache = p.talker_forward(frame, self.mask, positions, self.cache, use_cache=True)
        self.hidden = hidden[:, -1]
        return p.first_code_logits(self.hidden)

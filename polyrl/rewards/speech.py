"""Speech rewards (text-to-speech policies; docs/audio.md, "Speech rewards"): intelligibility by a local ASR model, and
voice match by a local speaker-embedding model. Both read `Audio` (mono-mixed, resampled to the model's rate with
`scipy.signal.resample_poly`, as `clap` does) and load from local directories only.

* `asr_wer`: a local Whisper-layout checkpoint (`AutoModelForSpeechSeq2Seq` + `AutoProcessor`) transcribes each clip
  (greedy, at most `max_new_tokens` tokens); the score is 1 − WER (`metric: wer`) or 1 − CER (`metric: cer`) of
  the transcript against the data's `text` column (`text_key`; it reaches the reward as `metadata["text"]`; a row
  without one is refused before training, naming its file and line), or with `reference: response` against the
  policy's own text of the same response (a speaking policy, model=qwen3_omni_speech: the speech says what the text
  says; the reward then reads both media). Both texts are normalised first (lower case, punctuation other than
  apostrophes dropped, whitespace collapsed; `normalize: false` keeps them as they are). A response whose own text
  is empty scores WER 0 when the transcript is empty too, else 1.

      WER = (S + D + I) / N     the fewest word substitutions, deletions and insertions turning the reference
                                (N words) into the transcript (Levenshtein over words), as jiwer computes it
      CER = the same over characters (spaces included after normalisation)

  The score is not clipped: a transcript with many insertions has WER > 1 and a negative score (never a silent 0).
  Extras: `asr_wer/wer` (or `/cer`); the transcripts of the last call are in `reward.last_transcripts`.
* `speaker_similarity`: cosine of speaker embeddings, cos(e(generated), e(reference)), where e is the x-vector of a
  local `AutoModelForAudioXVector` checkpoint (WavLM / UniSpeech-SAT / Wav2Vec2 ...ForXVector) with its
  `AutoFeatureExtractor`; the reference is a 16-bit PCM WAV whose path is in the data column `reference_key`
  (default `reference_audio`), read once and cached.
"""

from __future__ import annotations

import re
import unicodedata

import numpy as np
import torch

from .base import Audio, RewardOutput, check_batch, register_reward, resolve_device, resolve_dtype
from .clap import resample
from .clip_score import local_dir
from .ocr import edit_distance

METRICS = ("wer", "cer")
REFERENCES = ("column", "response")  # asr_wer's reference text: the data's column, or the policy's own text


def normalize_transcript(text: str) -> str:
    """Lower case, Unicode punctuation except apostrophes removed, whitespace collapsed."""
    text = unicodedata.normalize("NFKC", text).lower()
    text = "".join(" " if unicodedata.category(c).startswith("P") and c != "'" else c for c in text)
    return re.sub(r"\s+", " ", text).strip()


def error_rate(hypothesis: str, reference: str, metric: str = "wer") -> float:
    """(S + D + I) / N over words (`wer`) or characters (`cer`) of the reference (module docstring); ValueError for
    an empty reference."""
    if metric not in METRICS:
        raise ValueError(f"metric={metric!r} is not valid; allowed: {', '.join(METRICS)}")
    ref = reference.split() if metric == "wer" else list(reference)
    hyp = hypothesis.split() if metric == "wer" else list(hypothesis)
    if not ref:
        raise ValueError(f"the reference text {reference!r} is empty: the {metric.upper()} is undefined")
    return edit_distance(ref, hyp) / len(ref)


def speech_error_rate(hypothesis: str, reference: str, metric: str = "wer") -> float:
    """`error_rate`, with an empty reference (a response whose text is empty) at 0 for an empty transcript, else 1."""
    if not (reference.split() if metric == "wer" else reference):
        return 0.0 if not (hypothesis.split() if metric == "wer" else hypothesis) else 1.0
    return error_rate(hypothesis, reference, metric)


def mono_at(audio: Audio, rate: int) -> list[np.ndarray]:
    """Each clip of an `Audio` batch as a mono float32 waveform at `rate` Hz."""
    wave = audio.waveform.detach().to("cpu", torch.float32).mean(1).numpy()  # (B, samples)
    return [resample(w, audio.sample_rate, rate).astype(np.float32) for w in wave]


class _LocalSpeechModel:
    """What both scorers share: a transformers model loaded from a local directory (`auto_class`), and a batch's
    per-sample string column checked before scoring."""

    name = ""
    media = ("audio",)

    def _load(self, auto_class, path: str, device: str, dtype: str):
        path = local_dir(path, f"{self.name} model path")
        self.device, self.dtype = resolve_device(device), resolve_dtype(dtype)
        self.model = auto_class.from_pretrained(path, dtype=self.dtype).to(self.device).eval()
        return path

    def _column(self, audio, prompts, metadata, key: str, what: str) -> list[str]:
        """`metadata[i][key]` of each sample of an `Audio` batch; ValueError naming the sample and the key."""
        if not isinstance(audio, Audio):
            raise ValueError(f"{self.name} scores audio, got {type(audio).__name__}")
        metadata = check_batch(self.name, len(audio), prompts, metadata)
        values = []
        for i, meta in enumerate(metadata):
            value = meta.get(key)
            if not isinstance(value, str):
                raise ValueError(f"{self.name}: sample {i} has no {what} in metadata {key!r}")
            values.append(value)
        return values


@register_reward("asr_wer")
class AsrWer(_LocalSpeechModel):
    """1 − WER (or 1 − CER) of a local ASR model's transcript against the data's text (module docstring)."""

    name = "asr_wer"

    def __init__(self, path: str, metric: str = "wer", text_key: str = "text", normalize: bool = True,
                 language: str | None = None, max_new_tokens: int = 128, device: str = "auto",
                 dtype: str = "float32", reference: str = "column"):
        from transformers import AutoModelForSpeechSeq2Seq, AutoProcessor

        if metric not in METRICS:
            raise ValueError(f"asr_wer: metric={metric!r} is not valid; allowed: {', '.join(METRICS)}")
        if reference not in REFERENCES:
            raise ValueError(f"asr_wer: reference={reference!r} is not valid; allowed: {', '.join(REFERENCES)}")
        self.reference = reference
        if reference == "response":  # reads each response's text beside its audio
            self.media = ("audio", "text")
        path = self._load(AutoModelForSpeechSeq2Seq, path, device, dtype)
        self.metric, self.text_key, self.normalize = metric, text_key, bool(normalize)
        self.language, self.max_new_tokens = language, int(max_new_tokens)
        self.processor = AutoProcessor.from_pretrained(path)
        self.rate = int(self.processor.feature_extractor.sampling_rate)
        self.last_transcripts: list[str] = []

    def check_prompt(self, prompt: str, metadata: dict) -> None:
        """A data row must carry the reference text (called per row before training), unless the reference is the
        response's own text."""
        if self.reference == "response":
            return
        text = metadata.get(self.text_key)
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"asr_wer needs the reference transcript in the {self.text_key!r} column")

    @torch.no_grad()
    def transcribe(self, audio: Audio) -> list[str]:
        clips = mono_at(audio, self.rate)
        feats = self.processor.feature_extractor(clips, sampling_rate=self.rate, return_tensors="pt")
        kwargs = {"language": self.language} if self.language else {}
        out = self.model.generate(feats["input_features"].to(self.device, self.dtype),
                                  max_new_tokens=self.max_new_tokens, do_sample=False, **kwargs)
        return self.processor.batch_decode(out, skip_special_tokens=True)

    def __call__(self, audio, prompts, metadata=None) -> RewardOutput:
        if self.reference == "response":
            if not isinstance(audio, dict) or "text" not in audio or "audio" not in audio:
                raise ValueError("asr_wer: reference=response compares the speech with the policy's own text, but the "
                                 "model outputs no text beside its audio (model=qwen3_omni_speech does)")
            refs = list(audio["text"])
            audio = audio["audio"]
            self._column(audio, prompts, [{"text": r} for r in refs], "text", "response text")
        else:
            refs = self._column(audio, prompts, metadata, self.text_key, "reference text")
        self.last_transcripts = self.transcribe(audio)
        norm = normalize_transcript if self.normalize else (lambda s: s)
        rate = speech_error_rate if self.reference == "response" else error_rate
        rates = [rate(norm(h), norm(r), self.metric) for h, r in zip(self.last_transcripts, refs, strict=True)]
        return RewardOutput(torch.tensor([1.0 - x for x in rates], dtype=torch.float32),
                            {f"asr_wer/{self.metric}": rates})


@register_reward("speaker_similarity")
class SpeakerSimilarity(_LocalSpeechModel):
    """cos(x-vector of the generated clip, x-vector of the row's reference clip) (module docstring)."""

    name = "speaker_similarity"

    def __init__(self, path: str, reference_key: str = "reference_audio", device: str = "auto",
                 dtype: str = "float32"):
        from transformers import AutoFeatureExtractor, AutoModelForAudioXVector

        path = self._load(AutoModelForAudioXVector, path, device, dtype)
        self.reference_key = reference_key
        self.extractor = AutoFeatureExtractor.from_pretrained(path)
        self.rate = int(self.extractor.sampling_rate)
        self._references: dict[str, torch.Tensor] = {}

    def check_prompt(self, prompt: str, metadata: dict) -> None:
        if not isinstance(metadata.get(self.reference_key), str):
            raise ValueError(f"speaker_similarity needs a reference clip path (WAV) in the {self.reference_key!r} "
                             "column")

    @torch.no_grad()
    def embed(self, clips: list[np.ndarray]) -> torch.Tensor:
        """(B, D) float32 x-vectors of mono clips at the model's rate (each clip alone: no padding effects)."""
        out = []
        for clip in clips:
            feats = self.extractor([clip], sampling_rate=self.rate, return_tensors="pt")
            feats = {k: (v.to(self.device, self.dtype) if torch.is_floating_point(v) else v.to(self.device))
                     for k, v in feats.items()}
            out.append(self.model(**feats).embeddings.float().cpu())
        return torch.cat(out)

    def reference(self, path: str) -> torch.Tensor:
        if path not in self._references:
            from .codec import MediaDecodeError, decode_wav

            try:
                with open(path, "rb") as f:
                    wave, rate = decode_wav(f.read(), max_seconds=600.0)
            except (OSError, MediaDecodeError) as e:
                raise ValueError(f"speaker_similarity: reference clip {path}: {e}") from None
            clip = mono_at(Audio(torch.from_numpy(wave)[None], rate), self.rate)[0]
            self._references[path] = self.embed([clip])[0]
        return self._references[path]

    def __call__(self, audio, prompts, metadata=None) -> RewardOutput:
        paths = self._column(audio, prompts, metadata, self.reference_key, "reference clip path")
        refs = [self.reference(path) for path in paths]
        gen = self.embed(mono_at(audio, self.rate))
        cos = torch.nn.functional.cosine_similarity(gen.double(), torch.stack(refs).double(), dim=-1)
        return RewardOutput(cos.float())

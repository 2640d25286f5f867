"""`ocr`: does the image show the quoted text of the prompt? (the Flow-GRPO OCR task)

The engine is RapidOCR (`rapidocr-onnxruntime`): PP-OCRv4 detection + recognition ONNX models shipped inside
the wheel, run with onnxruntime on the CPU. Nothing is downloaded. It is the `ocr` extra
(`pip install -e '.[ocr]'`), not the core install; without it `reward=ocr` is one `polyrl: error:` line naming it.

Score per image, with the Flow-GRPO normalisation:

1. target: the text between the first pair of double quotes of the prompt (`a sign that says "HELLO"` ->
   `HELLO`), or the metadata's `text` field when given; a prompt with neither is an error;
2. read: the recognised text of every detected box (RapidOCR's reading order, top-to-bottom then
   left-to-right), confidence >= `min_confidence`, concatenated; with `detect=False` the recogniser reads the
   whole image as one text line instead (no detection: for images that are one line of text, e.g. the toy
   OCR task, about 30x faster);
3. both lower-cased with all whitespace removed;
4. d = 0 if the target occurs inside the read text (extra text is not penalised), else the Levenshtein
   distance(read, target), capped at len(target);
5. score = 1 - d / len(target), in [0, 1].

Extras: `ocr/exact` (the target read exactly, possibly inside more text), `ocr/chars_read`, and the `caption` of
each sample's tile in the sample grids: the target and what was read (`target 'HELLO', read 'HELL0'`).
"""

from __future__ import annotations

import functools
import re

import torch

from ..errors import missing_extra
from .base import RewardOutput, check_batch, image_batch_as_uint8, media_kind, register_reward

_QUOTED = re.compile(r'"([^"]*)"')


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance: the fewest single-character insertions, deletions and substitutions turning
    `a` into `b` (two-row dynamic programme)."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def normalise_text(text: str) -> str:
    return "".join(text.split()).lower()


def ocr_score(read: str, target: str) -> float:
    """Steps 3-5 of the module docstring."""
    read, target = normalise_text(read), normalise_text(target)
    if not target:
        raise ValueError("ocr reward: the target text is empty")
    d = 0 if target in read else min(edit_distance(read, target), len(target))
    return 1.0 - d / len(target)


def target_text(prompt: str, meta: dict | None) -> str:
    if meta and meta.get("text"):
        return str(meta["text"])
    m = _QUOTED.search(prompt)
    if m is None or not m.group(1).strip():
        raise ValueError(f'ocr reward: prompt {prompt!r} has no quoted target text (e.g. a sign that says "HELLO") '
                         "and its metadata no `text` field")
    return m.group(1)


@functools.lru_cache(maxsize=4)
def load_engine(use_cls: bool, threads: int, det_limit_side_len: int = 960, det_limit_type: str = "max"):
    """One RapidOCR engine per setting per process (loading the three ONNX sessions takes ~1 s)."""
    try:
        from rapidocr_onnxruntime import RapidOCR
    except ModuleNotFoundError as e:  # the `ocr` extra is not installed (or only part of it)
        if (e.name or "").split(".")[0] not in ("rapidocr_onnxruntime", "onnxruntime", "cv2"):
            raise
        raise missing_extra("reward=ocr", "ocr", "rapidocr-onnxruntime, which pulls onnxruntime and opencv-python") from None
    return RapidOCR(use_cls=use_cls, intra_op_num_threads=threads, inter_op_num_threads=1 if threads > 0 else -1,
                    det_limit_side_len=det_limit_side_len, det_limit_type=det_limit_type)


@register_reward("ocr")
class OcrReward:
    """1 - normalised edit distance between the prompt's quoted text and the text read (module docstring).

    `min_confidence`: recognised boxes below this confidence are ignored (Flow-GRPO kept every box with a
    confidence > 0; 0.0 here keeps them all). `use_cls`: run the 0/180 degree text-direction classifier
    (Flow-GRPO: off). `threads`: onnxruntime intra-op threads (-1: onnxruntime's default).
    `detect`: run the text detector (Flow-GRPO: on); false reads the whole image as one line with the
    recogniser alone (module docstring, step 2). `det_limit_side_len`, `det_limit_type`: the detector's input resize. Default: the longer side at most 960
    px (PaddleOCR's default, which Flow-GRPO ran); RapidOCR's own default ("min", 736) upscales a 192x64
    image to 2208x736 and is about 20x slower on such small images.
    """

    def __init__(self, min_confidence: float = 0.0, use_cls: bool = False, threads: int = -1,
                 det_limit_side_len: int = 960, det_limit_type: str = "max", detect: bool = True):
        if det_limit_type not in ("max", "min"):
            raise ValueError(f"ocr: det_limit_type={det_limit_type!r}; allowed: max, min")
        self.min_confidence = float(min_confidence)
        self.detect, self.use_cls = bool(detect), bool(use_cls)
        self.engine = load_engine(bool(use_cls), int(threads), int(det_limit_side_len), det_limit_type)

    def read(self, image) -> str:
        """Recognised text of one (H, W, 3) uint8 RGB image."""
        bgr = image[:, :, ::-1].copy()  # the engine takes BGR
        if not self.detect:  # rows are (text, confidence)
            result, _ = self.engine(bgr, use_det=False, use_cls=self.use_cls, use_rec=True)
            return "".join(text for text, conf in (result or []) if float(conf) >= self.min_confidence)
        result, _ = self.engine(bgr, text_score=self.min_confidence)  # rows are (box, text, confidence)
        return "".join(text for _, text, conf in (result or []) if float(conf) >= self.min_confidence)

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> RewardOutput:
        if media_kind(images) != "images":
            raise ValueError(f"ocr reward scores images (B, 3, H, W), got {tuple(images.shape)}")
        metadata = check_batch("ocr", images.shape[0], prompts, metadata)
        targets = [target_text(p, m) for p, m in zip(prompts, metadata, strict=True)]  # bad prompts fail first
        reads = [self.read(a) for a in image_batch_as_uint8(images)]
        scores = [ocr_score(r, t) for r, t in zip(reads, targets, strict=True)]
        return RewardOutput(
            torch.tensor(scores, dtype=torch.float32),
            {"ocr/exact": [float(normalise_text(t) in normalise_text(r)) for r, t in zip(reads, targets, strict=True)],
             "ocr/chars_read": [float(len(normalise_text(r))) for r in reads],
             "caption": [f"target {t!r}, read {r!r}" for r, t in zip(reads, targets, strict=True)]},
        )

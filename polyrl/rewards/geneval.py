"""`geneval`: GenEval's object-focused check of an image against its prompt's metadata (Ghosh et al. 2023).

Each prompt's metadata is a row of GenEval's evaluation_metadata.jsonl (data/benchmarks.py reads it): `tag`,
`include` (objects that must be there: `{class, count[, color][, position: [relation, index]]}`) and `exclude`
(`{class, count}`: fewer than `count` allowed). The rules, as GenEval's evaluation/evaluate_images.py applies them:

* detection: an instance-segmentation detector over GenEval's 80 COCO classes (`GENEVAL_CLASSES`; GenEval runs
  mmdetection's Mask2Former Swin-S COCO instance model, here any transformers Mask2Former COCO instance checkpoint,
  e.g. facebook/mask2former-swin-small-coco-instance, read from a local directory). Per class, the detections
  scoring above `threshold` = 0.3 (`counting_threshold` = 0.9 for the `counting` tag), most confident first, at most
  `max_objects` = 16; no NMS between them (GenEval's max_overlap 1.0). Boxes are the masks' extents.
* include: the first `count` detections of the class must exist; with `color`, CLIP (GenEval: ViT-L-14 OpenAI
  weights, the same as openai/clip-vit-large-patch14) classifies each of them among `COLORS` on the image pasted
  over grey (#999) through the object's mask, cropped to its box, with the templates "a photo of a {c} {class}",
  "a photo of a {c}-colored {class}", "a photo of a {c} object" (one mean normalised text embedding per colour), and
  at least `count` must be the asked colour; with `position` [relation, i], every one of them must stand in
  `relation` to every object matched by include entry i (`relative_position`, margin `position_threshold` = 0.1).
* exclude: the image fails when the class has at least `count` detections.
* an image is correct when every include holds and no exclude fires; GenEval's score of a tag is the share of correct
  images, its overall score the mean over tags (`polyrl eval` reports both: per category and `category_mean`).

The reward: `mode=strict` (default) 1.0 for a correct image, else 0.0; `mode=partial`, polyrl's graded variant for
training, the share of include and exclude clauses that hold. Extras: `geneval/correct` and `geneval/<tag>` (the
image's correctness, under its tag).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .base import RewardOutput, check_batch, image_batch_as_uint8, register_reward

# GenEval's object_names.txt: the 80 COCO classes as GenEval names them, in COCO order
GENEVAL_CLASSES = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light",
    "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow", "elephant",
    "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie", "suitcase", "frisbee", "skis", "snowboard",
    "sports ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard", "tennis racket", "bottle",
    "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple", "sandwich", "orange", "broccoli",
    "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch", "potted plant", "bed", "dining table", "toilet",
    "tv", "laptop", "computer mouse", "tv remote", "computer keyboard", "cell phone", "microwave", "oven", "toaster",
    "sink", "refrigerator", "book", "clock", "vase", "scissors", "teddy bear", "hair drier", "toothbrush",
)
# COCO label names detectors use (transformers' Mask2Former COCO id2label) where GenEval's differ
LABEL_ALIASES = {"mouse": "computer mouse", "remote": "tv remote", "keyboard": "computer keyboard",
                 "hair dryer": "hair drier"}
COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
COLOR_TEMPLATES = ("a photo of a {c} {cls}", "a photo of a {c}-colored {cls}", "a photo of a {c} object")
THRESHOLD, COUNTING_THRESHOLD, MAX_OBJECTS, POSITION_THRESHOLD = 0.3, 0.9, 16, 0.1
BACKGROUND = (153, 153, 153)  # GenEval's bgcolor "#999"


@dataclass
class Detection:
    """One detected object: its confidence, box (x0, y0, x1, y1) in pixels and mask (H, W) bool (None: the box)."""

    score: float
    box: tuple[float, float, float, float]
    mask: np.ndarray | None = None


def relative_position(a: Detection, b: Detection, margin: float = POSITION_THRESHOLD) -> set[str]:
    """The relations of A to B from box centres (GenEval's rule): offset o = c_A − c_B, shrunk per axis by
    margin·(size_A + size_B) toward 0 (r = sign(o)·max(|o| − margin·(s_A + s_B), 0)); none when both |r| < 1e-3; else
    with (dx, dy) = r / |o|: left of (dx < −0.5), right of (dx > 0.5), above (dy < −0.5), below (dy > 0.5), in image
    coordinates (y down)."""
    boxes = np.array([a.box, b.box], dtype=np.float64).reshape(2, 2, 2)
    center_a, center_b = boxes.mean(axis=1)
    size_a, size_b = np.abs(boxes[:, 1] - boxes[:, 0])
    offset = center_a - center_b
    revised = np.maximum(np.abs(offset) - margin * (size_a + size_b), 0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return set()
    dx, dy = revised / np.linalg.norm(offset)
    return ({"left of"} if dx < -0.5 else set()) | ({"right of"} if dx > 0.5 else set()) | \
        ({"above"} if dy < -0.5 else set()) | ({"below"} if dy > 0.5 else set())


def keep_detections(found: dict[str, list[Detection]], tag: str, threshold: float = THRESHOLD,
                    counting_threshold: float = COUNTING_THRESHOLD, max_objects: int = MAX_OBJECTS):
    """Per class, the detections above the tag's threshold (strictly, as GenEval), most confident first, at most
    `max_objects`; classes left empty are dropped."""
    cut = counting_threshold if tag == "counting" else threshold
    out = {}
    for cls, dets in found.items():
        kept = sorted((d for d in dets if d.score > cut), key=lambda d: -d.score)[:max_objects]
        if kept:
            out[cls] = kept
    return out


def check_metadata(meta: dict, objects: dict[str, list[Detection]], colors_of) -> tuple[bool, list[bool], list[str]]:
    """GenEval's rules (module docstring) on the kept detections `objects`. `colors_of(cls, detections)` -> one colour
    name per detection (CLIP on the masked crops; tests pass their own). Returns (correct, one bool per include then
    per exclude clause, reasons)."""
    clauses, reasons, matched_groups = [], [], []
    for req in meta.get("include", []):
        cls, count = req["class"], int(req["count"])
        found = objects.get(cls, [])[:count]
        ok = len(found) >= count
        if not ok:
            reasons.append(f"expected {cls}>={count}, found {len(found)}")
        if ok and "color" in req:
            colors = colors_of(cls, found)
            if colors.count(req["color"]) < count:
                ok = False
                reasons.append(f"expected {req['color']} {cls}>={count}, found {colors.count(req['color'])} "
                               f"{req['color']} (colours: {', '.join(colors)})")
        if ok and "position" in req:
            relation, target = req["position"][0], int(req["position"][1])
            group = matched_groups[target] if target < len(matched_groups) else None
            if group is None:
                ok = False
                reasons.append(f"no target for {cls} to be {relation}")
            else:
                for obj in found:
                    bad = [t for t in group if relation not in relative_position(obj, t)]
                    if bad:
                        ok = False
                        found_rel = " and ".join(sorted(relative_position(obj, bad[0]))) or "no relation to the"
                        reasons.append(f"expected {cls} {relation} target, found {found_rel} target")
                        break
        clauses.append(ok)
        matched_groups.append(found if ok else None)
    for req in meta.get("exclude", []):
        n = len(objects.get(req["class"], []))
        ok = n < int(req["count"])
        if not ok:
            reasons.append(f"expected {req['class']}<{req['count']}, found {n}")
        clauses.append(ok)
    return all(clauses), clauses, reasons


def mask_box(mask: np.ndarray) -> tuple[float, float, float, float]:
    """(x0, y0, x1, y1) of a mask's pixels, x1 / y1 one past the last (mmdetection's mask-to-box)."""
    ys, xs = np.nonzero(mask)
    return float(xs.min()), float(ys.min()), float(xs.max() + 1), float(ys.max() + 1)


@register_reward("geneval")
class GenEval:
    """GenEval's check as a reward (module docstring). `detector_path`: a transformers Mask2Former (or other
    universal-segmentation) COCO instance checkpoint directory; `clip_path`: a CLIP directory (GenEval: ViT-L/14)."""

    def __init__(self, detector_path: str, clip_path: str, mode: str = "strict", threshold: float = THRESHOLD,
                 counting_threshold: float = COUNTING_THRESHOLD, max_objects: int = MAX_OBJECTS,
                 position_threshold: float = POSITION_THRESHOLD, device: str = "auto", dtype: str = "float32"):
        from transformers import AutoImageProcessor, AutoModelForUniversalSegmentation

        from .base import resolve_device, resolve_dtype
        from .clip_score import ClipEmbedder, local_dir

        if mode not in ("strict", "partial"):
            raise ValueError(f"reward.mode={mode!r} is not valid; allowed: strict, partial")
        self.mode, self.threshold, self.counting_threshold = mode, threshold, counting_threshold
        self.max_objects, self.position_threshold = max_objects, position_threshold
        self.device, self.dtype = resolve_device(device), resolve_dtype(dtype)
        path = local_dir(detector_path, "geneval detector_path")
        self.detector = AutoModelForUniversalSegmentation.from_pretrained(path, dtype=self.dtype).to(self.device).eval()
        self.processor = AutoImageProcessor.from_pretrained(path)
        labels = {int(i): str(n) for i, n in self.detector.config.id2label.items()}
        self.labels = {i: LABEL_ALIASES.get(n, n) for i, n in labels.items()}
        self.clip = ClipEmbedder(clip_path, None, device, dtype)
        self._color_text: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def detect(self, images: torch.Tensor) -> list[dict[str, list[Detection]]]:
        """Per image, class -> detections with score >= min(threshold, counting_threshold), masks at image size."""
        h, w = images.shape[-2:]
        inputs = self.processor(images=image_batch_as_uint8(images), return_tensors="pt")
        inputs = {k: v.to(self.device, self.dtype) if v.is_floating_point() else v.to(self.device)
                  for k, v in inputs.items()}
        outputs = self.detector(**inputs)
        results = self.processor.post_process_instance_segmentation(
            outputs, threshold=min(self.threshold, self.counting_threshold), target_sizes=[(h, w)] * len(images),
            return_binary_maps=True)
        out = []
        for result in results:
            found: dict[str, list[Detection]] = {}
            maps = result["segmentation"]
            for j, info in enumerate(result["segments_info"]):
                mask = maps[j].cpu().numpy() > 0.5
                if not mask.any():
                    continue
                cls = self.labels.get(int(info["label_id"]), str(info["label_id"]))
                found.setdefault(cls, []).append(Detection(float(info["score"]), mask_box(mask), mask))
            out.append(found)
        return out

    def _color_classifier(self, cls: str) -> torch.Tensor:
        """(D, 10): per colour the normalised mean of its templates' normalised text embeddings."""
        if cls not in self._color_text:
            columns = []
            for c in COLORS:
                e = self.clip.text_embeds([t.format(c=c, cls=cls) for t in COLOR_TEMPLATES]).mean(0)
                columns.append(torch.nn.functional.normalize(e, dim=0))
            self._color_text[cls] = torch.stack(columns, dim=1)
        return self._color_text[cls]

    @torch.no_grad()
    def colors_of(self, image: np.ndarray, cls: str, detections: list[Detection]) -> list[str]:
        """CLIP's colour of each detection: the image over grey through its mask, cropped to its box."""
        crops = []
        for d in detections:
            pasted = image if d.mask is None else np.where(d.mask[..., None], image, np.array(BACKGROUND, np.uint8))
            x0, y0, x1, y1 = (int(round(v)) for v in d.box)
            crops.append(np.ascontiguousarray(pasted[y0:max(y1, y0 + 1), x0:max(x1, x0 + 1)]))
        pv = self.clip.image_processor(images=crops, return_tensors="pt")["pixel_values"]
        from .clip_score import _pooled

        feats = _pooled(self.clip.model.get_image_features(pixel_values=pv.to(self.clip.device, self.clip.dtype)))
        logits = torch.nn.functional.normalize(feats.float(), dim=-1) @ self._color_classifier(cls)
        return [COLORS[i] for i in logits.argmax(dim=1).tolist()]

    def __call__(self, images, prompts, metadata=None) -> RewardOutput:
        metadata = check_batch("geneval", images.shape[0], prompts, metadata)
        for i, meta in enumerate(metadata):
            if not isinstance(meta.get("include"), list):
                raise ValueError(f"reward geneval: sample {i} ({prompts[i]!r}) has no GenEval metadata ('include'); "
                                 "evaluate a GenEval evaluation_metadata.jsonl")
        arrays = image_batch_as_uint8(images)
        scores, correct, tags = [], [], {}
        for i, (found, meta) in enumerate(zip(self.detect(images), metadata, strict=True)):
            tag = str(meta.get("tag", ""))
            kept = keep_detections(found, tag, self.threshold, self.counting_threshold, self.max_objects)
            ok, clauses, _ = check_metadata(meta, kept, lambda cls, dets, a=arrays[i]: self.colors_of(a, cls, dets))
            correct.append(float(ok))
            scores.append(float(ok) if self.mode == "strict" else sum(clauses) / len(clauses))
            tags.setdefault(f"geneval/{tag}", [None] * len(metadata))[i] = float(ok)
        return RewardOutput(torch.tensor(scores, dtype=torch.float32), {"geneval/correct": correct, **tags})

"""The memory plan of a run (`polyrl plan`): its estimated peak GPU memory per GPU before anything loads, and where it
does not fit, the smallest change that does.

What it counts (docs/memory.md has every formula and its calibration):
- weights: every tensor of the checkpoint (safetensors headers, nothing loaded) in the dtype the run loads it in —
  the trained networks in `model.dtype` (FP8 keeps each frozen linear as two float8 copies: 2 B per parameter, as
  bf16), VAEs / vocoders in float32, the other encoders in `model.dtype`; FSDP2 divides the trained networks by the
  shard degree, tensor parallel by its degree;
- trainable state: LoRA (rank r on every target linear: r·(in + out)) or every parameter of the trained networks,
  float32 master weights, gradients and AdamW's two moments (16 B per trainable parameter), + 4 B for the old / EMA
  copy; a full fine-tune also keeps its frozen reference copy (KL, DPO) in `model.dtype` and autocast's half copy
  of the weights during a forward;
- activations: the training micro-batch (rows × tokens × blocks × width × bytes × c, c measured per block kind,
  eager or compiled, checkpointed blocks keeping only their input) and the rollout's sampling call (one block's
  temporaries; a token policy's KV cache and logits), whichever is larger.

Coefficients are fitted to the peaks recorded in docs/bench/*.json (scripts/plan_calibration.py prints the error of
every recorded run); families without a recorded run use the image DiT's and say so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .plan_inventory import (  # noqa: F401 (re-exported: the plan's input)
    Network,
    Tensor,
    blocks,
    inventory_from_modules,
    lora_parameters,
    matches,
    read_inventory,
    safetensors_header,
    trained_names,
)

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}
FLOAT32_PARTS = ("vae", "vocoder", "projection_model", "duration_embedder")  # loaded in float32 (models/*.py)
# activation coefficients, per family whose runs were measured (scripts/plan_calibration.py, docs/memory.md): tensors
# of the block width saved per token and block by the training forward (eager / compiled), in the network's dtype;
# the rollout call's memory per row, token and width unit; a token policy's logits bytes per response position and
# vocabulary entry. `trained`: the fine-tune the coefficients were measured with (a full fine-tune saves more: every
# linear's input, FULL_OVER_LORA times a LoRA run's, measured on SD3.5-M)
CALIBRATED = {
    "sd3": dict(eager=27.6, compiled=17.3, rollout=12.0, trained="lora", source="SD3.5-M runs on one and two H200s"),
    "qwen_image": dict(eager=27.6, compiled=17.3, rollout=171.0, trained="lora",
                       source="Qwen-Image runs on one H200 (the rollout's figure is fitted: the sampling call sets "
                              "these peaks, what holds the memory there was not profiled)"),
    "wan": dict(eager=51.5, compiled=27.6, rollout=12.0, trained="full",
                source="Wan2.2-TI2V-5B (full) and -T2V-A14B (LoRA) runs on one and two H200s"),
    "lm": dict(eager=33.0, compiled=33.0, rollout=2.0, logits=10.0, trained="lora",
               source="a Qwen3-1.7B-shaped LM on one H200"),
}
CALIBRATION_OF = {"sd3": "sd3", "qwen_image": "qwen_image", "qwen_image_edit": "qwen_image",
                  "qwen_image_edit_plus": "qwen_image", "wan": "wan", "wan_i2v": "wan", "causal_lm": "lm"}
FULL_OVER_LORA = 1.5
OVERHEAD_GIB = 0.75  # cuBLAS workspaces, the step's batch on the device, allocator rounding
# pixels per token side and frames per latent frame, by family; text tokens that enter the blocks (joint attention)
IMAGE_TOKENS = {"sd3": 16, "flux": 16, "flux_kontext": 16, "flux2": 16, "qwen_image": 16, "qwen_image_edit": 16,
                "qwen_image_edit_plus": 16, "z_image": 16, "hunyuan_image": 32, "bagel": 16, "diffusers_pipeline": 16,
                "wan": 16, "wan_i2v": 16, "ltx2": 32, "minimax_h3": 32}
CONDITION_IMAGES = {"flux_kontext": 1, "qwen_image_edit": 1, "qwen_image_edit_plus": 2}
GUIDANCE_EMBEDDED = {"flux", "flux_kontext", "hunyuan_image"}  # guidance is an input, not a second row
AUDIO_TOKENS_PER_SECOND = {"stable_audio": 44100 / 2048, "stable_audio_3": 25.0, "ace_step": 25.0}
TOKEN_FAMILIES = {"causal_lm", "janus_pro", "qwen3_omni", "qwen3_tts"}


# ------------------------------------------------------------------------------------------------- the plan
@dataclass
class Line:
    what: str
    gib: float
    note: str = ""


@dataclass
class Plan:
    resident: list[Line]
    peaks: list[Line]  # the activation candidates; the largest counts
    gpus: int
    layout: str
    calibration: str
    notes: list[str] = field(default_factory=list)
    counts: dict = field(default_factory=dict)  # exact arithmetic: trainable parameters, each component's bytes

    @property
    def peak_gib(self) -> float:
        return sum(x.gib for x in self.resident) + max((x.gib for x in self.peaks), default=0.0)

    def table(self, budget: float | None = None) -> str:
        rows = [(x.what, x.gib, x.note) for x in self.resident]
        top = max(self.peaks, key=lambda x: x.gib, default=None)
        rows += [(x.what + (" (the peak)" if x is top else ""), x.gib, x.note) for x in self.peaks]
        width = max(len(r[0]) for r in rows)
        lines = [f"  {w.ljust(width)}  {g:8.2f} GiB  {n}" for w, g, n in rows]
        lines.append(f"  {'estimated peak per GPU'.ljust(width)}  {self.peak_gib:8.2f} GiB  ({self.layout})")
        if budget:
            fits = "fits" if self.peak_gib <= budget else "does NOT fit"
            lines.append(f"  {'GPU memory'.ljust(width)}  {budget:8.2f} GiB  {fits}")
        return "\n".join(lines)


def count(n: float) -> str:
    """A parameter count as people write it: 2.47 B, 18.8 M, 30.7 K."""
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n / 1e3:.1f} K"


def calibration(family: str) -> tuple[str, bool]:
    """(the calibrated family whose coefficients a family uses, whether they were measured on it)."""
    if family in CALIBRATION_OF:
        return CALIBRATION_OF[family], True
    if family in TOKEN_FAMILIES:
        return "lm", False
    return ("wan" if family in ("ltx2", "minimax_h3") else "sd3"), False


def token_lengths(cfg, family: str, inventory: dict[str, Network], prompt_tokens: int | None) -> tuple[int, int]:
    """(tokens per row through the trained blocks, of them the response tokens of a token policy)."""
    r, m = cfg.rollout, cfg.model
    if family in TOKEN_FAMILIES:
        prompt = prompt_tokens if prompt_tokens is not None else int(m.max_sequence_length)
        return prompt + int(r.max_new_tokens), int(r.max_new_tokens)
    if family in AUDIO_TOKENS_PER_SECOND:
        seconds = float(dict(m.get("options") or {}).get("seconds", 10.0))
        return int(seconds * AUDIO_TOKENS_PER_SECOND[family]) + 1, 0
    side = IMAGE_TOKENS.get(family, 16)
    vae = inventory.get("vae")
    if family in ("wan", "wan_i2v") and vae is not None and int(vae.config.get("z_dim", 16)) != 48:
        side = 16  # the Wan2.1 VAE (8×) and patch 2; Wan2.2-TI2V's (16×, z 48): 32
    elif family in ("wan", "wan_i2v"):
        side = 32
    frames = 1
    if r.num_frames:
        frames = (int(r.num_frames) - 1) // (8 if family == "ltx2" else 4) + 1
    image = frames * max(1, r.height // side) * max(1, r.width // side)
    image *= 1 + CONDITION_IMAGES.get(family, 0)
    text = 0
    if family in ("sd3",):
        text = 77 + int(m.max_sequence_length)
    elif family in ("flux", "flux_kontext", "flux2", "z_image", "hunyuan_image", "bagel", "diffusers_pipeline"):
        text = int(m.max_sequence_length)
    elif family.startswith("qwen_image"):
        text = min(int(m.max_sequence_length), 64)  # the prompt's own tokens (the template's are dropped)
    return image + text, 0


def estimate(cfg, inventory: dict[str, Network], gpus: int = 1, prompt_tokens: int | None = None) -> Plan:
    """The plan of `cfg` on `gpus` GPUs of one run (see the module docstring)."""
    from ..algorithms import build_algorithm
    from ..models import MODELS

    family = cfg.model.name
    a, r = cfg.actor, cfg.rollout
    dtype_b = DTYPE_BYTES.get(str(cfg.model.dtype), 4)
    from omegaconf import OmegaConf

    algo = build_algorithm(OmegaConf.to_container(cfg.algorithm, resolve=True))
    lora = a.lora_rank > 0
    sharded = a.backend in ("fsdp2", "veomni")
    tp, sp = max(1, int(cfg.parallel.tp)), max(1, int(cfg.parallel.sp))
    shard = max(1, gpus // (tp * max(1, int(cfg.parallel.dp_replicate)))) if sharded else 1  # dp_shard × sp
    split = shard * tp
    trained = trained_names(inventory, family)
    resident, peaks, notes, weight_bytes = [], [], [], {}
    fp8 = cfg.model.fp8 is True or (cfg.model.fp8 == "auto" and lora and dtype_b == 2 and not sharded)
    for name, net in inventory.items():
        is_trained = name in trained
        b = 4 if name.startswith(FLOAT32_PARTS) else dtype_b
        if is_trained and not lora:
            b = max(4, dtype_b)  # a full fine-tune's weights are its float32 master copy
        weight_bytes[name] = net.numel * b
        gib = net.numel * b / GIB / (split if is_trained else 1)
        note = f"{count(net.numel)} × {b} B" + (f" / {split} ranks" if is_trained and split > 1 else "")
        if is_trained and lora and fp8 and dtype_b == 2:
            note += " (with FP8, model.fp8 on an H100 / H200: two float8 copies per frozen linear, 2 B too)"
        resident.append(Line(f"weights: {name}", gib, note))
    params = sum(inventory[n].numel for n in trained)
    if lora:
        targets = list(a.lora_targets) if a.lora_targets else list(getattr(MODELS.get(family), "default_lora_targets", []))
        trainable = sum(lora_parameters(inventory[n], targets, int(a.lora_rank)) for n in trained)
        what = f"LoRA r{a.lora_rank}"
        resident.append(Line(f"{what}: weights, gradients, AdamW", trainable * 16 / GIB / split,
                             f"{count(trainable)} × (4 + 4 + 8) B"))
    else:
        trainable = params
        resident.append(Line("full fine-tune: gradients, AdamW", trainable * 12 / GIB / split,
                             f"{count(trainable)} × (4 + 8) B (the float32 weights are above)"))
        if algo.needs_reference:
            resident.append(Line("reference copy (frozen)", params * dtype_b / GIB / split, f"× {dtype_b} B"))
    if algo.needs_old or float(a.ema_decay) > 0:
        resident.append(Line("old / EMA copy", trainable * 4 / GIB / split, "× 4 B"))
    teachers = list(getattr(algo, "teacher_paths", None) or ([algo.teacher_path] if getattr(algo, "teacher_path", None) else []))
    if teachers:
        resident.append(Line(f"{len(teachers)} teacher(s) (frozen)", len(teachers) * params * dtype_b / GIB, "assumed the policy's size"))
    resident.append(Line("overhead", OVERHEAD_GIB, "cuBLAS workspaces, the step's batch, allocator rounding"))

    key, measured = calibration(family)
    c, kind = CALIBRATED[key], "lm" if key == "lm" else "diffusion"
    n_blocks, width = max((blocks(inventory[n]) for n in trained), key=lambda x: x[0] * x[1])
    length, response = token_lengths(cfg, family, inventory, prompt_tokens)
    dp = max(1, gpus // (tp * sp))
    samples = cfg.data.prompts_per_step * (2 if cfg.data.get("pairs_path") else r.n)  # offline pairs: chosen + rejected
    per_rank = max(1, samples // max(1, a.num_minibatches) // dp)
    micro = min(int(a.micro_batch_size) or per_rank, per_rank)
    cfg_rows = 2 if (r.guidance_scale > 1 and family not in GUIDANCE_EMBEDDED and kind != "lm") else 1
    train_rows = micro * (cfg_rows if getattr(algo, "uses_log_probs", False) else 1)
    tokens = length / sp
    share = 1.0 if a.gradient_checkpointing is True else float(a.gradient_checkpointing or 0.0)
    coef = c["compiled"] if cfg.model.compile != "none" else c["eager"]
    coef *= {("lora", False): FULL_OVER_LORA, ("full", True): 1 / FULL_OVER_LORA}.get((c["trained"], lora), 1.0)
    per_block = train_rows * tokens * width * dtype_b
    act = n_blocks * per_block * ((1 - share) * coef + share) + (per_block * coef if share > 0 else 0.0)
    note = (f"{train_rows} rows × {tokens:.0f} tokens × {n_blocks} blocks × width {width} × {dtype_b} B × "
            f"{coef:.3g}" + (f", {share:g} of the blocks checkpointed (their input kept)" if share else ""))
    if not lora and dtype_b < 4:  # autocast's half copy of the float32 weights, kept for the backward
        act += params * dtype_b / split
        note += f"; autocast copy of the weights {params * dtype_b / split / GIB:.2f} GiB"
    if kind == "lm":
        vocab = max((t.shape[0] for n in trained for k, t in inventory[n].tensors.items()
                     if len(t.shape) == 2 and ("embed_tokens" in k or "lm_head" in k)), default=0)
        act += train_rows * max(response, 1) * vocab * c["logits"]
        note += f"; logits: {train_rows} × {response} × {vocab} × {c['logits']:g} B"
    peaks.append(Line("activations: training micro-batch", act / GIB, note))
    roll_rows = min(int(r.batch_size), per_rank * a.num_minibatches) * cfg_rows
    rollout = roll_rows * tokens * width * dtype_b * c["rollout"]
    rnote = f"{roll_rows} rows × {tokens:.0f} tokens × width {width} × {dtype_b} B × {c['rollout']:g}"
    if kind == "lm":
        cfg_json = inventory[trained[0]].config
        text = cfg_json.get("text_config", cfg_json)
        kv = int(text.get("num_key_value_heads") or text.get("num_attention_heads") or 0)
        head = int(text.get("head_dim") or (width // max(1, int(text.get("num_attention_heads") or 1))))
        cache = 2 * n_blocks * kv * head * length * roll_rows * dtype_b
        rollout += cache
        rnote += f"; KV cache {cache / GIB:.2f} GiB"
    peaks.append(Line("activations: rollout sampling call", rollout / GIB, rnote))
    # AdamW's step (torch's multi-tensor kernels) holds a float32 temporary of every trainable parameter
    peaks.append(Line("optimizer step temporaries", trainable * 4 / GIB / split, f"{count(trainable)} × 4 B"))
    layout = f"{gpus} GPU{'s' if gpus > 1 else ''}, actor.backend={a.backend}" + (
        f", FSDP2 shard {shard}" if sharded else "") + (f", sp {sp}" if sp > 1 else "") + (f", tp {tp}" if tp > 1 else "")
    cal = c["source"] if measured else f"not measured for {family}: the coefficients of {c['source']}"
    counts = {"trainable": trainable, "weights_bytes": weight_bytes}
    return Plan(resident, peaks, gpus, layout, cal, notes, counts)


def estimate_config(cfg, gpus: int = 1) -> Plan:
    """`estimate` of a config whose model.path holds the checkpoint."""
    return estimate(cfg, read_inventory(cfg.model.path), gpus)


# ------------------------------------------------------------------------------------------------- what fits
def candidates(cfg, gpus: int) -> list[tuple[list[str], int]]:
    """Single changes in the order a user would try them (cheapest first): (overrides, GPUs)."""
    from ..models import MODELS

    a, out = cfg.actor, []
    per_rank = max(1, cfg.data.prompts_per_step * cfg.rollout.n // max(1, a.num_minibatches))
    micro = int(a.micro_batch_size) or per_rank
    m = micro
    while m > 1:
        m //= 2
        out.append(([f"actor.micro_batch_size={m}"], gpus))
    if a.gradient_checkpointing is not True:
        out.append((["actor.gradient_checkpointing=true"], gpus))
        out.append((["actor.gradient_checkpointing=true", "actor.micro_batch_size=1"], gpus))
    b = int(cfg.rollout.batch_size)
    while b > 1:
        b //= 2
        out.append(([f"rollout.batch_size={b}"], gpus))
    plan = getattr(MODELS.get(cfg.model.name), "parallel_plan", None)
    for n in (2, 4, 8):
        if n <= gpus:
            continue
        out.append((["actor.backend=fsdp2", f"parallel.dp_shard={n}"], n))
        out.append((["actor.backend=fsdp2", f"parallel.dp_shard={n}", "actor.gradient_checkpointing=true",
                     "actor.micro_batch_size=1"], n))
        if plan and all("sequence" in p for p in plan.values()) and cfg.rollout.num_frames:
            out.append((["actor.backend=fsdp2", f"parallel.sp={n}", "model.compile=none",
                         "actor.gradient_checkpointing=true"], n))
    return out


def fits(cfg, inventory: dict[str, Network], budget_gib: float, gpus: int = 1,
         keys: tuple[str, ...] = ("",)) -> tuple[list[str], int, Plan] | None:
    """The first candidate change whose plan fits `budget_gib` per GPU: (overrides, GPUs, its plan), else None.
    `keys`: only changes of keys that start so (a rollout's out-of-memory is not the micro-batch's)."""
    from omegaconf import OmegaConf

    for overrides, n in candidates(cfg, gpus):
        if not all(o.startswith(keys) for o in overrides):
            continue
        changed = OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides))
        plan = estimate(changed, inventory, n)
        if plan.peak_gib <= budget_gib:
            return overrides, n, plan
    return None


def smallest_fix(cfg, budget_gib: float, keys: tuple[str, ...] = ("",)) -> list[str] | None:
    """The overrides of `fits` as the keys an out-of-memory line suggests (trainer/oom.py)."""
    found = fits(cfg, read_inventory(cfg.model.path), budget_gib, keys=keys)
    if found is None:
        return None
    overrides, gpus, _ = found
    return [" ".join(overrides) + (f" (torchrun --nproc-per-node {gpus})" if gpus > 1 else "")]


def launch_warning(cfg) -> str | None:
    """`polyrl train` on a GPU: one warning line when the plan's peak exceeds the device's free memory (with the
    change that fits, where one does); None off CUDA, when it fits, or when the plan cannot be made."""
    import torch

    from ..distributed.dims import world_size_from_env
    from ..perf.memory import free_memory_gib

    device = free_memory_gib() if cfg.trainer.device != "cpu" else None
    if device is None:
        return None
    try:
        inventory = read_inventory(cfg.model.path)
        plan = estimate(cfg, inventory, world_size_from_env())
    except Exception:  # a checkpoint the plan cannot read: the run itself says what is wrong
        return None
    free, _ = device
    if plan.peak_gib <= free:
        return None
    found = fits(cfg, inventory, free, world_size_from_env())
    hint = (f"{' '.join(found[0])} would need about {found[2].peak_gib:.1f} GiB" + (
        f" on each of {found[1]} GPUs (torchrun)" if found[1] > 1 else "") if found else "no single change the plan knows fits")
    return (f"polyrl: warning: the memory plan estimates {plan.peak_gib:.1f} GiB per GPU, more than the {free:.1f} GiB "
            f"free on {torch.cuda.get_device_name()}; {hint} (`polyrl plan` with this run's overrides shows the parts)")

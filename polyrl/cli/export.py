"""`polyrl export checkpoint=DIR out=DIR [--merge] [model.path=BASE]`: a checkpoint as files plain diffusers loads.

Without `--merge` (LoRA checkpoints): `out/pytorch_lora_weights.safetensors`, written by the base pipeline class's
own `save_lora_weights`: keys `<network>.<peft key>` (what polyrl's `adapter_model.safetensors` already holds) and,
in the file's `lora_adapter_metadata`, the adapter's rank, alpha and targets. Without that metadata diffusers
assumes alpha = rank, i.e. a scale of 1 instead of the run's alpha / rank, and applies a different update than the
one trained; the file name is the one `pipe.load_lora_weights(out)` looks for (a checkpoint directory holds
several .safetensors files, of which it would pick one).

With `--merge` (LoRA or full fine-tune): `out/` is a whole pipeline directory: the base pipeline with each
trained network's weights merged in (LoRA: W + (alpha/r)·B·A, by peft's own merge) or replaced (full fine-tune),
in the dtype the run used (`model.dtype`); load it with the line the export prints,
`<PipelineClass>.from_pretrained(out)` plus `<component>=None` for each required component the base lacks (the
shipped toy model has no T5: `text_encoder_3=None, tokenizer_3=None`).

The base model is the run's `model.path` (its config.yaml, two levels above the checkpoint), or `model.path=`.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

from ..errors import UserError

USAGE = "usage: polyrl export checkpoint=<run>/checkpoints/step_N out=DIR [--merge] [model.path=BASE]"


def parse_args(args: list[str]) -> dict:
    opts = {"merge": False}
    for a in args:
        if a in ("--merge", "merge=true"):
            opts["merge"] = True
            continue
        key, sep, value = a.partition("=")
        if not sep or key not in ("checkpoint", "out", "model.path") or not value:
            raise UserError(f"polyrl export: unexpected argument {a!r}; {USAGE}")
        opts[key] = value
    for key in ("checkpoint", "out"):
        if key not in opts:
            raise UserError(f"polyrl export: {key}= is required; {USAGE}")
    return opts


def run_config(ckpt: Path):
    from omegaconf import OmegaConf

    path = ckpt.parent.parent / "config.yaml"
    if not path.is_file():
        raise UserError(f"polyrl export: {path} not found (is {ckpt} inside a polyrl run directory?)")
    return OmegaConf.load(path)


def pipeline_class(model_path: Path):
    import diffusers

    from ..models.diffusers_base import load_model_index

    name = load_model_index(model_path).get("_class_name")
    cls = getattr(diffusers, str(name), None)
    if cls is None:
        raise UserError(f"{model_path}/model_index.json names pipeline class {name!r}, which diffusers "
                        f"{diffusers.__version__} does not have")
    return cls


def lora_metadata(meta: dict) -> dict:
    """The LoRA config diffusers builds the adapter from (peft LoraConfig arguments)."""
    return {"r": int(meta["lora_rank"]), "lora_alpha": float(meta["lora_alpha"]),
            "target_modules": list(meta["lora_targets"])}


def export_lora(ckpt: Path, meta: dict, model_path: Path, out: Path) -> Path:
    """`out/pytorch_lora_weights.safetensors` for `pipe.load_lora_weights(out)` (see the module docstring)."""
    import inspect

    from safetensors.torch import load_file

    from ..actor.local import split_by_network

    if not meta.get("lora"):
        raise UserError(f"{ckpt} holds a full fine-tune, not a LoRA adapter; export it with --merge")
    cls = pipeline_class(model_path)
    params = inspect.signature(cls.save_lora_weights).parameters if hasattr(cls, "save_lora_weights") else {}
    parts = split_by_network(load_file(str(ckpt / "adapter_model.safetensors")), list(meta["networks"]))
    kwargs = {}
    for name, part in parts.items():
        if f"{name}_lora_layers" not in params or f"{name}_lora_adapter_metadata" not in params:
            raise UserError(f"{cls.__name__}.save_lora_weights cannot write a LoRA of {name!r} (with its alpha); "
                            "export with --merge instead")
        kwargs[f"{name}_lora_layers"] = part
        kwargs[f"{name}_lora_adapter_metadata"] = lora_metadata(meta)
    out.mkdir(parents=True, exist_ok=True)
    cls.save_lora_weights(str(out), **kwargs)
    return out / "pytorch_lora_weights.safetensors"


def absent_components(model_path: Path) -> dict[str, None]:
    """Components model_index.json lists as null (e.g. SD3 without T5: text_encoder_3, tokenizer_3), as None."""
    from ..models.diffusers_base import load_model_index

    index = load_model_index(model_path)
    return {k: None for k, v in index.items() if isinstance(v, list) and v[:1] == [None]}


def required_absent(model_path: Path) -> dict[str, None]:
    """The absent components diffusers must be handed as None: those the pipeline class does not mark optional (a
    null optional one, e.g. SD3's image_encoder, loads as None by itself)."""
    optional = set(getattr(pipeline_class(model_path), "_optional_components", []))
    return {k: None for k in absent_components(model_path) if k not in optional}


def load_base_pipeline(model_path: Path, dtype):
    """The base pipeline; components model_index.json lists as null are passed as None, as diffusers asks for
    components a pipeline class does not mark optional."""
    return pipeline_class(model_path).from_pretrained(str(model_path), torch_dtype=dtype, **absent_components(model_path))


def load_line(model_path: Path, out: Path) -> str:
    """The one line that loads a merged export: the pipeline class, the directory and every required component
    the base lacks as `=None` (diffusers cannot be told by model_index.json alone that a required one is absent)."""
    args = [repr(str(out))] + [f"{k}=None" for k in sorted(required_absent(model_path))]
    return f"{pipeline_class(model_path).__name__}.from_pretrained({', '.join(args)})"


def export_merged(ckpt: Path, meta: dict, model_path: Path, out: Path, dtype) -> Path:
    """The base pipeline with the checkpoint's networks merged in, saved to `out` (see the module docstring)."""
    from ..actor.local import load_trained_weights

    pipe = load_base_pipeline(model_path, dtype)
    networks = {}
    for name in meta["networks"]:
        network = getattr(pipe, name, None)
        if network is None:
            raise UserError(f"{ckpt} trains network {name!r}, which the pipeline at {model_path} does not have")
        networks[name] = network
    if meta.get("lora"):  # the DiTs without diffusers' PEFT mixin get it, as the run gave it (models/stable_audio.py)
        from ..models.stable_audio import with_peft

        networks = {k: v if hasattr(v, "add_adapter") else with_peft(v) for k, v in networks.items()}
    holder = SimpleNamespace(modules=lambda: networks)
    load_trained_weights(holder, ckpt)  # exactly how a run builds its trained networks
    if meta.get("lora"):
        for network in networks.values():
            network.fuse_lora()  # peft's merge: W += (alpha / r) · B·A
            network.unload_lora()  # the merged base layers stay
    # the base's absent components stay null in model_index.json, as in the base; marked optional on this instance
    # only, so that save_pretrained skips them instead of warning that None "cannot be saved"
    pipe._optional_components = [*pipe._optional_components, *absent_components(model_path)]
    pipe.save_pretrained(str(out))
    return out


def main(args: list[str]) -> int:
    import torch

    from ..models.diffusers_base import DTYPES
    from ..trainer.checkpoint import read_checkpoint

    if any(a in ("-h", "--help") for a in args):
        print(USAGE + "\n\n" + __doc__)
        return 0
    opts = parse_args(args)
    ckpt, out = Path(opts["checkpoint"]), Path(opts["out"])
    read_checkpoint(ckpt)  # every file checked (sizes, checksums, finite weights) before anything is loaded
    meta = json.loads((ckpt / "weights.json").read_text())
    cfg = run_config(ckpt)
    model_path = Path(opts.get("model.path") or cfg.model.path)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"polyrl export: out={out} exists and is not an empty directory")
    # written beside `out`, renamed into place when complete: an interrupted export leaves no half directory
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        if opts["merge"]:
            export_merged(ckpt, meta, model_path, tmp, DTYPES.get(str(cfg.model.dtype), torch.float32))
            how = load_line(model_path, out)
        else:
            export_lora(ckpt, meta, model_path, tmp)
            how = f"pipe.load_lora_weights({str(out)!r}) on a {pipeline_class(model_path).__name__} of {model_path}"
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"polyrl: exported {ckpt} to {out}; load it with {how}", file=sys.stderr)
    return 0

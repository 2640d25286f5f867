"""Janus-Pro text-to-image generation as a token policy (`model=janus_pro`, docs/tokens.md "Janus-Pro").

`model.path` is a local directory that transformers' `JanusForConditionalGeneration.from_pretrained` and
`AutoTokenizer.from_pretrained` load (the `deepseek-community/Janus-Pro-1B` / `-7B` layout: config.json with a
Llama text config, a SigLIP vision config and a VQ config; the weights; the tokenizer files).

What is sampled. A prompt is put in Janus' generation template (DeepSeek's SFT format with an empty system prompt,
the one Janus' own generation script and transformers' Janus chat template write):

    <BOS><|User|>: {prompt}\\n\\n<|Assistant|>:<begin_of_image>

and the policy draws the image's N = (image_size / patch_size)² VQ codes (576 for Janus-Pro: a 24 × 24 grid, 384 px)
one after another: each code is embedded by the generation embedding + aligner, the language model runs on it,
and the generation head gives logits over the codebook. Janus' classifier-free guidance runs two rows per sample:
the conditional one, and an unconditional one in which every prompt token but BOS and `<begin_of_image>` is the pad
token (the image codes are the same in both rows); with w = `model.options.cfg_weight` (Janus: 5),

    guided = uncond + w · (cond − uncond)          (w = 1: the conditional logits alone, one row per sample)

**The policy trained is the guided distribution the sampler draws from**: π(c_t | prompt, c_<t) = softmax(guided_t
/ T), T = `rollout.temperature`. The rollout stores log π of each drawn code, and the learner's teacher-forced
recompute runs this same `forward` (both rows, the same guidance), so the two agree to float tolerance
(tests/test_janus_pro.py) and the gradient reaches the network through both rows.

Ids. The policy's token space is one id range: ids 0 … K−1 are the image codes (K = the VQ codebook size; they are
the responses, and the logits' columns), and a text token t of the prompt is the id K + t. `forward` embeds each id
by its range, so a `TokenBatch` of prompt ⧺ image codes needs no other marker. `pad_token_id` is K + the tokenizer's
pad id; there is no EOS: a response is the whole image, so `rollout.max_new_tokens` must equal N (an image of another
length cannot be decoded: the rollout stops with an error naming N).

Media. The rollout's `media` is `{"images": (B, 3, H, W) in [0, 1]}`: the codes decoded by Janus' VQ decoder
(pixel values in [−1, 1] mapped by (x + 1) / 2, as Janus' processor does). `media = ("images",)` below tells config
validation which rewards fit (any reward that reads images); the VQ model is frozen and not part of `modules()`.

Trained network. `modules()["model"]` is the `JanusForConditionalGeneration` without the parts image generation
never runs (the understanding encoder and its aligner, the text head) and without the VQ model (kept aside, frozen).
LoRA targets the language model's attention and MLP projections (`q_proj` … `down_proj`; the generation head and
aligner have other names); a full fine-tune (`actor.lora_rank=0`) trains the language model, the text and image
embeddings, the generation aligner and head.

FLOPs (docs/algorithms.md §6) count the language model and the generation head of both CFG rows, as for a causal LM;
the embedding aligner and the VQ decode are not counted.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError
from .base import Cond, Prompt, register_model, text_only
from .causal_lm import CAUSAL_LM_LORA_TARGETS, DTYPES, decoder_forward_flops
from .options import read_options

BOI_TOKEN = "<begin_of_image>"  # Janus' image start tag: the last prompt token, kept in the unconditional row


def janus_prompt(text: str) -> str:
    """Janus' text-to-image template around a prompt (BOS comes from the tokenizer)."""
    return f"<|User|>: {text}\n\n<|Assistant|>:{BOI_TOKEN}"


def guided_logits(cond: torch.Tensor, uncond: torch.Tensor, weight: float) -> torch.Tensor:
    """Janus' classifier-free guidance on logits: uncond + w · (cond − uncond)."""
    return uncond + weight * (cond - uncond)


@register_model("janus_pro")
class JanusProPolicy:
    policy_kind = "tokens"
    media = ("images",)  # what a rollout decodes its tokens into (config validation pairs the reward with it)
    default_lora_targets = CAUSAL_LM_LORA_TARGETS
    # `model.options` keys and defaults (config validation refuses other keys): Janus' CFG weight
    options = {"cfg_weight": 5.0}

    def __init__(self, cfg, device: torch.device):
        from transformers import AutoTokenizer, JanusForConditionalGeneration

        path = Path(cfg.path)
        if not (path / "config.json").is_file():
            raise UserError(f"model.path={str(path)!r} is not a transformers model directory (no config.json)")
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
        if model_type != "janus":
            raise UserError(f"model.path={str(path)!r} holds a {model_type!r} model, not Janus (model_type 'janus')")
        self.opts = read_options(self.options, dict(getattr(cfg, "options", None) or {}))
        self.cfg_weight = float(self.opts["cfg_weight"])
        if self.cfg_weight < 1:
            raise UserError(f"model.options.cfg_weight={self.cfg_weight:g} must be >= 1 (1: no guidance)")
        self.device, self.dtype = device, DTYPES[cfg.dtype]
        self.tokenizer = tok = AutoTokenizer.from_pretrained(str(path))
        network = JanusForConditionalGeneration.from_pretrained(str(path), dtype=self.dtype)
        # kept aside, frozen: the VQ model decodes codes into images
        self.vq = network.model.vqmodel.to(device).eval().requires_grad_(False)
        # image generation never runs the understanding encoder, its aligner or the text head
        for owner, name in ((network.model, "vision_model"), (network.model, "aligner"), (network.model, "vqmodel"),
                            (network, "lm_head")):
            delattr(owner, name)
        self.network = network.to(device).eval().requires_grad_(False)
        self.networks = {"model": self.network}
        self.codebook = int(network.config.vq_config.num_embeddings)  # K: ids below it are image codes
        self.image_tokens = int(network.config.vq_config.num_patches) ** 2  # N codes per image
        bos = tok.bos_token_id
        boi = tok.convert_tokens_to_ids(getattr(tok, "boi_token", None) or BOI_TOKEN)
        if bos is None or tok.pad_token_id is None or boi is None or boi == tok.unk_token_id:
            raise UserError(f"model.path={str(path)!r}: the tokenizer needs a BOS token, a pad token and {BOI_TOKEN} "
                            "(Janus' image start tag)")
        self.bos_id, self.boi_id, self.text_pad_id = int(bos), int(boi), int(tok.pad_token_id)
        self.pad_token_id = self.codebook + self.text_pad_id
        self.eos_token_ids: list[int] = []  # a response is the whole image: N codes
        self.max_prompt_tokens = int(cfg.max_sequence_length)
        params = inspect.signature(self.network.model.language_model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._prompt_ids: dict[str, list[int]] = {}
        self.flops = 0.0
        c = network.config.text_config
        lm = self.network.model.language_model
        self._body_params = sum(m.weight.numel() for m in lm.modules() if isinstance(m, torch.nn.Linear))
        self._head_params = sum(m.weight.numel() for m in self.network.model.generation_head.modules()
                                if isinstance(m, torch.nn.Linear))
        self._layers = c.num_hidden_layers
        self._attn_width = c.num_attention_heads * (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)

    def modules(self) -> dict[str, torch.nn.Module]:
        return self.networks

    # ------------------------------------------------------------------------------------------- prompts
    def encode_prompts(self, prompts: list[Prompt]) -> tuple[list[list[int]], Cond]:
        out = []
        for text in text_only(prompts, "model=janus_pro"):
            if text not in self._prompt_ids:
                ids = list(self.tokenizer(janus_prompt(text)).input_ids)
                if not ids or ids[0] != self.bos_id:  # a tokenizer that does not add BOS itself
                    ids = [self.bos_id, *ids]
                if len(ids) > self.max_prompt_tokens:
                    raise UserError(f"a prompt has {len(ids)} tokens, more than model.max_sequence_length="
                                    f"{self.max_prompt_tokens} ({text[:60]!r}...); raise model.max_sequence_length")
                self._prompt_ids[text] = [self.codebook + i for i in ids]
            out.append(self._prompt_ids[text])
        return out, {}

    def encode_responses(self, texts: list[str]) -> list[list[int]]:
        raise UserError("model=janus_pro generates images: offline text pairs (data.pairs_path) do not apply; "
                        "algorithm=dpo pairs its own samples when data.pairs_path is unset")

    def decode(self, ids: list[list[int]]) -> list[str]:
        """Image codes have no text: a placeholder per response (the images are `decode_media`'s)."""
        return [f"<{len(row)} image tokens>" for row in ids]

    @torch.no_grad()
    def decode_media(self, tokens) -> dict[str, torch.Tensor]:
        """A chunk's responses (a `TokenBatch`) -> {"images": (B, 3, H, W) float in [0, 1], on the CPU}."""
        lengths = tokens.response_mask.sum(1)
        if tokens.response_ids.shape[1] != self.image_tokens or bool((lengths != self.image_tokens).any()):
            raise UserError(f"rollout.max_new_tokens={tokens.response_ids.shape[1]}, but model=janus_pro draws "
                            f"{self.image_tokens} image tokens per image (this checkpoint's (image_size / "
                            f"patch_size)²): set rollout.max_new_tokens={self.image_tokens}")
        codes = tokens.response_ids.to(self.device)
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype.itemsize < 4):
            pixels = self.vq.decode(codes)
        return {"images": ((pixels.float() + 1) / 2).clamp(0, 1).cpu()}

    # ------------------------------------------------------------------------------------------- network
    def unconditional(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The unconditional row of each sequence: every text token but BOS and <begin_of_image> becomes pad."""
        k = self.codebook
        text = input_ids >= k
        keep = (input_ids == k + self.bos_id) | (input_ids == k + self.boi_id)
        return torch.where(text & ~keep, torch.full_like(input_ids, self.pad_token_id), input_ids)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Text ids (≥ K) through the language model's embedding, image codes (< K) through the generation
        embedding and aligner."""
        net, k = self.networks["model"], self.codebook  # the live entry: the actor may swap in another policy
        text = input_ids >= k
        text_embeds = net.model.language_model.get_input_embeddings()(torch.where(text, input_ids - k, 0))
        image_embeds = net.model.generation_aligner(net.model.generation_embeddings(torch.where(text, 0, input_ids)))
        return torch.where(text.unsqueeze(-1), text_embeds, image_embeds.to(text_embeds.dtype))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cond: Cond | None = None,
                cache: Any = None, keep: int = 0, use_cache: bool = False) -> tuple[torch.Tensor, Any]:
        """Guided logits (B, keep or T, K) float32 over the image codebook; the cache holds both CFG rows."""
        b, t = input_ids.shape
        guided = self.cfg_weight != 1.0
        if guided:  # rows 0..B−1 conditional, B..2B−1 unconditional
            input_ids = torch.cat([input_ids, self.unconditional(input_ids)])
            attention_mask = torch.cat([attention_mask, attention_mask])
        rows = input_ids.shape[0]
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -t:]
        kept = keep or t
        self.flops += rows * decoder_forward_flops(self._body_params, self._head_params, self._layers,
                                                   self._attn_width, t, kept, attention_mask.shape[1]) * (
            3 if torch.is_grad_enabled() else 1)
        net = self.networks["model"]
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype.itemsize < 4):
            out = net.model.language_model(inputs_embeds=self.embed(input_ids), attention_mask=attention_mask,
                                           position_ids=position_ids, use_cache=use_cache, **{self._cache_arg: cache})
            logits = net.model.generation_head(out.last_hidden_state[:, -kept:]).float()
        if guided:
            logits = guided_logits(logits[:b], logits[b:], self.cfg_weight)
        new_cache = getattr(out, "cache", None) if self._cache_arg == "cache" else getattr(out, "past_key_values", None)
        return logits, new_cache

"""`hpsv3`: an HPSv3-style preference model, a VLM backbone plus a scalar reward head.

What it does: one chat turn [image, `template` with the prompt] through a local VLM
(`AutoModelForImageTextToText`, e.g. the Qwen2-VL-7B backbone of HPSv3), the last layer's hidden state at the
last token (left padding, so position -1), then an MLP head (`polyrl.rewards.heads` format; HPSv3's head is
hidden -> 1024 -> 16 -> 2 with ReLU, stored under `rm_head.0`, `rm_head.3`, `rm_head.5`, so `head_path` may
be the checkpoint shard that holds them and `prefix` "rm_head."). A 2-output head is read as HPSv3's
(mu, sigma) of its uncertainty-aware ranking loss: the score is mu, the second output is logged raw as
`hpsv3/second_output`.

Faithful: backbone class and weights, head layout and activation, score = mu from a token's last hidden
state. Not faithful (so scores of a real HPSv3 checkpoint will differ from its reference code): the
instruction text (HPSv3's own is not copied here; pass yours as `template`), HPSv3's special reward token
(we read the last token of the prompt instead), and its image resizing limits (we use the processor's).
"""

from __future__ import annotations

import torch

from .base import RewardOutput, check_batch, register_reward
from .heads import load_mlp_head
from .vlm_judge import LocalVLM

DEFAULT_TEMPLATE = "Judge how well this image matches the prompt and how good it looks. Prompt: {prompt}"


@register_reward("hpsv3")
class HPSv3Style:
    """Score = head(last hidden state at the last token)[0] (module docstring)."""

    def __init__(self, path: str, head_path: str, template: str = DEFAULT_TEMPLATE, prefix: str = "rm_head.",
                 activation: str = "relu", device: str = "auto", dtype: str = "float32"):
        if "{prompt}" not in template:
            raise ValueError("hpsv3: template must contain {prompt}")
        self.template = template
        self.vlm = LocalVLM(path, device, dtype)
        self.head = load_mlp_head(head_path, prefix, activation).to(self.vlm.device)
        if self.head.out_features not in (1, 2):
            raise ValueError(f"hpsv3 head {head_path!r} outputs {self.head.out_features} values, need 1 or 2 (mu, sigma)")

    @torch.no_grad()
    def __call__(self, images, prompts, metadata=None) -> RewardOutput:
        check_batch("hpsv3", images.shape[0], prompts, metadata)
        batch = self.vlm.inputs(images, [self.template.replace("{prompt}", p) for p in prompts])
        hidden = self.vlm.model(**batch, output_hidden_states=True).hidden_states[-1][:, -1].float()
        if hidden.shape[1] != self.head.in_features:
            raise ValueError(f"hpsv3 head takes {self.head.in_features}-d states, the backbone gives {hidden.shape[1]}")
        out = self.head.float()(hidden)
        extras = {"hpsv3/second_output": out[:, 1].cpu().tolist()} if out.shape[1] == 2 else {}
        return RewardOutput(out[:, 0].cpu(), extras)

"""The training loops of the toy models (`polyrl pretrain-toy`): the two phases of every toy diffusion model
(shapes.py, motion.py, text.py; only the data and the model call differ between them) and the supervised training of
the toy LMs (count.py, rewrite.py)."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ...models.sd3 import encode_sd3_prompts


def train_vae(vae, next_batch, steps: int, lr: float = 2e-3, recon_loss=F.mse_loss,
              progress: bool = True) -> list[float]:
    """Phase 1, VAE reconstruction: Adam(lr) on recon_loss(D(z), x) + 1e-6·KL(q(z|x) ‖ N(0, I)), z ~ q(z|x), x =
    `next_batch()` (the tiny KL weight: the latents only need to be smooth enough to diffuse). The VAE is left in
    eval mode without gradients; returns the losses."""
    vae.train()
    opt = torch.optim.Adam(vae.parameters(), lr=lr)
    losses: list[float] = []
    for _ in (bar := tqdm(range(steps), desc="vae", disable=not progress)):
        x = next_batch()
        post = vae.encode(x).latent_dist
        loss = recon_loss(vae.decode(post.sample()).sample, x) + 1e-6 * post.kl().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        bar.set_postfix(mse=f"{loss.item():.4f}")
    vae.eval().requires_grad_(False)
    return losses


def train_flow(modules: list, lat: torch.Tensor, prompts: list[str], encode, velocity, steps: int, batch: int,
               lr: float, rng: random.Random, progress: bool = True) -> list[float]:
    """Phase 2, rectified flow on the normalised latents `lat` (N, ...) with their `prompts`: per step a batch of
    x0, 10% of its prompts replaced by "" (so CFG works), σ = sigmoid(n), n ~ N(0, 1), x_σ = (1 − σ)·x0 + σ·ε,
    loss = mean (v − (ε − x0))² with v = velocity(x_σ, σ·1000, encode(prompts)); AdamW(lr, weight decay 0.01) on
    the `modules`' parameters, a 200-step linear warm-up then a linear decay to 10% at `steps`, gradient norm
    clipped to 1. The modules are left in eval mode; returns the losses."""
    for m in modules:
        m.train()
    params = [p for m in modules for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 200) * max(0.1, 1 - i / steps))
    losses: list[float] = []
    for _ in (bar := tqdm(range(steps), desc="flow", disable=not progress)):
        idx = torch.randint(0, len(lat), (batch,))
        x0 = lat[idx.to(lat.device)]
        cond = encode(["" if rng.random() < 0.1 else prompts[i] for i in idx.tolist()])
        sigma = torch.sigmoid(torch.randn(batch, device=x0.device))
        noise = torch.randn_like(x0)
        s = sigma.view(-1, *[1] * (x0.dim() - 1))
        loss = F.mse_loss(velocity((1 - s) * x0 + s * noise, sigma * 1000, cond), noise - x0)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.4f}")
    for m in modules:
        m.eval()
    return losses


def sd3_flow_calls(pipe):
    """(encode, velocity) of `train_flow` for an SD3-layout pipeline with only its first (CLIP) text encoder."""
    tr = pipe.transformer
    encoders, tokenizers = [pipe.text_encoder, None, None], [pipe.tokenizer, None, None]

    def encode(prompts):
        return encode_sd3_prompts(encoders, tokenizers, prompts, tr.config, 0)

    def velocity(x, timestep, cond):
        return tr(x, cond["prompt_embeds"], cond["pooled"], timestep, return_dict=False)[0]

    return encode, velocity


def sft_step(model, opt, sched, ids: torch.Tensor, mask: torch.Tensor, loss_mask: torch.Tensor) -> float:
    """One supervised step of a causal LM: the mean next-token cross-entropy over the tokens `loss_mask` marks (the
    answer, not the prompt), gradients clipped to norm 1, then the optimizer and scheduler step; returns the loss."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    nll = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    target = loss_mask[:, 1:].float()
    loss = (nll * target).sum() / target.sum()
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return loss.item()


def train_sft(model, next_batch, steps: int, lr: float, schedule, desc: str, progress: bool = True) -> list[float]:
    """The toy LMs' supervised training: AdamW(lr, weight decay 0.01) on the model's parameters with the learning
    rate scaled by `schedule(i)` at step i; per step `sft_step` on `next_batch()` = (ids, attention mask, loss mask)
    on the model's device. Returns the losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    losses: list[float] = []
    for _ in (bar := tqdm(range(steps), desc=desc, disable=not progress)):
        losses.append(sft_step(model, opt, sched, *next_batch()))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    return losses


def sft_batch(prompts: list[list[int]], answers: list[list[int]], pad_id: int):
    """(ids, attention mask, loss mask), right-padded rows of prompt tokens then answer tokens; the loss mask marks
    the answer's tokens (for `sft_step`)."""
    rows = [p + a for p, a in zip(prompts, answers, strict=True)]
    ids = torch.full((len(rows), max(len(r) for r in rows)), pad_id, dtype=torch.long)
    mask, loss_mask = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (p, a) in enumerate(zip(prompts, answers, strict=True)):
        ids[i, : len(p) + len(a)] = torch.tensor(p + a)
        mask[i, : len(p) + len(a)] = 1
        loss_mask[i, len(p) : len(p) + len(a)] = 1
    return ids, mask, loss_mask

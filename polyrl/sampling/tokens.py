"""The rollout stage of a token policy: batched autoregressive sampling with a KV cache, per-token log-probs
stored from the rollout (docs/tokens.md, docs/algorithms.md §5).

The policy is π(y_t | x, y_<t) = softmax(logits_t / T) with T = `rollout.temperature`; the stored log-prob of a
sampled token is log π of that token (top-p only narrows what is drawn, it does not change π: the learner's
recompute uses the same π, so the first update's ratio is 1 up to kernel differences).

Randomness is drawn up front, like the diffusion rollout's noise: one uniform u ~ U[0, 1) per (sample, response
position) for the whole global batch from the step's generator, and a token is drawn by inverting the CDF of the
(top-p truncated) distribution at u. The draws therefore depend neither on `rollout.batch_size` nor on the rank
that samples a row, and a resumed run draws what an uninterrupted one would.

A response ends at an EOS token of the model or when its text contains one of `rollout.stop` (the token that
completes the stop string is the last one kept), else after `rollout.max_new_tokens` tokens. Every stored tensor
is padded to `max_new_tokens` columns, so rollouts of any length concatenate (the actor trims the padding).

A speaking policy (`speech_tokens` > 0: model=qwen3_omni_speech) then says each text (`speak`): its codes follow the
text in the same response, drawn from `speech_tokens` more uniform columns per sample, and the tensors are
`max_new_tokens + speech_tokens` wide.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch

from ..batch import Rollout, TokenBatch
from ..latents import at_least_float32
from ..media import Audio
from ..models.base import Prompt, TokenPolicy, token_media
from .base import SAMPLERS, step_generator
from .diffusion import MediaChunk


@dataclass
class TokenPlan:
    """What a token rollout samples. `temperature` 0 means greedy decoding (the held-out evaluation)."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    batch_size: int = 64  # sequences per network call (memory bound)

    @property
    def log_prob_temperature(self) -> float:
        """T of π = softmax(logits / T); greedy decoding scores with T = 1."""
        return self.temperature if self.temperature > 0 else 1.0


def draw_uniforms(num_samples: int, plan: TokenPlan, generator: torch.Generator, extra: int = 0) -> torch.Tensor:
    """(B, max_new_tokens + extra) float64 uniforms in [0, 1): one per (sample, position), drawn sample-major.
    `extra`: the columns of a second stream the policy decodes after the text (`speech_tokens`)."""
    return torch.rand((num_samples, plan.max_new_tokens + extra), generator=generator, dtype=torch.float64)


def extra_tokens(adapter) -> int:
    """The response columns a policy decodes after its text (a speaking policy's speech codes: `speech_tokens`;
    0 for a one-stream policy)."""
    return int(getattr(adapter, "speech_tokens", 0))


def token_log_probs(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log π(ids) with π = softmax(logits / T) (§5), in float32: `logits` (..., V), `ids` (...) -> (...)."""
    logp = torch.log_softmax(at_least_float32(logits) / temperature, dim=-1)
    return logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def top_p_mask(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The nucleus: the fewest most likely tokens whose mass reaches `top_p` (the token that crosses it included;
    always at least the most likely one). `probs` (B, V) -> bool (B, V)."""
    if top_p >= 1.0:
        return torch.ones_like(probs, dtype=torch.bool)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p  # mass of the more likely tokens
    keep_sorted = before < top_p
    keep_sorted[:, 0] = True
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def inverse_cdf_sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token whose CDF interval holds u·total (B, V) × (B,) -> (B,) long; a zero-probability token is never
    picked (its interval is empty)."""
    cdf = probs.double().cumsum(-1)
    target = (u.double() * cdf[:, -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return idx.clamp(max=probs.shape[-1] - 1)


def sample_next(logits: torch.Tensor, u: torch.Tensor, plan: TokenPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """(next token (B,), its log π (B,)) from the last position's logits (B, V) and uniforms (B,)."""
    logp = torch.log_softmax(at_least_float32(logits) / plan.log_prob_temperature, dim=-1)
    if plan.temperature <= 0:
        token = logits.argmax(-1)
    else:
        probs = logp.double().exp()
        probs = probs * top_p_mask(probs, plan.top_p)
        token = inverse_cdf_sample(probs, u)
    return token, logp.gather(-1, token.unsqueeze(-1)).squeeze(-1)


def pad_left(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded (ids, mask), both (B, max length) long."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s):] = 1
    return ids, mask


def pad_right(seqs: list[list[int]], pad_id: int, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (ids, mask), both (B, width) long (width: the longest sequence when None)."""
    width = width if width is not None else max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


ENDED_CHECK_EVERY = 16  # decoding steps between the GPU's "has every row ended?" checks (a few wasted steps at most)


class StopStrings:
    """Whether a response's text has just completed one of the stop strings: only the last few tokens are decoded
    each step (a stop string of n characters fits in its last n + 2 tokens: each token decodes to at least one
    character, the 2 cover a multi-byte character split over tokens)."""

    def __init__(self, adapter: TokenPolicy, stop: tuple[str, ...]):
        self.adapter, self.stop = adapter, tuple(s for s in stop if s)
        self.window = max((len(s) for s in self.stop), default=0) + 2

    def hit(self, response: list[int]) -> bool:
        if not self.stop:
            return False
        tail = self.adapter.decode([response[-self.window:]])[0]
        return any(s in tail for s in self.stop)


class CachedDecoding:
    """Decoding through the policy's own `forward` and the cache it returns (any cache type): the attention mask
    grows by one column per step. What a policy without a `decoding` method of its own samples with."""

    def __init__(self, adapter: TokenPolicy):
        self.adapter = adapter

    def prefill(self, prompt: torch.Tensor, mask: torch.Tensor, cond: dict) -> torch.Tensor:
        logits, self.cache = self.adapter.forward(prompt, mask, cond, None, keep=1, use_cache=True)
        self.mask = mask
        return logits[:, -1]

    def step(self, token: torch.Tensor) -> torch.Tensor:
        # the new column is 1 for every row: a row that has ended keeps decoding padding nobody reads
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], 1)
        logits, self.cache = self.adapter.forward(token.unsqueeze(1), self.mask, None, self.cache, keep=1,
                                                  use_cache=True)
        return logits[:, -1]


def decoding_for(adapter: TokenPolicy, batch: int, prompt_width: int, max_new_tokens: int):
    """The policy's own decoder for this chunk shape when it has one (`TokenPolicy.decoding`, e.g. a static KV
    cache replayed as a CUDA graph), else `CachedDecoding`. Both give the same logits up to kernel differences."""
    own = getattr(adapter, "decoding", None)
    decoding = own(batch, prompt_width, max_new_tokens) if own is not None else None
    return decoding if decoding is not None else CachedDecoding(adapter)


@torch.no_grad()
def sample_tokens(adapter: TokenPolicy, prompt_ids: list[list[int]], cond: dict, plan: TokenPlan,
                  uniforms: torch.Tensor) -> tuple[TokenBatch, torch.Tensor]:
    """Sample one chunk: (tokens with responses padded to max_new_tokens, log π of each response token (B, R)
    float32, 0 on padding). One prefill, then one cached forward per new token; stops when every row ended.
    A speaking policy (`speech_decoding`) then says each text: `speak`.

    Everything stays on the device until the chunk ends: on a GPU the host asks whether every row has ended only
    every `ENDED_CHECK_EVERY` steps (each question waits for the GPU), so the steps queue back to back."""
    device, pad = adapter.device, adapter.pad_token_id
    prompt, prompt_mask = pad_left(prompt_ids, pad)
    b, r = len(prompt_ids), plan.max_new_tokens
    stops = StopStrings(adapter, tuple(plan.stop))
    uniforms = uniforms.to(device)
    decoding = decoding_for(adapter, b, prompt.shape[1], r)
    logits = decoding.prefill(prompt.to(device), prompt_mask.to(device), {k: v.to(device) for k, v in cond.items()})
    response, response_mask, log_probs = decode_loop(decoding, logits, uniforms[:, :r], plan, adapter.eos_token_ids,
                                                     pad, stops)
    tokens = TokenBatch(prompt, prompt_mask, response.cpu(), response_mask.cpu(), pad)
    if extra_tokens(adapter):
        return speak(adapter, tokens, log_probs.cpu(), cond, plan, uniforms[:, r:])
    return tokens, log_probs.cpu()


def decode_loop(decoding, logits: torch.Tensor, uniforms: torch.Tensor, plan: TokenPlan, eos_ids: list[int], pad: int,
                stops: StopStrings | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw up to `uniforms.shape[1]` tokens from `logits` (the prefill's) and `decoding.step`: (tokens, mask, log π)
    each (B, R) on the device; a row ends at a token of `eos_ids` or a stop string."""
    b, r = uniforms.shape
    device = logits.device
    eos = torch.tensor(eos_ids, dtype=torch.long, device=device)
    stops = stops if stops is not None and stops.stop else None
    check_every = 1 if (device.type == "cpu" or stops) else ENDED_CHECK_EVERY
    response = torch.full((b, r), pad, dtype=torch.long, device=device)
    response_mask = torch.zeros((b, r), dtype=torch.long, device=device)
    log_probs = torch.zeros((b, r), dtype=torch.float32, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    for t in range(r):
        token, lp = sample_next(logits, uniforms[:, t], plan)
        alive = ~done
        token = torch.where(alive, token, torch.full_like(token, pad))
        response[:, t] = token
        response_mask[:, t] = alive.long()
        log_probs[:, t] = torch.where(alive, lp, torch.zeros_like(lp))
        done = done | torch.isin(token, eos)
        if stops:
            for i in torch.nonzero(alive & ~done).flatten().tolist():
                if stops.hit(response[i, : t + 1].tolist()):
                    done[i] = True
        if t == r - 1 or ((t + 1) % check_every == 0 and bool(done.all())):
            break
        logits = decoding.step(token)
    return response, response_mask, log_probs


def speak(adapter, text: TokenBatch, text_log_probs: torch.Tensor, cond: dict, plan: TokenPlan,
          uniforms: torch.Tensor) -> tuple[TokenBatch, torch.Tensor]:
    """The second stream of a speaking policy (Qwen3-Omni's talker, models/qwen3_omni_speech.py): its
    `speech_decoding(text, cond)` gives the codes' logits frame by frame, drawn as the text's were (π = softmax(logits
    / T), column j of `uniforms` for speech token j: (B, speech_tokens)) until the codec EOS or `speech_tokens`
    codes. Each response is its text, then its codes as ids `speech_offset` + code, one contiguous run (B, R +
    speech_tokens) with the log-probs beside it."""
    device = adapter.device
    decoding = adapter.speech_decoding(text, {k: v.to(device) for k, v in cond.items()})
    codes, code_mask, code_lp = decode_loop(decoding, decoding.prefill(), uniforms.to(device), plan,
                                            adapter.speech_eos_ids, 0)
    codes, code_mask, code_lp = codes.cpu(), code_mask.cpu(), code_lp.cpu()
    b, r, s = len(text), text.response_ids.shape[1], codes.shape[1]
    response = torch.full((b, r + s), text.pad_id, dtype=torch.long)
    mask = torch.zeros((b, r + s), dtype=torch.long)
    log_probs = torch.zeros((b, r + s), dtype=torch.float32)
    for i in range(b):
        n, m = int(text.response_mask[i].sum()), int(code_mask[i].sum())
        response[i, :n], log_probs[i, :n] = text.response_ids[i, :n], text_log_probs[i, :n]
        response[i, n: n + m] = codes[i, :m] + adapter.speech_offset
        log_probs[i, n: n + m] = code_lp[i, :m]
        mask[i, : n + m] = 1
    return TokenBatch(text.prompt_ids, text.prompt_mask, response, mask, text.pad_id), log_probs


def response_texts(adapter: TokenPolicy, tokens: TokenBatch) -> list[str]:
    """Each response's text: its kept tokens decoded, special tokens (EOS) skipped."""
    ids = [row[: int(n)].tolist() for row, n in zip(tokens.response_ids, tokens.response_mask.sum(1), strict=True)]
    return adapter.decode(ids)


def chunk_media(adapter: TokenPolicy, tokens: TokenBatch) -> dict:
    """A sampled chunk's media, the kinds the policy declares (`models.base.token_media`): the responses' texts for
    "text", the policy's `decode_media(tokens)` for any other kind (Janus-Pro: {"images": ...})."""
    kinds = token_media(adapter)
    media = {"text": response_texts(adapter, tokens)} if "text" in kinds else {}
    if set(kinds) - {"text"}:
        media.update(adapter.decode_media(tokens))
    return media


def _cat_chunks(parts: list[dict]) -> dict:
    """The chunks' media in order: lists (texts) joined, `Audio` (model=qwen3_tts's speech) and tensors concatenated."""
    def cat(values: list):
        if isinstance(values[0], list):
            return [x for v in values for x in v]
        return Audio.cat(values) if isinstance(values[0], Audio) else torch.cat(values)

    return {k: cat([p[k] for p in parts]) for k in parts[0]}


def token_rollout(adapter: TokenPolicy, prompts: list[Prompt], metadata: list[dict], group_ids: torch.Tensor,
                  plan: TokenPlan, uniforms: torch.Tensor, sink=None, times: dict | None = None) -> Rollout:
    """Sample len(prompts) responses in chunks of `plan.batch_size`; each chunk's media go to `sink.put(MediaChunk)`
    as soon as it is sampled (the reward stage may score it while the next chunk samples). `uniforms` (B, R) are
    this batch's rows of `draw_uniforms`. Returns the batch: `tokens`, per-token `log_probs`, `media` ({"text"} for
    a text policy, the decoded kinds for one that declares others: `chunk_media`)."""
    prompt_ids, cond = adapter.encode_prompts(prompts)
    b = len(prompts)
    parts, media = [], []
    for i in range(0, b, plan.batch_size):
        sl = slice(i, min(b, i + plan.batch_size))
        tokens, log_probs = sample_tokens(adapter, prompt_ids[sl], {k: v[sl] for k, v in cond.items()}, plan,
                                          uniforms[sl])
        parts.append((tokens, log_probs))
        media.append(chunk_media(adapter, tokens))
        if sink is not None:
            sink.put(MediaChunk(sl, {}, media[-1]))
    tokens = TokenBatch.cat([p[0] for p in parts])
    return Rollout(
        prompts=list(prompts), metadata=list(metadata), group_ids=group_ids, cond={k: v.cpu() for k, v in cond.items()},
        shared={}, latents={}, log_probs=torch.cat([p[1] for p in parts]), sigmas=torch.zeros(b, 0),
        noise_levels=torch.zeros(b, 0), final={}, media=_cat_chunks(media), tokens=tokens,
    )


def response_token_log_probs(adapter: TokenPolicy, tokens: TokenBatch, cond: dict, temperature: float) -> torch.Tensor:
    """Teacher-forced log π of every response token (B, R) (0 on padding), in one forward of prompt ⧺ response:
    the logits at sequence position P − 1 + t score response token t. Differentiable (the learner's recompute)."""
    device = adapter.device
    p, r = tokens.prompt_ids.shape[1], tokens.response_ids.shape[1]
    if r == 0:  # no response token (an empty micro-batch: a rank may hold no sample of a mini-batch)
        return torch.zeros((len(tokens), 0), device=device, requires_grad=torch.is_grad_enabled())
    own = getattr(adapter, "teacher_forced_log_probs", None)  # a policy of two streams scores each with its network
    if own is not None:
        lp = own(tokens.to(device), {k: v.to(device) for k, v in cond.items()}, temperature)
        return lp * tokens.response_mask.to(device)
    ids = tokens.input_ids[:, : p + r - 1].to(device)
    mask = tokens.attention_mask[:, : p + r - 1].to(device)
    logits, _ = adapter.forward(ids, mask, {k: v.to(device) for k, v in cond.items()}, None, keep=r)
    lp = token_log_probs(logits, tokens.response_ids.to(device), temperature)
    return lp * tokens.response_mask.to(device)


def token_plan_from_config(r) -> TokenPlan:
    """The `rollout.*` keys of a run's config as a TokenPlan."""
    return TokenPlan(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, stop=tuple(r.stop),
                     batch_size=r.batch_size)


def response_metrics(batches: list[Rollout], engine, max_new_tokens: int, adapter=None) -> dict[str, float]:
    """Mean / max response length of every sample this step, and the share cut at max_new_tokens without ending.
    A speaking policy's (`speech_offset`): the text's, and its speech codes' (`speech_length/*`, cut at
    `speech_tokens`)."""
    offset, extra = getattr(adapter, "speech_offset", None), extra_tokens(adapter)
    masks = [b.tokens.response_mask.bool() for b in batches]
    speech = [b.tokens.response_ids >= offset if offset is not None else torch.zeros_like(m)
              for b, m in zip(batches, masks, strict=True)]
    lengths = engine.gather(torch.cat([(m & ~s).sum(1).float() for m, s in zip(masks, speech, strict=True)]))
    out = {"response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
           "response_length/clip_ratio": float((lengths >= max_new_tokens).float().mean())}
    if extra:
        codes = engine.gather(torch.cat([(m & s).sum(1).float() for m, s in zip(masks, speech, strict=True)]))
        out.update({"speech_length/mean": float(codes.mean()), "speech_length/max": float(codes.max()),
                    "speech_length/clip_ratio": float((codes >= extra).float().mean())})
    return out


@SAMPLERS.register("tokens")
class TokenSampler:
    """The training step's rollout stage for a token policy (sampling/base.py `PolicySampler`): responses with
    per-token log-probs from uniforms drawn up front for the whole step (one generator per step: a refill continues
    it). The held-out evaluation decodes greedily."""

    fp8_auto = False  # model.fp8=auto is measured on diffusion transformers only: off unless asked for
    runs_on_replicas = False  # no Ray rollout replica samples tokens yet

    @staticmethod
    def plan_from_config(cfg, micro_batch: int, say) -> TokenPlan:
        return token_plan_from_config(cfg.rollout)

    def __init__(self, adapter: TokenPolicy, plan: TokenPlan, seed: int, reads_media: bool = True):
        self.adapter, self.plan, self.seed = adapter, plan, seed
        self.policy = nullcontext  # the actor's sampling policy (the trainer sets it)
        self.generator: torch.Generator | None = None
        self.fps = 16.0  # of sample videos (a token policy decodes none today)

    def draws(self, group_ids: torch.Tensor, mine: slice, step: int, attempt: int) -> torch.Tensor:
        if attempt == 0:
            self.generator = step_generator(self.seed, step)
        # the whole step's draws, then ours
        return draw_uniforms(len(group_ids), self.plan, self.generator, extra_tokens(self.adapter))[mine]

    def rollout(self, prompts: list, metadata: list[dict], group_ids: torch.Tensor, draws: torch.Tensor, sink,
                timer) -> Rollout:
        with timer("rollout"), self.policy():
            return token_rollout(self.adapter, prompts, metadata, group_ids, self.plan, draws, sink=sink)

    def prepare_next(self, step: int, group_ids: torch.Tensor, mine: slice, max_steps: int, peek) -> None:
        pass

    @torch.no_grad()
    def evaluate(self, prompts: list, metadata: list[dict], seed: int) -> Rollout:
        """Greedy decoding (the same responses for the same weights)."""
        greedy = replace(self.plan, temperature=0.0, top_p=1.0)
        uniforms = torch.zeros((len(prompts), greedy.max_new_tokens + extra_tokens(self.adapter)), dtype=torch.float64)
        return token_rollout(self.adapter, list(prompts), list(metadata), torch.arange(len(prompts)), greedy, uniforms)

    def metrics(self, batches: list[Rollout], engine) -> dict[str, float]:
        return response_metrics(batches, engine, self.plan.max_new_tokens, self.adapter)

    def close(self) -> None:
        pass

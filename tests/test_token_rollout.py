"""Token rollout (sampling/tokens.py) on a tiny Qwen3 with an offline byte-level tokenizer: stored log-probs equal a
teacher-forced recompute, sampling is the inverse CDF of the top-p distribution, responses stop where they should,
and the prompt goes through the chat template when the tokenizer has one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from polyrl.batch import Rollout, TokenBatch
from polyrl.errors import UserError
from polyrl.models.causal_lm import CausalLMPolicy, StaticCacheDecoding
from polyrl.sampling.tokens import (
    CachedDecoding,
    TokenPlan,
    draw_uniforms,
    inverse_cdf_sample,
    response_token_log_probs,
    token_rollout,
    top_p_mask,
)

PROMPTS = ["hi", "what is two plus two? answer briefly", "x", "count the circles"]


def load(path, max_len=128):
    return CausalLMPolicy(SimpleNamespace(path=str(path), dtype="float32", max_sequence_length=max_len),
                          torch.device("cpu"))


@pytest.fixture(scope="module")
def adapter(tiny_qwen3_dir):
    return load(tiny_qwen3_dir)


def test_rollout_log_probs_equal_a_teacher_forced_recompute(adapter):
    plan = TokenPlan(max_new_tokens=10, temperature=0.7, top_p=0.9, batch_size=3)
    prompts = PROMPTS * 2
    u = draw_uniforms(len(prompts), plan, torch.Generator().manual_seed(0))
    batch = token_rollout(adapter, prompts, [{}] * len(prompts), torch.arange(len(prompts)), plan, u)
    tokens = batch.tokens
    assert tokens.response_ids.shape == (8, 10) and batch.log_probs.shape == (8, 10)
    # the recompute: one forward of prompt ⧺ response, no cache, the whole batch at once
    with torch.no_grad():
        recomputed = response_token_log_probs(adapter, tokens.trimmed(), {}, 0.7)
    r = recomputed.shape[1]
    mask = tokens.response_mask[:, :r].bool()
    assert mask.sum() > 20
    assert torch.allclose(recomputed[mask], batch.log_probs[:, :r][mask], atol=1e-5)
    assert (batch.log_probs[:, r:] == 0).all() and (batch.log_probs[:, :r][~mask] == 0).all()
    # and an independent float64 recompute of one row with the plain transformers forward (no padding at all)
    i = 1
    p = int(tokens.prompt_mask[i].sum())
    n = int(tokens.response_mask[i].sum())
    ids = torch.cat([tokens.prompt_ids[i, -p:], tokens.response_ids[i, :n]])[None]
    with torch.no_grad():
        logits = adapter.network.double()(input_ids=ids).logits[0, p - 1: p + n - 1]
    adapter.network.float()
    ref = torch.log_softmax(logits / 0.7, -1).gather(-1, ids[0, p:, None]).squeeze(-1)
    assert torch.allclose(ref.float(), batch.log_probs[i, :n], atol=1e-5)


def test_draws_do_not_depend_on_the_chunk_size(adapter):
    plan = TokenPlan(max_new_tokens=6, temperature=1.0)
    u = draw_uniforms(len(PROMPTS), plan, torch.Generator().manual_seed(3))
    one = token_rollout(adapter, PROMPTS, [{}] * 4, torch.arange(4), TokenPlan(6, batch_size=4), u)
    many = token_rollout(adapter, PROMPTS, [{}] * 4, torch.arange(4), TokenPlan(6, batch_size=1), u)
    one_t, many_t = one.tokens.trimmed(), many.tokens.trimmed()
    assert torch.equal(one_t.response_ids, many_t.response_ids)
    assert torch.allclose(one.log_probs, many.log_probs, atol=1e-5)


def test_static_cache_decoding_equals_the_growing_cache_and_is_one_graph(adapter):
    """The policy's static-cache decoder (the GPU's CUDA-graph path, traced here by a counting torch.compile backend)
    gives the logits of the generic decoder over transformers' growing cache at every step, for left-padded prompts,
    and every step of every chunk of the same shape is the same single graph (no graph break, no recompile)."""
    from polyrl.sampling.tokens import pad_left

    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    ids, _ = adapter.encode_prompts(PROMPTS)
    static = StaticCacheDecoding(adapter, len(PROMPTS), 64, graphs=True, backend=counting_backend)
    generic = CachedDecoding(adapter)
    for chunk in (ids, [i[: 2 + j] for j, i in enumerate(ids)]):  # then shorter prompts: same cache and graph
        prompt, mask = pad_left(chunk, adapter.pad_token_id)
        assert (mask == 0).any()  # left padding is exercised
        with torch.no_grad():
            a, b = static.prefill(prompt, mask, {}), generic.prefill(prompt, mask, {})
            for t in range(6):
                assert torch.allclose(a, b, atol=1e-5), t
                token = b.argmax(-1)
                a, b = static.step(token), generic.step(token)
    assert len(graphs) == 1


def test_rollout_uses_the_static_cache_and_reuses_it(adapter, monkeypatch):
    plan = TokenPlan(max_new_tokens=5, temperature=1.0, batch_size=2)
    u = draw_uniforms(len(PROMPTS), plan, torch.Generator().manual_seed(1))
    adapter._decodings.clear()
    fast = token_rollout(adapter, PROMPTS, [{}] * 4, torch.arange(4), plan, u)
    made = dict(adapter._decodings)
    assert made  # the chunks decoded through static caches
    again = token_rollout(adapter, PROMPTS, [{}] * 4, torch.arange(4), plan, u)
    assert all(adapter._decodings[k] is v for k, v in made.items())  # reused, not rebuilt
    assert torch.equal(again.tokens.response_ids, fast.tokens.response_ids)
    monkeypatch.setattr(type(adapter), "decoding", lambda self, *a: None)  # the generic decoder
    slow = token_rollout(adapter, PROMPTS, [{}] * 4, torch.arange(4), plan, u)
    assert torch.equal(fast.tokens.response_ids, slow.tokens.response_ids)
    assert torch.allclose(fast.log_probs, slow.log_probs, atol=1e-5)


def test_top_p_and_inverse_cdf_against_reference():
    probs = torch.tensor([[0.1, 0.5, 0.15, 0.25], [0.7, 0.1, 0.1, 0.1]], dtype=torch.float64)
    # sorted: 0.5, 0.25, 0.15, 0.1 -> the nucleus of 0.8 is {0.5, 0.25, 0.15} (0.75 < 0.8 needs the third)
    assert top_p_mask(probs, 0.8)[0].tolist() == [False, True, True, True]
    assert top_p_mask(probs, 0.5)[0].tolist() == [False, True, False, False]
    assert top_p_mask(probs, 0.5)[1].tolist() == [True, False, False, False]
    assert top_p_mask(probs, 1.0).all()
    # CDF of row 0: 0.1, 0.6, 0.75, 1.0
    for u, want in [(0.0, 0), (0.05, 0), (0.1, 1), (0.59, 1), (0.6, 2), (0.74, 2), (0.76, 3), (0.999, 3)]:
        assert inverse_cdf_sample(probs[:1], torch.tensor([u])).item() == want, u
    kept = probs * top_p_mask(probs, 0.8)  # renormalised by the CDF's total: 0.5/0.9, 0.65/0.9, 1
    assert inverse_cdf_sample(kept[:1], torch.tensor([0.0])).item() == 1  # a dropped token is never drawn


def test_responses_end_at_eos_stop_string_or_length(adapter):
    eos = adapter.eos_token_ids[0]
    calls = []

    def forward(input_ids, attention_mask, cond=None, cache=None, keep=0, use_cache=False):
        """A fake network: always the same next token per row (row 0: 'a', row 1: EOS after two 'b', row 2: 'c')."""
        step = len(calls)
        calls.append(input_ids.shape)
        logits = torch.full((3, 1, len(adapter.tokenizer)), -1e4)
        plan_tokens = [ord("a"), eos if step >= 2 else ord("b"), ord("c")]
        for i, tok in enumerate(plan_tokens):
            ids = adapter.tokenizer.convert_tokens_to_ids(chr(tok)) if tok != eos else eos
            logits[i, 0, ids] = 0.0
        return logits, cache

    fake = SimpleNamespace(device=adapter.device, pad_token_id=adapter.pad_token_id, eos_token_ids=adapter.eos_token_ids,
                           forward=forward, decode=adapter.decode, encode_prompts=adapter.encode_prompts)
    plan = TokenPlan(max_new_tokens=5, temperature=1.0, stop=("cc",))
    batch = token_rollout(fake, PROMPTS[:3], [{}] * 3, torch.arange(3), plan, torch.zeros(3, 5, dtype=torch.float64))
    assert batch.tokens.response_mask.sum(1).tolist() == [5, 3, 2]  # max length; EOS kept; the token completing "cc"
    assert batch.media["text"] == ["aaaaa", "bb", "cc"]
    assert batch.tokens.response_ids[1, 2] == eos and batch.tokens.response_ids[1, 3] == adapter.pad_token_id
    assert len(calls) == 5  # prefill + 4 decoding steps (none after the last token)


def test_chat_template_is_applied_and_raw_prompts_otherwise(tiny_qwen3_dir, tmp_path):
    adapter = load(tiny_qwen3_dir)
    ids, cond = adapter.encode_prompts(["hello"])
    assert cond == {}
    assert adapter.tokenizer.decode(ids[0]) == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    from polyrl.models.tiny_lm import byte_tokenizer, save_tiny_causal_lm

    raw = load(save_tiny_causal_lm(tmp_path / "raw", tokenizer=byte_tokenizer(chat_template=None)))
    assert raw.tokenizer.decode(raw.encode_prompts(["hello"])[0][0]) == "hello"
    with pytest.raises(UserError, match="model.max_sequence_length=4"):
        load(tiny_qwen3_dir, max_len=4).encode_prompts(["a longer prompt"])
    with pytest.raises(UserError, match="not a transformers model directory"):
        load(tmp_path)


def test_token_batches_concatenate_and_select():
    a = TokenBatch(torch.tensor([[5, 6]]), torch.tensor([[1, 1]]), torch.tensor([[7, 0, 0]]), torch.tensor([[1, 0, 0]]))
    b = TokenBatch(torch.tensor([[0, 0, 8], [9, 9, 9]]), torch.tensor([[0, 0, 1], [1, 1, 1]]), torch.tensor([[1], [2]]),
                   torch.tensor([[1], [1]]))
    both = TokenBatch.cat([a, b])
    assert both.prompt_ids.tolist() == [[0, 5, 6], [0, 0, 8], [9, 9, 9]]  # prompts padded on the left
    assert both.response_mask.tolist() == [[1, 0, 0], [1, 0, 0], [1, 0, 0]]  # responses on the right
    assert both.trimmed().response_ids.shape == (3, 1)
    rollout = Rollout(prompts=["a", "b", "c"], metadata=[{}] * 3, group_ids=torch.arange(3), cond={}, shared={}, latents={},
                      log_probs=torch.zeros(3, 3), sigmas=torch.zeros(3, 0), noise_levels=torch.zeros(3, 0), final={},
                      tokens=both, extras={"rejected_tokens": both})
    sub = rollout.select(torch.tensor([2, 0]))
    assert sub.tokens.prompt_ids.tolist() == [[9, 9, 9], [0, 5, 6]]
    assert sub.extras["rejected_tokens"].response_ids.tolist() == [[2, 0, 0], [7, 0, 0]]
    assert Rollout.cat([sub, rollout]).tokens.prompt_ids.shape == (5, 3)


def test_cat_pads_ragged_cond_inputs_but_refuses_mismatched_latents():
    """Per-sample model inputs in `cond` may differ in width between rollouts (media of different sizes: padded
    with zeros at the end); the same mismatch anywhere else is an error, never a silent pad."""
    def rollout(width: int, latent: int) -> Rollout:
        return Rollout(prompts=["a"], metadata=[{}], group_ids=torch.arange(1), cond={"pixels": torch.ones(1, width)},
                       shared={}, latents={"x": torch.ones(1, latent)}, log_probs=torch.zeros(1, 1),
                       sigmas=torch.zeros(1, 0), noise_levels=torch.zeros(1, 0), final={})

    both = Rollout.cat([rollout(2, 4), rollout(3, 4)])
    assert both.cond["pixels"].tolist() == [[1, 1, 0], [1, 1, 1]]
    with pytest.raises(RuntimeError):
        Rollout.cat([rollout(2, 4), rollout(2, 5)])

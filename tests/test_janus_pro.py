"""`model=janus_pro` (models/janus_pro.py) on a tiny random Janus checkpoint built here with save_pretrained and a
word-level tokenizer built offline: rollout log-probs (with CFG) equal a teacher-forced recompute and an independent
float64 computation of Janus' guidance, greedy decoding draws what transformers' own `generate(generation_mode=
"image")` draws, the codes decode into images an image reward scores, `polyrl train` runs GRPO / DAPO / GSPO on it,
and config validation pairs the model with image rewards only."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from polyrl.cli.main import main
from polyrl.config import ConfigError, load_config
from polyrl.errors import UserError
from polyrl.models.janus_pro import BOI_TOKEN, JanusProPolicy, janus_prompt
from polyrl.sampling.tokens import TokenPlan, draw_uniforms, response_token_log_probs, token_rollout

PROMPTS = ["a red circle", "two blue squares above a green triangle", "a yellow star", "three circles"]
BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
SPECIALS = [BOS, EOS, PAD, "<|User|>", "<|Assistant|>", BOI_TOKEN, "<end_of_image>", "<image_placeholder>"]
CODEBOOK, IMAGE_TOKENS = 48, 16  # a 4 × 4 grid of codes -> a 16 × 16 image


def janus_tokenizer(words: list[str]):
    """Word-level, Janus' special tokens, BOS prepended (as Janus' Llama tokenizer does)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0}
    for w in [*SPECIALS, ":", *sorted(set(words))]:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.add_special_tokens(SPECIALS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token=BOS, eos_token=EOS, pad_token=PAD)


@pytest.fixture(scope="module")
def janus_dir(tmp_path_factory):
    from transformers import (
        JanusConfig,
        JanusForConditionalGeneration,
        JanusVisionConfig,
        JanusVQVAEConfig,
        LlamaConfig,
    )

    path = tmp_path_factory.mktemp("tiny_janus")
    tok = janus_tokenizer([w for p in PROMPTS for w in p.split()])
    text = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    vision = JanusVisionConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=64, patch_size=16,
                               projection_dim=32, num_image_tokens=IMAGE_TOKENS, mlp_ratio=2)
    vq = JanusVQVAEConfig(embed_dim=4, num_embeddings=CODEBOOK, latent_channels=32, base_channels=32,
                          channel_multiplier=[1, 1, 1], num_res_blocks=1, projection_dim=32, image_token_embed_dim=32)
    config = JanusConfig(text_config=text, vision_config=vision, vq_config=vq,
                         image_token_id=tok.convert_tokens_to_ids("<image_placeholder>"))
    torch.manual_seed(0)
    model = JanusForConditionalGeneration(config)
    with torch.no_grad():  # sharper logits than the init's, so samples and greedy picks are far from ties
        model.model.generation_head.vision_head.weight.mul_(20)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def load(path, cfg_weight=3.0):
    cfg = SimpleNamespace(path=str(path), dtype="float32", max_sequence_length=64, options={"cfg_weight": cfg_weight})
    return JanusProPolicy(cfg, torch.device("cpu"))


@pytest.fixture(scope="module")
def policy(janus_dir):
    return load(janus_dir)


@pytest.fixture(scope="module")
def sampled(policy):
    plan = TokenPlan(max_new_tokens=IMAGE_TOKENS, temperature=0.8, batch_size=3)
    u = draw_uniforms(len(PROMPTS), plan, torch.Generator().manual_seed(0))
    return plan, token_rollout(policy, PROMPTS, [{}] * 4, torch.arange(4), plan, u)


def test_prompt_template_and_unconditional_rows(policy):
    ids, cond = policy.encode_prompts(["a red circle"])
    text_ids = [i - CODEBOOK for i in ids[0]]
    assert cond == {} and min(ids[0]) >= CODEBOOK  # text ids live above the codebook
    assert policy.tokenizer.convert_ids_to_tokens(text_ids) == [BOS, "<|User|>", ":", "a", "red", "circle",
                                                                "<|Assistant|>", ":", BOI_TOKEN]
    assert janus_prompt("x") == f"<|User|>: x\n\n<|Assistant|>:{BOI_TOKEN}"
    row = torch.tensor([[policy.pad_token_id, *ids[0], 5, 7]])  # left pad, the prompt, two image codes
    uncond = policy.unconditional(row)[0].tolist()
    pad, bos, boi = policy.pad_token_id, CODEBOOK + policy.bos_id, CODEBOOK + policy.boi_id
    assert uncond == [pad, bos, *[pad] * (len(ids[0]) - 2), boi, 5, 7]


def test_image_tokens_decode_into_images(policy, sampled):
    _, batch = sampled
    tokens = batch.tokens
    assert set(batch.media) == {"images"}  # the policy's declared media, no text
    images = batch.media["images"]
    assert images.shape == (4, 3, 16, 16) and images.min() >= 0 and images.max() <= 1
    assert tokens.response_ids.shape == (4, IMAGE_TOKENS) and (tokens.response_mask == 1).all()
    assert tokens.response_ids.max() < CODEBOOK
    with torch.no_grad():  # the VQ decoder of the codes, mapped from [-1, 1]
        want = ((policy.vq.decode(tokens.response_ids) + 1) / 2).clamp(0, 1)
    assert torch.allclose(images, want, atol=1e-6)
    assert len({tuple(r) for r in tokens.response_ids.tolist()}) == 4  # the samples differ


def test_rollout_log_probs_equal_a_teacher_forced_recompute(policy, sampled):
    plan, batch = sampled
    with torch.no_grad():  # one forward of prompt ⧺ codes, both CFG rows, no cache, the whole batch at once
        recomputed = response_token_log_probs(policy, batch.tokens.trimmed(), {}, plan.temperature)
    assert recomputed.shape == batch.log_probs.shape
    assert (batch.log_probs < 0).all()
    assert torch.allclose(recomputed, batch.log_probs, atol=1e-5)


def test_guided_log_probs_against_an_independent_float64_computation(janus_dir, policy, sampled):
    """Row 2 (a short prompt, left-padded in its chunk) recomputed with transformers' modules in float64, no padding:
    cond and uncond rows, guided = u + w·(c − u), log softmax(guided / T)."""
    from transformers import JanusForConditionalGeneration

    plan, batch = sampled
    model = JanusForConditionalGeneration.from_pretrained(str(janus_dir)).double().eval()
    i, w = 2, 3.0
    prompt = [t - CODEBOOK for t in policy.encode_prompts([PROMPTS[i]])[0][0]]
    uncond = [t if t in (policy.bos_id, policy.boi_id) else policy.text_pad_id for t in prompt]
    codes = batch.tokens.response_ids[i]
    with torch.no_grad():
        image_embeds = model.prepare_embeddings_for_image_generation(codes[:-1])
        rows = []
        for text in (prompt, uncond):
            embeds = torch.cat([model.get_input_embeddings()(torch.tensor(text)), image_embeds])[None]
            hidden = model.model.language_model(inputs_embeds=embeds).last_hidden_state[0, len(text) - 1:]
            rows.append(model.model.generation_head(hidden))
        guided = rows[1] + w * (rows[0] - rows[1])
        ref = torch.log_softmax(guided / plan.temperature, -1).gather(-1, codes[:, None]).squeeze(-1)
    assert ref.dtype == torch.float64 and ref.shape == (IMAGE_TOKENS,)
    assert torch.allclose(ref.float(), batch.log_probs[i], atol=1e-5)
    # the policy's guided logits themselves, one unpadded forward
    ids = torch.tensor([[t + CODEBOOK for t in prompt] + codes[:-1].tolist()])
    with torch.no_grad():
        logits, _ = policy.forward(ids, torch.ones_like(ids), {}, keep=IMAGE_TOKENS)
    assert torch.allclose(logits[0].double(), guided, atol=1e-4)
    # and the guidance is not the conditional policy: its log-probs differ
    cond_only = torch.log_softmax(rows[0] / plan.temperature, -1).gather(-1, codes[:, None]).squeeze(-1)
    assert (cond_only.float() - batch.log_probs[i]).abs().max() > 1e-2


def test_greedy_codes_match_transformers_generate(janus_dir, policy):
    from transformers import JanusForConditionalGeneration

    model = JanusForConditionalGeneration.from_pretrained(str(janus_dir)).eval()
    g = model.generation_config  # what Janus' generate reads: BOS and BOI stay in the unconditional row, pad elsewhere
    g.bos_token_id, g.pad_token_id = policy.bos_id, policy.text_pad_id
    g.generation_kwargs = {"boi_token_id": policy.boi_id}
    ids = torch.tensor([[t - CODEBOOK for t in policy.encode_prompts([PROMPTS[1]])[0][0]]])
    with torch.no_grad():
        want = model.generate(ids, attention_mask=torch.ones_like(ids), generation_mode="image", do_sample=False,
                              guidance_scale=3.0)
    greedy = TokenPlan(max_new_tokens=IMAGE_TOKENS, temperature=0.0)
    got = token_rollout(policy, [PROMPTS[1]], [{}], torch.arange(1), greedy, torch.zeros(1, IMAGE_TOKENS, dtype=torch.float64))
    assert got.tokens.response_ids.tolist() == want.tolist()


def _args(model, data, out, extra=()):
    return ["train", "recipe=janus_pro_grpo", f"model.path={model}", "model.dtype=float32",
            "model.options.cfg_weight=3", f"data.path={data}", "actor.micro_batch_size=2",
            f"trainer.output_dir={out}", "trainer.max_steps=2", "rollout.n=4", "data.prompts_per_step=2",
            f"rollout.max_new_tokens={IMAGE_TOKENS}", "rollout.batch_size=8", "trainer.eval_samples=4",
            "trainer.eval_every=2", "trainer.save_every=0", "trainer.progress=false", "trainer.tensorboard=false",
            "actor.lora_rank=4", "actor.lora_alpha=8", "actor.lr=1e-2", "actor.num_minibatches=2",
            "reward=jpeg_compressibility", *extra]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("janus_data") / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


CASES = {  # LoRA by default here; grpo_full: the recipe's full fine-tune, with a KL to the initial weights
    "grpo": ["algorithm=grpo"], "dapo": ["algorithm=dapo"], "dpo": ["algorithm=dpo"],
    "gspo": ["algorithm=gspo", "reward.async=true"],  # + the reward stage scoring each chunk while the next samples
    "grpo_full": ["algorithm=grpo", "actor.lora_rank=0", "actor.lr=1e-3", "algorithm.kl_beta=0.01"],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_polyrl_train_scores_the_images_and_updates(janus_dir, prompts_file, tmp_path, case):
    out = tmp_path / "run"
    assert main(_args(janus_dir, prompts_file, out, CASES[case])) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:  # the image reward scored the decoded images: −kB of each JPEG (online DPO: best vs worst)
        assert r["reward/mean"] < 0 and r["reward/std"] > 0 and r["loss"] == r["loss"]
        assert r["response_length/mean"] == IMAGE_TOKENS and "reward_extra/jpeg/kilobytes" in r
    assert any(r["grad_norm"] > 0 for r in steps)
    if case.startswith("grpo"):  # the first mini-batch recomputes the rollout's own guided log-probs
        assert steps[0]["ratio_absdev/first_minibatch"] < 1e-5
    if case == "grpo_full":
        assert all(r["kl"] >= 0 for r in steps) and steps[1]["kl"] > 0  # the weights left the reference copy
    evals = [r for r in rows if "eval/reward_mean" in r]
    assert [r["step"] for r in evals] == [0, 2] and evals[0]["eval/reward_mean"] < 0
    samples = [json.loads(line) for line in (out / "samples" / "step_000002.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and set(samples[0]) == {"prompt", "reward"}
    assert (out / "samples" / "step_000002.png").is_file()  # the held-out images


def test_a_checkpoint_that_is_not_janus_is_refused(tiny_qwen3_dir):
    with pytest.raises(UserError, match="holds a 'qwen3' model, not Janus"):
        load(tiny_qwen3_dir)


def test_wrong_response_length_is_one_error_line(janus_dir, prompts_file, tmp_path, capsys):
    args = [a if not a.startswith("rollout.max_new_tokens") else "rollout.max_new_tokens=8"
            for a in _args(janus_dir, prompts_file, tmp_path / "run", ["algorithm=grpo"])]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "polyrl: error: rollout.max_new_tokens=8, but model=janus_pro draws 16 image tokens" in err
    assert "set rollout.max_new_tokens=16" in err


def test_validation_pairs_janus_with_image_rewards(janus_dir, prompts_file):
    # its own recipe: the default recipe's DiffusionNFT keys are not grpo's
    base = ["recipe=janus_pro_grpo", f"model.path={janus_dir}", f"data.path={prompts_file}"]
    with pytest.raises(ConfigError) as e:
        load_config([*base, "reward=math_answer"])
    msg = str(e.value)
    assert msg.startswith("reward=math_answer does not score images, which model=janus_pro outputs; rewards for images: ")
    assert "jpeg_compressibility" in msg and "math_answer" not in msg.split("rewards for images:")[1]
    cfg = load_config([*base, "reward=jpeg_compressibility"])  # an image reward fits
    assert cfg.model.name == "janus_pro" and cfg.model.options.cfg_weight == 5.0
    with pytest.raises(ConfigError, match="algorithm=flow_grpo trains diffusion policies, but model=janus_pro"):
        load_config([*base, "reward=jpeg_compressibility", "algorithm=flow_grpo"])
    with pytest.raises(ConfigError, match="reward=latent_predictor reads latents only, which model=janus_pro"):
        load_config([*base, "reward=latent_predictor", "reward.path=head.safetensors"])
    with pytest.raises(ConfigError, match="model.options.guidance"):
        load_config([*base, "reward=jpeg_compressibility", "+model.options.guidance=2"])

"""BAGEL (BAGEL-7B-MoT layout) on a tiny random checkpoint the test writes in the public file layout: loading by the
public tensor names (understanding-only tensors skipped), the mixture-of-transformers routing, the understanding
expert against transformers' Qwen3 (a Qwen2 with q/k norms), BAGEL's CFG with renorm and interval, the sigma grid,
image generation, 2 Flow-GRPO steps through the CLI, and the errors a bad checkpoint directory gives."""

import json
import math
import shutil

import pytest
import torch
from conftest import SHAPE_PROMPTS
from flop_count import SDPA, count_flops
from omegaconf import OmegaConf
from safetensors.torch import save_file

from polyrl.cli.main import main
from polyrl.errors import UserError
from polyrl.latents import MediaShape
from polyrl.models import build_model
from polyrl.models.bagel.autoencoder import AutoencoderGeometry, FluxAutoencoder
from polyrl.models.bagel.policy import (
    BAGEL_LORA_TARGETS,
    BagelCheckpointError,
    bagel_cfg,
    bagel_forward_flops,
    bagel_sigmas,
    patchify,
)
from polyrl.models.base import Guidance

HIDDEN, HEADS, KV_HEADS, INTER, LAYERS, SIDE = 32, 4, 2, 48, 2, 8  # SIDE: latent_pos_embed covers 8×8 patches
HEAD_DIM = HIDDEN // HEADS
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<unk>"]


def _tokenizer():
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for w in sorted({w for p in SHAPE_PROMPTS for w in p.split()} | {"blurry", "ugly"}):
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\w+|[^\w\s]+"), behavior="removed", invert=True)
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", unk_token="<unk>")


def ema_shapes(vocab: int, patch_dim: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of BAGEL-7B-MoT's ema.safetensors by its public name (shapes scaled down), including the
    understanding-only ones the generator skips (the ViT, its connector and position table, the text head)."""
    d, q, kv = HIDDEN, HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    shapes = {"language_model.model.embed_tokens.weight": (vocab, d), "language_model.model.norm.weight": (d,),
              "language_model.model.norm_moe_gen.weight": (d,), "language_model.lm_head.weight": (vocab, d),
              "time_embedder.mlp.0.weight": (d, 256), "time_embedder.mlp.0.bias": (d,),
              "time_embedder.mlp.2.weight": (d, d), "time_embedder.mlp.2.bias": (d,),
              "vae2llm.weight": (d, patch_dim), "vae2llm.bias": (d,), "llm2vae.weight": (patch_dim, d),
              "llm2vae.bias": (patch_dim,), "latent_pos_embed.pos_embed": (SIDE * SIDE, d),
              "vit_model.vision_model.embeddings.patch_embedding.weight": (16, 3, 4, 4),
              "connector.fc1.weight": (d, 16), "connector.fc1.bias": (d,), "vit_pos_embed.pos_embed": (16, d)}
    for i in range(LAYERS):
        p = f"language_model.model.layers.{i}."
        for s in ("", "_moe_gen"):
            shapes |= {f"{p}self_attn.q_proj{s}.weight": (q, d), f"{p}self_attn.q_proj{s}.bias": (q,),
                       f"{p}self_attn.k_proj{s}.weight": (kv, d), f"{p}self_attn.k_proj{s}.bias": (kv,),
                       f"{p}self_attn.v_proj{s}.weight": (kv, d), f"{p}self_attn.v_proj{s}.bias": (kv,),
                       f"{p}self_attn.o_proj{s}.weight": (d, q), f"{p}self_attn.q_norm{s}.weight": (HEAD_DIM,),
                       f"{p}self_attn.k_norm{s}.weight": (HEAD_DIM,), f"{p}mlp{s}.gate_proj.weight": (INTER, d),
                       f"{p}mlp{s}.up_proj.weight": (INTER, d), f"{p}mlp{s}.down_proj.weight": (d, INTER),
                       f"{p}input_layernorm{s}.weight": (d,), f"{p}post_attention_layernorm{s}.weight": (d,)}
    return shapes


def save_tiny_bagel(path, seed: int = 0):
    """llm_config.json, vit_config.json, config.json, the tokenizer files, ema.safetensors (random, public names) and
    ae.safetensors (a FLUX-layout autoencoder with 16 latent channels and ÷2 downsampling)."""
    torch.manual_seed(seed)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer()
    tokenizer.save_pretrained(str(path))
    vocab = len(tokenizer)
    (path / "llm_config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "hidden_size": HIDDEN,
        "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": vocab,
        "max_position_embeddings": 256, "qk_norm": True, "layer_module": "Qwen2MoTDecoderLayer",
        "tie_word_embeddings": False}))
    (path / "vit_config.json").write_text(json.dumps({"model_type": "siglip_vision_model", "hidden_size": 16}))
    ema = {}
    for name, shape in ema_shapes(vocab, 2 * 2 * 16).items():
        base = 1.0 if name.endswith("norm.weight") or "layernorm" in name or "norm_moe_gen" in name else 0.0
        ema[name] = base + (0.2 if len(shape) > 1 else 0.1) * torch.randn(shape)
    save_file(ema, str(path / "ema.safetensors"))
    ae = FluxAutoencoder(AutoencoderGeometry(ch=32, ch_mult=(1, 2), num_res_blocks=1, z_channels=16))
    save_file({k: v.contiguous() for k, v in ae.state_dict().items()}, str(path / "ae.safetensors"))
    return path


@pytest.fixture(scope="module")
def bagel_dir(tmp_path_factory):
    return save_tiny_bagel(tmp_path_factory.mktemp("bagel") / "BAGEL-7B-MoT")


def _adapter(path, **options):
    cfg = OmegaConf.create({"name": "bagel", "path": str(path), "dtype": "float32", "max_sequence_length": 32,
                            "shift": None, "options": options})
    return build_model(cfg, torch.device("cpu"))


def _decoder_outputs(adapter, x, sigma, cond):
    """The decoder's final hidden states (B, S, d) of one conditional forward."""
    seen = {}
    handle = adapter.transformer.language_model.model.register_forward_hook(lambda m, a, out: seen.update(h=out))
    try:
        with torch.no_grad():
            adapter.velocity({"x": x}, sigma, cond, {}, 1.0)
    finally:
        handle.remove()
    return seen["h"]


# ----------------------------------------------------------------------------------------------- loading, generation
def test_loads_the_public_layout_and_generates_an_image(bagel_dir):
    adapter = _adapter(bagel_dir)
    model = adapter.transformer
    names = set(model.state_dict())
    public = ema_shapes(len(adapter.tokenizer), 64)
    skipped = {k for k in public if k.startswith(("vit_model.", "connector.", "vit_pos_embed.", "language_model.lm_"))}
    assert names == set(public) - skipped and len(skipped) == 5
    from safetensors.torch import load_file

    stored = load_file(str(bagel_dir / "ema.safetensors"))
    for k in names:  # every tensor landed under its own name
        torch.testing.assert_close(model.state_dict()[k], stored[k], rtol=0, atol=0)
    assert adapter.default_lora_targets == BAGEL_LORA_TARGETS
    trainable = {k for k, p in model.requires_grad_(True).named_parameters() if p.requires_grad}  # a full fine-tune
    assert trainable == {k for k in names if "_moe_gen" in k or k.split(".")[0] in ("time_embedder", "vae2llm",
                                                                                     "llm2vae")}
    assert not any(p.requires_grad for p in model.requires_grad_(False).parameters())
    assert adapter.latent_shapes(MediaShape(32, 16)) == {"x": (16, 16, 8)}

    torch.manual_seed(0)
    steps, shape = 4, MediaShape(32, 16)
    sigmas = adapter.sigmas(steps, shape)
    cond = adapter.encode_prompts([SHAPE_PROMPTS[0]])
    shared = adapter.encode_guidance(Guidance(4.0))
    x = torch.randn(1, *adapter.latent_shapes(shape)["x"])
    with torch.no_grad():
        for i in range(steps):
            v = adapter.velocity({"x": x}, sigmas[i : i + 1], cond, shared, 4.0)["x"]
            x = x + (sigmas[i + 1] - sigmas[i]) * v
    images = adapter.decode({"x": x})["images"]
    assert images.shape == (1, 3, 32, 16) and torch.isfinite(images).all()
    assert 0 <= images.min() and images.max() <= 1 and images.std() > 0
    back = adapter.encode_media({"images": images})["x"]
    assert back.shape == x.shape


def test_flop_count_equals_the_executed_operations(bagel_dir):
    """bagel_forward_flops (and the adapter's counter) equals the Linear and attention work one guided velocity call
    executes: prompts of two lengths (the padded text is computed), a text-unconditional row for CFG."""
    adapter = _adapter(bagel_dir)
    shape = MediaShape(32, 16)
    cond = adapter.encode_prompts([SHAPE_PROMPTS[0], SHAPE_PROMPTS[1] + " with a thin outline"])
    shared = adapter.encode_guidance(Guidance(4.0))
    x = torch.randn(2, *adapter.latent_shapes(shape)["x"])
    before = adapter.flops
    with count_flops(adapter.transformer, SDPA) as executed, torch.no_grad():
        adapter.velocity({"x": x}, torch.tensor([0.9, 0.3]), cond, shared, 4.0)  # only σ = 0.9 is in cfg_interval
    assert executed.attention_calls == LAYERS  # one network call: both CFG branches in one batch
    assert adapter.flops - before == pytest.approx(executed.flops, rel=1e-12)
    h, w = adapter.latent_shapes(shape)["x"][1:]
    tokens = (h // 2) * (w // 2)
    text = cond["text_ids"].shape[1]
    # 3 rows of the padded width: 2 conditional, 1 text-unconditional (its empty text padded to the batch's width)
    assert executed.flops == pytest.approx(3 * bagel_forward_flops(adapter.transformer.config, text, tokens), rel=1e-12)


def test_prompt_tokens_are_bagels(bagel_dir):
    """<|im_start|> + the prompt's tokens + <|im_end|>, no template; cut to max_sequence_length."""
    adapter = _adapter(bagel_dir)
    tok, ids = adapter.tokenizer, adapter.special_ids
    cond = adapter.encode_prompts(["a green triangle", "three yellow squares above a"])
    assert cond["text_ids"][0, :5].tolist() == [ids["<|im_start|>"], *tok.encode("a green triangle"), ids["<|im_end|>"]]
    assert cond["text_mask"].sum(1).tolist() == [5, 7] and cond["text_ids"][0, 5:].tolist() == [0, 0]
    empty = adapter.encode_guidance(Guidance(4.0))  # BAGEL's text-CFG context: no text at all
    assert empty["text_ids"].shape == (1, 0)
    assert adapter.encode_guidance(Guidance(4.0, "blurry"))["text_ids"].shape == (1, 3)
    assert adapter.encode_guidance(Guidance(1.0)) == {}


# ----------------------------------------------------------------------------------------------- the network
def test_mixture_of_transformers_routing(bagel_dir):
    """Text tokens read the understanding expert, latent tokens the generation expert: perturbing the last layer's
    generation MLP changes only the latent tokens' outputs (and the velocity), perturbing its understanding MLP only
    the text tokens' (text never attends to latents, so no earlier layer leaks it back); a first-layer understanding
    q/k/v perturbation reaches the latents through the joint attention."""
    adapter = _adapter(bagel_dir)
    model = adapter.transformer
    cond = adapter.encode_prompts([SHAPE_PROMPTS[1]])
    length, n = cond["text_ids"].shape[1], 16  # image block: <|vision_start|>, n latents, <|vision_end|>
    x, sigma = torch.randn(1, 16, 8, 8), torch.tensor([0.7])
    base = _decoder_outputs(adapter, x, sigma, cond)
    v_base = adapter.velocity({"x": x}, sigma, cond, {}, 1.0)["x"]
    text, latents = slice(0, length), slice(length + 1, length + 1 + n)

    def perturbed(param):
        saved = param.detach().clone()
        with torch.no_grad():
            param.add_(torch.randn_like(param))
        try:
            return _decoder_outputs(adapter, x, sigma, cond), adapter.velocity({"x": x}, sigma, cond, {}, 1.0)["x"]
        finally:
            with torch.no_grad():
                param.copy_(saved)

    last = model.language_model.model.layers[-1]
    h, v = perturbed(last.mlp_moe_gen.down_proj.weight)
    torch.testing.assert_close(h[:, text], base[:, text], rtol=0, atol=0)
    assert (h[:, latents] - base[:, latents]).abs().amin(-1).min() > 0  # every latent token changed
    assert (v - v_base).abs().max() > 1e-3
    h, v = perturbed(last.mlp.down_proj.weight)
    assert (h[:, text] - base[:, text]).abs().amin(-1).min() > 0
    torch.testing.assert_close(h[:, latents], base[:, latents], rtol=0, atol=0)
    torch.testing.assert_close(v, v_base, rtol=0, atol=0)
    first = model.language_model.model.layers[0].self_attn
    h, v = perturbed(first.k_proj.weight)
    assert (v - v_base).abs().max() > 1e-3
    h, v = perturbed(first.q_proj_moe_gen.weight)
    torch.testing.assert_close(h[:, text], base[:, text], rtol=0, atol=0)
    assert (v - v_base).abs().max() > 1e-3


def test_understanding_expert_is_qwen2_with_qk_norm(bagel_dir):
    """The text tokens' hidden states equal transformers' Qwen3Model (Qwen2 + per-head q/k RMS norms, q/k/v biases;
    its o_proj bias set to 0) loaded with the understanding expert's weights."""
    from transformers import Qwen3Config, Qwen3Model

    adapter = _adapter(bagel_dir)
    model = adapter.transformer
    qwen = Qwen3Model(Qwen3Config(vocab_size=len(adapter.tokenizer), hidden_size=HIDDEN, intermediate_size=INTER,
                                  num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                                  head_dim=HEAD_DIM, rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=True,
                                  max_position_embeddings=256)).eval()
    ours = {k.removeprefix("language_model.model."): v for k, v in model.state_dict().items()
            if k.startswith("language_model.model.") and "_moe_gen" not in k}
    state = {k: ours.get(k, torch.zeros_like(v)) for k, v in qwen.state_dict().items()}
    assert {k for k in state if k not in ours} == {f"layers.{i}.self_attn.o_proj.bias" for i in range(LAYERS)}
    qwen.load_state_dict(state)
    cond = adapter.encode_prompts([SHAPE_PROMPTS[0]])
    h = _decoder_outputs(adapter, torch.randn(1, 16, 4, 4), torch.tensor([0.5]), cond)
    with torch.no_grad():
        expected = qwen(input_ids=cond["text_ids"]).last_hidden_state
    torch.testing.assert_close(h[:, : cond["text_ids"].shape[1]], expected, rtol=0, atol=1e-5)


def test_a_samples_velocity_does_not_depend_on_its_batch(bagel_dir):
    """Prompts of different lengths, padded into one batch, with CFG on some samples: each equals its own call."""
    adapter = _adapter(bagel_dir)
    prompts = [SHAPE_PROMPTS[0], "a green triangle"]
    cond = adapter.encode_prompts(prompts)
    x, sigma = torch.randn(2, 16, 8, 4), torch.tensor([0.9, 0.2])  # 0.2 is outside the CFG interval (0.4, 1]
    for shared in (adapter.encode_guidance(Guidance(4.0)), adapter.encode_guidance(Guidance(4.0, "blurry ugly"))):
        both = adapter.velocity({"x": x}, sigma, cond, shared, 4.0)["x"]
        for i, p in enumerate(prompts):
            alone = adapter.velocity({"x": x[i : i + 1]}, sigma[i : i + 1], adapter.encode_prompts([p]), shared,
                                     4.0)["x"]
            torch.testing.assert_close(both[i : i + 1], alone, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------------------------- guidance, grid
def _cfg_reference(v_c, v_t, v_i, s_t, s_i, renorm, lo):
    """BAGEL's guidance in float64 on one sample's (N, D) tokens, loop by loop."""
    v_c, v_t, v_i = v_c.double(), v_t.double(), v_i.double()
    text = v_t + s_t * (v_c - v_t)
    if renorm == "text_channel":
        for j in range(text.shape[0]):
            text[j] = text[j] * min(max(float(v_c[j].norm() / (text[j].norm() + 1e-8)), lo), 1.0)
        return v_i + s_i * (text - v_i) if s_i > 1 else text
    out = v_i + s_i * (text - v_i) if s_i > 1 else text
    if renorm == "global":
        return out * min(max(float(v_c.norm() / (out.norm() + 1e-8)), lo), 1.0)
    return torch.stack([out[j] * min(max(float(v_c[j].norm() / (out[j].norm() + 1e-8)), lo), 1.0)
                        for j in range(out.shape[0])])


@pytest.mark.parametrize("renorm", ["global", "channel", "text_channel"])
@pytest.mark.parametrize("img_scale,lo", [(1.0, 0.0), (2.0, 0.5)])
def test_cfg_matches_bagels_formula(renorm, img_scale, lo):
    torch.manual_seed(1)
    v_c, v_t, v_i = (torch.randn(3, 6, 64, dtype=torch.float64) for _ in range(3))
    out = bagel_cfg(v_c, v_t, v_i, 4.0, img_scale, renorm, lo)
    for b in range(3):  # "global" is per sample: BAGEL generates one image per call
        torch.testing.assert_close(out[b], _cfg_reference(v_c[b], v_t[b], v_i[b], 4.0, img_scale, renorm, lo),
                                   rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="cfg_renorm_type='local'"):
        bagel_cfg(v_c, v_t, v_i, 4.0, 1.0, "local")


def test_guided_velocity_is_bagels_cfg_inside_the_interval(bagel_dir):
    """At σ in (0.4, 1]: renormed text CFG between the prompt's and the empty context's velocities; at σ ≤ 0.4, the
    conditional velocity."""
    adapter = _adapter(bagel_dir, cfg_renorm_min=0.0)
    cond = adapter.encode_prompts([SHAPE_PROMPTS[2]])
    empty = {"text_ids": torch.zeros(1, 0, dtype=torch.long), "text_mask": torch.zeros(1, 0, dtype=torch.bool)}
    shared = adapter.encode_guidance(Guidance(4.0))
    x = torch.randn(1, 16, 8, 8)
    torch.set_grad_enabled(False)  # restored by the fixture-free finally below
    try:
        _check_guided(adapter, x, cond, empty, shared)
    finally:
        torch.set_grad_enabled(True)


def _check_guided(adapter, x, cond, empty, shared):
    for sigma, guided in ((0.8, True), (0.4, False), (0.1, False)):
        s = torch.tensor([sigma])
        v = adapter.velocity({"x": x}, s, cond, shared, 4.0)["x"]
        v_c = adapter.velocity({"x": x}, s, cond, {}, 1.0)["x"]
        if not guided:
            torch.testing.assert_close(v, v_c, rtol=0, atol=1e-6)
            continue
        v_u = adapter.velocity({"x": x}, s, empty, {}, 1.0)["x"]
        raw = v_u + 4.0 * (v_c - v_u)
        expected = raw * min(1.0, float(v_c.norm() / (raw.norm() + 1e-8)))
        torch.testing.assert_close(v, expected, rtol=0, atol=1e-5)
        assert (v - v_c).abs().max() > 1e-3


def test_sigmas_and_patchify_are_bagels():
    t = torch.linspace(1, 0, 6, dtype=torch.float64)
    expected = 3 * t / (1 + 2 * t)
    got = bagel_sigmas(5, 3.0)
    assert got.dtype == torch.float32 and got[0] == 1 and got[-1] == 0
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-7)
    x = torch.randn(2, 16, 6, 4)
    tokens = torch.stack([torch.einsum("chpwq->hwpqc", s.reshape(16, 3, 2, 2, 2)).reshape(6, 64) for s in x])
    torch.testing.assert_close(patchify(x, 2), tokens, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("missing", ["ema.safetensors", "ae.safetensors", "llm_config.json"])
def test_a_missing_file_names_it(bagel_dir, tmp_path, missing, capsys):
    broken = tmp_path / "ckpt"
    shutil.copytree(bagel_dir, broken)
    (broken / missing).unlink()
    (tmp_path / "p.txt").write_text("a green triangle\n")
    with pytest.raises(BagelCheckpointError, match=f"{missing} not found") as info:
        _adapter(broken)
    assert isinstance(info.value, ValueError) and isinstance(info.value, UserError)
    assert main(["train", "model=bagel", f"model.path={broken}", f"data.path={tmp_path / 'p.txt'}",
                 f"trainer.output_dir={tmp_path / 'run'}", "reward=jpeg_compressibility"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("polyrl: error:") and str(broken / missing) in err


def test_wrong_tensors_are_named(bagel_dir, tmp_path):
    from safetensors.torch import load_file

    broken = tmp_path / "ckpt"
    shutil.copytree(bagel_dir, broken)
    state = load_file(str(broken / "ema.safetensors"))
    del state["language_model.model.layers.1.mlp_moe_gen.up_proj.weight"]
    state["vae2llm.weight"] = torch.zeros(HIDDEN, 8)
    save_file(state, str(broken / "ema.safetensors"))
    with pytest.raises(BagelCheckpointError, match=r"ema.safetensors does not hold the BAGEL weights this model needs: "
                                                   r"missing language_model.model.layers.1.mlp_moe_gen.up_proj.weight; "
                                                   r"wrong shape for 1 \(e.g. vae2llm.weight: \[32, 8\], expected "
                                                   r"\[32, 64\]\)"):
        _adapter(broken)
    with pytest.raises(UserError, match="cfg_renorm_type='local'"):
        _adapter(bagel_dir, cfg_renorm_type="local")


# ----------------------------------------------------------------------------------------------- CLI
def test_two_flow_grpo_steps_through_the_cli(bagel_dir, shape_prompts_file, tmp_path):
    """model=bagel recipe=toy_flow_grpo (Flow-GRPO): CFG (text scale 4, interval (0.8, 1]: the σ grid 1, .9, .75, .5 mixes guided
    and unguided steps in the SDE window) in rollout and training, LoRA on the generation expert; every default
    target is trained and only generation-expert weights carry LoRA."""
    out = tmp_path / "run"
    args = ["train", "model=bagel", f"model.path={bagel_dir}", "recipe=toy_flow_grpo", f"data.path={shape_prompts_file}",
            f"trainer.output_dir={out}", "model.max_sequence_length=32", "trainer.max_steps=2", "rollout.height=32",
            "rollout.width=32", "rollout.num_steps=4", "rollout.n=2", "rollout.guidance_scale=4",
            "model.options.cfg_interval=[0.8,1.0]", "rollout.sde_window_size=2", "rollout.sde_window_range=[0,2]",
            "data.prompts_per_step=2", "rollout.batch_size=4", "actor.micro_batch_size=2", "actor.lora_rank=4",
            "actor.lora_alpha=4", "trainer.eval_every=2", "trainer.eval_samples=2", "trainer.num_validation=2",
            "trainer.save_every=2", "trainer.progress=false", "trainer.tensorboard=false",
            "reward=jpeg_compressibility"]
    assert main(args) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[1]["grad_norm"] > 0 and math.isfinite(rows[1]["loss"]) and rows[1]["perf/tflops"] > 0
    assert rows[1]["ratio_absdev/first_minibatch"] < 1e-5  # rollout and training compute the same guided velocity
    assert math.isfinite(rows[2]["eval/reward_mean"]) and (out / "samples" / "step_000002.png").is_file()
    from safetensors.torch import load_file

    state = load_file(str(out / "checkpoints" / "step_000002" / "adapter_model.safetensors"))
    assert state and all("_moe_gen" in k for k in state)
    trained = {k.split(".lora_")[0] for k, v in state.items() if k.endswith("lora_B.weight") and v.abs().max() > 0}
    for target in BAGEL_LORA_TARGETS:
        assert any(k.endswith(target) for k in trained), target


def test_recipe_is_verl_omnis_bagel_workload():
    from polyrl.config import load_config

    cfg = load_config(["recipe=bagel_flowgrpo", "model.path=/x", "data.path=/y.txt", "reward.path=/z"])
    r, a = cfg.rollout, cfg.actor
    assert cfg.model.name == "bagel" and cfg.reward.name == "pickscore" and cfg.algorithm.name == "flow_grpo"
    assert (r.num_steps, r.n, r.noise_level, r.sde_window_size, list(r.sde_window_range)) == (15, 16, 1.3, 2, [0, 7])
    assert (a.lora_rank, a.lora_alpha, a.lr, cfg.algorithm.clip_range, cfg.data.prompts_per_step) == (
        64, 128.0, 1e-4, 1e-5, 48)
    assert dict(cfg.model.options) == {"cfg_img_scale": 1.0, "cfg_interval": [0.4, 1.0], "cfg_renorm_type": "global",
                                       "cfg_renorm_min": 0.0}

"""model=qwen3_omni_speech: Qwen3-Omni's thinker and talker as one token policy (text, then speech codes), on a tiny
random Qwen3-Omni with all four parts that the tests save in the public layout (omni_speech_tiny.py).

Greedy rollouts equal transformers' own `Qwen3OmniMoeForConditionalGeneration.generate` (text, codes and waveform);
sampled rollouts' log-probs of both streams equal the teacher-forced recompute and a float64 copy run through
transformers' own forwards and talker-input builders; gradients of text and speech tokens reach the networks they
depend on; 2-step `polyrl train` runs train the thinker alone, the talker alone and all three (the frozen networks
bit-identical after the steps), resume exactly, and take GSPO, DAPO, online DPO and OPD; speech rewards score the
waveform against the policy's own text; `polyrl eval` scores both streams.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omni_speech_tiny import CODEC, GROUPS, SPEAKERS, TALKER_VOCAB, save_tiny_omni
from test_qwen3_omni import write_wav
from test_speech_rewards import build_tiny_whisper

from polyrl.algorithms.streams import stream_token_weights
from polyrl.cli.main import main
from polyrl.models.qwen3_omni_speech import SUPPRESSED, Qwen3OmniSpeechPolicy, give_audio_config
from polyrl.sampling.tokens import TokenPlan, draw_uniforms, extra_tokens, response_token_log_probs, token_rollout

FRAMES = 6  # model.options.max_speech_frames of the tests


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory):
    return save_tiny_omni(tmp_path_factory.mktemp("tiny_qwen3_omni_speech"))


def load(path, **options):
    cfg = SimpleNamespace(path=str(path), dtype="float32", max_sequence_length=512,
                          options={"max_speech_frames": FRAMES, **options})
    return Qwen3OmniSpeechPolicy(cfg, torch.device("cpu"))


@pytest.fixture(scope="module")
def policy(omni_dir):
    return load(omni_dir)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """An image and a WAV clip, and a data file of rows with and without them (paths relative to the file)."""
    import numpy as np
    from PIL import Image

    root = tmp_path_factory.mktemp("omni_speech_data")
    (root / "media").mkdir()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(root / "media/a.png")
    write_wav(root / "media/a.wav", 0.3)
    rows = [{"prompt": "what is one plus one?", "image": "media/a.png", "audio": "media/a.wav"},
            {"prompt": "say hi"}, {"prompt": "count the beeps", "audio": "media/a.wav"}, {"prompt": "tell a story"}]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def prompts(root: Path) -> list:
    m = root / "media"
    return [{"text": "what is one plus one?", "images": [str(m / "a.png")], "audio": [str(m / "a.wav")]}, "say hi",
            {"text": "count the beeps", "audio": [str(m / "a.wav")]}, "tell a story"]


def rollout(policy, ps, temperature: float, seed: int = 0, max_new_tokens: int = 6):
    plan = TokenPlan(max_new_tokens=max_new_tokens, temperature=temperature, batch_size=3)
    width = max_new_tokens + extra_tokens(policy)
    u = (draw_uniforms(len(ps), plan, torch.Generator().manual_seed(seed), extra_tokens(policy)) if temperature > 0
         else torch.zeros(len(ps), width, dtype=torch.float64))
    return token_rollout(policy, ps, [{}] * len(ps), torch.arange(len(ps)), plan, u)


@pytest.mark.parametrize("speaker", ["", "Chelsie"])
def test_greedy_rollout_is_transformers_generate(policy, omni_dir, media, speaker):
    """Greedy decoding through the policy = transformers' generate of one sample (thinker greedy with the media markers
    suppressed, talker and code predictor greedy, no repetition penalty), for generate's default speaker and another:
    the same text, codes and waveform."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    ps = prompts(media) if not speaker else prompts(media)[:2]
    if speaker:
        policy = load(omni_dir, speaker=speaker)
    batch = rollout(policy, ps, temperature=0.0)
    ref = Qwen3OmniMoeForConditionalGeneration.from_pretrained(str(omni_dir)).eval()
    give_audio_config(ref)  # transformers' talker reads an audio_config its config lacks
    assert batch.media["audio"].waveform.shape == (len(ps), 1, FRAMES * policy.hop)
    compared = 0
    for i, prompt in enumerate(ps):
        text, codes = policy.split(batch.tokens)[i]
        if len(codes) == 1:  # the codec EOS first: silence (generate fails to stack zero frames)
            assert codes.tolist() == [CODEC["eos"]] and not batch.media["audio"].waveform[i].any()
            continue
        ids, cond = policy.encode_prompts([prompt])
        flat = policy._flat_inputs(cond)
        captured = {}
        decode = ref.code2wav.chunked_decode

        def spy(codes, captured=captured, decode=decode, **kwargs):
            captured["codes"] = codes
            return decode(codes, **kwargs)

        ref.code2wav.chunked_decode = spy
        seq, wav = ref.generate(input_ids=torch.tensor(ids), thinker_max_new_tokens=6,
                                thinker_eos_token_id=policy.eos_token_ids, thinker_do_sample=False,
                                thinker_suppress_tokens=policy._banned, talker_do_sample=False,
                                talker_repetition_penalty=1.0, talker_max_new_tokens=FRAMES + 1,
                                speaker=speaker or "Ethan", **flat)
        ref.code2wav.chunked_decode = decode
        assert text == seq[0, len(ids[0]):].tolist()
        whole = len(codes) // GROUPS
        assert whole >= 1 and torch.equal(codes[: whole * GROUPS].reshape(whole, GROUPS).T, captured["codes"][0][:, :whole])
        ours = batch.media["audio"].waveform[i, 0]
        assert torch.allclose(ours[: wav.shape[-1]], wav.flatten(), atol=1e-6) and not ours[wav.shape[-1]:].any()
        assert batch.media["text"][i] == policy.tokenizer.decode(text, skip_special_tokens=True)
        compared += 1
    assert compared >= min(3, len(ps))


def float64_log_probs(model, policy, tokens, cond, i: int, temperature: float) -> torch.Tensor:
    """Row i's log-probs (text, then codes) by a float64 Qwen3-Omni through transformers' own pieces: the thinker's
    forward (its own positions) over prompt ⧺ text, the model's `_get_talker_user_parts` /
    `_get_talker_assistant_parts` on its embeddings and hidden states as `generate` calls them, the talker's forward
    (its own `compute_3d_position_ids`) over the prompt part and the frames, and the code predictor's forward step by
    step as in generation (`generation_steps`)."""
    c, tc = model.config, model.config.talker_config
    t = temperature
    ids = tokens.prompt_ids[i][tokens.prompt_mask[i].bool()]
    text, codes = policy.split(tokens)[i]
    p = len(ids)
    seq = torch.cat([ids, torch.tensor(text[:-1], dtype=torch.long)])[None]
    flat = {k: (v.double() if v.is_floating_point() else v)
            for k, v in policy._flat_inputs({k: v[i: i + 1] for k, v in cond.items()}).items()}
    model.thinker.model.rope_deltas = None
    with torch.no_grad():
        out = model.thinker(input_ids=seq, attention_mask=torch.ones_like(seq), output_hidden_states=True, **flat)
    logits = out.logits[0, p - 1: p - 1 + len(text)]
    logits[:, policy._banned] = float("-inf")
    lps = [torch.log_softmax(logits / t, -1).gather(-1, torch.tensor(text)[:, None])[:, 0]]
    embed, hidden = out.hidden_states[0], out.hidden_states[tc.accept_hidden_layer]
    # generate's talker input (modeling_qwen3_omni_moe.py, Qwen3OmniMoeForConditionalGeneration.generate)
    mm = torch.isin(seq, torch.tensor(policy.media_ids))
    pos = torch.arange(p)
    starts = torch.where(ids == c.im_start_token_id, pos, -1).cummax(0).values.clamp(min=0)
    user = (ids[(starts + 1).clamp(max=p - 1)] == c.user_token_id).nonzero().flatten()
    with torch.no_grad():
        user_embeds = model._get_talker_user_parts(0, p, mm, hidden, embed)[:, user]
        special = torch.tensor([[c.tts_bos_token_id, c.tts_eos_token_id, c.tts_pad_token_id]])
        bos, eos, pad = model.talker.text_projection(model.thinker.get_input_embeddings()(special)).chunk(3, dim=1)
        start = int(((ids[:-1] == c.im_start_token_id) & (ids[1:] == c.assistant_token_id)).nonzero()[-1])
        assistant, assistant_ids, trailing = model._get_talker_assistant_parts(start, seq.shape[1] + 1,
                                                                               SPEAKERS["ethan"], embed, pad, bos, eos)
        whole = len(codes) // GROUPS
        frames = codes[: whole * GROUPS].reshape(whole, GROUPS)
        inputs = []
        for f in range(whole):
            e = model.talker.get_input_embeddings()(frames[f, :1]) + sum(
                model.talker.code_predictor.get_input_embeddings()[k - 1](frames[f, k: k + 1]) for k in range(1, GROUPS))
            inputs.append(e[None] + (trailing[:, f: f + 1] if f < trailing.shape[1] else pad))
        embeds = torch.cat([user_embeds, assistant, *inputs], 1)
        talker_ids = torch.cat([seq[:, user], assistant_ids, torch.full((1, whole), c.tts_pad_token_id)], 1)
        fmask = flat.get("feature_attention_mask")
        model.talker.rope_deltas = None
        out = model.talker(inputs_embeds=embeds, attention_mask=torch.ones_like(talker_ids), talker_input_ids=talker_ids,
                           image_grid_thw=flat.get("image_grid_thw"), video_grid_thw=flat.get("video_grid_thw"),
                           audio_feature_lengths=None if fmask is None else fmask.sum(-1), output_hidden_states=True)
    n = user_embeds.shape[1] + assistant.shape[1]
    banned = torch.zeros(TALKER_VOCAB, dtype=torch.bool)
    banned[TALKER_VOCAB - SUPPRESSED:] = True
    banned[CODEC["eos"]] = False
    states = out.hidden_states[0][-1][0]
    for f in range(-(-len(codes) // GROUPS)):
        first = out.logits[0, n - 1 + f].masked_fill(banned, float("-inf"))
        lps.append(torch.log_softmax(first / t, -1)[codes[f * GROUPS]][None])
        if f * GROUPS + 1 >= len(codes):
            continue
        predictor = model.talker.code_predictor
        with torch.no_grad():
            step = predictor(inputs_embeds=torch.cat([states[n - 1 + f][None, None],
                                                      model.talker.get_input_embeddings()(codes[f * GROUPS][None, None])], 1),
                             use_cache=True)
            for k in range(1, GROUPS):
                lps.append(torch.log_softmax(step.logits[0, -1] / t, -1)[codes[f * GROUPS + k]][None])
                if k < GROUPS - 1:
                    step = predictor(input_ids=codes[f * GROUPS + k][None, None], cache=step.cache, use_cache=True,
                                     generation_steps=step.generation_steps)
    return torch.cat(lps)


def test_rollout_log_probs_equal_teacher_forcing_and_transformers_in_float64(policy, omni_dir, media):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    batch = rollout(policy, prompts(media) * 2, temperature=0.9, seed=1)
    tokens = batch.tokens
    streams = policy.token_streams(tokens.response_ids) * tokens.response_mask
    speech = streams.sum(1)
    assert (speech == FRAMES * GROUPS).any() and ((speech % GROUPS == 1) & (speech < FRAMES * GROUPS)).any()
    with torch.no_grad():
        recomputed = response_token_log_probs(policy, tokens.trimmed(), batch.cond, 0.9)
    r = recomputed.shape[1]
    mask = tokens.response_mask[:, :r].bool()
    assert (batch.log_probs[:, :r][mask] <= 0).all() and (batch.log_probs[:, r:] == 0).all()
    assert torch.allclose(recomputed, batch.log_probs[:, :r], atol=1e-5)
    # micro-batches of other rows (the actor's) give the same numbers
    rows = torch.tensor([5, 0, 2])
    with torch.no_grad():
        sub = response_token_log_probs(policy, tokens.select(rows).trimmed(),
                                       {k: v[rows] for k, v in batch.cond.items()}, 0.9)
    assert torch.allclose(sub, batch.log_probs[rows, : sub.shape[1]], atol=1e-5)
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(str(omni_dir), dtype=torch.float64,
                                                                 experts_implementation="eager").eval()
    give_audio_config(model)
    checked = 0
    for i in range(len(tokens)):
        text, codes = policy.split(tokens)[i]
        if len(text) < 2:  # the text is its EOS alone: nothing to say (generate cannot run its talker)
            assert codes.tolist() == [CODEC["eos"]] and batch.log_probs[i, 1] == 0
            continue
        ref = float64_log_probs(model, policy, tokens, batch.cond, i, 0.9)
        n = len(text) + len(codes)
        assert torch.allclose(ref, batch.log_probs[i, :n].double(), atol=1e-5), i
        checked += 1
    assert checked >= 6


def test_gradients_reach_the_networks_each_stream_reads(policy, media):
    """A text token's log-prob depends on the thinker only; a code's on the talker, the code predictor and the thinker
    (its embeddings and, for a prompt with media, its hidden states), never on code2wav."""
    batch = rollout(policy, prompts(media)[:1] * 2, temperature=0.9, seed=2)
    tokens = batch.tokens.trimmed()
    streams = policy.token_streams(tokens.response_ids).bool() & tokens.response_mask.bool()
    nets = dict(policy.modules(), code2wav=policy.code2wav)
    for which, expected in (("text", {"thinker"}), ("speech", {"thinker", "talker", "code_predictor"})):
        for net in nets.values():
            net.requires_grad_(True)
            net.zero_grad(set_to_none=True)
        lp = response_token_log_probs(policy, tokens, batch.cond, 0.9)
        (lp * (streams if which == "speech" else ~streams & tokens.response_mask.bool())).sum().backward()
        reached = {n for n, net in nets.items() if any(p.grad is not None and p.grad.abs().sum() > 0
                                                        for p in net.parameters())}
        assert reached == expected, which
        if which == "speech":  # through the hidden states of the prompt's media placeholders, too
            layer = policy.network.model.language_model.layers[0].self_attn.q_proj.weight
            assert layer.grad.abs().sum() > 0
    for net in nets.values():
        net.requires_grad_(False)
        net.zero_grad(set_to_none=True)


def test_stream_weights_by_hand():
    stream = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0], [0, 1, 1, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0]])
    coefs = torch.tensor([1.0, 0.5], dtype=torch.float64)
    token = stream_token_weights(stream, mask, coefs, "token")
    assert token.tolist() == [[1, 1, 0.5, 0.5, 0.5, 0.5], [1, 1, 1, 0, 0, 0], [1, 0.5, 0.5, 0, 0, 0]]
    w = stream_token_weights(stream, mask, coefs, "stream")
    # row 0: 6 tokens, text 2 with 1 / 1.5 of them, speech 4 with 0.5 / 1.5: 6·(1/1.5)/2 = 2, 6·(0.5/1.5)/4 = 0.5
    assert w[0].tolist() == pytest.approx([2, 2, 0.5, 0.5, 0.5, 0.5])
    assert w[1].tolist() == pytest.approx([1, 1, 1, 0, 0, 0])  # one stream: its own
    assert w[2].tolist() == pytest.approx([2, 0.5, 0.5, 0, 0, 0])  # 3·(1/1.5)/1, 3·(0.5/1.5)/2
    # GRPO's sequence mean of per-token losses ℓ then is Σ_s c_s · mean_{t∈s} ℓ / Σ_s c_s
    loss = torch.tensor([[1.0, 3.0, 2.0, 2.0, 4.0, 0.0]], dtype=torch.float64)
    got = (loss * w[:1]).sum() / 6
    assert float(got) == pytest.approx((1.0 * 2.0 + 0.5 * 2.0) / 1.5)
    assert w.sum(1).tolist() == pytest.approx(mask.sum(1).double().tolist())  # the normalisation is unchanged


# ------------------------------------------------------------------------------------------------------- CLI
# a loose pattern gives groups of differing rewards on random weights (about a third of the texts hold a letter a..m)
FORMAT = ("reward=format", "reward.pattern='.*[a-m].*'")


def _args(model, data, out, extra=(), reward=FORMAT):
    return ["train", "recipe=qwen3_omni_speech_grpo", f"model.path={model}", "model.dtype=float32",
            f"model.options.max_speech_frames={FRAMES}", "algorithm=grpo", *reward, f"data.path={data}", f"trainer.output_dir={out}", "trainer.max_steps=2",
            "rollout.n=2", "data.prompts_per_step=2", "rollout.max_new_tokens=4", "rollout.batch_size=4",
            "rollout.temperature=0.9", "trainer.eval_every=0", "trainer.save_every=2", "actor.micro_batch_size=2",
            "trainer.progress=false", "trainer.tensorboard=false", "actor.lora_rank=0", "actor.lr=1e-2",
            "actor.num_minibatches=1", "actor.weight_decay=0", "trainer.seed=9", *extra]


@pytest.fixture
def keep_adapter(monkeypatch):
    """The policy `polyrl train` builds, kept for a look at its weights after the run."""
    import polyrl.trainer.build as build

    built = []
    original = build.build_model

    def spy(cfg, device):
        built.append(original(cfg, device))
        return built[-1]

    monkeypatch.setattr(build, "build_model", spy)
    return built


def _states(policy) -> dict[str, dict[str, torch.Tensor]]:
    nets = dict(policy.modules(), code2wav=policy.code2wav)
    return {n: {k: v.detach().clone() for k, v in net.state_dict().items()} for n, net in nets.items()}


TRAINS = {"thinker": ["thinker"], "talker": ["talker"], "joint": ["thinker", "talker", "code_predictor"]}


@pytest.mark.parametrize("case", sorted(TRAINS))
def test_two_steps_train_exactly_the_configured_modules(policy, omni_dir, media, tmp_path, keep_adapter, case):
    """Full fine-tunes of two steps without weight decay: the configured networks move (every one of them; the
    thinker's encoders stay), every other one (and code2wav) is bit-identical to the base's; the checkpoint holds the
    trained ones."""
    base = _states(policy)
    out = tmp_path / "run"
    names = TRAINS[case]
    extra = [f"actor.train_modules=[{','.join(names)}]"] if case != "joint" else []
    assert main(_args(omni_dir, media / "train.jsonl", out, extra)) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2] and rows[0]["ratio_absdev/first_minibatch"] < 1e-5
    assert rows[0]["grad_norm"] > 0  # no weight decay: a weight moves only where its gradient is not 0
    assert rows[0]["speech_length/mean"] > 0 and rows[0]["response_length/mean"] > 0
    after = _states(keep_adapter[-1])
    for net, state in after.items():
        moved = [k for k in state if not torch.equal(state[k], base[net][k])]
        if net in names:
            assert moved, net
            if net == "thinker":
                assert not [k for k in moved if k.startswith(("model.audio_tower", "model.visual"))]
        else:
            assert not moved, (net, moved[:3])
    meta = json.loads((out / "checkpoints" / "step_000002" / "weights.json").read_text())
    assert meta["networks"] == names
    assert sorted(f.name for f in (out / "checkpoints" / "step_000002").glob("*.safetensors")) == sorted(
        f"{n}.safetensors" for n in names)


def test_lora_joint_run_with_stream_weights_resumes_exactly(omni_dir, media, tmp_path, whisper):
    """LoRA on the three decoders, speech weighed per stream, reward=mix of a text rule and the ASR of the speech
    against its own text; held-out samples hold each response's text, wav and spectrogram; a run resumed from step 1
    ends bit-identical to the uninterrupted one."""
    extra = ["actor.lora_rank=4", "actor.lora_alpha=8", "actor.stream_norm=stream", "+actor.stream_weights.speech=0.5",
             "trainer.save_every=1", "trainer.eval_every=2", "trainer.eval_samples=2"]
    mix = ["reward=mix", "reward.mix={format: {weight: 1.0, pattern: '.*[a-m].*'}, asr_wer: {weight: 0.5, path: "
           f"'{whisper}', reference: response, max_new_tokens: 3, device: cpu}}}}"]
    straight = tmp_path / "run"
    assert main(_args(omni_dir, media / "train.jsonl", straight, extra, mix)) == 0
    rows = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2] and any(r["grad_norm"] > 0 for r in steps)
    assert "reward/asr_wer" in steps[0] and "reward_extra/asr_wer/wer" in steps[0]
    samples = [json.loads(line) for line in (straight / "samples" / "step_000002.jsonl").read_text().splitlines()]
    assert len(samples) == 2 and all("response" in s for s in samples)
    assert (straight / "samples" / "step_000002.wav").stat().st_size > 44
    assert (straight / "samples" / "step_000002.png").is_file()
    first = straight / "checkpoints" / "step_000001"
    assert json.loads((first / "weights.json").read_text())["networks"] == ["thinker", "talker", "code_predictor"]
    from safetensors.torch import load_file

    last = straight / "checkpoints" / "step_000002"
    a = load_file(str(last / "adapter_model.safetensors"))
    shutil.rmtree(last)  # the run resumed from step 1 (in its own directory) makes step 2 again
    assert main(_args(omni_dir, media / "train.jsonl", straight, [*extra, f"trainer.resume={first}"], mix)) == 0
    again = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    two = [r for r in again if r.get("step") == 2 and "loss" in r][-1]
    for key in ("loss", "grad_norm", "reward/mean", "speech_length/mean"):
        assert two[key] == steps[1][key], key
    b = load_file(str(last / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(k.startswith("talker.") for k in a) and any(k.startswith("code_predictor.") for k in a)


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    return build_tiny_whisper(tmp_path_factory.mktemp("omni_whisper"))


LOSSES = {"gspo": ["algorithm=gspo"], "dapo": ["algorithm=dapo", "algorithm.dynamic_sampling=false"],
          "dpo": ["algorithm=dpo", "actor.lora_rank=4", "actor.lora_alpha=8", "actor.stream_norm=stream"],
          "opd": ["algorithm=opd", "algorithm.task_loss=grpo"]}


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_the_token_losses_train_both_streams(omni_dir, media, tmp_path, loss):
    """One step each of GSPO, DAPO, online DPO (LoRA; its sequence log-probs the stream-normalised sums) and OPD (the
    teacher: the model directory itself, loaded as the three networks) over the text and speech tokens of each
    sample."""
    extra = [*LOSSES[loss], "trainer.max_steps=1", "trainer.save_every=0"]
    if loss == "opd":
        extra.append(f"algorithm.teacher_path={omni_dir}")
    out = tmp_path / "run"
    assert main(_args(omni_dir, media / "train.jsonl", out, extra)) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] and rows[0]["loss"] == rows[0]["loss"] and rows[0]["grad_norm"] > 0
    if loss == "opd":  # the teacher is the initial policy: the distillation advantage is 0 on every token
        assert rows[0].get("opd/kl", 0.0) == pytest.approx(0.0, abs=1e-5)


def build_tiny_xvector(path):
    from transformers import Wav2Vec2Config, Wav2Vec2FeatureExtractor, Wav2Vec2ForXVector

    cfg = Wav2Vec2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                         conv_dim=(8, 8), conv_stride=(5, 4), conv_kernel=(10, 4), num_conv_pos_embeddings=8,
                         num_conv_pos_embedding_groups=2, tdnn_dim=(8, 8), tdnn_kernel=(3, 1), tdnn_dilation=(1, 1),
                         xvector_output_dim=6)
    torch.manual_seed(0)
    Wav2Vec2ForXVector(cfg).save_pretrained(path)
    Wav2Vec2FeatureExtractor(sampling_rate=16000, do_normalize=True).save_pretrained(path)
    return path


def test_eval_scores_text_and_speech(omni_dir, media, tmp_path, whisper):
    """`polyrl eval` with a text scorer and every speech scorer (asr_wer against the model's own text, speaker
    similarity against the rows' reference clip, CLAP against the prompt): each sample scored by each, the ASR score
    1 − WER by hand (the scripted Whisper always hears "cat cat cat")."""
    from test_clap import build_tiny_clap

    from polyrl.rewards.speech import error_rate, normalize_transcript

    build_tiny_clap(tmp_path / "clap")
    data = tmp_path / "eval.jsonl"
    rows = [json.loads(line) for line in (media / "train.jsonl").read_text().splitlines()]
    data.write_text("".join(json.dumps({**r, **{k: str(media / v) for k, v in r.items() if k in ("image", "audio")},
                                        "reference_audio": str(media / "media/a.wav")}) + "\n" for r in rows))
    out = tmp_path / "eval"
    scorers = ["format", "asr_wer", "speaker_similarity", "clap"]
    args = ["eval", "recipe=qwen3_omni_speech_grpo", f"model.path={omni_dir}", "model.dtype=float32",
            f"model.options.max_speech_frames={FRAMES}", "model.options.sample_rate=4000", f"data.path={data}",
            *FORMAT, f"eval.scorers=[{','.join(scorers)}]", f"scorer.asr_wer.path={whisper}",
            "scorer.asr_wer.reference=response", "scorer.asr_wer.max_new_tokens=3", "scorer.asr_wer.device=cpu",
            f"scorer.speaker_similarity.path={build_tiny_xvector(tmp_path / 'xvec')}",
            "scorer.speaker_similarity.device=cpu", f"scorer.clap.path={tmp_path / 'clap'}", "scorer.clap.device=cpu",
            "rollout.max_new_tokens=4", f"eval.output_dir={out}", "eval.progress=false"]
    assert main(args) == 0
    records = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(records) == 4 and all(set(r["scores"]) == set(scorers) for r in records)
    for r in records:  # an empty text: WER 1
        ref = normalize_transcript(r["responses"][0])
        wer = error_rate("cat cat cat", ref) if ref.split() else 1.0
        assert r["scores"]["asr_wer"][0] == pytest.approx(1 - wer, abs=1e-6)
        assert -1 <= r["scores"]["speaker_similarity"][0] <= 1 and -1 <= r["scores"]["clap"][0] <= 1
    report = json.loads((out / "report.json").read_text())
    assert set(report["scorers"]) == set(scorers)


def test_config_and_checkpoint_errors_are_one_line(omni_dir, media, tmp_path, capsys):
    data = media / "train.jsonl"
    no_talker = tmp_path / "thinker_only"
    no_talker.mkdir()
    config = json.loads((omni_dir / "config.json").read_text())
    (no_talker / "config.json").write_text(json.dumps({**config, "enable_audio_output": False}))
    thinker_model = ["train", "recipe=qwen3_omni_grpo", f"model.path={omni_dir}", f"data.path={data}", *FORMAT]
    cases = [
        (_args(omni_dir, data, tmp_path / "run", ["actor.train_modules=[thinker,vocoder]"]),
         "actor.train_modules: 'vocoder' is not a network of model=qwen3_omni_speech; allowed: thinker, talker, "
         "code_predictor"),
        ([*thinker_model, "+actor.stream_weights.speech=0.5"], "model=qwen3_omni has one"),
        (_args(omni_dir, data, tmp_path / "run", ["+actor.stream_weights.video=0.5"]),
         "actor.stream_weights.video: not a stream of model=qwen3_omni_speech; allowed: text, speech"),
        (_args(omni_dir, data, tmp_path / "run", ["model.options.speaker=nobody"]),
         "model.options.speaker='nobody' is not one of"),
        (_args(no_talker, data, tmp_path / "run"), "has no talker (enable_audio_output false or no talker_config)"),
    ]
    for args, message in cases:
        capsys.readouterr()
        assert main(args) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("polyrl: ") and message in err[0], err

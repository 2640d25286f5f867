"""Tiny chat judges of the Qwen2.5-VL class for the judge tests, saved offline: a word-level tokenizer, a chat
template, random or "scripted" weights, and a processor that `AutoProcessor` (and so `transformers serve`) loads.

Qwen2.5-VL's own processor cannot be built without torchvision (its video processor needs it; the CPU test
environment has no torchvision that imports against the CPU torch wheel), so the checkpoint ships the image-only
subclass below as the model directory's own code (`auto_map`), loaded with `trust_remote_code`; the model class,
the image processor (`Qwen2VLImageProcessorPil`) and the chat rendering are transformers' own.

A scripted judge answers what the test chose, from what the question says: its one decoder layer is set by hand.
Token embeddings are orthonormal; the MLP is zeroed; attention head 0 lets the generation prompt's last token ("\n"
after the assistant header) attend to the question's `lookup` words only (its query and their keys live in the
rotary pair of the lowest frequency, which turns by under 1e-3 rad over the prompt, so the score ignores position)
and copies the word's embedding into the residual stream; lm_head maps each lookup word to the answer's first token
and each `script` token to the next one. So greedy decoding spells "3" for a question that says "square", and so on,
whatever the images."""

import json
from pathlib import Path

import torch

QWEN_VL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>", "<|vision_start|>", "<|vision_end|>",
                    "<|image_pad|>", "<|video_pad|>"]
# Qwen's chat layout: a default system turn, <|im_start|>role\n ... <|im_end|>\n per message, images as the vision
# block, and the assistant header as the generation prompt (what transformers serve's Qwen answer parser expects)
JUDGE_TEMPLATE = (
    "{% for m in messages %}{% if loop.first and m.role != 'system' %}<|im_start|>system\nYou are a helpful "
    "assistant.<|im_end|>\n{% endif %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}"
    "{% else %}{% for c in m.content %}{% if c.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c.type == 'text' %}{{ c.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEMPLATE_WORDS = ["system", "you", "are", "a", "helpful", "assistant", ".", "user"]
PROCESSOR_CODE = '''"""Qwen2.5-VL's processor without its video processor (which cannot be built without torchvision)."""
from transformers import Qwen2_5_VLProcessor
from transformers.processing_utils import ProcessorMixin


class ImageQwen2_5_VLProcessor(Qwen2_5_VLProcessor):
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
'''


def judge_tokenizer(words: list[str], phrases: list[str] = ()):
    """A lower-cased word-level tokenizer whose decode gives back the text exactly (as a byte-level one does, and as
    transformers serve's answer parser needs, which finds the assistant header in the decoded prompt): every word,
    punctuation run, space and newline is a token, and decoding concatenates them. `phrases` are single tokens as
    written (case and spaces kept: "Final Score: 4", "<answer>"), so a scripted judge can say them in one step."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate([*QWEN_VL_SPECIALS, "\n", " "])}
    for w in [*TEMPLATE_WORDS, *words]:
        vocab.setdefault(w.lower(), len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\w+|[^\w\s]+|\s"), behavior="removed", invert=True)
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(QWEN_VL_SPECIALS)
    tok.add_tokens([AddedToken(p, normalized=False, special=False) for p in phrases])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False, model_max_length=2048)


def save_tiny_qwen_judge(path, words: list[str], lookup: dict[str, str] | None = None,
                         script: dict[str, str] | None = None, seed: int = 0, template: str = JUDGE_TEMPLATE,
                         model_class=None, config_extra: dict | None = None, phrases: list[str] = ()) -> Path:
    """A random-weight Qwen2.5-VL judge (or `model_class` of its config) saved in `path`; with `lookup` (a word of
    the question -> the answer's first token) and `script` (a token -> the next one, "<eos>" for the end) a
    scripted one (module docstring)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    path = Path(path)
    tok = judge_tokenizer(words, phrases)
    tok.chat_template = template
    vocab = tok.get_vocab()
    ids = {f"{n}_token_id": vocab[f"<|{t}|>"] for n, t in (
        ("image", "image_pad"), ("video", "video_pad"), ("vision_start", "vision_start"), ("vision_end", "vision_end"))}
    eos, hidden = vocab["<|im_end|>"], 64
    if lookup is not None and len(vocab) > hidden:
        raise ValueError(f"a scripted judge needs at most {hidden} tokens (orthonormal embeddings), got {len(vocab)}")
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=hidden, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                         pad_token_id=tok.pad_token_id, eos_token_id=eos, bos_token_id=None,
                         tie_word_embeddings=False, rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=hidden,
                           patch_size=8, spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[0]),
        eos_token_id=eos, bos_token_id=None, pad_token_id=tok.pad_token_id, tie_word_embeddings=False, **ids,
        **(config_extra or {}))
    torch.manual_seed(seed)
    model = (model_class or Qwen2_5_VLForConditionalGeneration)(config).eval()
    if lookup is not None:
        _script(model, vocab, eos, hidden, lookup, script or {})
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    Qwen2VLImageProcessorPil(patch_size=8, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16,
                             max_pixels=64 * 64).save_pretrained(path)
    (path / "processing_image_qwen.py").write_text(PROCESSOR_CODE)
    (path / "processor_config.json").write_text(json.dumps({
        "processor_class": "ImageQwen2_5_VLProcessor",
        "auto_map": {"AutoProcessor": "processing_image_qwen.ImageQwen2_5_VLProcessor"}}))
    (path / "chat_template.jinja").write_text(template)
    return path


def _script(model, vocab: dict, eos: int, hidden: int, lookup: dict[str, str], script: dict[str, str]) -> None:
    """Set the one decoder layer and lm_head of a scripted judge (module docstring)."""
    lm = model.model.language_model
    (layer,) = lm.layers
    attn, head_dim = layer.self_attn, hidden // 2
    pair = head_dim // 2 - 1  # the rotary pair of the lowest frequency: dims `pair` and `pair + head_dim // 2`
    if len(lookup) > head_dim:
        raise ValueError(f"at most {head_dim} lookup words")
    with torch.no_grad():
        emb = torch.linalg.qr(torch.randn(hidden, hidden))[0][: len(vocab)]  # orthonormal token embeddings
        lm.embed_tokens.weight.copy_(emb)
        layer.mlp.down_proj.weight.zero_()
        for lin in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
            lin.weight.zero_()
            if lin.bias is not None:
                lin.bias.zero_()
        attn.q_proj.weight[pair] = emb[vocab["\n"]]  # head 0's query: only at "\n"
        for j, word in enumerate(lookup):
            attn.k_proj.weight[pair] += 2.0 * emb[vocab[word]]  # score ~ 11 · 2 = 23 for a lookup word, 0 else
            attn.v_proj.weight[j] = emb[vocab[word]]  # value dim j: 8 (the normed input's scale) for word j
            attn.o_proj.weight[:, j] = emb[vocab[word]] / 8.0  # back to the word's embedding
        model.lm_head.weight.zero_()
        for word, first in lookup.items():
            model.lm_head.weight[vocab[first]] += 10.0 * emb[vocab[word]]
        for cur, nxt in script.items():
            model.lm_head.weight[eos if nxt == "<eos>" else vocab[nxt]] += 10.0 * emb[vocab[cur]]

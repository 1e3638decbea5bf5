"""A random Qwen2.5-VL (transformers' Qwen2_5_VLForConditionalGeneration) with its processor, built
offline and saved with save_pretrained: what `ditdata caption --captioner DIR` loads through the real
path. tests/test_caption.py uses a tiny one; bench/caption.py a wider one for speed."""

from __future__ import annotations

from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>"]
# Qwen's chat form: each message between <|im_start|>ROLE and <|im_end|>, an image as its three tokens
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}"
            "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}"
            "{% endif %}{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% endif %}")


def byte_tokenizer(specials: list[str], **tokens):
    """A byte-level BPE tokenizer without merges (every byte a token) with `specials` added, as
    transformers' PreTrainedTokenizerFast; `tokens`: its special-token keywords (eos_token=, ...)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))},
                              merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tk, **tokens)


def save_random(folder: Path, model_class, config, processor, **generation) -> Path:
    """A random `model_class(config)` (torch seed 0) in eval mode, `generation` set on its generation
    config, saved with save_pretrained into `folder` beside `processor`: `folder`."""
    import torch

    torch.manual_seed(0)
    model = model_class(config).eval()
    for key, value in generation.items():
        setattr(model.generation_config, key, value)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def random_qwen_vl(folder: Path, *, text: dict, vision: dict, max_patches: int) -> Path:
    """Saves into `folder` a random Qwen2.5-VL whose text decoder and vision tower have the sizes in
    `text` and `vision` (Qwen2_5_VLConfig's text_config / vision_config keys), a byte_tokenizer and a
    processor that resizes an image to at most `max_patches` 28-pixel patches (4 at the least).
    Seeded: the same folder every time."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
    )
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    tok = byte_tokenizer(SPECIALS, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    ids = {s: tok.convert_tokens_to_ids(s) for s in SPECIALS}
    image_processor = Qwen2VLImageProcessor(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * max_patches)
    processor = Qwen2_5_VLProcessor(image_processor=image_processor, tokenizer=tok,
                                    video_processor=Qwen2VLVideoProcessor(), chat_template=TEMPLATE)
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tok), bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                         pad_token_id=ids["<|endoftext|>"], **text),
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    return save_random(folder, Qwen2_5_VLForConditionalGeneration, config, processor,
                       eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])

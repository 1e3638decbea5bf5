"""Tiny random transformers text encoders (T5, Gemma-2) with offline tokenizers, saved with
save_pretrained into a folder: what `--text-encoder DIR` loads through the real path; and a store
encoded with one (encode_with)."""

from __future__ import annotations

from pathlib import Path

WORDS = ("a photo of the cat dog on red blue mat in house sleeping busy city street with many people "
         "user prompt : - . , given generate enhanced").split()


def tokenizer(kind: str):
    """A word-level fast tokenizer: T5's appends </s>, Gemma's puts <bos> first."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "</s>", "<unk>", "<bos>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(set(WORDS)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if kind == "t5":
        tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
        return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   bos_token="<bos>")


def save_text_encoder(folder, kind: str = "t5", width: int = 32, seed: int = 0) -> Path:
    """A random T5EncoderModel or Gemma2Model (width `width`) and its tokenizer, saved in `folder`."""
    import torch
    from transformers import Gemma2Config, Gemma2Model, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    tok = tokenizer(kind)
    n = len(tok)
    if kind == "t5":
        model = T5EncoderModel(T5Config(vocab_size=n, d_model=width, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                        relative_attention_num_buckets=8, feed_forward_proj="gated-gelu",
                                        pad_token_id=0, eos_token_id=1))
    else:
        model = Gemma2Model(Gemma2Config(vocab_size=n, hidden_size=width, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         pad_token_id=0, bos_token_id=3, eos_token_id=1, sliding_window=16,
                                         attn_implementation="eager"))
    folder = Path(folder)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def encode_with(shards, out, text_encoder, **config):
    """`ditdata encode` (ditdata.encode, in-process) of image `shards` into a 16 px pixels store `out`
    whose captions `text_encoder` (a folder) embeds: one process, on the CPU, chunks of 2 samples;
    `config`: EncodeConfig's other fields (they override these)."""
    from ditdata.encode import EncodeConfig, encode

    cfg = dict(shards=str(shards), out=str(out), vae="pixels", resolution=16, text_encoder=str(text_encoder),
               workers=0, progress=False, device="cpu", chunk_samples=2)
    return encode(EncodeConfig(**(cfg | config)))

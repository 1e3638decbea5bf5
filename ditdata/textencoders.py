"""Caption encoders for text-conditioned stores: the registry of `--text-encoder NAME`.

    from ditdata.textencoders import load_text_encoder
    enc = load_text_encoder("t5-v1_1-xxl", device="cuda")      # or a folder, or a hub id
    flat, lengths = enc.embed_ragged(captions)                   # (sum L_i, W) float32, (B,) int64
    enc.embed_text(captions, tokens=True)                        # text_tokens (B, L, W), text_mask (B, L)
    enc.empty_caption()                                          # the embedding of "" (B = 1)

Two families sit behind one name space:

- open_clip towers (ViT-B-32, ViT-L-14, ...: any open_clip model name), the path that was
  there before (ditdata.clip.load_clip, with --text-pretrained TAG_OR_FILE): a pooled
  embedding and per-token outputs PADDED to the context length (77), stored per sample as
  text_pooled, text_tokens, text_mask, exactly as before;
- transformers encoders (TEXT_ENCODERS below), whose token embeddings are stored UNPADDED
  (each caption at its own length, ditdata.store.schema's ragged fields), with no pooled
  embedding. Each entry follows its reference, recorded in the manifest ("convention"):

  t5 (T5 v1.1 XXL, flan-t5-xl; PixArt-alpha / PixArt-Sigma, diffusers' PixArtAlphaPipeline
      .encode_prompt): T5EncoderModel's last hidden state (after the final RMSNorm) of the
      caption tokenized with add_special_tokens=True (so it ends in </s>), truncated to the max
      tokens (120 in PixArt-alpha, 300 in PixArt-Sigma: --text-max-tokens 300), the attention
      mask over the real tokens; the unconditional input is the embedding of "" made the same
      way (the </s> token alone: length 1), which PixArt computes once and stores.
  gemma2 (Gemma-2-2B as SANA uses it, diffusers' SanaPipeline.encode_prompt): the "complex
      human instruction" (SANA_INSTRUCTION, its lines joined by newlines) is put before the
      caption; the whole is tokenized with <bos>, truncated to n_instruction + max_tokens - 2
      tokens (n_instruction counted with its <bos>) and run through Gemma2Model (the decoder
      without the LM head: its last hidden state after the final norm); of that sequence,
      position 0 (<bos>) and the last max_tokens - 1 positions of the padded sequence are kept,
      which for a right-padded sequence is <bos>, the instruction's last token and the caption's
      tokens. The unconditional input is "" WITHOUT the instruction and without that selection
      (SANA: complex_human_instruction=False for the negative prompt): <bos> alone.

  Captions go in as given: no caption cleaning (diffusers' clean_caption needs bs4/ftfy; with
  it off, its pipelines lower-case and strip the PROMPT, which the references' training
  feature extraction does not do to captions).

A name is resolved in this order: a preset of TEXT_ENCODERS (its hub id, looked up in the local
Hugging Face cache only); a local folder saved with save_pretrained (config.json with
model_type t5 or gemma2, the tokenizer beside it); a hub id ORG/NAME in the local cache; else an
open_clip model name. Nothing is downloaded: a hub model that is not cached fails at once in
one line naming the `hf download` command. Weights load in bfloat16 on CUDA and float32 on the
CPU; embeddings come back as float32 on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ditdata.common.errors import described
from ditdata.common.files import sha256_file
from ditdata.common.hub import cached_snapshot, required_weights, saved_model_type
from ditdata.errors import DitdataError

if TYPE_CHECKING:
    import numpy as np
    import torch

# SANA's instruction before each caption (diffusers' SanaPipeline.__call__ default and
# NVlabs/Sana's config: complex_human_instruction), one string per line.
SANA_INSTRUCTION = (
    "Given a user prompt, generate an 'Enhanced prompt' that provides detailed visual descriptions suitable for "
    "image generation. Evaluate the level of detail in the user prompt:",
    "- If the prompt is simple, focus on adding specifics about colors, shapes, sizes, textures, and spatial "
    "relationships to create vivid and concrete scenes.",
    "- If the prompt is already detailed, refine and enhance the existing details slightly without "
    "overcomplicating.",
    "Here are examples of how to transform or refine prompts:",
    "- User Prompt: A cat sleeping -> Enhanced: A small, fluffy white cat curled up in a round shape, sleeping "
    "peacefully on a warm sunny windowsill, surrounded by pots of blooming red flowers.",
    "- User Prompt: A busy city street -> Enhanced: A bustling city street scene at dusk, featuring glowing street "
    "lamps, a diverse crowd of people in colorful clothing, and a double-decker bus passing by towering glass "
    "skyscrapers.",
    "Please generate only the enhanced description for the prompt below and avoid including any additional "
    "commentary or evaluations:",
    "User Prompt: ",
)


@dataclass(frozen=True)
class Preset:
    """One registry entry: the hub repository, the model_type it must hold, the reference's max
    tokens and instruction, and where the convention comes from."""

    repo: str
    model_type: str  # "t5" or "gemma2": the convention (module docstring)
    max_tokens: int
    reference: str
    instruction: tuple[str, ...] | None = None


# --text-encoder NAME -> its preset. Adding one: an entry here (and, for a new convention, a
# MODEL_TYPES row and its branch in TransformersTextEncoder), and its row in docs/extending.md.
TEXT_ENCODERS: dict[str, Preset] = {
    "t5-v1_1-xxl": Preset("google/t5-v1_1-xxl", "t5", 120, "PixArt-alpha (120 tokens), PixArt-Sigma (300)"),
    "flan-t5-xl": Preset("google/flan-t5-xl", "t5", 120, "T5 convention of PixArt-alpha"),
    "gemma-2-2b": Preset("google/gemma-2-2b-it", "gemma2", 300, "SANA (Gemma-2-2B-IT, complex human instruction)",
                         SANA_INSTRUCTION),
}
# model_type of a folder's config.json -> (transformers class, the reference's max tokens, instruction)
MODEL_TYPES = {"t5": ("T5EncoderModel", 120, None), "gemma2": ("Gemma2Model", 300, SANA_INSTRUCTION)}
INSTRUCTIONS = ("reference", "none")  # --text-instruction: the preset's own (SANA's for gemma2), or none


def is_transformers_encoder(name: str) -> bool:
    """Whether --text-encoder NAME names a transformers encoder (a preset, a folder, a hub id)
    rather than an open_clip model; decided without importing anything heavy."""
    if name in TEXT_ENCODERS:
        return True
    p = Path(name).expanduser()
    if p.is_dir():
        return True
    return "/" in name and not name.startswith(("hf-hub:", "/", ".", "~"))


def load_text_encoder(name: str, device="cpu", *, max_tokens: int | None = None, instruction: str = "reference",
                      pretrained: str | None = None, config: str | None = None):
    """The encoder --text-encoder NAME names: a TransformersTextEncoder, or for an open_clip
    model name ditdata.clip.load_clip(name, pretrained, config=config) (module docstring)."""
    if not is_transformers_encoder(name):
        if name.startswith(("/", ".", "~")):  # a folder that is not there, not an open_clip name
            raise DitdataError(f"text encoder folder {name} not found (a folder saved with save_pretrained, a "
                               f"preset: {', '.join(TEXT_ENCODERS)}, a cached hub id, or an open_clip model)")
        from ditdata.clip import load_clip

        return load_clip(name, pretrained, device=device, config=config)
    if instruction not in INSTRUCTIONS:
        raise DitdataError(f"--text-instruction {instruction!r}: use one of {', '.join(INSTRUCTIONS)}")
    preset = TEXT_ENCODERS.get(name)
    if preset is not None:
        folder, revision, ident = _cached(preset.repo, name), None, preset.repo
        revision = folder.name
    elif Path(name).expanduser().is_dir():
        folder, revision, ident = Path(name).expanduser().resolve(), None, str(Path(name).expanduser().resolve())
    else:
        folder = _cached(name, name)
        revision, ident = folder.name, name
    return _from_dir(folder, name, ident, revision, device, max_tokens, instruction, preset)


def store_text_encoder(store, device="cpu", *, pretrained: str | None = None):
    """The caption encoder a store was made with (its manifest's conditioning.text): the
    transformers encoder it names (its folder, or its hub id in the local cache; `pretrained`
    a folder that holds it instead), with the recorded max tokens and instruction; for an
    open_clip store, ditdata.clip.store_text_encoder."""
    text = store.conditioning.text or {}
    if text.get("layout") != "ragged":
        from ditdata.clip import store_text_encoder as clip_encoder

        return clip_encoder(store, device, pretrained=pretrained)
    name = pretrained or text.get("path") or text.get("id") or text["encoder"]
    if not pretrained and text.get("path") and not Path(text["path"]).is_dir():
        raise DitdataError(f"the store's text encoder {text['path']} is not there (moved, or the store was made on "
                           "another machine)")
    enc = load_text_encoder(name, device, max_tokens=text.get("max_tokens"),
                            instruction="reference" if text.get("instruction") else "none")
    want = text.get("token_dim")
    if want and enc.info["token_dim"] != want:
        raise DitdataError(f"text encoder {name} gives {enc.info['token_dim']}-wide tokens, the store's are {want} "
                           "wide: not the encoder the store was made with")
    return enc


def _cached(repo: str, name: str) -> Path:
    """The snapshot folder of hub `repo` in the local cache, or one line naming `hf download`."""
    return cached_snapshot(repo, "text encoder", name, "data",
                           "a local folder saved with save_pretrained (--text-encoder DIR)", DitdataError)


def _from_dir(folder: Path, name: str, ident: str, revision: str | None, device, max_tokens: int | None,
              instruction: str, preset: Preset | None) -> TransformersTextEncoder:
    import torch

    from ditdata.common.devices import resolve_device

    kind = saved_model_type(folder, MODEL_TYPES, f"text encoder {name}", " (and its tokenizer)", DitdataError)
    if preset is not None and preset.model_type != kind:
        raise DitdataError(f"text encoder {name}: {folder} holds a {kind} model, the preset is {preset.model_type}")
    files, safe = required_weights(folder, holds="a folder saved with save_pretrained holds config.json, "
                                   "model.safetensors and the tokenizer files", error=DitdataError)
    cls_name, ref_tokens, ref_instruction = MODEL_TYPES[kind]
    if preset is not None:
        ref_tokens, ref_instruction = preset.max_tokens, preset.instruction
    max_tokens = ref_tokens if max_tokens is None else int(max_tokens)
    if max_tokens < 1 or (kind == "gemma2" and max_tokens < 2):
        raise DitdataError(f"--text-max-tokens {max_tokens}: at least {2 if kind == 'gemma2' else 1}")
    lines = ref_instruction if instruction == "reference" else None
    dev = resolve_device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    from ditdata.autoencoders.kinds import quiet_transformers

    transformers = quiet_transformers(f"text encoder {name}", "data")
    try:
        model = getattr(transformers, cls_name).from_pretrained(str(folder), local_files_only=True,
                                                                 use_safetensors=safe, dtype=dtype)
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # corrupt or incompatible files, no tokenizer: one line for the CLI
        raise DitdataError(f"cannot load text encoder {name} from {folder}: {described(e)}") from e
    model.to(dev).eval()
    info = {
        "encoder": name, "kind": "transformers", "model_type": kind, "class": cls_name, "id": ident,
        "path": str(folder) if ident == str(folder) else None, "revision": revision,
        "weights_sha256": {f: sha256_file(folder / f) for f in files},
        "token_dim": int(model.config.hidden_size if kind == "gemma2" else model.config.d_model),
        "max_tokens": max_tokens, "pooled_dim": None,
        "instruction": "\n".join(lines) if lines else None,
        "convention": _convention(kind, max_tokens, lines, preset),
    }
    return TransformersTextEncoder(model, tokenizer, info, dev)


def _convention(kind: str, max_tokens: int, lines, preset: Preset | None) -> str:
    ref = preset.reference if preset is not None else {"t5": "PixArt-alpha", "gemma2": "SANA"}[kind]
    if kind == "t5":
        return (f"{ref}: T5EncoderModel last_hidden_state of the caption with </s> (add_special_tokens), truncated "
                f"to {max_tokens} tokens, attention mask over the real tokens; unpadded; empty prompt = ''")
    inst = "SANA's complex human instruction before the caption" if lines else "no instruction"
    return (f"{ref}: {inst}; Gemma2Model last_hidden_state; <bos> + the last {max_tokens - 1} positions of the "
            f"n_instruction + {max_tokens} - 2 token sequence (diffusers select_index); unpadded; empty prompt = '' "
            "without the instruction")


class TransformersTextEncoder:
    """A T5 or Gemma-2 encoder with its tokenizer, in eval mode on its device; `info` is what the
    manifest records (module docstring: the conventions)."""

    def __init__(self, model, tokenizer, info: dict, device):
        import torch

        self.model, self.tokenizer, self.info = model, tokenizer, dict(info)
        self.device = torch.device(device)
        self.max_tokens = int(info["max_tokens"])
        self.kind = info["model_type"]
        inst = info.get("instruction")
        # SANA counts the instruction's tokens as tokenizer.encode gives them (with <bos>)
        self._n_inst = len(tokenizer.encode(inst)) if inst else 0

    def token_ids(self, captions: list[str], *, empty: bool = False) -> tuple[list[list[int]], list[int]]:
        """(each caption's token ids as the model sees them, the position where its kept tokens
        begin after position 0: 0 = all kept). `empty`: the unconditional convention."""
        tok, out, first = self.tokenizer, [], []
        inst = None if empty else self.info.get("instruction")
        if self.kind == "gemma2" and inst:
            total = self._n_inst + self.max_tokens - 2  # SANA's max_length_all
            for c in captions:
                ids = tok(inst + c, truncation=True, max_length=total, add_special_tokens=True)["input_ids"]
                out.append(ids)
                first.append(total - (self.max_tokens - 1))  # select_index: [0] + range(-(max - 1), 0)
            return out, first
        for c in captions:
            out.append(tok(c, truncation=True, max_length=self.max_tokens, add_special_tokens=True)["input_ids"])
            first.append(0)
        return out, first

    def embed_ragged(self, captions: list[str], *, empty: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(the kept tokens' embeddings of every caption, one after the other, (sum L_i, W)
        float32 on the CPU; their counts L_i (B,) int64)."""
        import torch

        ids, first = self.token_ids(list(captions), empty=empty)
        if not ids:
            return torch.zeros(0, self.info["token_dim"]), torch.zeros(0, dtype=torch.int64)
        n = max(len(i) for i in ids)
        pad = self.tokenizer.pad_token_id or 0
        x = torch.full((len(ids), n), pad, dtype=torch.long)
        mask = torch.zeros((len(ids), n), dtype=torch.long)
        for r, row in enumerate(ids):  # right padding: real positions do not see the pads
            x[r, :len(row)] = torch.tensor(row)
            mask[r, :len(row)] = 1
        with torch.inference_mode():
            h = self.model(input_ids=x.to(self.device), attention_mask=mask.to(self.device)).last_hidden_state
        h = h.float().cpu()
        parts, lengths = [], []
        for r, row in enumerate(ids):
            keep = list(range(len(row))) if first[r] == 0 else [0, *range(first[r], len(row))]
            parts.append(h[r, keep])
            lengths.append(len(keep))
        return torch.cat(parts), torch.tensor(lengths, dtype=torch.int64)

    def embed_text(self, captions: list[str], *, tokens: bool = True, normalize: bool = False) -> dict:
        """{"text_tokens": (B, L, W) float32, "text_mask": (B, L) bool} padded to the longest caption
        of the batch (what `dittrain sample --prompt` feeds the model); no pooled embedding."""
        import torch

        flat, lengths = self.embed_ragged(captions)
        L = int(lengths.max()) if len(lengths) else 0
        mask = torch.arange(L)[None, :] < lengths[:, None]
        out = torch.zeros((len(lengths), L, flat.shape[-1]))
        out[mask] = flat
        return {"text_tokens": out, "text_mask": mask}

    def empty_caption(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The unconditional input: the embedding of "" ((L, W), L its length)."""
        return self.embed_ragged([""], empty=True)


def token_counts(lengths: np.ndarray) -> dict:
    """Length statistics of a store's captions (the manifest's and inspect's)."""
    import numpy as np

    lengths = np.asarray(lengths)
    if not len(lengths):
        return {"count": 0}
    return {"count": int(len(lengths)), "mean": round(float(lengths.mean()), 2), "min": int(lengths.min()),
            "p50": int(np.percentile(lengths, 50)), "p95": int(np.percentile(lengths, 95)), "max": int(lengths.max())}

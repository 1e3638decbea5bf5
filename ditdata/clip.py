"""open_clip models, loaded offline: the one place that builds a CLIP model.

Used by `ditdata score` (image-caption similarity) and by `ditdata encode` (caption text
embeddings for text-conditioned training).

    from ditdata.clip import load_clip
    clip = load_clip("ViT-B-32", "laion2b_s34b_b79k", device="cuda")
    clip.score(images, captions)                       # (B,) cosine similarity
    clip.embed_text(captions, tokens=True)             # text_pooled, text_tokens, text_mask

`pretrained` is one of

- an open_clip pretrained TAG of the model (`open_clip.list_pretrained_tags_by_model`),
  e.g. "laion2b_s34b_b79k" or "openai". Nothing is downloaded: the weights file open_clip
  would fetch for the tag is looked up in the local Hugging Face cache
  (`ditdata.common.hub.hub_cache_dir`: HF_HUB_CACHE, else HF_HOME/hub, else
  ~/.cache/huggingface/hub; the safetensors variant first, as open_clip does) and in
  open_clip's URL cache (~/.cache/clip). When it is there, the model is built by the
  real open_clip path `create_model_and_transforms(name, pretrained=<that file>)`
  with the tag's preprocessing (mean, std, interpolation, resize mode) and its QuickGELU
  setting (the tag records which activation the weights were trained with); when it is
  not, DitdataError says at once which repository and file to copy in (no download, no
  retries);
- a local weights FILE (.pt/.pth/.bin/.safetensors: an open_clip state dict or a
  checkpoint with "state_dict"), loaded through the same path with the model config's own
  preprocessing. A file says nothing about its activation: for weights trained with
  QuickGELU (OpenAI's and LAION-400M's) name the model ViT-B-32-quickgelu and so on;
- None: random initialisation (speed benchmarks only; the scores mean nothing).

`config` is an optional model-config JSON (embed_dim, vision_cfg, text_cfg: the format of
open_clip's model_configs/*.json). It is registered with `open_clip.add_model_config`; the
model name is then the file's stem, so small or custom architectures work offline.

Devices and precision follow `ditdata.common.devices`: inference runs under bf16 autocast
on CUDA devices (fp16 where the GPU has no bf16) and in fp32 on the CPU; embeddings and
scores come back as float32 (masks as bool) on the CPU, pixels (`pixels`,
`preprocess_images`) on the model's device.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from ditdata.common import files
from ditdata.common.errors import described
from ditdata.common.extras import require
from ditdata.common.hub import download_command, hub_cache_dir
from ditdata.errors import DitdataError

if TYPE_CHECKING:
    import torch

# open_clip's names for the default weights file of a Hugging Face repo (constants.py)
HF_WEIGHTS_NAME = "open_clip_pytorch_model.bin"
HF_SAFE_WEIGHTS_NAME = "open_clip_model.safetensors"
WEIGHT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors", ".ckpt", ".npz")


# ----------------------------------------------------------------------------- resolving


def openclip_url_cache() -> Path:
    """Where open_clip's download_pretrained_from_url stores files (its default)."""
    return Path("~/.cache/clip").expanduser()


def _open_clip():
    """open_clip, or the one-line error naming the extra that brings it."""
    return require("open_clip", "CLIP models (ditdata score, encode --text-encoder, sample --prompt)", "data",
                   DitdataError)


def register_config(config) -> str:
    """Register a model-config JSON with open_clip; returns the model name (file stem)."""
    open_clip = _open_clip()

    from ditdata.jsondocs import load_json

    p = Path(config)
    if not p.is_file():
        raise DitdataError(f"{p}: CLIP model config not found")
    cfg = load_json(p, "unreadable CLIP model config")
    missing = [k for k in ("embed_dim", "vision_cfg", "text_cfg") if not isinstance(cfg, dict) or k not in cfg]
    if missing:
        raise DitdataError(f"{p}: not an open_clip model config (missing {', '.join(missing)})")
    if p.resolve() not in [Path(q).resolve() for q in open_clip.factory._MODEL_CONFIG_PATHS]:
        open_clip.add_model_config(p)
    else:
        open_clip.factory._rescan_model_configs()  # the file may have changed
    return p.stem


def resolve_pretrained(name: str, pretrained: str | None, *, config: str | None = None) -> dict:
    """Where the weights of (name, pretrained) are on THIS machine, without loading them.

    Returns {"model", "pretrained", "tag", "file", "weights_sha256", "tag_cfg"}:
    "pretrained" is what identifies the weights in outputs (the normalised tag, an
    absolute file path, or None), "file" the file to load. DitdataError when the model is
    unknown or the weights are not available offline."""
    open_clip = _open_clip()

    if config is not None:
        stem = register_config(config)
        if name and name != stem:
            raise DitdataError(
                f"--clip {name!r} does not match the config file {config} (a registered config is "
                f"named after its file stem: {stem!r})"
            )
        name = stem
    if not name:
        raise DitdataError("no CLIP model name given")
    if ":" in name:
        raise DitdataError(
            f"CLIP model {name!r}: schemas such as hf-hub: are not supported offline; pass the open_clip "
            f"model name (e.g. ViT-B-32) with --pretrained TAG or a weights file, or --clip-config JSON"
        )
    if name not in open_clip.list_models():
        raise DitdataError(
            f"unknown open_clip model {name!r} (see open_clip.list_models(), e.g. ViT-B-32, ViT-L-14; "
            f"or register an architecture with --clip-config FILE.json)"
        )
    out = {"model": name, "pretrained": None, "tag": None, "file": None, "weights_sha256": None, "tag_cfg": {}}
    if pretrained is None:
        return out
    pretrained = str(pretrained)
    tag_cfg = open_clip.get_pretrained_cfg(name, pretrained)
    if tag_cfg:
        tag = pretrained.lower().replace("-", "_")  # open_clip's _clean_tag
        path = _find_tag_weights(name, tag, tag_cfg)
        out.update(pretrained=tag, tag=tag, file=str(path), tag_cfg=dict(tag_cfg))
    else:
        p = Path(pretrained).expanduser()
        if p.is_file():
            out.update(pretrained=str(p.resolve()), file=str(p.resolve()))
        else:
            tags = open_clip.list_pretrained_tags_by_model(name)
            looks_like_path = os.sep in pretrained or pretrained.endswith(WEIGHT_SUFFIXES)
            if looks_like_path:
                raise DitdataError(f"CLIP weights file {pretrained} not found")
            known = f"known tags: {', '.join(tags)}" if tags else "it has no pretrained tags in open_clip"
            raise DitdataError(
                f"--pretrained {pretrained!r} is neither a pretrained tag of {name} ({known}) nor an "
                f"existing weights file"
            )
    out["weights_sha256"] = weights_sha256(out["file"])
    return out


def _find_tag_weights(name: str, tag: str, cfg: dict) -> Path:
    """The local copy of the file open_clip would download for (name, tag), or DitdataError."""
    if cfg.get("file"):
        p = Path(cfg["file"]).expanduser()
        if p.is_file():
            return p
    looked: list[str] = []
    how: list[str] = []
    hub = cfg.get("hf_hub") or ""
    if hub:
        from huggingface_hub import try_to_load_from_cache

        repo, filename = os.path.split(hub)  # as open_clip: "org/repo/" = the default file
        filename = filename or HF_WEIGHTS_NAME
        cache = hub_cache_dir()
        safe = []  # open_clip prefers a .safetensors sibling of the named file (pretrained.py)
        if filename == HF_WEIGHTS_NAME:
            safe = [HF_SAFE_WEIGHTS_NAME]
        elif filename.endswith((".bin", ".pth")):
            safe = [filename[:-4] + ".safetensors"]
        for fn in safe + [filename]:
            try:
                hit = try_to_load_from_cache(repo, fn, cache_dir=str(cache))
            except Exception:
                hit = None
            if isinstance(hit, str) and Path(hit).is_file():
                return Path(hit)
        looked.append(f"the Hugging Face cache {cache} (repo {repo}, file {filename})")
        how.append(
            f"on a machine with internet run `{download_command(repo, filename)}` and copy its "
            f"Hugging Face cache folder (~/.cache/huggingface/hub) here, or point HF_HOME / HF_HUB_CACHE at it"
        )
    url = cfg.get("url") or ""
    if url:
        p = openclip_url_cache() / os.path.basename(url)
        if p.is_file():
            return p
        looked.append(f"open_clip's cache {p}")
        if not hub:
            how.append(f"download {url} on a machine with internet and put it at {p}")
    how.append("or pass --pretrained /path/to/weights-file (.bin, .pt or .safetensors)")
    raise DitdataError(
        f"CLIP weights for {name} / {tag} are not available offline: not found in "
        f"{' or '.join(looked) or 'any local cache'}. To supply them, {'; '.join(how)}"
    )


_SHA_CACHE: dict[tuple, str] = {}


def weights_sha256(path) -> str:
    """`files.sha256_file`, remembered per (path, size, mtime) for this process: a run
    resolves the same weights more than once (`ditdata score` checks, then loads)."""
    st = os.stat(path)
    ident = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns)
    if ident not in _SHA_CACHE:
        _SHA_CACHE[ident] = files.sha256_file(path)
    return _SHA_CACHE[ident]


# ----------------------------------------------------------------------------- loading


def store_text_encoder(store, device="cpu", *, pretrained: str | None = None) -> ClipModel:
    """The caption encoder a latent store was made with (its manifest's conditioning), its
    weights from `pretrained` when given: embed_text(captions, tokens=...)."""
    from ditdata.store import MANIFEST, StoreError

    text = store.conditioning.text
    if not text:
        raise StoreError(f"{store.root / MANIFEST}: this store has no text conditioning")
    return load_clip(text["model"], pretrained or text.get("pretrained"), device=device, config=text.get("config"))


def load_clip(name: str, pretrained: str | None, device="cpu", *, config: str | None = None) -> ClipModel:
    """Build an open_clip model with its preprocessing and tokenizer (module docstring)."""
    import logging

    from ditdata.common.devices import resolve_device

    open_clip = _open_clip()

    res = resolve_pretrained(name, pretrained, config=config)
    dev = resolve_device(device)
    tag_cfg = res["tag_cfg"]
    kwargs = {}
    if tag_cfg:
        kwargs = dict(
            image_mean=tag_cfg.get("mean"),
            image_std=tag_cfg.get("std"),
            image_interpolation=tag_cfg.get("interpolation"),
            image_resize_mode=tag_cfg.get("resize_mode"),
            force_quick_gelu=bool(tag_cfg.get("quick_gelu", False)),
        )
    root = logging.getLogger()
    level = root.level
    if res["file"] is None:
        root.setLevel(max(level, logging.ERROR))  # "initialized randomly" is the point here
    try:
        with _offline():
            model, _, preprocess = open_clip.create_model_and_transforms(
                res["model"], pretrained=res["file"], device=dev, precision="fp32", **kwargs
            )
            tokenizer = open_clip.get_tokenizer(res["model"])
    except DitdataError:
        raise
    except Exception as e:
        what = f"{res['model']} with weights {res['file']}" if res["file"] else res["model"]
        raise DitdataError(f"cannot build CLIP model {what}: {described(e)}") from e
    finally:
        root.setLevel(level)
    model.eval()
    info = {
        "model": res["model"],
        "pretrained": res["pretrained"],
        "weights_sha256": res["weights_sha256"],
    }
    return ClipModel(model, preprocess, tokenizer, info, dev)


@contextmanager
def _offline():
    """Hugging Face offline mode while open_clip builds the model and tokenizer: a model
    whose text tower or tokenizer comes from the hub (e.g. xlm-roberta) then fails at
    once instead of trying the network."""
    saved = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    constants = sys.modules.get("huggingface_hub.constants")
    before = getattr(constants, "HF_HUB_OFFLINE", None)
    if constants is not None:
        constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if constants is not None:
            constants.HF_HUB_OFFLINE = before


class ClipModel:
    """An open_clip model in eval mode with its own preprocessing and tokenizer.

    info: {"model", "pretrained" (tag, absolute file path or None), "weights_sha256",
    "embed_dim" (D of pooled image/text embeddings), "context_length" (L, tokens per
    caption), "token_dim" (W, width of the text transformer's per-token outputs)}."""

    def __init__(self, model, preprocess, tokenizer, info: dict, device):
        import torch

        from ditdata.common.devices import amp_dtype

        self.model = model
        self.preprocess = preprocess
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self._amp = amp_dtype(self.device)  # bf16 / fp16 on GPUs, None (fp32) on the CPU
        token_dim, self._pad_id = _text_dims(model)
        self._pil_part, self._mean, self._std = _split_preprocess(preprocess)
        visual = model.visual  # D, the pooled embeddings' width: the image tower's output size
        if getattr(visual, "output_dim", None):
            embed_dim = visual.output_dim
        elif getattr(visual, "proj", None) is not None:
            embed_dim = visual.proj.shape[-1]
        else:
            raise DitdataError("cannot determine the CLIP embedding size")
        # L, tokens per caption: the tokenizer's, else the model's
        context_length = getattr(tokenizer, "context_length", None) or getattr(model, "context_length", None)
        if context_length is None:
            raise DitdataError("cannot determine the CLIP text context length")
        self.info = dict(info)
        self.info["embed_dim"] = int(embed_dim)
        self.info["context_length"] = int(context_length)
        self.info["token_dim"] = int(token_dim)

    def _autocast(self):
        from ditdata.common.devices import autocast

        return autocast(self.device, self._amp)

    # -- images

    def prepare_image(self, img):
        """One RGB PIL image -> what `pixels` batches. Thread-safe, meant for decoding
        workers. When the model's preprocessing ends in ToTensor + Normalize (every
        open_clip inference transform), only the PIL steps (resize, crop) run here and a
        (H, W, 3) uint8 array comes back: no torch ops, so threads do not fight over
        torch's intra-op thread pool. Otherwise the whole preprocessing runs here and a
        (3, H, W) float32 tensor comes back."""
        if self._pil_part is not None:
            import numpy as np

            a = np.asarray(self._pil_part(img))
            if a.dtype == np.uint8 and a.ndim == 3 and a.shape[2] == 3:
                return a
        return self.preprocess(img)

    def pixels(self, prepared: list):
        """Batch prepared images into (B, 3, H, W) float32 pixels on the model's device.
        ToTensor + Normalize are applied to the whole uint8 batch with the same float32
        operations as torchvision's (x / 255, then (x - mean) / std, element by element),
        so the pixels are bit-identical to `preprocess(img)`."""
        import numpy as np
        import torch

        if prepared and all(isinstance(a, np.ndarray) for a in prepared) and len({a.shape for a in prepared}) == 1:
            x = torch.from_numpy(np.stack(prepared)).to(self.device, non_blocking=True)
            return self._to_float(x)
        return torch.stack([
            self._to_float(torch.from_numpy(np.ascontiguousarray(a))[None].to(self.device))[0]
            if isinstance(a, np.ndarray) else a.to(self.device)
            for a in prepared
        ])

    def _to_float(self, x):
        """(B, H, W, 3) uint8 -> (B, 3, H, W) float32 normalised (torchvision's arithmetic)."""
        import torch

        x = x.permute(0, 3, 1, 2).contiguous().to(torch.float32).div(255)
        mean = torch.as_tensor(self._mean, dtype=torch.float32, device=x.device).view(1, -1, 1, 1)
        std = torch.as_tensor(self._std, dtype=torch.float32, device=x.device).view(1, -1, 1, 1)
        return x.sub_(mean).div_(std)

    def preprocess_images(self, images) -> torch.Tensor:
        """PIL images -> (B, 3, H, W) float32 pixels on the model's device, the model's own
        preprocessing."""
        return self.pixels([self.prepare_image(im) for im in images])

    def embed_pixels(self, pixels) -> torch.Tensor:
        """Preprocessed pixels (B, 3, H, W) -> (B, D) L2-normalised float32 on the CPU."""
        import torch
        import torch.nn.functional as F

        with torch.inference_mode(), self._autocast():
            x = self.model.encode_image(pixels.to(self.device, non_blocking=True))
        return F.normalize(x.float(), dim=-1).cpu()

    def embed_images(self, images) -> torch.Tensor:
        """PIL images -> (B, D) L2-normalised image embeddings (float32, CPU)."""
        return self.embed_pixels(self.preprocess_images(images))

    # -- text

    def tokenize(self, captions: list[str]) -> torch.Tensor:
        """(B, L) token ids; captions longer than L tokens are cut, keeping the end token."""
        return self.tokenizer(list(captions))

    def text_mask(self, ids) -> torch.Tensor:
        """(B, L) bool: True for the start token, the caption's tokens and the end token."""
        import torch

        eot = getattr(self.tokenizer, "eot_token_id", None)
        if eot is not None:
            is_eot = ids == eot
            last = torch.where(is_eot.any(-1), is_eot.int().argmax(-1), torch.full_like(ids[:, 0], ids.shape[1] - 1))
            return torch.arange(ids.shape[1]).unsqueeze(0) <= last.unsqueeze(1)
        return ids != self._pad_id

    def embed_text(self, captions: list[str], *, tokens: bool = False, normalize: bool = False) -> dict:
        """{"text_pooled": (B, D) projected pooled embedding (= model.encode_text), L2-normalised
        only if `normalize`}; with tokens=True also "text_tokens": (B, L, W) the text
        transformer's per-token outputs after its final LayerNorm (before pooling and
        projection) and "text_mask": (B, L) bool, True up to and including the end token."""
        import torch
        import torch.nn.functional as F

        ids = self.tokenize(captions)
        with torch.inference_mode(), self._autocast():
            if tokens:
                pooled, toks = self._text_with_tokens(ids.to(self.device))
            else:
                pooled, toks = self.model.encode_text(ids.to(self.device)), None
        pooled = pooled.float()
        out = {"text_pooled": (F.normalize(pooled, dim=-1) if normalize else pooled).cpu()}
        if tokens:
            out["text_tokens"] = toks.float().cpu()
            out["text_mask"] = self.text_mask(ids).cpu()
        return out

    def _text_with_tokens(self, ids):
        """(pooled, tokens) from one forward pass of the text tower."""
        model = self.model
        if hasattr(model, "ln_final") and hasattr(model, "token_embedding"):
            # open_clip.CLIP: the text tower lives on the model; catch ln_final's output.
            caught = []
            handle = model.ln_final.register_forward_hook(lambda m, i, o: caught.append(o))
            try:
                pooled = model.encode_text(ids)
            finally:
                handle.remove()
            toks = caught[-1] if caught else None
            if toks is None or toks.ndim != 3:
                raise DitdataError(f"{self.info['model']}: cannot read per-token text outputs")
            return pooled, toks
        text = model.text  # CustomTextCLIP (TextTransformer or a Hugging Face encoder)
        if not hasattr(text, "output_tokens"):
            raise DitdataError(f"{self.info['model']}: its text encoder cannot output per-token embeddings")
        before = text.output_tokens
        text.output_tokens = True
        try:
            out = text(ids)
        finally:
            text.output_tokens = before
        if not isinstance(out, tuple) or len(out) != 2:
            raise DitdataError(f"{self.info['model']}: cannot read per-token text outputs")
        return out

    # -- pairs

    def score(self, images, captions) -> torch.Tensor:
        """Cosine similarity of each image with its caption: (B,) float32."""
        if len(images) != len(captions):
            raise ValueError(f"{len(images)} images but {len(captions)} captions")
        return self.score_pixels(self.preprocess_images(images), captions)

    def score_pixels(self, pixels, captions) -> torch.Tensor:
        """Like score() for already preprocessed pixels (B, 3, H, W)."""
        return self.score_and_embed_pixels(pixels, captions)[0]

    def score_and_embed_pixels(self, pixels, captions) -> tuple[torch.Tensor, torch.Tensor]:
        """(score_pixels' (B,) scores, the (B, D) L2-normalised image embeddings they came from):
        `ditdata score --save-embeddings / --aesthetic` keep the embeddings of the same pass."""
        img = self.embed_pixels(pixels)
        txt = self.embed_text(captions, normalize=True)["text_pooled"]
        return (img * txt).sum(-1), img


def _split_preprocess(preprocess):
    """(the PIL steps, mean, std) when `preprocess` is Compose([..., ToTensor, Normalize])
    with no other tensor step; (None, None, None) otherwise."""
    from torchvision import transforms as T

    steps = list(getattr(preprocess, "transforms", None) or [])
    if len(steps) >= 2:
        *head, to_tensor, norm = steps
        if (isinstance(to_tensor, T.ToTensor) and isinstance(norm, T.Normalize)
                and not any(isinstance(t, (T.ToTensor, T.Normalize, T.ConvertImageDtype)) for t in head)):
            return T.Compose(head), tuple(float(m) for m in norm.mean), tuple(float(v) for v in norm.std)
    return None, None, None


def _text_dims(model) -> tuple[int, int]:
    """(width of the text transformer's per-token outputs, its pad token id): on the model
    for open_clip.CLIP, on model.text for CustomTextCLIP."""
    if hasattr(model, "token_embedding") and hasattr(model, "transformer"):
        return model.transformer.width, getattr(model, "pad_id", 0)
    text = model.text
    width = getattr(text, "width", None) or getattr(getattr(text, "config", None), "hidden_size", None)
    if width is None:
        raise DitdataError("unsupported open_clip text tower (unknown width)")
    return width, getattr(text, "pad_id", 0)

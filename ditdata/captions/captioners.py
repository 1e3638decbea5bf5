"""Captioners: the vision-language models `ditdata caption` writes caption sets with, one
registry entry per family, loaded through transformers' own classes.

``load_captioner(name, device)`` resolves NAME in this order (SOURCES):

1. ``python:MODULE:FUNCTION``: FUNCTION() (MODULE a dotted module name on sys.path, or a
   path to a .py file) returns a callable ``cap(images, prompt=..., max_new_tokens=...)``
   that takes a list of RGB PIL images and returns one caption per image: a str, or a dict
   {"text": str, "tokens": int, "truncated": bool} when it knows how many tokens it generated
   and whether it stopped at the limit. Its failures are the user's (ditdata.common.usercode):
   one line naming it. Its identity (weights_sha256) is the digest of its state_dict when it
   is a torch module, else the sha256 of its module's source file;
2. a preset of ``PRESETS`` (below), found in the LOCAL Hugging Face cache;
3. a local directory saved with transformers' save_pretrained (config.json, weights, and the
   processor's files: tokenizer, image processor, chat template);
4. a hub id ``org/name``, from the local Hugging Face cache only.

Nothing is downloaded: as for the autoencoders and feature encoders, a hub model that is not
in the cache fails at once with one line naming the `hf download` command that fetches it.

How each family is asked (FAMILIES, by config.json's model_type; the models' cards and
transformers' docs show these calls):

- "florence2" (Florence-2, transformers' native Florence2ForConditionalGeneration, the
  florence-community conversions): the prompt is a task token, "<MORE_DETAILED_CAPTION>" by
  default ("<CAPTION>", "<DETAILED_CAPTION>" are the shorter ones); the processor turns it into
  the task's question. Encoder-decoder: the output starts with the decoder's start token.
- "chat" (SmolVLM = Idefics3 / SmolVLM, Qwen2.5-VL, and any other image-text-to-text model
  with a chat template): one user turn holding the image and the instruction, rendered by
  the processor's chat template with the generation prompt; decoder-only, left-padded.

Generation: greedy (do_sample=False) so that a rerun gives the same text, at most
max_new_tokens new tokens, num_beams None = what the model's generation config sets (greedy
when it sets none; Florence-2's card calls it with num_beams=3: pass --num-beams 3 to follow it). fp32 on the CPU; on CUDA the weights are loaded in
bf16 (the models' cards run them so; a 7B model in fp32 would not fit a 24 GB card). A caption
is "truncated" when its row holds no end-of-sequence token (generation_config.eos_token_id)
and reached max_new_tokens; `tokens` counts the generated tokens before the end-of-sequence
token (padding excluded).

Importing this module is cheap: torch and transformers are imported inside the loaders.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ditdata.common.errors import described
from ditdata.common.extras import installed_version
from ditdata.common.files import read_json, sha256_file, state_dict_sha256
from ditdata.common.hub import HubPreset, cached_snapshot, model_source, required_weights
from ditdata.common.usercode import UserCodeError, user_call, user_function
from ditdata.errors import DitdataError

FLORENCE2, CHAT = "florence2", "chat"
# the instruction when --prompt is not given, per family
DEFAULT_PROMPTS = {FLORENCE2: "<MORE_DETAILED_CAPTION>", CHAT: "Describe this image in detail."}


@dataclass(frozen=True)
class Preset(HubPreset):
    """A named captioner: its hub repository and the transformers class that loads it."""

    model_class: str
    about: str


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("florence2-base", "florence-community/Florence-2-base", "Florence2ForConditionalGeneration",
           "Florence-2 base (0.23B), transformers' native port"),
    Preset("florence2-large", "florence-community/Florence-2-large", "Florence2ForConditionalGeneration",
           "Florence-2 large (0.77B), transformers' native port"),
    Preset("smolvlm-256m", "HuggingFaceTB/SmolVLM-256M-Instruct", "Idefics3ForConditionalGeneration",
           "SmolVLM 256M instruct"),
    Preset("smolvlm-500m", "HuggingFaceTB/SmolVLM-500M-Instruct", "Idefics3ForConditionalGeneration",
           "SmolVLM 500M instruct"),
    Preset("smolvlm2-2.2b", "HuggingFaceTB/SmolVLM2-2.2B-Instruct", "SmolVLMForConditionalGeneration",
           "SmolVLM2 2.2B instruct"),
    Preset("qwen2.5-vl-3b", "Qwen/Qwen2.5-VL-3B-Instruct", "Qwen2_5_VLForConditionalGeneration",
           "Qwen2.5-VL 3B instruct"),
    Preset("qwen2.5-vl-7b", "Qwen/Qwen2.5-VL-7B-Instruct", "Qwen2_5_VLForConditionalGeneration",
           "Qwen2.5-VL 7B instruct"),
)}

# config.json model_type -> (the transformers class, the family's way of asking); a model type
# not listed is tried as a chat model through AutoModelForImageTextToText
FAMILIES = {
    "florence2": ("Florence2ForConditionalGeneration", FLORENCE2),
    "idefics3": ("Idefics3ForConditionalGeneration", CHAT),
    "smolvlm": ("SmolVLMForConditionalGeneration", CHAT),
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", CHAT),
    "qwen2_vl": ("Qwen2VLForConditionalGeneration", CHAT),
}


@dataclass(frozen=True)
class Generated:
    """One caption as the captioner gave it: the decoded text (unstripped), the tokens it
    generated (None: unknown), and whether it stopped at max_new_tokens without its end."""

    text: str
    tokens: int | None
    hit_limit: bool


class Captioner:
    """A loaded captioner: ``info`` (name, kind, source, revision, model_type, model_class,
    family, weights_sha256, library, library_version), ``default_prompt``, and
    ``caption(images, prompt, max_new_tokens, num_beams) -> [Generated]``."""

    def __init__(self, info: dict[str, Any], default_prompt: str):
        self.info, self.default_prompt = dict(info), default_prompt
        self.source = f"--captioner {info['name']}"

    def caption(self, images: list, prompt: str, max_new_tokens: int, num_beams: int | None) -> list[Generated]:
        raise NotImplementedError


# --------------------------------------------------------------------------- transformers


class TransformersCaptioner(Captioner):
    """A transformers image-text-to-text model and its processor (module docstring)."""

    def __init__(self, model, processor, info: dict[str, Any], device):
        super().__init__(info, DEFAULT_PROMPTS[info["family"]])
        self.model, self.processor, self.device = model, processor, device
        self.family = info["family"]
        gen = model.generation_config
        eos = gen.eos_token_id
        self.eos = set(eos if isinstance(eos, list | tuple) else [] if eos is None else [eos])
        self.pad = gen.pad_token_id
        self.encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False)) or self.family == FLORENCE2

    def _inputs(self, images: list, prompt: str):
        proc = self.processor
        if self.family == FLORENCE2:
            return proc(text=[prompt] * len(images), images=images, return_tensors="pt")
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
        text = proc.apply_chat_template(messages, add_generation_prompt=True)
        return proc(text=[text] * len(images), images=[[im] for im in images], return_tensors="pt", padding=True)

    def caption(self, images: list, prompt: str, max_new_tokens: int, num_beams: int | None) -> list[Generated]:
        import torch

        try:
            inputs = self._inputs(images, prompt)
        except Exception as e:  # a prompt the processor refuses (e.g. Florence-2: text beside a task token)
            raise DitdataError(f"{self.source}: its processor refused the prompt {prompt!r} ({described(e)})") from e
        dtype = next(self.model.parameters()).dtype
        inputs = {k: (v.to(self.device, dtype) if v.is_floating_point() else v.to(self.device))
                  for k, v in inputs.items() if isinstance(v, torch.Tensor)}
        kwargs = {"max_new_tokens": max_new_tokens, "do_sample": False}
        if num_beams is not None:
            kwargs["num_beams"] = num_beams
        with torch.inference_mode():
            out = self.model.generate(**inputs, **kwargs)
        # decoder-only: the prompt comes back first; encoder-decoder: the decoder's start token
        gen = out[:, 1:] if self.encoder_decoder else out[:, inputs["input_ids"].shape[1]:]
        texts = self.processor.batch_decode(gen, skip_special_tokens=True)
        rows = []
        for row, text in zip(gen.tolist(), texts, strict=True):
            end = next((i for i, t in enumerate(row) if t in self.eos), None)
            body = row if end is None else row[:end]
            tokens = sum(t != self.pad for t in body) if self.pad is not None and self.pad not in self.eos else len(body)
            rows.append(Generated(text, tokens, end is None and len(row) >= max_new_tokens))
        return rows


def _from_dir(model_dir: Path, name: str, kind: str, source: str, device, revision: str | None = None) -> Captioner:
    try:
        model_type = read_json(model_dir / "config.json").get("model_type")
    except (OSError, ValueError, AttributeError):
        raise DitdataError(f"captioner {name}: {model_dir} has no readable config.json (a directory saved with "
                           "transformers' save_pretrained holds config.json, the weights and the processor)") from None
    files, safe = required_weights(model_dir, error=DitdataError)
    sha = {f: sha256_file(model_dir / f) for f in files}
    from ditdata.autoencoders.kinds import quiet_transformers

    transformers = quiet_transformers(f"captioner {name}", "captions")
    import torch

    class_name, family = FAMILIES.get(model_type, ("AutoModelForImageTextToText", CHAT))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        processor = transformers.AutoProcessor.from_pretrained(str(model_dir), local_files_only=True)
        model = getattr(transformers, class_name).from_pretrained(str(model_dir), local_files_only=True,
                                                                  use_safetensors=safe, dtype=dtype)
    except Exception as e:  # corrupt or incompatible files: one line for the CLI
        raise DitdataError(f"cannot load captioner {name} from {model_dir}: {described(e)}") from e
    if family == CHAT:
        if not getattr(processor, "chat_template", None):
            raise DitdataError(f"captioner {name}: the processor in {model_dir} has no chat template; a chat "
                               "captioner needs one (chat_template.jinja beside the processor's files)")
        tok = getattr(processor, "tokenizer", None)
        if tok is not None:
            tok.padding_side = "left"  # decoder-only generation continues each row from its end
    info = {"name": name, "kind": kind, "source": source, "revision": revision, "model_type": model_type,
            "model_class": type(model).__name__, "family": family, "weights_sha256": sha,
            "library": "transformers", "library_version": installed_version("transformers")}
    return TransformersCaptioner(model.eval().to(device), processor, info, device)


def _from_hub(repo_id: str, name: str, kind: str, device) -> Captioner:
    snap = cached_snapshot(repo_id, "captioner", name, "captions",
                           "a local directory saved with save_pretrained (--captioner DIR)", DitdataError)
    return _from_dir(snap, name, kind, repo_id, device, revision=snap.name)


# --------------------------------------------------------------------------- python:


class PythonCaptioner(Captioner):
    """A python:MODULE:FUNCTION captioner (module docstring)."""

    def __init__(self, fn, info: dict[str, Any]):
        super().__init__(info, DEFAULT_PROMPTS[CHAT])
        self.fn = fn

    def caption(self, images: list, prompt: str, max_new_tokens: int, num_beams: int | None) -> list[Generated]:
        out = user_call(self.source, self.fn, images, prompt=prompt, max_new_tokens=max_new_tokens,
                        what="its call")
        if not isinstance(out, list | tuple) or len(out) != len(images):
            got = f"{len(out)} captions" if isinstance(out, list | tuple) else f"a {type(out).__name__}"
            raise UserCodeError(f"{self.source}: returned {got} for {len(images)} images; expected a list of one "
                                "caption (a str, or a dict with text, tokens, truncated) per image")
        rows = []
        for c in out:
            if isinstance(c, str):
                rows.append(Generated(c, None, False))
            elif isinstance(c, dict) and isinstance(c.get("text"), str):
                tokens = c.get("tokens")
                if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0):
                    raise UserCodeError(f"{self.source}: returned tokens {tokens!r}; expected a count (int >= 0)")
                rows.append(Generated(c["text"], tokens, bool(c.get("truncated", False))))
            else:
                raise UserCodeError(f"{self.source}: returned a caption of type {type(c).__name__}; expected a str "
                                    "or a dict with a str 'text'")
        return rows


def _from_python(spec: str, device) -> Captioner:
    label = f"--captioner {spec}"
    mod, fn_name, fn = user_function(spec, label, "ditkit_captioner", DitdataError)
    cap = user_call(label, fn, what=f"{fn_name}()")
    if not callable(cap):
        raise DitdataError(f"{label}: {fn_name}() returned a {type(cap).__name__}, not a callable captioner")
    try:
        import torch

        is_module = isinstance(cap, torch.nn.Module)
    except ImportError:  # pragma: no cover - torch is a core dependency
        is_module = False
    if is_module:
        cap = cap.eval().to(device)
        sha = {"state_dict": state_dict_sha256(cap.state_dict())}
    else:
        src = getattr(mod, "__file__", None)
        sha = {"module_file": sha256_file(Path(src))} if src and Path(src).is_file() else {}
    info = {"name": spec, "kind": "python", "source": spec, "revision": None, "model_type": None,
            "model_class": type(cap).__name__, "family": "python", "weights_sha256": sha, "library": None,
            "library_version": None}
    return PythonCaptioner(cap, info)


# --------------------------------------------------------------------------- resolving


def _preset(s: str, device) -> Captioner:
    return _from_hub(PRESETS[s].repo_id, s, "preset", device)


def _directory(s: str, device) -> Captioner:
    path = Path(s).expanduser().resolve()
    return _from_dir(path, str(path), "directory", str(path), device)


def _hub(s: str, device) -> Captioner:
    return _from_hub(s, s, "hub", device)


# where NAME comes from (ditdata.common.hub.model_source, in the module docstring's order) -> its loader
SOURCES = {"python": _from_python, "preset": _preset, "directory": _directory, "hub": _hub}


def load_captioner(name: str, device) -> Captioner:
    """The captioner NAME (module docstring) on `device` (a torch.device); DitdataError when it
    is not on disk or cannot be loaded."""
    source, s = model_source(name, "captioner", PRESETS, DitdataError)
    return SOURCES[source](s, device)


__all__ = ["CHAT", "DEFAULT_PROMPTS", "FAMILIES", "FLORENCE2", "PRESETS", "SOURCES", "Captioner", "Generated",
           "load_captioner"]

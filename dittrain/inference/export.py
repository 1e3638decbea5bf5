"""`dittrain export`: a run's EMA weights in the forms other tools load.

    dittrain export --ckpt RUN --format fp16      --out dit-fp16.safetensors
    dittrain export --ckpt RUN --format int8      --out dit-int8.pt
    dittrain export --ckpt RUN --format onnx      --out dit.onnx         (dittrain.inference.onnx)
    dittrain export --ckpt RUN --format diffusers --out dit-pipeline/
    dittrain export --ckpt LORA_RUN --merge-lora  --out dit-lora/     (export_lora: merged + peft adapter)

The source is anything `dittrain sample --ckpt` reads (a run directory: its EMA; an EMA
export, fp32 or fp16; a checkpoint .pt: its EMA; a plain state dict, its model inferred from
the shapes or named with --model); not an int8 export. Every format records what made it
(source, step, versions, time: "dittrain_export") and the run config. Formats and layouts:

fp16       FILE.safetensors: the EMA's floating tensors in float16 (half the size), the run
           config in the metadata ("dittrain_config", as ema.safetensors). An EMA export like
           any other: `dittrain sample/serve --ckpt FILE` load it, and sampling casts the weights
           to float32 (load_model; --precision's autocast applies as for any run).
int8       FILE.pt: {"format": "dittrain-int8", "config", "state_dict", "export"}: torchao
           weight-only int8 of every nn.Linear (quantize_ with Int8WeightOnlyConfig: one scale
           per output row); the patch-embedding convolution, the embeddings, pos_embed and
           the biases stay float32. `dittrain sample/serve --ckpt FILE` load it: torch.load
           (weights_only=True) allows torchao's tensor classes by name (dittrain.train.checkpoint),
           load_model assigns them; torchao must be installed. On the CPU it is not faster.
onnx       FILE.onnx: the DiT forward with a dynamic batch, checked against PyTorch; see
           dittrain.inference.onnx. `dittrain sample --engine onnx --onnx FILE` samples it.
--merge-lora  DIR/: a --lora run's EMA adapter merged into its frozen base (DIR/ema.safetensors, an EMA
           export every reader takes) and the adapter itself as peft saves one (adapter_model.safetensors,
           adapter_config.json). A LoRA run needs no merging to be read: every format above, sampling and
           serving apply its adapter to its base as they load it (dittrain.inference.weights.with_base).
diffusers  DIR/: a diffusers DiTPipeline folder (model_index.json, transformer/, vae/,
           scheduler/, and dittrain_export.json), which DiTPipeline.from_pretrained(DIR,
           local_files_only=True) loads offline. Class-conditional ddpm runs on a store
           encoded with a diffusers AutoencoderKL (shift 0) only; the others are refused with
           the reason (text: no diffusers pipeline has our text DiT; LightningDiT's blocks
           (SwiGLU, RMSNorm, RoPE): DiTTransformer2DModel has none of them; flow: DiTPipeline
           is DDPM eps; unconditional; QK-norm; a TAEF2 or pixels store).
           transformer  DiTTransformer2DModel, weights mapped from facebookresearch/DiT's names
                        (the t/y embedders copied into every block, qkv split), norm_eps 1e-6,
                        out_channels 2C with learned sigma (the pipeline drops the variance).
           timesteps    diffusers divides the sinusoid's exponent by half - 1, DiT by half:
                        exact only with time_proj.downscale_freq_shift = 0 in every block. No
                        config key carries it (diffusers builds Timesteps(..., 1) itself), so it
                        is NOT saved: a plain from_pretrained uses 1 (as diffusers' own DiT port
                        of facebookresearch's weights does): close, not equal (the export prints
                        the difference). match_dit_timesteps(pipe) after loading makes it exact.
           null class   DiTPipeline's guidance takes class 1000 as the null class. A run of
                        K < 1000 classes gets a 1001-row table: its K classes, then the null
                        embedding in rows K..1000 (labels K..999 sample unconditionally), so
                        guidance_scale > 1 works; K == 1000 is the table as it is; K > 1000 is
                        refused (class 1000 would be a real class).
           vae          the store's AutoencoderKL with the manifest's scaling_factor.
           scheduler    DDIMScheduler: the run's num_timesteps and linear betas, epsilon,
                        clip_sample=False, "trailing" spacing (steps start at T - 1).
           id2label     the store's class names (register_to_config), when it has them.

           PixArt      a PixArt run (adaln=single: the PixArt-* presets, a run --init-from a diffusers PixArt)
                        is a PixArtAlphaPipeline folder instead: transformer/ a PixArtTransformer2DModel
                        (dittrain.model.pixart's names; its outputs equal ours, checked after reloading),
                        vae/ the store's AutoencoderKL, scheduler/ DPMSolverMultistepScheduler (dpmsolver++,
                        order 2: PixArt's pipeline) of the run's linear betas, epsilon; text_encoder/ and
                        tokenizer/ the store's encoder when it is a local transformers T5 folder, else none
                        (null in model_index.json; the export says so in one line): pass
                        text_encoder=T5EncoderModel..., tokenizer=... to from_pretrained, or call the
                        pipeline with prompt_embeds / prompt_attention_mask and the negative ones (the
                        store's empty caption: what dittrain's guidance uses, and diffusers' for "").
                        PixArtSigmaPipeline.from_pretrained loads the same folder (a non-micro-conditioned
                        model). Refused: flow runs, QK-norm, other blocks, a micro-conditioned model whose
                        factor is not the autoencoder's downsample, the KL conditions above.

A refused export (unknown format, output exists without --overwrite, output inside a latent
store, a missing extra, a run the format cannot hold) is an ExportError: one line, nothing
written. Files are written to a temporary name and renamed when complete.

Public API:
    FORMATS, ExportError, export (the command), export_fp16, export_int8, export_diffusers,
    diffusers_state_dict, match_dit_timesteps, check_request, file_size.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from ditdata.common.bytesize import format_size
from ditdata.common.extras import install_hint
from ditdata.common.files import atomic_file, atomic_path
from dittrain.config import OnnxConfig, recorded
from dittrain.inference import open_run
from dittrain.inference.onnx import export_onnx, random_inputs
from dittrain.inference.open_run import ExportError
from dittrain.inference.weights import full_weights, infer_run_config, read_weights
from dittrain.model.dit import DiT
from dittrain.model.sizes import BLOCK_FIELDS, DiTConfig
from dittrain.rundir import INT8_FORMAT, CheckpointError, export_weights, load_checkpoint

FORMATS = ("onnx", "diffusers", "fp16", "int8")
SUFFIX = {"fp16": ".safetensors", "int8": ".pt", "onnx": ".onnx", "diffusers": None}
NEEDS = {"onnx": ("onnx", "onnxscript", "onnxruntime"), "int8": ("torchao",), "diffusers": ("diffusers",),
         "fp16": ()}
EXPORT_KEY = "dittrain_export"  # safetensors metadata, the int8 payload, ONNX metadata_props
DIFFUSERS_NULL = 1000  # DiTPipeline's hard-coded null class
DIFFUSERS_RECORD = "dittrain_export.json"
_ONNX = OnnxConfig()  # --format onnx's defaults


def file_size(path) -> int:
    """Bytes of a file, or of every file under a folder."""
    path = Path(path)
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# -----------------------------------------------------------------------------
# What is asked, checked before anything loads


def check_request(fmt: str, out, overwrite: bool = False) -> Path:
    """The output path of a valid request; ExportError for an unknown format, a wrong suffix,
    an output inside a latent store, an existing output without overwrite, a missing extra."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}: choose one of {', '.join(FORMATS)}")
    out = Path(out)
    suffix = SUFFIX[fmt]
    if suffix and out.suffix.lower() != suffix:
        raise ExportError(f"--out {out}: a {fmt} export is one {suffix} file; name it NAME{suffix}")
    if suffix is None and out.is_file():
        raise ExportError(f"--out {out} is a file; a diffusers export is a folder")
    open_run.check_new_output(out, "--out", ExportError, overwrite=overwrite)
    missing = [m for m in NEEDS[fmt] if not _importable(m)]
    if missing:
        raise ExportError(f"--format {fmt} needs {', '.join(missing)}, which is not installed: "
                          f"{install_hint('export')}")
    return out


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: blocked in sys.modules (None)
        return False


def _record(fmt: str, source) -> dict:
    """What made an export (saved in it)."""
    try:
        version = importlib.metadata.version("ditkit")
    except importlib.metadata.PackageNotFoundError:
        version = None
    return {"format": fmt, "source": str(Path(source.file).resolve()), "source_kind": source.kind,
            "step": source.step, "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "ditkit": version, "torch": str(torch.__version__)}


# -----------------------------------------------------------------------------
# The command


def export(ckpt, fmt: str, out, *, overwrite: bool = False, latents=None, vae: str | None = None,
           model: str | None = None, onnx: OnnxConfig = _ONNX, log=print) -> dict:
    """`dittrain export`: read `ckpt`, write it as `fmt` at `out`, check it, say where and how
    big. latents / vae / model: as `dittrain sample`'s; onnx: --format onnx's tolerance, largest
    batch and opset (OnnxConfig). Returns {"format", "files": [Path], "sizes": {path: bytes}}."""
    out = check_request(fmt, out, overwrite)
    source = full_weights(ckpt, ExportError, "export from the run it came from (or its fp32 or fp16 weights)")
    if out.resolve() == source.file.resolve():
        raise ExportError(f"--out {out} is the source itself; choose another name")
    if model is not None and not source.plain:
        raise ExportError(f"--model {model}: {ckpt} is a dittrain run; --model names the model of a plain state dict")
    config = source.config if not source.plain else infer_run_config(source.state, model, where=source.file)
    store = None
    if fmt == "diffusers":
        refusal = diffusers_refusal(config)  # before the store: a text run's store need not be here
        if not refusal:
            store = open_run.run_store(config, latents, vae, source.file)[0]
            refusal = diffusers_refusal(config, store)
        if refusal:
            raise ExportError(f"cannot export {source.file} to diffusers: {refusal}")
    dit = open_run.load_model(source.state, config, "cpu")
    name = recorded(config, "model", "DiT")
    params = sum(p.numel() for k, p in dit.named_parameters() if k != "pos_embed")
    log(f"exporting {source.file} ({name}, {params / 1e6:.2f} M parameters) as {fmt}")
    record = _record(fmt, source)
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "fp16":
        files = [export_fp16(dit, config, out, record, log=log)]
    elif fmt == "int8":
        files = [export_int8(dit, config, out, record, log=log)]
    elif fmt == "onnx":
        tokens = None  # the store's text length, for the trtexec shapes (None when it cannot be read)
        if dit.config.text_token_dim:
            try:
                spec = open_run.open_run_store(config, latents)[0].schema.tensors.get("text_tokens")
                tokens = int(spec.shape[0]) if spec is not None else None
            except Exception:
                tokens = None
        files = export_onnx(dit, config, out, record, onnx, tokens=tokens, log=log)
    else:
        files = [export_diffusers(dit, config, store, out, record, vae=vae, log=log)]
    sizes = {str(f): file_size(f) for f in files}
    for f in files:
        log(f"wrote {f} ({format_size(sizes[str(f)], decimal=True, smallest='kB')})")
        if f.is_dir():
            for part in sorted(f.iterdir()):
                log(f"  {part.name}{'/' if part.is_dir() else ''}  {format_size(file_size(part), decimal=True, smallest='kB')}")
    return {"format": fmt, "files": files, "sizes": sizes}


# -----------------------------------------------------------------------------
# --merge-lora: a LoRA run's weights merged, and its adapter as peft saves one

ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"  # peft's file names
PEFT_PREFIX = "base_model.model."  # what PeftModel puts before the base model's names in its saved keys


def export_lora(ckpt, out, *, overwrite: bool = False, log=print) -> dict:
    """`dittrain export --merge-lora`: the EMA adapter of a --lora run (its run directory, ema.safetensors or a
    checkpoint) into the folder `out`:

        OUT/ema.safetensors            the merged weights (W + (alpha / r) B A on the frozen base), an EMA export
                                       with the run config: `dittrain sample/serve/export --ckpt OUT` take it
                                       (no base needed any more)
        OUT/adapter_model.safetensors  the adapter as peft saves it (keys base_model.model.NAME.lora_A.weight)
        OUT/adapter_config.json        its LoraConfig (r, lora_alpha, lora_dropout, the targeted modules' full
                                       names): PeftModel.from_pretrained(our DiT holding the base, OUT) loads it

    Checked: the merged weights, reloaded, give the adapted model's outputs. Returns {"files", "sizes"}."""
    from safetensors.torch import save_file

    from dittrain.inference.weights import adapted_model, load_weights, strip_prefixes, weights_file
    from dittrain.model import lora
    from dittrain.rundir import EMA_EXPORT

    out = Path(out)
    if out.is_file():
        raise ExportError(f"--out {out} is a file; --merge-lora writes a folder")
    open_run.check_new_output(out, "--out", ExportError, overwrite=overwrite)
    file = weights_file(ckpt)
    try:
        state, config = load_weights(file)
    except CheckpointError as e:
        raise ExportError(f"--merge-lora: not a --lora run's weights ({e})") from None
    state = strip_prefixes(state)
    if not lora.is_adapter(state):
        raise ExportError(f"--merge-lora: {file} holds no LoRA adapter (not a --lora run); export it with --format")
    settings = lora.settings_of(config["train"]["lora"])
    model = adapted_model(state, config, file)
    names = [n for n, m in model.named_modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]
    merged = lora.merged_state(model)
    source = SimpleNamespace(file=file, kind="export" if file.suffix == ".safetensors" else "checkpoint",
                             step=None if file.suffix == ".safetensors" else load_checkpoint(file).get("step"))
    record = {**_record("merge-lora", source), "base": (config.get("init") or {}).get("file")}
    out.mkdir(parents=True, exist_ok=True)
    weights = export_weights(out / EMA_EXPORT, merged, config, metadata={EXPORT_KEY: json.dumps(record)})
    adapter = out / ADAPTER_WEIGHTS
    save_file({PEFT_PREFIX + k: v.detach().contiguous().cpu() for k, v in state.items()}, str(adapter),
              metadata={"format": "pt"})
    peft = lora.peft_config(settings, names)
    peft.base_model_name_or_path = (config.get("init") or {}).get("from")
    peft.save_pretrained(str(out))
    inputs = _probe(model.config)
    with torch.no_grad():
        ref = model(**inputs)
    log(f"check: {weights.name} (merged) against the adapter on its base, forward on random inputs: at most "
        f"{_reload_diff(weights, inputs, ref):.1e} apart (outputs up to {float(ref.abs().max()):.2f})")
    files = [weights, adapter, out / ADAPTER_CONFIG]
    sizes = {str(f): file_size(f) for f in files}
    for f in files:
        log(f"wrote {f} ({format_size(sizes[str(f)], decimal=True, smallest='kB')})")
    return {"format": "merge-lora", "files": files, "sizes": sizes}


# -----------------------------------------------------------------------------
# fp16 and int8: files dittrain's own loaders read


def _probe(cfg: DiTConfig) -> dict:
    return random_inputs(cfg, 4, torch.Generator().manual_seed(2))


def _reload_diff(path: Path, inputs: dict, ref: torch.Tensor) -> float:
    """max |forward of the file, loaded as `dittrain sample --ckpt FILE` loads it - ref|."""
    w = read_weights(path)
    with torch.no_grad():
        return float((open_run.load_model(w.state, w.config, "cpu")(**inputs) - ref).abs().max())


def export_fp16(dit: DiT, config: dict, out, record: dict, *, log=print) -> Path:
    """The weights in float16 as an EMA export (safetensors, run config in the metadata)."""
    state = {}
    for k, v in dit.state_dict().items():
        if v.is_floating_point():
            v = v.half()
            if not torch.isfinite(v).all():
                raise ExportError(f"{k} has values beyond float16's range (|w| > 65504); keep the fp32 weights")
        state[k] = v
    inputs = _probe(dit.config)
    with torch.no_grad():
        ref = dit(**inputs)
    path = export_weights(out, state, config, metadata={EXPORT_KEY: json.dumps(record)})
    log(f"check: {path.name} loads as `dittrain sample --ckpt` loads it (cast to float32); forward on random "
        f"inputs differs from fp32 by at most {_reload_diff(path, inputs, ref):.1e} (outputs up to "
        f"{float(ref.abs().max()):.2f})")
    return path


def export_int8(dit: DiT, config: dict, out, record: dict, *, log=print) -> Path:
    """torchao weight-only int8 of the linears, saved as {"format": "dittrain-int8", ...}.
    Quantises `dit` in place."""
    from ditdata.autoencoders.kinds import quiet_third_party_imports

    quiet_third_party_imports()
    import torchao
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    inputs = _probe(dit.config)
    with torch.no_grad():
        ref = dit(**inputs)
    quantize_(dit, Int8WeightOnlyConfig(set_inductor_config=False))
    record = {**record, "torchao": str(torchao.__version__),
              "quantization": "torchao Int8WeightOnlyConfig: nn.Linear weights int8, one scale per output row"}
    payload = {"format": INT8_FORMAT, "config": config, "state_dict": dit.state_dict(), "export": record}
    out = Path(out)
    with atomic_file(out) as f:
        torch.save(payload, f)
    log(f"check: {out.name} loads as `dittrain sample --ckpt` loads it; forward on random inputs differs from "
        f"fp32 by at most {_reload_diff(out, inputs, ref):.1e} (outputs up to {float(ref.abs().max()):.2f})")
    return out


# -----------------------------------------------------------------------------
# diffusers: a DiTPipeline folder


def diffusers_refusal(config: dict, store=None) -> str | None:
    """Why a run cannot be a DiTPipeline (a PixArt run: a PixArtAlphaPipeline) (None: it can); with `store`, its
    autoencoder too."""
    cfg, d = open_run.model_config(config), open_run.diffusion_config(config)
    if cfg.adaln == "single":
        return pixart_refusal(config, store)
    if cfg.head_depth:
        return ("it is a DiT^DH (a DDT head after the trunk) and no diffusers pipeline has one "
                "(DiTTransformer2DModel is DiT's blocks alone); export it as onnx, fp16 or int8")
    if cfg.text_pooled_dim or cfg.text_token_dim:
        return ("it is a text-conditioned DiT and no diffusers pipeline matches it (DiTPipeline is class-conditional); "
                "export it as onnx, fp16 or int8")
    blocks = [f"{k}={getattr(cfg, k)}" for k in BLOCK_FIELDS if k != "qk_norm" and getattr(cfg, k) != getattr(DiTConfig, k)]
    if blocks:
        return (f"its blocks are LightningDiT's ({', '.join(blocks)}) and no diffusers pipeline has these blocks "
                "(DiTTransformer2DModel: GELU MLP, LayerNorm, sin-cos positions); export it as onnx, fp16 or int8")
    if not cfg.num_classes:
        return "it is unconditional and DiTPipeline is class-conditional; export it as onnx, fp16 or int8"
    if (why := _sampling_refusal(config, d, "DiTPipeline", "DDIM")) is not None:
        return why
    if cfg.num_classes > DIFFUSERS_NULL:
        return (f"it has {cfg.num_classes} classes and DiTPipeline's guidance uses class {DIFFUSERS_NULL} as the null "
                "class, a real class here")
    if cfg.qk_norm:
        return "it uses QK-norm, which DiTTransformer2DModel does not have"
    if cfg.mlp_ratio != 4 or cfg.frequency_embedding_size != 256:
        return "DiTTransformer2DModel has MLP ratio 4 and 256 timestep features, this model does not"
    return _kl_refusal(store, "DiTPipeline")


def _sampling_refusal(config: dict, d, pipeline: str, scheduler: str) -> str | None:
    """Why the pipeline cannot sample this run (None: it can): its `scheduler` is DDPM eps-prediction's, and it
    decodes the raw latents. d: the run's resolved diffusion config."""
    if d.objective != "ddpm":
        return (f"its objective is {d.objective} (velocity) and {pipeline} samples DDPM eps-prediction models "
                f"(a {scheduler} scheduler); export it as onnx, fp16 or int8")
    if (config.get("latents") or {}).get("norm", "none") != "none":
        return (f"it was trained on per-channel standardised latents (--latent-norm channel) and {pipeline} "
                "decodes latents / scaling_factor only; export it as onnx, fp16 or int8")
    return None


def _kl_refusal(store, pipeline: str) -> str | None:
    """Why the store's autoencoder cannot be the pipeline's vae (None: it can, or no store yet)."""
    if store is None:
        return None
    vae = store.manifest["vae"]
    if vae.get("kind") != "autoencoder_kl":
        return (f"its store's autoencoder is {vae.get('name')!r} ({vae.get('kind')}); {pipeline} decodes with a "
                "diffusers AutoencoderKL, so only runs on a store encoded with one (sd-vae-ft-ema, sdxl-vae, a "
                "diffusers folder) export to diffusers")
    if float(vae.get("shift_factor") or 0.0):
        return (f"its store's autoencoder has shift_factor {vae['shift_factor']}, which {pipeline}'s decode "
                "(latents / scaling_factor) ignores")
    return None


def pixart_refusal(config: dict, store=None) -> str | None:
    """Why a PixArt run (adaln=single) cannot be a PixArtAlphaPipeline folder (None: it can)."""
    cfg, d = open_run.model_config(config), open_run.diffusion_config(config)
    if not cfg.text_token_dim or cfg.num_classes:
        return ("it is a PixArt model without text tokens (or with class labels) and PixArtTransformer2DModel "
                "cross-attends to caption tokens alone; export it as onnx, fp16 or int8")
    blocks = [f"{k}={getattr(cfg, k)}" for k in BLOCK_FIELDS if getattr(cfg, k) != getattr(DiTConfig, k)]
    if blocks or cfg.mlp_ratio != 4 or cfg.frequency_embedding_size != 256 or cfg.time_embed != "sinusoid":
        return (f"its blocks are not PixArt's ({', '.join(blocks) or 'MLP ratio, timestep features'}) and "
                "PixArtTransformer2DModel has only those; export it as onnx, fp16 or int8")
    if not cfg.pos_interpolation:
        return ("its sin-cos positions are DiT's (pos_interpolation 0) and PixArtTransformer2DModel's are PixArt's "
                "(an interpolation scale); export it as onnx, fp16 or int8")
    if (why := _sampling_refusal(config, d, "PixArtAlphaPipeline", "DPM-Solver")) is not None:
        return why
    if store is not None and cfg.micro_conditions:
        down = int(store.manifest["vae"].get("downsample") or 0)
        if down != cfg.micro_conditions:
            return (f"its micro-conditions take {cfg.micro_conditions} pixels a latent pixel but the store's "
                    f"autoencoder downsamples by {down}, the size PixArtAlphaPipeline passes")
    return _kl_refusal(store, "PixArtAlphaPipeline")


def diffusers_state_dict(state: dict, cfg: DiTConfig) -> dict:
    """Our (facebookresearch/DiT) names -> DiTTransformer2DModel's, with the class table
    padded to DiTPipeline's 1001 rows (module docstring: null class)."""
    D, K = cfg.hidden_size, cfg.num_classes
    table = state["y_embedder.embedding_table.weight"]  # (K + 1, D), row K: the null class
    rows = table[K].expand(DIFFUSERS_NULL + 1, D).clone()
    rows[:K] = table[:K]
    out = {"pos_embed.proj.weight": state["x_embedder.proj.weight"],
           "pos_embed.proj.bias": state["x_embedder.proj.bias"]}
    for p in ("weight", "bias"):
        out[f"proj_out_1.{p}"] = state[f"final_layer.adaLN_modulation.1.{p}"]
        out[f"proj_out_2.{p}"] = state[f"final_layer.linear.{p}"]
    for i in range(cfg.depth):
        ours, theirs = f"blocks.{i}.", f"transformer_blocks.{i}."
        emb = theirs + "norm1.emb."
        out[emb + "class_embedder.embedding_table.weight"] = rows.clone()
        for p in ("weight", "bias"):
            out[f"{emb}timestep_embedder.linear_1.{p}"] = state[f"t_embedder.mlp.0.{p}"].clone()
            out[f"{emb}timestep_embedder.linear_2.{p}"] = state[f"t_embedder.mlp.2.{p}"].clone()
            out[f"{theirs}norm1.linear.{p}"] = state[f"{ours}adaLN_modulation.1.{p}"]
            q, k, v = state[f"{ours}attn.qkv.{p}"].chunk(3, dim=0)  # (3D, ...): q, k, v of all heads
            out[f"{theirs}attn1.to_q.{p}"], out[f"{theirs}attn1.to_k.{p}"], out[f"{theirs}attn1.to_v.{p}"] = q, k, v
            out[f"{theirs}attn1.to_out.0.{p}"] = state[f"{ours}attn.proj.{p}"]
            out[f"{theirs}ff.net.0.proj.{p}"] = state[f"{ours}mlp.fc1.{p}"]
            out[f"{theirs}ff.net.2.{p}"] = state[f"{ours}mlp.fc2.{p}"]
    return {k: v.contiguous() for k, v in out.items()}


def match_dit_timesteps(model) -> int:
    """Set downscale_freq_shift = 0 in the timestep projection of every block of a
    DiTTransformer2DModel (or a DiTPipeline's): DiT's sinusoid, so outputs equal ours.
    DiTPipeline.from_pretrained does not keep it (module docstring); returns the blocks set."""
    transformer = getattr(model, "transformer", model)
    for block in transformer.transformer_blocks:
        block.norm1.emb.time_proj.downscale_freq_shift = 0
    return len(transformer.transformer_blocks)


def _versus(transformer, dit: DiT, inputs: dict) -> float:
    """max |transformer - dit| on the same inputs (our null class -> diffusers' 1000)."""
    y = inputs["y"]
    with torch.no_grad():
        ref = dit(**inputs)
        got = transformer(inputs["x"], timestep=inputs["t"],
                          class_labels=torch.where(y == dit.config.num_classes, DIFFUSERS_NULL, y)).sample
    return float((got - ref).abs().max())


class _quiet_diffusers:
    """diffusers' info logging and progress bars off for the block, then as they were."""

    def __enter__(self):
        from diffusers.utils import logging

        self.level = logging.get_verbosity()
        logging.set_verbosity_error()
        logging.disable_progress_bar()

    def __exit__(self, *exc):
        from diffusers.utils import logging

        logging.set_verbosity(self.level)
        logging.enable_progress_bar()


def export_diffusers(dit: DiT, config: dict, store, out, record: dict, *, vae: str | None = None,
                     log=print) -> Path:
    """A DiTPipeline folder at `out` (module docstring), reloaded with from_pretrained and its
    transformer checked against `dit` before it is published."""
    from ditdata.autoencoders.kinds import quiet_third_party_imports

    quiet_third_party_imports()
    from diffusers import DiTPipeline

    refusal = diffusers_refusal(config, store)
    if refusal:
        raise ExportError(f"cannot export to diffusers: {refusal}")
    if dit.config.adaln == "single":
        return export_pixart(dit, config, store, out, record, vae=vae, log=log)
    ae = _pipeline_vae(store, vae)
    K, names = dit.config.num_classes, open_run.class_names(store)
    with _quiet_diffusers():
        pipe = _pipeline(dit, config, ae, names)
        inputs = random_inputs(dit.config, 3, torch.Generator().manual_seed(3))
        out = Path(out)
        with atomic_path(out) as tmp:
            _save_pipeline(pipe, tmp, {"export": record, "config": config, "num_classes": K, "class_names": names,
                                       "notes": _diffusers_notes(dit.config)})
            loaded = DiTPipeline.from_pretrained(str(tmp), local_files_only=True)
            as_loaded = _versus(loaded.transformer, dit, inputs)
            match_dit_timesteps(loaded)
            matched = _versus(loaded.transformer, dit, inputs)
            _check_reloaded(matched)
    log(f"check: DiTPipeline.from_pretrained(local_files_only=True) loads it; its transformer vs the DiT on random "
        f"inputs: max abs diff {matched:.1e} after match_dit_timesteps(pipe), {as_loaded:.1e} as loaded "
        "(downscale_freq_shift=1: diffusers keeps no config key for it)")
    if K < DIFFUSERS_NULL:
        log(f"note: DiTPipeline's null class is {DIFFUSERS_NULL}: the class table has {DIFFUSERS_NULL + 1} rows, this "
            f"run's {K} classes then the null embedding, so guidance_scale > 1 works")
    return out


def _pipeline_vae(store, vae: str | None):
    """The store's autoencoder (or --vae's) as the pipeline's vae: a diffusers AutoencoderKL whose config's
    scaling_factor is the store's, what the pipeline divides the latents by before decoding."""
    ae = open_run.load_autoencoder(store, "cpu", vae)
    if ae.kind != "autoencoder_kl":
        raise ExportError(f"cannot export to diffusers: --vae {vae} is a {ae.kind} autoencoder, not a diffusers "
                          "AutoencoderKL")
    ae.module.register_to_config(scaling_factor=float(store.manifest["vae"]["scaling_factor"]))
    return ae


def _save_pipeline(pipe, tmp: Path, record: dict) -> None:
    """The pipeline saved (safetensors) into the folder `tmp`, with dittrain's `record` beside it."""
    pipe.save_pretrained(str(tmp), safe_serialization=True)
    (tmp / DIFFUSERS_RECORD).write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def _check_reloaded(diff: float) -> None:
    """ExportError unless the reloaded transformer matches the DiT (max abs diff `diff`), so nothing is published."""
    if not diff <= 1e-4:
        raise ExportError(f"diffusers check failed: the reloaded transformer differs from the DiT by "
                          f"{diff:.1e}; nothing written")


def pixart_transformer(dit: DiT):
    """The PixArtTransformer2DModel holding `dit`'s weights (dittrain.model.pixart's names), in eval mode."""
    from diffusers import PixArtTransformer2DModel

    from dittrain.model.pixart import diffusers_config, to_diffusers

    transformer = PixArtTransformer2DModel(**diffusers_config(dit.config))
    transformer.load_state_dict(to_diffusers(dit.state_dict(), dit.config.depth), strict=True)
    return transformer.eval()


def pixart_versus(transformer, dit: DiT, inputs: dict) -> float:
    """max |transformer - dit| on the same inputs (x, t, text_tokens, text_mask; diffusers' micro-conditions from
    the latent's size, as its pipeline passes them)."""
    x, cfg = inputs["x"], dit.config
    added = None
    if cfg.micro_conditions:
        N, (H, W) = x.shape[0], (s * cfg.micro_conditions for s in x.shape[-2:])
        added = {"resolution": torch.tensor([[float(H), float(W)]]).repeat(N, 1),
                 "aspect_ratio": torch.tensor([[H / W]]).repeat(N, 1)}
    with torch.no_grad():
        ref = dit(**inputs)
        got = transformer(x, encoder_hidden_states=inputs["text_tokens"], timestep=inputs["t"],
                          encoder_attention_mask=inputs["text_mask"].float(), added_cond_kwargs=added).sample
    return float((got - ref).abs().max())


def _t5_folder(store) -> tuple[Path | None, str]:
    """(the store's text encoder as a local transformers T5 folder with its tokenizer, else None; what is missing,
    for the note). The manifest's text entry names it by a folder (path, pretrained, model) or a hub id (id), looked
    up in the local Hugging Face cache only (ditdata.textencoders' rule: nothing is downloaded)."""
    text = (store.manifest.get("conditioning") or {}).get("text") or {}
    name = text.get("encoder") or text.get("model") or text.get("id") or "unknown"
    for key in ("path", "pretrained", "model", "encoder"):
        value = text.get(key)
        if value and Path(str(value)).is_dir() and _is_t5(Path(str(value))):
            return Path(str(value)), ""
    if text.get("model_type") in ("t5", "umt5") and text.get("id"):
        from ditdata.common.hub import download_command, hub_cache_dir

        try:
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(text["id"], revision=text.get("revision"), cache_dir=str(hub_cache_dir()),
                                            local_files_only=True))
        except Exception:
            folder = None
        if folder is not None and _is_t5(folder):
            return folder, ""
        return None, (f"the store's T5 text encoder {text['id']} is not in the local Hugging Face cache "
                      f"({download_command(text['id'])} adds it)")
    return None, f"the store's text encoder {name!r} is not a local transformers T5 folder"


def _is_t5(folder: Path) -> bool:
    try:
        kind = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return False
    return kind in ("t5", "umt5") and any((folder / f).is_file() for f in ("tokenizer.json", "spiece.model"))


def export_pixart(dit: DiT, config: dict, store, out, record: dict, *, vae: str | None = None, log=print) -> Path:
    """A PixArtAlphaPipeline folder at `out` (module docstring: PixArt), reloaded with from_pretrained and its
    transformer checked against `dit` before it is published."""
    from diffusers import DPMSolverMultistepScheduler, PixArtAlphaPipeline, PixArtTransformer2DModel

    from dittrain.inference.onnx import random_inputs

    ae = _pipeline_vae(store, vae)
    d = open_run.diffusion_config(config)
    t5, encoder = _t5_folder(store)
    text_encoder = tokenizer = None
    with _quiet_diffusers():
        if t5 is not None:
            from transformers import AutoTokenizer, T5EncoderModel

            text_encoder = T5EncoderModel.from_pretrained(str(t5), local_files_only=True)
            tokenizer = AutoTokenizer.from_pretrained(str(t5), local_files_only=True)
        # PixArt's pipeline scheduler: DPM-Solver++ of order 2 over the training betas, eps prediction
        scheduler = DPMSolverMultistepScheduler(num_train_timesteps=d.num_timesteps, beta_start=d.beta_start,
                                                beta_end=d.beta_end, beta_schedule="linear",
                                                prediction_type="epsilon", algorithm_type="dpmsolver++",
                                                solver_order=2)
        transformer = pixart_transformer(dit)
        pipe = PixArtAlphaPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=ae.module,
                                   transformer=transformer, scheduler=scheduler)
        inputs = random_inputs(dit.config, 3, torch.Generator().manual_seed(3))
        inputs = {k: inputs[k] for k in ("x", "t", "text_tokens", "text_mask")}
        # every caption keeps a real token: diffusers' -10000 bias attends uniformly over an all-padding caption,
        # ours adds nothing (dittrain.model.dit.CrossAttention); T5 captions always have their EOS token
        inputs["text_mask"][:, 0] = True
        out = Path(out)
        with atomic_path(out) as tmp:
            _save_pipeline(pipe, tmp, {"export": record, "config": config,
                                       "text_encoder": None if t5 is None else str(t5),
                                       "notes": _pixart_notes(dit.config, t5 is not None)})
            loaded = PixArtTransformer2DModel.from_pretrained(str(tmp / "transformer"), local_files_only=True)
            diff = pixart_versus(loaded, dit, inputs)
            _check_reloaded(diff)
    log(f"check: PixArtTransformer2DModel.from_pretrained(local_files_only=True) loads its transformer/; vs the DiT "
        f"on random inputs: max abs diff {diff:.1e}")
    if t5 is None:
        log(f"note: no text_encoder/ or tokenizer/: {encoder}; pass text_encoder= and tokenizer= to "
            "PixArtAlphaPipeline.from_pretrained, or call the pipeline with prompt_embeds, prompt_attention_mask "
            "and the negative ones")
    return out


def _pixart_notes(cfg: DiTConfig, has_text_encoder: bool) -> dict:
    """What dittrain_export.json says a user of a PixArt folder must know."""
    return {
        "guidance": "dittrain's unconditional pass uses the store's empty-caption embedding; diffusers' pipeline "
                    "embeds negative_prompt='' with its text encoder: the same input when the encoder is the store's",
        "text_encoder": None if has_text_encoder else
        "not included (the store's encoder is not a local transformers T5): pass text_encoder= and tokenizer= to "
        "from_pretrained, or prompt_embeds and prompt_attention_mask (and negative_*) to the pipeline",
        "micro_conditions": "the pipeline passes the image's height, width and aspect ratio, as dittrain derives "
                            "them from the latent" if cfg.micro_conditions else None,
        "learned_sigma": "out_channels = 2 x in_channels: the pipeline drops the variance channels"
                         if cfg.learn_sigma else None,
        "resolution_binning": "call the pipeline with use_resolution_binning=False for sizes outside PixArt's "
                              "aspect-ratio bins (sample_size 128, 64, 32 and 16 have bins)",
    }


def _pipeline(dit: DiT, config: dict, ae, names: list[str] | None):
    """The DiTPipeline of `dit` (its weights mapped, DiT's timesteps), the autoencoder `ae` and
    a DDIM scheduler of the run's schedule; id2label from the store's class names."""
    from diffusers import DDIMScheduler, DiTPipeline, DiTTransformer2DModel

    cfg, d = dit.config, open_run.diffusion_config(config)
    transformer = DiTTransformer2DModel(
        num_attention_heads=cfg.num_heads, attention_head_dim=cfg.hidden_size // cfg.num_heads,
        in_channels=cfg.in_channels, out_channels=cfg.out_channels, num_layers=cfg.depth,
        sample_size=cfg.input_size, patch_size=cfg.patch_size, num_embeds_ada_norm=DIFFUSERS_NULL, norm_eps=1e-6)
    transformer.load_state_dict(diffusers_state_dict(dit.state_dict(), cfg), strict=True)
    match_dit_timesteps(transformer.eval())
    scheduler = DDIMScheduler(num_train_timesteps=d.num_timesteps, beta_start=d.beta_start, beta_end=d.beta_end,
                              beta_schedule="linear", prediction_type="epsilon", clip_sample=False,
                              set_alpha_to_one=True, steps_offset=0, timestep_spacing="trailing")
    pipe = DiTPipeline(transformer=transformer, vae=ae.module, scheduler=scheduler)
    if names:
        pipe.register_to_config(id2label=dict(enumerate(names)))
    return pipe


def _diffusers_notes(cfg: DiTConfig) -> dict:
    """What dittrain_export.json says a user of the folder must know."""
    K = cfg.num_classes
    return {
        "timesteps": "DiTPipeline.from_pretrained builds time_proj with downscale_freq_shift=1 (no config key "
                     "carries it); call dittrain.inference.export.match_dit_timesteps(pipe) after loading for outputs "
                     "equal to dittrain's (or set transformer_blocks[i].norm1.emb.time_proj."
                     "downscale_freq_shift = 0 in every block)",
        "null_class": f"class {DIFFUSERS_NULL} is the null class of guidance" + (
            f"; rows {K}..{DIFFUSERS_NULL - 1} of the class table are the null embedding too (this run has "
            f"{K} classes)" if K < DIFFUSERS_NULL else ""),
        "learned_sigma": "out_channels = 2 x in_channels: DiTPipeline drops the variance channels"
                         if cfg.learn_sigma else None,
    }


__all__ = [
    "FORMATS", "ExportError", "check_request", "diffusers_refusal", "diffusers_state_dict", "export",
    "export_diffusers", "export_fp16", "export_int8", "export_pixart", "file_size", "match_dit_timesteps",
    "pixart_refusal", "pixart_transformer", "pixart_versus",
]

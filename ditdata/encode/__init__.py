"""`ditdata encode`: image shards -> latent store (VAE latents, optional text embeddings).

    image shard NNNNN.tar --(worker: decode, ADM center crop)--> uint8 batches
        --(main: autoencoder on the device, optional flip twin, text encoder)--> store shard NNNNN

Parallelism: DataLoader worker processes each take whole input shards, decode and crop
their images and hand over uint8 batches through shared memory, so decoding overlaps with
the batched encoding in the main process. Batches never straddle shards, so a shard's
latents do not depend on how the work was split (reruns and torchrun ranks give the
same bytes). Under torchrun each rank takes every WORLD_SIZE-th shard; rank 0 writes the
manifest once every shard exists.

Resumable and idempotent: the store writer publishes each shard atomically and skips
finished ones, so a rerun after a kill encodes only the missing shards.

With `buckets` (--buckets AREA[:STEP]) each image goes to the aspect-ratio bucket nearest
its shape (ditdata.framing; the cover crop instead of the square one), a worker's batches
hold one bucket each, and every input shard becomes at most one shard per bucket store,
then its record (buckets.py, BucketWriter, which also makes reruns skip finished input shards
and discard what a killed run left of the others); the top manifest is written last.

With `captions` (--captions alt,SET,...) every named caption set is embedded, one text-encoder
pass per set: the first keeps the store's plain text fields, each further set NAME gets its own
(text_tokens.NAME, text_length.NAME, caption.NAME, clip_score.NAME where its score files exist:
ditdata.store.captions), and the manifest lists them (conditioning.text.caption_sets). Every
shard still to encode must have every set, checked before any work.

With `features` (--features NAME) a feature set is made in the same pass: each batch's
cropped images also go through the feature encoder, and each feature shard is written right
after its latent shard, with exactly its keys (ditdata.features.encode_pass); once the store's
manifest is written, the feature shards the pass did not write are computed and the feature
set's manifest follows. The reader (ditdata.imageshards.batches) is `ditdata features`' too.

Nothing vanishes without a word. The store is locked for the whole run (one encode per
store; torchrun ranks share rank 0's lock). Before any encoding, every image shard still
to do must read through to its end and hold the count its stats file records; a shard
that does not stops the run with a one-line error, or, with `skip_bad_shards`, is left
out and listed in the manifest's `skipped_shards` (name, reason, samples lost). Within a
shard, every sample that is not encoded is counted by reason: undecodable images, members
without an image, and latents (or text embeddings) that are not finite in the storage
dtype (fp16 overflow in an autoencoder happens), which are never written.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ditdata.autoencoders.kinds import load_autoencoder
from ditdata.common.devices import amp_dtype, autocast, resolve_device
from ditdata.common.dist import join, launch_env, leave
from ditdata.common.lock import rank_zero_lock
from ditdata.common.memory import halved, out_of_memory_hint
from ditdata.common.progress import progress_bar
from ditdata.config import DTYPES, MAX_RESOLUTION, POSTERIORS, TEXT_DTYPES, EncodeConfig  # noqa: F401  (EncodeConfig: re-exported)
from ditdata.encode.buckets import BucketWriter, with_latent_shape
from ditdata.errors import DitdataError
from ditdata.framing import COVER_RULE, CROP_RULE, parse_spec
from ditdata.imageshards import folder as imageshards
from ditdata.imageshards.batches import ShardImages
from ditdata.imageshards.scores import read_score_meta, score_file_current, score_path
from ditdata.store import BFLOAT16, LATENT_SCALES, Schema, StoreWriter, TensorSpec, encode_array, quantize
from ditdata.store.captions import set_field, set_fields
from ditdata.store.schema import TEXT_LENGTH, RaggedSpec, dequantize, offsets_of, scale_field

NON_FINITE = "non-finite latent"
# Ranks wait for each other at the manifest: a rank with more (or slower) shards may take hours.
GROUP_TIMEOUT = dt.timedelta(hours=12)


# --------------------------------------------------------------------------- main side


def _to_numpy(x, dtype: str) -> np.ndarray:
    """A tensor in a float storage dtype; int8 latents travel as float32 until _ShardOut.add
    quantizes the samples it keeps (a non-finite one is left out, not refused)."""
    if dtype == "bfloat16":
        return x.to(torch.bfloat16).view(torch.int16).cpu().numpy().view(BFLOAT16)
    if dtype == "int8":
        return x.float().cpu().numpy()
    return x.to(torch.float16).cpu().numpy()


def _text_dtype(dtype: str) -> str:
    """Text embeddings are stored in the latents' dtype, float16 beside int8 latents."""
    return "float16" if dtype == "int8" else dtype


class _ShardOut:
    """One store shard being filled: its arrays and columns as batches arrive, the
    generator of its posterior draws (seeded by the shard, so the split of the work does
    not change the bytes) and the keys of the samples left out as not finite."""

    def __init__(self, seed: int, name: str, bucket: tuple[int, int] | None = None, int8: bool = False,
                 text_int8: bool = False, text_groups: tuple = (("text_tokens", TEXT_LENGTH),)):
        digits = "".join(c for c in name if c.isdigit()) or "0"
        shard_seed = (seed * 1_000_003 + int(digits)) % (2**63)
        if bucket is not None:  # a bucket's draws: seeded by (shard, bucket), not by batch order
            shard_seed = (shard_seed * 1_000_003 + bucket[0] * 65_537 + bucket[1]) % (2**63)
        self.gen = torch.Generator().manual_seed(shard_seed)
        self.tensors: dict[str, list] = {}
        self.columns: dict[str, list] = {}
        self.nonfinite_keys: list[str] = []
        self.int8 = int8  # quantize the latents (float32 here) of the samples kept
        self.text_int8 = text_int8  # quantize the unpadded text tokens (float32 here) of the samples kept
        self.text_groups = text_groups  # (tokens field, length field) of each caption set's unpadded tokens

    def add(self, tensors: dict[str, np.ndarray], columns: dict[str, list]) -> int:
        """Keep the batch's samples whose every value is finite as stored; returns how many."""
        # unpadded text tokens (all the batch's, caption after caption; each caption set's) are
        # checked per caption: a sample is kept when every one of its captions is finite
        groups = [(t, n) for t, n in self.text_groups if t in tensors and n in tensors]  # (not open_clip's padded)
        tokens = {t: tensors.pop(t) for t, _ in groups}
        ok = _finite_rows(tensors)
        for t, n in groups:
            finite = np.isfinite(tokens[t].astype(np.float32)).all(axis=1)
            if len(finite):
                ok &= np.add.reduceat(~finite, offsets_of(tensors[n].astype(np.int64))[:-1]) == 0
        if not ok.all():  # never store NaN/inf: count the samples and leave them out
            self.nonfinite_keys.extend(k for k, good in zip(columns["key"], ok, strict=True) if not good)
            tokens = {t: tokens[t][np.repeat(ok, tensors[n])] for t, n in groups}
            tensors = {k: v[ok] for k, v in tensors.items()}
            columns = {k: [x for x, good in zip(v, ok, strict=True) if good] for k, v in columns.items()}
        for t, _ in groups:
            if self.text_int8:  # codes and a scale per token (its W values)
                tensors[t], tensors[scale_field(t)] = quantize(tokens[t], axis=1)
            else:
                tensors[t] = tokens[t]
        if self.int8:  # codes and per-token scales (the C channels at each position: axis 1)
            for name in [k for k in tensors if k in LATENT_SCALES]:
                tensors[name], tensors[LATENT_SCALES[name]] = quantize(tensors[name], axis=1)
        for k, v in tensors.items():
            self.tensors.setdefault(k, []).append(v)
        for k, v in columns.items():
            self.columns.setdefault(k, []).extend(v)
        return int(ok.sum())

    def result(self, schema: Schema):
        tensors = {}
        for name, spec in (*schema.tensors.items(), *schema.ragged.items()):
            parts = self.tensors.get(name)
            dt_ = BFLOAT16 if spec.dtype == "bfloat16" else np.dtype(spec.dtype)
            tensors[name] = np.concatenate(parts) if parts else np.zeros((0, *spec.shape), dt_)
        columns = {c: self.columns.get(c, []) for c in schema.columns}
        return tensors, columns

    def stats(self, worker_stats: dict) -> dict:
        """The shard's record extras: the worker's skip counts plus the non-finite samples."""
        return _skip_stats(worker_stats, self.nonfinite_keys)


def _skip_stats(worker_stats: dict, nonfinite_keys: list[str]) -> dict:
    """An input shard's skip counts: the worker's (undecodable images, ...) plus the samples
    left out as not finite."""
    nonfinite = Counter({NON_FINITE: len(nonfinite_keys)})
    return {**worker_stats,
            "skipped": dict(Counter(worker_stats["skipped"]) + nonfinite),
            "skipped_keys": (worker_stats["skipped_keys"] + nonfinite_keys)[:1000]}


class Encoder:
    """Everything that runs on the device: the autoencoder and the optional text encoder."""

    def __init__(self, cfg: EncodeConfig, device: torch.device):
        self.cfg, self.device = cfg, device
        self.ae = load_autoencoder(cfg.vae, device=device, vae_config=cfg.vae_config)
        if cfg.posterior == "mean_std" and self.ae.deterministic:
            raise DitdataError(
                f"--posterior mean_std needs a KL autoencoder with a posterior; {self.ae.name} is "
                "deterministic (use --posterior sample)"
            )
        self.text = None
        self.ragged = False  # a transformers encoder: its tokens stored unpadded
        if cfg.text_encoder:
            from ditdata.textencoders import is_transformers_encoder, load_text_encoder

            self.ragged = is_transformers_encoder(cfg.text_encoder)
            self.text = load_text_encoder(cfg.text_encoder, device, max_tokens=cfg.text_max_tokens,
                                          instruction=cfg.text_instruction, pretrained=cfg.text_pretrained,
                                          config=cfg.text_config)
        cuda = device.type == "cuda"
        # Convolutions run faster in channels-last layout (oneDNN on this CPU: TAEF2 at 256 px
        # 3.6 vs 2.6 images/s; tensor cores on GPUs). On the CPU, one image at a time keeps
        # the full-resolution activations in cache (batches of 2-4 measured slower per image).
        if self.ae.module is not None:
            self.ae.module.to(memory_format=torch.channels_last)
        self.micro = cfg.batch_size if cuda else 1
        # bf16 autocast on GPUs that have it, fp16 on older ones; the CPU stays in fp32 (bf16
        # is very slow there): ditdata.common.devices' rule.
        self.amp = amp_dtype(device)

    def latent_names(self) -> list[str]:
        names = ["latent"] if self.cfg.posterior == "sample" else ["mean", "std"]
        return names + [f"{n}_flip" for n in names] if self.cfg.flip else names

    def images(self, images_u8, gen) -> dict:
        """(B, N, N, 3) uint8 -> {field: (B, C, h, w) float32 tensor} (scaled latents)."""
        x = torch.as_tensor(images_u8).to(self.device).permute(0, 3, 1, 2).float().div_(255.0)
        b = x.shape[0]
        if self.cfg.flip:
            x = torch.cat([x, x.flip(-1)])  # one pass for both views
        x = x.contiguous(memory_format=torch.channels_last)
        with torch.inference_mode(), autocast(self.device, self.amp):
            parts = [self.ae.encode(x[i:i + self.micro]) for i in range(0, len(x), self.micro)]
        mean = torch.cat([p[0] for p in parts]).float().contiguous()
        std = None if parts[0][1] is None else torch.cat([p[1] for p in parts]).contiguous()
        out = {}
        if self.cfg.posterior == "sample":
            if std is not None:
                eps = torch.randn(mean.shape, generator=gen, dtype=torch.float32).to(mean.device)
                mean = mean + std.float() * eps
            out["latent"] = mean[:b]
            if self.cfg.flip:
                out["latent_flip"] = mean[b:]
        else:
            out["mean"], out["std"] = mean[:b], std.float()[:b]
            if self.cfg.flip:
                out["mean_flip"], out["std_flip"] = mean[b:], std.float()[b:]
        return out

    def captions(self, captions: list[str]) -> dict:
        if self.ragged:  # {"text_tokens": (sum L_i, W) float32, "text_length": (B,)}: unpadded
            flat, lengths = self.text.embed_ragged(captions)
            return {"text_tokens": flat, TEXT_LENGTH: lengths}
        with torch.inference_mode(), autocast(self.device, self.amp):
            emb = self.text.embed_text(captions, tokens=self.cfg.text_tokens)
        return {k: v if v.dtype == torch.bool else v.float() for k, v in emb.items()}


def _load_scores(path: Path, captions: str = "alt") -> tuple[dict[str, float | None] | None, dict | None]:
    """({key: clip_score}, the CLIP model that made them {model, pretrained, weights_sha256}) of caption
    set `captions` of image shard `path` (NNNNN.clip.parquet, NNNNN.clip.SET.parquet), or (None, None)
    without a score file; DitdataError for one that is incomplete, or made for another version of the
    shard or of the set's captions (its scores would be of other captions)."""
    score_file = score_path(path, captions)
    if not score_file.is_file():
        return None, None
    import pyarrow.parquet as pq

    meta = read_score_meta(score_file)
    flag = "" if captions == "alt" else f" --captions {captions}"
    if meta is None:
        raise DitdataError(f"{score_file}: incomplete or not a score file; rerun `ditdata score {path.parent}{flag}`")
    if not score_file_current(path, captions, meta):
        raise DitdataError(f"{score_file}: made for a different version of {path.name} or of its captions; rerun "
                           f"`ditdata score {path.parent}{flag}` (it rescores what changed)")
    t = pq.read_table(score_file, columns=["key", "clip_score"])
    clip = {k: meta.get(k) for k in ("model", "pretrained", "weights_sha256")}
    return dict(zip(t.column("key").to_pylist(), t.column("clip_score").to_pylist(), strict=True)), clip


def encode(cfg: EncodeConfig) -> dict:
    """Encode every input shard not yet in the store and write the manifest. Returns a summary."""
    for flag, value, choices in (("--posterior", cfg.posterior, POSTERIORS), ("--dtype", cfg.dtype, DTYPES)):
        if value not in choices:
            raise DitdataError(f"{flag} must be one of {choices}")
    if cfg.dtype == "int8" and cfg.posterior != "sample":
        raise DitdataError("--dtype int8 stores one latent per image (--posterior sample): a per-token scale "
                           "for mean and for std is not offered; use --dtype float16 with --posterior mean_std")
    if not cfg.text_encoder and (cfg.text_pretrained or cfg.text_config or cfg.text_tokens):
        raise DitdataError("--text-pretrained, --text-config and --text-tokens need --text-encoder NAME")
    _check_text_options(cfg)
    sets = caption_set_names(cfg.captions)
    if sets and not cfg.text_encoder:
        raise DitdataError(f"--captions {','.join(sets)} needs --text-encoder NAME (the captions it embeds)")
    if len(sets) > 1 and not _transformers_text(cfg):
        raise DitdataError(f"--captions {','.join(sets)}: several caption sets are stored as unpadded tokens, which "
                           "the transformers text encoders give (t5-v1_1-xxl, gemma-2-2b, a folder, a hub id), not "
                           f"{cfg.text_encoder}")
    if cfg.text_encoder and not cfg.text_pretrained and not _transformers_text(cfg):
        raise DitdataError(f"--text-encoder {cfg.text_encoder} needs --text-pretrained TAG_OR_FILE "
                           "(the weights that embed the captions)")
    if not 0 < cfg.resolution <= MAX_RESOLUTION:
        raise DitdataError(f"--resolution {cfg.resolution}: expected 1 to {MAX_RESOLUTION} pixels (e.g. 256 or 512)")
    if cfg.batch_size < 1 or cfg.chunk_samples < 1 or cfg.workers < 0:
        raise DitdataError("--batch-size and --chunk-samples must be at least 1, --workers at least 0")
    # The --features options, checked before any work (the feature set's options alone are a
    # mistake: they would be silently ignored).
    given = [f"--{f.replace('_', '-')}" for f in ("features_out_name", "features_dims", "features_resolution")
             if getattr(cfg, f) is not None]
    if not cfg.features and given:
        raise DitdataError(f"{', '.join(given)} need --features ENCODER (the feature set to compute)")
    if cfg.features:
        from ditdata.features import check_options

        check_options(dtype=cfg.features_dtype, dims=cfg.features_dims, resolution=cfg.features_resolution,
                      resize=cfg.features_resize)
    if cfg.buckets and cfg.features:
        raise DitdataError("--buckets with --features is not supported yet (feature sets of bucketed stores "
                           "would need each bucket's crop); drop one of them")
    _check_out(Path(cfg.out), Path(cfg.shards), bool(cfg.buckets))
    with rank_zero_lock(cfg.out, "ditdata encode"):  # one encode per store
        return _encode(cfg)


def _check_out(out: Path, shards: Path, bucketed: bool) -> None:
    """--out must be a new or empty directory, or a store (bucketed with --buckets, plain
    without): never the image shards or another tool's folder, which the store's files
    would be mixed into."""
    from ditdata.store import refuse_inside_store

    refuse_inside_store(out.parent, "--out")  # a store inside another store
    if not out.is_dir():
        return
    if out.resolve() == shards.resolve() or shards.resolve() in out.resolve().parents:
        raise DitdataError(f"--out {out}: must not be the image-shard folder {shards} or inside it")
    from ditdata.common.lock import LOCK_FILE
    from ditdata.encode.buckets import INPUTS
    from ditdata.store import MANIFEST
    from ditdata.store.buckets import BUCKETS
    from ditdata.store.features import FEATURES
    from ditdata.store.writer import CONFIG, SHARDS

    names = {p.name for p in out.iterdir()} - {LOCK_FILE}
    if names and not names & {CONFIG, MANIFEST, BUCKETS}:
        first = sorted(names)[0]
        raise DitdataError(f"--out {out} is not empty and not a latent store (it holds {first!r}, ...); "
                           "choose a new directory")
    if bucketed and names & {CONFIG, SHARDS}:
        raise DitdataError(f"--out {out} is a plain latent store (one crop size); --buckets writes a bucketed "
                           "one: choose a new --out")
    if not bucketed and BUCKETS in names:
        raise DitdataError(f"--out {out} is a bucketed latent store (encoded with --buckets); give the same "
                           "--buckets to add to it, or choose a new --out")
    allowed = {CONFIG, MANIFEST, SHARDS, FEATURES} | ({BUCKETS, INPUTS} if bucketed else set())
    if names - allowed:
        extra = sorted(names - allowed)
        raise DitdataError(f"--out {out} holds files a latent store does not ({', '.join(extra[:3])}); "
                           "choose a new directory")


def _encode(cfg: EncodeConfig) -> dict:
    folder = imageshards.read_folder(cfg.shards)
    if not folder.shards:
        raise DitdataError(f"{cfg.shards}: no finished image shards (NNNNN.tar with NNNNN_stats.json)")
    if cfg.text_encoder and folder.info["kind"] == "classes":
        raise DitdataError("--text-encoder needs captions; this shard folder is a class dataset")
    if folder.foreign:
        print(f"note: {cfg.shards} has no {imageshards.DATASET_INFO} (not written by `ditdata fetch`); "
              f"reading its {len(folder.shards)} tar(s) as they are (captions, no labels)", file=sys.stderr)
    selection = None
    if cfg.select:
        from ditdata.imageshards.selections import load_selection

        selection = load_selection(cfg.select)
    env = launch_env()
    device = resolve_device(cfg.device)
    own_group = join(device, timeout=GROUP_TIMEOUT)  # a group we join, we also leave
    torch.manual_seed(cfg.seed)
    with _memory_hint(cfg, device):
        enc = Encoder(cfg, device)
        if cfg.buckets and enc.ae.adapter.no_buckets:
            raise DitdataError(f"--buckets: autoencoder {enc.ae.name} {enc.ae.adapter.no_buckets}")
        spec = parse_spec(cfg.buckets, enc.ae.downsample) if cfg.buckets else None
        layout = _store_layout(cfg, enc, folder, spec)
        image = {"resolution": cfg.resolution, "crop": "center", "crop_rule": CROP_RULE, "flip": cfg.flip}
        if spec is not None:
            image = {"resolution": spec.area, "crop": "cover", "crop_rule": COVER_RULE, "flip": cfg.flip,
                     "buckets": {"area": spec.area, "step": spec.step}}
        info = {"vae": enc.ae.info, "image": image, "conditioning": layout.conditioning,
                "filter": None if selection is None else {**selection.rule,
                                                          "selection": str(Path(cfg.select).resolve())}}
        options = {"backend": cfg.backend, "chunk_samples": cfg.chunk_samples}
        if spec is None:
            writer = StoreWriter(cfg.out, schema=layout.schema, info=info, **options)
        else:
            writer = BucketWriter(cfg.out, spec, layout.bucket_schema, info, **options)
        plan = _plan_shards(cfg, folder, writer, env.rank, env.world_size)
        keep = None if selection is None else selection.keys
        feats = None  # the feature set computed in this pass (--features)
        if cfg.features:
            from ditdata.features.encode_pass import InPass

            feats = InPass(cfg, device, folder, keep, {b["name"] for b in plan.bad}, plan.world)
        run = _encode_shards(cfg, enc, layout, plan, keep, writer, feats)
    summary = _finish(cfg, folder, writer, plan, run)
    if feats is not None:
        with _memory_hint(cfg, device):
            summary["features"] = feats.finish(cfg, plan.rank, plan.world)
    # after _finish's last barrier: a gloo rank that exits with the group open can die at
    # shutdown when its peer closes first (and torchrun's other agent then waits 300 s)
    leave(own_group)
    return summary


def _memory_hint(cfg: EncodeConfig, device: torch.device):
    """Out of GPU memory while encoding: one line that names the autoencoder (and text
    encoder), the batch and the precision, and a smaller --batch-size (ditdata.common.memory)."""
    what = f"encoding with {cfg.vae}" + "".join(f" and {m}" for m in (cfg.text_encoder, cfg.features) if m)
    batch = f"--batch-size {cfg.batch_size}" + (f" ({2 * cfg.batch_size} images a pass with --flip)" if cfg.flip else "")
    return out_of_memory_hint(what=what, batch=batch, precision=amp_dtype(device), device=device,
                              hints=[halved("--batch-size", cfg.batch_size)], error=DitdataError)


# ------------------------------------------------------------------- the steps of a run


def caption_set_names(value) -> tuple[str, ...]:
    """--captions as given ("alt,recap", a config file's list, None) -> the caption set names in
    order (the first is the store's plain text fields'); DitdataError for a name that is not one
    (ditdata.imageshards.captionsets.check_set_name) or is named twice."""
    from ditdata.imageshards.captionsets import check_set_name

    if not value:
        return ()
    parts = value.split(",") if isinstance(value, str) else list(value)
    names = tuple(check_set_name(str(part).strip()) for part in parts)
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise DitdataError(f"--captions {','.join(names)}: {', '.join(twice)} named twice; name each set once")
    return names


def _transformers_text(cfg: EncodeConfig) -> bool:
    from ditdata.textencoders import is_transformers_encoder

    return bool(cfg.text_encoder) and is_transformers_encoder(cfg.text_encoder)


def _check_text_options(cfg: EncodeConfig) -> None:
    """The options of the unpadded (transformers) text encoders, refused with any other."""
    if cfg.text_dtype not in TEXT_DTYPES:
        raise DitdataError(f"--text-dtype must be one of {TEXT_DTYPES}")
    given = [f for f, v in (("--text-max-tokens", cfg.text_max_tokens is not None),
                            ("--text-dtype", cfg.text_dtype != "float16"),
                            ("--text-instruction", cfg.text_instruction != "reference")) if v]
    if given and not _transformers_text(cfg):
        raise DitdataError(f"{', '.join(given)} apply to a transformers text encoder (--text-encoder t5-v1_1-xxl, "
                           "gemma-2-2b, a folder or a hub id), not to an open_clip one")
    if _transformers_text(cfg) and (cfg.text_pretrained or cfg.text_config):
        raise DitdataError(f"--text-pretrained / --text-config are open_clip options; {cfg.text_encoder} is a "
                           "transformers encoder (its folder or hub id holds the weights)")


def _ragged_text(cfg: EncodeConfig, enc: Encoder) -> tuple[dict, dict, dict]:
    """The schema entries (tensors, ragged) of unpadded text tokens and the manifest's
    conditioning, with the empty caption's embedding as the store keeps the others."""
    info = enc.text.info
    width, dtype = info["token_dim"], cfg.text_dtype
    tensors = {TEXT_LENGTH: TensorSpec((), "int32")}
    ragged = {"text_tokens": RaggedSpec((width,), dtype, TEXT_LENGTH)}
    if dtype == "int8":
        ragged["text_tokens_scale"] = RaggedSpec((), "float32", TEXT_LENGTH)
    for name in caption_set_names(cfg.captions)[1:]:  # each further caption set: its own ragged group
        tokens, length = set_field("text_tokens", name, False), set_field(TEXT_LENGTH, name, False)
        tensors[length] = TensorSpec((), "int32")
        ragged[tokens] = RaggedSpec((width,), dtype, length)
        if dtype == "int8":
            ragged[scale_field(tokens)] = RaggedSpec((), "float32", length)
    flat, _ = enc.text.empty_caption()
    x = flat.float().numpy()
    # the unconditional input as training sees the others: rounded to the storage (int8: its codes x scales)
    x = dequantize(*quantize(x, axis=1), axis=1) if dtype == "int8" else _to_numpy(torch.from_numpy(x), dtype)
    empty = {"text_tokens": encode_array(x), "text_mask": encode_array(np.ones(len(x), dtype=bool))}
    text = {**info, "layout": "ragged", "storage": dtype, "tokens_shape": [info["max_tokens"], width],
            "length_field": TEXT_LENGTH, "empty": empty}
    return tensors, ragged, {"type": "text", "text": text}



@dataclass
class _Layout:
    """What every store shard of the run holds, and where its values come from."""

    schema: Schema  # with --buckets: the square bucket's
    conditioning: dict  # the manifest's conditioning entry
    scores: dict[str, dict | None]  # image shard file name -> {key: clip_score}, None: not scored
    latent_shape: object = None  # (H, W) pixels -> the autoencoder's latent shape (C, h, w)
    buckets: tuple | None = None  # the bucket sizes (W, H) of --buckets
    caption_sets: tuple[str, ...] = ()  # --captions alt,SET,...: the caption sets embedded (none: the alt text)
    tars: dict = field(default_factory=dict)  # store shard name -> its image shard (for --captions)
    set_scores: dict = field(default_factory=dict)  # caption set -> {image shard file name: {key: score} or None}
    _captions: dict = field(default_factory=dict)  # caption set -> (shard name, {key: caption}) of the last shard read

    @property
    def sets(self) -> tuple[str, ...]:
        """The caption sets embedded, the first the store's plain fields' ("alt" without --captions)."""
        return self.caption_sets or ("alt",)

    @property
    def text_groups(self) -> tuple[tuple[str, str], ...]:
        """(tokens field, length field) of each caption set's unpadded tokens."""
        return tuple((set_field("text_tokens", n, i == 0), set_field(TEXT_LENGTH, n, i == 0))
                     for i, n in enumerate(self.sets))

    def captions_of(self, shard: str, keys: list[str], name: str) -> list[str]:
        """The captions of `keys` in shard `shard` of caption set `name` ("" where it has none, as a
        sample without alt text), read once per shard."""
        from ditdata.imageshards.captionsets import read_caption_set

        if self._captions.get(name, (None,))[0] != shard:
            self._captions[name] = (shard, read_caption_set(self.tars[shard], name))
        table = self._captions[name][1]
        missing = [k for k in keys if k not in table]
        if missing:
            raise DitdataError(f"{self.tars[shard]}: caption set {name!r} has no row for key "
                               f"{missing[0]!r}; caption the shard again (ditdata caption --out-name {name})")
        return [table[k] or "" for k in keys]

    def bucket_schema(self, size: tuple[int, int]) -> Schema:
        """The schema of bucket `size` (W, H): its latents are (C, H/f, W/f)."""
        return with_latent_shape(self.schema, self.latent_shape(size[1], size[0]))

    def schema_of(self, bucket: tuple[int, int] | None) -> Schema:
        return self.schema if bucket is None else self.bucket_schema(bucket)


def _store_layout(cfg: EncodeConfig, enc: Encoder, folder: imageshards.ShardFolder, spec=None) -> _Layout:
    ae, info = enc.ae, folder.info
    if spec is None and cfg.resolution % ae.downsample:
        lo = cfg.resolution // ae.downsample * ae.downsample
        fits = " or ".join(str(r) for r in (lo, lo + ae.downsample) if r > 0)
        raise DitdataError(f"--resolution {cfg.resolution} is not a multiple of {ae.name}'s downsample "
                           f"factor {ae.downsample}; use a multiple of {ae.downsample}, e.g. {fits}")
    side = cfg.resolution if spec is None else spec.area
    latent_shape = ae.latent_shape(side, side)
    tensors = {n: TensorSpec(latent_shape, cfg.dtype) for n in enc.latent_names()}
    if cfg.dtype == "int8":  # each int8 latent's scales: one per token (position)
        tensors |= {LATENT_SCALES[n]: TensorSpec(latent_shape[1:], "float32") for n in enc.latent_names()}
    conditioning: dict = {"type": "none"}
    ragged: dict = {}
    if info["kind"] == "classes":
        conditioning = {"type": "class", "num_classes": info.get("num_classes"), "class_names": info.get("class_names")}
    elif enc.text is not None and enc.ragged:
        text_tensors, ragged, conditioning = _ragged_text(cfg, enc)
        tensors |= text_tensors
    elif enc.text is not None:
        # the text fields' tensor specs, and the empty-caption embedding for the manifest
        text_specs, arrays = {}, {}
        for k, v in enc.captions([""]).items():
            is_mask = v.dtype == torch.bool
            text_specs[k] = TensorSpec(tuple(v.shape[1:]), "bool" if is_mask else _text_dtype(cfg.dtype))
            arrays[k] = v[0].cpu().numpy() if is_mask else _to_numpy(v[0], _text_dtype(cfg.dtype))
        empty = {k: encode_array(a) for k, a in arrays.items()}
        tensors |= text_specs
        conditioning = {"type": "text", "text": {
            **enc.text.info,
            "encoder": enc.text.info.get("model"),
            # a custom open_clip config is needed again to embed prompts at sampling time
            "config": str(Path(cfg.text_config).resolve()) if cfg.text_config else None,
            "pooled_dim": text_specs["text_pooled"].shape[0],
            "tokens_shape": list(text_specs["text_tokens"].shape) if "text_tokens" in text_specs else None,
            "empty": empty,
        }}
    names = caption_set_names(cfg.captions) if enc.text is not None else ()
    # each caption set's CLIP scores where its score files exist (the first set's: the clip_score
    # column; without --captions, the alt text's, as before), and the CLIP models that made them
    set_scores, clips = {}, {}
    for name in names or ("alt",):
        loaded = {p.name: _load_scores(p, name) for p in folder.shards}
        set_scores[name] = {k: v[0] for k, v in loaded.items()}
        clips[name] = [c for _, c in loaded.values() if c is not None]
    scores = set_scores[(names or ("alt",))[0]]
    columns = {"key": "string", **({"label": "int64"} if info["kind"] == "classes" else {"caption": "string"}),
               "source": "string", "original_width": "int64", "original_height": "int64"}
    if any(v is not None for v in scores.values()):
        columns["clip_score"] = "float64"
    for name in names[1:]:  # each further set's captions and, where scored, its CLIP scores
        columns[set_field("caption", name, False)] = "string"
        if any(v is not None for v in set_scores[name].values()):
            columns[set_field("clip_score", name, False)] = "float64"
    if spec is not None:
        columns["crop"] = "int64"  # pixels the cover crop cut off (ditdata.framing.crop_pixels)
    if names and conditioning.get("type") == "text":  # what the embeddings are of
        conditioning["text"]["caption_set"] = names[0]
        if enc.ragged:
            conditioning["text"]["caption_sets"] = _caption_set_records(names, clips, cfg.text_dtype == "int8",
                                                                        columns)
    return _Layout(Schema(tensors=tensors, columns=columns, ragged=ragged), conditioning, scores, ae.latent_shape,
                   None if spec is None else tuple(spec.sizes()), caption_sets=names,
                   tars={p.name[:-len(".tar")]: p for p in folder.shards}, set_scores=set_scores)


def _caption_set_records(names: tuple[str, ...], clips: dict, int8: bool, columns: dict) -> list[dict]:
    """The manifest's conditioning.text.caption_sets (ditdata.store.captions): each set's fields, the
    CLIP model of its scores and how many image shards had them; DitdataError when one set's shards
    were scored by different CLIP models (their scores would not compare)."""
    out = []
    for i, name in enumerate(names):
        rec = set_fields(name, i == 0, int8=int8, scored=set_field("clip_score", name, i == 0) in columns)
        models = {json.dumps(c, sort_keys=True) for c in clips[name]}
        if len(models) > 1:
            flag = "" if name == "alt" else f" --captions {name}"
            raise DitdataError(f"caption set {name!r}: its shards were scored by different CLIP models "
                               f"({'; '.join(sorted(models))}); rescore them with one (ditdata score{flag} --overwrite)")
        out.append({**rec, "clip": json.loads(next(iter(models))) if models else None,
                    "scored_shards": len(clips[name])})
    return out


@dataclass
class _Plan:
    """Which image shards this rank encodes."""

    names: list[str]  # the store shard name of every input, in order
    todo: list[tuple[str, Path, int | None]]  # (name, tar, samples its stats file records)
    bad: list[dict]  # shards found damaged before the run, on every rank (_bad_shard)
    already: int  # this rank's shards already in the store
    rank: int
    world: int


def _plan_shards(cfg: EncodeConfig, folder, writer: StoreWriter | BucketWriter, rank: int, world: int) -> _Plan:
    inputs = folder.shards
    names = [p.name[: -len(".tar")] for p in inputs]
    mine = [(n, p) for i, (n, p) in enumerate(zip(names, inputs, strict=True)) if i % world == rank]
    todo = [(n, p, folder.expected[p.name]) for n, p in mine if not writer.done(n)]
    # --captions: every shard still to encode (every rank's, so all stop alike) has every set
    _check_caption_sets([p for n, p in zip(names, inputs, strict=True) if not writer.done(n)],
                        caption_set_names(cfg.captions) if cfg.text_encoder else ())
    # Every shard to encode is checked before any work: a damaged one stops the run now,
    # not hours in (or, with --skip-bad-shards, is left out and recorded).
    problems = {n: imageshards.check_shard(p, e) for n, p, e in todo}
    bad = _gather_lists([_bad_shard(n, p, e, problems[n]) for n, p, e in todo if problems[n]], world)
    _refuse_bad_shards(bad, cfg)
    return _Plan(names, [t for t in todo if not problems[t[0]]], bad, len(mine) - len(todo), rank, world)


def _check_caption_sets(tars: list[Path], names: tuple[str, ...]) -> None:
    """DitdataError, one line, when an image shard of `tars` lacks a complete caption set of `names`
    made for it as it is now (ditdata.imageshards.captionsets): each set missing somewhere, with how
    many shards and the first of them."""
    from ditdata.common.errors import first_names
    from ditdata.imageshards.captionsets import ALT, caption_set_path, read_caption_meta

    lacking = {}
    for name in names:
        if name == ALT:  # the shards' own captions: in the tars
            continue
        bad = [t.name for t in tars if (meta := read_caption_meta(caption_set_path(t, name))) is None
               or (t.is_file() and meta.get("shard_bytes") != t.stat().st_size)]
        if bad:
            lacking[name] = bad
    if lacking:
        what = "; ".join(f"no complete caption set {n!r} for {len(b)} of {len(tars)} shards ({first_names(b, 3)})"
                         for n, b in lacking.items())
        raise DitdataError(f"--captions {','.join(names)}: {what}; run `ditdata caption {tars[0].parent} --captioner "
                           f"NAME --out-name SET` for each (a set made for another version of a shard counts as "
                           "missing)")


def _encode_shards(cfg: EncodeConfig, enc: Encoder, layout: _Layout, plan: _Plan, keep: set | None,
                   writer: StoreWriter | BucketWriter, feats=None) -> dict:
    """The batch loop: decoded images from the workers -> latents -> one store shard per
    image shard (with --buckets: one per bucket its images went to), written when its last
    batch is in (and its feature shard right after, with its keys, when `feats`:
    ditdata.features.encode_pass). Returns what the run did."""
    todo = plan.todo
    workers = min(cfg.workers, len(todo))
    loader = torch.utils.data.DataLoader(
        ShardImages(todo, cfg.resolution, cfg.batch_size, keep, layout.buckets), batch_size=None,
        num_workers=workers, persistent_workers=False, prefetch_factor=4 if workers else None,
    )
    jobs = {n: (p, e) for n, p, e in todo}
    pending: dict[tuple, _ShardOut] = {}  # (input shard, bucket or None) -> its samples so far
    encoded, skipped, late_bad = 0, Counter(), []
    t0 = time.perf_counter()
    bar = progress_bar(total=sum(e or 0 for _, _, e in todo) or None, unit="img",
                       desc=f"encode[{plan.rank}]" if plan.world > 1 else "encode", enabled=cfg.progress)
    for batch in loader:
        name, bucket = batch["shard"], batch["bucket"] and tuple(batch["bucket"])  # (the loader makes it a list)
        if (name, bucket) not in pending:
            pending[name, bucket] = _ShardOut(cfg.seed, name, bucket, int8=cfg.dtype == "int8",
                                              text_int8=enc.ragged and cfg.text_dtype == "int8",
                                              text_groups=layout.text_groups)
        shard = pending[name, bucket]
        if batch["meta"]:
            encoded += shard.add(*_encode_batch(cfg, enc, layout, batch, shard.gen))
            if feats is not None:
                feats.batch(name, batch["images"], [m["key"] for m in batch["meta"]])
            bar.update(len(batch["meta"]))
        if batch["last"]:
            outs = {b: pending.pop((n, b)) for n, b in list(pending) if n == name}
            path, expected = jobs[name]
            if batch["bad"]:  # the tar changed since it was checked: same rules as before the run
                late_bad.append(_bad_shard(name, path, expected, batch["bad"]))
                _refuse_bad_shards(late_bad[-1:], cfg)
                if feats is not None:
                    feats.discard(name)
                continue
            if layout.buckets is not None:
                skipped.update(_write_buckets(cfg, writer, layout, name, outs, batch["stats"], str(path)))
                continue
            stats = shard.stats(batch["stats"])
            skipped.update(stats["skipped"])
            tensors, columns = shard.result(layout.schema)
            record = writer.write_shard(name, tensors, columns, source=str(path), extra=stats)
            if feats is not None:
                feats.written(writer, record, columns["key"], path)
    bar.close()
    return {"encoded": encoded, "skipped": skipped, "late_bad": late_bad, "seconds": time.perf_counter() - t0}


def _write_buckets(cfg: EncodeConfig, writer: BucketWriter, layout: _Layout, name: str, outs: dict,
                   worker_stats: dict, source: str) -> Counter:
    """Input shard `name`'s buckets, each a shard of its bucket store, then the record that
    says it is finished (ditdata.encode.buckets). Returns its skipped samples by reason."""
    parts, nonfinite = {}, []
    for bucket, out in outs.items():
        nonfinite += out.nonfinite_keys
        if bucket is None or not out.columns.get("key"):
            continue
        tensors, columns = out.result(layout.schema_of(bucket))
        parts[bucket] = (tensors, columns, {"nonfinite_keys": out.nonfinite_keys[:1000]})
    stats = _skip_stats(worker_stats, nonfinite)
    step = writer.spec.step
    beyond = sum(1 for _, c, _ in parts.values() for crop in c["crop"] if crop > step)
    writer.write(name, parts, source=source, stats=stats, cropped_beyond_step=beyond)
    return Counter(stats["skipped"])


def _encode_batch(cfg: EncodeConfig, enc: Encoder, layout: _Layout, batch: dict, gen) -> tuple[dict, dict]:
    """One worker batch -> (arrays in the storage dtype, columns) for the store."""
    metas = batch["meta"]
    out = {k: _to_numpy(v, cfg.dtype) for k, v in enc.images(batch["images"], gen).items()}
    cols = {"key": [m["key"] for m in metas],
            **{k: [m.get(k) for m in metas] for k in ("source", "original_width", "original_height")}}
    for k in ("label", "caption", "crop"):
        if k in layout.schema.columns:
            cols[k] = [m.get(k) for m in metas]
    # --captions alt,SET,...: each set's captions (the first stored as `caption`, the others as caption.SET)
    # and, where scored, its CLIP scores (clip_score, clip_score.SET)
    alt = [m.get("caption") for m in metas]  # the tar's own captions
    captions = {name: alt if name == "alt" else layout.captions_of(batch["shard"], cols["key"], name)
                for name in layout.caption_sets}
    for i, name in enumerate(layout.caption_sets):
        cols[set_field("caption", name, i == 0)] = captions[name]
    for i, name in enumerate(layout.sets):
        column = set_field("clip_score", name, i == 0)
        if column in layout.schema.columns:
            table = (layout.set_scores.get(name) or {}).get(batch["shard"] + ".tar") or {}
            cols[column] = [table.get(k) for k in cols["key"]]
    if enc.text is not None and enc.ragged:  # one text-encoder pass per caption set
        for (tokens, length), name in zip(layout.text_groups, layout.sets, strict=True):
            emb = enc.captions([c or "" for c in captions.get(name, alt)])
            # float32 until _ShardOut.add has kept the finite captions (int8: then quantized)
            out[tokens] = emb["text_tokens"].numpy() if cfg.text_dtype == "int8" else \
                _to_numpy(emb["text_tokens"], cfg.text_dtype)
            out[length] = emb[TEXT_LENGTH].numpy().astype(np.int32)
        return out, cols
    if enc.text is not None:
        emb = enc.captions([c or "" for c in cols["caption"]])
        out |= {k: (v.cpu().numpy() if k == "text_mask" else _to_numpy(v, _text_dtype(cfg.dtype))) for k, v in emb.items()}
    return out, cols


def _finish(cfg: EncodeConfig, folder, writer: StoreWriter, plan: _Plan, run: dict) -> dict:
    """Rank 0 writes the manifest once every rank is done; every rank returns the summary."""
    world = plan.world
    bad = sorted(plan.bad + _gather_lists(run["late_bad"], world), key=lambda b: b["name"])
    if world > 1:
        dist.barrier()
    manifest = None
    if plan.rank == 0:
        skipped_names = {b["name"] for b in bad}
        manifest = writer.finalize([n for n in plan.names if n not in skipped_names], skipped_shards=bad, provenance={
            "input_shards": [str(p) for p in folder.shards],
            "shards_dir": str(Path(cfg.shards).resolve()),
            "dataset": {k: folder.info.get(k) for k in ("kind", "source", "num_samples")},
            "encode": {k: v for k, v in asdict(cfg).items() if k not in ("progress", "extra")},
        })
    if world > 1:
        dist.barrier()
    encoded, elapsed = run["encoded"], run["seconds"]
    return {
        "encoded": encoded,
        "skipped": dict(run["skipped"]),
        "skipped_shards": bad,
        "shards_written": len(plan.todo) - len(run["late_bad"]),
        "shards_skipped": plan.already,
        "seconds": elapsed,
        "images_per_s": encoded / elapsed if elapsed > 0 else 0.0,
        "num_samples": manifest["num_samples"] if manifest else None,
        "buckets": (manifest or {}).get("buckets"),
    }


def report(summary: dict) -> str | None:
    """The end-of-run line of `ditdata encode`; None on the ranks that wrote no manifest."""
    r = summary
    if r["num_samples"] is None:
        return None
    skipped = ", ".join(f"{k}: {v}" for k, v in r["skipped"].items()) or "none"
    bad = "; ".join(imageshards.left_out(Path(b["shard"]).name, b["reason"], b["samples_lost"])
                    for b in r["skipped_shards"])
    line = (f"{r['num_samples']} samples; this run encoded {r['encoded']} images in "
            f"{r['shards_written']} shards ({r['shards_skipped']} already done) at "
            f"{r['images_per_s']:.1f} img/s; skipped: {skipped}"
            + (f"; skipped shards: {bad}" if bad else ""))
    if r.get("buckets"):
        b = r["buckets"]
        line += (f"; {len(b['list'])} aspect-ratio buckets ({b['cropped_beyond_step']} images cropped by more "
                 f"than {b['step']} px; `ditdata inspect` shows the histogram)")
    if r.get("features"):
        from ditdata.features import report as features_report

        line += f"; {features_report(r['features'])}"
    return line


def _finite_rows(arrays: dict[str, np.ndarray]) -> np.ndarray:
    """(n,) bool: the samples whose every float value is finite, as stored (after the cast
    to fp16/bf16, where an overflow becomes inf)."""
    n = len(next(iter(arrays.values())))
    ok = np.ones(n, dtype=bool)
    for v in arrays.values():
        if v.dtype != np.bool_:
            ok &= np.isfinite(v.astype(np.float32).reshape(n, -1)).all(axis=1)
    return ok


def _bad_shard(name: str, path: Path, expected: int | None, reason: str) -> dict:
    """The manifest's record of an image shard left out: name, reason, samples lost (None:
    unknown, the shard has no stats file)."""
    return {"name": name, "shard": str(path), "reason": reason, "samples_lost": expected}


def _refuse_bad_shards(bad: list[dict], cfg: EncodeConfig) -> None:
    if not bad or cfg.skip_bad_shards:
        return
    first = bad[0]
    raise imageshards.bad_shard_error(first["shard"], first["reason"], len(bad) - 1,
                                      " (recorded in the store's manifest)")


def _gather_lists(items: list, world: int) -> list:
    """Every rank's list items, on every rank."""
    if world == 1:
        return list(items)
    parts = [None] * world
    dist.all_gather_object(parts, items)
    return [x for part in parts for x in part]

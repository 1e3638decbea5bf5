"""Human-readable reports on a latent store: `ditdata inspect` and `ditdata verify`, which
cover the store's feature sets too (ditdata.store.features) and a bucketed store's buckets
(ditdata.store.buckets: inspect shows their histogram); a plain store without feature sets
reads as it always did. Given an image-shard folder instead, they report its caption sets
(ditdata.imageshards.captionsets): inspect their coverage and counts, verify each file (complete,
made for the shard as it is, its rows the shard's keys in order, statuses and counts that agree)."""

from __future__ import annotations

from typing import NamedTuple

from ditdata.common.bytesize import format_size
from ditdata.store import open_store
from ditdata.store.captions import caption_set_faults, describe_caption_sets


def _conditioning(cond, lengths: dict | None = None) -> list[str]:
    """The store's typed conditioning (ditdata.store.Conditioning) as report lines; `lengths`:
    the manifest's caption length statistics of unpadded text tokens."""
    if cond.kind == "class":
        names = cond.class_names or ()
        shown = ", ".join(map(str, names[:5])) + (", ..." if len(names) > 5 else "")
        return [f"conditioning: class, {cond.num_classes} classes ({shown})"]
    if cond.kind == "text":
        t = cond.text or {}
        if t.get("layout") == "ragged":  # a transformers encoder: tokens unpadded (ditdata.textencoders)
            ln = (lengths or {}).get(t.get("length_field") or "text_length") or {}
            per = (f"; caption tokens mean {ln['mean']}, p50 {ln['p50']}, p95 {ln['p95']}, max {ln['max']}"
                   if ln.get("count") else "")
            return [f"conditioning: text, encoder {t.get('encoder')} ({t.get('model_type')}, {t.get('id')}, "
                    f"revision {t.get('revision')})",
                    f"  tokens unpadded, up to {t.get('max_tokens')} x {t.get('token_dim')} in {t.get('storage')}"
                    f"{per}; empty prompt {len(cond.empty.get('text_tokens', ()))} token(s)",
                    f"  convention: {t.get('convention')}"]
        tokens = list(cond.tokens_shape) if cond.tokens_shape else "not stored"
        return [f"conditioning: text, encoder {t.get('encoder')} ({t.get('pretrained')})",
                f"  pooled dim {cond.pooled_dim}, tokens {tokens}"]
    return [f"conditioning: {cond.kind}"]


def is_image_shard_folder(path) -> bool:
    """A local folder of image shards (NNNNN.tar, `ditdata fetch`'s or another tool's) and not a
    latent store: inspect and verify then report its caption sets."""
    from pathlib import Path

    p = Path(str(path))
    return p.is_dir() and not (p / "manifest.json").exists() and any(p.glob("*.tar"))


def describe(path, **remote) -> str:
    if not remote and is_image_shard_folder(path):
        return describe_shards(path)
    s = open_store(path, **remote)
    m = s.manifest
    lat = m["latent"]
    vae = m["vae"]
    lines = [
        f"store:        {s.url or s.root}" + (f" (cached in {s.root})" if s.url else ""),
        f"format:       version {m['format_version']}, backend {m['backend']}",
        f"samples:      {m['num_samples']} in " + (
            f"{len(s.buckets)} buckets ({sum(len(b.store.shards) for b in s.buckets)} shards)" if s.buckets
            else f"{len(s.shards)} shards"),
        f"latent:       {tuple(lat['shape'])} {lat['dtype']}, stored as {lat['stored']}"
        f"{', with flipped variant' if lat['flip'] else ''}"
        + (f", codes with a float32 scale per token ({lat['int8']['scale']})" if lat.get("int8") else "")
        + (" (the square or most populated bucket's; all below)" if s.buckets else ""),
        f"autoencoder:  {vae.get('name')} ({vae.get('id')}), scaling {vae.get('scaling_factor')}, "
        f"shift {vae.get('shift_factor')}, {vae.get('latent_channels')} channels, /{vae.get('downsample')}"
        + ("; no published scaling: `dittrain run` standardises it per channel (--latent-norm auto)"
           if vae.get("latent_norm") == "channel" else ""),
        f"image:        {m['image'].get('resolution')} px, crop {m['image'].get('crop')}",
        *_conditioning(s.conditioning, m.get("ragged")),
        *describe_caption_sets(s),
        f"filter:       {m['filter'] if m['filter'] else 'none'}",
        "fields:       " + ", ".join(
            [f"{k} {v['dtype']}{v['shape']}" for k, v in m["fields"]["tensors"].items()]
            + [f"{k} {v['dtype']}[{v['length']} x {v['shape']}] (unpadded)"
               for k, v in (m["fields"].get("ragged") or {}).items()]
        ),
        "columns:      " + ", ".join(f"{k} ({v})" for k, v in m["fields"]["columns"].items()),
    ]
    st = m["stats"]
    if st.get("mean"):
        lines.append(f"channel stats ({st['field']}, {st['count']} values each):")
        for c, (mu, sd) in enumerate(zip(st["mean"], st["std"], strict=True)):
            lines.append(f"  c{c:<3d} mean {mu:+.4f}  std {sd:.4f}")
    lines += _bucket_lines(s)
    for b in m.get("skipped_shards", []):
        lost = b.get("samples_lost")
        lines.append(f"skipped:      image shard {b.get('shard') or b['name']} ({b.get('reason')}; "
                     f"{'unknown number of' if lost is None else lost} samples lost)")
    lines += _feature_lines(s)
    lines.append(f"size on disk: {format_size(s.nbytes_on_disk())}")
    prov = m.get("provenance", {})
    lines.append(f"created:      {prov.get('created_at')} with ditkit {prov.get('tools', {}).get('ditkit')}")
    return "\n".join(lines)


BAR = 30  # characters of the histogram's longest bar


def _bucket_lines(s) -> list[str]:
    """A bucketed store's histogram: one line per bucket (name, latent shape, count, share,
    bar); none for a plain store."""
    if not s.buckets:
        return []
    total, top = max(len(s), 1), max(b.num_samples for b in s.buckets) or 1
    lines = [f"buckets:      {len(s.buckets)}, AREA {s.area} STEP {s.step}: {s.cropped_beyond_step} images cropped "
             f"by more than {s.step} px (beyond the 1:2 to 2:1 ratios)",
             f"  {'bucket':<11} {'latent':<16} {'samples':>8} {'share':>6}"]
    for b in s.buckets:
        bar = "#" * round(BAR * b.num_samples / top)
        lines.append(f"  {b.name:<11} {str(b.latent_shape):<16} {b.num_samples:>8} "
                     f"{100 * b.num_samples / total:>5.1f}% {bar}")
    return lines


def _each_feature_set(s):
    """(name, its FeatureSet, None) for each feature set the store records, in name order, or
    (name, None, the StoreError) for one that cannot be opened: inspect and verify both
    report that one and go on with the next."""
    from ditdata.store import StoreError, feature_sets, open_features

    for name in sorted(feature_sets(s)):
        try:
            fs = open_features(s, name)
        except StoreError as e:
            yield name, None, e
            continue
        yield name, fs, None


def _feature_lines(s) -> list[str]:
    """One line per feature set: name, encoder, tokens x dims and dtype, PCA, bytes per
    sample, rows (or why it cannot be read)."""
    lines = []
    for name, fs, error in _each_feature_set(s):
        if error is not None:
            lines.append(f"features:     {name}: unusable ({error})")
            continue
        enc, st, pca = fs.encoder, fs.storage, fs.storage.get("pca")
        dtype = fs.schema.tensors["feat"].dtype
        reduced = (f", PCA {enc.get('dim')} -> {fs.dims} ({100 * pca['explained_variance']:.1f}% of the variance)"
                   if pca else "")
        cosine = st.get("cosine_to_fp32")
        lines.append(f"features:     {name}: {enc.get('name')}, {fs.tokens} x {fs.dims} {dtype}{reduced}"
                     f"{', with flips' if fs.flip else ''}, {fs.bytes_per_sample()} bytes/sample, {len(fs)} rows"
                     + (f", cosine to fp32 {cosine:.4f}" if cosine is not None else ""))
    return lines


def verify_store(path, *, progress: bool = True, **remote) -> tuple[list[str], int]:
    """Faults (one line each) and samples of verify_all (its warnings left out)."""
    result = verify_all(path, progress=progress, **remote)
    return result.faults, result.samples


class Verified(NamedTuple):
    """What verify_all found: faults (one line each, naming the file), the samples verified,
    the names of the feature sets verified, and warnings (one line each: suspect, no fault);
    for an image-shard folder, the caption sets verified."""

    faults: list[str]
    samples: int
    feature_sets: list[str]
    warnings: list[str]
    caption_sets: list[str] = []


def verify_all(path, *, progress: bool = True, **remote) -> Verified:
    """Verify a store (Store.verify: every checksum, shape and count, NaN/inf of float fields
    as faults, tokens exactly zero in every dimension as warnings) and each of its feature
    sets the same way, checked against the store (ditdata.store.features.check_matches); a
    URL store downloads every shard into its cache. progress: a bar over the shards
    (ditdata.common.progress; False: -q/--quiet)."""
    from ditdata.common.progress import progress_bar
    from ditdata.store import feature_sets

    if not remote and is_image_shard_folder(path):
        return verify_shards(path, progress=progress)
    s = open_store(path, **remote)
    warnings: list[str] = []
    faults = s.verify(progress=lambda xs: progress_bar(xs, desc="verify", unit="shard", enabled=progress, leave=False),
                      warnings=warnings)
    faults += caption_set_faults(s)  # the caption sets the manifest lists, against the fields
    for name, fs, error in _each_feature_set(s):
        if error is not None:
            faults.append(str(error))
            continue
        faults += fs.verify(progress=lambda xs, n=name: progress_bar(xs, desc=f"verify {n}", unit="shard",
                                                                   enabled=progress, leave=False), warnings=warnings)
    return Verified(faults, len(s), sorted(feature_sets(s)), warnings)


def _filename(key: str) -> str:
    """A sample key as a flat, safe file name."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in str(key))
    return safe.strip(".") or "sample"


def decode_samples(path, n: int, out, *, vae: str | None = None, device: str = "cpu",
                   batch_size: int = 16, **remote) -> list:
    """Decode the first n latents of a store with its own autoencoder; write PNGs by key."""
    from pathlib import Path

    import torch
    from PIL import Image

    from ditdata.autoencoders.kinds import autoencoder_from_manifest
    from ditdata.common.devices import resolve_device
    from ditdata.store import LATENT_SCALES, values

    s = open_store(path, **remote)
    ae = autoencoder_from_manifest(s.manifest["vae"], device=resolve_device(device), source=vae)
    field = s.schema.primary  # "latent", or "mean" for mean+std stores
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    shards = [(b.store, shard) for b in s.buckets for shard in b.store.shards] or [(s, shard) for shard in s.shards]
    for store, shard in shards:
        if len(written) >= n:
            break
        fields = [field, "key", *([LATENT_SCALES[field]] if LATENT_SCALES.get(field) in store.schema.tensors else [])]
        data = store.read(shard, fields=fields, stop=n - len(written))
        latents = values(data, field)  # int8 ones dequantized
        for i in range(0, len(data["key"]), batch_size):
            z = torch.from_numpy(latents[i:i + batch_size])
            images = ae.decode(z).mul(255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
            for key, img in zip(data["key"][i:i + batch_size], images, strict=True):
                p = out / f"{_filename(key)}.png"
                Image.fromarray(img).save(p)
                written.append(p)
    return written


# --------------------------------------------------------------------------- image-shard folders


def _caption_set_line(d, name: str) -> str:
    from ditdata.imageshards.captionsets import FLAGS, OK, set_coverage

    cov = set_coverage(d, name)
    c = cov["counts"]
    undecodable = sum(v for k, v in c.items() if k != OK and k not in FLAGS)
    parts = [f"{cov['complete']} of {cov['shards']} shards, {sum(c.values())} samples: ok {c.get(OK, 0)}, "
             + ", ".join(f"{f} {c.get(f, 0)}" for f in FLAGS) + f", undecodable {undecodable}"]
    if cov["stale"]:
        parts.append(f"{len(cov['stale'])} stale (made for another version of the shard)")
    caps = cov["captioners"]
    if len(caps) == 1 and caps[0]:
        parts.append(f"by {caps[0].get('name')}")
    elif len(caps) > 1:
        parts.append(f"by {len(caps)} different captioners")
    return f"  {name:<12} " + "; ".join(parts)


def describe_shards(path) -> str:
    """`ditdata inspect SHARDS`: the folder, its caption sets (coverage, ok / flagged /
    undecodable counts, the captioner) and which sets have CLIP scores."""
    from ditdata.imageshards import folder as shards
    from ditdata.imageshards.captionsets import ALT, list_caption_sets
    from ditdata.imageshards.scores import read_score_meta, score_path

    f = shards.read_folder(path)
    n = f.info.get("num_samples")
    lines = [f"image shards: {f.path} ({len(f.shards)} shards, {'?' if n is None else n} samples, "
             f"kind {f.info.get('kind')}{', written by another tool' if f.foreign else ''})"]
    sets = list_caption_sets(f.path)
    lines.append("caption sets:" if sets else "caption sets: none")
    for name in sets:
        if name == ALT:
            lines.append(f"  {ALT:<12} the shards' own captions (the alt-text in each tar)")
        else:
            lines.append(_caption_set_line(f.path, name))
    scored = []
    for name in sets:
        k = sum(read_score_meta(score_path(t, name)) is not None for t in f.shards)
        if k:
            scored.append(f"{name} ({k} of {len(f.shards)} shards)")
    lines.append("clip scores:  " + (", ".join(scored) if scored else "none"))
    return "\n".join(lines)


def verify_shards(path, *, progress: bool = True) -> Verified:
    """`ditdata verify SHARDS`: every shard reads to its end and holds the count its stats file
    records (ditdata.imageshards.folder.check_shard), and every caption-set file of the folder is
    sound (module docstring). A set that does not cover every shard yet is a warning, not a fault."""
    from collections import Counter

    from ditdata.common.progress import progress_bar
    from ditdata.imageshards import folder as shards
    from ditdata.imageshards.captionsets import (
        ALT,
        FLAGS,
        OK,
        caption_set_path,
        list_caption_sets,
        read_caption_meta,
        read_caption_table,
    )

    f = shards.read_folder(path)
    sets = [n for n in list_caption_sets(f.path) if n != ALT]
    faults, warnings, samples = [], [], 0
    for tar in progress_bar(f.shards, desc="verify", unit="shard", enabled=progress, leave=False):
        problem = shards.check_shard(tar, f.expected[tar.name])  # the tar reads to its end, holds its count
        if problem is not None:
            faults.append(f"{tar}: {problem}; its caption sets cannot be checked")
            continue
        present = [n for n in sets if caption_set_path(tar, n).exists()]
        if not present:
            samples += f.expected[tar.name] or 0
            continue
        keys = [s.key for s in shards.iter_shard(tar)]
        samples += len(keys)
        for name in present:
            p = caption_set_path(tar, name)
            meta = read_caption_meta(p)
            if meta is None:
                faults.append(f"{p}: incomplete or not a caption-set file; delete it and rerun `ditdata caption "
                              f"{f.path} --out-name {name}` with its captioner")
                continue
            if meta.get("shard_bytes") != tar.stat().st_size:
                faults.append(f"{p}: made for a different version of {tar.name}; rerun `ditdata caption` with "
                              "--overwrite")
                continue
            t, _ = read_caption_table(tar, name)
            rows = t.to_pylist()
            if [r["key"] for r in rows] != keys:
                faults.append(f"{p}: its rows are not {tar.name}'s keys in stored order")
                continue
            bad = [r["key"] for r in rows if not r["status"] or (r["caption"] is None) != (
                r["status"] not in (OK, *FLAGS) or r["status"] == "empty")]
            if bad:
                faults.append(f"{p}: {len(bad)} row(s) whose caption and status disagree (first key {bad[0]!r})")
            if dict(Counter(r["status"] for r in rows)) != meta.get("counts"):
                faults.append(f"{p}: its statuses do not add up to the counts its metadata records")
    for name in sets:
        missing = [t.name for t in f.shards if read_caption_meta(caption_set_path(t, name)) is None
                   and not caption_set_path(t, name).exists()]
        if missing:
            warnings.append(f"caption set {name!r} covers {len(f.shards) - len(missing)} of {len(f.shards)} shards "
                            f"(first missing: {missing[0]}); rerun `ditdata caption` to complete it")
    alt = [ALT] if ALT in list_caption_sets(f.path) else []
    return Verified(faults, samples, [], warnings, alt + sets)

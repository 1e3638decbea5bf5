"""`ditdata caption`: a named caption set of an image-shard folder, written by a captioner
(ditdata.captions.captioners), shard by shard, beside the shards
(ditdata.imageshards.captionsets: NNNNN.captions.SET.parquet, one row per sample in stored order).

Resuming. Each shard's file is published atomically when the whole shard is captioned, so a
killed run leaves no file that looks finished (its temporaries are removed by the next run).
A rerun skips a shard whose file is complete, was made for the shard as it is (its size in
bytes) and with the same settings: the captioner (name, kind, source, weights sha256), the
prompt, max_new_tokens and num_beams. Batches never cross a shard and generation is greedy,
so a shard captioned by a resumed run holds the same bytes as one of a clean run (the file
records no time for that reason). A set begun with OTHER settings is never mixed with new
ones: the run stops before loading the model and names both (--overwrite replaces them).

One writer: one `ditdata caption` (or score, or fetch) per folder at a time (the folder's
lock). Under torchrun each rank captions every WORLD_SIZE-th shard still to do (rank 0 holds
the lock); each shard's file has one writer, and rank 0 reports the whole set at the end.

Counted and flagged (ditdata.captions.quality): "empty", "repeated" and "truncated"
captions; an image that cannot be decoded gets a row with a null caption and the reason as
its status, never a traceback. A damaged shard (unreadable tar, fewer samples than its stats
file records) stops the run before the model is loaded, or with skip_bad_shards is left out
(no file; reported).
"""

from __future__ import annotations

import re
import sys
import time
from collections import Counter
from pathlib import Path

from ditdata.common.progress import Batches, run_totals
from ditdata.config import CaptionConfig
from ditdata.errors import DitdataError
from ditdata.imageshards import folder as shards
from ditdata.imageshards.captionsets import (
    FLAGS,
    FORMAT,
    OK,
    VERSION,
    caption_set_path,
    check_set_name,
    read_caption_meta,
    write_caption_set,
)

from .quality import status as caption_status

_TMP_RE = re.compile(r"^\.\d{5,}\.captions\.[A-Za-z0-9_-]+\.parquet" + re.escape(shards.TMP_MARK))
SETTINGS = ("captioner", "prompt", "max_new_tokens", "num_beams")  # what a resumed shard must share


def identity(captioner, prompt: str, max_new_tokens: int, num_beams: int | None) -> dict:
    """The settings a caption file records and a rerun must match (module docstring)."""
    info = captioner.info
    rec = {k: info.get(k) for k in ("name", "kind", "source", "model_class", "weights_sha256")}
    return {"captioner": rec, "prompt": prompt, "max_new_tokens": int(max_new_tokens), "num_beams": num_beams}


def caption_shard(captioner, tar, name: str, ident: dict, *, batch_size: int, progress=None) -> dict:
    """Caption one shard and publish its caption-set file; returns the file's metadata."""
    tar = Path(tar)
    rows = {"key": [], "caption": [], "status": [], "tokens": []}
    counts: Counter = Counter()

    def caption_batch(batch_idx: list[int], batch_img: list) -> None:
        out = captioner.caption(batch_img, ident["prompt"], ident["max_new_tokens"], ident["num_beams"])
        for i, g in zip(batch_idx, out, strict=True):
            text = g.text.strip()
            st = caption_status(text, g.hit_limit)
            rows["caption"][i] = text or None
            rows["status"][i] = st
            rows["tokens"][i] = g.tokens
            counts[st] += 1

    batches = Batches(batch_size, caption_batch, progress)
    for i, s in enumerate(shards.iter_shard(tar)):
        rows["key"].append(s.key)
        try:
            img = s.decode()
        except shards.BadImageError as e:
            for k, v in (("caption", None), ("status", e.reason), ("tokens", None)):
                rows[k].append(v)
            counts[e.reason] += 1
            if progress is not None:
                progress.update(1)
            continue
        for k in ("caption", "status", "tokens"):
            rows[k].append(None)  # filled when its batch is captioned
        batches.add(i, img)
    batches.flush()
    meta = {  # the file's metadata (ditdata.imageshards.captionsets): no time, so reruns give the same bytes
        "format": FORMAT,
        "version": VERSION,
        "set": name,
        "shard": tar.name,
        "shard_bytes": tar.stat().st_size,
        "num_samples": len(rows["key"]),
        **ident,
        "counts": dict(sorted(counts.items())),
    }
    write_caption_set(caption_set_path(tar, name), rows, meta)
    return meta


def _same(meta: dict, ident: dict) -> bool:
    return all(meta.get(k) == ident[k] for k in SETTINGS)


def _already_done(folder, name: str, ident: dict, overwrite: bool) -> dict[str, dict]:
    """{shard name: metadata} of the shards whose caption file is complete, for the shard as it
    is and made with these settings; files of OTHER settings stop the run unless `overwrite`."""
    done, other = {}, {}
    for tar, meta in shards.with_meta(folder, lambda t: read_caption_meta(caption_set_path(t, name))):
        if not _same(meta, ident):
            other[tar.name] = meta
        elif meta.get("shard_bytes") == tar.stat().st_size and not overwrite:
            done[tar.name] = meta
    if other and not overwrite:
        first_name, m = next(iter(other.items()))
        diff = [k for k in SETTINGS if m.get(k) != ident[k]]
        was = ", ".join(f"{k} {_short(m.get(k))}" for k in diff)
        now = ", ".join(f"{k} {_short(ident[k])}" for k in diff)
        raise DitdataError(f"{folder.path}: caption set {name!r} of {len(other)} shard(s) (first {first_name}) was "
                           f"made with {was}, not {now}; rerun with --overwrite to replace it, or pick another "
                           "--out-name")
    return done


def _short(v) -> str:
    if isinstance(v, dict) and "name" in v:
        return f"{v['name']!r}" + (f" (weights {_digest(v.get('weights_sha256'))})" if v.get("weights_sha256") else "")
    return repr(v)


def _digest(sha) -> str:
    if isinstance(sha, dict):
        sha = ",".join(str(x) for x in sha.values())
    return str(sha)[:12]


def _leave_out_bad(folder, todo: list[Path], skip_bad_shards: bool) -> tuple[list[Path], list[dict]]:
    """Damaged shards found before the model is loaded: stop now, or leave them out."""
    bad = shards.damaged_shards(folder, todo, skip_bad_shards)
    left = [{"shard": n, "reason": why, "samples_lost": folder.expected[n]} for n, why in bad.items()]
    return [t for t in todo if t.name not in bad], left


def _check(cfg: CaptionConfig) -> None:
    check_set_name(cfg.out_name, allow_alt=False)
    for flag, v, lo in (("--batch-size", cfg.batch_size, 1), ("--max-new-tokens", cfg.max_new_tokens, 1),
                        ("--num-beams", cfg.num_beams, 1), ("--limit", cfg.limit, 1)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < lo):
            raise DitdataError(f"{flag} {v!r}: must be an integer of at least {lo}")
    if cfg.prompt is not None and not cfg.prompt.strip():
        raise DitdataError("--prompt is empty; leave it out for the captioner's default instruction")


def caption(cfg: CaptionConfig) -> dict:
    """Write caption set cfg.out_name of the folder cfg.shards with cfg.captioner (module
    docstring). Returns a summary (report() makes its lines): set, captioner, prompt, shards,
    captioned_shards, skipped_shards, bad_shards, samples, counts (status -> n over the set's
    complete files), new_samples, seconds, images_per_s."""
    from ditdata.common.lock import rank_zero_lock

    _check(cfg)
    folder = shards.read_folder(cfg.shards)  # refuses an unfinished fetch
    if not folder.shards:
        raise DitdataError(f"{folder.path}: no image shards to caption")
    with rank_zero_lock(folder.path, "ditdata caption"):
        return _run(cfg, folder)


def _run(cfg: CaptionConfig, folder) -> dict:
    from ditdata.common.devices import resolve_device
    from ditdata.common.dist import join, launch_env, leave
    from ditdata.common.progress import progress_bar

    from .captioners import load_captioner

    env = launch_env()
    device = resolve_device(cfg.device)
    own_group = join(device)
    try:
        if env.rank == 0:
            for p in folder.path.iterdir():  # temporaries of a killed caption run
                if _TMP_RE.match(p.name):
                    p.unlink(missing_ok=True)
        _barrier()
        name = cfg.out_name
        with _memory_hint(cfg.captioner, cfg.batch_size, device):
            captioner = load_captioner(cfg.captioner, device)
            prompt = cfg.prompt if cfg.prompt is not None else captioner.default_prompt
            ident = identity(captioner, prompt, cfg.max_new_tokens, cfg.num_beams)
            done = _already_done(folder, name, ident, cfg.overwrite)
            todo, bad = _leave_out_bad(folder, [t for t in folder.shards if t.name not in done], cfg.skip_bad_shards)
            if cfg.limit is not None:
                todo = todo[:cfg.limit]
            mine = todo[env.rank::env.world_size]
            if done and mine and env.rank == 0:
                print(f"resuming: {len(done)} of {len(folder.shards)} shards already captioned", file=sys.stderr)
            t0 = time.perf_counter()
            n_new = 0
            expected = sum(folder.expected[t.name] or 0 for t in mine)
            with progress_bar(total=expected or None, unit=" images", enabled=cfg.progress and bool(mine),
                              desc=f"caption {name}") as bar:
                for tar in mine:
                    m = caption_shard(captioner, tar, name, ident, batch_size=cfg.batch_size, progress=bar)
                    n_new += m["num_samples"]
            seconds = time.perf_counter() - t0
        _barrier()  # every rank's shards are written before the set is counted
    finally:
        leave(own_group)
    counts: Counter = Counter()
    complete = 0
    for tar in folder.shards:
        meta = read_caption_meta(caption_set_path(tar, name))
        if meta is not None and _same(meta, ident) and meta.get("shard_bytes") == tar.stat().st_size:
            complete += 1
            counts.update(meta.get("counts", {}))
    return {
        "shards_dir": str(folder.path),
        "set": name,
        "captioner": ident["captioner"],
        "prompt": prompt,
        "max_new_tokens": cfg.max_new_tokens,
        "shards": len(folder.shards),
        "complete_shards": complete,
        "captioned_shards": len(mine),
        "skipped_shards": len(done),
        "bad_shards": bad,
        **run_totals(counts, n_new, seconds, "images_per_s"),
        "rank": env.rank,
        "world_size": env.world_size,
    }


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _memory_hint(captioner: str, batch_size: int, device):
    """Out of GPU memory while captioning: one line naming the captioner, the batch, the
    precision (bf16 weights on CUDA) and a smaller --batch-size (ditdata.common.memory)."""
    import torch

    from ditdata.common.memory import halved, out_of_memory_hint

    return out_of_memory_hint(what=f"captioning with {captioner}", batch=f"--batch-size {batch_size}",
                              precision=torch.bfloat16 if device.type == "cuda" else None,
                              hints=[halved("--batch-size", batch_size)], device=device, error=DitdataError)


def report(summary: dict) -> str:
    """The end-of-run lines printed by `ditdata caption`."""
    s = summary
    cap = s["captioner"]
    lines = [f"caption set {s['set']!r} by {cap['name']} ({cap['kind']}): {s['samples']} samples in "
             f"{s['complete_shards']} of {s['shards']} shards",
             f"  prompt {s['prompt']!r}, at most {s['max_new_tokens']} new tokens"]
    if s["captioned_shards"]:
        rate = f" at {s['images_per_s']:.2f} images/s" if s["images_per_s"] else ""
        ranks = f" (this rank of {s['world_size']})" if s["world_size"] > 1 else ""
        lines.append(f"  captioned {s['captioned_shards']} shard(s){ranks}, {s['new_samples']} samples in "
                     f"{s['seconds']:.1f} s{rate}")
    if s["skipped_shards"]:
        lines.append(f"  skipped {s['skipped_shards']} shard(s) already captioned with these settings")
    left = s["shards"] - s["complete_shards"] - len(s["bad_shards"])
    if left > 0:
        lines.append(f"  {left} shard(s) still to caption (rerun the same command)")
    for b in s["bad_shards"]:
        lines.append(f"  left out the damaged shard {shards.left_out(b['shard'], b['reason'], b['samples_lost'])}")
    c = s["counts"]
    lines.append(f"  ok:                {c.get(OK, 0)}")
    for flag, why in (("empty", "nothing but whitespace; stored as null"),
                      ("repeated", "a loop of the same words; text kept, flagged"),
                      ("truncated", "stopped at --max-new-tokens; text kept, flagged")):
        lines.append(f"  {flag + ':':<18} {c.get(flag, 0)} ({why})")
    lines.append(shards.undecodable_line(c, (OK, *FLAGS), "null caption"))
    return "\n".join(lines)

"""`dittrain sample --npz`: the ADM evaluator's sample file, drawn in resumable chunks.

    dittrain sample --ckpt RUN --n 50000 --npz samples.npz [--classes random|balanced]
    torchrun --standalone --nproc_per_node 8 -m dittrain.cli sample --ckpt RUN --npz samples.npz

The file is what the ADM evaluator (guided-diffusion's evaluations/evaluator.py) and
`dittrain eval` read: an uncompressed .npz with `arr_0`, uint8 (N, H, W, 3), and for class
models `arr_1`, int64 (N,) labels (text models: the index of each sample's prompt, the
prompts cycled over N; unconditional models: no arr_1).

Chunks. Samples are drawn in chunks of --chunk-size into a folder beside the output,
NAME.npz.parts/: job.json (everything that decides the images) and one NNNNNN.npy per
finished chunk, written to a temporary name and renamed, so a killed job leaves only
complete chunks (a chunk whose samples went NaN/inf is not written: SampleError). The same
command again continues with the missing ones; other settings are refused (the folder
belongs to the job that made it). When every chunk is there, the
chunks are streamed into the zip entries of the .npz (never all in memory: 50,000 images
of 256 px are 9.8 GB; the disk holds the chunks and the file at once for a moment), under a
temporary name renamed into place, and the folder is removed. The job's record stays beside
the file as NAME.npz.json (what decided the images: sampler, steps, cfg and its interval,
time shift, seed, ...; the .npz itself holds only the evaluator's arrays).

Determinism. Everything is decided from --seed before anything is drawn: the labels of all
N samples (random: pick_labels(N, K, seed); balanced: balanced_labels(N, K, seed)), and
chunk i (samples i*C .. i*C+C-1) is a plan of its own drawn by run_plan with a generator
seeded by chunk_seed(seed, i), for its initial noise and its ancestral noise. So sample j
does not depend on which process drew it, on how many ranks there were, or on where a job
was interrupted; it does depend on the chunk size, batch size, device type and precision,
which is why job.json records them.

torchrun: rank r of K draws chunks r, r+K, ...; rank 0 holds the folder's lock, shows the
progress (all ranks' chunks on disk) and assembles the file once every rank is done.

Public API:
    eval_settings (the FID protocol's defaults), check_npz_path, plan_npz -> NpzJob (the job:
    plan of all N, labels, chunking), job_record (job.json), check_job (resume or refuse),
    chunk_seed, chunk_plan, draw_chunk, write_npz (chunks -> .npz, streamed), record_path (the
    finished file's NAME.npz.json), sample_to_npz (the command).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import sys
import zipfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from ditdata.common import files as files_api
from ditdata.common.dist import LaunchEnv, launch_env, process_group
from ditdata.common.files import json_digest, read_json, state_dict_sha256
from dittrain.config import CFG_EVERYWHERE, EvalSampleConfig, NpzConfig, SampleConfig
from dittrain.inference import open_run
from dittrain.inference.open_run import SampleError
from dittrain.inference.sample import (
    NonFiniteSamples,
    SamplePlan,
    check_output,
    class_mode,
    embed_prompts,
    make_grid,
    output_paths,
    parse_classes,
    plan_samples,
    run_plan,
    save_png,
)

_E, _N = EvalSampleConfig(), NpzConfig()  # the FID protocol's defaults, and --npz's
JOB_NAME = "job.json"
RECORD_SUFFIX = ".json"  # NAME.npz.json: the finished file's job record
JOB_VERSION = 2  # 2: the config and stand-in store digests are ditdata.common.files.json_digest
PARTS_SUFFIX = ".parts"
PREVIEW = 64  # --out with --npz: a grid of the first 64 samples
_CHUNK = re.compile(r"^(\d{6})\.npy$")
# job.json keys (in the order they are compared) -> the option that sets them, for the refusal
OPTIONS = {
    "version": "the job file version", "weights_sha256": "--ckpt (its weights)",
    "config_sha256": "--ckpt (its model / diffusion config)", "store_identity": "--latents (the store)",
    "n": "--n", "seed": "--seed", "sampler": "--sampler", "steps": "--steps", "cfg_scale": "--cfg", "cfg_channels": "--cfg-channels",
    "cfg_interval": "--cfg-interval", "time_shift": "--time-shift", "classes": "--classes", "prompts": "--prompt", "chunk_size": "--chunk-size", "batch_size": "--batch-size",
    "precision": "--precision", "device": "--device", "image_shape": "the image shape",
}
# job.json keys newer than some jobs of this version: what a job recorded without them drew with
_BEFORE = {"cfg_interval": lambda job: list(CFG_EVERYWHERE) if job.plan.kind != "none" else None,
           "time_shift": lambda job: job.plan.diffusion.t_shift if job.plan.diffusion.objective == "flow" else None}


def eval_settings(objective: str, *, steps: int | None = None, cfg_scale: float | None = None,
                  **settings) -> SampleConfig:
    """The settings of evaluation samples: the DiT paper's FID protocol unless given (ddpm:
    250 steps, flow: 50; CFG 1.5); `settings` are SampleConfig's other fields."""
    if steps is None:
        steps = _E.ddpm_steps if objective == "ddpm" else _E.flow_steps
    return SampleConfig(steps=steps, cfg_scale=_E.cfg_scale if cfg_scale is None else cfg_scale, **settings)


def chunk_seed(seed: int, index: int) -> int:
    """The generator seed of chunk `index` of a job seeded `seed`: 63 bits of a digest of both."""
    digest = hashlib.sha256(f"dittrain-npz/{seed}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


# -----------------------------------------------------------------------------
# The job: what it draws, where its chunks go


@dataclass(frozen=True, eq=False)
class NpzJob:
    """One --npz job: its output, parts folder, whole plan (labels of all N, settings),
    the arr_1 values, the chunking and the image shape."""

    path: Path  # the .npz
    plan: SamplePlan  # all N samples (labels decided), the sampler resolved
    labels: np.ndarray | None  # arr_1: class labels, or prompt indices (text); None: unconditional
    chunk_size: int
    image_shape: tuple[int, int, int]  # (H, W, 3)
    prompts: tuple[str, ...] | None = None  # text models: the prompts as given (arr_1 indexes them)

    @property
    def parts(self) -> Path:
        return self.path.with_name(self.path.name + PARTS_SUFFIX)

    @property
    def total(self) -> int:
        return self.plan.total

    @property
    def num_chunks(self) -> int:
        return math.ceil(self.total / self.chunk_size)

    def bounds(self, index: int) -> tuple[int, int]:
        start = index * self.chunk_size
        return start, min(start + self.chunk_size, self.total)

    def chunk_path(self, index: int) -> Path:
        return self.parts / f"{index:06d}.npy"

    def done(self) -> set[int]:
        """The chunks on disk (only finished ones carry a chunk name)."""
        if not self.parts.is_dir():
            return set()
        found = (_CHUNK.match(p.name) for p in self.parts.iterdir())
        return {i for m in found if m and (i := int(m.group(1))) < self.num_chunks}

    def images_in(self, chunks) -> int:
        return sum(b - a for a, b in map(self.bounds, chunks))


def check_npz_path(path, *, overwrite: bool = False) -> Path:
    """A bad --npz fails before any work: NAME.npz, not a folder, outside any latent store,
    not there yet (unless overwrite)."""
    path = Path(path)
    if path.suffix.lower() != ".npz":
        raise SampleError(f"--npz {path}: the evaluator's sample file is a .npz; give NAME.npz")
    if path.is_dir():
        raise SampleError(f"--npz {path} is a folder; give NAME.npz")
    open_run.check_new_output(path, "--npz", SampleError, overwrite=overwrite, hint=", or give another --npz")
    return path


def plan_npz(config: dict, store, path, settings: NpzConfig = _N, *, classes=(), prompts=(),
             device="auto") -> NpzJob:
    """Check an --npz call and decide all settings.n samples (plan_samples: labels from the seed,
    prompts cycled) with the sampling settings of the run's objective (eval_settings: the FID
    protocol's steps unless settings.steps); SampleError on the first problem."""
    if settings.chunk_size < 1:
        raise SampleError(f"--chunk-size must be at least 1, got {settings.chunk_size}")
    sampling = eval_settings(open_run.diffusion_config(config).objective, steps=settings.steps, cfg_scale=settings.cfg_scale,
                             cfg_channels=settings.cfg_channels, cfg_interval=settings.cfg_interval,
                             time_shift=settings.time_shift, sampler=settings.sampler, seed=settings.seed,
                             batch_size=settings.batch_size, precision=settings.precision)
    plan = plan_samples(config, store, sampling, device=device, classes=classes, prompts=list(prompts), n=settings.n)
    if plan.kind == "class":
        labels = np.asarray(plan.labels, dtype=np.int64)
    elif plan.kind == "text":
        labels = np.asarray([r["prompt_index"] for r in plan.records], dtype=np.int64)
    else:
        labels = None
    # (H, W, 3) of decoded samples: the latent size times the autoencoder's downsample
    down = (store.manifest.get("vae") or {}).get("downsample")
    if down:
        size = plan.model.input_size * int(down)
    else:
        size = int((store.manifest.get("image") or {}).get("resolution") or plan.model.input_size)
    return NpzJob(path=Path(path), plan=plan, labels=labels, chunk_size=settings.chunk_size,
                  image_shape=(size, size, 3), prompts=tuple(prompts) if plan.kind == "text" else None)


def job_record(job: NpzJob, *, weights: dict, config: dict, store, classes=(), ckpt=None) -> dict:
    """job.json: everything that decides the images (compared on resume, in OPTIONS order),
    then what is only for people (ckpt path, store path)."""
    p, s = job.plan, job.plan.settings
    spec = None  # what decides the labels: the mode, or the chosen indices
    if p.kind == "class":
        mode = class_mode(classes)
        chosen = [] if mode else parse_classes(classes, p.model.num_classes, open_run.class_names(store))
        spec = mode or (chosen if chosen else "random")
    return {
        "version": JOB_VERSION,
        "weights_sha256": state_dict_sha256(weights),
        "config_sha256": json_digest({"model": asdict(p.model), "diffusion": asdict(p.diffusion)}),
        "store_identity": store.identity or "vae:" + json_digest((store.manifest or {}).get("vae")),
        "n": job.total,
        "seed": s.seed,
        "sampler": s.sampler,
        "steps": s.steps,
        "cfg_scale": s.cfg_scale if p.kind != "none" else None,
        "cfg_channels": s.cfg_channels if p.kind != "none" else None,
        "cfg_interval": list(s.cfg_interval) if p.kind != "none" else None,
        "time_shift": s.time_shift,  # resolved: the run's t_shift unless given (flow); None for ddpm
        "classes": spec,
        "prompts": list(job.prompts) if job.prompts else None,
        "chunk_size": job.chunk_size,
        "batch_size": s.batch_size,
        "precision": {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[p.amp],
        "device": p.device.type,
        "image_shape": list(job.image_shape),
        "info": {"ckpt": None if ckpt is None else str(Path(ckpt).resolve()), "store": str(Path(store.root).resolve()),
                 "model": p.name, "objective": p.diffusion.objective, "output": str(job.path.resolve())},
    }


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_job(job: NpzJob, record: dict) -> bool:
    """True when job.parts holds this job's chunks to continue, False when there is nothing
    (yet); SampleError when it holds another job (the first differing setting named)."""
    parts, path = job.parts, job.parts / JOB_NAME
    if not path.is_file():
        if job.done():
            raise SampleError(f"{parts}/ holds chunks but no {JOB_NAME}, so what made them is unknown; "
                              f"delete {parts}/ to start over, or give another --npz")
        return False
    try:
        old = read_json(path)
    except (OSError, ValueError) as e:
        raise SampleError(f"{path}: unreadable ({files_api.error_reason(e)}); delete {parts}/ to start over") from e
    for key, option in OPTIONS.items():
        then = old[key] if key in old or key not in _BEFORE else _BEFORE[key](job)
        if then != record[key]:
            raise SampleError(f"--npz {job.path}: {parts}/ holds a job with other settings: {key} "
                              f"{_short(then)} there, {_short(record[key])} now ({option}); rerun with "
                              f"the same settings to continue, or delete {parts}/ or give another --npz")
    return True


# -----------------------------------------------------------------------------
# Drawing chunks


def chunk_plan(job: NpzJob, index: int, config: dict, store, text: dict | None = None) -> SamplePlan:
    """The plan of chunk `index`: its samples' conditions, the job's settings, its own seed.
    text: a text model's embeddings of the job's prompts {field: (P, ...)}, indexed by arr_1."""
    a, b = job.bounds(index)
    p = job.plan
    settings = replace(p.settings, seed=chunk_seed(p.settings.seed, index))
    kw = dict(model=p.model, device=p.device, n=b - a)
    if p.kind == "class":
        return plan_samples(config, store, settings, classes=list(p.labels[a:b]), **kw)
    if p.kind == "text":
        rows = torch.as_tensor(job.labels[a:b])
        return plan_samples(config, store, settings, text={k: v[rows] for k, v in text.items()}, model=p.model,
                            device=p.device)
    return plan_samples(config, store, settings, **kw)


def draw_chunk(job: NpzJob, index: int, model, config: dict, store, autoencoder, text=None) -> Path:
    """Draw chunk `index` and write it as NNNNNN.npy (atomically: a temporary name, renamed);
    a chunk whose samples went NaN/inf is not written (SampleError)."""
    a, b = job.bounds(index)
    try:
        images = run_plan(model, chunk_plan(job, index, config, store, text), store, autoencoder=autoencoder)
    except NonFiniteSamples as e:
        raise SampleError(e.describe(offset=a, seed=f"{job.plan.settings.seed}, chunk {index}",
                                     after=f"chunk {index} was not written (finished chunks stay in {job.parts}/)"
                                     )) from e
    if images.shape != (b - a, *job.image_shape):
        raise SampleError(f"chunk {index}: the autoencoder made images of {images.shape[1:]}, "
                          f"expected {job.image_shape}")
    path = job.chunk_path(index)
    try:
        with files_api.atomic_file(path, "wb") as f:
            np.save(f, np.ascontiguousarray(images))
    except OSError as e:
        raise SampleError(f"{path}: could not write the chunk ({files_api.error_reason(e)})") from e
    return path


# -----------------------------------------------------------------------------
# The file


def _entry(name: str) -> zipfile.ZipInfo:
    """A zip entry with a fixed time, so the same samples make the same bytes."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    info.external_attr = 0o644 << 16
    return info


def write_npz(path, chunks: list[Path], shape: tuple[int, ...], labels: np.ndarray | None = None) -> Path:
    """Stream chunk files (each an .npy of (n, H, W, 3) uint8, in order) into the arr_0 entry
    of an uncompressed .npz at `path` (np.savez's layout), with `labels` as arr_1; written
    under a temporary name and renamed. Never holds more than one chunk in memory."""
    path = Path(path)
    total, rest = shape[0], tuple(shape[1:])
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(np.uint8)), "fortran_order": False,
              "shape": tuple(shape)}
    seen = 0
    with files_api.atomic_path(path) as tmp, zipfile.ZipFile(tmp, "w", allowZip64=True) as zf:
        with zf.open(_entry("arr_0.npy"), "w", force_zip64=True) as f:
            np.lib.format.write_array_header_1_0(f, header)
            for chunk in chunks:
                a = np.load(chunk, mmap_mode="r")
                if a.dtype != np.uint8 or a.shape[1:] != rest:
                    raise SampleError(f"{chunk}: {a.dtype} {a.shape}, not uint8 (n, {', '.join(map(str, rest))}); "
                                      "delete it and rerun to draw it again")
                f.write(np.ascontiguousarray(a).data)
                seen += len(a)
                del a
        if seen != total:
            raise SampleError(f"the chunks hold {seen} samples, not {total}")
        if labels is not None:
            with zf.open(_entry("arr_1.npy"), "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.ascontiguousarray(labels, dtype=np.int64))
    return path


# -----------------------------------------------------------------------------
# Ranks


def _barrier(env: LaunchEnv, device: torch.device) -> None:
    if env.distributed:
        import torch.distributed as dist

        if device.type == "cuda":
            dist.barrier(device_ids=[device.index])
        else:
            dist.barrier()


# -----------------------------------------------------------------------------
# The command


def sample_to_npz(
    engine,
    npz,
    settings: NpzConfig = _N,
    *,
    classes=(),
    prompts=(),
    device="auto",
    text_pretrained: str | None = None,
    overwrite: bool = False,
    preview=None,
    log=print,
    progress: bool = True,
) -> dict:
    """`dittrain sample --npz`: draw settings.n samples (default 50,000) into the ADM evaluator's
    .npz, in resumable chunks, on every torchrun rank; see the module docstring.

    engine: a dittrain.inference.open_run.TorchEngine (--ckpt, --latents, --vae, --model): the job
    records a digest of its weights. settings: NpzConfig (n, steps, cfg scale, chunk size,
    sampler, seed, batch size, precision, guided channels, guidance interval, time shift; steps
    None: the FID protocol's for the run's objective, eval_settings). classes: as --class, or "random" (the default) /
    "balanced". prompts (text models): cycled over the n samples. preview: --out, where a grid
    of the first 64 samples goes (optional).
    Returns {"npz", "total", "drawn" (chunks this process drew), "resumed" (chunks found)}."""
    path = check_npz_path(npz, overwrite=overwrite)
    if preview is not None:
        check_output(preview)
    env = launch_env()
    dev = open_run.sampling_device(device)  # a bare `cuda` under torchrun is cuda:LOCAL_RANK
    if env.distributed and dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", env.local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    say = log if env.rank == 0 else (lambda line: None)
    with process_group(dev):
        config, store, note = engine.open(dev)
        job = plan_npz(config, store, path, settings, classes=classes, prompts=prompts, device=dev)
        record = job_record(job, weights=engine.weights, config=config, store=store, classes=classes,
                            ckpt=engine.ckpt)
        resuming = check_job(job, record)  # every rank, before any waits: all fail alike
        if note:
            say(note)
        say(job.plan.describe() + f"; {job.num_chunks} chunk{'s' if job.num_chunks > 1 else ''} of "
            f"{job.chunk_size}" + (f" over {env.world_size} ranks" if env.distributed else ""))
        # every rank: rank 0 takes the parts folder's lock and prepares it, all draw their chunks,
        # rank 0 assembles the file and removes the folder
        from ditdata.common.lock import DirLock

        lock = DirLock(job.parts, "dittrain sample --npz") if env.rank == 0 else None
        if lock is not None:
            lock.acquire()
        try:
            if env.rank == 0:
                _prepare(job, record, resuming, say)
            _barrier(env, dev)
            result = _draw(job, env, engine, store, text_pretrained, progress)
            _barrier(env, dev)
            if env.rank == 0:
                _assemble(job, record, preview, say)
        finally:
            if lock is not None:
                lock.release()
        if env.rank == 0:
            files_api.remove(job.parts)
        _barrier(env, dev)
    return {"npz": path, "total": job.total, **result}


def _prepare(job: NpzJob, record: dict, resuming: bool, say) -> None:
    """Rank 0, holding the lock: job.json for a new job, a line for a resumed one, and the
    temporaries of killed writers removed."""
    job.parts.mkdir(parents=True, exist_ok=True)
    for p in job.parts.iterdir():
        if files_api.is_tmp(p):
            files_api.remove(p)
    if resuming:
        done = job.done()
        say(f"resuming {job.parts}/: {len(done)} of {job.num_chunks} chunks done "
            f"({job.images_in(done)} of {job.total} samples)")
    else:
        files_api.write_json_atomic(job.parts / JOB_NAME, record)


def _draw(job: NpzJob, env: LaunchEnv, engine, store, text_pretrained, progress) -> dict:
    """Draw this rank's missing chunks (r, r + K, ...); rank 0 shows all ranks' progress."""
    done = job.done()
    mine = [i for i in range(env.rank, job.num_chunks, env.world_size) if i not in done]
    result = {"drawn": len(mine), "resumed": len(done)}
    # a bar on a terminal, else a plain line every 30 s (ditdata.common.progress)
    from ditdata.common.progress import progress_bar

    bar = progress_bar(total=job.total, initial=job.images_in(job.done()), enabled=progress and env.rank == 0,
                       unit="img", desc="sampling", file=sys.stderr, mininterval=1.0, smoothing=0.1)
    try:
        if not mine:
            return result
        with open_run.sampling_memory_hint(job.plan):
            # the chunks `mine`, drawn and written one by one (the bar counts every rank's)
            plan, config = job.plan, engine.config
            model = engine.network(plan.device)
            autoencoder = open_run.load_autoencoder(store, plan.device, engine.vae)
            text = None
            if plan.kind == "text":  # the prompts embedded once, gathered per chunk
                text = embed_prompts(store, list(job.prompts), tokens=bool(plan.model.text_token_dim),
                                     device=plan.device, pretrained=text_pretrained)
            for index in mine:
                draw_chunk(job, index, model, config, store, autoencoder, text)
                bar.update(job.images_in(job.done()) - bar.n)  # every rank's chunks on disk
    finally:
        bar.close()
    return result


def record_path(npz) -> Path:
    """NAME.npz.json: the job record kept beside a finished NAME.npz."""
    npz = Path(npz)
    return npz.with_name(npz.name + RECORD_SUFFIX)


def _assemble(job: NpzJob, record: dict, preview, say) -> None:
    """Rank 0, every chunk drawn: the .npz, its record beside it, the preview grid, the parts emptied."""
    chunks = [job.chunk_path(i) for i in range(job.num_chunks)]
    missing = [i for i, p in enumerate(chunks) if not p.is_file()]
    if missing:
        raise SampleError(f"{job.parts}/: chunks {missing[:5]} are missing after drawing; rerun to draw them")
    try:
        write_npz(job.path, chunks, (job.total, *job.image_shape), job.labels)
    except OSError as e:
        raise SampleError(f"--npz {job.path}: could not write ({files_api.error_reason(e)}); "
                          f"the chunks in {job.parts}/ are kept: rerun to try again") from e
    files_api.write_json_atomic(record_path(job.path), record)
    h, w, _ = job.image_shape
    what = {"class": "class labels", "text": "prompt indices", "none": None}[job.plan.kind]
    say(f"npz: {job.path}  (arr_0 {job.total} x {h} x {w} x 3 uint8" + (f", arr_1 {what} int64)" if what else ")")
        + f"; how it was made: {record_path(job.path).name}")
    if preview is not None:
        first, need = [], min(PREVIEW, job.total)
        for p in chunks:
            first.append(np.load(p))
            if sum(map(len, first)) >= need:
                break
        images = np.concatenate(first)[:need]
        grid = save_png(make_grid(images, nrow=math.ceil(math.sqrt(need))), output_paths(preview)[0])
        say(f"grid:  {grid}  (the first {need} samples)")
    for p in [*chunks, job.parts / JOB_NAME]:
        p.unlink(missing_ok=True)


__all__ = [
    "NpzJob", "check_job", "check_npz_path", "chunk_plan", "chunk_seed", "draw_chunk", "eval_settings",
    "job_record", "plan_npz", "record_path", "sample_to_npz", "write_npz",
]

"""`ditdata fetch --retry-failed --out SHARDS`: one more pass over the rows of a finished URL
fetch whose latest status is a transient failure (ledger.FAILURE_CLASSES: timeouts,
connection errors, HTTP 5xx and 429; never a 4xx, a decode error or a refused URL).

A pass, under the folder's lock:

1. reads every row's latest status (ledger.latest) and picks the transient failures;
2. hands them to img2dataset, with the first fetch's settings (dataset.json's options;
   --processes, --threads, --timeout, --retries and the distributor may change), writing
   into a scratch folder SHARDS/.retry: nothing in SHARDS changes while it downloads;
3. publishes each scratch shard as a NEW shard of SHARDS, numbered after every finished
   one (a finished shard is never rewritten): tar, parquet, then the stats file that makes
   it count, each atomically;
4. writes dataset.json again: num_shards counts every shard, the summary counts each
   row once at its latest status, and "retries" lists the passes.

Keys. img2dataset names a sample after its shard and position (shard * 10**k + index),
which for a retried row would be a new key. So the row's key travels with it as an extra
column (ORIGINAL_KEY) and step 3 renames the samples back: tar members, their json and the
parquet's `key` column carry the key the row had in the first fetch, and the extra column
is dropped. A row that succeeded in the first fetch is never retried, and one that
succeeds in a retry is a success from then on, so every sample is in exactly one shard.

Interruptions. A pass killed in steps 1-2 left SHARDS as it was; one killed in step 3 left
some whole new shards and no dataset.json (it goes before the first shard is published, so
nothing reads a half-updated folder; RECORD, written just before, keeps the folder a
retryable fetch and holds its options and passes meanwhile). Either way, rerunning
`--retry-failed` starts over from the latest statuses: a shard without its stats file is
deleted, the rows a published shard holds have their new status, the rest are retried.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import sys
import tarfile
import time
from collections import Counter
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from pathlib import Path

import ditdata.fetch.ledger as ledger
import ditdata.fetch.urls as urls
from ditdata.common.files import read_json
from ditdata.common.lock import DirLock
from ditdata.config import FetchConfig
from ditdata.errors import DitdataError
from ditdata.fetch.state import RETRY_RECORD, RETRY_SCRATCH, PackOptions, write_dataset_info
from ditdata.fetch.urllists import run_img2dataset
from ditdata.imageshards import folder as shards

ORIGINAL_KEY = "ditdata_key"  # the column that carries a retried row's key through img2dataset
_SHARD_DATA = re.compile(r"^(\d{5,})\.(tar|parquet)$")  # what a pass publishes before the stats file
# FetchConfig fields a pass may change: how it downloads, not what a shard holds
OVERRIDABLE = ("processes", "threads", "timeout", "retries", "distributor", "spark_master", "ray_address")


@dataclass(frozen=True)
class Pass:
    """What one pass did (one line of output, one entry of dataset.json's "retries")."""

    number: int
    retried: int
    recovered: int
    transient: int  # still failing transiently: the next pass retries them
    permanent: dict  # every row whose latest status is a permanent failure, by reason
    shards: list  # the new shards' indices

    def line(self) -> str:
        perm = sum(self.permanent.values())
        reasons = f" ({urls.describe(Counter(self.permanent))})" if perm else ""
        return (f"retry pass {self.number}: retried {self.retried}, recovered {self.recovered}, "
                f"still failing transiently {self.transient}, permanent failures {perm}{reasons}")


def retry_failed(out, source=None, **options) -> tuple[str, dict]:
    """One --retry-failed pass over the URL fetch in OUT (module docstring). OPTIONS are the
    FetchConfig fields the user gave: the OVERRIDABLE ones apply to this pass, any other must
    be what the first fetch recorded. Returns the pass's one-line summary and dataset.json."""
    out = Path(out)
    unknown = sorted(set(options) - {f.name for f in fields(FetchConfig)})
    if unknown:
        raise TypeError(f"retry_failed() got unknown options {', '.join(unknown)}")
    if not out.is_dir():
        raise DitdataError(f"--retry-failed: {out} is not a finished URL fetch (no such directory); "
                           "pass the --out of a finished `ditdata fetch` of a URL list")
    with DirLock(out, "ditdata fetch --retry-failed"):
        state, record = _finished_url_fetch(out)
        if source is not None and Path(source).resolve() != Path(state["source"]):
            raise DitdataError(f"--retry-failed: {out} was fetched from {state['source']}, not {source}; "
                               "drop SOURCE (the recorded one is used) or choose the right --out")
        overrides = {k: v for k, v in options.items() if k in OVERRIDABLE}
        _check_recorded({k: v for k, v in options.items() if k not in OVERRIDABLE}, record["options"])
        # the PackOptions .fetch_state records (JSON has no infinity: null is the default)
        packed = {f.name: state["options"][f.name] for f in fields(PackOptions)}
        if packed["max_aspect_ratio"] is None:
            packed["max_aspect_ratio"] = math.inf
        opts = PackOptions(**packed)
        recorded = record["options"]
        cfg = FetchConfig(**{**{k: recorded[k] for k in ("processes", "threads", "timeout", "retries", "distributor")},
                             **overrides, "samples_per_shard": opts.samples_per_shard,
                             "keep_cols": (*recorded["keep_cols"], ORIGINAL_KEY)})
        _drop_unpublished(out)
        columns = ["url", *(["caption"] if recorded["caption_col"] is not None else []), *recorded["keep_cols"]]
        stats = shards.read_shard_stats(out)
        rows = ledger.latest(out, stats, columns)
        todo = rows[rows["failure"] == ledger.TRANSIENT]
        if todo.empty:
            info = (read_json(out / shards.DATASET_INFO) if (out / shards.DATASET_INFO).is_file()
                    else _write_info(out, state, record, rows, len(stats)))  # a pass killed while publishing
            perm = _permanent(rows)
            n = sum(perm.values())
            reasons = f": {urls.describe(Counter(perm))}" if n else ""
            return (f"nothing to retry: no row's latest status is a transient failure "
                    f"(permanent failures {n}{reasons})"), info

        t0 = time.time()
        scratch = out / RETRY_SCRATCH
        downloaded = _download(todo, scratch, columns, opts, cfg)
        # from here SHARDS changes: dataset.json goes first, RECORD stays (module docstring)
        shards.write_json_atomic(out / RETRY_RECORD, record)
        (out / shards.DATASET_INFO).unlink(missing_ok=True)
        first = max(stats) + 1
        for j in downloaded:
            _publish(scratch / "out", j, out, first + j)
        stats = shards.read_shard_stats(out)
        rows = ledger.latest(out, stats, columns)
        retried = rows[rows["key"].isin(set(todo["key"]))]
        done = Pass(
            number=len(record["passes"]) + 1,
            retried=len(todo),
            recovered=int((retried["status"] == ledger.SUCCESS).sum()),
            transient=int((rows["failure"] == ledger.TRANSIENT).sum()),
            permanent=_permanent(rows),
            shards=[first + j for j in downloaded],
        )
        record["passes"].append({**{f.name: getattr(done, f.name) for f in fields(Pass)},
                                 "duration_s": round(time.time() - t0, 3),
                                 "at": datetime.now(UTC).isoformat(timespec="seconds")})
        shards.write_json_atomic(out / RETRY_RECORD, record)
        info = _write_info(out, state, record, rows, len(stats))
        shutil.rmtree(scratch, ignore_errors=True)
        return done.line(), info


def _finished_url_fetch(out: Path) -> tuple[dict, dict]:
    """.fetch_state and the retry record ({"source", "options", "passes"}) of the finished
    URL fetch in OUT; the one-line refusal when OUT is anything else."""
    def refuse(why: str) -> DitdataError:
        return DitdataError(f"--retry-failed: {out} is not a finished URL fetch ({why})")

    try:
        state = read_json(out / shards.FETCH_STATE)
    except (OSError, ValueError):
        raise refuse("no `ditdata fetch` record in it; pass the --out of a finished fetch of a URL list") from None
    if not isinstance(state, dict) or state.get("kind") != "urls":
        kind = state.get("kind") if isinstance(state, dict) else None
        raise refuse(f"it holds a {kind} fetch; only a URL list has downloads to retry")
    info_path, record_path = out / shards.DATASET_INFO, out / RETRY_RECORD
    if info_path.is_file():
        info = shards.read_dataset_info(out)
        record = {"source": info["source"], "options": info["options"], "passes": info.get("retries", [])}
    elif record_path.is_file():  # a pass was killed while publishing: its record stands in
        record = read_json(record_path)
    else:
        raise refuse("the fetch did not finish; rerun the first `ditdata fetch` command to complete it")
    stats = shards.read_shard_stats(out)
    expected = sum(math.ceil(i["rows"] / state["options"]["samples_per_shard"]) for i in state["inputs"])
    missing = [i for i in range(expected) if i not in stats]
    if missing:
        raise refuse(f"{len(missing)} of its {expected} shards have no stats file; rerun the first "
                     "`ditdata fetch` command to complete it")
    return state, record


def _check_recorded(given: dict, recorded: dict) -> None:
    """GIVEN settings (FetchConfig fields) that decide what a shard holds must be the ones
    the first fetch recorded (a --config file of that fetch may be passed again)."""
    defaults = {f.name: f.default for f in fields(FetchConfig)}
    for name, value in given.items():
        want = recorded.get(name, defaults[name])
        if name == "caption_col" and value == "":
            value = None  # --caption-col '' is "no caption column", recorded as null
        if isinstance(value, float) and math.isinf(value):
            value = None  # JSON has no infinity (state.jsonable)
        if name == "keep_cols":
            value, want = list(value), list(want)
        if value != want:
            flag = "--keep-col" if name == "keep_cols" else "--" + name.replace("_", "-")
            raise DitdataError(
                f"--retry-failed refetches with the first fetch's settings: {flag} {value!r} is not the recorded "
                f"{want!r}; drop it (only --{', --'.join(o.replace('_', '-') for o in OVERRIDABLE)} may change)")


def _drop_unpublished(out: Path) -> None:
    """Forget what a killed pass left half-done: the scratch folder, temporaries, and shard
    files (tar, parquet) without a stats file, which therefore never counted."""
    shutil.rmtree(out / RETRY_SCRATCH, ignore_errors=True)
    shards.remove_stale_tmp(out)
    finished = set(shards.read_shard_stats(out))
    for p in out.iterdir():
        m = _SHARD_DATA.match(p.name)
        if m and int(m.group(1)) not in finished:
            print(f"note: {p.name} was left by an interrupted --retry-failed pass; deleted", file=sys.stderr)
            p.unlink()


def _download(todo, scratch: Path, columns: list, opts: PackOptions, cfg: FetchConfig) -> list[int]:
    """img2dataset over the rows TODO (their COLUMNS and key as ORIGINAL_KEY) into
    SCRATCH/out; the indices of its shards, all of them finished."""
    import pyarrow as pa

    (scratch / "list").mkdir(parents=True)
    todo = todo.sort_values("key")
    table = pa.Table.from_pandas(todo[columns].assign(**{ORIGINAL_KEY: todo["key"]}), preserve_index=False)
    shards.write_parquet_atomic(scratch / "list" / "00000.parquet", table)
    print(f"retrying {len(todo)} rows whose latest status is a transient failure", file=sys.stderr)
    run_img2dataset(scratch / "list", scratch / "out", opts, cfg, url_col="url",
                    caption_col="caption" if "caption" in columns else None)
    expected = math.ceil(len(todo) / opts.samples_per_shard)
    got = shards.read_shard_stats(scratch / "out")
    if sorted(got) != list(range(expected)):
        raise DitdataError(f"{expected - len(got)} of {expected} retry shard(s) did not finish (see img2dataset's "
                           "messages above); nothing was published: rerun --retry-failed")
    return list(range(expected))


def _publish(src: Path, j: int, out: Path, index: int) -> None:
    """Scratch shard J (img2dataset's keys) as shard INDEX of OUT under the rows' own keys
    (ORIGINAL_KEY): tar, parquet, then the stats file that makes it count as finished."""
    import pyarrow.parquet as pq

    table = pq.read_table(src / f"{shards.shard_name(j)}.parquet")
    table = table.set_column(table.schema.get_field_index("key"), "key", table.column(ORIGINAL_KEY))
    table = table.drop_columns([ORIGINAL_KEY])
    with tarfile.open(shards.shard_path(src, j)) as tf, shards.ShardWriter(out, index) as writer:
        for files in _samples(tf):
            meta = json.loads(files["json"])
            key = meta.pop(ORIGINAL_KEY)
            meta["key"] = key
            ext = next(e for e in shards.IMAGE_EXTS if e in files)
            caption = files["txt"].decode("utf-8") if "txt" in files else None
            writer.write(key, files[ext], ext, meta, caption)
    shards.write_parquet_atomic(out / f"{shards.shard_name(index)}.parquet", table)
    shards.write_shard_stats(out, index, read_json(shards.stats_path(src, j)))


def _samples(tf: tarfile.TarFile):
    """{extension: bytes} per sample of an img2dataset tar (its members come by sample)."""
    key, files = None, {}
    for member in tf:
        if not member.isfile():
            continue
        k, _, ext = member.name.partition(".")
        if k != key and files:
            yield files
            files = {}
        key = k
        files[ext] = tf.extractfile(member).read()
    if files:
        yield files


def _permanent(rows) -> dict:
    perm = rows.loc[rows["failure"] == ledger.PERMANENT, "error_message"].fillna("unknown error")
    return dict(Counter(perm))


def _write_info(out: Path, state: dict, record: dict, rows, num_shards: int) -> dict:
    """dataset.json of the fetch with its retry passes: every shard, each row at its latest status."""
    return write_dataset_info(out, "urls", Path(record["source"]), num_shards, ledger.summary(rows),
                              record["options"], {"retries": record["passes"]})

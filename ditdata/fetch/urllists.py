"""`ditdata fetch` of a URL list (LAION metadata parquet, csv, tsv, jsonl, json, txt; a file
or a folder of them), downloaded by img2dataset into image shards.

img2dataset owns the downloading, resizing, per-shard stats and incremental resume; here
the list's columns are checked first (as img2dataset's reader parses them), the settings
recorded, and dataset.json written once every shard has its stats. Only http and https
URLs are fetched: img2dataset reads a screened copy of the list (SHARDS_DIR/.urls) and
downloads through an http(s)-only opener (ditdata/fetch/urls.py); every other row fails
with a "refused URL: ..." reason and keeps its key (img2dataset's 9-digit scheme: a key
depends only on the row's position).

img2dataset is imported only inside the call that runs it: its workers (spawned
processes, pyspark or ray executors) import this package, which starts nothing at import.
"""

from __future__ import annotations

import csv
import gzip
import json
import math
import os
import shutil
import signal
import sys
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import ditdata.fetch.distributors as distributors
import ditdata.fetch.ledger as ledger
import ditdata.fetch.urls as urls
from ditdata.common.extras import missing_extra
from ditdata.common.files import read_json
from ditdata.config import FetchConfig
from ditdata.errors import DitdataError
from ditdata.fetch.state import RETRY_RECORD, URL_COPIES, PackOptions, check_state, jsonable, write_dataset_info
from ditdata.imageshards import folder as shards

URL_LIST_FORMATS = ("parquet", "csv", "tsv", "jsonl", "json", "txt")  # (+ .gz except parquet)
URL_COLUMNS = ("url", "URL", "image_url", "img_url", "link")
CAPTION_COLUMNS = ("caption", "TEXT", "text", "Caption", "alt", "alt_text")
# Columns img2dataset writes itself; a URL list column of the same name cannot be kept.
IMG2DATASET_RESERVED = frozenset(
    {"key", "caption", "url", "width", "height", "original_width", "original_height",
     "status", "error_message", "exif", "md5", "sha256", "sha512"}
)


def fetch_urls(src: Path, out: Path, opts: PackOptions, cfg: FetchConfig) -> dict:
    """Download the URL list SRC (a file or a folder of them) into OUT with img2dataset,
    resuming what a previous run finished; returns dataset.json's contents."""
    t0 = time.time()
    keep_cols = list(cfg.keep_cols)
    files, fmt = _url_files(src)
    columns = _columns(files[0], fmt)
    url_col, caption_col = _pick_columns(columns, fmt, cfg.url_col, cfg.caption_col, keep_cols, files[0])
    counts = [_count_rows(f, fmt, url_col) for f in files]
    num_shards = sum(math.ceil(n / opts.samples_per_shard) for n in counts)
    if num_shards == 0:
        raise DitdataError(f"{src}: the URL list is empty")
    refused: Counter = Counter()  # {reason label: rows} whose URL is not fetched
    for f in files:
        for chunk in _read_list(f, fmt, [url_col]).column(0).chunks:
            refused.update(urls.count_refusals(chunk.to_pylist()))
    if refused.total() == sum(counts):
        raise DitdataError(
            f"{src}: none of its {sum(counts)} rows is an http(s) URL ({urls.describe(refused)}); "
            "ditdata fetch downloads only http and https URLs"
        )
    state = {
        "kind": "urls",
        "source": str(src.resolve()),
        "inputs": [{"path": str(f.resolve()), "rows": n, "size": f.stat().st_size} for f, n in zip(files, counts, strict=True)],
        "columns": {"url": url_col, "caption": caption_col, "keep": keep_cols},
        "options": jsonable(asdict(opts)),
    }
    check_state(out, state)

    _drop_torn_shards(out)
    done = set(shards.read_shard_stats(out))
    if len(done & set(range(num_shards))) < num_shards:
        if done:
            print(f"resuming: {len(done)} of {num_shards} shards already finished", file=sys.stderr)
        if refused:
            print(f"note: {refused.total()} of {sum(counts)} rows are not http(s) URLs and are not fetched "
                  f"({urls.describe(refused)}); they are counted as refused in the summary", file=sys.stderr)
        lists = _screened_copies(out, files, fmt, [url_col, caption_col, *keep_cols], url_col)
        run_img2dataset(lists, out, opts, cfg, url_col=url_col, caption_col=caption_col)
    stats = shards.read_shard_stats(out)
    missing = [i for i in range(num_shards) if i not in stats]
    if missing:
        raise DitdataError(
            f"{len(missing)} of {num_shards} shard(s) did not finish (see img2dataset's messages above); "
            "rerun the same command to retry them"
        )
    _remove_tree(out / URL_COPIES)  # only needed while shards are left to download
    summary, extra = shards.summarize_stats(stats), {}
    if max(stats) >= num_shards:  # `--retry-failed` passes added shards: count each row at its latest status
        summary, extra = ledger.summary(ledger.latest(out, stats)), {"retries": read_json(out / RETRY_RECORD)["passes"]}
    summary["duration_s"] = round(time.time() - t0, 3)
    options = {
        **asdict(opts), "kind": "urls", "processes": cfg.processes, "threads": cfg.threads, "url_col": url_col,
        "caption_col": caption_col, "keep_cols": keep_cols, "distributor": cfg.distributor,
        "timeout": cfg.timeout, "retries": cfg.retries, "input_format": fmt,
    }
    return write_dataset_info(out, "urls", src, len(stats), summary, options, extra)


def _drop_torn_shards(out: Path) -> None:
    """Delete the shards whose NNNNN_stats.json a killed fetch left cut short. img2dataset
    writes that file in place (not by a rename) after the shard's tar, and its resume counts
    a shard as done as soon as the file exists: a kill during that write would leave a shard
    that the rerun skips and can then not read. Such a shard's files go, so it is fetched again."""
    for stats in sorted(out.glob("*_stats.json")):
        index = stats.name[: -len("_stats.json")]
        if not index.isdigit():
            continue
        try:
            if isinstance(read_json(stats), dict):
                continue
        except (OSError, ValueError):
            pass
        print(f"note: {stats.name} was cut short by an interrupted fetch; fetching shard {index} again",
              file=sys.stderr)
        for suffix in (".tar", ".parquet", "_stats.json"):
            (out / f"{index}{suffix}").unlink(missing_ok=True)


def _screened_copies(out: Path, files: list[Path], fmt: str, columns: list, url_col: str) -> Path:
    """OUT/.urls: one parquet per input list (same order, rows and column names, only the
    columns img2dataset reads) in which every refused URL is its sentinel, so img2dataset
    never sees one; keys depend on row positions only and stay as with the original list.
    Kept while the inputs are unchanged (a resume), written again otherwise."""
    import pyarrow as pa

    columns = list(dict.fromkeys(c for c in columns if c is not None))
    folder = out / URL_COPIES
    manifest = folder / "inputs.json"
    want = {
        "format": fmt,
        "columns": columns,
        "inputs": [{"path": str(f.resolve()), "size": f.stat().st_size, "mtime_ns": f.stat().st_mtime_ns}
                   for f in files],
    }
    try:
        if read_json(manifest) == want:
            return folder
    except (OSError, ValueError):
        pass
    _remove_tree(folder)
    folder.mkdir()
    for i, f in enumerate(files):
        table = _read_list(f, fmt, columns)
        screened = pa.chunked_array(
            [pa.array(urls.screened(c.to_pylist()), pa.string()) for c in table.column(url_col).chunks],
            pa.string(),
        )
        table = table.set_column(table.schema.get_field_index(url_col), url_col, screened)
        shards.write_parquet_atomic(folder / f"{i:05d}.parquet", table)
    shards.write_json_atomic(manifest, want)  # last: its presence means the copies are complete
    return folder


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


# Our options that img2dataset's download() takes under the same names (of PackOptions, of
# FetchConfig); the others are passed one by one.
_SAME_NAME_PACK = ("image_size", "resize_mode", "min_image_size", "max_aspect_ratio", "encode_format")
_SAME_NAME_FETCH = ("distributor", "timeout", "retries")


def run_img2dataset(lists: Path, out, opts: PackOptions, cfg: FetchConfig, *, url_col, caption_col) -> None:
    distributors.check(cfg)  # before img2dataset's imports: a missing Java fails at once
    os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
    # img2dataset decodes with OpenCV, whose own limit is 2**30 pixels; the spawned
    # workers read this when cv2 loads, so bombs are refused before they are decoded.
    os.environ.setdefault("OPENCV_IO_MAX_IMAGE_PIXELS", str(opts.max_pixels))
    try:
        from img2dataset import download
    except ImportError as e:
        raise missing_extra("a URL list", "data", e, error=DitdataError) from None

    previous = signal.getsignal(signal.SIGINT)
    try:
        # the http(s)-only opener in every worker; a Spark session or Ray for those distributors
        with urls.guarded_img2dataset(), distributors.runtime(cfg):
            download(
                url_list=str(lists),
                output_folder=str(out),
                input_format="parquet",
                output_format="webdataset",
                url_col=url_col,
                caption_col=caption_col,
                save_additional_columns=list(cfg.keep_cols) or None,
                **{k: getattr(opts, k) for k in _SAME_NAME_PACK},
                max_image_area=float(opts.max_pixels),
                encode_quality=opts.encode_quality if opts.encode_format != "png" else 9,
                number_sample_per_shard=opts.samples_per_shard,
                oom_shard_count=shards.SHARD_DIGITS,
                **{k: getattr(cfg, k) for k in _SAME_NAME_FETCH},
                processes_count=cfg.processes,
                thread_count=cfg.threads,
                incremental_mode="incremental",
                enable_wandb=False,
            )
    except SystemExit:  # img2dataset's SIGINT handler exits with status 0
        raise DitdataError("interrupted; rerun the same command to resume") from None
    finally:
        signal.signal(signal.SIGINT, previous)


def url_format(p: Path) -> str | None:
    name = p.name.lower()
    for fmt in URL_LIST_FORMATS:
        if name.endswith("." + fmt):
            return fmt
        if fmt != "parquet" and name.endswith(f".{fmt}.gz"):
            return fmt + ".gz"
    return None


def _url_files(src: Path) -> tuple[list[Path], str]:
    if src.is_file():
        fmt = url_format(src)
        if fmt is None:
            raise DitdataError(f"{src}: not a URL list (.parquet, .csv, .tsv, .jsonl, .json, .txt)")
        return [src], fmt
    files = sorted(p for p in src.iterdir() if p.is_file() and not p.name.startswith("."))
    fmts = {url_format(p) for p in files}
    if len(fmts) != 1 or None in fmts:
        raise DitdataError(f"{src}: a folder of URL lists must hold files of one format only, found {sorted(map(str, fmts))}")
    fmt = fmts.pop()
    # img2dataset globs "*.<format>" in the folder
    return files, fmt


def _open_text(p: Path):
    if p.name.lower().endswith(".gz"):
        return gzip.open(p, "rt", encoding="utf-8", newline="")
    return open(p, encoding="utf-8", newline="")


def _columns(p: Path, fmt: str) -> list[str]:
    base = fmt.removesuffix(".gz")
    try:
        if base == "parquet":
            import pyarrow.parquet as pq

            return list(pq.read_schema(p).names)
        if base in ("csv", "tsv"):
            with _open_text(p) as f:
                return next(csv.reader(f, delimiter="\t" if base == "tsv" else ","), [])
        if base == "jsonl":
            with _open_text(p) as f:
                for line in f:
                    if line.strip():
                        return list(json.loads(line))
            return []
        if base == "json":
            import pandas as pd

            return list(pd.read_json(p).columns)
        return ["url"]
    except (OSError, ValueError, StopIteration) as e:
        raise DitdataError(f"{p}: cannot read the URL list ({e})") from None


def _count_rows(p: Path, fmt: str, url_col: str) -> int:
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(p).metadata.num_rows
        except (OSError, ValueError) as e:
            raise DitdataError(f"{p}: cannot read the URL list ({e})") from None
    return _read_list(p, fmt, [url_col]).num_rows


def _read_list(p: Path, fmt: str, columns: list[str]):
    """COLUMNS of a URL list as a pyarrow table, parsed the way img2dataset's Reader parses
    FMT (img2dataset/reader.py), so that rows and values are the ones it would download."""
    import pyarrow as pa
    import pyarrow.csv as pcsv
    import pyarrow.json as pjson
    import pyarrow.parquet as pq

    base = fmt.removesuffix(".gz")
    try:
        if base == "parquet":
            return pq.read_table(p, columns=columns)
        with (gzip.open if fmt.endswith(".gz") else open)(p, "rb") as f:
            if base == "txt":
                table = pcsv.read_csv(f, read_options=pcsv.ReadOptions(column_names=["url"]))
            elif base in ("csv", "tsv"):
                table = pcsv.read_csv(
                    f, parse_options=pcsv.ParseOptions(delimiter="\t" if base == "tsv" else ","),
                    convert_options=pcsv.ConvertOptions(include_columns=columns),
                )
            elif base == "jsonl":
                table = pjson.read_json(f)
            else:
                import pandas as pd

                table = pa.Table.from_pandas(pd.read_json(f))
        return table.select(columns)
    except (OSError, ValueError, KeyError, pa.ArrowException) as e:
        raise DitdataError(f"{p}: cannot read the URL list ({e})") from None


def _pick_columns(columns, fmt, url_col, caption_col, keep_cols, path) -> tuple[str, str | None]:
    if fmt.startswith("txt"):
        if caption_col or keep_cols:
            raise DitdataError(f"{path}: a .txt URL list has one URL per line and no other columns")
        return "url", None
    have = ", ".join(columns)
    if url_col is None:
        url_col = next((c for c in URL_COLUMNS if c in columns), None)
        if url_col is None:
            raise DitdataError(f"{path}: no URL column found (columns: {have}); pass --url-col")
    elif url_col not in columns:
        raise DitdataError(f"{path}: no column {url_col!r} for --url-col (columns: {have})")
    if caption_col is None:
        caption_col = next((c for c in CAPTION_COLUMNS if c in columns and c != url_col), None)
    elif caption_col == "":
        caption_col = None
    elif caption_col not in columns:
        raise DitdataError(f"{path}: no column {caption_col!r} for --caption-col (columns: {have})")
    for c in keep_cols:
        if c not in columns:
            raise DitdataError(f"{path}: no column {c!r} for --keep-col (columns: {have})")
        if c in (url_col, caption_col):
            raise DitdataError(f"--keep-col {c}: the URL and caption columns are always kept")
        if c in IMG2DATASET_RESERVED:
            raise DitdataError(
                f"--keep-col {c}: img2dataset reserves this name for its own metadata "
                f"(reserved: {', '.join(sorted(IMG2DATASET_RESERVED))}); rename the column in the URL list"
            )
    return url_col, caption_col

"""`ditdata fetch`: URL lists through img2dataset (served from 127.0.0.1), class folders,
caption folders, the bad-input zoo, and resuming after SIGKILL."""

from __future__ import annotations

import collections
import contextlib
import hashlib
import http.server
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from cliutil import assert_has, http_server
from PIL import Image
from skimage import data as skdata
from sklearn.datasets import load_sample_images
from test_imageshards import arrow_image, bomb_png, encode, exif_rotated_jpeg, rgb16_png

from ditdata.cli import main as cli
from ditdata.errors import DitdataError
from ditdata.fetch import fetch
from ditdata.images import resize_image
from ditdata.imageshards.folder import iter_samples, iter_shard, list_shards, read_dataset_info, read_shard_stats


def real_images() -> dict[str, np.ndarray]:
    """Real photographs shipped with scikit-image and scikit-learn (RGB uint8)."""
    china, flower = load_sample_images().images
    out = {
        "astronaut": skdata.astronaut(),
        "chelsea": skdata.chelsea(),
        "coffee": skdata.coffee(),
        "rocket": skdata.rocket(),
        "camera": np.repeat(skdata.camera()[..., None], 3, axis=2),
        "china": china,
        "flower": flower,
    }
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


@pytest.fixture(scope="module")
def images() -> dict[str, np.ndarray]:
    return real_images()


def _subprocess_env() -> dict:
    env = dict(os.environ)
    for k in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        env.pop(k, None)
    env["no_proxy"] = env["NO_PROXY"] = "127.0.0.1,localhost"
    env["NO_ALBUMENTATIONS_UPDATE"] = "1"
    env["WANDB_MODE"] = "disabled"
    return env


def run_cli(*args, timeout=180) -> subprocess.CompletedProcess:
    """`ditdata ...` in a subprocess (img2dataset spawns workers and installs signal handlers)."""
    return subprocess.run(
        [sys.executable, "-m", "ditdata.cli", *map(str, args)],
        capture_output=True, text=True, timeout=timeout, env=_subprocess_env(),
    )


# ============================================================================ URL lists


@contextlib.contextmanager
def serve(files: dict, settings: dict | None = None, redirects: dict[str, str] | None = None,
          requests: dict | None = None):
    """An HTTP server on 127.0.0.1:<free port> serving `files` {path: bytes} (404 for the
    rest) and 302 `redirects` {path: Location}; settings["delay"] seconds per image request
    slow it down. A path may also map to a list of answers, one per request (the last one
    repeats), each bytes or an HTTP status code; `requests` (a Counter) counts the requests
    per path. Yields the base URL."""
    settings = {"delay": 0.0} if settings is None else settings
    redirects = redirects or {}
    requests = collections.Counter() if requests is None else requests
    lock = threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            with lock:
                n = requests[self.path]
                requests[self.path] += 1
            if self.path in redirects:
                self.send_response(302)
                self.send_header("Location", redirects[self.path])
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            body = files.get(self.path)
            if isinstance(body, list):
                body = body[min(n, len(body) - 1)]
            if body is None or isinstance(body, int):
                self.send_error(body or 404)
                return
            time.sleep(settings["delay"])
            self.send_response(200)
            self.send_header("Content-Type", "image/jpeg")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    with http_server(Handler) as base:
        yield base


@pytest.fixture
def http_files():
    """serve() as a fixture: (base URL, files to fill, settings); `delay` slows it down for
    the kill test."""
    files: dict[str, bytes] = {}
    settings = {"delay": 0.0}
    with serve(files, settings) as base:
        yield base, files, settings


@pytest.mark.slow
def test_fetch_url_parquet_killed_and_resumed(tmp_path, http_files, images):
    """A LAION-style parquet (URL, TEXT, extra columns) of real images served from
    127.0.0.1 plus a 404 and a garbage URL. The first run is SIGKILLed mid-way (the
    server is slowed down), the rerun resumes it; the result is exact: every row once,
    its caption and kept columns, the right pixels, and a summary with the right counts.
    (One scenario, because every img2dataset run costs ~10 s of imports on 2 cores.)"""
    base, files, settings = http_files
    settings["delay"] = 0.1
    rows = []
    for copy in range(2):
        for i, (name, arr) in enumerate(images.items()):
            files[f"/{copy}/{name}.jpg"] = encode(arr, "JPEG", quality=95)
            rows.append({"URL": f"{base}/{copy}/{name}.jpg", "TEXT": f"photo {copy} of {name}",
                         "similarity": 0.25 + i / 100 + copy / 1000, "punsafe": i / 1000, "ignored": "x"})
    files["/garbage.jpg"] = os.urandom(2000)
    rows.insert(3, {"URL": f"{base}/missing.jpg", "TEXT": "gone", "similarity": 0.1, "punsafe": 0.0, "ignored": "x"})
    rows.insert(9, {"URL": f"{base}/garbage.jpg", "TEXT": "noise", "similarity": 0.2, "punsafe": 0.0, "ignored": "x"})
    assert len(rows) == 16
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "urls.parquet")
    # 4 shards of 4 rows (img2dataset restarts its worker after 5 shards: stay below)
    args = ["fetch", tmp_path / "urls.parquet", "--image-size", 64, "--samples-per-shard", 4,
            "--processes", 1, "--threads", 1, "--keep-col", "similarity", "--keep-col", "punsafe"]

    out = tmp_path / "shards"
    done = _kill_midway([*args, "--out", out], out, min_done=1, timeout=150)
    assert 1 <= done < 4
    with pytest.raises(DitdataError, match="did not finish"):
        read_dataset_info(out)
    # img2dataset writes a stats file in place: a kill can land inside that write (the
    # kill above comes as soon as the first file exists). Model it for one finished shard.
    torn = sorted(out.glob("*_stats.json"))[0]
    torn.write_text(torn.read_text()[:7])

    r = run_cli(*args, "--out", out, "-q")
    assert r.returncode == 0, r.stderr + r.stdout
    assert "resuming:" in r.stderr or done == 1
    assert f"{torn.name} was cut short" in r.stderr
    # the summary: 16 rows, 14 images, one 404 and one undecodable
    assert_has(r.stdout, "total:        16", "successes:    14 (87.5%)", "failed:       2",
               "1  HTTP Error 404: Not Found", "1  Image decoding error")
    info = read_dataset_info(out)
    assert (info["kind"], info["num_shards"], info["num_samples"]) == ("urls", 4, 14)
    assert info["summary"]["reasons"] == {"HTTP Error 404: Not Found": 1, "Image decoding error": 1}
    assert sum(s["count"] for s in read_shard_stats(out).values()) == 16

    samples = list(iter_samples(out))
    # no duplicates, no gaps: img2dataset's key is shard * 10 + index (4 per shard) <-> row
    rows_of = [int(s.key[:5]) * 4 + int(s.key[5:]) for s in samples]
    assert sorted(rows_of) == [k for k in range(16) if k not in (3, 9)]
    for k, s in zip(rows_of, samples, strict=True):
        row = rows[k]
        assert s.source == row["URL"] and s.caption == row["TEXT"]
        assert s.meta["similarity"] == pytest.approx(row["similarity"])
        assert s.meta["punsafe"] == pytest.approx(row["punsafe"])
        assert "ignored" not in s.meta
        name = s.source.rsplit("/", 1)[1][:-4]
        h, w = images[name].shape[:2]
        assert (s.meta["original_width"], s.meta["original_height"]) == (w, h)
        img = s.decode()
        assert img.size == (64, 64) and (s.meta["width"], s.meta["height"]) == (64, 64)
        ref = np.asarray(resize_image(Image.fromarray(images[name]), 64, "center_crop")).astype(int)
        assert np.abs(np.asarray(img).astype(int) - ref).mean() < 12, name


def test_url_list_errors(tmp_path):
    pq.write_table(pa.table({"link_x": ["http://127.0.0.1:9/a.jpg"], "width": [1]}), tmp_path / "u.parquet")
    with pytest.raises(DitdataError, match="no URL column"):
        fetch(tmp_path / "u.parquet", tmp_path / "o1")
    assert not (tmp_path / "o1").exists()  # a refused fetch leaves no empty folder
    with pytest.raises(DitdataError, match="no column 'nope'"):
        fetch(tmp_path / "u.parquet", tmp_path / "o2", url_col="link_x", keep_cols=["nope"])
    with pytest.raises(DitdataError, match="reserves"):
        fetch(tmp_path / "u.parquet", tmp_path / "o3", url_col="link_x", keep_cols=["width"])
    with pytest.raises(DitdataError, match="applies to --distributor pyspark"):  # more: test_fetch_spark.py
        fetch(tmp_path / "u.parquet", tmp_path / "o4", url_col="link_x", spark_master="local[2]")
    # the CLI turns it into one line and exit status 1
    r = CliRunner().invoke(cli, ["fetch", str(tmp_path / "u.parquet"), "--out", str(tmp_path / "o5")])
    assert r.exit_code == 1 and "no URL column found" in r.output and "Traceback" not in r.output


# ============================================================================ folders


def _crop(arr: np.ndarray, rng: np.random.Generator, size: int | None = None) -> np.ndarray:
    h, w = arr.shape[:2]
    ch, cw = int(h * rng.uniform(0.6, 1.0)), int(w * rng.uniform(0.6, 1.0))
    y, x = rng.integers(0, h - ch + 1), rng.integers(0, w - cw + 1)
    out = arr[y:y + ch, x:x + cw]
    if size:
        out = np.asarray(Image.fromarray(out).resize((size, size * ch // cw), Image.Resampling.BILINEAR))
    return np.ascontiguousarray(out)


def make_class_tree(root: Path, images: dict, per_class: int = 3, seed: int = 0) -> dict[str, bytes]:
    """ImageNet-like tree: one folder per 'synset' holding JPEGs; returns {relpath: bytes}."""
    rng = np.random.default_rng(seed)
    written = {}
    for c, name in enumerate(["n02123045", "n01440764", "n04552348"]):
        src = list(images.values())[c]
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            rel = f"{name}/{name}_{i:04d}.JPEG"
            written[rel] = encode(_crop(src, rng), "JPEG", quality=90)
            (root / rel).write_bytes(written[rel])
    return written


def test_class_folder(tmp_path, images):
    src = tmp_path / "train"
    written = make_class_tree(src, images)
    (src / "README.txt").write_text("not an image")
    (src / "n09999999").mkdir()  # an empty class keeps its index
    info = fetch(src, tmp_path / "shards", samples_per_shard=4, processes=2, progress=False)
    class_names = ["n01440764", "n02123045", "n04552348", "n09999999"]
    assert info["kind"] == "classes" and info["class_names"] == class_names and info["num_classes"] == 4
    assert info["num_samples"] == 9 and info["num_shards"] == 3
    assert info["summary"]["notes"]["class folders without images"] == 1
    assert info["summary"]["notes"]["other files ignored"] == 1

    samples = list(iter_samples(tmp_path / "shards"))
    assert [s.key for s in samples] == [f"{sh:05d}{i}" for sh, n in ((0, 4), (1, 4), (2, 1)) for i in range(n)]
    assert sorted(s.source for s in samples) == sorted(written)
    for s in samples:
        cls = s.source.split("/")[0]
        assert s.label == class_names.index(cls) and s.meta["class_name"] == cls
        assert s.caption is None
        assert s.image == written[s.source]  # RGB JPEG originals are stored byte for byte
        w, h = Image.open(io.BytesIO(written[s.source])).size
        assert (s.meta["width"], s.meta["height"], s.meta["original_width"], s.meta["original_height"]) == (w, h, w, h)
    labels = [s.label for s in samples]
    assert labels == sorted(labels)  # sorted order by default

    # rerun: nothing to do, same shards; different settings are refused
    before = {p.name: p.read_bytes() for p in list_shards(tmp_path / "shards")}
    fetch(src, tmp_path / "shards", samples_per_shard=4, processes=1, progress=False)
    assert {p.name: p.read_bytes() for p in list_shards(tmp_path / "shards")} == before
    with pytest.raises(DitdataError, match="samples_per_shard 4 -> 5"):
        fetch(src, tmp_path / "shards", samples_per_shard=5, progress=False)
    info = fetch(src, tmp_path / "shards", samples_per_shard=5, overwrite=True, progress=False)
    assert info["num_shards"] == 2


def test_class_folder_resized_via_cli(tmp_path, images):
    src = tmp_path / "train"
    make_class_tree(src, images, per_class=2)
    r = CliRunner().invoke(cli, ["fetch", str(src), "--out", str(tmp_path / "s"), "--image-size", "48",
                                 "--processes", "1", "--shuffle-seed", "0", "-q"])
    assert r.exit_code == 0, r.output
    assert "total:        6" in r.output and "successes:    6 (100.0%)" in r.output
    samples = list(iter_samples(tmp_path / "s"))
    assert sorted(s.label for s in samples) == [0, 0, 1, 1, 2, 2]
    assert [s.label for s in samples] != [0, 0, 1, 1, 2, 2]  # shuffled
    for s in samples:
        assert s.decode().size == (48, 48) and (s.meta["width"], s.meta["height"]) == (48, 48)
        assert min(s.meta["original_width"], s.meta["original_height"]) > 48


def test_caption_folder(tmp_path, images):
    src = tmp_path / "pairs"
    (src / "sub").mkdir(parents=True)
    expected = {}
    for i, (name, arr) in enumerate(images.items()):
        rel = f"{'sub/' if i % 2 else ''}{name}.{'png' if i == 3 else 'jpg'}"
        (src / rel).write_bytes(encode(arr, "PNG" if i == 3 else "JPEG"))
        if name != "rocket":
            (src / rel).with_suffix(".txt").write_text(f"  a photo of {name} ✓\n", encoding="utf-8")
            expected[rel] = f"a photo of {name} ✓"
        else:
            expected[rel] = None
    info = fetch(src, tmp_path / "shards", progress=False)
    assert info["kind"] == "captions" and info["num_samples"] == len(images)
    assert info["summary"]["notes"]["images without a caption file (caption null)"] == 1
    got = {s.source: s for s in iter_samples(tmp_path / "shards")}
    assert {k: s.caption for k, s in got.items()} == expected
    png = got["sub/rocket.png"]
    assert png.ext == "jpg" and png.meta["original_format"] == "PNG"  # re-encoded as --encode-format
    # the .txt member is there for WebDataset readers too
    with_txt = next(s for s in got.values() if s.caption)
    assert with_txt.meta["caption"] == with_txt.caption


def test_bad_input_zoo(tmp_path, images):
    """Each broken or unusual file is converted correctly or skipped with its reason."""
    src = tmp_path / "zoo" / "things"
    src.mkdir(parents=True)
    ast = images["astronaut"][::4, ::4].copy()  # 128 x 128
    jpg = encode(ast, "JPEG", quality=95)
    rgba = np.dstack([ast, np.full((128, 128), 255, np.uint8)])
    rgba[64:, :, 3] = 0
    files = {
        "a_truncated.jpg": jpg[: len(jpg) // 2],
        "b_empty.jpg": b"",
        "c_text.jpg": b"definitely not a jpeg\n",
        "d_bomb.png": bomb_png(),
        "e_cmyk.jpg": encode(Image.fromarray(ast).convert("CMYK"), "JPEG", quality=95),
        "f_gray16.png": encode(Image.fromarray(np.arange(256, dtype=np.uint16).reshape(16, 16) * 257), "PNG"),
        "g_rgb16.png": rgb16_png(ast),
        "h_gray.jpg": encode(ast[..., 1], "JPEG", quality=95),
        "i_palette.png": encode(Image.fromarray(ast).convert("P", palette=Image.Palette.ADAPTIVE), "PNG"),
        "j_rgba.png": encode(rgba, "PNG"),
        "k_exif6.jpg": exif_rotated_jpeg(arrow_image(), 6),
        "l_ok.jpg": jpg,
    }
    for name, payload in files.items():
        (src / name).write_bytes(payload)
    info = fetch(tmp_path / "zoo", tmp_path / "shards", samples_per_shard=5, processes=2, progress=False)
    s = info["summary"]
    assert (s["total"], s["successes"], s["failed"]) == (12, 8, 4)
    assert s["reasons"] == {"decompression bomb": 1, "empty file": 1, "not an image": 1, "truncated image": 1}
    assert s["notes"]["converted to RGB"] == "CMYK 1, I;16 1, L 1, P 1, RGBA 1"
    assert s["notes"]["exif_rotated"] == 1
    skipped = {f["source"]: f["reason"] for st in read_shard_stats(tmp_path / "shards").values()
               for f in st["skipped_files"]}
    assert skipped == {"things/a_truncated.jpg": "truncated image", "things/b_empty.jpg": "empty file",
                       "things/c_text.jpg": "not an image", "things/d_bomb.png": "decompression bomb"}

    got = {Path(x.source).name: x for x in iter_samples(tmp_path / "shards")}
    assert set(got) == {n for n in files if n[0] in "efghijkl"}
    px = {n: np.asarray(x.decode()).astype(int) for n, x in got.items()}
    for n, x in got.items():
        assert x.decode().mode == "RGB"
        assert (x.meta["width"], x.meta["height"]) == px[n].shape[1::-1]
    assert got["l_ok.jpg"].image == jpg  # untouched original
    assert np.abs(px["e_cmyk.jpg"] - ast).mean() < 6
    assert np.abs(px["f_gray16.png"][..., 0] - np.arange(256).reshape(16, 16)).max() <= 3
    assert (px["f_gray16.png"][..., 0] == px["f_gray16.png"][..., 2]).all()
    assert np.abs(px["g_rgb16.png"] - ast).mean() < 4
    assert np.abs(px["h_gray.jpg"] - ast[..., 1:2]).mean() < 3
    assert np.abs(px["i_palette.png"] - ast).mean() < 8
    assert np.abs(px["j_rgba.png"][:64] - ast[:64]).mean() < 4 and (px["j_rgba.png"][64:] >= 250).all()
    k = got["k_exif6.jpg"]
    assert (k.meta["width"], k.meta["height"], k.meta["original_width"], k.meta["original_height"]) == (40, 60, 40, 60)
    assert k.meta["exif_orientation"] == 6
    expect = np.asarray(Image.fromarray(arrow_image()).transpose(Image.Transpose.ROTATE_270)).astype(int)
    assert np.abs(px["k_exif6.jpg"] - expect).mean() < 8


def test_detect_kind_needs_help(tmp_path, images):
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "a.jpg").write_bytes(encode(images["coffee"], "JPEG"))
    with pytest.raises(DitdataError, match="--kind captions"):
        fetch(tmp_path / "flat", tmp_path / "o")
    info = fetch(tmp_path / "flat", tmp_path / "o", kind="captions", progress=False)
    assert info["num_samples"] == 1 and next(iter_samples(tmp_path / "o")).caption is None
    # shards that some other command wrote are not adopted nor deleted silently
    (tmp_path / "o2").mkdir()
    (tmp_path / "o2" / "00000.tar").write_bytes(b"")
    (tmp_path / "o2" / "notes.md").write_text("mine")
    with pytest.raises(DitdataError, match="did not start"):
        fetch(tmp_path / "flat", tmp_path / "o2", kind="captions", progress=False)
    with pytest.raises(DitdataError, match="refusing to empty"):
        fetch(tmp_path / "flat", tmp_path / "o2", kind="captions", overwrite=True, progress=False)


# ============================================================================ kill and resume


def _kill_midway(cmd: list, out: Path, min_done: int, timeout: float = 60) -> int:
    """Start `ditdata fetch` in its own process group, SIGKILL the whole group as soon as
    `min_done` shards have their stats file, and return how many had."""
    p = subprocess.Popen([sys.executable, "-m", "ditdata.cli", *map(str, cmd)], env=_subprocess_env(),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + timeout
    try:
        while time.time() < deadline and p.poll() is None:
            if out.is_dir() and len(list(out.glob("*_stats.json"))) >= min_done:
                break
            time.sleep(0.005)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    assert p.returncode == -signal.SIGKILL, "the fetch finished before it could be killed"
    return len(list(out.glob("*_stats.json")))


def _digest(shards_dir: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in list_shards(shards_dir)}


@pytest.mark.slow
def test_folder_fetch_resumes_after_sigkill(tmp_path, images):
    src = tmp_path / "train"
    rng = np.random.default_rng(1)
    for c, name in enumerate(["cats", "dogs", "fish"]):
        (src / name).mkdir(parents=True)
        for i in range(16):  # big PNGs: slow enough to decode that the kill lands mid-run
            arr = _crop(list(images.values())[c + 2], rng, size=900)
            (src / name / f"{i:03d}.png").write_bytes(encode(arr, "PNG", compress_level=1))
    (src / "dogs" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnope")
    args = ["fetch", src, "--samples-per-shard", 2, "--processes", 1, "--image-size", 96]

    out = tmp_path / "killed"
    done = _kill_midway([*args, "--out", out], out, min_done=3)
    assert 3 <= done < 25
    with pytest.raises(DitdataError, match="did not finish"):
        read_dataset_info(out)
    for p in list_shards(out):  # whatever looks finished is complete
        list(iter_shard(p))

    r = run_cli(*args, "--out", out, "-q")
    assert r.returncode == 0, r.stderr
    assert "resuming:" in r.stderr
    clean = tmp_path / "clean"
    fetch(src, clean, samples_per_shard=2, processes=2, image_size=96, progress=False)
    assert _digest(out) == _digest(clean)  # byte-identical shards
    keys = [s.key for s in iter_samples(out)]
    assert len(keys) == len(set(keys)) == 48
    assert read_dataset_info(out)["summary"]["reasons"] == {"not an image": 1}
    assert not [p for p in out.iterdir() if ".tmp-" in p.name]


def test_help_has_an_example_per_source_kind():
    r = CliRunner().invoke(cli, ["fetch", "--help"])
    assert r.exit_code == 0
    for needle in ("laion_part0.parquet", "--keep-col similarity", "imagenet/train --out", "--kind captions",
                   "--resize-mode", "--distributor"):
        assert needle in r.output


def test_url_list_formats_are_read(tmp_path):
    """Column detection and row counting for each URL-list format (no download)."""
    import gzip

    from ditdata.fetch import detect_kind
    from ditdata.fetch.urllists import _columns, _count_rows, _pick_columns, _url_files

    urls = [f"http://127.0.0.1:9/{i}.jpg" for i in range(5)]
    (tmp_path / "a.csv").write_text("URL,TEXT,similarity\n" + "".join(f"{u},cap {i},0.3\n" for i, u in enumerate(urls)))
    (tmp_path / "a.tsv").write_text("url\tcaption\n" + "".join(f"{u}\tcap\n" for u in urls))
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"url": u, "text": "t"}) + "\n" for u in urls) + "\n")
    (tmp_path / "a.txt").write_text("\n".join(urls) + "\n")
    with gzip.open(tmp_path / "b.csv.gz", "wt") as f:
        f.write("url,caption\n" + "".join(f"{u},c\n" for u in urls))
    expect = {"a.csv": ("csv", "URL", "TEXT"), "a.tsv": ("tsv", "url", "caption"),
              "a.jsonl": ("jsonl", "url", "text"), "a.txt": ("txt", "url", None),
              "b.csv.gz": ("csv.gz", "url", "caption")}
    for name, (fmt, url_col, cap_col) in expect.items():
        p = tmp_path / name
        assert detect_kind(p) == "urls"
        files, got_fmt = _url_files(p)
        assert got_fmt == fmt
        cols = _columns(p, fmt)
        assert _pick_columns(cols, fmt, None, None, [], p) == (url_col, cap_col)
        assert _count_rows(p, fmt, url_col) == 5


def test_importing_fetch_starts_nothing():
    """img2dataset's workers (spawned processes, Spark or Ray executors) import this package
    to unpickle their downloader: importing it must not import img2dataset or a cluster."""
    code = ("import sys, ditdata.fetch, ditdata.fetch.urls, ditdata.fetch.distributors; "
            "assert not {'img2dataset', 'pyspark', 'ray', 'torch'} & set(sys.modules), sys.modules.keys()")
    subprocess.run([sys.executable, "-c", code], check=True)

"""The image-shard format (ditdata/imageshards/folder.py) and safe decoding (ditdata/images.py)."""

from __future__ import annotations

import hashlib
import io
import json
import struct
import tarfile
import zlib

import numpy as np
import pytest
from PIL import Image
from skimage import data as skdata

from ditdata.errors import DitdataError
from ditdata.images import BadImageError, decode_rgb, resize_image
from ditdata.imageshards.folder import (
    ShardWriter,
    iter_shard,
    list_shards,
    read_dataset_info,
    sample_key,
    shard_path,
    summarize_stats,
    write_shard_stats,
)

# ------------------------------------------------------------------ helpers shared with test_fetch


def png_bytes(width: int, height: int, bit_depth: int, color_type: int, raw_rows: bytes) -> bytes:
    """A PNG written by hand (so we can make 16-bit RGB and 30000 x 30000 files cheaply);
    raw_rows are the filtered scanlines, already zlib-compressed."""

    def chunk(tag: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + tag + payload + struct.pack(">I", zlib.crc32(tag + payload))

    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", raw_rows) + chunk(b"IEND", b"")


def bomb_png(side: int = 30000) -> bytes:
    """A real side x side 1-bit greyscale PNG (all black): ~100 kB on disk, 900 Mpixels."""
    c = zlib.compressobj(9)
    row = b"\x00" + bytes((side + 7) // 8)
    parts = [c.compress(row * 1000) for _ in range(side // 1000)]
    parts.append(c.compress(row * (side % 1000)))
    parts.append(c.flush())
    return png_bytes(side, side, 1, 0, b"".join(parts))


def rgb16_png(rgb8: np.ndarray) -> bytes:
    a16 = rgb8.astype(">u2") * 257
    rows = b"".join(b"\x00" + a16[i].tobytes() for i in range(a16.shape[0]))
    return png_bytes(rgb8.shape[1], rgb8.shape[0], 16, 2, zlib.compress(rows))


def encode(arr_or_img, fmt: str, **kw) -> bytes:
    img = arr_or_img if isinstance(arr_or_img, Image.Image) else Image.fromarray(arr_or_img)
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def exif_rotated_jpeg(raw: np.ndarray, orientation: int = 6) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(raw, "JPEG", quality=95, exif=exif.tobytes())


def arrow_image(h: int = 40, w: int = 60) -> np.ndarray:
    """Asymmetric blocks: red left half, blue right half, green top-left corner."""
    a = np.zeros((h, w, 3), np.uint8)
    a[:, : w // 2] = (255, 0, 0)
    a[:, w // 2 :] = (0, 0, 255)
    a[: h // 4, : w // 4] = (0, 255, 0)
    return a


# ------------------------------------------------------------------ decoding


@pytest.fixture(scope="module")
def astronaut() -> np.ndarray:
    return skdata.astronaut()[::4, ::4].copy()  # 128 x 128 RGB


def test_decode_plain_formats(astronaut):
    for fmt in ("PNG", "BMP", "TIFF"):
        assert np.array_equal(np.asarray(decode_rgb(encode(astronaut, fmt))), astronaut)
    img = decode_rgb(encode(astronaut, "JPEG", quality=95))
    assert img.mode == "RGB" and img.size == (128, 128)
    assert np.abs(np.asarray(img).astype(int) - astronaut).mean() < 4


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"", "empty file"),
        (b"this is a caption, not a JPEG\n", "not an image"),
        ("truncated_jpeg", "truncated image"),
        ("truncated_png", "truncated image"),
        ("bomb", "decompression bomb"),
    ],
)
def test_bad_inputs_give_reasons(payload, reason, astronaut):
    if payload == "truncated_jpeg":
        full = encode(astronaut, "JPEG")
        payload = full[: len(full) // 2]
    elif payload == "truncated_png":
        full = encode(astronaut, "PNG")
        payload = full[: len(full) * 3 // 4]
    elif payload == "bomb":
        payload = bomb_png()
    with pytest.raises(BadImageError) as e:
        decode_rgb(payload)
    assert e.value.reason == reason


def test_mode_conversions(astronaut):
    gray = skdata.camera()[::4, ::4].copy()
    # greyscale -> R = G = B
    out = np.asarray(decode_rgb(encode(gray, "PNG")))
    assert out.shape == (128, 128, 3) and (out == gray[..., None]).all()
    # 16-bit greyscale: scaled, not clipped
    g16 = (np.arange(256, dtype=np.uint16).reshape(16, 16) * 257)
    out = np.asarray(decode_rgb(encode(Image.fromarray(g16), "PNG")))
    assert (out[..., 0] == np.arange(256).reshape(16, 16)).all()
    # 16-bit RGB
    assert np.array_equal(np.asarray(decode_rgb(rgb16_png(astronaut))), astronaut)
    # CMYK JPEG
    out = np.asarray(decode_rgb(encode(Image.fromarray(astronaut).convert("CMYK"), "JPEG", quality=95)))
    assert np.abs(out.astype(int) - astronaut).mean() < 6
    # palette: exact
    pal = Image.fromarray(astronaut).convert("P", palette=Image.Palette.ADAPTIVE, colors=64)
    assert np.array_equal(np.asarray(decode_rgb(encode(pal, "PNG"))), np.asarray(pal.convert("RGB")))
    # RGBA: alpha composited on white
    rgba = np.dstack([astronaut, np.zeros((128, 128), np.uint8)])
    rgba[:64, :, 3] = 255
    rgba[64:96, :, 3] = 128
    out = np.asarray(decode_rgb(encode(rgba, "PNG"))).astype(int)
    assert np.array_equal(out[:64], astronaut[:64])
    assert (out[96:] == 255).all()
    blend = astronaut[64:96].astype(int) * 128 / 255 + 255 * 127 / 255
    assert np.abs(out[64:96] - blend).max() <= 1


def test_exif_orientation_applied():
    raw = arrow_image()
    img = decode_rgb(exif_rotated_jpeg(raw, 6))  # 6: rotate 90 degrees clockwise to display
    assert img.size == (40, 60)
    expect = np.asarray(Image.fromarray(raw).transpose(Image.Transpose.ROTATE_270)).astype(int)
    assert np.abs(np.asarray(img).astype(int) - expect).mean() < 8


def test_resize_modes(astronaut):
    wide = Image.fromarray(np.concatenate([astronaut, astronaut], axis=1))  # 256 x 128
    assert resize_image(wide, 64, "center_crop").size == (64, 64)
    assert resize_image(wide, 64, "keep_ratio").size == (128, 64)
    assert resize_image(wide, 64, "keep_ratio_largest").size == (64, 32)
    bordered = resize_image(wide, 64, "border")
    assert bordered.size == (64, 64) and np.asarray(bordered)[0, 0].tolist() == [255, 255, 255]
    assert resize_image(wide, 64, "no") is wide


# ------------------------------------------------------------------ shards


def test_writer_is_atomic_and_deterministic(tmp_path, astronaut):
    jpg = encode(astronaut, "JPEG")
    digests = []
    for run in ("a", "b"):
        d = tmp_path / run
        d.mkdir()
        with ShardWriter(d, 3) as w:
            w.write(sample_key(3, 0, 100), jpg, "jpg", {"source": "x.jpg", "label": 1}, caption=None)
            w.write(sample_key(3, 1, 100), jpg, "jpg", {"source": "y.jpg", "caption": "hi"}, caption="hi")
        assert [p.name for p in d.iterdir()] == ["00003.tar"]
        digests.append(hashlib.sha256((d / "00003.tar").read_bytes()).hexdigest())
    assert digests[0] == digests[1]

    # an exception inside the writer leaves nothing behind
    with pytest.raises(RuntimeError), ShardWriter(tmp_path / "a", 4) as w:
        w.write("0000400", jpg, "jpg", {})
        raise RuntimeError("boom")
    assert not shard_path(tmp_path / "a", 4).exists()
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["00003.tar"]

    # unfinished (no stats) shards are not listed
    assert list_shards(tmp_path / "a") == []
    write_shard_stats(tmp_path / "a", 3, {"count": 2, "successes": 2, "status_dict": {"success": 2}})
    (paths,) = [list_shards(tmp_path / "a")]
    assert [p.name for p in paths] == ["00003.tar"]
    samples = list(iter_shard(paths[0]))
    assert [s.key for s in samples] == ["0000300", "0000301"]
    assert samples[0].label == 1 and samples[0].caption is None and samples[0].source == "x.jpg"
    assert samples[1].caption == "hi" and samples[1].label is None
    assert samples[0].image == jpg and samples[0].ext == "jpg"


def test_reader_normalises_img2dataset_samples(tmp_path, astronaut):
    """img2dataset's webdataset layout: 9-digit keys, url instead of source, .txt always."""
    path = tmp_path / "00000.tar"
    with tarfile.open(path, "w") as tf:
        for key, meta, txt in [
            ("000000000", {"url": "http://x/a.jpg", "caption": "a cat", "key": "000000000",
                           "width": 64, "height": 64, "original_width": 500, "original_height": 400,
                           "status": "success", "similarity": 0.31}, b"a cat"),
            ("000000002", {"url": "http://x/b.jpg", "caption": None, "key": "000000002",
                           "status": "success"}, b""),
        ]:
            for ext, payload in (("jpg", encode(astronaut, "JPEG")), ("json", json.dumps(meta).encode()),
                                 ("txt", txt)):
                ti = tarfile.TarInfo(f"{key}.{ext}")
                ti.size = len(payload)
                tf.addfile(ti, io.BytesIO(payload))
    a, b = list(iter_shard(path))
    assert (a.key, a.source, a.caption, a.label) == ("000000000", "http://x/a.jpg", "a cat", None)
    assert a.meta["similarity"] == 0.31 and a.meta["original_width"] == 500
    assert (b.source, b.caption, b.meta["width"]) == ("http://x/b.jpg", None, None)
    assert a.decode().size == (128, 128)


def test_read_dataset_info_errors(tmp_path):
    with pytest.raises(DitdataError, match="no such directory"):
        read_dataset_info(tmp_path / "nope")
    with pytest.raises(DitdataError, match="dataset.json is missing"):
        read_dataset_info(tmp_path)
    (tmp_path / "dataset.json").write_text("{not json")
    with pytest.raises(DitdataError, match="unreadable"):
        read_dataset_info(tmp_path)
    (tmp_path / "dataset.json").write_text(json.dumps({"format": "ditdata-images", "version": 9}))
    with pytest.raises(DitdataError, match="version"):
        read_dataset_info(tmp_path)


def test_summarize_stats():
    s = summarize_stats([
        {"count": 3, "successes": 2, "failed_to_download": 1, "failed_to_resize": 0,
         "status_dict": {"success": 2, "HTTP Error 404: Not Found": 1}},
        {"count": 2, "successes": 1, "failed_to_download": 0, "failed_to_resize": 1,
         "status_dict": {"success": 1, "not an image": 1}},
    ])
    assert (s["total"], s["successes"], s["failed"]) == (5, 3, 2)
    assert s["reasons"] == {"HTTP Error 404: Not Found": 1, "not an image": 1}
    assert s["success_rate"] == pytest.approx(0.6)

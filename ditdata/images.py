"""Decoding untrusted image bytes into RGB, and the resize policies of `ditdata fetch`.

Everything a crawl or a hand-made folder can throw at us is either converted correctly or
refused with a short, countable reason (`BadImageError.reason`):

    empty file            zero bytes
    not an image          Pillow cannot identify the format (e.g. a text file named .jpg)
    truncated image       the data ends before the image does
    decompression bomb    more pixels than `max_pixels` (Pillow's limit by default)
    corrupt image         the decoder failed for another reason (the message is kept)
    unsupported mode      a pixel format with no sensible RGB conversion

Conversions (`to_rgb`): EXIF orientation is applied; L, 1 and I;16 (16-bit) greyscale
become grey RGB (16-bit scaled to 8 bits, not clipped); RGBA, LA, PA and palette images
with transparency are composited on WHITE (the same as img2dataset); CMYK goes through
its embedded ICC profile when there is one, else through Pillow's conversion (which also
undoes Adobe's inverted CMYK); 16-bit RGB PNGs are read by Pillow as 8-bit RGB.

The resize modes keep img2dataset's names, so a folder packed here and a URL list
downloaded by img2dataset mean the same thing by `--resize-mode`:

    no                  keep the original size
    keep_ratio          smaller side -> size
    center_crop         smaller side -> size, then the central size x size square
    border              longer side -> size, then pad to size x size with white
    keep_ratio_largest  longer side -> size
"""

from __future__ import annotations

import io
import math
import warnings

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from ditdata.errors import DitdataError

# Pillow's own threshold for DecompressionBombWarning (about 89.5 megapixels); Pillow
# refuses outright at twice this. Real photos stay far below it.
DEFAULT_MAX_PIXELS = 89_478_485

RESIZE_MODES = ("no", "keep_ratio", "center_crop", "border", "keep_ratio_largest")

# Extensions treated as images when scanning folders (compared lower-case).
IMAGE_EXTENSIONS = frozenset(
    {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".ppm", ".pgm", ".pbm"}
)

# File extension in a shard for each Pillow format we write or pass through.
EXT_BY_FORMAT = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}
FORMAT_BY_EXT = {"jpg": "JPEG", "jpeg": "JPEG", "png": "PNG", "webp": "WEBP"}

_ORIENTATION = 0x0112
_WHITE = (255, 255, 255)


class BadImageError(DitdataError):
    """An input that cannot become an RGB image. `reason` is one of the short strings in
    this module's docstring (used as the counter key in shard stats); `detail` is the
    underlying message, if any."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def open_image(data: bytes, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Open (header only, no pixel decoding yet) and refuse decompression bombs."""
    if not data:
        raise BadImageError("empty file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise BadImageError("decompression bomb", str(e)) from None
    except UnidentifiedImageError:
        raise BadImageError("not an image") from None
    except Exception as e:  # a header so broken that even identification fails
        raise BadImageError("corrupt image", _msg(e)) from None
    w, h = img.size
    if w <= 0 or h <= 0:
        raise BadImageError("corrupt image", f"size {w}x{h}")
    if w * h > max_pixels:
        raise BadImageError("decompression bomb", f"{w}x{h} pixels exceeds {max_pixels}")
    return img


def orientation(img: Image.Image) -> int:
    """The EXIF orientation tag (1 = upright; 1 when absent or unreadable)."""
    try:
        value = img.getexif().get(_ORIENTATION, 1)
        return int(value) if int(value) in range(1, 9) else 1
    except Exception:
        return 1


def load(img: Image.Image, *, draft: tuple[int, int] | None = None) -> Image.Image:
    """Decode the pixels of an opened image, the first frame of animations, applying EXIF
    orientation. `draft` (JPEG only) lets libjpeg decode at 1/2, 1/4 or 1/8 scale while
    staying at least that size: much faster when the image is shrunk anyway."""
    try:
        if draft is not None and img.format == "JPEG":
            img.draft("RGB", draft)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. "Corrupt EXIF data", palette transparency
            img.load()
            ImageOps.exif_transpose(img, in_place=True)
    except BadImageError:
        raise
    except OSError as e:
        text = str(e)
        if "truncated" in text or "premature end" in text.lower():
            raise BadImageError("truncated image", text) from None
        raise BadImageError("corrupt image", text) from None
    except (Image.DecompressionBombError, MemoryError) as e:
        raise BadImageError("decompression bomb", _msg(e)) from None
    except Exception as e:
        raise BadImageError("corrupt image", _msg(e)) from None
    return img


def to_rgb(img: Image.Image) -> Image.Image:
    """Convert a loaded image of any Pillow mode to 8-bit RGB (see the module docstring)."""
    mode = img.mode
    try:
        if mode == "RGB":
            return img
        if mode in ("L", "1"):
            return img.convert("RGB")
        if mode == "P":
            if "transparency" in img.info:
                return _on_white(img.convert("RGBA"))
            return img.convert("RGB")
        if mode in ("RGBA", "LA", "PA", "RGBa", "La"):
            return _on_white(img.convert("RGBA"))
        if mode == "CMYK":
            return _cmyk_to_rgb(img)
        if mode.startswith("I;16") or mode == "I":
            a = np.asarray(img).astype(np.float64)
            top = 65535.0 if mode.startswith("I;16") or a.max(initial=0) > 255 else 255.0
            a = np.clip(np.rint(a * (255.0 / top)), 0, 255).astype(np.uint8)
            return Image.fromarray(a, "L").convert("RGB")
        if mode == "F":
            a = np.asarray(img, dtype=np.float64)
            a = a * 255.0 if a.max(initial=0) <= 1.0 else a
            return Image.fromarray(np.clip(np.rint(a), 0, 255).astype(np.uint8), "L").convert("RGB")
        return img.convert("RGB")  # YCbCr, HSV, LAB (without profile), ...
    except Exception as e:
        raise BadImageError("unsupported mode", f"{mode}: {_msg(e)}") from None


def decode_rgb(
    data: bytes, *, max_pixels: int = DEFAULT_MAX_PIXELS, draft: tuple[int, int] | None = None
) -> Image.Image:
    """Bytes of any image file -> a loaded, upright, 8-bit RGB PIL image, or BadImageError.

    This is what every reader of image shards should use: it handles whatever
    img2dataset or a folder packer stored (JPEG, PNG, WebP; greyscale, RGBA, CMYK)."""
    return to_rgb(load(open_image(data, max_pixels=max_pixels), draft=draft))


def target_size(size: tuple[int, int], image_size: int, mode: str) -> tuple[int, int]:
    """The (width, height) an image of `size` is scaled to before any crop or padding."""
    w, h = size
    if mode == "no":
        return w, h
    if mode in ("keep_ratio", "center_crop"):
        s = image_size / min(w, h)
    elif mode in ("border", "keep_ratio_largest"):
        s = image_size / max(w, h)
    else:
        raise ValueError(f"unknown resize mode {mode!r}; expected one of {', '.join(RESIZE_MODES)}")
    return max(1, round(w * s)), max(1, round(h * s))


def draft_size(size: tuple[int, int], image_size: int | None, mode: str) -> tuple[int, int] | None:
    """The smallest decoded size that still allows `resize_image` without upscaling."""
    if image_size is None or mode == "no":
        return None
    tw, th = target_size(size, image_size, mode)
    if tw >= size[0]:
        return None
    return math.ceil(tw), math.ceil(th)


def resize_image(img: Image.Image, image_size: int | None, mode: str) -> Image.Image:
    """Apply an img2dataset-named resize mode (module docstring) with bicubic
    resampling; large reductions first box-reduce by an integer factor (Pillow's
    reducing_gap), as the ADM/DiT ImageNet preprocessing does."""
    if image_size is None or mode == "no":
        return img
    tw, th = target_size(img.size, image_size, mode)
    if (tw, th) != img.size:
        img = img.resize((tw, th), Image.Resampling.BICUBIC, reducing_gap=2.0)
    if mode == "center_crop":
        left, top = (tw - image_size) // 2, (th - image_size) // 2
        img = img.crop((left, top, left + image_size, top + image_size))
    elif mode == "border":
        canvas = Image.new("RGB", (image_size, image_size), _WHITE)
        canvas.paste(img, ((image_size - tw) // 2, (image_size - th) // 2))
        img = canvas
    return img


def encode_image(img: Image.Image, fmt: str = "jpg", quality: int = 95) -> bytes:
    """RGB image -> file bytes. `fmt` is a shard extension: jpg, png or webp. For png,
    `quality` is ignored (lossless, default compression)."""
    buf = io.BytesIO()
    pil_format = FORMAT_BY_EXT[fmt]
    if pil_format == "JPEG":
        img.save(buf, "JPEG", quality=quality, subsampling=0 if quality >= 90 else 2)
    elif pil_format == "WEBP":
        img.save(buf, "WEBP", quality=quality, method=4)
    else:
        img.save(buf, "PNG")
    return buf.getvalue()


def _on_white(rgba: Image.Image) -> Image.Image:
    canvas = Image.new("RGB", rgba.size, _WHITE)
    canvas.paste(rgba, mask=rgba.getchannel("A"))
    return canvas


def _cmyk_to_rgb(img: Image.Image) -> Image.Image:
    icc = img.info.get("icc_profile")
    if icc:
        try:
            from PIL import ImageCms

            src = ImageCms.ImageCmsProfile(io.BytesIO(icc))
            dst = ImageCms.createProfile("sRGB")
            out = ImageCms.profileToProfile(img, src, dst, outputMode="RGB")
            if out is not None:
                return out
        except Exception:
            pass  # a broken profile: fall back to the plain conversion
    return img.convert("RGB")


def _msg(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text if len(text) <= 200 else text[:197] + "..."

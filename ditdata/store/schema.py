"""What a store holds per sample: tensor fields (fixed shape arrays) and scalar columns.

Tensor fields have standard names so that dittrain can find them:

    latent, latent_flip            one frozen posterior sample (and its flipped-image twin)
    latent_scale, latent_flip_scale (h, w) float32, only beside int8 latents: a scale per token
    mean, std, mean_flip, std_flip posterior parameters, so training draws a fresh sample
    text_pooled                    (D,)   pooled text embedding of the caption
    text_tokens, text_mask         (L, D) token embeddings and their (L,) validity mask (padded:
                                   open_clip encoders, every caption at the context length L)

RAGGED fields hold a different number of tokens per sample (unpadded text embeddings of the
transformers text encoders, ditdata.textencoders). Schema.ragged names them with their
per-token shape; each has a LENGTH field, an ordinary (n,) int32 tensor field, that says how
many of its tokens each sample has:

    text_tokens       ragged (W,)  float16/bfloat16, or int8 with
    text_tokens_scale ragged ()    float32, a scale per token (the int8 rule below)
    text_length       ()   int32   the caption's token count (>= 1, <= the encoder's max tokens)

A shard holds a ragged field as ONE array of all its samples' tokens, sample after sample
(sample i's are rows offsets[i]:offsets[i] + length[i], offsets the running sum of the
lengths); a writer takes and a reader returns that layout for any row range (ragged_rows,
pad_ragged below). Each further caption set NAME of a store (`ditdata encode --captions
alt,NAME,...`) is another ragged group with its own length field (text_tokens.NAME,
text_tokens_scale.NAME, text_length.NAME: RaggedSpec.length says which; captions.py lists them).
An int8 ragged field's scales are its name with "_scale" before any ".NAME" (scale_field).

A feature set (features.py) has a schema of its own, FeatureSchema: `feat` (T, D) per
sample (and `feat_scale` (T,) when int8; `feat_flip`, `feat_flip_scale` with flips).

Columns are one scalar per sample: `key` (always), `label`, `caption` and any extra
column from the source (clip_score, width, height, url, ...).

int8 fields (latents, a feature set's feat) are symmetric per token: a token's values x (a
latent's C channels at one position, a feature's D dims) are stored as q = round(x / s) in
[-127, 127] with s = max |x| / 127 (1 for an all-zero token) in the field's `_scale`;
x ~= q * s, within s / 2. quantize() and dequantize() below are the definition, shared by
the producers, verify and the trainer, which multiplies on its own device (the same float32
product, so the same bits).

bfloat16 has no NumPy dtype of its own; ml_dtypes provides one, and on disk the values
are kept as their uint16 bit patterns (npy and zarr know nothing of bfloat16).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from .errors import StoreError

LATENT_FIELDS = ("latent", "latent_flip", "mean", "std", "mean_flip", "std_flip")
TEXT_FIELDS = ("text_pooled", "text_tokens", "text_mask")
# The unpadded text fields (ragged) and the length field of the default caption set.
TEXT_RAGGED = ("text_tokens", "text_tokens_scale")
TEXT_LENGTH = "text_length"
TENSOR_DTYPES = ("float16", "bfloat16", "float32", "bool", "uint8", "int8", "int32", "int64")
COLUMN_TYPES = ("string", "int64", "float64", "bool")

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

# The fields made of tokens, and the axis of a sample's array that holds one token's values:
# a latent (C, H, W) has a token per position (its C channels), a feature set's feat (T, D)
# one per row (its D dims). A token exactly zero in every one of them is suspect (verify).
TOKEN_AXES = {"latent": 0, "latent_flip": 0, "mean": 0, "mean_flip": 0, "feat": 1, "feat_flip": 1}
# The latent fields that may be stored int8, and the field of their per-token scales.
LATENT_SCALES = {"latent": "latent_scale", "latent_flip": "latent_flip_scale"}


def scale_field(name: str) -> str:
    """The field of an int8 field's per-token scales: "_scale" added to its name, before the
    ".NAME" of a further caption set (text_tokens -> text_tokens_scale, text_tokens.recap ->
    text_tokens_scale.recap)."""
    base, dot, suffix = name.partition(".")
    return f"{base}_scale{dot}{suffix}"


def is_scale_field(name: str) -> bool:
    """Whether `name` is an int8 field's per-token scales (scale_field's names)."""
    return name.partition(".")[0].endswith("_scale")


def quantize(x: np.ndarray, axis: int = -1) -> tuple[np.ndarray, np.ndarray]:
    """float array -> (int8 codes of its shape, float32 scale without `axis`): symmetric per
    token, a token being the values along `axis` (the module docstring). StoreError on NaN or
    inf: int8 has no code for them (NaN would round to 0, silently)."""
    x = np.asarray(x, dtype=np.float32)
    finite = np.isfinite(x)
    if not finite.all():
        nan = int(np.isnan(x).sum())
        raise StoreError(f"cannot quantize to int8: {nan} NaN and {x.size - int(finite.sum()) - nan} "
                         f"inf value(s) of {x.size}; int8 cannot store them")
    peak = np.abs(x).max(axis=axis)
    scale = np.where(peak > 0, peak / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(x / np.expand_dims(scale, axis)), -127, 127).astype(np.int8)
    return q, scale


def dequantize(q: np.ndarray, scale: np.ndarray | None, axis: int = -1) -> np.ndarray:
    """The float32 values an int8 array (with its scale, tokens along `axis`) or a float
    array (scale None) stands for."""
    if scale is None:
        return np.asarray(q, dtype=np.float32)
    return q.astype(np.float32) * np.expand_dims(np.asarray(scale, dtype=np.float32), axis)


def values(data: dict[str, np.ndarray], field: str) -> np.ndarray:
    """The float32 values of `field` in a read() result of n samples: dequantized with its
    `_scale` when there is one (int8), else as stored."""
    scale = data.get(f"{field}_scale")
    if scale is None:
        return np.asarray(data[field], dtype=np.float32)
    return dequantize(data[field], scale, axis=1 + TOKEN_AXES[field])


@dataclass(frozen=True)
class _ArraySpec:
    """What TensorSpec and RaggedSpec share: a shape, normalised to a tuple of ints, and a
    storage dtype checked against TENSOR_DTYPES."""

    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self):
        if self.dtype not in TENSOR_DTYPES:
            raise ValueError(f"unsupported tensor dtype {self.dtype!r}; use one of {TENSOR_DTYPES}")
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))


@dataclass(frozen=True)
class TensorSpec(_ArraySpec):
    """One per-sample array: its shape (without the sample axis) and storage dtype."""

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_json(cls, d: dict) -> TensorSpec:
        return cls(tuple(d["shape"]), d["dtype"])


@dataclass(frozen=True)
class RaggedSpec(_ArraySpec):
    """One ragged field: the shape of ONE token (without the token axis), its storage dtype,
    and the (n,) int32 tensor field that holds each sample's token count."""

    length: str

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "dtype": self.dtype, "length": self.length}

    @classmethod
    def from_json(cls, d: dict) -> RaggedSpec:
        return cls(tuple(d["shape"]), d["dtype"], d["length"])


def offsets_of(lengths: np.ndarray) -> np.ndarray:
    """(n + 1,) int64 running sum of (n,) lengths: sample i's tokens are rows offsets[i]:offsets[i + 1]."""
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(np.asarray(lengths, dtype=np.int64), out=out[1:])
    return out


def ragged_rows(flat: np.ndarray, lengths: np.ndarray, rows) -> np.ndarray:
    """The tokens of samples `rows` (any order) of a ragged array `flat` with per-sample
    `lengths`, sample after sample (their lengths are lengths[rows])."""
    lengths = np.asarray(lengths, dtype=np.int64)
    rows = np.asarray(rows, dtype=np.int64)
    off = offsets_of(lengths)
    take = lengths[rows]
    if len(rows) and (rows == np.arange(rows[0], rows[0] + len(rows))).all():  # a run: one slice
        return flat[off[rows[0]]:off[rows[-1] + 1]]
    idx = np.repeat(off[rows] - offsets_of(take)[:-1], take) + np.arange(int(take.sum()))
    return flat[idx]


def pad_ragged(flat: np.ndarray, lengths: np.ndarray, length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(n, L, *token) zero-padded array and (n, L) bool mask (True = a real token) of a ragged
    array; L = `length` (at least the longest sample's), else the longest sample's."""
    lengths = np.asarray(lengths, dtype=np.int64)
    longest = int(lengths.max(initial=0))
    L = longest if length is None else int(length)
    if L < longest:
        raise ValueError(f"pad_ragged: length {L} is shorter than the longest sample ({longest})")
    mask = np.arange(L)[None, :] < lengths[:, None]
    out = np.zeros((len(lengths), L, *flat.shape[1:]), dtype=flat.dtype)
    out[mask] = flat[:int(lengths.sum())]
    return out, mask


def numpy_dtype(name: str) -> np.dtype:
    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


def disk_dtype(name: str) -> np.dtype:
    """The dtype written to disk: bfloat16 travels as its uint16 bits."""
    return np.dtype(np.uint16) if name == "bfloat16" else np.dtype(name)


def to_disk(arr: np.ndarray, name: str) -> np.ndarray:
    return arr.view(np.uint16) if name == "bfloat16" else arr


def from_disk(arr: np.ndarray, name: str) -> np.ndarray:
    return arr.view(BFLOAT16) if name == "bfloat16" else arr


def dtype_name(arr: np.ndarray) -> str:
    return "bfloat16" if arr.dtype == BFLOAT16 else arr.dtype.name


@dataclass(frozen=True)
class Schema:
    """The fields of every sample in a store; shared by the writer, the reader and verify."""

    tensors: dict[str, TensorSpec]
    columns: dict[str, str]
    ragged: dict[str, RaggedSpec] = field(default_factory=dict)

    def __post_init__(self):
        self._check_ragged()
        if "key" not in self.columns or self.columns["key"] != "string":
            raise ValueError("a store schema needs a 'key' column of type 'string'")
        for name, kind in self.columns.items():
            if kind not in COLUMN_TYPES:
                raise ValueError(f"column {name!r}: unsupported type {kind!r}; use one of {COLUMN_TYPES}")
        overlap = set(self.tensors) & set(self.columns)
        if overlap:
            raise ValueError(f"names used both as tensor and column: {sorted(overlap)}")
        if self.latent_kind() is None:
            raise ValueError("a store schema needs 'latent', or 'mean' and 'std'")
        self._check_int8_latents()

    def _check_int8_latents(self) -> None:
        """int8 latents come with their per-token scales (h, w) float32; only one frozen sample
        per image may be int8 (mean and std are not quantized)."""
        for name, scale_name in LATENT_SCALES.items():
            spec, scale = self.tensors.get(name), self.tensors.get(scale_name)
            if spec is not None and spec.dtype == "int8":
                want = TensorSpec(spec.shape[1:], "float32")
                if scale != want:
                    raise ValueError(f"int8 {name} {list(spec.shape)} needs {scale_name} float32{list(want.shape)}, "
                                     f"got {scale and scale.to_json()}")
            elif scale is not None:
                raise ValueError(f"{scale_name} is only stored beside an int8 {name}")
        wide = [n for n in ("mean", "std", "mean_flip", "std_flip") if n in self.tensors
                and self.tensors[n].dtype == "int8"]
        if wide:
            raise ValueError(f"{wide} cannot be int8: int8 stores one latent per image ('latent'), not mean and std")

    def _check_ragged(self) -> None:
        """Each ragged field's length field is an (n,) int32 tensor field; an int8 ragged field
        comes with its per-token float32 `_scale` (ragged, the same length field)."""
        for name, spec in self.ragged.items():
            if name in self.tensors or name in self.columns:
                raise ValueError(f"{name!r} is both a ragged field and a tensor or column")
            if self.tensors.get(spec.length) != TensorSpec((), "int32"):
                raise ValueError(f"ragged field {name!r} needs its length field {spec.length!r} int32[]")
            if spec.dtype == "int8":
                want = RaggedSpec(spec.shape[:-1], "float32", spec.length)
                if self.ragged.get(scale_field(name)) != want:
                    raise ValueError(f"int8 {name} needs {scale_field(name)} {want.to_json()}")

    @property
    def lengths(self) -> dict[str, str]:
        """{ragged field: its length field}."""
        return {k: v.length for k, v in self.ragged.items()}

    def latent_kind(self) -> str | None:
        if "latent" in self.tensors:
            return "sample"
        if "mean" in self.tensors and "std" in self.tensors:
            return "mean_std"
        return None

    @property
    def primary(self) -> str:
        """The field whose per-channel statistics describe the latents."""
        return "latent" if self.latent_kind() == "sample" else "mean"

    @property
    def flip(self) -> bool:
        return f"{self.primary}_flip" in self.tensors

    @property
    def token_axes(self) -> dict[str, int]:
        """{field: the axis of its per-sample array that holds a token's values} of the
        fields it has that are made of tokens (TOKEN_AXES: latents, feat; not std nor text)."""
        return {f: axis for f, axis in TOKEN_AXES.items() if f in self.tensors}

    def to_json(self) -> dict:
        out = {
            "tensors": {k: v.to_json() for k, v in self.tensors.items()},
            "columns": dict(self.columns),
        }
        if self.ragged:  # absent in stores without ragged fields: their config is as before
            out["ragged"] = {k: v.to_json() for k, v in self.ragged.items()}
        return out

    @classmethod
    def from_json(cls, d: dict) -> Schema:
        return cls(
            tensors={k: TensorSpec.from_json(v) for k, v in d["tensors"].items()},
            columns=dict(d["columns"]),
            ragged={k: RaggedSpec.from_json(v) for k, v in (d.get("ragged") or {}).items()},
        )


FEATURE_FIELDS = ("feat", "feat_scale", "feat_flip", "feat_flip_scale")


@dataclass(frozen=True)
class FeatureSchema(Schema):
    """The fields of a feature set's samples: `feat` (T tokens, D dims) in int8 or float16,
    its per-token `feat_scale` (T,) float32 when int8 (x ~= feat * feat_scale[:, None]),
    the same for the flipped image (`feat_flip`, `feat_flip_scale`), and the `key` column
    that matches each row to the store's row."""

    def __post_init__(self):
        if set(self.columns) != {"key"} or self.columns["key"] != "string":
            raise ValueError("a feature set has exactly one column, 'key' (string)")
        if "feat" not in self.tensors or set(self.tensors) - set(FEATURE_FIELDS):
            raise ValueError(f"a feature set holds 'feat' and optionally {FEATURE_FIELDS[1:]}, got {sorted(self.tensors)}")
        feat = self.tensors["feat"]
        if len(feat.shape) != 2 or feat.dtype not in ("int8", "float16", "float32"):
            raise ValueError(f"feat must be (tokens, dims) int8/float16/float32, got {feat.dtype}{list(feat.shape)}")
        want = {"feat"} | ({"feat_scale"} if feat.dtype == "int8" else set())
        if self.flip:
            want |= {f.replace("feat", "feat_flip") for f in want}
        if set(self.tensors) != want:
            raise ValueError(f"a feature set of {feat.dtype} holds {sorted(want)}, got {sorted(self.tensors)}")
        for name, spec in self.tensors.items():
            ok = (spec == feat) if not name.endswith("scale") else spec == TensorSpec(feat.shape[:1], "float32")
            if not ok:
                raise ValueError(f"{name} is {spec.dtype}{list(spec.shape)}: it does not match feat")

    @classmethod
    def build(cls, tokens: int, dims: int, dtype: str, flip: bool) -> FeatureSchema:
        base = {"feat": TensorSpec((tokens, dims), dtype)}
        if dtype == "int8":
            base["feat_scale"] = TensorSpec((tokens,), "float32")
        tensors = dict(base)
        if flip:
            tensors |= {k.replace("feat", "feat_flip"): v for k, v in base.items()}
        return cls(tensors=tensors, columns={"key": "string"})

    def latent_kind(self) -> str | None:
        return None

    @property
    def primary(self) -> str:
        return "feat"

    @property
    def flip(self) -> bool:
        return "feat_flip" in self.tensors

    @property
    def tokens(self) -> int:
        return self.tensors["feat"].shape[0]

    @property
    def dims(self) -> int:
        return self.tensors["feat"].shape[1]

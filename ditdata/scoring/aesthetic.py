"""The LAION aesthetic predictor: a small head on L2-normalised CLIP image embeddings that
predicts how much people like an image (about 1..10), loaded offline from a local
state-dict file. The project never ships its weights.

Two published heads, told apart by their keys (the architecture is read from the file,
never assumed):

- the "improved aesthetic predictor" (christophschuhmann/improved-aesthetic-predictor,
  e.g. sac+logos+ava1-l14-linearMSE.pth): linear layers 768 -> 1024 -> 128 -> 64 -> 16 -> 1
  stored as layers.0, layers.2, layers.4, layers.6, layers.7 (.weight, .bias); the odd
  indices between them are dropouts (inert at inference) and there is NO activation
  between the layers in the published model, so the head is a chain of affine maps;
- the plain linear head (LAION-AI/aesthetic-predictor, e.g. sa_0_4_vit_l_14_linear.pth):
  one nn.Linear(768, 1), keys weight and bias.

The "reluMSE" variants of the improved predictor put a ReLU between the layers, which the
keys do not show: their scores would be wrong here (use the linearMSE files).

Any chain of linear layers `P.N.weight` / `P.N.bias` ordered by N, each layer's input the
previous one's output and the last one's output 1, is accepted the same way; a file with
other tensors (norms, activations with weights) is refused, naming the first odd key. The
input width must be the CLIP model's embedding width (768 for ViT-L/14): anything else
is refused before scoring, naming both.

    pred = load_predictor("sac+logos+ava1-l14-linearMSE.pth")
    pred.in_dim, pred.widths, pred.sha256
    pred(embeddings)        # (B, D) L2-normalised float32 -> (B,) float32 scores
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ditdata.common.usercode import check_weights
from ditdata.errors import DitdataError

_LAYER_RE = re.compile(r"^(?:(?P<prefix>.*?)\.)?(?:(?P<index>\d+)\.)?(?P<param>weight|bias)$")


@dataclass
class AestheticPredictor:
    """A chain of affine layers [(W (out, in), b (out,)), ...] ending in one output."""

    path: str
    sha256: str
    layers: list

    @property
    def widths(self) -> list[int]:
        """[in, hidden..., 1]: e.g. [768, 1024, 128, 64, 16, 1]."""
        return [int(self.layers[0][0].shape[1])] + [int(w.shape[0]) for w, _ in self.layers]

    @property
    def in_dim(self) -> int:
        return self.widths[0]

    @property
    def kind(self) -> str:
        return "linear" if len(self.layers) == 1 else "mlp"

    def describe(self) -> str:
        return f"{self.kind} {'-'.join(map(str, self.widths))}"

    def record(self) -> dict:
        """What a score file records about the predictor."""
        return {"file": self.path, "sha256": self.sha256, "kind": self.kind, "widths": self.widths}

    def check_width(self, clip_info: dict) -> None:
        """Refuse a predictor whose input is not the CLIP model's embedding width."""
        dim = int(clip_info["embed_dim"])
        if dim != self.in_dim:
            raise DitdataError(
                f"aesthetic predictor {self.path} takes {self.in_dim}-wide embeddings but CLIP "
                f"{clip_info['model']} gives {dim}-wide ones; use the predictor made for this CLIP model "
                f"(the LAION ones are for ViT-L-14, 768)"
            )

    def __call__(self, embeddings):
        """(B, in_dim) L2-normalised embeddings (torch or numpy) -> (B,) float32 torch scores."""
        import torch

        y = torch.as_tensor(embeddings, dtype=torch.float32)
        for w, b in self.layers:  # no activation: the published head has none (module docstring)
            y = torch.addmm(b, y, w.T)
        return y[:, 0]


def _state_dict(path: Path) -> dict:
    """The tensors of a .pth/.pt/.bin (torch.save, weights only) or .safetensors file; a
    checkpoint holding {"state_dict": ...} is unwrapped."""
    import torch

    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            sd = load_file(str(path))
        else:
            sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        from ditdata.common.errors import described

        raise DitdataError(f"aesthetic predictor {path}: unreadable weights file ({described(e)})") from None
    if isinstance(sd, dict) and isinstance(sd.get("state_dict"), dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict) or not sd or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise DitdataError(f"aesthetic predictor {path}: not a state dict of tensors")
    return sd


def layers_from_state_dict(sd: dict, where: str = "state dict") -> list:
    """[(W, b), ...] in layer order from the keys (module docstring), or DitdataError."""
    layers: dict[tuple, dict] = {}
    for key, t in sd.items():
        m = _LAYER_RE.match(key)
        if m is None:
            raise DitdataError(f"aesthetic predictor {where}: unexpected key {key!r} (expected linear layers "
                               "P.N.weight / P.N.bias, or weight / bias)")
        layer = (m["prefix"] or "", int(m["index"]) if m["index"] is not None else -1)
        layers.setdefault(layer, {})[m["param"]] = t
    if len({prefix for prefix, _ in layers}) > 1:
        raise DitdataError(f"aesthetic predictor {where}: layers under several prefixes "
                           f"({', '.join(sorted({p for p, _ in layers}))}); expected one chain")
    chain = []
    for (prefix, index), params in sorted(layers.items(), key=lambda kv: kv[0][1]):
        name = ".".join(x for x in (prefix, str(index) if index >= 0 else "") if x)
        w, b = params.get("weight"), params.get("bias")
        if w is None or b is None or w.ndim != 2 or b.shape != (w.shape[0],):
            raise DitdataError(f"aesthetic predictor {where}: layer {name or '(top)'} is not a linear layer "
                               "(2-D weight and a bias of its output width)")
        if chain and chain[-1][0].shape[0] != w.shape[1]:
            raise DitdataError(f"aesthetic predictor {where}: layer {name} takes {w.shape[1]} inputs but the "
                               f"layer before gives {chain[-1][0].shape[0]}")
        chain.append((w.float(), b.float()))
    if chain[-1][0].shape[0] != 1:
        raise DitdataError(f"aesthetic predictor {where}: the last layer gives {chain[-1][0].shape[0]} outputs, "
                           "not one score")
    return chain


def load_predictor(path) -> AestheticPredictor:
    """The predictor of a local weights file (module docstring); nothing is downloaded."""
    from ditdata.clip import weights_sha256

    p = Path(path).expanduser()
    if not p.is_file():
        raise DitdataError(
            f"aesthetic predictor {p} not found: download it on a machine with internet (e.g. "
            "sac+logos+ava1-l14-linearMSE.pth from github.com/christophschuhmann/improved-aesthetic-predictor) "
            "and pass its local path"
        )
    p = p.resolve()
    sd = _state_dict(p)
    check_weights(sd, f"aesthetic predictor {p}")  # NaN weights would score every image NaN
    return AestheticPredictor(path=str(p), sha256=weights_sha256(p), layers=layers_from_state_dict(sd, str(p)))

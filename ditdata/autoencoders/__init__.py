"""Autoencoders: the presets and one adapter per kind, for encoding and decoding.

    kinds.py    the table of kinds (diffusers AutoencoderKL, TAEF2, pixels), load_autoencoder,
                the manifest's "vae" entry and the autoencoder a store was made with
    presets.py  the named presets (sd-vae-ft-ema, flux-vae, vavae-f16d32, taef2, pixels, ...); no torch
    ldm.py      LDM-format (CompVis) single-file KL checkpoints made into a diffusers AutoencoderKL
    taef2.py    TAEF2, the tiny FLUX.2 autoencoder, written from its architecture facts

    from ditdata.autoencoders import load_autoencoder
    ae = load_autoencoder("sd-vae-ft-ema")        # offline: the local HF cache, or a clear error

Names are imported on first use: importing the package costs nothing.
"""

from __future__ import annotations

from ditdata.common.lazy import lazy_exports

_EXPORTS = {name: "kinds" for name in ("Autoencoder", "KINDS", "PRESETS", "autoencoder_from_manifest",
                                       "load_autoencoder", "store_autoencoder", "quiet_third_party_imports")}
__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS, globals())

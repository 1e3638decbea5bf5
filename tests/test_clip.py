"""ditdata/clip.py: open_clip loaded offline through its real path, text/image embeddings."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

open_clip = pytest.importorskip("open_clip")
torch = pytest.importorskip("torch")

from ditdata.clip import load_clip, register_config  # noqa: E402
from ditdata.errors import DitdataError  # noqa: E402

TINY_CFG = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}
CAPTIONS = ["an astronaut in a white suit", "a cat! sitting", "", "x " * 200]


def tiny_clip_files(folder: Path, *, name: str = "tiny-clip", seed: int = 0, custom_text: bool = False,
                    text_width: int = 32):
    """A tiny open_clip architecture (config JSON; its text tower `text_width` wide) and random
    weights saved with torch.save(state_dict): (config path, weights path)."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(TINY_CFG, text_cfg=dict(TINY_CFG["text_cfg"], width=text_width))
    if custom_text:
        cfg["custom_text"] = True
    config = folder / f"{name}.json"
    config.write_text(json.dumps(cfg))
    register_config(config)
    torch.manual_seed(seed)
    model = open_clip.create_model(name)
    weights = folder / f"{name}-seed{seed}.pt"
    torch.save(model.state_dict(), weights)
    return config, weights


def tiny_clip_conditioning(folder: Path, *, name: str, text_width: int) -> tuple[dict, Path]:
    """A store's text conditioning by a tiny_clip_files model (pooled 32, tokens 77 x `text_width`),
    its empty caption embedded by it: (conditioning, weights path)."""
    import numpy as np

    from ditdata.store import encode_array

    config, weights = tiny_clip_files(folder, name=name, text_width=text_width)
    empty = load_clip(name, str(weights), config=str(config)).embed_text([""], tokens=True)
    text = {"model": name, "pretrained": str(weights), "config": str(config), "encoder": name,
            "pooled_dim": TINY_CFG["embed_dim"], "tokens_shape": [77, text_width],
            "empty": {k: encode_array(v[0].numpy().astype(bool if k == "text_mask" else np.float16))
                      for k, v in empty.items()}}
    return {"type": "text", "text": text}, weights


def real_pil_images():
    from PIL import Image
    from skimage import data

    return [Image.fromarray(a) for a in (data.astronaut(), data.chelsea(), data.coffee(), data.rocket())]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_clip_files(tmp_path_factory.mktemp("clip"))


def reference(name: str, weights: Path):
    model, _, preprocess = open_clip.create_model_and_transforms(name, pretrained=str(weights))
    return model.eval(), preprocess, open_clip.get_tokenizer(name)


def test_file_weights_match_open_clip(tiny):
    config, weights = tiny
    clip = load_clip("tiny-clip", str(weights), config=str(config))
    assert clip.info["model"] == "tiny-clip"
    assert clip.info["pretrained"] == str(weights.resolve())
    assert clip.info["weights_sha256"] and len(clip.info["weights_sha256"]) == 64
    assert (clip.info["embed_dim"], clip.info["context_length"], clip.info["token_dim"]) == (32, 77, 32)

    ref, preprocess, tok = reference("tiny-clip", weights)
    images = real_pil_images()
    with torch.no_grad():
        ri = ref.encode_image(torch.stack([preprocess(im) for im in images]), normalize=True)
        rt = ref.encode_text(tok(CAPTIONS), normalize=True)
        rt_raw = ref.encode_text(tok(CAPTIONS))
    # the batched ToTensor + Normalize gives bit-identical pixels to open_clip's transform
    assert clip._pil_part is not None
    assert torch.equal(clip.preprocess_images(images), torch.stack([preprocess(im) for im in images]))
    odd = images[0].resize((33, 71))
    assert torch.equal(clip.pixels([clip.prepare_image(odd)])[0], preprocess(odd))
    torch.testing.assert_close(clip.embed_images(images), ri, rtol=0, atol=1e-6)
    generic = load_clip("tiny-clip", str(weights))
    generic._pil_part = None  # a transform that is not [..., ToTensor, Normalize]: whole preprocess per image
    assert isinstance(generic.prepare_image(odd), torch.Tensor)
    assert torch.equal(generic.preprocess_images(images), clip.preprocess_images(images))
    torch.testing.assert_close(clip.embed_text(CAPTIONS)["text_pooled"], rt_raw, rtol=0, atol=1e-6)
    torch.testing.assert_close(clip.embed_text(CAPTIONS, normalize=True)["text_pooled"], rt, rtol=0, atol=1e-6)
    torch.testing.assert_close(clip.score(images, CAPTIONS), (ri * rt).sum(-1), rtol=0, atol=1e-6)
    # deterministic: the same inputs give bit-identical outputs
    assert torch.equal(clip.score(images, CAPTIONS), clip.score(images, CAPTIONS))


@pytest.mark.parametrize("custom_text", [False, True], ids=["CLIP", "CustomTextCLIP"])
def test_embed_text_tokens_and_mask(tmp_path, custom_text):
    name = "tiny-clip-custom" if custom_text else "tiny-clip-plain"
    config, weights = tiny_clip_files(tmp_path, name=name, custom_text=custom_text)
    clip = load_clip(name, str(weights), config=str(config))
    assert type(clip.model).__name__ == ("CustomTextCLIP" if custom_text else "CLIP")
    out = clip.embed_text(CAPTIONS, tokens=True)
    assert out["text_pooled"].shape == (4, 32)
    assert out["text_tokens"].shape == (4, 77, 32) and out["text_tokens"].dtype == torch.float32
    assert out["text_mask"].shape == (4, 77) and out["text_mask"].dtype == torch.bool
    # start token + words + end token; "!" is token id 0 (= the pad id) but is a real token
    assert out["text_mask"].sum(1).tolist() == [2 + 6, 2 + 4, 2, 77]
    assert out["text_mask"][:, 0].all()

    ref, _, tok = reference(name, weights)
    ids = tok(CAPTIONS)
    with torch.no_grad():
        pooled = ref.encode_text(ids)
    torch.testing.assert_close(out["text_pooled"], pooled, rtol=0, atol=1e-6)
    # the pooled embedding is the projected token output at the end token
    eot = out["text_mask"].sum(1) - 1
    at_eot = out["text_tokens"][torch.arange(4), eot]
    proj = ref.text.text_projection if custom_text else ref.text_projection
    proj_out = proj(at_eot) if isinstance(proj, torch.nn.Linear) else at_eot @ proj
    torch.testing.assert_close(proj_out.detach(), pooled, rtol=0, atol=1e-5)
    # tokens=True does not change the pooled output and leaves the model as it was
    torch.testing.assert_close(clip.embed_text(CAPTIONS)["text_pooled"], out["text_pooled"], rtol=0, atol=0)
    if custom_text:
        assert clip.model.text.output_tokens is False


def test_missing_tag_fails_fast_and_says_how(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    t = time.perf_counter()
    with pytest.raises(DitdataError) as e:
        load_clip("ViT-B-32", "laion2b_s34b_b79k")
    assert time.perf_counter() - t < 10
    msg = str(e.value)
    assert "ViT-B-32" in msg and "laion2b_s34b_b79k" in msg
    assert "hf download laion/CLIP-ViT-B-32-laion2B-s34B-b79K" in msg
    assert "--pretrained /path/to/" in msg
    assert str(tmp_path / "hf" / "hub") in msg
    assert "\n" not in msg


def test_tag_resolved_from_local_hf_cache(tiny, tmp_path, monkeypatch):
    """A tag is looked up where open_clip would download it from: the HF cache."""
    config, weights = tiny
    register_config(config)
    hub = tmp_path / "hub"
    repo = hub / "models--test-org--tiny-clip"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (snap / "open_clip_pytorch_model.bin").write_bytes(weights.read_bytes())
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    tag_cfg = {"url": "", "hf_hub": "test-org/tiny-clip/", "mean": (0.5, 0.5, 0.5), "std": (0.25, 0.25, 0.25),
               "interpolation": "bilinear", "resize_mode": "squash"}
    monkeypatch.setitem(open_clip.pretrained._PRETRAINED, "tiny-clip", {"my_tag": tag_cfg})

    clip = load_clip("tiny-clip", "My-Tag", config=str(config))  # tags are normalised like open_clip's
    assert clip.info["pretrained"] == "my_tag"
    assert clip.info["weights_sha256"] == load_clip("tiny-clip", str(weights)).info["weights_sha256"]
    norm = [t for t in clip.preprocess.transforms if type(t).__name__ == "Normalize"][0]
    assert tuple(norm.mean) == (0.5, 0.5, 0.5) and tuple(norm.std) == (0.25, 0.25, 0.25)
    ref = load_clip("tiny-clip", str(weights))
    torch.testing.assert_close(clip.embed_text(CAPTIONS)["text_pooled"], ref.embed_text(CAPTIONS)["text_pooled"])

    # the same tag with an empty cache: a clear error naming the repo
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(DitdataError, match="hf download test-org/tiny-clip"):
        load_clip("tiny-clip", "my_tag")


def test_bad_names(tiny, tmp_path):
    config, weights = tiny
    with pytest.raises(DitdataError, match="unknown open_clip model"):
        load_clip("no-such-model", None)
    with pytest.raises(DitdataError, match="neither a pretrained tag of ViT-B-32"):
        load_clip("ViT-B-32", "not_a_tag")
    with pytest.raises(DitdataError, match="not found"):
        load_clip("tiny-clip", str(tmp_path / "missing.pt"), config=str(config))
    with pytest.raises(DitdataError, match="does not match the config file"):
        load_clip("ViT-B-32", str(weights), config=str(config))
    with pytest.raises(DitdataError, match="not supported offline"):
        load_clip("hf-hub:laion/CLIP-ViT-B-32-laion2B-s34B-b79K", None)
    bad = tmp_path / "bad.json"
    bad.write_text('{"embed_dim": 8}')
    with pytest.raises(DitdataError, match="not an open_clip model config"):
        load_clip(None, None, config=str(bad))
    with pytest.raises(DitdataError, match="cannot build CLIP model"):  # wrong architecture
        wrong = tmp_path / "other.pt"
        torch.save({"nothing": torch.zeros(1)}, wrong)
        load_clip("tiny-clip", str(wrong))

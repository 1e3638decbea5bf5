"""Transformers text encoders (ditdata.textencoders) and unpadded text tokens in the store and
the loaders: tiny random T5EncoderModel / Gemma2Model with offline word-level tokenizers,
saved with save_pretrained and loaded through the real path.

- the embeddings equal diffusers' PixArtAlphaPipeline.encode_prompt (T5) and
  SanaPipeline.encode_prompt (Gemma-2, SANA's instruction and token selection) on the same
  weights at every real token, the empty prompt too;
- `ditdata encode --text-encoder DIR` stores them unpadded (zarr and wds, fp16 and int8):
  values within fp16 rounding / half an int8 step of the encoder's, lengths, manifest,
  verify (and its faults), inspect;
- the loaders' batches are (B, L_batch, W) with L_batch the batch's longest caption, the mask
  right, values to the bit, exact resume;
- a tiny DiT trains on a T5 store, resumes after SIGKILL to the same losses, and
  `dittrain sample --prompt` embeds with the store's encoder;
- `encode --captions SET` embeds a caption set instead of the alt text.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from cliutil import ditdata, dittrain, resume_after_sigkill
from textenc_util import encode_with, save_text_encoder

from ditdata.errors import DitdataError
from ditdata.store import open_store
from ditdata.store.schema import dequantize, ragged_rows
from ditdata.textencoders import SANA_INSTRUCTION, load_text_encoder
from dittrain.data import ResidentLoader, StreamingLoader

CAPTIONS = ["a photo of the cat on the mat", "a dog", "blue house in a busy city street with many people", ""]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("textenc")
    return {k: save_text_encoder(root / k, k) for k in ("t5", "gemma2")}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from test_score import caption_shards

    return caption_shards(tmp_path_factory.mktemp("caps") / "shards")


def _padded_reference(kind: str, folder: Path, captions: list[str]):
    """diffusers' encode_prompt on the same weights: (embeds, mask, negative embeds, negative mask)."""
    from diffusers import PixArtAlphaPipeline, SanaPipeline
    from transformers import AutoTokenizer, Gemma2Model, T5EncoderModel

    tok = AutoTokenizer.from_pretrained(folder)
    if kind == "t5":
        pipe = PixArtAlphaPipeline(tokenizer=tok, text_encoder=T5EncoderModel.from_pretrained(folder), vae=None,
                                   transformer=None, scheduler=None)
        return pipe.encode_prompt(captions, do_classifier_free_guidance=True, device="cpu", clean_caption=False,
                                  max_sequence_length=120)
    pipe = SanaPipeline(tokenizer=tok, text_encoder=Gemma2Model.from_pretrained(folder), vae=None, transformer=None,
                        scheduler=None)
    return pipe.encode_prompt(captions, do_classifier_free_guidance=True, device="cpu", clean_caption=False,
                              max_sequence_length=300, complex_human_instruction=list(SANA_INSTRUCTION))


@pytest.mark.parametrize("kind", ["t5", "gemma2"])
def test_embeddings_equal_diffusers_encode_prompt(folders, kind):
    """Ours, unpadded, equals the reference pipeline's padded output at its real tokens (the same
    count of them), and the stored empty prompt equals its negative prompt's embedding."""
    enc = load_text_encoder(str(folders[kind]))
    caps = [c for c in CAPTIONS if c]  # diffusers lower-cases prompts; these are lower-case already
    pe, pm, ne, nm = _padded_reference(kind, folders[kind], caps)
    ours = enc.embed_text(caps)
    mask = ours["text_mask"]
    assert mask.sum(1).tolist() == pm.sum(1).tolist()
    L = mask.shape[1]
    assert not pm[:, L:].any()  # the reference's real tokens all lie within our L (right padding)
    torch.testing.assert_close(ours["text_tokens"][mask], pe[:, :L][mask].detach(), atol=1e-5, rtol=1e-5)
    assert (ours["text_tokens"][~mask] == 0).all()
    flat, lengths = enc.empty_caption()
    assert lengths.tolist() == [1] == nm.sum(1)[:1].tolist()  # </s> alone (T5), <bos> alone (Gemma, no instruction)
    torch.testing.assert_close(flat, ne[0, :1].detach(), atol=1e-5, rtol=1e-5)
    assert enc.info["max_tokens"] == (120 if kind == "t5" else 300)


def test_max_tokens_truncate_and_missing_hub_model_is_one_line(folders, tmp_path, monkeypatch):
    enc = load_text_encoder(str(folders["t5"]), max_tokens=3)
    _, lengths = enc.embed_ragged(CAPTIONS[:3])
    assert lengths.tolist() == [3, 3, 3]  # cut, keeping </s> (tokenizer truncation)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(DitdataError) as e:
        load_text_encoder("t5-v1_1-xxl")
    msg = str(e.value)
    assert "\n" not in msg and "hf download google/t5-v1_1-xxl" in msg


@pytest.mark.parametrize("backend,dtype", [("zarr", "float16"), ("wds", "int8")])
def test_unpadded_store_round_trip(shards, folders, tmp_path, backend, dtype):
    """encode stores each caption at its own length: values within fp16 rounding (int8: half a
    step of its token's scale) of the encoder's own, verify clean, manifest and inspect."""
    encode_with(shards, tmp_path / "s", folders["t5"], backend=backend, text_dtype=dtype)
    store = open_store(tmp_path / "s", verify=True)
    assert store.verify() == []
    enc = load_text_encoder(str(folders["t5"]))
    lengths_seen = []
    for shard in store.shards:
        data = store.read(shard)
        want, lengths = enc.embed_ragged([c or "" for c in data["caption"]])
        assert data["text_length"].tolist() == lengths.tolist()
        lengths_seen += lengths.tolist()
        got = dequantize(data["text_tokens"], data.get("text_tokens_scale"), axis=-1)
        if dtype == "int8":
            assert np.all(np.abs(got - want.numpy()) <= data["text_tokens_scale"][:, None] / 2 + 1e-7)
        else:
            np.testing.assert_allclose(got, want.numpy(), rtol=1e-3, atol=1e-3)
        # a row range is those rows' tokens
        part = store.read(shard, fields=["text_tokens"], start=1, stop=3)
        assert np.array_equal(part["text_tokens"], ragged_rows(data["text_tokens"], data["text_length"], [1, 2]))
    m = store.manifest
    text = m["conditioning"]["text"]
    assert text["layout"] == "ragged" and text["storage"] == dtype and text["tokens_shape"] == [120, 32]
    assert text["model_type"] == "t5" and text["weights_sha256"] and text["pooled_dim"] is None
    assert m["ragged"]["text_length"]["max"] == max(lengths_seen)
    assert m["ragged"]["text_length"]["count"] == len(store)
    empty = store.empty_caption()
    assert empty["text_tokens"].shape == (1, 32) and empty["text_mask"].tolist() == [True]
    # the trainer's sample grids without a text encoder: the store's first captions, padded to the longest
    from dittrain.inference.sample import store_text

    first = store.read(0, start=0, stop=3)
    grid = store_text(store, 3)
    L = int(first["text_length"].max())
    assert grid["text_tokens"].shape == (3, L, 32) and grid["text_mask"].sum(1).tolist() == first["text_length"].tolist()
    vals = dequantize(first["text_tokens"], first.get("text_tokens_scale"), axis=-1)
    assert torch.equal(grid["text_tokens"][grid["text_mask"]], torch.from_numpy(vals))
    r = ditdata("inspect", tmp_path / "s")
    assert r.exit_code == 0, r.output
    assert "unpadded" in r.output and "t5" in r.output


def test_verify_finds_bad_ragged_fields(shards, folders, tmp_path):
    """verify's checks of a shard's unpadded tokens: lengths >= 1 adding up to the stored tokens,
    finite values, int8 scales > 0; each fault names the shard."""
    from ditdata.store.reader import _ragged_faults

    encode_with(shards, tmp_path / "s", folders["t5"], text_dtype="int8")
    store = open_store(tmp_path / "s")
    shard = store.shards[0]
    good = store.read(shard)
    assert _ragged_faults(shard, good, store.schema) == []
    cases = {"length < 1": {"text_length": np.r_[0, good["text_length"][1:]].astype(np.int32)},
             "sums to": {"text_tokens": good["text_tokens"][:-1]},
             "scales that are not > 0": {"text_tokens_scale": np.r_[-1.0, good["text_tokens_scale"][1:]]},
             "non-finite": {"text_tokens_scale": np.r_[np.nan, good["text_tokens_scale"][1:]]}}
    for what, change in cases.items():
        faults = _ragged_faults(shard, good | change, store.schema)
        assert any(what in f and str(shard.path) in f for f in faults), (what, faults)


def _truth(store) -> list[np.ndarray]:
    """Every sample's float32 token values, by global index."""
    out = []
    for shard in store.shards:
        data = store.read(shard)
        for i in range(shard.num_samples):
            t = ragged_rows(data["text_tokens"], data["text_length"], [i]).astype(np.float32)
            if "text_tokens_scale" in data:
                t = t * ragged_rows(data["text_tokens_scale"], data["text_length"], [i])[:, None]
            out.append(t)
    return out


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_loaders_pack_per_batch_and_resume_exactly(shards, folders, tmp_path, dtype):
    encode_with(shards, tmp_path / "s", folders["t5"], text_dtype=dtype, backend="wds" if dtype == "int8" else "zarr")
    store = open_store(tmp_path / "s")
    truth = _truth(store)

    def loaders():
        yield lambda: ResidentLoader(store, batch_size=4, with_index=True, seed=1)
        yield lambda: StreamingLoader(store, batch_size=4, workers=0, with_index=True, shuffle_window=1, seed=1)
        yield lambda: StreamingLoader(store, batch_size=4, workers=2, with_index=True, shuffle_window=1, seed=1)

    for make in loaders():
        loader = make()
        batches = [next(loader) for _ in range(6)]  # windows of one shard: batches cross them
        for b in batches:
            lengths = b["text_mask"].sum(1)
            assert b["text_tokens"].shape[1] == int(lengths.max())  # L_batch: the longest caption
            assert b["text_mask"].dtype == torch.bool and (b["text_mask"] == (
                torch.arange(b["text_mask"].shape[1])[None] < lengths[:, None])).all()
            for r, i in enumerate(b["index"].tolist()):
                t = torch.from_numpy(truth[i])
                assert int(lengths[r]) == len(t) and torch.equal(b["text_tokens"][r, :len(t)], t)
                assert (b["text_tokens"][r, len(t):] == 0).all()
        state = loader.state_dict()
        after = [next(loader) for _ in range(3)]
        loader.close()
        again = make()
        again.load_state_dict(state)
        for a, b in zip(after, [next(again) for _ in range(3)], strict=True):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        again.close()


def test_train_resume_and_sample_with_prompt(shards, folders, tmp_path):
    """A tiny DiT cross-attends to the T5 store's unpadded tokens (caption dropout to the
    stored empty prompt), resumes after SIGKILL with the same losses; sample --prompt embeds
    with the store's text encoder."""
    encode_with(shards, tmp_path / "s", folders["t5"])
    store = tmp_path / "s"
    resume_after_sigkill(store, tmp_path, ["--max-steps", 30, "--save-every", 14, "--caption-dropout", 0.5,
                                           "--batch-size", 4], steps=30, half=14)
    cfg = json.loads((tmp_path / "straight" / "config.json").read_text())
    assert cfg["model"]["text_token_dim"] == 32 and not cfg["model"].get("text_pooled_dim")
    r = dittrain("sample", "--ckpt", tmp_path / "straight", "--out", tmp_path / "grid.png", "--prompt", "a dog",
                 "--prompt", "a photo of the cat on the mat", "--steps", "2", "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "grid.png").is_file()
    # the encoder's folder gone: one line naming what to pass
    shutil.move(folders["t5"], tmp_path / "moved")
    try:
        r = dittrain("sample", "--ckpt", tmp_path / "straight", "--out", tmp_path / "g2.png", "--prompt", "a dog",
                     "--steps", "2", "--device", "cpu")
        assert r.exit_code != 0 and "--text-pretrained" in r.output and "Traceback" not in r.output, r.output
        r = dittrain("sample", "--ckpt", tmp_path / "straight", "--out", tmp_path / "g3.png", "--prompt", "a dog",
                     "--steps", "2", "--device", "cpu", "--text-pretrained", tmp_path / "moved")
        assert r.exit_code == 0, r.output
    finally:
        shutil.move(tmp_path / "moved", folders["t5"])


def test_text_options_need_a_transformers_encoder(shards, tmp_path):
    r = ditdata("encode", shards, "--vae", "pixels", "--resolution", "16", "--out", tmp_path / "s",
                "--text-encoder", "ViT-B-32", "--text-pretrained", "x.pt", "--text-dtype", "int8")
    assert r.exit_code != 0 and "transformers text encoder" in r.output
    assert len(r.output.strip().splitlines()) == 1, r.output



def test_encode_a_caption_set(shards, folders, tmp_path):
    """--captions SET embeds the set's captions (stored as `caption`, recorded in the manifest)
    instead of the alt text; a shard without the set stops the run before any work, in one line."""
    from ditdata.imageshards import captionsets as cs
    from ditdata.imageshards import folder as imageshards

    d = tmp_path / "shards"
    shutil.copytree(shards, d)
    tars = imageshards.list_shards(d)
    for tar in tars[:1]:
        keys = [s.key for s in imageshards.iter_shard(tar)]
        rows = {"key": keys, "caption": [f"a blue house {i}" if i % 2 else None for i in range(len(keys))],
                "status": ["ok"] * len(keys), "tokens": [3] * len(keys)}
        cs.write_caption_set(cs.caption_set_path(tar, "recap"), rows,
                             {"format": cs.FORMAT, "version": cs.VERSION, "set": "recap", "shard": tar.name,
                              "shard_bytes": tar.stat().st_size, "num_samples": len(keys)})
    with pytest.raises(DitdataError, match="no complete caption set 'recap'"):
        encode_with(d, tmp_path / "bad", folders["t5"], captions="recap")
    for tar in tars[1:]:
        keys = [s.key for s in imageshards.iter_shard(tar)]
        rows = {"key": keys, "caption": ["a red mat"] * len(keys), "status": ["ok"] * len(keys),
                "tokens": [3] * len(keys)}
        cs.write_caption_set(cs.caption_set_path(tar, "recap"), rows,
                             {"format": cs.FORMAT, "version": cs.VERSION, "set": "recap", "shard": tar.name,
                              "shard_bytes": tar.stat().st_size, "num_samples": len(keys)})
    encode_with(d, tmp_path / "s", folders["t5"], captions="recap")
    store = open_store(tmp_path / "s")
    assert store.manifest["conditioning"]["text"]["caption_set"] == "recap"
    enc = load_text_encoder(str(folders["t5"]))
    for shard in store.shards:
        data = store.read(shard)
        want = cs.read_caption_set(Path(shard.record["source"]), "recap")
        assert list(data["caption"]) == [want[k] or "" for k in data["key"]]
        flat, lengths = enc.embed_ragged(list(data["caption"]))
        assert data["text_length"].tolist() == lengths.tolist()
        np.testing.assert_allclose(data["text_tokens"].astype(np.float32), flat.numpy(), rtol=1e-3, atol=1e-3)

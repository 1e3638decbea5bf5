"""`ditdata caption`: caption sets beside the image shards (ditdata.imageshards.captionsets),
written by a tiny random Qwen2.5-VL through transformers' own classes (equal to calling
transformers directly) and by a python: captioner; flags, resume, score and filter on a set."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from cliutil import ditdata as run_cli
from cliutil import ok, raises_one_line

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_score import jpeg, make_shards  # noqa: E402

from ditdata.captions import caption  # noqa: E402
from ditdata.captions.quality import longest_loop, status, words  # noqa: E402
from ditdata.common.usercode import UserCodeError  # noqa: E402
from ditdata.config import CaptionConfig  # noqa: E402
from ditdata.errors import DitdataError  # noqa: E402
from ditdata.imageshards import captionsets as cs  # noqa: E402
from ditdata.imageshards import folder as imageshards  # noqa: E402

# crops of these widths get a caption that is flagged (the python: captioner below)
EMPTY_W, LOOP_W, CUT_W = 101, 102, 103

CAPTIONER_PY = '''
import os

import numpy as np

CALLS = {"n": 0}


def make():
    """A captioner that describes an image by its size and mean, except for three widths."""
    def cap(images, prompt, max_new_tokens):
        out = []
        for im in images:
            CALLS["n"] += 1
            fail = os.environ.get("TEST_CAPTION_FAIL_AFTER")
            if fail and CALLS["n"] > int(fail):
                raise RuntimeError("the machine went down")
            w, h = im.size
            if w == EMPTY_W:
                out.append("  \\n ")
            elif w == LOOP_W:
                out.append("a cat on a mat on a mat on a mat")
            elif w == CUT_W:
                out.append({"text": "a photo of a very long", "tokens": max_new_tokens, "truncated": True})
            else:
                mean = float(np.asarray(im, dtype=np.float64).mean())
                out.append({"text": f" {prompt} {w}x{h} mean {mean:.3f} ", "tokens": 9, "truncated": False})
        return out
    return cap
'''.replace("EMPTY_W", str(EMPTY_W)).replace("LOOP_W", str(LOOP_W)).replace("CUT_W", str(CUT_W))


def photo_shards(folder: Path) -> Path:
    """Three shards of real photos (crops of scikit-image pictures) with alt-texts; one crop
    of each flagged width, and one broken JPEG."""
    from skimage import data

    pics = [("astronaut", data.astronaut()), ("cat", data.chelsea()), ("coffee", data.coffee()),
            ("rocket", data.rocket())]
    samples = []
    for j in range(10):
        name, arr = pics[j % 4]
        w = {2: EMPTY_W, 5: LOOP_W, 7: CUT_W}.get(j, 120 + 8 * j)
        crop = arr[5 * j:, 3 * j:][:96, :w]
        samples.append({"key": f"{j:09d}", "image": jpeg(crop), "caption": f"a photo of a {name}"})
    samples[8]["image"] = samples[8]["image"][:300]  # cut inside the header: "corrupt image"
    return make_shards(folder, [samples[:4], samples[4:8], samples[8:]])


@pytest.fixture
def captioner_py(tmp_path):
    p = tmp_path / "my_captioner.py"
    p.write_text(CAPTIONER_PY)
    return f"python:{p}:make"


def cfg(shards, captioner, name="py", **kw) -> CaptionConfig:
    return CaptionConfig(shards=str(shards), captioner=captioner, out_name=name, device="cpu", progress=False, **kw)


def file_bytes(folder: Path, name: str) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob(f"*.captions.{name}.parquet"))}


# --------------------------------------------------------------------------- the rules


def test_quality_rules():
    assert status("   ", False) == "empty" and status(None, True) == "empty"
    assert status("a cat on a mat on a mat on a mat", False) == "repeated"
    assert status("The dog. The dog. The dog.", True) == "repeated"  # the loop is the cause worth counting
    assert status("very very very very", False) == "repeated"
    assert status("a very, very good dog on a mat", False) == "ok"
    assert status("a dog on a mat on a sofa", True) == "truncated"
    assert longest_loop(words("x a b c a b c a b c y")) == (3, 3)


def test_set_names():
    for bad in ("", "a b", "x/y", "a.b", "z" * 65):
        raises_one_line(DitdataError, lambda b=bad: cs.check_set_name(b))
    assert "reserved" in raises_one_line(DitdataError, lambda: cs.caption_set_path("00000.tar", "alt"))
    assert cs.caption_set_path("/d/00003.tar", "qwen-7b_v2").name == "00003.captions.qwen-7b_v2.parquet"


# --------------------------------------------------------------------------- python: captioner


def test_captions_row_for_row_flags_and_counts(tmp_path, captioner_py):
    d = photo_shards(tmp_path / "s")
    summary = caption(cfg(d, captioner_py, batch_size=3, prompt="Describe:", max_new_tokens=20))
    assert summary["captioned_shards"] == 3 and summary["complete_shards"] == 3
    assert summary["counts"] == {"ok": 6, "empty": 1, "repeated": 1, "truncated": 1, "corrupt image": 1}
    assert cs.list_caption_sets(d) == ["alt", "py"]
    tars = imageshards.read_folder(d).shards
    for tar in tars:
        samples = list(imageshards.iter_shard(tar))
        t, meta = cs.read_caption_table(tar, "py")
        assert t.column("key").to_pylist() == [s.key for s in samples]  # row for row, stored order
        assert meta["num_samples"] == len(samples) and meta["shard_bytes"] == tar.stat().st_size
        assert meta["prompt"] == "Describe:" and meta["max_new_tokens"] == 20
        assert meta["captioner"]["kind"] == "python" and meta["captioner"]["weights_sha256"]["module_file"]
        for s, row in zip(samples, t.to_pylist(), strict=True):
            try:
                w, h = s.decode().size
            except imageshards.BadImageError as e:
                assert row == {"key": s.key, "caption": None, "status": e.reason, "tokens": None}
                continue
            want = {EMPTY_W: (None, "empty", None), LOOP_W: ("a cat on a mat on a mat on a mat", "repeated", None),
                    CUT_W: ("a photo of a very long", "truncated", 20)}.get(w)
            if want is None:
                assert row["caption"].startswith(f"Describe: {w}x{h} mean ") and row["status"] == "ok"
                assert row["tokens"] == 9 and row["caption"] == row["caption"].strip()
            else:
                assert (row["caption"], row["status"], row["tokens"]) == want
    caps = cs.read_caption_set(tars[1], "py")
    assert cs.read_caption_set(tars[1], "py", only_ok=True) == {k: (v if not v or "mean" in v else None)
                                                                for k, v in caps.items()}
    assert cs.read_caption_set(tars[0], "alt")["000000000"] == "a photo of a astronaut"
    # a rerun does nothing
    again = caption(cfg(d, captioner_py, batch_size=3, prompt="Describe:", max_new_tokens=20))
    assert again["captioned_shards"] == 0 and again["skipped_shards"] == 3 and again["counts"] == summary["counts"]


def test_a_killed_run_resumes_to_the_same_bytes(tmp_path, captioner_py, monkeypatch):
    clean = photo_shards(tmp_path / "clean")
    killed = tmp_path / "killed"
    shutil.copytree(clean, killed)
    caption(cfg(clean, captioner_py, batch_size=2))
    # the captioner fails on its 6th image: shard 0 (4 images) is written, shard 1 is not
    monkeypatch.setenv("TEST_CAPTION_FAIL_AFTER", "5")
    msg = raises_one_line(UserCodeError, lambda: caption(cfg(killed, captioner_py, batch_size=2)))
    assert "the machine went down" in msg and captioner_py in msg
    assert list(file_bytes(killed, "py")) == ["00000.captions.py.parquet"]
    assert not [p for p in killed.iterdir() if imageshards.is_tmp(p)]  # no half file
    # what a SIGKILL during the write of shard 1 would leave: a temporary, removed by the next run
    tmp = killed / ".00001.captions.py.parquet.tmp-123-abcdef01"
    tmp.write_bytes(b"PAR1 half")
    monkeypatch.delenv("TEST_CAPTION_FAIL_AFTER")
    resumed = caption(cfg(killed, captioner_py, batch_size=2))
    assert resumed["captioned_shards"] == 2 and resumed["skipped_shards"] == 1 and not tmp.exists()
    assert file_bytes(killed, "py") == file_bytes(clean, "py")  # bitwise those of the clean run


def test_torchrun_ranks_share_the_shards(tmp_path, captioner_py):
    from cliutil import on_one_and_two_ranks, torchrun_or_skip

    torchrun_or_skip()
    one = photo_shards(tmp_path / "one")
    two = tmp_path / "two"
    shutil.copytree(one, two)
    args = ["--captioner", captioner_py, "--out-name", "py", "--device", "cpu", "--batch-size", 2, "-q"]
    multi = on_one_and_two_ranks("ditdata", ["caption", one, *args], ["caption", two, *args], timeout=120)
    assert multi.stdout.count("caption set 'py'") == 1  # rank 0 reports the whole set
    assert "10 samples in 3 of 3 shards" in multi.stdout and "(this rank of 2)" in multi.stdout
    assert file_bytes(two, "py") == file_bytes(one, "py") and len(file_bytes(one, "py")) == 3


def test_other_settings_are_refused_and_limit(tmp_path, captioner_py):
    d = photo_shards(tmp_path / "s")
    first = caption(cfg(d, captioner_py, limit=1))
    assert first["captioned_shards"] == 1 and first["complete_shards"] == 1
    msg = raises_one_line(DitdataError, lambda: caption(cfg(d, captioner_py, prompt="Another prompt")))
    assert "--overwrite" in msg and "'Another prompt'" in msg and "00000.tar" in msg
    assert caption(cfg(d, captioner_py, prompt="Another prompt", overwrite=True))["captioned_shards"] == 3
    # an undecodable shard file (damaged) is redone, an unfinished set listed
    assert cs.set_coverage(d, "py")["complete"] == 3


def test_cli_errors_are_one_line(tmp_path, captioner_py, monkeypatch):
    d = photo_shards(tmp_path / "s")
    r = run_cli("caption", d, "--captioner", captioner_py, "--out-name", "alt", "-q")
    assert r.exit_code != 0 and "reserved" in r.output and len(r.output.strip().splitlines()) == 1
    r = run_cli("caption", d, "--captioner", "nope-vlm", "--out-name", "x", "-q")
    assert r.exit_code != 0 and "unknown captioner 'nope-vlm'" in r.output
    # a preset that is not in the (empty) local cache: one line naming `hf download`
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    r = run_cli("caption", d, "--captioner", "qwen2.5-vl-3b", "--out-name", "q", "-q")
    assert r.exit_code != 0 and len(r.output.strip().splitlines()) == 1, r.output
    assert "`hf download Qwen/Qwen2.5-VL-3B-Instruct`" in r.output and "Traceback" not in r.output
    assert not list(d.glob("*.captions.*"))


# --------------------------------------------------------------------------- a real transformers VLM


def tiny_qwen_vl(folder: Path) -> Path:
    """A tiny random Qwen2.5-VL saved with save_pretrained (tests/vlm_util.py): a 2-layer text decoder
    of width 64, a 2-block vision tower of width 32, images at most 16 patches."""
    from vlm_util import random_qwen_vl

    return random_qwen_vl(folder, max_patches=16, text=dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, rope_parameters={"rope_type": "default", "mrope_section": [2, 2, 4],
                                                       "rope_theta": 1e4}),
        vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                    window_size=56, fullatt_block_indexes=[1]))


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return tiny_qwen_vl(tmp_path_factory.mktemp("qwen"))


def test_a_transformers_vlm_equals_transformers_and_is_deterministic(tmp_path, qwen_dir):
    a = photo_shards(tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    r = run_cli("caption", a, "--captioner", qwen_dir, "--out-name", "qwen", "--max-new-tokens", 6,
                "--batch-size", 3, "--device", "cpu", "-q")
    ok(r, "caption set 'qwen'", "10 samples in 3 of 3 shards", "undecodable image: 1 (null caption): corrupt image 1")
    tars = imageshards.read_folder(a).shards
    rows = [row for tar in tars for row in cs.read_caption_table(tar, "qwen")[0].to_pylist()]
    meta = cs.read_caption_meta(cs.caption_set_path(tars[0], "qwen"))
    assert meta["captioner"]["model_class"] == "Qwen2_5_VLForConditionalGeneration"
    assert meta["prompt"] == "Describe this image in detail." and meta["captioner"]["kind"] == "directory"
    assert list(meta["captioner"]["weights_sha256"]) == ["model.safetensors"]

    # the same images through transformers itself, one at a time (no padding): the same text and tokens
    processor = transformers.AutoProcessor.from_pretrained(qwen_dir)
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen_dir).eval()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": meta["prompt"]}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    samples = [s for tar in tars for s in imageshards.iter_shard(tar)]
    for s, row in zip(samples, rows, strict=True):
        if s.key == "000000008":
            assert row["status"] == "corrupt image" and row["caption"] is None
            continue
        inputs = processor(text=[text], images=[s.decode()], return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=6, do_sample=False)
        gen = out[0, inputs["input_ids"].shape[1]:].tolist()
        eos = model.generation_config.eos_token_id
        n = gen.index(eos) if eos in gen else len(gen)
        want = processor.batch_decode([gen], skip_special_tokens=True)[0].strip()
        assert row["caption"] == (want or None) and row["tokens"] == n
        assert row["status"] == status(want, eos not in gen and len(gen) == 6)

    # deterministic: a second run on a copy writes the same bytes (batches of another composition
    # are not asked for: --batch-size is the same)
    ok(run_cli("caption", b, "--captioner", qwen_dir, "--out-name", "qwen", "--max-new-tokens", 6,
               "--batch-size", 3, "--device", "cpu", "-q"))
    assert file_bytes(a, "qwen") == file_bytes(b, "qwen")
    # rerun: every shard skipped
    ok(run_cli("caption", a, "--captioner", qwen_dir, "--out-name", "qwen", "--max-new-tokens", 6,
               "--batch-size", 3, "--device", "cpu", "-q"), "skipped 3 shard(s) already captioned")


def tiny_florence2(folder: Path) -> Path:
    """A tiny random Florence-2 (transformers' native Florence2ForConditionalGeneration: a DaViT
    vision tower, a BART encoder-decoder) and its processor, saved; its generation config
    suppresses the end-of-sequence token so that the random decoder writes to the token limit."""
    from transformers import CLIPImageProcessor, Florence2Config, Florence2ForConditionalGeneration, Florence2Processor
    from vlm_util import byte_tokenizer, save_random

    specials = ["<s>", "<pad>", "</s>", "<unk>", "<image>"]
    tok = byte_tokenizer(specials, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
                         extra_special_tokens={"image_token": "<image>"})
    ids = {s: tok.convert_tokens_to_ids(s) for s in specials}
    # 64 px -> an 8 x 8 grid after the two stages, plus the pooled token: 65 image tokens
    images = CLIPImageProcessor(size={"height": 64, "width": 64}, do_center_crop=False, image_seq_length=65)
    processor = Florence2Processor(image_processor=images, tokenizer=tok)
    config = Florence2Config(
        vision_config=dict(depths=[1, 1], patch_size=[7, 3], patch_stride=[4, 2], patch_padding=[3, 1],
                           patch_prenorm=[False, True], embed_dim=[16, 32], num_heads=[2, 2], num_groups=[2, 2],
                           window_size=4, projection_dim=32, drop_path_rate=0.0, max_position_embeddings=16),
        text_config=dict(model_type="bart", vocab_size=len(tok), d_model=32, encoder_layers=1, decoder_layers=1,
                         encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                         decoder_ffn_dim=64, max_position_embeddings=128, bos_token_id=ids["<s>"],
                         eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"], decoder_start_token_id=ids["</s>"]),
        image_token_id=ids["<image>"])
    return save_random(folder, Florence2ForConditionalGeneration, config, processor,
                       suppress_tokens=[ids["</s>"], ids["<pad>"]],  # the random decoder would stop at once
                       eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"], decoder_start_token_id=ids["</s>"])


def test_florence2_is_asked_with_its_task_token(tmp_path):
    d = photo_shards(tmp_path / "s")
    model_dir = tiny_florence2(tmp_path / "florence")
    ok(run_cli("caption", d, "--captioner", model_dir, "--out-name", "flo", "--max-new-tokens", 5,
               "--batch-size", 4, "--device", "cpu", "-q"), "prompt '<MORE_DETAILED_CAPTION>'")
    tars = imageshards.read_folder(d).shards
    meta = cs.read_caption_meta(cs.caption_set_path(tars[0], "flo"))
    assert meta["captioner"]["model_class"] == "Florence2ForConditionalGeneration"
    processor = transformers.AutoProcessor.from_pretrained(model_dir)
    model = transformers.Florence2ForConditionalGeneration.from_pretrained(model_dir).eval()
    tar = tars[0]
    samples = list(imageshards.iter_shard(tar))
    inputs = processor(text=["<MORE_DETAILED_CAPTION>"] * len(samples), images=[s.decode() for s in samples],
                       return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    want = [t.strip() for t in processor.batch_decode(out[:, 1:], skip_special_tokens=True)]  # after the start
    rows = cs.read_caption_table(tar, "flo")[0].to_pylist()
    assert [r["caption"] for r in rows] == [w or None for w in want] and any(want)
    assert all(r["tokens"] == 5 and r["status"] in ("truncated", "repeated") for r in rows)
    # text beside a task token is refused by Florence-2's processor: one line
    r = run_cli("caption", d, "--captioner", model_dir, "--out-name", "flo2", "--prompt", "<CAPTION> of a cat",
                "--device", "cpu", "-q")
    assert r.exit_code != 0 and "refused the prompt" in r.output and len(r.output.strip().splitlines()) == 1


# --------------------------------------------------------------------------- score, filter, inspect, verify


def test_score_and_filter_a_caption_set(tmp_path, captioner_py):
    open_clip = pytest.importorskip("open_clip")
    from test_clip import tiny_clip_files

    from ditdata.imageshards.scores import read_score_meta, score_path

    config, weights = tiny_clip_files(tmp_path / "clip")
    d = photo_shards(tmp_path / "s")
    clip = ["--clip-config", config, "--pretrained", weights, "--device", "cpu", "--threads", 0, "-q"]
    r = run_cli("score", d, *clip, "--captions", "py")
    assert r.exit_code != 0 and "no complete caption set 'py'" in r.output and "ditdata caption" in r.output
    caption(cfg(d, captioner_py))
    ok(run_cli("score", d, *clip, "--captions", "py"), "captions of set 'py'")
    ok(run_cli("score", d, *clip))  # the alt-texts, beside
    model, _, preprocess = open_clip.create_model_and_transforms("tiny-clip", pretrained=str(weights))
    tok = open_clip.get_tokenizer("tiny-clip")
    for tar in imageshards.read_folder(d).shards:
        alt, mine = pq.read_table(score_path(tar)), pq.read_table(score_path(tar, "py"))
        assert score_path(tar, "py").name == tar.name.replace(".tar", ".clip.py.parquet")
        assert mine.column("key").to_pylist() == alt.column("key").to_pylist()  # row for row
        meta = read_score_meta(score_path(tar, "py"))
        assert meta["captions"] == {"set": "py", "sha256": hashlib.sha256(
            cs.caption_set_path(tar, "py").read_bytes()).hexdigest()}
        caps = cs.read_caption_set(tar, "py")
        for s, row in zip(imageshards.iter_shard(tar), mine.to_pylist(), strict=True):
            cap = caps[s.key]
            if cap is None:
                assert row["clip_score"] is None
                continue
            with torch.no_grad():
                fi = model.eval().encode_image(preprocess(s.decode())[None], normalize=True)
                ft = model.encode_text(tok([cap]), normalize=True)
            assert row["clip_score"] == pytest.approx(float((fi * ft).sum()), abs=1e-6)
            assert row["caption_length"] == len(cap)
    # a rerun skips; a set captioned again is scored again
    again = run_cli("score", d, *clip, "--captions", "py")
    ok(again, "skipped 3 shard(s)")
    caption(cfg(d, captioner_py, prompt="Other:", overwrite=True))
    ok(run_cli("score", d, *clip, "--captions", "py"), "scored 3 shard(s)")

    sel = tmp_path / "keep.json"
    r = ok(run_cli("filter", d, "--top-fraction", "0.5", "--captions", "py", "--out", sel),
           "captions of set 'py'")
    import json

    rule = json.loads(sel.read_text())["rule"]
    assert rule["captions"] == "py" and rule["scored"] == 8  # the set's null captions have no score
    alt_rule = ok(run_cli("filter", d, "--top-fraction", "0.5", "--out", tmp_path / "alt.json"))
    assert "captions" not in json.loads((tmp_path / "alt.json").read_text())["rule"] and alt_rule


def test_inspect_and_verify_show_the_sets(tmp_path, captioner_py):
    d = photo_shards(tmp_path / "s")
    caption(cfg(d, captioner_py))
    caption(cfg(d, captioner_py, name="short", prompt="Say:", limit=2))
    r = ok(run_cli("inspect", d), "image shards:", "caption sets:", "alt", "py", "3 of 3 shards",
           "ok 6, empty 1, repeated 1, truncated 1, undecodable 1", "short", "2 of 3 shards")
    assert "Traceback" not in r.output
    ok(run_cli("verify", d, "-q"), "OK", "caption sets alt, py, short")
    # a damaged file and one whose rows do not follow the shard: faults naming them
    p = cs.caption_set_path(d / "00001.tar", "py")
    p.write_bytes(p.read_bytes()[:-40])
    t, meta = cs.read_caption_table(d / "00000.tar", "short")
    rows = t.to_pylist()[::-1]
    cs.write_caption_set(cs.caption_set_path(d / "00000.tar", "short"),
                         {c: [row[c] for row in rows] for c in cs.COLUMNS}, meta)
    r = run_cli("verify", d, "-q")
    assert r.exit_code != 0
    assert "FAULT" in r.output and "00001.captions.py.parquet" in r.output and "incomplete" in r.output
    assert "00000.captions.short.parquet" in r.output and "order" in r.output
    # a damaged shard is a fault of its own
    tar = d / "00002.tar"
    tar.write_bytes(tar.read_bytes()[:1000])
    r = run_cli("verify", d, "-q")
    assert r.exit_code != 0 and "00002.tar: damaged tar" in r.output

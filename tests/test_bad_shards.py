"""Image shards that don't match their records: truncated tars (cut inside a member or
exactly between two), tars with fewer samples than their stats file, unusable samples in
tars written by other tools. Encode and score stop with one line by default, or leave the
shard out and record it with --skip-bad-shards; nothing is dropped silently."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
from cliutil import ditdata as cli
from cliutil import ok
from cliutil import one_error_line as error_line
from PIL import Image
from tiny import fetch_tree, real_images

from ditdata.framing import Framing
from ditdata.imageshards import folder as imageshards
from ditdata.imageshards.batches import _shard_batches
from ditdata.store import open_store


def one_error_line(r) -> str:
    """The CLI failed (exit 1) with exactly one line and no traceback; that line."""
    assert r.exit_code == 1, r.output
    assert not isinstance(r.exception, AssertionError)
    return error_line(r.output)


@pytest.fixture
def pristine(class_shards) -> Path:
    return class_shards


@pytest.fixture
def shards(pristine, tmp_path) -> Path:
    return Path(shutil.copytree(pristine, tmp_path / "shards"))


def members(tar: Path) -> list[tarfile.TarInfo]:
    with tarfile.open(tar) as tf:
        return list(tf)


def second_sample(tar: Path) -> list[tarfile.TarInfo]:
    ms = members(tar)
    first_key = ms[0].name.split(".")[0]
    return [m for m in ms if m.name.split(".")[0] != first_key]


def cut_inside_a_member(tar: Path) -> None:
    """Truncate in the middle of the second sample's image bytes."""
    image = next(m for m in second_sample(tar) if m.name.endswith(".png"))
    with open(tar, "r+b") as f:
        f.truncate(image.offset_data + image.size // 2)


def cut_between_samples(tar: Path) -> None:
    """Truncate exactly at the header of the second sample: what is left is a tar of one
    whole sample that simply ends early (no error from tarfile)."""
    with open(tar, "r+b") as f:
        f.truncate(second_sample(tar)[0].offset)


def keep_first_sample(tar: Path) -> None:
    """Rewrite the tar, complete and valid, with only its first sample."""
    with tarfile.open(tar) as tf:
        ms = [(m, tf.extractfile(m).read()) for m in tf]
    first_key = ms[0][0].name.split(".")[0]
    with tarfile.open(tar, "w", format=tarfile.USTAR_FORMAT) as out:
        for m, data in ms:
            if m.name.split(".")[0] == first_key:
                out.addfile(m, io.BytesIO(data))


def encode_args(shards: Path, out: Path, *extra):
    return ["encode", shards, "--vae", "pixels", "--resolution", 32, "--out", out, "--workers", 0,
            "--device", "cpu", *extra]


@pytest.mark.parametrize("damage, found", [(cut_inside_a_member, None), (cut_between_samples, 1),
                                           (keep_first_sample, 1)])
def test_encode_stops_on_a_bad_shard_then_skips_and_records_it(pristine, shards, tmp_path, damage, found):
    tar = imageshards.shard_path(shards, 1)
    damage(tar)
    reason = imageshards.check_shard(tar, 2)
    assert reason is not None
    if found is not None:  # a tar that reads cleanly but is short
        assert reason == f"holds {found} samples but its stats file records 2"
    else:
        assert reason.startswith("damaged tar")

    store = tmp_path / "store"
    line = one_error_line(cli(*encode_args(shards, store)))
    assert str(tar) in line and reason in line and "--skip-bad-shards" in line and "refetch" in line
    assert not (store / "manifest.json").exists()
    assert not list(store.glob("shards/*.zarr"))  # checked before any work: nothing encoded

    r = cli(*encode_args(shards, store, "--skip-bad-shards"))
    assert r.exit_code == 0, r.output
    assert f"skipped shards: 00001.tar ({reason}; 2 samples lost)" in r.output
    s = open_store(store, verify=True)
    assert len(s) == 6 and [sh.name for sh in s.shards] == ["00000", "00002", "00003"]
    assert s.manifest["skipped_shards"] == [{"name": "00001", "shard": str(tar), "reason": reason,
                                             "samples_lost": 2}]
    assert "skipped:      image shard" in cli("inspect", store).output
    assert cli("verify", store).exit_code == 0

    # refetched (here: restored), the shard is encoded and the record disappears
    shutil.copy(imageshards.shard_path(pristine, 1), tar)
    r = cli(*encode_args(shards, store))
    assert r.exit_code == 0, r.output
    s = open_store(store, verify=True)
    assert len(s) == 8 and "skipped_shards" not in s.manifest


def test_worker_reports_a_shard_that_changed_after_the_check(shards):
    tar = imageshards.shard_path(shards, 2)
    cut_between_samples(tar)
    batches = list(_shard_batches("00002", tar, 2, Framing(32), 8, None))
    assert batches[-1]["last"] and batches[-1]["bad"] == "holds 1 samples but its stats file records 2"
    cut_inside_a_member(imageshards.shard_path(shards, 3))
    batches = list(_shard_batches("00003", imageshards.shard_path(shards, 3), 2, Framing(32), 8, None))
    assert batches[-1]["bad"].startswith(f"{imageshards.shard_path(shards, 3)}: damaged tar")
    good = list(_shard_batches("00000", imageshards.shard_path(shards, 0), 2, Framing(32), 8, None))
    assert good[-1]["bad"] is None and sum(len(b["meta"]) for b in good) == 2


def png(arr) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return buf.getvalue()


def write_tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    with tarfile.open(path, "w") as tf:
        for name, data in members:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return path


def test_foreign_tars_are_read_as_they_are_and_unusable_samples_counted(tmp_path):
    """Tars from another tool: no dataset.json, no stats files. Every sample that is not
    encoded is counted by reason; the good ones are encoded."""
    pics = {k: v[:64, :64] for k, v in real_images().items()}
    d = tmp_path / "webdataset"
    d.mkdir()
    write_tar(d / "part-a.tar", [
        ("a/good1.png", png(pics["astronaut"])), ("a/good1.txt", b"an astronaut"),
        ("a/garbage.jpg", b"\xff\xd8 this is not a jpeg"),
        ("a/captiononly.txt", b"no image here"),
        ("a/badjson.png", png(pics["chelsea"])), ("a/badjson.json", b"{not json"),
        ("a/good1.png", png(pics["coffee"])),  # the key again, further down: a duplicate
    ])
    write_tar(d / "part-b.tar", [("b/good2.png", png(pics["rocket"])), ("b/good2.json", b'{"caption": "a rocket"}')])
    ok(cli(*encode_args(d, tmp_path / "store")), "not written by `ditdata fetch`", "encoded 2 images",
       "not an image: 1", "no image member: 1", "unreadable metadata: 1", "duplicate key: 1")
    s = open_store(tmp_path / "store", verify=True)
    assert sorted(s.read("part-a")["key"].tolist() + s.read("part-b")["key"].tolist()) == ["a/good1", "b/good2"]
    assert s.read("part-b")["caption"].tolist() == ["a rocket"]
    assert s.shard("part-a").record["extra"]["skipped"] == {
        "not an image": 1, "no image member": 1, "unreadable metadata": 1, "duplicate key": 1}


def test_img2dataset_folder_made_elsewhere_is_checked_against_its_stats(shards, tmp_path):
    """No dataset.json (img2dataset writes none), but stats files: counts are checked."""
    (shards / imageshards.DATASET_INFO).unlink()
    (shards / imageshards.FETCH_STATE).unlink()
    folder = imageshards.read_folder(shards)
    assert folder.foreign and folder.expected == {f"0000{i}.tar": 2 for i in range(4)}
    cut_between_samples(imageshards.shard_path(shards, 3))
    line = one_error_line(cli(*encode_args(shards, tmp_path / "store")))
    assert "00003.tar holds 1 samples but its stats file records 2" in line


def test_unfinished_fetch_is_still_refused(shards, tmp_path):
    (shards / imageshards.DATASET_INFO).unlink()  # .fetch_state remains: our fetch, unfinished
    line = one_error_line(cli(*encode_args(shards, tmp_path / "store")))
    assert "dataset.json is missing" in line and "rerun the same `ditdata fetch`" in line


def test_score_and_filter_with_a_bad_shard(shards, tmp_path):
    pytest.importorskip("open_clip")
    from test_clip import tiny_clip_files

    config, weights = tiny_clip_files(tmp_path / "clip")
    # captions, so that there is something to score: a captions folder of the same images
    d = tmp_path / "captions"
    d.mkdir()
    tree = tmp_path / "ctree"
    for name, arr in real_images().items():
        for i in range(2):
            (tree).mkdir(exist_ok=True)
            Image.fromarray(np.ascontiguousarray(arr[i * 9:, i * 13:][:48, :48])).save(tree / f"{name}{i}.png")
            (tree / f"{name}{i}.txt").write_text(f"a photo of a {name}")
    fetch_tree(tree, d, samples_per_shard=3)
    cut_between_samples(imageshards.shard_path(d, 1))
    common = ["--clip-config", config, "--pretrained", weights, "--device", "cpu", "--threads", 0, "-q"]
    line = one_error_line(cli("score", d, *common))
    assert "00001.tar holds 1 samples but its stats file records 3" in line and "--skip-bad-shards" in line
    assert not list(d.glob("*.clip.parquet"))

    r = cli("score", d, *common, "--skip-bad-shards")
    assert r.exit_code == 0, r.output
    assert "left out the damaged shard 00001.tar (holds 1 samples but its stats file records 3; 3 samples lost)" in r.output
    rec = json.loads((d / "00001.clip.skipped.json").read_text())
    assert rec["samples_lost"] == 3 and not (d / "00001.clip.parquet").exists()

    r = cli("filter", d, "--top-fraction", 1.0, "--out", tmp_path / "keep.parquet")
    assert r.exit_code == 0, r.output
    assert "left out: shard 00001.tar" in r.output
    from ditdata.imageshards.selections import load_selection

    sel = load_selection(tmp_path / "keep.parquet")
    assert len(sel) == 5 and sel.rule["skipped_shards"][0]["shard"] == "00001.tar"

"""Aspect-ratio buckets, the training side: the DiT on any token grid (sin-cos, RoPE, unpatchify),
the bucketed loader (one shape per batch, buckets in proportion, pad vs drop, exact resume, DDP
rows, flips), `dittrain run` on a bucketed store (the batch shape in the logs, config.json, exact
resume after SIGKILL), `dittrain sample --size` and serve's sizes."""

from __future__ import annotations

import collections
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from cliutil import dittrain, ok, one_error_line, raises_one_line, resume_after_sigkill, run_args
from storeutil import bucketed_store, class_conditioning, pixels_info, schema, take, write_store
from test_sample import read_png
from test_train import assert_same_state

from ditdata.store import finalize_buckets
from dittrain.data import BucketedLoader, LoaderConfig, LoaderError, build_loader
from dittrain.model.dit import DiT, rope_table, sincos_pos_embed_2d
from dittrain.model.sizes import get_config
from dittrain.rundir import latest_checkpoint, load_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

# 3 buckets of pixel latents (3, H, W): 20 square, 12 wide, 5 tall (fewer than a batch of 8)
SIZES = {(8, 8): 20, (16, 8): 12, (8, 16): 5}


@pytest.fixture(scope="module")
def bstore(tmp_path_factory) -> Path:
    return bucketed_store(tmp_path_factory.mktemp("buckets") / "s", SIZES)


# ----------------------------------------------------------------------------- the model


def _sincos_as_before(dim: int, side: int) -> torch.Tensor:
    """The square table as dittrain.model.dit computed it before buckets (MAE's layout), written out."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim / 4))
    pos = torch.arange(side, dtype=torch.float64)
    rows, cols = torch.meshgrid(pos, pos, indexing="ij")

    def emb(p):
        out = p.reshape(-1)[:, None] * omega[None]
        return torch.cat([torch.sin(out), torch.cos(out)], dim=1)

    return torch.cat([emb(cols), emb(rows)], dim=1).float()


def test_sincos_square_grid_is_unchanged_and_2x1_is_the_formula():
    assert torch.equal(sincos_pos_embed_2d(32, 4), _sincos_as_before(32, 4))
    assert torch.equal(sincos_pos_embed_2d(32, (4, 4)), _sincos_as_before(32, 4))
    # a 2x1 grid (2 rows, 1 column): token t at row t, column 0; channels [col sin, col cos, row sin, row cos]
    dim = 8
    w = [1.0, 1.0 / 100]  # 1 / 10000^(i / (dim/4)), i = 0, 1
    got = sincos_pos_embed_2d(dim, (2, 1))
    for t in range(2):
        want = [0.0, 0.0, 1.0, 1.0] + [math.sin(t * w[0]), math.sin(t * w[1]), math.cos(t * w[0]), math.cos(t * w[1])]
        assert torch.allclose(got[t], torch.tensor(want), atol=1e-7), (t, got[t])
    # a 1x2 grid is the transpose: the column half moves, the row half stays at 0
    assert torch.equal(sincos_pos_embed_2d(dim, (1, 2))[:, :4], got[:, 4:])


def test_rope_tables_per_grid():
    head_dim = 8
    cos, sin = rope_table(head_dim, (2, 3))
    assert cos.shape == sin.shape == (6, head_dim)
    freqs = [1.0, 1.0 / 100]  # theta^(-2i / (head_dim/2)), one per pair, i = 0, 1
    for t in range(6):
        r, c = divmod(t, 3)  # row-major over 3 columns
        angles = [r * f for f in freqs for _ in range(2)] + [c * f for f in freqs for _ in range(2)]
        assert torch.allclose(cos[t], torch.tensor(angles).cos(), atol=1e-7)
        assert torch.allclose(sin[t], torch.tensor(angles).sin(), atol=1e-7)
    square = rope_table(head_dim, 3)
    assert all(torch.equal(a, b) for a, b in zip(square, rope_table(head_dim, (3, 3)), strict=True))


@pytest.mark.parametrize("pos", ["sincos", "rope"])
def test_the_dit_takes_any_token_grid(pos):
    torch.manual_seed(0)
    cfg = get_config("custom:hidden=32,depth=2,heads=2,patch=2,pos=" + pos, input_size=8, in_channels=3, num_classes=3)
    model = DiT(cfg).eval()
    for p in model.final_layer.parameters():  # adaLN-Zero outputs exactly 0: make it depend on the input
        torch.nn.init.normal_(p, std=0.1)
    t, y = torch.tensor([3, 500]), torch.tensor([0, 2])
    for h, w in ((8, 8), (8, 16), (12, 4)):
        x = torch.randn(2, 3, h, w)
        assert model(x, t, y=y).shape == (2, 6, h, w)
    if pos == "sincos":
        # the square grid uses the checkpoint's pos_embed itself; another grid, the formula's table
        assert model.pos_table((4, 4), x) is model.pos_embed
        assert torch.equal(model.pos_table((4, 8), x)[0], sincos_pos_embed_2d(32, (4, 8)))
    # unpatchify is patchify's inverse on a non-square grid: token (i, j) holds patch (i, j)
    x = torch.randn(2, 3, 4, 6)
    tokens = x.unfold(2, 2, 2).unfold(3, 2, 2)  # (N, C, h, w, p, p)
    tokens = tokens.permute(0, 2, 3, 4, 5, 1).reshape(2, 6, 2 * 2 * 3)  # (N, T, p*p*C), row-major
    model.out_channels = 3
    assert torch.equal(model.unpatchify(tokens, (2, 3)), x)


# ----------------------------------------------------------------------------- the loader


def _bucket_sequence(loader, n: int) -> list[int]:
    return [loader.bucket_of(k) for k in range(n)]


def test_every_batch_is_one_bucket_in_proportion(bstore):
    loader = build_loader(bstore, batch_size=4, seed=1)
    assert isinstance(loader, BucketedLoader) and loader.kind == "bucketed" and "bucketed" in loader.reason
    names = [b.name for b in loader.buckets]  # sorted: 16x8, 8x16, 8x8
    per_epoch = loader.batches_per_epoch
    assert loader.bucket_batches == [3, 2, 5] and per_epoch == 10  # ceil(n / 4): pad
    batches = take(loader, 3 * per_epoch)
    shapes = collections.Counter(tuple(b["x"].shape) for b in batches)
    assert shapes == {(4, 3, 8, 16): 9, (4, 3, 16, 8): 6, (4, 3, 8, 8): 15}, shapes
    seq = _bucket_sequence(loader, 3 * per_epoch)
    for b, batch in zip(seq, batches, strict=True):  # the batch is the bucket's shape
        w, h = map(int, names[b].split("x"))
        assert batch["x"].shape[2:] == (h, w)
    # in proportion within each epoch, spread over it (not bucket after bucket), a new order each epoch
    for e in range(3):
        assert collections.Counter(seq[e * per_epoch:(e + 1) * per_epoch]) == {0: 3, 1: 2, 2: 5}
    runs = sum(1 for i in range(1, per_epoch) if seq[i] != seq[i - 1])
    assert runs > 2 and seq[:per_epoch] != seq[per_epoch:2 * per_epoch]


def _epoch_indices(store, remainder: str, batch_size: int = 8) -> tuple[BucketedLoader, dict]:
    loader = BucketedLoader(store, batch_size=batch_size, seed=5, with_index=True, remainder=remainder)
    seen = collections.defaultdict(list)
    for k in range(loader.batches_per_epoch):
        b = loader.bucket_of(k)
        batch = next(loader)
        seen[loader.buckets[b].name] += batch["index"].tolist()
    return loader, seen


def test_pad_sees_every_sample_and_drop_drops_the_remainder(bstore, tmp_path):
    loader, seen = _epoch_indices(bstore, "pad")
    assert loader.bucket_batches == [2, 1, 3]  # ceil(12/8), ceil(5/8), ceil(20/8)
    for b, n in zip(loader.buckets, loader.counts, strict=True):
        got = seen[b.name]
        assert len(got) % 8 == 0 and sorted(set(got)) == list(range(n))  # every sample, repeats to fill
        assert len(got) - n == -n % 8
    loader, seen = _epoch_indices(bstore, "drop")
    assert loader.bucket_batches == [1, 0, 2]  # the 8x16 bucket (5 < 8) gives no batch
    for b, n in zip(loader.buckets, loader.counts, strict=True):
        got = seen[b.name]
        assert len(got) == n // 8 * 8 and len(set(got)) == len(got)  # no repeats
    small = bucketed_store(tmp_path / "small", {(8, 8): 3, (16, 8): 2})
    assert "--bucket-remainder pad" in raises_one_line(
        LoaderError, lambda: BucketedLoader(small, batch_size=4, remainder="drop"))
    padded = take(BucketedLoader(small, batch_size=4, with_index=True), 2)  # a bucket smaller than a batch: cycled
    assert all(len(b["index"]) == 4 for b in padded)


def test_flips_are_the_stored_twins_and_change_between_epochs(bstore):
    loader = BucketedLoader(bstore, batch_size=4, seed=2, with_index=True)
    stores = {b.name: b.store for b in loader.buckets}
    flips = collections.defaultdict(set)
    for k in range(2 * loader.batches_per_epoch):
        name = loader.buckets[loader.bucket_of(k)].name
        batch = next(loader)
        data = stores[name].read(stores[name].shards[0], fields=["latent", "latent_flip"])
        for i, f, x in zip(batch["index"].tolist(), batch["flip"].tolist(), batch["x"], strict=True):
            want = data["latent_flip" if f else "latent"][i].astype(np.float32)
            assert np.array_equal(x.numpy(), want)
            flips[(name, i)].add(f)
    assert any(len(v) == 2 for v in flips.values())  # a sample's coin is drawn again each epoch


def test_mean_std_buckets_draw_fresh_samples_each_epoch_and_resume_them(tmp_path):
    info = pixels_info(8, class_conditioning(["a", "b", "c"]))
    for w, h in ((8, 8), (16, 8)):
        sch = schema(kind="mean_std", flip=False, text=False, shape=(3, h, w))  # shard_data's columns and values
        write_store(tmp_path / "buckets" / f"{w}x{h}", sch, [6], info=info)
    finalize_buckets(tmp_path, info, area=8, step=8)
    loader = BucketedLoader(tmp_path, batch_size=3, seed=1, with_index=True)
    per = loader.batches_per_epoch
    eps = collections.defaultdict(list)  # (bucket, index) -> eps of each epoch
    for k in range(2 * per):
        bucket = loader.buckets[loader.bucket_of(k)]
        data = bucket.store.read(bucket.store.shards[0], fields=["mean", "std"])
        batch = next(loader)
        for i, x in zip(batch["index"].tolist(), batch["x"], strict=True):
            mean, std = (torch.from_numpy(data[f][i].astype(np.float32)) for f in ("mean", "std"))
            eps[(bucket.name, i)].append((x - mean) / std)
    assert len(eps) == 12 and all(len(v) == 2 and not torch.allclose(v[0], v[1]) for v in eps.values())
    again = BucketedLoader(tmp_path, batch_size=3, seed=1)
    again.load_state_dict({**loader.state_dict(), "batches": per + 1})
    replay = BucketedLoader(tmp_path, batch_size=3, seed=1)
    take(replay, per + 1)
    assert torch.equal(next(again)["x"], next(replay)["x"])  # the same draw at resume


def test_resume_from_any_batch_and_ranks_split_each_batch(bstore):
    whole = take(BucketedLoader(bstore, batch_size=4, seed=7, with_index=True), 25)
    first = BucketedLoader(bstore, batch_size=4, seed=7, with_index=True)
    take(first, 13)
    state = first.state_dict()
    assert state["kind"] == "bucketed" and state["batches"] == 13
    resumed = BucketedLoader(bstore, batch_size=4, seed=7, with_index=True)
    resumed.load_state_dict(state)
    for a, b in zip(whole[13:], take(resumed, 12), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
    other = dict(state, remainder="drop")
    assert "remainder" in raises_one_line(Exception, lambda: resumed.load_state_dict(other))
    # two ranks of batch 2: the rows [0, 2) and [2, 4) of the one-process batch of 4, same bucket
    ranks = [take(BucketedLoader(bstore, batch_size=2, seed=7, rank=r, world_size=2, with_index=True), 25)
             for r in range(2)]
    for one, r0, r1 in zip(whole, *ranks, strict=True):
        assert torch.equal(one["x"], torch.cat([r0["x"], r1["x"]]))
        assert torch.equal(one["index"], torch.cat([r0["index"], r1["index"]]))


def test_streaming_a_bucketed_store_is_refused(bstore):
    msg = raises_one_line(LoaderError, lambda: build_loader(bstore, LoaderConfig(kind="streaming"), batch_size=4))
    assert "bucketed store" in msg and "--loader auto or resident" in msg
    assert build_loader(bstore, LoaderConfig(kind="resident"), batch_size=4).kind == "bucketed"


# ----------------------------------------------------------------------------- dittrain run / sample / serve


def test_run_logs_each_batch_shape_and_resumes_exactly_after_sigkill(bstore, tmp_path):
    steps, half = 30, 14
    common = ["--max-steps", steps, "--save-every", half, "--lr", "1e-3", "--ema", "0.9", "--batch-size", 4]
    err = resume_after_sigkill(bstore, tmp_path, common, steps=steps, half=half)
    assert "loader bucketed" in err and "aspect-ratio buckets: 3 buckets" in err
    assert "16x8 (3x8x16, 12 samples, 3 batches)" in err and "batch 4x3x" in err
    rows = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    shapes = collections.Counter(r["batch_shape"] for r in rows)
    assert set(shapes) == {"4x3x8x8", "4x3x8x16", "4x3x16x8"} and sum(shapes.values()) == steps
    assert_same_state(load_checkpoint(latest_checkpoint(tmp_path / "straight")),
                      load_checkpoint(latest_checkpoint(tmp_path / "killed")))
    config = json.loads((tmp_path / "straight" / "config.json").read_text())
    assert config["model"]["input_size"] == 8 and config["train"]["data"]["bucket_remainder"] == "pad"
    assert [(b["name"], b["latent_shape"], b["num_samples"]) for b in config["store"]["buckets"]] == [
        ("16x8", [3, 8, 16], 12), ("8x16", [3, 16, 8], 5), ("8x8", [3, 8, 8], 20)]


@pytest.fixture(scope="module")
def bucket_run(bstore, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bucket-run") / "run"
    ok(dittrain(*run_args(bstore, out, "--max-steps", 3, "--batch-size", 4)))
    return out


def test_sample_at_two_bucket_sizes_and_refuse_others(bucket_run, tmp_path):
    for size, hw in (("16x8", (8, 16)), ("8x16", (16, 8))):
        out = tmp_path / f"{size}.png"
        r = ok(dittrain("sample", "--ckpt", bucket_run, "--size", size, "--n", 2, "--steps", 2, "--device", "cpu",
                        "--out", out), f"at {size} px")
        singles = sorted((tmp_path / size).glob("*.png"))
        assert len(singles) == 2 and all(read_png(p).shape == (*hw, 3) for p in singles), r.output
        assert json.loads((tmp_path / size / "samples.json").read_text())["size"] == size
    ok(dittrain("sample", "--ckpt", bucket_run, "--n", 1, "--steps", 2, "--device", "cpu", "--out", tmp_path / "d.png"),
       "at 8x8 px")  # the default: the square bucket
    line = one_error_line(dittrain("sample", "--ckpt", bucket_run, "--size", "9x9", "--out", tmp_path / "x.png").output)
    assert "--size 9x9" in line and "16x8, 8x16, 8x8" in line
    line = one_error_line(dittrain("sample", "--ckpt", bucket_run, "--size", "16x8", "--npz", tmp_path / "x.npz").output)
    assert "--npz" in line


def test_size_on_a_plain_run_is_refused(tmp_path):
    from storeutil import tiny_store
    from test_sample import make_run

    run = make_run(tmp_path / "run", tiny_store(tmp_path / "store"))
    line = one_error_line(dittrain("sample", "--ckpt", run, "--size", "16x16", "--out", tmp_path / "x.png").output)
    assert "--size 16x16" in line and "without aspect-ratio buckets" in line


def test_serve_offers_the_bucket_sizes(bucket_run, tmp_path):
    from dittrain.config import ServeConfig
    from dittrain.inference.serve import Request, Server

    server = Server(bucket_run, ServeConfig(device="cpu", batch_size=2, max_images=4), log=lambda line: None)
    assert server.sizes == ["16x8", "8x16", "8x8"] and server.default_size == "8x8" and server.image_size == (8, 8)
    out = server.generate(Request(choice="1", n=2, steps=2, seed=3, size="8x16"))
    assert out.ok and out.images.shape == (2, 16, 8, 3) and "--size 8x16" in out.command, out.message
    bad = server.generate(Request(choice="1", n=1, steps=2, seed=3, size="7x7"))
    assert not bad.ok and "16x8, 8x16, 8x8" in bad.message
    pytest.importorskip("gradio")
    from dittrain.inference.serve import build_app

    by_id = {c.get("props", {}).get("elem_id"): c for c in build_app(server).config["components"]}
    assert [c[1] for c in by_id["size"]["props"]["choices"]] == ["16x8", "8x16", "8x8"]
    assert by_id["size"]["props"]["value"] == "8x8"



def test_text_buckets_carry_each_rows_embeddings_and_train(tmp_path):
    store = bucketed_store(tmp_path / "text", {(8, 8): 5, (16, 8): 4}, text={"pooled": 16, "tokens": (5, 16)})
    loader = BucketedLoader(store, batch_size=3, seed=4, with_index=True)
    fields = ("text_pooled", "text_tokens", "text_mask")
    seen = set()
    for k in range(2 * loader.batches_per_epoch):
        bucket = loader.buckets[loader.bucket_of(k)]
        data = bucket.store.read(bucket.store.shards[0], fields=list(fields))
        batch = next(loader)
        for f in fields:  # each row's own caption embedding, from its own bucket's store
            want = np.stack([data[f][i] for i in batch["index"].tolist()])
            assert np.array_equal(batch[f].float().numpy(), want.astype(np.float32)), (bucket.name, f)
        seen.add(tuple(batch["x"].shape))
    assert seen == {(3, 3, 8, 8), (3, 3, 8, 16)}
    run = tmp_path / "run"
    ok(dittrain(*run_args(store, run, "--max-steps", 4, "--batch-size", 3, "--caption-dropout", 0.5)))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and {r["batch_shape"] for r in rows} <= {"3x3x8x8", "3x3x8x16"} and all(np.isfinite(r["loss"]) for r in rows)

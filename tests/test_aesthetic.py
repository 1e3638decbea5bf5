"""ditdata/scoring/aesthetic.py and `ditdata score --aesthetic / --save-embeddings`: the LAION
aesthetic predictor read from its keys equals a numpy computation, the width is checked,
the embeddings and scores are stored beside the CLIP score and resumable."""

from __future__ import annotations

import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest
from cliutil import ditdata as run_cli
from cliutil import ok

torch = pytest.importorskip("torch")
pytest.importorskip("open_clip")

from test_score import caption_shards, read_all  # noqa: E402

from ditdata.common.files import sha256_file  # noqa: E402
from ditdata.errors import DitdataError  # noqa: E402
from ditdata.imageshards import folder as imageshards  # noqa: E402
from ditdata.imageshards.scores import read_embeddings, read_score_meta, score_path  # noqa: E402
from ditdata.scoring.aesthetic import load_predictor  # noqa: E402

MLP_WIDTHS = [768, 1024, 128, 64, 16, 1]  # the improved aesthetic predictor's


def mlp_state_dict(widths, seed=0) -> dict:
    """A state dict with the improved predictor's key layout: layers.0, .2, .4, .6, .7 (the
    odd indices are its dropouts)."""
    g = torch.Generator().manual_seed(seed)
    index = [0, 2, 4, 6, 7] if len(widths) == 6 else list(range(0, 2 * len(widths) - 2, 2))
    sd = {}
    for i, (a, b) in zip(index, zip(widths[:-1], widths[1:], strict=True), strict=True):
        sd[f"layers.{i}.weight"] = torch.randn(b, a, generator=g) / a ** 0.5
        sd[f"layers.{i}.bias"] = torch.randn(b, generator=g) * 0.1
    return sd


def by_hand(sd: dict, x: np.ndarray) -> np.ndarray:
    """The affine chain layers.N in float64 numpy, by N (no activation), for (B, D) rows."""
    y = x.astype(np.float64)
    for n in sorted({int(k.split(".")[1]) for k in sd}):
        y = y @ sd[f"layers.{n}.weight"].double().numpy().T + sd[f"layers.{n}.bias"].double().numpy()
    return y[:, 0]


def unit_rows(n, d, seed=1) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_mlp_and_linear_heads_equal_a_hand_computation(tmp_path):
    x = unit_rows(5, 768)
    mlp = mlp_state_dict(MLP_WIDTHS)
    torch.save(mlp, tmp_path / "mlp.pth")
    pred = load_predictor(tmp_path / "mlp.pth")
    assert pred.kind == "mlp" and pred.widths == MLP_WIDTHS and pred.in_dim == 768
    assert pred.sha256 == sha256_file(tmp_path / "mlp.pth")
    np.testing.assert_allclose(pred(x).numpy(), by_hand(mlp, x), rtol=1e-5, atol=1e-5)

    g = torch.Generator().manual_seed(3)
    linear = {"weight": torch.randn(1, 768, generator=g), "bias": torch.tensor([5.0])}
    torch.save({"state_dict": linear}, tmp_path / "linear.pth")  # a checkpoint wrapping it
    pred = load_predictor(tmp_path / "linear.pth")
    assert pred.kind == "linear" and pred.widths == [768, 1]
    expect = x.astype(np.float64) @ linear["weight"].double().numpy()[0] + 5.0
    np.testing.assert_allclose(pred(x).numpy(), expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sd, says", [
    ({"layers.0.weight": torch.zeros(4, 8), "layers.0.bias": torch.zeros(4), "norm.running_mean": torch.zeros(4)},
     "unexpected key 'norm.running_mean'"),
    ({"layers.0.weight": torch.zeros(4, 8), "layers.0.bias": torch.zeros(4), "fc.weight": torch.zeros(1, 4),
      "fc.bias": torch.zeros(1)}, "layers under several prefixes"),
    ({"layers.0.weight": torch.zeros(4, 8), "layers.0.bias": torch.zeros(4),
      "layers.2.weight": torch.zeros(1, 5), "layers.2.bias": torch.zeros(1)}, "takes 5 inputs"),
    ({"weight": torch.zeros(2, 8), "bias": torch.zeros(2)}, "gives 2 outputs"),
    ({"layers.0.weight": torch.zeros(1, 8)}, "not a linear layer"),
    ({"embed.pos": torch.zeros(3)}, "unexpected key 'embed.pos'"),
])
def test_not_a_predictor_is_refused(tmp_path, sd, says):
    torch.save(sd, tmp_path / "p.pth")
    with pytest.raises(DitdataError, match=says):
        load_predictor(tmp_path / "p.pth")
    with pytest.raises(DitdataError, match="not found"):
        load_predictor(tmp_path / "nope.pth")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from test_clip import tiny_clip_files

    return tiny_clip_files(tmp_path_factory.mktemp("clip"))


def score_args(folder, tiny, *extra):
    config, weights = tiny
    return ("score", folder, "--clip-config", config, "--pretrained", weights, "--device", "cpu",
            "--batch-size", 4, "--threads", 0, "--quiet", *extra)


def test_predictor_width_must_match_the_clip_model(tiny, tmp_path):
    torch.save(mlp_state_dict(MLP_WIDTHS), tmp_path / "l14.pth")
    r = run_cli(*score_args(caption_shards(tmp_path / "a"), tiny, "--aesthetic", tmp_path / "l14.pth"))
    assert r.exit_code == 1
    line = r.output.strip()
    assert "\n" not in line and "takes 768-wide embeddings" in line and "tiny-clip gives 32-wide" in line, line


def test_score_keeps_embeddings_and_aesthetic_scores(tiny, tmp_path):
    config, weights = tiny
    sd = mlp_state_dict([32, 16, 8, 1])
    torch.save(sd, tmp_path / "p32.pth")
    a = caption_shards(tmp_path / "a")
    plain = tmp_path / "plain"
    shutil.copytree(a, plain)
    ok(run_cli(*score_args(a, tiny, "--save-embeddings", "--aesthetic", tmp_path / "p32.pth")),
       "image embeddings saved in 2 of 2 shard(s)", "aesthetic scores: mlp 32-16-8-1")

    from ditdata.clip import load_clip

    clip = load_clip("tiny-clip", str(weights), config=str(config))
    rows = read_all(a)
    samples = [s for tar in imageshards.list_shards(a) for s in imageshards.iter_shard(tar)]
    stored = []
    for tar in imageshards.list_shards(a):
        meta = read_score_meta(score_path(tar))
        assert meta["embeddings"] == {"dim": 32, "dtype": "float16", "normalized": True}
        assert meta["aesthetic"]["sha256"] == sha256_file(tmp_path / "p32.pth")
        assert meta["aesthetic"]["widths"] == [32, 16, 8, 1]
        stored.append(read_embeddings(score_path(tar), meta["num_samples"], 32))
    emb = np.concatenate([e for e, _ in stored])
    has = np.concatenate([v for _, v in stored])
    for s, row, e, h in zip(samples, rows, emb, has, strict=True):
        assert h == (row["clip_score"] is not None)
        if not h:
            assert row["aesthetic"] is None and row["image_embedding"] is None
            continue
        ref = clip.embed_images([s.decode()]).numpy()  # fp32 on the CPU
        np.testing.assert_allclose(e.astype(np.float32), ref[0], atol=2e-3)  # stored in float16
        assert row["aesthetic"] == pytest.approx(float(by_hand(sd, ref)[0]), abs=1e-5)

    # resumable: the same flags skip every shard; a plain score file is scored again for embeddings
    ok(run_cli(*score_args(a, tiny, "--save-embeddings", "--aesthetic", tmp_path / "p32.pth")),
       "skipped 2 shard(s)")
    ok(run_cli(*score_args(plain, tiny)), "scored 2 shard(s)")
    assert "image_embedding" not in pq.read_schema(score_path(imageshards.list_shards(plain)[0])).names
    ok(run_cli(*score_args(plain, tiny, "--save-embeddings")), "scored 2 shard(s)", "embeddings saved in 2 of 2")
    ok(run_cli(*score_args(plain, tiny, "--save-embeddings")), "skipped 2 shard(s)")

    # another predictor file is never mixed in silently
    torch.save(mlp_state_dict([32, 16, 8, 1], seed=5), tmp_path / "other.pth")
    r = run_cli(*score_args(a, tiny, "--aesthetic", tmp_path / "other.pth"))
    assert r.exit_code == 1 and "aesthetic scores of another predictor" in r.output and "--overwrite" in r.output

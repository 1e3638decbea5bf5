"""dittrain.train.repa and `dittrain run --repa SET`: the loss against a hand computation, the hidden
tokens of the model, the projector training, exact resume, what is exported (nothing of the
projector), the one-line refusals and the --config round trip."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from cliutil import (
    assert_close_checkpoints,
    assert_has,
    losses,
    one_and_two_ranks,
    one_error_line,
    resume_after_sigkill,
    run_args,
)
from cliutil import dittrain as cli
from storeutil import CREATED_AT, add_features, make_store
from test_step import no_host_reads
from tiny import step_inputs

from dittrain.config import TrainConfig
from dittrain.data import targets as data_targets
from dittrain.diffusion import Diffusion, DiffusionConfig
from dittrain.inference.weights import load_weights
from dittrain.model.dit import DiT
from dittrain.model.sizes import DiTConfig, get_config
from dittrain.rundir import latest_checkpoint, load_checkpoint
from dittrain.train.optim import build_optimizer
from dittrain.train.repa import Alignment, Projector, alignment_loss, build_projector, resize_targets
from dittrain.train.step import TrainStep

pytestmark = pytest.mark.usefixtures("one_thread")
REPA = ["--repa", "feats", "--repa-depth", 2, "--repa-projector-dim", 32]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """A 48-latent 3x8x8 store (DiT-T/4: a 2x2 token grid) with feature set feats (4x4 tokens,
    8 dims, int8) and pos, whose targets are one vector per token position (and noise), and pca
    (PCA_DIMS coordinates of a PCA_WIDTH-dim encoder)."""
    root = make_store(tmp_path_factory.mktemp("store") / "s")
    add_features(root, "feats", tokens=16, dims=8)
    positional_features(root, "pos")
    pca_features(root, "pca")
    return root


PCA_DIMS, PCA_WIDTH = 4, 12  # a PCA set's stored dims K and its encoder's width Dy


def pca_arrays(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(components (K, Dy) with orthonormal rows, mean (Dy,)) float32, as ditdata.features.pca fits them."""
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.standard_normal((PCA_WIDTH, PCA_DIMS)))
    return q.T.astype(np.float32), rng.standard_normal(PCA_WIDTH).astype(np.float32)


def pca_features(root: Path, name: str, *, dtype: str = "int8") -> None:
    """Feature set `name` stored as PCA_DIMS coordinates (4x4 tokens), its storage["pca"] as
    ditdata.features.targets._storage writes it (components and mean in encode_array's format)."""
    from storeutil import FEATURE_INFO

    from ditdata.store import encode_array

    comps, mean = pca_arrays()
    info = {"encoder": {**FEATURE_INFO["encoder"], "dim": PCA_WIDTH},
            "storage": {**FEATURE_INFO["storage"], "dtype": dtype, "dims": PCA_DIMS, "cosine_to_fp32": 0.95,
                        "pca": {"components": encode_array(comps), "mean": encode_array(mean),
                                "explained_variance": 0.9}}}
    add_features(root, name, tokens=16, dims=PCA_DIMS, dtype=dtype, info=info)


def positional_features(root: Path, name: str, *, tokens: int = 4, dims: int = 8, noise: float = 0.1) -> None:
    """Feature set `name`: token t of every sample is base[t] plus a little noise, on a 2x2 grid
    (the model's), so a projector can learn them from the position embedding."""
    from ditdata.store import FeatureSchema, FeatureWriter, open_store, quantize

    store, rng = open_store(root), np.random.default_rng(0)
    base = rng.standard_normal((tokens, dims))
    info = {"encoder": {"name": "positions", "grid": [2, 2], "tokens": tokens, "dim": dims},
            "storage": {"dtype": "int8", "dims": dims, "pca": None}}
    w = FeatureWriter(store, name, schema=FeatureSchema.build(tokens, dims, "int8", store.schema.flip), info=info)
    for s in store.shards:
        keys = store.read(s.name, ["key"])["key"].tolist()
        x = (base + noise * rng.standard_normal((len(keys), tokens, dims))).astype(np.float32)
        flipped = x.reshape(len(keys), 2, 2, dims)[:, :, ::-1].reshape(x.shape)
        tensors = {}
        for field, v in (("feat", x), ("feat_flip", flipped))[:2 if store.schema.flip else 1]:
            tensors[field], tensors[f"{field}_scale"] = quantize(v)
        w.write_shard(s.name, tensors, {"key": keys})
    w.finalize(created_at=CREATED_AT)


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------- the loss and the model


def test_the_loss_is_one_minus_the_cosine_by_hand():
    """A projector with fixed weights, hidden tokens and targets: the loss and the mean cosine
    as numpy computes them from the formulas (SiLU MLP, cosine, mean over batch and tokens)."""
    g = torch.Generator().manual_seed(0)
    proj = Projector(6, 5, 3)
    with torch.no_grad():
        for p in proj.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    hidden, target = torch.randn((2, 4, 6), generator=g), torch.randn((2, 4, 3), generator=g)
    align = Alignment(proj, proj, depth=1, weight=0.5, grid=(2, 2), target_grid=(2, 2))
    loss, cos = align.loss(hidden, target)

    w = [p.detach().double().numpy() for p in proj.parameters()]  # W1, b1, W2, b2, W3, b3

    def silu(z):
        return z / (1 + np.exp(-z))

    h = hidden.double().numpy()
    y = silu(silu(h @ w[0].T + w[1]) @ w[2].T + w[3]) @ w[4].T + w[5]  # (2, 4, 3)
    t = target.double().numpy()
    cosine = (y * t).sum(-1) / (np.linalg.norm(y, axis=-1) * np.linalg.norm(t, axis=-1))  # (2, 4)
    assert loss.item() == pytest.approx(np.mean(1 - cosine), rel=1e-5)
    assert cos.item() == pytest.approx(np.mean(cosine), rel=1e-5)
    assert loss.requires_grad and not cos.requires_grad


def test_pca_coordinates_are_rebuilt_to_the_encoders_tokens_before_the_cosine():
    """y = c W + m (numpy, float64) of the stored coordinates c, then 1 - cos against the
    projection: the loss of an Alignment given the PCA; under autocast still in fp32; resized
    coordinates rebuilt equal rebuilt targets resized (the resize and the affine map commute)."""
    from dittrain.train.repa import reconstruct

    g = torch.Generator().manual_seed(1)
    comps, mean = pca_arrays()
    pca = (torch.from_numpy(comps), torch.from_numpy(mean))
    coords = torch.randn((2, 4, PCA_DIMS), generator=g)
    y = coords.double().numpy() @ comps.astype(np.float64) + mean.astype(np.float64)  # (2, 4, 12)
    np.testing.assert_allclose(reconstruct(coords, pca).numpy(), y, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rebuilt = reconstruct(coords, pca)
    assert rebuilt.dtype == torch.float32
    np.testing.assert_allclose(rebuilt.numpy(), y, atol=1e-5)

    proj = Projector(6, 5, PCA_WIDTH)
    hidden = torch.randn((2, 4, 6), generator=g)
    align = Alignment(proj, proj, depth=1, weight=1.0, grid=(2, 2), target_grid=(2, 2), pca=pca)
    loss, cos = align.loss(hidden, coords)
    with torch.no_grad():
        p = proj(hidden).double().numpy()
    cosine = (p * y).sum(-1) / (np.linalg.norm(p, axis=-1) * np.linalg.norm(y, axis=-1))
    assert loss.item() == pytest.approx(np.mean(1 - cosine), rel=1e-5)
    assert cos.item() == pytest.approx(np.mean(cosine), rel=1e-5)
    # on a 4x4 set and the model's 2x2 grid: resizing the coordinates first changes nothing
    fine = torch.randn((2, 16, PCA_DIMS), generator=g)
    align = Alignment(proj, proj, depth=1, weight=1.0, grid=(2, 2), target_grid=(4, 4), pca=pca)
    want = resize_targets(reconstruct(fine, pca), (4, 4), (2, 2))
    assert align.loss(hidden, fine)[0].item() == pytest.approx(alignment_loss(proj(hidden), want)[0].item(), rel=1e-5)


def test_targets_are_resized_bilinearly_per_channel_on_the_token_grid():
    # (1, 4 tokens on 2x2, 2 channels): channel 0 holds a, b along a row, channel 1 their negatives
    a, b = 1.0, 5.0
    feat = torch.tensor([[[a, -a], [b, -b], [a, -a], [b, -b]]])
    up = resize_targets(feat, (2, 2), (4, 4))  # align_corners=False: a, 3/4 a + 1/4 b, 1/4 a + 3/4 b, b
    row = torch.tensor([a, 0.75 * a + 0.25 * b, 0.25 * a + 0.75 * b, b])
    assert up.shape == (1, 16, 2)
    assert torch.allclose(up[0, :, 0], row.repeat(4)) and torch.allclose(up[0, :, 1], -row.repeat(4))
    const = torch.arange(3.0).expand(1, 16, 3)
    assert torch.allclose(resize_targets(const, (4, 4), (2, 2)), const[:, :4])  # shrinking keeps a constant
    assert resize_targets(feat, (2, 2), (2, 2)) is feat


def _tiny_dit(learn_sigma: bool = True, **kw) -> DiT:
    torch.manual_seed(0)
    model = DiT(get_config("DiT-T/4", input_size=8, in_channels=4, num_classes=3, learn_sigma=learn_sigma, **kw))
    with torch.no_grad():  # adaLN-Zero starts every block as the identity: make them do something
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("checkpointing", ["none", "every"])
def test_hidden_tokens_are_those_of_a_block_by_block_forward(checkpointing):
    model = _tiny_dit(grad_checkpointing=checkpointing).train()
    keys = list(model.state_dict())
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([3.0, 700.0]), torch.tensor([0, 2])
    drop = torch.zeros(2, dtype=torch.bool)
    plain = model(x, t, y, force_drop_ids=drop)
    for k in (1, 3, len(model.blocks)):
        out, hidden = model(x, t, y, force_drop_ids=drop, return_hidden=k)
        assert torch.equal(out, plain)  # the output does not change
        h = model.x_embedder(x) + model.pos_embed
        c = model.t_embedder(t) + model.y_embedder(y, False, drop)
        for block in model.blocks[:k]:
            h = block(h, c)
        assert hidden.shape == (2, 4, model.config.hidden_size) and torch.allclose(hidden, h, atol=1e-6)
    assert list(model.state_dict()) == keys
    with pytest.raises(ValueError, match="has 6 blocks"):
        model(x, t, y, return_hidden=7)


def _repa_step(objective: str, weight: float) -> tuple[TrainStep, Alignment]:
    model = _tiny_dit(learn_sigma=objective == "ddpm")
    ema = DiT(model.config).requires_grad_(False)
    ema.load_state_dict(model.state_dict())
    proj = build_projector(model.config.hidden_size, 16, 8, seed=0)
    align = Alignment(proj, proj, depth=2, weight=weight, grid=(2, 2), target_grid=(4, 4))
    cfg = TrainConfig.from_flat(batch_size=4, lr=1e-2, objective=objective)
    params = [p for p in model.parameters() if p.requires_grad] + list(proj.parameters())
    opt = build_optimizer(cfg, params, torch.device("cpu"))
    diffusion = Diffusion(DiffusionConfig(objective=objective, learn_sigma=objective == "ddpm"))
    step = TrainStep(model=model, train_model=model, ema=ema, optimizer=opt, diffusion=diffusion, cfg=cfg,
                     scaler=torch.amp.GradScaler("cpu", enabled=False), gen=torch.Generator().manual_seed(1),
                     device=torch.device("cpu"), amp_dtype=None, terms=[align])
    return step, align


def _feat_batches():
    g = torch.Generator().manual_seed(0)
    while True:
        yield {"x": torch.randn((4, 4, 8, 8), generator=g), "y": torch.randint(0, 3, (4,), generator=g),
               "feat": torch.randn((4, 16, 8), generator=g)}


@pytest.mark.parametrize("objective", ["ddpm", "flow"])
def test_the_step_adds_weight_times_the_repa_loss_to_the_diffusion_loss(objective):
    """What the step's backward takes is the diffusion loss + weight x the REPA loss of the
    hidden tokens after the block (for both objectives), the projector steps with the model
    (one clipping norm), and the step reads nothing on the host."""
    step, align = _repa_step(objective, weight=0.5)
    batch = next(_feat_batches())
    x0, t, noise, kwargs = step_inputs(step, batch)
    total, loss, figures = step._losses(batch, x0, kwargs, t, noise)
    model = step.train_model
    want_loss = step.diffusion.training_loss(model, x0, kwargs, t=t, noise=noise).mean()
    x_t = step.diffusion.q_sample(x0, t, noise)
    _, hidden = model(x_t, step.diffusion.model_timesteps(t), **kwargs, return_hidden=2)
    repa_loss, cos = alignment_loss(align.projector(hidden), resize_targets(data_targets(batch), (4, 4), (2, 2)))
    assert torch.allclose(loss, want_loss) and torch.allclose(total, want_loss + 0.5 * repa_loss)
    assert list(figures) == ["repa_loss", "repa_cos"]
    assert torch.allclose(torch.stack(list(figures.values())), torch.stack([repa_loss, cos]))

    before = [p.detach().clone() for p in align.projector.parameters()]
    with no_host_reads():
        attempt = step.update(step.backward(_feat_batches()))
    assert attempt.settle() == (True, False) and list(attempt.metrics) == ["repa_loss", "repa_cos"]
    assert all(v.shape == () for v in attempt.metrics.values())
    assert all(not torch.equal(a, b) for a, b in zip(before, align.projector.parameters(), strict=True))
    assert len(step.params) == len([p for p in model.parameters() if p.requires_grad]) + 6


# ----------------------------------------------------------------------------- runs


def test_a_repa_run_logs_and_its_projector_learns(store, tmp_path):
    """--repa on a store whose targets the position embedding predicts: the REPA loss falls and
    the cosine rises; the figures are in metrics.jsonl and on the progress lines; the startup
    line says what is aligned to what (no resize: the set's grid is the model's)."""
    r = cli(*run_args(store, tmp_path / "r", "--max-steps", 40, "--lr", "2e-3", "--logger", "jsonl",
                      "--repa", "pos", "--repa-depth", 2, "--repa-projector-dim", 64))
    assert r.exit_code == 0, r.output
    assert_has(r.output, "repa: pos (encoder positions, 4 tokens x 8 dims int8), block 2 of 6, weight 0.5, "
                         "projector 192->64->64->8 (", "repa_loss ")
    assert "resized" not in r.output
    rows = _rows(tmp_path / "r")
    first, last = np.mean([r["repa_loss"] for r in rows[:5]]), np.mean([r["repa_loss"] for r in rows[-5:]])
    assert last < 0.7 * first, (first, last)
    assert rows[-1]["repa_cos"] > rows[0]["repa_cos"] and all("loss" in r and "repa_cos" in r for r in rows)
    config = json.loads((tmp_path / "r" / "config.json").read_text())
    assert config["train"]["repa"] == {"repa": "pos", "repa_depth": 2, "repa_weight": 0.5, "repa_projector_dim": 64,
                                       "repa_min_cosine": 0.9}
    features = config["store"]["features"]
    assert (features["name"], features["tokens"], features["dims"], features["grid"]) == ("pos", 4, 8, [2, 2])
    assert features["identity"] and features["identity"] != config["store"]["identity"]


def test_a_pca_set_is_aligned_at_the_encoders_width(store, tmp_path):
    """REPA aligns to the encoder's features: a set stored as PCA coordinates trains a projector
    to the encoder's width, against the coordinates rebuilt with the set's own components and mean;
    the record says so (a resume keeps it)."""
    from dittrain.train.losses import LOSS_TERMS

    out = tmp_path / "r"
    r = cli(*run_args(store, out, "--max-steps", 2, "--logger", "jsonl", "--repa", "pca", "--repa-depth", 2,
                      "--repa-projector-dim", 32))
    assert r.exit_code == 0, r.output
    assert_has(r.output, f"repa: pca (encoder test-encoder, 16 tokens x {PCA_DIMS} dims int8, rebuilt to the "
                         f"encoder's {PCA_WIDTH} dims from its PCA), block 2 of 6", f"projector 192->32->32->{PCA_WIDTH} (")
    projector = load_checkpoint(latest_checkpoint(out))["projector"]
    assert tuple(projector["4.weight"].shape) == (PCA_WIDTH, 32)  # Linear SiLU Linear SiLU Linear: the 5th
    config = json.loads((out / "config.json").read_text())
    record = config["store"]["features"]
    assert (record["dims"], record["targets"], record["target_dims"]) == (PCA_DIMS, "reconstructed", PCA_WIDTH)
    # the step's term rebuilds with exactly the set's arrays
    module = build_projector(192, 32, PCA_WIDTH, 0)
    term = LOSS_TERMS["repa"].build(TrainConfig.from_record(config["train"]), DiTConfig(**config["model"]), config,
                                    module, module)
    comps, mean = pca_arrays()
    assert np.array_equal(term.pca[0].numpy(), comps) and np.array_equal(term.pca[1].numpy(), mean)
    assert all(np.isfinite(row["repa_loss"]) for row in _rows(out))
    # a resume keeps the projector and the rebuilt targets
    r = cli("run", "--resume", "--out", out, "--max-steps", 3)
    assert r.exit_code == 0, r.output
    assert json.loads((out / "config.json").read_text())["store"]["features"]["targets"] == "reconstructed"


@pytest.mark.parametrize("bad, says", [("shape", "its PCA has components (3, 12) and mean (12,), not (4, dim)"),
                                        ("nan", "its PCA holds non-finite values")])
def test_a_pca_that_does_not_fit_is_refused(small_store, tmp_path, bad, says):
    from storeutil import FEATURE_INFO

    from ditdata.store import encode_array

    comps, mean = pca_arrays()
    comps = comps[:3] if bad == "shape" else np.where(np.arange(PCA_WIDTH) == 0, np.nan, comps).astype(np.float32)
    info = {"encoder": {**FEATURE_INFO["encoder"], "dim": PCA_WIDTH},
            "storage": {**FEATURE_INFO["storage"], "dims": PCA_DIMS, "cosine_to_fp32": 0.95,
                        "pca": {"components": encode_array(comps), "mean": encode_array(mean)}}}
    add_features(small_store, "bad", tokens=16, dims=PCA_DIMS, info=info)
    r = cli(*run_args(small_store, tmp_path / "r", "--max-steps", 1, "--repa", "bad", "--repa-depth", 2))
    assert says in one_error_line(r.output)
    assert not (tmp_path / "r").exists()


def test_the_plan_counts_a_pca_sets_projector_at_the_encoders_width(store):
    from ditdata.store import open_store
    from dittrain.train.losses import LOSS_TERMS

    cfg = TrainConfig.from_flat(latents=str(store), model="DiT-T/4", repa="pca", repa_depth=2, repa_projector_dim=32)
    model_cfg = get_config("DiT-T/4", input_size=8, in_channels=3)
    entry = LOSS_TERMS["repa"]
    assert entry.planned(cfg, model_cfg, open_store(store, features="pca")) == (2, 32, PCA_WIDTH)
    assert entry.planned(cfg, model_cfg, open_store(store, features="feats")) == (2, 32, 8)


def test_a_run_recorded_aligning_pca_coordinates_resumes_with_them(store, tmp_path, monkeypatch):
    """Runs recorded before the rebuilt targets aligned a PCA set's K coordinates and record
    neither "targets" nor "target_dims": a resume keeps that projector (K wide) and those targets."""
    from dittrain.train import repa as repa_mod

    out, real = tmp_path / "old", repa_mod.feature_record

    def as_recorded_before(store):  # the record of the code before: no "targets", no "target_dims"
        return {k: v for k, v in real(store).items() if k not in ("targets", "target_dims")}

    args = run_args(store, out, "--max-steps", 2, "--logger", "jsonl", "--repa", "pca", "--repa-depth", 2,
                    "--repa-projector-dim", 32)
    with monkeypatch.context() as m:
        m.setattr(repa_mod, "feature_record", as_recorded_before)
        assert cli(*args).exit_code == 0
    assert "targets" not in json.loads((out / "config.json").read_text())["store"]["features"]
    r = cli("run", "--resume", "--out", out, "--max-steps", 4)
    assert r.exit_code == 0, r.output
    assert f"projector 192->32->32->{PCA_DIMS} (" in r.output and "rebuilt" not in r.output
    record = json.loads((out / "config.json").read_text())["store"]["features"]
    assert (record["targets"], record["target_dims"]) == ("stored", PCA_DIMS)
    projector = load_checkpoint(latest_checkpoint(out))["projector"]
    assert tuple(projector["4.weight"].shape) == (PCA_DIMS, 32)
    assert [s for s, _ in losses(out)] == [1, 2, 3, 4]


def test_flow_with_repa_streamed_and_the_resize_line(store, tmp_path):
    r = cli(*run_args(store, tmp_path / "r", "--max-steps", 2, "--objective", "flow", "--logger", "jsonl", *REPA,
                      "--repa-weight", "2", "--loader", "streaming", "--workers", 1))
    assert r.exit_code == 0, r.output
    assert_has(r.output, "repa: feats (encoder test-encoder, 16 tokens x 8 dims int8), block 2 of 6, weight 2,",
               "targets resized from the encoder's 4x4 grid to the model's 2x2 (bilinear)")
    assert all(np.isfinite(r["repa_loss"]) for r in _rows(tmp_path / "r"))


def test_compiled_model_with_repa_matches_eager(store, tmp_path):
    """--compile model traces the forward that also returns the hidden tokens: the diffusion and
    REPA losses of eager within test_compile's stated tolerance (inductor reorders float sums)."""
    from test_compile import RTOL

    common = ["--max-steps", 3, "--lr", "1e-3", "--loader", "resident", "--logger", "jsonl", *REPA]
    for out, flags in (("eager", ["--no-compile"]), ("model", ["--compile", "model"])):
        r = cli(*run_args(store, tmp_path / out, *common, *flags))
        assert r.exit_code == 0, r.output
    a, b = _rows(tmp_path / "eager"), _rows(tmp_path / "model")
    for key in ("loss", "repa_loss"):
        np.testing.assert_allclose([r[key] for r in b], [r[key] for r in a], rtol=RTOL)


def test_exact_resume_with_repa(store, tmp_path):
    """Killed and resumed: the same losses (diffusion and REPA) at every step, and bitwise the
    same model, EMA, projector and optimizer state as a run never stopped."""
    steps, half = 60, 30
    common = ["--loader", "resident", "--max-steps", steps, "--save-every", half, "--lr", "1e-3", "--ema", "0.9",
              "--logger", "jsonl", *REPA]
    resume_after_sigkill(store, tmp_path, common, steps=steps, half=half)
    a, b = (load_checkpoint(latest_checkpoint(tmp_path / n)) for n in ("straight", "killed"))
    for part in ("model", "ema", "projector"):
        assert a[part].keys() == b[part].keys() and all(torch.equal(a[part][k], b[part][k]) for k in a[part]), part
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys() and len(sa) == len(a["model"]) - 1 + len(a["projector"])  # pos_embed is frozen
    assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])
    ra, rb = _rows(tmp_path / "straight"), _rows(tmp_path / "killed")
    assert [(r["repa_loss"], r["repa_cos"]) for r in ra] == [(r["repa_loss"], r["repa_cos"]) for r in rb]


def test_torchrun_two_ranks_match_single_process_with_repa(tmp_path):
    """2 DDP ranks (the model and the projector each in DDP, accumulation under both no_syncs,
    REPA's figures in the step's all-reduce) compute what one process does, on a store whose
    samples and targets are all alike (so the data partition cannot matter)."""
    store = make_store(tmp_path / "same", n=16, identical=True, flip=False)
    positional_features(store, "feats", noise=0.0)
    common = ["--max-steps", 4, "--save-every", 4, "--loader", "resident", "--lr", "1e-3", "--grad-clip", "0",
              "--accumulation-steps", 2, "--logger", "jsonl", *REPA]
    one_and_two_ranks(store, tmp_path, common)
    a, b = _rows(tmp_path / "one"), _rows(tmp_path / "two")
    for key in ("loss", "repa_loss", "repa_cos"):  # stated tolerance: the order of float reductions
        np.testing.assert_allclose([r[key] for r in a], [r[key] for r in b], rtol=1e-4, atol=1e-6)
    assert_close_checkpoints(tmp_path / "one", tmp_path / "two", ["model", "projector"], rtol=1e-4, atol=1e-5)


def test_nothing_of_the_projector_is_exported_and_sampling_is_unchanged(store, tmp_path):
    common = ["--max-steps", 2, "--logger", "jsonl"]
    assert cli(*run_args(store, tmp_path / "plain", *common)).exit_code == 0
    assert cli(*run_args(store, tmp_path / "repa", *common, *REPA)).exit_code == 0
    from safetensors import safe_open

    def keys(path):
        with safe_open(str(path), "pt") as f:
            return set(f.keys())

    assert keys(tmp_path / "repa" / "ema.safetensors") == keys(tmp_path / "plain" / "ema.safetensors")
    plain, repa = (load_checkpoint(latest_checkpoint(tmp_path / n)) for n in ("plain", "repa"))
    assert plain["ema"].keys() == repa["ema"].keys() and plain["model"].keys() == repa["model"].keys()
    assert "projector" in repa and "projector" not in plain
    assert set(repa["projector"]) == {f"{i}.{p}" for i in (0, 2, 4) for p in ("weight", "bias")}
    for source in (tmp_path / "repa", latest_checkpoint(tmp_path / "repa")):
        weights, _ = load_weights(source)
        assert set(weights) == set(plain["ema"])
    r = cli("sample", "--ckpt", tmp_path / "repa", "--out", tmp_path / "g.png", "--n", 2, "--steps", 2,
            "--device", "cpu", "--class", 0)
    assert r.exit_code == 0, r.output
    assert (tmp_path / "g.png").is_file()
    r = cli("export", "--ckpt", tmp_path / "repa", "--format", "fp16", "--out", tmp_path / "w.safetensors")
    assert r.exit_code == 0, r.output
    assert keys(tmp_path / "w.safetensors") == keys(tmp_path / "plain" / "ema.safetensors")
    pytest.importorskip("gradio")
    from dittrain.config import ServeConfig
    from dittrain.inference.serve import Request, Server

    served = Server(tmp_path / "repa", ServeConfig(device="cpu", batch_size=2, max_images=4), log=lambda line: None)
    out = served.generate(Request(choice="0", n=2, steps=2, cfg_scale=2.0, seed=0))
    assert out.ok, out.message
    assert out.images.shape[0] == 2


# ----------------------------------------------------------------------------- refusals and the record


@pytest.mark.parametrize(("extra", "says"), [
    (["--repa", "nope"], "no feature set 'nope' (it has: feats, pca, pos)"),
    ([*REPA, "--repa-depth", 30], "--repa-depth 30: the model DiT-T/4 has 6 blocks; choose 1..6"),
    ([*REPA, "--repa-depth", 0], "'--repa-depth': 0 is not in the range x>=1"),
    ([*REPA, "--repa-weight", -1], "'--repa-weight': -1.0 is not in the range x>=0"),
    ([*REPA, "--repa-weight", "nan"], "'--repa-weight'"),
    ([*REPA, "--repa-weight", "inf"], "'--repa-weight'"),
    (["--repa-depth", 4, "--repa-weight", 1], "--repa-depth, --repa-weight without --repa: name the feature set"),
])
def test_refusals_are_one_line_and_write_nothing(store, tmp_path, extra, says):
    r = cli(*run_args(store, tmp_path / "r", "--max-steps", 1, *extra))
    assert r.exit_code != 0 and says in one_error_line(r.output), r.output
    assert not (tmp_path / "r").exists()


@pytest.fixture
def small_store(tmp_path) -> Path:
    """A 12-latent store of the test's own (it may change it) with feature set feats."""
    root = make_store(tmp_path / "s", n=12)
    add_features(root, "feats")
    return root


def test_a_feature_set_whose_rows_do_not_match_is_refused(small_store, tmp_path):
    from ditdata.store import features

    path = small_store / "features" / "feats" / "manifest.json"
    fm = json.loads(path.read_text())
    fm["shards"][0]["num_samples"] -= 1
    fm["num_samples"] -= 1
    path.write_text(json.dumps(fm))
    sm = json.loads((small_store / "manifest.json").read_text())
    sm["features"]["feats"]["identity"] = features.identity(fm)  # a consistent record of the wrong rows
    (small_store / "manifest.json").write_text(json.dumps(sm))
    r = cli(*run_args(small_store, tmp_path / "r", "--max-steps", 1, *REPA))
    assert "its rows do not match the store's" in one_error_line(r.output)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(("cosine", "says"), [
    (0.5, "--repa low: its stored targets keep a mean cosine of 0.5000 to the encoder's fp32 output, below "
          "--repa-min-cosine 0.9"),
    (float("nan"), "--repa low: its manifest records cosine_to_fp32 nan"),
])
def test_a_set_whose_targets_lost_too_much_is_refused(small_store, tmp_path, cosine, says):
    """A set whose manifest records a low or non-finite cosine to fp32 is refused in one line,
    writing nothing; --repa-min-cosine 0 says to train on it anyway, and the run records that."""
    from storeutil import FEATURE_INFO

    info = {"encoder": FEATURE_INFO["encoder"], "storage": {**FEATURE_INFO["storage"], "cosine_to_fp32": cosine}}
    add_features(small_store, "low", info=info)
    args = ["--repa", "low", "--repa-depth", 2, "--repa-projector-dim", 32]
    r = cli(*run_args(small_store, tmp_path / "r", "--max-steps", 1, *args))
    assert r.exit_code == 1 and says in one_error_line(r.output), r.output
    assert not (tmp_path / "r").exists()
    r = cli(*run_args(small_store, tmp_path / "r", "--max-steps", 1, *args, "--repa-min-cosine", 0))
    assert r.exit_code == 0, r.output
    config = json.loads((tmp_path / "r" / "config.json").read_text())
    assert config["train"]["repa"]["repa_min_cosine"] == 0


def test_a_resume_keeps_the_repa_settings_and_the_feature_set(small_store, tmp_path):
    out = tmp_path / "r"
    args = run_args(small_store, out, "--max-steps", 2, "--logger", "jsonl", *REPA)
    assert cli(*args).exit_code == 0
    resume = ["run", "--resume", "--out", out, "--max-steps", 3]
    said = one_error_line(cli(*resume, "--repa-weight", 1).output)
    assert_has(said, "changes what is learned: --repa-weight 0.5 -> 1.0", "--allow-changes")
    for flags in (["--repa-projector-dim", 16], ["--repa", ""]):
        assert "cannot change on a resume" in one_error_line(cli(*resume, *flags).output)
    r = cli(*resume, "--repa-weight", 1, "--allow-changes")
    assert r.exit_code == 0, r.output
    assert json.loads((out / "config.json").read_text())["train"]["repa"]["repa_weight"] == 1.0

    # the same set's name, computed again with other features: another identity
    shutil.rmtree(small_store / "features" / "feats")
    add_features(small_store, "feats", seed=1)
    said = one_error_line(cli("run", "--resume", "--out", out, "--max-steps", 4).output)
    assert_has(said, "aligned to feature set 'feats'", "is now another one", "start a new --out")
    assert [s for s, _ in losses(out)] == [1, 2, 3]


def test_print_config_round_trips_the_repa_settings(store, tmp_path):
    flags = run_args(store, tmp_path / "a", "--max-steps", 2, "--logger", "jsonl", *REPA, "--repa-weight", "0.25")
    printed = cli(*flags, "--print-config")
    assert printed.exit_code == 0, printed.output
    assert_has(printed.output, "[repa]\n", 'repa = "feats"', "repa-depth = 2", "repa-weight = 0.25",
               "repa-projector-dim = 32")
    assert cli(*flags).exit_code == 0
    conf = tmp_path / "run.toml"
    conf.write_text(printed.output.replace(str(tmp_path / "a"), str(tmp_path / "b")))
    assert cli("run", "--config", conf).exit_code == 0
    a, b = (json.loads((tmp_path / n / "config.json").read_text()) for n in ("a", "b"))
    a["train"]["checkpointing"]["out"] = b["train"]["checkpointing"]["out"]
    assert a == b and a["train"]["repa"]["repa_weight"] == 0.25
    assert _rows(tmp_path / "a")[-1]["repa_loss"] == _rows(tmp_path / "b")[-1]["repa_loss"]


def test_the_projector_starts_the_same_anywhere_and_leaves_the_global_rng_alone():
    state = torch.get_rng_state()
    a, b = build_projector(12, 7, 5, seed=3), build_projector(12, 7, 5, seed=3)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert all(torch.count_nonzero(layer.bias) == 0 for layer in a if isinstance(layer, torch.nn.Linear))
    assert not torch.equal(a[0].weight, build_projector(12, 7, 5, seed=4)[0].weight)

"""dittrain.inference.sample.plan_samples: the one check-and-plan pass of `dittrain sample` and of
sample_images, on tiny stores (storeutil) and fabricated runs (test_sample.make_run);
only one test samples."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from storeutil import SAMPLE_CLASSES, tiny_store
from test_sample import make_run

from ditdata.store import open_store
from dittrain.cli import main as dittrain_cli
from dittrain.config import SampleConfig
from dittrain.inference.open_run import SampleError, class_names, load_model, model_config, store_mismatches
from dittrain.inference.open_run import sampling_device as resolve_device
from dittrain.inference.sample import plan_samples, run_plan, sample_images
from dittrain.inference.weights import load_weights

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def class_run(pixel_run):  # pixel_run: conftest.py
    run, store = pixel_run
    weights, config = load_weights(run)
    return config, open_store(store), weights


@pytest.fixture(scope="module")
def uncond_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("uncond")
    store = tiny_store(root / "store", conditioning={"type": "none"})
    _, config = load_weights(make_run(root / "run", store, objective="flow"))
    return config, open_store(store)


def test_flat_layout_cycles_the_classes_over_the_default_count(class_run):
    config, store, _ = class_run
    plan = plan_samples(config, store, device="cpu", classes=["coffee", "0"])
    assert plan.total == SampleConfig().n == 16
    assert plan.labels == (2, 0) * 8 and plan.groups is None and plan.nrow == 4
    assert plan.records[0] == {"class": 2, "class_name": "coffee"}
    assert plan.settings.sampler == "ddpm" and plan.device == torch.device("cpu") and plan.amp is None
    assert plan.guide and plan.record()["layout"] == "flat"
    assert plan.describe().startswith("sampling 16 images with DiT-T/4 (ddpm, ddpm, 50 steps, cfg 4) on cpu")
    # no classes: drawn with the seed, reproducibly; per_class_dir groups the singles by class
    a = plan_samples(config, store, replace(SampleConfig(), seed=3, n=5), device="cpu", per_class_dir=True)
    b = plan_samples(config, store, replace(SampleConfig(), seed=3), device="cpu", n=5)
    assert a.labels == b.labels and len(a.labels) == 5 and a.groups == a.labels and b.groups is None


def test_row_layout_and_class_names(class_run):
    config, store, _ = class_run
    assert class_names(store) == SAMPLE_CLASSES
    plan = plan_samples(config, store, device="cpu", n_per_class=2)
    assert plan.labels == (0, 0, 1, 1, 2, 2) and plan.groups == plan.labels
    assert plan.nrow == 2 and plan.rows_per_class and plan.record()["layout"] == "row per class"
    assert plan_samples(config, store, device="cpu", classes=["2"], n_per_class=3, nrow=5).nrow == 5


def test_sample_images_plans_exactly_the_given_labels(class_run):
    # labels are taken as they are (not cycled to the default count), also as an array
    config, store, weights = class_run
    images = sample_images(weights, config, store, SampleConfig(steps=2), labels=np.array([1, 2, 1]), device="cpu")
    assert images.shape == (3, 16, 16, 3)
    plan = plan_samples(config, store, SampleConfig(steps=2), device="cpu", classes=[1, 2, 1], n=3)
    assert plan.labels == (1, 2, 1)
    assert np.array_equal(images, run_plan(load_model(weights, config, "cpu"), plan, store))


@pytest.mark.parametrize("kw, fragment", [
    (dict(n=4, n_per_class=2), "give either --n"),
    (dict(n=0), "--n must be at least 1, got 0"),
    (dict(nrow=0), "--nrow must be at least 1"),
    (dict(prompts=["a cat"]), "--prompt needs a text-conditioned model; this one is class-conditional"),
    (dict(text={"text_pooled": torch.zeros(2, 4)}), "--prompt needs a text-conditioned model"),
    (dict(classes=["3"]), "class 3 is out of range: the model has 3 classes (0..2)"),
    (dict(classes=["-1"]), "class -1 is out of range"),
    (dict(classes=["zebra"]), "unknown class 'zebra'"),
    (dict(device="bogus"), "bad device 'bogus': use auto, cpu, cuda or cuda:N"),
])
def test_class_model_refusals(class_run, kw, fragment):
    config, store, _ = class_run
    with pytest.raises(SampleError) as e:
        plan_samples(config, store, **{"device": "cpu", **kw})
    assert fragment in str(e.value)


@pytest.mark.parametrize("settings, fragment", [
    (SampleConfig(batch_size=0), "--batch-size must be at least 1, got 0"),
    (SampleConfig(steps=1), "the ddpm sampler needs at least 2 steps, got 1"),
    (SampleConfig(steps=1, sampler="ddim"), "the ddim sampler needs at least 2 steps, got 1"),
    (SampleConfig(sampler="euler"), "sampler 'euler' does not fit the 'ddpm' objective"),
    (SampleConfig(precision="fp8"), "precision must be one of auto, fp32, bf16, fp16, got 'fp8'"),
    (SampleConfig(n=0), "nothing to sample"),
])
def test_settings_refusals(class_run, settings, fragment):
    config, store, _ = class_run
    with pytest.raises(SampleError) as e:
        plan_samples(config, store, settings, device="cpu")
    assert fragment in str(e.value)


def test_unconditional_model(uncond_run):
    config, store = uncond_run
    plan = plan_samples(config, store, device="cpu", n=3)
    assert plan.kind == "none" and plan.total == 3 and plan.labels is None and not plan.guide
    assert plan.records == ({}, {}, {}) and plan.settings.sampler == "euler" and plan.record()["cfg_scale"] is None
    for kw, fragment in ((dict(classes=["1"]), "--class needs a class-conditional model; this one is unconditional"),
                         (dict(n_per_class=2), "--n-per-class needs a class or text model")):
        with pytest.raises(SampleError, match=fragment):
            plan_samples(config, store, device="cpu", **kw)
    # a class model's store must be a class store: the typed conditioning says what it is
    class_config = {**config, "model": {**config["model"], "num_classes": 3}}
    assert store_mismatches(store, model_config(class_config)) == [
        "the model is class-conditional (3 classes) but the store's conditioning is 'none'"]


def test_precision_and_devices(class_run):
    config, store, _ = class_run
    assert plan_samples(config, store, SampleConfig(precision="bf16"), device="cpu").amp == torch.bfloat16
    assert plan_samples(config, store, SampleConfig(precision="fp32"), device="cpu").amp is None
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(SampleError, match=r"device 'cuda:1' requested but CUDA is not available"):
            resolve_device("cuda:1")
        assert resolve_device("auto") == torch.device("cpu")


def test_cli_help_names_the_default_count():
    r = CliRunner().invoke(dittrain_cli, ["sample", "--help"])
    assert r.exit_code == 0 and f"(default {SampleConfig().n})" in " ".join(r.output.split())

"""The published recipes (pipelines/configs/recipes/*.toml) hold their references' values: each file is
read as the commands read it (`dittrain run --print-config`, `dittrain sample --print-config`, and the
`[encode]`/`[features]` tables through ditdata's own option checks) and every value is compared with
the table below, written from the reference code independently of the files (repository@commit,
file:line). A recipe whose value drifts from its reference, or a flag that stops meaning what the
reference means, fails here."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from cliutil import dittrain

from ditdata.common import configfile

RECIPES = Path(__file__).resolve().parent.parent / "pipelines" / "configs" / "recipes"
DIT = "facebookresearch/DiT@ed81ce2229091fd4ecc9a223645f95cf379d582b"
REPA = "sihyun-yu/REPA@67f714503e3892f993844aab088ffc5791c92613"
LIGHTNING = "hustvl/LightningDiT@2725fed42a14898744433809949834e26957bcdd"
LIGHTNING_YAML = f"{LIGHTNING} configs/reproductions/lightningdit_xl_vavae_f16d32_64ep_cfg.yaml"
TREAD = "CompVis/tread@fccf77cc735ae2850162e12e4ed360cbc9a13e68"
RAE = "bytetriper/RAE@a4d18c4db766419cbe7cb8c02cd9f7ceb0ec9041"
RAE_YAML = f"{RAE} configs/stage2/training/ImageNet256/DiTDH-XL_DINOv2-B.yaml"
RAE_EPOCH = 1_281_167 // 1024  # its steps per epoch: ImageNet-1k's train images, drop_last batches of 1024

# {recipe: {command: {(table, key): (value, where the reference says so)}}}; run's tables are its
# --help sections, the other commands' keys are top-level (table None)
DIT_RUN = {
    ("model", "model"): ("DiT-XL/2", f"{DIT} train.py:258, models.py:328"),
    ("model", "learn-sigma"): (True, f"{DIT} models.py:160"),
    ("diffusion", "flow-time-scale"): (1000.0, "ddpm: the model sees the step index (models.py TimestepEmbedder)"),
    ("diffusion", "objective"): ("ddpm", f"{DIT} train.py:150 create_diffusion: 1000 linear steps, eps"),
    ("diffusion", "class-dropout"): (0.1, f"{DIT} models.py:158"),
    ("optim", "optimizer"): ("adamw", f"{DIT} train.py:155"),
    ("optim", "lr"): (1e-4, f"{DIT} train.py:155"),
    ("optim", "lr-schedule"): ("constant", f"{DIT} train.py: no scheduler"),
    ("optim", "warmup-steps"): (0, f"{DIT} train.py: no warmup"),
    ("optim", "adam-betas"): ("0.9,0.999", f"{DIT} train.py:155: torch's AdamW default betas"),
    ("optim", "weight-decay"): (0.0, f"{DIT} train.py:155"),
    ("optim", "grad-clip"): (0.0, f"{DIT} train.py: no clipping"),
    ("optim", "batch-size"): (256, f"{DIT} train.py:262"),
    ("optim", "ema"): (0.9999, f"{DIT} train.py:40"),
    ("optim", "max-steps"): (7_000_000, "the DiT paper's Table 4 (7M steps for FID 2.27)"),
    ("optim", "seed"): (0, f"{DIT} train.py:263"),
    ("performance", "precision"): ("fp32", f"{DIT} train.py: no autocast"),
    ("performance", "tf32"): (True, f"{DIT} train.py:12-13"),
    ("routing", "route"): ("", "no routing"),
    ("repa", "repa"): ("", "no REPA"),
}
DIT_SAMPLE = {
    (None, "sampler"): ("ddpm", f"{DIT} sample_ddp.py:78"),
    (None, "steps"): (250, f"{DIT} sample_ddp.py:159"),
    (None, "cfg"): (1.5, f"{DIT} sample_ddp.py:158"),
    (None, "cfg-channels"): (3, f"{DIT} models.py:262"),
    (None, "cfg-interval"): ("0.0,1.0", f"{DIT} models.py:250-266: guided at every step"),
    (None, "n"): (50000, f"{DIT} sample_ddp.py:155"),
    (None, "seed"): (0, f"{DIT} sample_ddp.py:160"),
}
DIT_ENCODE = {
    (None, "vae"): ("sd-vae-ft-ema", f"{DIT} train.py:151, 264"),
    (None, "resolution"): (256, f"{DIT} train.py:259, 85"),
    (None, "flip"): (True, f"{DIT} train.py:160"),
}

REFERENCE = {
    "dit_xl2.toml": {"run": DIT_RUN, "sample": DIT_SAMPLE, "encode": DIT_ENCODE},
    "dit_xl2_tread.toml": {
        "run": {**DIT_RUN,
                ("optim", "max-steps"): (400_000, f"{DIT} README.md:96 (the 400K comparison point)"),
                ("optim", "lr"): (1e-4, f"{TREAD} configs/config.yaml train.optimizer.lr"),
                ("optim", "batch-size"): (256, f"{TREAD} configs/config.yaml train.general.batch_size"),
                ("optim", "grad-clip"): (0.0, f"{TREAD} configs/config.yaml gradient_clipping_norm null"),
                ("diffusion", "class-dropout"): (0.1, f"{TREAD} configs/config.yaml class_drop_prob"),
                ("optim", "seed"): (42, f"{TREAD} configs/config.yaml global_seed"),
                ("routing", "route"): ("0.5:2:24", f"{TREAD} configs/model/tread.yaml (0.5, 2, depth - 4)"),
                ("routing", "route-convention"): ("tread", f"{TREAD} dit.py DiT.forward: 0-based, both ends")},
        "sample": DIT_SAMPLE, "encode": DIT_ENCODE},
    "sit_xl2_repa.toml": {
        "run": {
            ("model", "model"): ("DiT-XL/2", f"{REPA} models/sit.py:349 SiT_XL_2: DiT-XL/2's sizes"),
            ("model", "learn-sigma"): (False, f"{REPA} models/sit.py:186 out_channels = in_channels"),
            ("model", "qk-norm"): (False, f"{REPA} train.py:402"),
            ("diffusion", "objective"): ("flow", f"{REPA} train.py:432-433 linear path, v"),
            ("diffusion", "t-sampling"): ("uniform", f"{REPA} train.py:437, loss.py:57"),
            ("diffusion", "t-shift"): (1.0, f"{REPA} loss.py: no shift"),
            ("diffusion", "flow-time-scale"): (1.0, f"{REPA} loss.py:77: the model is given t"),
            ("diffusion", "class-dropout"): (0.1, f"{REPA} train.py:434"),
            ("repa", "repa"): ("dinov2-vitb14", f"{REPA} train.py:435"),
            ("repa", "repa-depth"): (8, f"{REPA} train.py:400"),
            ("repa", "repa-weight"): (0.5, f"{REPA} train.py:436"),
            ("repa", "repa-projector-dim"): (2048, f"{REPA} models/sit.py:180"),
            ("optim", "optimizer"): ("adamw", f"{REPA} train.py:204"),
            ("optim", "lr"): (1e-4, f"{REPA} train.py:418"),
            ("optim", "lr-schedule"): ("constant", f"{REPA} train.py: no scheduler"),
            ("optim", "adam-betas"): ("0.9,0.999", f"{REPA} train.py:419-420"),
            ("optim", "weight-decay"): (0.0, f"{REPA} train.py:421"),
            ("optim", "grad-clip"): (1.0, f"{REPA} train.py:423"),
            ("optim", "batch-size"): (256, f"{REPA} train.py:407"),
            ("optim", "ema"): (0.9999, f"{REPA} train.py:81"),
            ("optim", "max-steps"): (4_000_000, f"{REPA} README.md:138"),
            ("optim", "seed"): (0, f"{REPA} train.py:426"),
            ("performance", "precision"): ("fp16", f"{REPA} train.py:411"),
            ("routing", "route"): ("", "no routing"),
        },
        "sample": {
            (None, "sampler"): ("sde", f"{REPA} README.md:132, samplers.py euler_maruyama_sampler"),
            (None, "steps"): (250, f"{REPA} README.md:133"),
            (None, "cfg"): (1.8, f"{REPA} README.md:134"),
            (None, "cfg-interval"): ("0.0,0.7", f"{REPA} README.md:135, generate.py:206"),
            (None, "cfg-channels"): (0, f"{REPA} samplers.py:150: every channel"),
            (None, "n"): (50000, f"{REPA} README.md:126"),
            (None, "seed"): (0, f"{REPA} generate.py:174"),
        },
        "encode": {
            (None, "vae"): ("sd-vae-ft-mse", f"{REPA} preprocessing/encoders.py:54"),
            (None, "resolution"): (256, f"{REPA} train.py:406"),
            (None, "flip"): (False, f"{REPA} dataset.py: no flip"),
            (None, "posterior"): ("mean_std", f"{REPA} train.py:296 sample_posterior"),
        },
        "features": {
            (None, "encoder"): ("dinov2-vitb14", f"{REPA} train.py:435"),
            (None, "features-resize"): ("reference", f"{REPA} train.py:39 preprocess_raw_image"),
        },
    },
    "lightningdit_xl1_vavae.toml": {
        "run": {
            ("model", "model"): ("LightningDiT-XL/1", f"{LIGHTNING_YAML}:25"),
            ("model", "qk-norm"): (False, f"{LIGHTNING_YAML}:26"),
            ("diffusion", "objective"): ("flow", f"{LIGHTNING_YAML}:49-50"),
            ("diffusion", "t-sampling"): ("logit-normal", f"{LIGHTNING_YAML}:55"),
            ("diffusion", "t-mean"): (0.0, f"{LIGHTNING} transport: sigmoid(N(0, 1))"),
            ("diffusion", "t-std"): (1.0, f"{LIGHTNING} transport: sigmoid(N(0, 1))"),
            ("diffusion", "t-shift"): (1.0, f"{LIGHTNING} transport: no training shift"),
            ("diffusion", "flow-time-scale"): (1.0, f"{LIGHTNING} transport: the model is given t"),
            ("diffusion", "velocity-cosine-weight"): (1.0, f"{LIGHTNING_YAML}:54, train.py:202-204"),
            ("diffusion", "class-dropout"): (0.1, f"{LIGHTNING} models/lightningdit.py:288"),
            ("data", "latent-norm"): ("channel", f"{LIGHTNING_YAML}:15-16"),
            ("optim", "optimizer"): ("adamw", f"{LIGHTNING} train.py:118"),
            ("optim", "lr"): (2e-4, f"{LIGHTNING_YAML}:44"),
            ("optim", "lr-schedule"): ("constant", f"{LIGHTNING} train.py: no scheduler"),
            ("optim", "adam-betas"): ("0.9,0.95", f"{LIGHTNING} train.py:118, {LIGHTNING_YAML}:45"),
            ("optim", "weight-decay"): (0.0, f"{LIGHTNING} train.py:118"),
            ("optim", "grad-clip"): (0.0, f"{LIGHTNING} train.py:210-211 (no max_grad_norm in the yaml)"),
            ("optim", "batch-size"): (1024, f"{LIGHTNING_YAML}:36"),
            ("optim", "ema"): (0.9999, f"{LIGHTNING} train.py:304"),
            ("optim", "max-steps"): (80_000, f"{LIGHTNING_YAML}:35"),
            ("optim", "seed"): (0, f"{LIGHTNING_YAML}:37"),
            ("performance", "precision"): ("bf16", f"{LIGHTNING} run_train.sh PRECISION=bf16"),
        },
        "sample": {
            (None, "sampler"): ("euler", f"{LIGHTNING_YAML}:59-60"),
            (None, "steps"): (249, f"{LIGHTNING_YAML}:65: 250 grid points"),
            (None, "cfg"): (10.0, f"{LIGHTNING_YAML}:66"),
            (None, "cfg-channels"): (3, f"{LIGHTNING} models/lightningdit.py forward_with_cfg"),
            (None, "cfg-interval"): ("0.0,0.9", f"{LIGHTNING_YAML}:75 cfg_interval_start 0.10, in our t"),
            (None, "time-shift"): (1 / 0.3, f"{LIGHTNING_YAML}:76 timestep_shift 0.3, in our t"),
            (None, "n"): (50000, f"{LIGHTNING_YAML}:74"),
        },
        "encode": {
            (None, "vae"): ("vavae-f16d32", f"{LIGHTNING_YAML}:20"),
            (None, "resolution"): (256, f"{LIGHTNING_YAML}:12"),
            (None, "flip"): (True, f"{LIGHTNING} extract_features.py:51-52"),
        },
    },
}


REFERENCE["rae_ditdh_xl.toml"] = {
    "run": {
        ("model", "model"): ("DiTDH-XL/1", f"{RAE_YAML}:18-33 DiTwDDTHead [1152, 2048] x [28, 2], heads [16, 16]"),
        ("model", "qk-norm"): (False, f"{RAE_YAML}:28"),
        ("model", "learn-sigma"): (False, f"{RAE} src/stage2/models/DDT.py: out_channels = in_channels"),
        ("diffusion", "objective"): ("flow", f"{RAE_YAML}:37-38 Linear, velocity"),
        ("diffusion", "t-sampling"): ("logit-normal", f"{RAE_YAML}:40"),
        ("diffusion", "t-mean"): (0.0, f"{RAE_YAML}:40 logit-normal_0_1"),
        ("diffusion", "t-std"): (1.0, f"{RAE_YAML}:40 logit-normal_0_1"),
        ("diffusion", "t-shift"): ("auto", f"{RAE_YAML}:60-61, src/train.py:137-139 sqrt(dims / 4096)"),
        ("diffusion", "flow-time-scale"): (1.0, f"{RAE} transport.py training_losses: model(xt, t)"),
        ("diffusion", "velocity-cosine-weight"): (0.0, f"{RAE} transport.py: the velocity MSE"),
        ("diffusion", "class-dropout"): (0.1, f"{RAE_YAML}:26"),
        ("data", "latent-norm"): ("none", f"{RAE_YAML}:12 normalisation inside the RAE's encode"),
        ("optim", "optimizer"): ("adamw", f"{RAE} src/utils/optim_utils.py"),
        ("optim", "lr"): (2e-4, f"{RAE_YAML}:82"),
        ("optim", "adam-betas"): ("0.9,0.95", f"{RAE_YAML}:83"),
        ("optim", "weight-decay"): (0.0, f"{RAE_YAML}:84"),
        ("optim", "lr-schedule"): ("linear", f"{RAE_YAML}:86"),
        ("optim", "warmup-steps"): (0, f"{RAE_YAML}:91 warmup_from_zero false"),
        ("optim", "lr-decay-start"): (40 * RAE_EPOCH, f"{RAE_YAML}:87 warmup_epochs 40"),
        ("optim", "lr-decay-end"): (800 * RAE_EPOCH, f"{RAE_YAML}:88 decay_end_epoch 800"),
        ("optim", "min-lr"): (2e-5, f"{RAE_YAML}:90 final_lr"),
        ("optim", "grad-clip"): (1.0, f"{RAE_YAML}:79"),
        ("optim", "batch-size"): (1024, f"{RAE_YAML}:72"),
        ("optim", "ema"): (0.9995, f"{RAE_YAML}:74"),
        ("optim", "max-steps"): (1400 * RAE_EPOCH, f"{RAE_YAML}:71 epochs 1400"),
        ("optim", "seed"): (42, f"{RAE_YAML}:80"),
        ("performance", "precision"): ("fp32", f"{RAE} src/train.py:95 default fp32"),
        ("routing", "route"): ("", "no routing"),
        ("repa", "repa"): ("", "no REPA"),
    },
    "sample": {
        (None, "sampler"): ("euler", f"{RAE} configs/stage2/sampling/ImageNet256/DiTDHXL-DINOv2-B.yaml:44-45"),
        (None, "steps"): (49, f"{RAE} its num_steps 50 grid points (integrators.py:100)"),
        (None, "cfg"): (1.0, f"{RAE} its guidance scale 1.0"),
        (None, "cfg-interval"): ("0.0,1.0", f"{RAE} its t-min 0.0, t-max 1.0"),
        (None, "n"): (50000, f"{RAE} src/sample_ddp.py:34"),
    },
    "encode": {
        (None, "vae"): ("rae-dinov2-b", f"{RAE_YAML}:2-12 DINOv2-B with registers, ViT-XL decoder"),
        (None, "resolution"): (256, f"{RAE} src/train.py:94, 252"),
        (None, "flip"): (True, f"{RAE} src/train.py:253 RandomHorizontalFlip"),
    },
}


def test_every_recipe_has_its_reference_table():
    assert sorted(p.name for p in RECIPES.glob("*.toml")) == sorted(REFERENCE)


def _printed(command: str, recipe: Path, tmp_path: Path) -> dict:
    args = (["run", "--latents", tmp_path, "--out", tmp_path / "run"] if command == "run"
            else ["sample", "--ckpt", tmp_path])
    r = dittrain(*args, "--config", recipe, "--print-config")
    assert r.exit_code == 0, r.output
    return tomllib.loads(r.output)


def _data_side(command: str, recipe: Path) -> dict:
    """The [command] table as ditdata's command checks and converts it (its --config reader)."""
    from ditdata.cli import main

    data = configfile.command_table(recipe, configfile.read(recipe), command)
    cmd = main.commands[command]
    values = configfile.defaults_from(cmd, recipe, data)
    keys = {p.name: configfile.key_of(p) for p in cmd.params}
    return {keys[name]: v for name, v in values.items()}


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_a_recipe_gives_its_references_values(name, tmp_path):
    recipe = RECIPES / name
    for command, table in REFERENCE[name].items():
        got = (_printed(command, recipe, tmp_path) if command in ("run", "sample") else _data_side(command, recipe))
        for (section, key), (want, source) in table.items():
            value = (got.get(section) or {}).get(key) if section else got.get(key)
            if isinstance(want, float):
                assert value == pytest.approx(want, rel=1e-12), f"{name} {command} {section} {key}: {source}"
            else:
                assert value == want, f"{name} [{command}] {section or ''} {key} = {value!r}; reference: {source}"


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_every_value_names_its_source(name):
    """Each setting line carries a comment (its source), and the recipe names its reference's commit."""
    text = (RECIPES / name).read_text()
    data = tomllib.loads(text)
    assert re.search(r"/tree/[0-9a-f]{40}", data["recipe"]["reference"]), data["recipe"]
    table = None
    for line in text.splitlines():
        if line.startswith("["):
            table = line.strip("[]")
        elif table != "recipe" and re.match(r"^[a-z][\w-]* = ", line):
            assert "#" in line.split("=", 1)[1], f"{name} [{table}] {line!r}: no source comment"

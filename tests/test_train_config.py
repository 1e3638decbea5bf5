"""dittrain's choice lists in one place: dittrain/config.py holds them without torch, the CLI's
click.Choice lists are exactly these tuples, and the modules that check a value accept every
value listed (and refuse one that is not)."""

from __future__ import annotations

import dataclasses

import pytest
from cliutil import loaded_after

from dittrain import config
from dittrain.cli import main as cli


def test_importing_config_loads_no_torch():
    assert loaded_after("import dittrain.config, dittrain.cli", ("torch", "numpy")) == []


def _choices(command: str) -> dict[str, tuple]:
    return {p.name: tuple(p.type.choices) for p in cli.commands[command].params if hasattr(p.type, "choices")}


def test_run_choices_are_the_config_constants():
    assert _choices("run") == {
        "objective": config.OBJECTIVES, "optimizer": config.OPTIMIZERS, "lr_schedule": config.LR_SCHEDULES,
        "latent_norm": config.LATENT_NORMS, "loss_weighting": config.LOSS_WEIGHTINGS,
        "t_sampling": config.T_SAMPLINGS, "amp": config.AMP_MODES, "compile": config.COMPILE,
        "compile_mode": config.COMPILE_MODES, "loader": config.LOADERS, "resident_device": config.RESIDENT_DEVICES,
        "bucket_remainder": config.BUCKET_REMAINDERS, "route_convention": config.ROUTE_CONVENTIONS,
        "eval_sampler": config.SAMPLERS,
    }


def test_sample_samplers_are_the_config_constant():
    assert _choices("sample")["sampler"] == config.SAMPLERS


def test_the_constants_are_what_their_modules_check():
    from ditdata.common import devices
    from dittrain.data import bucketed
    from dittrain.data import latent_norm as latents
    from dittrain.model import checkpointing as grad_checkpointing
    from dittrain.model import routing
    from dittrain.train import loggers, step

    assert latents.LATENT_NORMS is config.LATENT_NORMS and loggers.LOGGERS is config.LOGGERS
    assert bucketed.REMAINDERS is config.BUCKET_REMAINDERS
    assert (routing.TREAD, routing.HALF_OPEN) == config.ROUTE_CONVENTIONS
    for convention in config.ROUTE_CONVENTIONS:
        assert routing.parse_route("0.5:1:2", convention).convention == convention
    assert config.PRECISIONS == devices.PRECISIONS and set(config.AMP_MODES) == set(devices.PRECISIONS)
    assert set(config.COMPILE_TARGETS) < set(config.COMPILE)
    for knob in config.COMPILE:
        assert step.compile_target(knob, devices.resolve_device("cpu")) in config.COMPILE_TARGETS
    for mode in config.COMPILE_MODES:
        step.compile_model(None, "off", mode)
    with pytest.raises(step.CompileError):
        step.compile_model(None, "off", "fastest")
    for knob in config.GRAD_CHECKPOINTING:
        grad_checkpointing.checkpoint_every(knob)
    assert {grad_checkpointing.block_recompute(k) for k in config.GRAD_CHECKPOINTING} == {
        None, *config.CHECKPOINT_BRANCHES, config.CHECKPOINT_SELECTIVE}
    with pytest.raises(grad_checkpointing.GradCheckpointingError):
        grad_checkpointing.checkpoint_every("sometimes")


def test_diffusion_accepts_the_listed_objectives_and_options():
    from dittrain.diffusion import DiffusionConfig

    for objective in config.OBJECTIVES:
        DiffusionConfig(objective=objective)
    for weighting in config.LOSS_WEIGHTINGS:
        DiffusionConfig(objective="ddpm", loss_weighting=weighting)
    for sampling in config.T_SAMPLINGS:
        DiffusionConfig(objective="flow", t_sampling=sampling)
    for bad in (dict(objective="edm"), dict(loss_weighting="p2"), dict(objective="flow", t_sampling="cosmap")):
        with pytest.raises(ValueError):
            DiffusionConfig(**bad)


def test_optimizers_and_schedules():
    import torch

    from dittrain.train.optim import OptimizerError, build_optimizer, lr_at

    params = [torch.nn.Parameter(torch.zeros(3))]
    assert isinstance(build_optimizer(config.TrainConfig.from_flat(optimizer="adamw"), params, torch.device("cpu")),
                      torch.optim.AdamW)
    with pytest.raises(OptimizerError, match="choose adamw or adamw8bit"):
        build_optimizer(config.TrainConfig.from_flat(optimizer="sgd"), params, torch.device("cpu"))
    cfg = dict(lr=1.0, min_lr=0.0, warmup_steps=0, max_steps=10)
    assert [lr_at(5, config.TrainConfig.from_flat(lr_schedule=s, **cfg)) for s in config.LR_SCHEDULES] == [1.0, 0.5, 0.5]
    # RAE's linear rule (bytetriper/RAE src/utils/optim_utils.py, warmup_from_zero false): held at lr until the
    # decay's start, linear to min_lr at its end, held after
    rae = config.TrainConfig.from_flat(lr_schedule="linear", lr=2e-4, min_lr=2e-5, lr_decay_start=40, lr_decay_end=800,
                                       max_steps=1400)
    assert [lr_at(s, rae) for s in (0, 39, 40, 800, 1399)] == [2e-4, 2e-4, 2e-4, 2e-5, 2e-5]
    assert lr_at(420, rae) == pytest.approx(2e-4 - 1.8e-4 * 380 / 760)


# ------------------------------------------------------------------------ TrainConfig sections


def test_every_run_flag_is_one_field_of_one_section():
    from click.testing import CliRunner

    from ditdata.common.configfile import key_of

    invocation = {"no_compile", "help", "config", "print_config", "allow_changes", "quiet", "verbose"}  # not settings
    params = {p.name: p for p in cli.commands["run"].params if p.name not in invocation}
    assert set(params) == set(config.SECTION_OF)  # the flags map 1:1 onto the sections' fields
    # no field name in two sections (a flat name says which section it lives in)
    names = [f.name for cls in config.SECTIONS.values() for f in dataclasses.fields(cls)]
    assert len(names) == len(set(names)) == len(config.SECTION_OF)
    # --help lists each section's options under its heading, in the sections' order
    text = CliRunner().invoke(cli, ["run", "--help"], terminal_width=200).output
    heads = [text.index(f"{s.capitalize()} options:") for s in config.SECTIONS]
    assert heads == sorted(heads)
    bounds = [*heads, text.index("Other options:")]
    for i, section in enumerate(config.SECTIONS):
        part = text[bounds[i]:bounds[i + 1]]
        for name, where in config.SECTION_OF.items():
            flag = "--" + key_of(params[name])  # --precision for the field amp
            listed = any(f"{lead}{flag}{end}" in part for lead in ("  ", ", ") for end in (" ", "/", ","))
            assert listed == (where == section), (flag, section)


def test_flat_and_sectioned_records_read_alike():
    from dataclasses import asdict

    cfg = config.TrainConfig.from_flat(lr=3e-4, model="DiT-S/2", latents="/s", compile="blocks", eval_n=64)
    assert (cfg.optim.lr, cfg.model.model, cfg.data.latents, cfg.performance.compile, cfg.eval.eval_n) == (
        3e-4, "DiT-S/2", "/s", "blocks", 64)
    sectioned = asdict(cfg)
    assert set(sectioned) == set(config.SECTIONS) and sectioned["optim"]["lr"] == 3e-4
    flat = cfg.flat()  # how runs recorded "train" before the sections
    assert config.TrainConfig.from_record(sectioned) == cfg == config.TrainConfig.from_record(flat)
    # a record from before a knob existed takes its default; a name this version lacks is ignored
    old = {k: v for k, v in flat.items() if k != "optimizer"} | {"retired_knob": 1}
    assert config.TrainConfig.from_record(old).optim.optimizer == config.OptimSection().optimizer
    # ... unless its definition says what its absence means (setting(absent=)): a record from before
    # --route-convention counted --route half-open, a new run TREAD's way
    assert config.ABSENT == {"route_convention": "half-open"} and cfg.routing.route_convention == "tread"
    before = {k: v for k, v in flat.items() if k != "route_convention"}
    assert config.TrainConfig.from_record(before).routing.route_convention == "half-open"
    assert config.recorded({"train": before}, "route_convention") == "half-open"
    for record in (sectioned, flat):
        run = {"train": record}
        assert config.recorded(run, "model") == "DiT-S/2" and config.recorded(run, "lr") == 3e-4
        assert config.recorded(run, "no_such_knob", "x") == "x"
    assert config.recorded({}, "model", "DiT") == "DiT" and config.recorded(None, "model") is None
    with pytest.raises(TypeError, match="no field bogus"):
        config.TrainConfig.from_flat(bogus=1)


# ----------------------------------------------------------------------------- resume classes

# What each setting was before the classes moved into the field definitions (dittrain.train.resume
# kept these as name lists): a resume treats every field as it did. A new field is added here too,
# on purpose, with the class its definition declares.
LEARNED_SETTINGS = {
    "lr", "lr_schedule", "min_lr", "lr_decay_start", "lr_decay_end", "warmup_steps", "weight_decay", "ema", "grad_clip", "batch_size",
    "accumulation_steps", "seed", "shuffle_window", "bucket_remainder", "loss_weighting", "min_snr_gamma",
    "t_sampling", "t_mean", "t_std", "t_shift", "class_dropout", "caption_dropout", "amp", "tf32", "repa_depth",
    "repa_weight", "route", "route_convention", "adam_betas", "velocity_cosine_weight",
    "lora_alpha", "lora_dropout", "caption_mix"}  # LoRA's: no tensor changes, how the adapter acts and learns does
FIXED_SETTINGS = {"model", "learn_sigma", "qk_norm", "objective", "optimizer", "latent_norm", "repa",
                  "flow_time_scale",
                  "repa_projector_dim", "val_fraction",  # which samples are held out must not move
                  "lora", "lora_targets"}  # LoRA's rank and targets make the adapter's tensors
START_SETTINGS = {"resume", "out", "init_from"}


def _all_fields():
    return [f for cls in config.SECTIONS.values() for f in dataclasses.fields(cls)]


def test_every_setting_declares_its_resume_class():
    missing = [f.name for f in _all_fields() if f.metadata.get("resume") not in config.RESUME_CLASSES]
    assert missing == [], "declare each with dittrain.config.setting(default, SAFE | LEARNED | FIXED | START)"
    by_class = {c: {f.name for f in _all_fields() if f.metadata["resume"] == c} for c in config.RESUME_CLASSES}
    assert by_class[config.LEARNED] == LEARNED_SETTINGS
    assert by_class[config.FIXED] == FIXED_SETTINGS
    assert by_class[config.START] == START_SETTINGS
    assert by_class[config.SAFE] == {f.name for f in _all_fields()} - LEARNED_SETTINGS - FIXED_SETTINGS - START_SETTINGS


def test_the_resume_rules_read_the_declarations():
    from dittrain.train import resume

    plain, cosine = config.TrainConfig(), config.TrainConfig.from_flat(lr_schedule="cosine")
    assert resume.kind("lr", plain) == "learned" and resume.kind("repa", plain) == "fixed"
    assert resume.kind("save_every", plain) == "safe" and resume.kind("out", plain) == "start"
    assert resume.kind("max_steps", plain) == "safe" and resume.kind("max_steps", cosine) == "learned"
    linear = config.TrainConfig.from_flat(lr_schedule="linear")  # to min_lr at max_steps: learned too
    assert resume.kind("max_steps", linear) == "learned"
    assert resume.kind("max_steps", config.TrainConfig.from_flat(lr_schedule="linear", lr_decay_end=9)) == "safe"
    assert resume.RESOLVED_AUTO == {"latent_norm", "t_shift"} and resume.flag("amp") == "--precision"
    assert resume.flag("repa_depth") == "--repa-depth"
    needing = {f.name: f.metadata["needs"] for f in _all_fields() if f.metadata["needs"]}
    assert needing == {"repa_depth": "repa", "repa_weight": "repa", "repa_projector_dim": "repa",
                       "repa_min_cosine": "repa", "route_convention": "route",
                       "lora_targets": "lora", "lora_alpha": "lora", "lora_dropout": "lora"}


def test_a_setting_without_a_known_class_is_refused():
    with pytest.raises(ValueError, match="resume class 'sometimes'"):
        config.setting(1, "sometimes")

    @dataclasses.dataclass
    class Section:
        plain: int = 1  # declared the old way: no class

    from dittrain.train import resume

    field = dataclasses.fields(Section)[0]
    resume._FIELDS["plain"] = field
    try:
        with pytest.raises(TypeError, match="TrainConfig.plain declares no resume class"):
            resume.kind("plain", config.TrainConfig())
    finally:
        del resume._FIELDS["plain"]

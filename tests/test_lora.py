"""`dittrain run --lora RANK` (dittrain.model.lora, through peft) on a frozen --init-from base: the
trainable parameters are peft's count, the optimizer and the checkpoints hold the adapter alone, a
run killed and resumed gives the same losses and tensors bit for bit; `dittrain export --merge-lora`
writes merged weights equal to the adapter on its base (and sampling the run unmerged gives the
same images) and peft's adapter files, which PeftModel.from_pretrained loads onto our DiT;
`dittrain plan` counts the adapter alone; bad settings are one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cliutil import dittrain as cli
from cliutil import kill_when, losses, one_error_line, run_args, spawn
from tiny import nudged

from dittrain.config import LORA_TARGETS
from dittrain.inference.open_run import load_model
from dittrain.inference.weights import adapted_model, load_weights, read_weights
from dittrain.model.dit import DiT
from dittrain.model.sizes import get_config
from dittrain.rundir import latest_checkpoint, load_checkpoint

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("one_thread")
RANK = 4
# lr 1e-2: the adapter moves visibly in a few steps; dropout: its draws must resume exactly too
COMMON = ["--lora", RANK, "--lora-dropout", "0.1", "--lr", "1e-2", "--ema", "0.5", "--loader", "resident"]


def tiny_dit() -> DiT:
    """The DiT-T/4 of the `store` fixture (3x8x8 latents, classes a, b, c)."""
    return DiT(get_config("DiT-T/4", input_size=8, in_channels=3, num_classes=3))


def inputs(n: int = 4) -> dict:
    g = torch.Generator().manual_seed(1)
    return {"x": torch.randn(n, 3, 8, 8, generator=g), "t": torch.randint(0, 1000, (n,), generator=g),
            "y": torch.randint(0, 3, (n,), generator=g)}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A pretrained stand-in: a plain state dict whose every weight is random (DiT's zero-initialised
    final layer and adaLN too, so outputs are not zero and an adapter changes them)."""
    torch.manual_seed(0)
    model = nudged(tiny_dit(), 0.05)
    path = tmp_path_factory.mktemp("base") / "base.pt"
    torch.save(model.state_dict(), path)
    return path


@pytest.fixture(scope="module")
def runs(store, base, tmp_path_factory) -> Path:
    """root/straight: 6 steps of --lora; root/killed: the same in a child process, SIGKILLed once its
    step-3 checkpoint exists, then resumed with `--resume --out RUN` alone. Both on one thread (the
    child: OMP_NUM_THREADS=1), in this process but the killed one (one start of torch and peft, not three)."""
    root = tmp_path_factory.mktemp("lora")
    common = [*COMMON, "--init-from", base, "--max-steps", 6, "--save-every", 3]
    killed = spawn(run_args(store, root / "killed", *common))
    threads = torch.get_num_threads()  # (the one_thread fixture is per test)
    torch.set_num_threads(1)
    try:
        r = cli(*run_args(store, root / "straight", *common))
        assert r.exit_code == 0, r.output
        ckpt = root / "killed" / "checkpoints" / "step_00000003.pt"
        kill_when(killed, ckpt.exists, timeout=300, too_late="the run ended before the kill", poll=0.01)
        assert latest_checkpoint(root / "killed") == ckpt
        r = cli("run", "--resume", "--out", root / "killed")
        assert r.exit_code == 0 and "resuming at step 3" in r.output, r.output
    finally:
        torch.set_num_threads(threads)
    assert losses(root / "straight") == losses(root / "killed")  # every step's loss, before and after the kill
    assert [s for s, _ in losses(root / "killed")] == [1, 2, 3, 4, 5, 6]
    return root


def test_only_the_adapter_trains_and_is_saved(runs, base, store, tmp_path):
    ckpt = load_checkpoint(latest_checkpoint(runs / "straight"))
    # peft's count of the same adapter: its own model wrapper, its own suffix matching of the default targets
    model = peft.get_peft_model(tiny_dit(), peft.LoraConfig(r=RANK, target_modules=LORA_TARGETS.split(",")))
    trainable, _ = model.get_nb_trainable_parameters()
    assert sum(v.numel() for v in ckpt["model"].values()) == trainable == 6 * RANK * (768 + 384 + 960 + 960)
    assert all(".lora_A." in k or ".lora_B." in k for part in ("model", "ema") for k in ckpt[part])
    assert len(ckpt["optimizer"]["state"]) == len(ckpt["model"])  # the adapter's tensors, nothing else
    assert ckpt["model"].keys() == ckpt["ema"].keys() and any(
        not torch.equal(ckpt["model"][k], ckpt["ema"][k]) for k in ckpt["model"])  # the EMA of the adapter
    # the files: the adapter alone, against a full fine-tune's checkpoint of the same model
    full = tmp_path / "full"
    assert cli(*run_args(store, full, "--init-from", base, "--max-steps", 1)).exit_code == 0
    lora_bytes = latest_checkpoint(runs / "straight").stat().st_size
    assert lora_bytes * 10 < latest_checkpoint(full).stat().st_size
    assert (runs / "straight" / "ema.safetensors").stat().st_size * 10 < (full / "ema.safetensors").stat().st_size
    config = json.loads((runs / "straight" / "config.json").read_text())
    assert config["train"]["lora"] == {"lora": RANK, "lora_targets": LORA_TARGETS, "lora_alpha": 0.0,
                                       "lora_dropout": 0.1}
    assert config["init"]["from"] == str(base.resolve())  # what a resume and every reader rebuild the base from


def test_resume_after_a_kill_is_exact(runs):
    a, b = (load_checkpoint(latest_checkpoint(runs / d)) for d in ("straight", "killed"))
    for part in ("model", "ema"):
        assert all(torch.equal(a[part][k], b[part][k]) for k in a[part]), part
    assert all(torch.equal(x, y) for s, t in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values(),
                                                 strict=True) for x, y in zip(s.values(), t.values(), strict=True))


def test_gradient_checkpointing_recomputes_the_same_steps(runs, store, base, tmp_path):
    # peft's layers inside the checkpointed blocks, dropout included (the recomputation replays its draws);
    # --compile blocks gives these losses too (checked by hand: its CPU compile is too slow for the suite)
    out = tmp_path / "gc"
    r = cli(*run_args(store, out, *COMMON, "--init-from", base, "--max-steps", 2, "--grad-checkpointing", "every"))
    assert r.exit_code == 0, r.output
    assert losses(out) == losses(runs / "straight")[:2]


def test_merged_export_equals_the_adapter_and_peft_loads_it(runs, base, tmp_path):
    run = runs / "straight"
    out = tmp_path / "merged"
    r = cli("export", "--ckpt", run, "--merge-lora", "--out", out)
    assert r.exit_code == 0, r.output
    assert {p.name for p in out.iterdir()} == {"ema.safetensors", "adapter_model.safetensors", "adapter_config.json"}
    adapter, config = load_weights(run)
    unmerged = adapted_model(adapter, config, run / "ema.safetensors")
    merged, _ = load_weights(out)
    with torch.no_grad():
        want = unmerged(**inputs())
        assert not torch.allclose(want, load_model(torch.load(base), config)(**inputs()), atol=1e-4)  # it trained
        assert torch.allclose(load_model(merged, config)(**inputs()), want, atol=1e-5)
        # the run itself, unmerged: every reader applies the adapter to its base as it loads it
        in_memory = read_weights(run).state
        assert in_memory.keys() == merged.keys() and all(torch.equal(in_memory[k], merged[k]) for k in merged)
        # peft, on our DiT holding the base
        plain = tiny_dit()
        plain.load_state_dict(torch.load(base))
        tuned = peft.PeftModel.from_pretrained(plain, str(out)).eval()
        assert torch.allclose(tuned(**inputs()), want, atol=1e-5)
    saved = json.loads((out / "adapter_config.json").read_text())
    assert saved["r"] == RANK and saved["lora_alpha"] == RANK and saved["peft_type"] == "LORA"
    # sampling the run (unmerged) and the merged export: the same images
    grids = []
    for ckpt, name in ((run, "a"), (out, "b")):
        r = cli("sample", "--ckpt", ckpt, "--n", 2, "--steps", 2, "--device", "cpu", "--out", tmp_path / f"{name}.png")
        assert r.exit_code == 0, r.output
        grids.append((tmp_path / f"{name}.png").read_bytes())
    assert grids[0] == grids[1]
    # a full run has no adapter to merge
    line = one_error_line(cli("export", "--ckpt", base, "--merge-lora", "--out", tmp_path / "x").output)
    assert "--merge-lora" in line


def test_plan_counts_the_adapter_alone():
    from dittrain.plan.footprint import Setting, footprint, model_parts

    cfg = get_config("DiT-XL/2", input_size=32, in_channels=4, num_classes=1000)
    full, lora = (footprint(Setting(cfg, micro_batch=32, precision="bf16", lora=x)) for x in (None, (16, LORA_TARGETS)))
    assert sum(model_parts(cfg, (16, LORA_TARGETS)).trainable) == 28 * 16 * (4 * 1152 + 2 * 1152 + 2 * (1152 + 4608))
    assert lora.activations == full.activations and lora.weights > full.weights  # the base, and the adapter beside it
    assert lora.optimizer * 50 < full.optimizer and lora.ema * 50 < full.ema and lora.peak < full.peak
    # --probe builds the run's step as the loop does: the adapter alone in the optimizer, its EMA alone
    from dittrain.config import TrainConfig
    from dittrain.plan.probe import build

    tiny = get_config("DiT-T/4", input_size=8, in_channels=3, num_classes=3)
    step, _, _ = build(TrainConfig.from_flat(model="DiT-T/4", batch_size=2, lora=RANK), tiny, torch.device("cpu"))
    assert sum(p.numel() for p in step.params) == sum(p.numel() for p in step.ema_params) == 6 * RANK * 3072
    r = cli("plan", "--model", "DiT-XL/2", "--latent-shape", "4x32x32", "--classes", 1000, "--gpu", "RTX 4090",
            "--batch-size", 256, "--lora", 16)
    assert r.exit_code == 0 and "--lora 16: 8.26 M trainable (the adapter)" in r.output, r.output
    assert "--lora 16 --init-from WEIGHTS --out RUN" in r.output  # the pick's command: the base to fill in


def test_bad_settings_are_one_line(store, base, runs, tmp_path):
    out = tmp_path / "bad"
    cases = [(["--lora", 4], "needs --init-from"),
             (["--lora", 4, "--init-from", base, "--lora-targets", "attn.qkv,to_q"], "to_q match(es) no linear"),
             (["--lora", 4, "--init-from", base, "--lora-targets", "blocks\\.9\\d\\.attn\\.qkv"], "match(es) no linear"),
             (["--lora", 4, "--init-from", base, "--lora-targets", "blocks.(0"], "not a regular expression"),
             (["--lora", 1000, "--init-from", base], "at most 192"),
             (["--lora", -1, "--init-from", base], "positive integer"),
             (["--lora-alpha", 8], "--lora-alpha without --lora")]
    for args, words in cases:
        line = one_error_line(cli(*run_args(store, out, "--max-steps", 1, *args)).output)
        assert words in line, (args, line)
    assert not out.exists()
    # a resume keeps the rank and targets (fixed), and lets alpha and dropout change only with --allow-changes
    run = runs / "straight"
    line = one_error_line(cli("run", "--resume", "--out", run, "--lora", 8).output)
    assert "--lora 4 -> 8 cannot change on a resume" in line
    line = one_error_line(cli("run", "--resume", "--out", run, "--lora-alpha", 8).output)
    assert "changes what is learned: --lora-alpha 0.0 -> 8.0" in line

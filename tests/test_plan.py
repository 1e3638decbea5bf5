"""`dittrain plan` (issue 27): the memory model (dittrain.plan.footprint) against the peaks measured on
the CPU allocator, the memory guide of docs/memory.md (measured on an H200) reproduced, --probe ranking
by measured speed with a pick that runs, the printed command and config file accepted by
`dittrain run`, and one-line errors."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch
from cliutil import assert_has, dittrain, ok, one_error_line

from dittrain.config import TrainConfig
from dittrain.model.routing import parse_route, route_of
from dittrain.model.sizes import get_config
from dittrain.plan.footprint import Setting, footprint, kept_bytes
from dittrain.plan.probe import measured_peak

ROOT = Path(__file__).resolve().parents[1]
DDT = ("custom:hidden=64,depth=2,heads=2,patch=1,mlp=swiglu,norm=rms,pos=sincos+rope,time=fourier,head_depth=2,"
       "head_hidden=128,head_heads=4")
TOLERANCE = 0.15  # the issue's: predicted peak within 15% of the measured one

# (model, latent side, micro-batch, --grad-checkpointing, extra run settings): DiT-T/2 at two batch
# sizes and three modes, LightningDiT's blocks, token routing and REPA (what each adds is modelled)
CASES = [("DiT-T/2", 16, n, mode, {}) for n in (4, 8) for mode in ("none", "selective", "every")] + [
    ("custom:hidden=128,depth=4,heads=4,patch=2,mlp=swiglu,norm=rms,pos=rope,qk_norm=1", 16, 4, "mlp", {}),
    ("DiT-T/2", 16, 8, "none", {"route": "0.5:1:4"}),
    ("DiT-T/2", 16, 4, "2", {"repa": "feat", "repa_depth": 2, "repa_projector_dim": 256}),
] + [(DDT, 8, 8, mode, {}) for mode in ("none", "3")]  # a DiT^DH: its head blocks, wiring and final layer


@pytest.mark.parametrize("model,side,n,mode,extra", CASES, ids=[f"{c[0][:12]}-{c[2]}-{c[3]}-{'+'.join(c[4]) or 'plain'}"
                                                                  for c in CASES])
def test_the_predicted_peak_is_within_15_percent_of_the_cpu_allocators(model, side, n, mode, extra):
    torch.set_num_threads(1)  # the allocator's peak does not depend on it; the machine is shared
    cfg = TrainConfig.from_flat(model=model, batch_size=n, grad_checkpointing=mode, device="cpu", **extra)
    model_cfg = get_config(model, input_size=side, in_channels=4, num_classes=1000,
                           grad_checkpointing=int(mode) if mode.isdigit() else mode)
    dims = 48 if cfg.repa.repa else None
    setting = Setting(model_cfg, micro_batch=n, mode=mode, route=route_of(cfg.routing),
                      repa=(cfg.repa.repa_depth, cfg.repa.repa_projector_dim, dims) if dims else None)
    predicted = footprint(setting)
    measured = measured_peak(cfg, model_cfg, torch.device("cpu"), targets=(model_cfg.num_tokens, dims) if dims else None)
    assert abs(predicted.peak / measured - 1) < TOLERANCE, (predicted, measured)
    if extra.get("route"):  # routing lowers the activations of the routed blocks (K of T tokens)
        assert kept_bytes(setting) < 0.8 * kept_bytes(Setting(model_cfg, micro_batch=n, mode=mode))


def test_the_block_after_a_tread_rejoin_is_planned_in_fp32():
    """Under bf16 the block a TREAD route runs with autocast off (the one after the rejoin) keeps
    what an fp32 block keeps; a half-open route (the old meaning) has no such block."""
    from dittrain.plan.footprint import _Blocks

    model_cfg = get_config("DiT-T/2", input_size=16, in_channels=4, num_classes=1000)
    bf16 = {"micro_batch": 4, "precision": "bf16"}
    tread = _Blocks(Setting(model_cfg, route=parse_route("0.5:1:3"), **bf16))
    old = _Blocks(Setting(model_cfg, route=parse_route("0.5:1:4", "half-open"), **bf16))  # the same blocks 1-3
    plain16, plain32 = _Blocks(Setting(model_cfg, **bf16)), _Blocks(Setting(model_cfg, micro_batch=4))
    assert tread.full == 4 and old.full is None
    assert tread.kept(4) == plain32.kept(4) > plain16.kept(4) == old.kept(4)
    assert [tread.kept(i) for i in range(6) if i != 4] == [old.kept(i) for i in range(6) if i != 4]
    assert kept_bytes(Setting(model_cfg, route=parse_route("0.5:1:3"), **bf16)) > kept_bytes(
        Setting(model_cfg, route=parse_route("0.5:1:4", "half-open"), **bf16))


def _memory_guide() -> list[tuple[str, str, int, float]]:
    """(model, --grad-checkpointing, batch, GiB) of the memory guide (docs/memory.md)."""
    text = (ROOT / "docs" / "memory.md").read_text()
    guide = text[text.index("## Memory guide"):]
    end = guide.find("\n## ")
    guide = guide if end < 0 else guide[:end]  # up to the next section (planning a run)
    rows = []
    for line in guide.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) > 5 and cells[0].startswith("DiT-") and cells[3].endswith("GiB"):
            mode = {"none": "none", "every block": "every"}[cells[2]]
            rows += [(cells[0], mode, batch, float(cells[3 + i].split()[0])) for i, batch in enumerate((64, 128, 256))]
    return rows


def _size(text: str) -> float:
    """Bytes of a size as format_size writes it ("70.3 MiB", "1.07 GiB")."""
    number, unit = text.split()
    return float(number) * 2 ** {"KiB": 10, "MiB": 20, "GiB": 30}[unit]


def _pick_peak(output: str) -> float:
    """GiB of the pick's predicted peak."""
    return _size(re.search(r"^pick: .*?: ([0-9.]+ [KMG]iB) predicted peak", output, re.M).group(1)) / 2**30


def test_the_memory_guide_is_reproduced_by_dittrain_plan():
    rows = _memory_guide()
    assert len(rows) == 15  # S/2, B/2 (two modes), XL/2 (two modes) at batch 64, 128, 256
    for model, mode, batch, gib in rows:
        r = ok(dittrain("plan", "--model", model, "--latent-shape", "4x32x32", "--classes", 1000, "--gpu", "H200",
                        "--batch-size", batch, "--accumulation-steps", 1, "--grad-checkpointing", mode,
                        "--optimizer", "adamw"))
        assert abs(_pick_peak(r.output) / gib - 1) < TOLERANCE, (model, mode, batch, gib, r.output)


def _rows(output: str) -> list[list[str]]:
    """The candidates' table: the cells of each row (the pick's first cell is *)."""
    lines = output.splitlines()
    start = next(i for i, ln in enumerate(lines) if "micro x acc" in ln) + 1
    rows = []
    for ln in lines[start:]:
        if not ln.strip():
            break
        rows.append([ln[0]] + [c for part in ln[1:].split("|") for c in part.split()])
    return rows


@pytest.fixture(scope="module")
def store16(tmp_path_factory) -> Path:
    """48 latents of 4x16x16: DiT-T/2's activations (64 tokens) weigh against its state."""
    from storeutil import make_store

    return make_store(tmp_path_factory.mktemp("store16") / "s", shape=(4, 16, 16))


def test_probe_ranks_by_measured_speed_and_its_pick_runs(store16, tmp_path):
    torch.set_num_threads(1)
    base = ["--model", "DiT-T/2", "--latents", store16, "--batch-size", 8, "--device", "cpu"]
    everything = ok(dittrain("plan", *base, "--grad-checkpointing", "none", "--accumulation-steps", 1))
    need = _pick_peak(everything.output) * 2**30
    # less than "none" at micro-batch 8 needs: something else must be chosen
    limit = int(need * 1.1 * 0.995)
    r = ok(dittrain("plan", *base, "--gpu-memory", limit, "--probe", "--optimizer", "adamw"))
    rows = _rows(r.output)
    probed = [(row, float(row[-1])) for row in rows if row[-1] != "-"]
    assert len(probed) >= 3, r.output
    pick = next(row for row in rows if row[0] == "*")
    assert float(pick[-1]) == max(speed for _, speed in probed), r.output  # the fastest measured
    assert pick[1:4] != ["8", "x", "1"] or pick[4] != "none", r.output
    measured = _size(re.search(r"the pick's measured peak ([0-9.]+ [KMG]iB)", r.output).group(1))
    assert measured <= limit, r.output
    command = next(ln for ln in r.output.splitlines() if ln.startswith("  dittrain run "))
    words = shlex.split(command)[1:]
    words[words.index("RUN")] = str(tmp_path / "run")
    ok(dittrain(*words, "--max-steps", 2, "--sample-every", 0, "--log-every", 1, "-q"), "finished at step 2")


def test_the_pick_as_command_and_config_file_is_what_dittrain_run_takes(tmp_path):
    from storeutil import add_features, make_store

    store = make_store(tmp_path / "store")
    add_features(store, "feats", tokens=16, dims=8)  # REPA targets on DiT-T/2's 4x4 grid
    config = tmp_path / "pick.toml"
    r = ok(dittrain("plan", "--model", "DiT-T/2", "--latents", store, "--batch-size", 16, "--device", "cpu",
                    "--gpu-memory", "200MiB", "--route", "0.5:1:4", "--repa", "feats", "--repa-depth", 2,
                    "--write-config", config), f"wrote {config}", "MiB at the predicted peak")
    command = next(ln for ln in r.output.splitlines() if ln.startswith("  dittrain run "))
    assert_has(command, "--route 0.5:1:4", f"--latents {store}", "--repa feats --repa-depth 2")
    settings = ok(dittrain(*shlex.split(command)[1:], "--print-config")).output
    from_file = ok(dittrain("run", "--config", config, "--out", "RUN", "--print-config")).output
    assert from_file == settings
    pick = re.search(r"^pick: micro-batch (\d+) x (\d+) accumulation, --grad-checkpointing (\S+),", r.output, re.M)
    assert f"accumulation-steps = {pick.group(2)}" in settings
    assert f'grad-checkpointing = "{pick.group(3)}"' in settings or pick.group(3) == "none"


def test_time_lines_from_the_record_and_the_store(store):
    r = ok(dittrain("plan", "--model", "DiT-XL/2", "--latent-shape", "4x32x32", "--classes", 1000, "--gpu", "H200",
                    "--samples", 1_281_167, "--epochs", 80, "--grad-checkpointing", "none", "--accumulation-steps", 1))
    out = r.output
    # the recorded H200 speed of XL/2 at batch 256 (394 img/s): 80 epochs of ImageNet in about 72 hours
    assert re.search(r"400,365 steps \(80\.0 epochs of 1,281,167 samples\) at 0\.65 s/step \(predicted\): 72\.\d GPU-hours", out), out
    assert "bench/gpu_train.py on one H200, 2026-11-30" in out and "FID-50K: 250 sampler steps at CFG 1.5" in out
    assert "--max-steps 400365" in out  # --epochs as the run's length
    local = ok(dittrain("plan", "--model", "DiT-T/2", "--latents", store, "--batch-size", 8, "--device", "cpu"))
    assert "loader: needs" in local.output and "resident in RAM" in local.output, local.output


def test_steps_is_plans_name_for_max_steps_and_run_keeps_its_own():
    common = ["--model", "DiT-XL/2", "--latent-shape", "4x32x32", "--classes", 1000, "--gpu", "H200",
              "--grad-checkpointing", "none", "--accumulation-steps", 1]
    r = ok(dittrain("plan", *common, "--steps", 1000))
    assert "--max-steps 1000" in r.output and "1,000 steps" in r.output, r.output
    assert r.output == ok(dittrain("plan", *common, "--max-steps", 1000)).output
    assert "No such option '--steps'" in dittrain("run", "--steps", 3).output  # the shared option is unchanged


@pytest.mark.parametrize("args,needles", [
    (["--model", "DiT-Q/2", "--latent-shape", "4x32x32"], ["unknown model 'DiT-Q/2'"]),
    (["--model", "DiT-XL/2", "--latent-shape", "4x32x32", "--classes", 1000, "--gpu-memory", "4GiB"],
     ["nothing fits in", "so at least", "GiB of GPU memory"]),
    (["--model", "DiT-B/2", "--latent-shape", "4x32"], ["--latent-shape 4x32: write CxHxW"]),
    (["--model", "DiT-B/2"], ["give --latents STORE, or --latent-shape CxHxW"]),
    (["--model", "DiT-B/2", "--latent-shape", "4x32x32", "--gpu", "H200", "--epochs", 2], ["--epochs needs"]),
    (["--model", "DiT-B/2", "--latent-shape", "4x32x32", "--gpu", "TPU"], ["--gpu TPU: not a card"]),
    (["--model", "DiT-B/2", "--latent-shape", "4x32x32", "--gpu-memory", "lots"], ["--gpu-memory 'lots'"]),
])
def test_impossible_requests_are_one_line(args, needles):
    r = dittrain("plan", *args)
    assert r.exit_code != 0
    line = one_error_line(r.output)
    for needle in needles:
        assert needle in line, line


def test_the_table_has_every_block_kind_and_mode():
    from dittrain.model.parts import MLPS, NORMS, POSITIONS
    from dittrain.model.sizes import DiTConfig
    from dittrain.plan.footprint import BLOCK_FIXED, BLOCK_SAMPLE, MODES, activation_table, block_kind

    table = activation_table()
    for mlp in MLPS:
        for norm in NORMS:
            for pos in POSITIONS:
                for qk in (False, True):
                    kind = block_kind(DiTConfig(mlp=mlp, norm=norm, pos=pos, qk_norm=qk))
                    for key in (f"{kind}/{d}/{k}" for d in ("fp32", "bf16") for k in ("fused", "math")):
                        assert set(table.BLOCK[key]) == set(MODES), key
                        assert all(len(row) == len(BLOCK_SAMPLE) + len(BLOCK_FIXED) for row in table.BLOCK[key].values())
    assert table.SOURCE["command"].startswith("python bench/activation_memory.py --table")

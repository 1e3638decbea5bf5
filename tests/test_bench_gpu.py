"""bench/gpu_train.py on its CPU path (the CI has no GPU): the trainer's step runs through
it, with the real loaders too, and every figure the GPU table needs is in its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_train_cpu_path(tmp_path):
    out = tmp_path / "r.json"
    configs = ("DiT-T/2:2:none:off;DiT-T/2:2:selective:off;DiT-T/2:2:none:off:default:resident;DiT-T/2:2:x:off;"
               "DiT-T/2:2:none:off:default:gpu:repa;DiT-T/2:2:none:off:default:gpu:route=0.5,1,5;"
               "custom:hidden=64,depth=2,heads=2,patch=1,mlp=swiglu,norm=rms,pos=rope:2:none:off:default:gpu:latent=8x4x4;"
               "DiT-T/2:2:none:off:default:gpu:route=0.5,1,9")
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_train.py"), "--device", "cpu", "--configs", configs,
                        "--steps", "1", "--store-size", "8", "--store-dir", str(tmp_path / "store"),
                        "--json", str(out)], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert [row["status"] for row in rows[:3]] == ["ok"] * 3
    assert rows[3]["status"].startswith("error: GradCheckpointingError") and "grad_checkpointing" in rows[3]["status"]
    for row in rows[:3]:
        assert row["images_per_s"] > 0 and row["ms_per_step"] > 0 and 0 <= row["data_wait_frac"] < 1
        assert row["sdpa"] in ("cpu-flash", "math") and row["host_syncs_per_step"] is None  # counted on CUDA
    assert [row["loader"] for row in rows[:3]] == ["gpu", "gpu", "resident"]
    assert "| DiT-T/2 | 2 | selective | off | default | gpu |" in r.stdout  # the markdown table
    assert rows[4]["status"] == "ok" and rows[4]["repa"] and "| gpu + repa |" in r.stdout  # --repa's step
    # --route: the routed step, its MFU from the FLOPs it computes (fewer than the plain row's)
    assert rows[5]["status"] == "ok" and "| gpu + route 0.5:1:5 |" in r.stdout
    assert rows[5]["tflops"] * rows[5]["ms_per_step"] < rows[0]["tflops"] * rows[0]["ms_per_step"]
    # a LightningDiT-style model on VA-VAE-like latents (8 channels, a 4x4 grid at patch 1)
    assert rows[6]["status"] == "ok" and rows[6]["latent"] == [8, 4, 4] and "| gpu + latent 8x4x4 |" in r.stdout
    assert rows[7]["status"].startswith("error: RouteError") and "END 9 is beyond" in rows[7]["status"]


def test_gpu_train_recipe_rows(tmp_path):
    """recipe:NAME[:BATCH[:MODEL]] rows: the recipe's [run] settings (its route, REPA, latents' shape,
    precision unless --amp) on a small model; a global batch above 256 runs in accumulated micro-batches."""
    out = tmp_path / "r.json"
    configs = ("recipe:sit_xl2_repa:2:DiT-T/2;recipe:lightningdit_xl1_vavae:2:DiT-T/2;"
               "recipe:dit_xl2_tread:2:custom:hidden=32,depth=28,heads=2,patch=2")
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_train.py"), "--device", "cpu", "--amp", "fp32",
                        "--configs", configs, "--steps", "1", "--store-size", "8", "--json", str(out)],
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert [row["status"] for row in rows] == ["ok"] * 3, rows
    repa, lightning, tread = rows
    assert repa["repa"] and repa["train"]["repa_depth"] == 8 and repa["train"]["objective"] == "flow"
    assert lightning["latent"] == [32, 16, 16] and lightning["train"]["adam_betas"] == "0.9,0.95"
    assert tread["route"] == "0.5:2:24" and "| dit_xl2_tread: custom:" in r.stdout
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_train import parse_spec

    big = parse_spec("recipe:lightningdit_xl1_vavae")
    assert (big["batch"], big["accumulation"], big["grad_ckpt"]) == (1024, 4, "selective")
    assert parse_spec("recipe:dit_xl2")["grad_ckpt"] == "selective"  # fp32 at 256


def test_gpu_train_without_cuda_says_so():
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_train.py")], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert r.returncode == 2 and "CUDA is not available" in r.stderr

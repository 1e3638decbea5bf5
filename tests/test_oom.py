"""Out of GPU memory (ditdata.common.memory): one line that names what ran, its batch and
precision, and the flags that lower it; never "internal error", never a traceback. The
error is simulated on the CPU: torch.OutOfMemoryError raised inside a batch."""

from __future__ import annotations

from types import SimpleNamespace

import click
import numpy as np
import pytest
import torch
from cliutil import assert_has, ditdata, dittrain, one_error_line, run_args

from ditdata.common.cli import OneLineErrors
from ditdata.common.errors import UserError
from ditdata.common.memory import GENERAL_HINT, OutOfGpuMemory, is_out_of_memory, out_of_memory_hint, precision_name

OOM = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB"


def oom(*args, **kwargs):
    raise torch.OutOfMemoryError(OOM)


def failed_with(result, *needles: str) -> str:
    """The one `Error:` line of a failed command (its last; what it said before stays),
    holding every needle and no bug report."""
    assert result.exit_code == 1, result.output
    errors = [ln for ln in result.output.splitlines() if "Error" in ln]
    assert len(errors) == 1 and result.output.splitlines()[-1] == errors[0], result.output
    line = one_error_line(errors[0])
    assert "internal error" not in line and "Traceback" not in result.output
    assert_has(line, "Error: out of GPU memory (2.00 GiB more asked for)", *needles)
    return line


# ----------------------------------------------------------------------------- the pieces


def test_the_hint_turns_torch_oom_into_one_line_and_lets_the_rest_pass():
    with pytest.raises(OutOfGpuMemory) as e, out_of_memory_hint(
            what="training DiT-XL/2", batch="global batch 256 (micro-batch 64 x 4 accumulation)",
            precision=torch.bfloat16, hints=["--grad-checkpointing selective", None, "--optimizer adamw8bit"]):
        oom()
    assert str(e.value) == ("out of GPU memory (2.00 GiB more asked for) training DiT-XL/2 at global batch 256 "
                            "(micro-batch 64 x 4 accumulation), bf16: lower it with --grad-checkpointing selective "
                            "or --optimizer adamw8bit")
    assert isinstance(e.value, UserError) and isinstance(e.value.__cause__, torch.OutOfMemoryError)
    with pytest.raises(ValueError), out_of_memory_hint(what="x"):
        raise ValueError("not memory")
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("x")) and not is_out_of_memory(RuntimeError("x"))
    assert [precision_name(p) for p in (None, torch.float16, torch.float32, "bf16")] == ["fp32", "fp16", "fp32", "bf16"]


def test_a_bare_oom_is_one_line_not_an_internal_error():
    @click.group(cls=OneLineErrors)
    def group():
        pass

    @group.command()
    def work():
        oom()

    from click.testing import CliRunner

    r = CliRunner().invoke(group, ["work"])
    assert failed_with(r).endswith(GENERAL_HINT)


def test_training_hint_names_model_batch_precision_and_unused_savings():
    from dittrain.config import TrainConfig
    from dittrain.train.log import training_memory_hint

    def message(per_rank, world=1, **flat):
        cfg = TrainConfig.from_flat(model="DiT-XL/2", **flat)
        run = SimpleNamespace(cfg=cfg, per_rank=per_rank, world=world, amp_dtype=torch.bfloat16,
                              device=torch.device("cpu"))
        with pytest.raises(OutOfGpuMemory) as e, training_memory_hint(run):
            oom()
        return str(e.value)

    assert message(64, batch_size=256, accumulation_steps=4, latents="/data/in 1k") == (
        "out of GPU memory (2.00 GiB more asked for) training DiT-XL/2 at global batch 256 (micro-batch 64 x 4 "
        "accumulation), bf16: lower it with --grad-checkpointing selective, --accumulation-steps 8 "
        "(micro-batch 32) or --optimizer adamw8bit; `dittrain plan --model DiT-XL/2 --latents '/data/in 1k' "
        "--batch-size 256 --device cpu` lists the settings that fit this GPU")
    done = message(1, world=2, batch_size=2, accumulation_steps=1, grad_checkpointing="every", optimizer="adamw8bit")
    assert ("(micro-batch 1 x 1 accumulation x 2 ranks), bf16: lower it with --batch-size 1; `dittrain plan --model "
            "DiT-XL/2 --latents STORE --batch-size 2 --device cpu`") in done, done
    assert "--grad-checkpointing every" in message(8, batch_size=8, grad_checkpointing="selective")


# ----------------------------------------------------------------------------- the commands


def test_encode(class_shards, tmp_path, monkeypatch):
    import ditdata.encode as encode_mod

    monkeypatch.setattr(encode_mod.Encoder, "images", oom)
    r = ditdata("encode", class_shards, "--vae", "pixels", "--resolution", 16, "--out", tmp_path / "s",
                "--batch-size", 4, "--flip", "--workers", 0, "--device", "cpu")
    failed_with(r, "encoding with pixels at --batch-size 4 (8 images a pass with --flip), fp32: "
                   "lower it with --batch-size 2")


def test_score(tmp_path, monkeypatch):
    pytest.importorskip("open_clip")
    from test_clip import tiny_clip_files
    from test_score import caption_shards

    from ditdata.clip import ClipModel

    config, weights = tiny_clip_files(tmp_path / "clip")
    monkeypatch.setattr(ClipModel, "score_and_embed_pixels", oom)
    r = ditdata("score", caption_shards(tmp_path / "shards"), "--clip-config", config, "--pretrained", weights,
                "--device", "cpu", "--batch-size", 4, "--threads", 0, "-q")
    failed_with(r, "scoring with CLIP tiny-clip at --batch-size 4, fp32: lower it with --batch-size 2")


def test_eval(tmp_path, monkeypatch):
    pytest.importorskip("torch_fidelity")
    from tiny import save_random_inception

    from dittrain.eval import INCEPTION_FILES, Inception

    inception = save_random_inception(tmp_path / INCEPTION_FILES[0])
    samples = tmp_path / "s.npz"
    np.savez(samples, arr_0=np.zeros((4, 16, 16, 3), np.uint8))
    monkeypatch.setattr(Inception, "features", oom)
    r = dittrain("eval", "--samples", samples, "--ref", samples, "--inception", inception, "--device", "cpu",
                 "--batch-size", 8)
    failed_with(r, "evaluating with the FID Inception-v3 at --batch-size 8, fp32: "
                   "lower it with --batch-size 4 or --no-precision-recall")


def test_train(tmp_path, monkeypatch):
    from storeutil import make_store

    from dittrain.train.step import TrainStep

    monkeypatch.setattr(TrainStep, "backward", oom)
    store = make_store(tmp_path / "store", n=24, shards=2)
    r = dittrain(*run_args(store, tmp_path / "run", "--max-steps", 2, "--accumulation-steps", 2))
    line = failed_with(r)
    assert_has(line, "training DiT-T/4 at global batch 8 (micro-batch 4 x 2 accumulation), fp32: lower it with "
                     "--grad-checkpointing selective, --accumulation-steps 4 (micro-batch 2) or --optimizer adamw8bit; "
                     "`dittrain plan --model DiT-T/4 --latents", "--batch-size 8 --device cpu` lists the settings")


@pytest.mark.parametrize("npz", [False, True])
def test_sample(pixel_run, tmp_path, monkeypatch, npz):
    from dittrain.diffusion import Diffusion

    run, _ = pixel_run
    monkeypatch.setattr(Diffusion, "sample", oom)
    out = ["--npz", tmp_path / "s.npz"] if npz else ["--out", tmp_path / "o"]
    r = dittrain("sample", "--ckpt", run, *out, "--n", 4, "--batch-size", 2, "--steps", 2, "--device", "cpu")
    line = failed_with(r)
    assert_has(line, "sampling DiT-T/4 at --batch-size 2", ", fp32: lower it with --batch-size 1")

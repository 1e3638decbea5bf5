"""The README's overview block runs as written: every command of it, in order, in one folder,
with only the paths and sizes of the table below swapped for tiny local stand-ins.

The block is found by its marker (`<!-- overview`), its continuation lines are joined and its
comments dropped. SUBSTITUTIONS names each swap explicitly (the user's SOURCE, hub models that
cannot be downloaded here, sizes that would take days on a CPU); every entry must match the
block (so a README edit cannot leave the table stale), no hub name may survive it, and what it
does not touch runs unchanged. Each command then runs as a child process of the venv's entry
points, offline (HF_HUB_OFFLINE=1, empty caches) and on the CPU, must exit 0 and leave its output.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image

pytest.importorskip("open_clip")
pytest.importorskip("torch_fidelity")

from test_clip import tiny_clip_files  # noqa: E402
from tiny import random_crops, save_random_inception  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the venv's console scripts
MARKER = "<!-- overview"

# what the README says -> what runs here ({name}: a path made by the test)
SUBSTITUTIONS: dict[tuple[str, ...], tuple[str, ...]] = {
    ("SOURCE",): ("{photos}",),  # the user's images: a folder of photo.jpg + photo.txt pairs
    ("--clip", "ViT-B-32"): ("--clip", "tiny-clip", "--clip-config", "{clip_config}"),  # a random tiny CLIP
    ("--pretrained", "laion2b_s34b_b79k"): ("--pretrained", "{clip_weights}"),
    ("--text-encoder", "ViT-B-32"): ("--text-encoder", "tiny-clip", "--text-config", "{clip_config}"),
    ("--text-pretrained", "laion2b_s34b_b79k"): ("--text-pretrained", "{clip_weights}"),
    ("--min-clip-score", "0.28"): ("--min-clip-score", "-1"),  # a random CLIP's scores are near 0: keep all
    ("--vae", "sd-vae-ft-ema"): ("--vae", "pixels"),  # no autoencoder (diffusers' import alone costs ~10 s a command)
    ("--resolution", "256"): ("--resolution", "16"),
    ("--model", "DiT-XL/2"): ("--model", "DiT-T/4"),
    ("--batch-size", "256"): ("--batch-size", "4"),
    ("--max-steps", "400000"): ("--max-steps", "2"),
    ("--n", "50000"): ("--n", "4"),
}
HUB_NAMES = ("SOURCE", "ViT-B-32", "laion2b_s34b_b79k", "sd-vae-ft-ema", "DiT-XL/2")

# what each command of the block leaves in its folder, in the block's order
OUTPUTS = ["shards/dataset.json", "shards/00000.clip.parquet", "keep.parquet", "store/manifest.json",
           "runs/exp1/ema.safetensors", "fox.png", "samples.npz", None]


def overview_commands(readme: str) -> list[str]:
    """The commands of the README's overview block: continuation lines joined, one string each."""
    start = readme.index(MARKER)
    body = readme[readme.index("```bash\n", start) + len("```bash\n"):]
    body = body[:body.index("```")]
    return [line for line in body.replace("\\\n", " ").splitlines() if line.strip()]


def substitute(tokens: list[str], used: set) -> list[str]:
    """`tokens` with every SUBSTITUTIONS key replaced by its value (keys found go into `used`)."""
    out, i = [], 0
    while i < len(tokens):
        for key, new in SUBSTITUTIONS.items():
            if tuple(tokens[i:i + len(key)]) == key:
                out += new
                used.add(key)
                i += len(key)
                break
        else:
            out.append(tokens[i])
            i += 1
    return out


def captioned_photos(folder: Path, n: int = 12) -> Path:
    """n crops of the photographs scikit-image and scikit-learn ship, as x.jpg + x.txt pairs."""
    folder.mkdir(parents=True)
    for i, crop in enumerate(random_crops(n, size=48, seed=4)):
        Image.fromarray(crop).save(folder / f"photo{i:02d}.jpg", quality=95)
        (folder / f"photo{i:02d}.txt").write_text(f"a photo, crop number {i}")
    return folder


def test_commands_are_what_the_substitution_table_expects():
    """Without running anything: the block is the eight commands, every table entry matches it,
    and after the swaps no hub name or placeholder is left."""
    commands = overview_commands((REPO / "README.md").read_text())
    assert len(commands) == len(OUTPUTS), commands
    used: set = set()
    for line in commands:
        tokens = shlex.split(line, comments=True)
        assert tokens[0] in ("ditdata", "dittrain"), line
        swapped = substitute(tokens, used)
        assert not set(HUB_NAMES) & set(swapped), (line, swapped)
    assert used == set(SUBSTITUTIONS), f"table entries the README no longer has: {set(SUBSTITUTIONS) - used}"


@pytest.mark.slow
def test_overview_block_runs_as_written(tmp_path):
    commands = overview_commands((REPO / "README.md").read_text())
    clip_config, clip_weights = tiny_clip_files(tmp_path / "models" / "clip")
    paths = {"photos": str(captioned_photos(tmp_path / "my_photos")),
             "clip_config": str(clip_config), "clip_weights": str(clip_weights)}
    inception = save_random_inception(tmp_path / "models" / "inception.pth")
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "TORCH_HOME": str(tmp_path / "torch"), "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "DITKIT_INCEPTION": str(inception),  # what `dittrain eval` finds without --inception
           "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    used: set = set()
    timings = []
    for line, output in zip(commands, OUTPUTS, strict=True):
        tokens = substitute(shlex.split(line, comments=True), used)
        argv = [str(BIN / tokens[0]), *(t.format(**paths) for t in tokens[1:])]
        start = time.perf_counter()
        r = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=300)
        timings.append(f"{time.perf_counter() - start:5.1f} s  {line[:60]}")
        assert r.returncode == 0, f"{line}\n-> {shlex.join(argv)}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        if output:
            assert (work / output).is_file(), f"{line}: no {output}\n{r.stderr[-2000:]}"
        else:  # dittrain eval
            assert "FID" in r.stdout, r.stdout
    assert used == set(SUBSTITUTIONS)
    print("\n".join(timings))

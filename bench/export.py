"""Exported weights side by side (`dittrain export`): file size, forward and sampling speed,
and how close fp16 / int8 / ONNX samples are to fp32's with the same seeds.

    python bench/export.py [--model DiT-S/2] [--latent 4x32x32] [--num-classes 1000]
                           [--formats fp32,fp16,int8,onnx] [--n 8] [--steps 10] [--cfg 4]
                           [--batch 8] [--device cpu|cuda] [--vae NAME_OR_DIR]
                           [--inception FILE] [--rounds 3] [--json results.json] [--threads N]

What one row measures (a DiT of --model on --latent latents with --num-classes classes and
learned sigma, random weights nudged by N(0, 0.02) so the output depends on t and y, as the
tests' "trained" runs; an untouched adaLN-Zero init outputs zeros):

  file        the fp32 run's ema.safetensors, then each `dittrain export` of it (the
              library's export(), its own check included): fp16 .safetensors, int8 .pt
              (torchao weight-only), .onnx (one file under 2 GB)
  forward     one network call on the guided batch (2 x --batch): median of 3 after a warm-up,
              the fastest over --rounds rounds that visit the formats in turn (so a busy machine
              slows them alike); the file loaded as `dittrain sample` loads it (load_model: fp16
              is cast to fp32; int8 keeps torchao's int8 linears; onnx: OnnxDiT over
              onnxruntime, CUDA provider only with onnxruntime-gpu)
  sampling    --n latents, guided DDPM (--cfg) in --steps respaced steps, batches of --batch,
              the same initial noise, labels and ancestral generator for every format (one
              timed run each: noisier than forward)
  PSNR        of the sampled latents against fp32's, peak = the fp32 latents' range; with
              --vae, also of the decoded uint8 images (peak 255) (ditdata.autoencoders.kinds: a preset in the
              local hub cache, a diffusers folder or TAEF2; its latent shape must be --latent)
  FID         with --inception FILE and --vae: FID of each format's decoded images against
              fp32's (0 = the same images; a noisy figure for small --n; needs the eval extra)

Needs the export extra (onnx, onnxscript, onnxruntime, torchao); diffusers for a KL --vae.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from scratch import add_device_args, add_options, open_device, parser, sync  # bench/scratch.py

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dittrain.diffusion import Diffusion, DiffusionConfig  # noqa: E402
from dittrain.inference.export import export, file_size  # noqa: E402
from dittrain.inference.open_run import load_model  # noqa: E402
from dittrain.inference.sample import pick_labels, to_uint8  # noqa: E402
from dittrain.inference.weights import load_weights  # noqa: E402
from dittrain.model.dit import DiT  # noqa: E402
from dittrain.model.sizes import get_config  # noqa: E402
from dittrain.rundir import export_weights  # noqa: E402

FILES = {"fp32": None, "fp16": "dit-fp16.safetensors", "int8": "dit-int8.pt", "onnx": "dit.onnx"}


def make_run(root: Path, args) -> tuple[Path, dict]:
    c, h, w = (int(v) for v in args.latent.split("x"))
    assert h == w, "square latents only"
    torch.manual_seed(0)
    dit = DiT(get_config(args.model, input_size=h, in_channels=c, num_classes=args.num_classes))
    with torch.no_grad():
        for p in dit.parameters():
            if p.requires_grad:
                p.add_(0.02 * torch.randn_like(p))
    config = {"train": {"model": args.model, "objective": "ddpm"}, "model": asdict(dit.config),
              "diffusion": asdict(DiffusionConfig())}
    run = root / "run"
    run.mkdir()
    export_weights(run / "ema.safetensors", dit.state_dict(), config)
    return run, config


def load(fmt: str, path: Path, device: torch.device):
    if fmt == "onnx":
        from dittrain.inference.onnx import OnnxDiT

        return OnnxDiT(path, device=device)
    weights, config = load_weights(path)
    return load_model(weights, config, device)


def time_forward(net, cfg, batch: int, device: torch.device) -> float:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2 * batch, cfg.in_channels, cfg.input_size, cfg.input_size, generator=g).to(device)
    t = (torch.rand(2 * batch, generator=g) * 1000).to(device)
    y = torch.randint(0, cfg.num_classes + 1, (2 * batch,), generator=g).to(device)
    times = []
    with torch.no_grad():
        for _ in range(4):
            sync(device)
            t0 = time.perf_counter()
            net(x, t, y)
            sync(device)
            times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def sample(net, cfg, args, device: torch.device) -> tuple[torch.Tensor, float]:
    """(latents (n, C, H, W) on the CPU, seconds): the same noise, labels and generator each call."""
    g = torch.Generator().manual_seed(args.seed)
    noise = torch.randn(args.n, cfg.in_channels, cfg.input_size, cfg.input_size, generator=g)
    labels = torch.tensor(pick_labels(args.n, cfg.num_classes, args.seed))
    diffusion = Diffusion(DiffusionConfig())
    out = []
    sync(device)
    t0 = time.perf_counter()
    for s in range(0, args.n, args.batch):
        cond = {"y": labels[s:s + args.batch].to(device)}
        out.append(diffusion.sample(net, noise[s:s + args.batch].shape, steps=args.steps, sampler="ddpm",
                                    cfg_scale=args.cfg, model_kwargs=cond, uncond_kwargs=net.unconditional_kwargs(cond),
                                    generator=g, device=device, noise=noise[s:s + args.batch]).cpu())
    sync(device)
    return torch.cat(out), time.perf_counter() - t0


def psnr(a: np.ndarray, ref: np.ndarray, peak: float) -> float:
    mse = float(np.mean((a.astype(np.float64) - ref.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(peak**2 / mse)


def main(argv=None) -> int:
    p = parser(__doc__)
    add_options(p, ("--model", "DiT-S/2", "the DiT size"), ("--latent", "4x32x32", "latent shape CxHxW"),
                ("--num-classes", 1000, "classes"), ("--formats", "fp32,fp16,int8,onnx", "export formats"),
                ("--n", 8, "samples per format"), ("--steps", 10, "sampling steps"), ("--cfg", 4.0, "guidance scale"),
                ("--batch", 8, "samples per forward"), ("--seed", 0, "sampling seed"))
    add_device_args(p)
    p.add_argument("--vae", default=None)
    p.add_argument("--inception", default=None)
    p.add_argument("--rounds", type=int, default=3, help="forward timings per format, round-robin; the fastest counts")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = open_device(args, "no CUDA device: use --device cpu")
    formats = args.formats.split(",")
    if "fp32" not in formats:
        formats.insert(0, "fp32")  # the reference
    ae = None
    if args.vae:
        from ditdata.autoencoders.kinds import load_autoencoder

        ae = load_autoencoder(args.vae, device)
    inception = None
    if args.inception:
        if ae is None:
            print("--inception needs --vae (FID is of decoded images)", file=sys.stderr)
            return 2
        from dittrain.eval import load_inception

        inception = load_inception(args.inception, device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")
    print(f"device: {where}, {torch.get_num_threads()} threads; torch {torch.__version__}; {args.model} on "
          f"{args.latent} latents, {args.num_classes} classes; sampling {args.n} x {args.steps} ddpm steps, "
          f"cfg {args.cfg:g}, batch {args.batch}")
    rows, nets, ref, ref_images, ref_feats = [], {}, None, None, None
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        run, config = make_run(tmp, args)
        for fmt in formats:  # export and load them all first
            if fmt == "fp32":
                path, export_s = run / "ema.safetensors", 0.0
            else:
                path = tmp / FILES[fmt]
                t0 = time.perf_counter()
                export(run, fmt, path, log=lambda line, fmt=fmt: print(f"  [{fmt}] {line}"))
                export_s = time.perf_counter() - t0
            nets[fmt] = load(fmt, path, device)
            row = {"format": fmt, "file_mb": file_size(path) / 1e6, "export_s": export_s}
            if fmt == "onnx":
                row["provider"] = nets[fmt].provider
            rows.append(row)
        # forward: round-robin rounds, the fastest of each format's (robust to other jobs on the machine)
        times = {fmt: [] for fmt in formats}
        for _ in range(args.rounds):
            for fmt, net in nets.items():
                times[fmt].append(time_forward(net, net.config, args.batch, device))
        for row in rows:
            net = nets[row["format"]]
            row.update(forward_ms=1e3 * min(times[row["format"]]), forward_batch=2 * args.batch)
            z, sample_s = sample(net, net.config, args, device)
            row.update(sample_s=sample_s, images_per_s=args.n / sample_s)
            if ref is None:
                ref = z.numpy()
            row["psnr_latent_db"] = psnr(z.numpy(), ref, float(ref.max() - ref.min()))
            if ae is not None:
                images = to_uint8(ae.decode(z.to(device)))
                if ref_images is None:
                    ref_images = images
                row["psnr_image_db"] = psnr(images, ref_images, 255.0)
                if inception is not None:
                    from dittrain.eval import feature_stats, fid, image_features

                    feats = image_features(images, inception)["pool"]
                    if ref_feats is None:
                        ref_feats = feats
                    row["fid_vs_fp32"] = fid(*feature_stats(feats), *feature_stats(ref_feats))
            print(json.dumps(row), flush=True)
    cols = ["format", "file_mb", "forward_ms", "sample_s", "images_per_s", "psnr_latent_db", "psnr_image_db",
            "fid_vs_fp32"]
    cols = [c for c in cols if any(c in r for r in rows)]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c, "")
            cells.append(f"{v:.3g}" if isinstance(v, float) and c != "file_mb" else
                         f"{v:.1f}" if isinstance(v, float) else str(v))
        print("| " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": where, "args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

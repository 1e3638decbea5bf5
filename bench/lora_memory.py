"""`dittrain plan`'s memory model of --lora against the allocator's measured peak (issue 38).

    python bench/lora_memory.py [--models DiT-S/2:8,DiT-B/2:4] [--rank 16] [--input-size 16] [--device cpu]

For each MODEL:BATCH, a full run and a --lora RANK run (the default targets): the peak footprint predicts
(dittrain.plan.footprint, Setting.lora) and the peak of two trainer steps as dittrain.plan.probe builds
them (the adapter injected, an EMA of the adapter alone; on the CPU the allocator's record, on CUDA
torch.cuda.max_memory_allocated): 4-channel latents of --input-size, 1000 classes, ddpm with learned
sigma, AdamW, no checkpointing, fp32 on the CPU (bf16 on CUDA). A markdown table.
"""

from __future__ import annotations

import torch
from scratch import add_device_args, open_device, parser, row  # bench/scratch.py

from dittrain.config import LORA_TARGETS, TrainConfig
from dittrain.model.sizes import get_config
from dittrain.plan.footprint import Setting, footprint
from dittrain.plan.probe import measured_peak


def main() -> None:
    ap = parser(__doc__, ("--models", "DiT-S/2:8,DiT-B/2:4", "MODEL:BATCH,..."), ("--rank", 16, "the --lora rank"),
                ("--input-size", 16, "latent side"))
    add_device_args(ap, threads=False)  # one thread: below
    args = ap.parse_args()
    device = open_device(args)
    precision = "bf16" if device.type == "cuda" else "fp32"
    torch.set_num_threads(1)  # the CPU allocator's record is the same on any thread count; one is steadier
    print(f"latents 4x{args.input_size}x{args.input_size}, 1000 classes, ddpm + learned sigma, AdamW, {precision}, "
          f"on {device}\n")
    print("| model | batch | run | predicted peak (MiB) | measured peak (MiB) | error |")
    print("|---|---:|---|---:|---:|---:|")
    for spec in args.models.split(","):
        model, batch = spec.rsplit(":", 1)
        n = int(batch)
        model_cfg = get_config(model, input_size=args.input_size, in_channels=4, num_classes=1000,
                               grad_checkpointing="none")
        for rank in (0, args.rank):
            cfg = TrainConfig.from_flat(model=model, batch_size=n, grad_checkpointing="none", amp=precision, lora=rank)
            lora = (rank, LORA_TARGETS) if rank else None
            predicted = footprint(Setting(model_cfg, micro_batch=n, mode="none", precision=precision, lora=lora)).peak
            measured = measured_peak(cfg, model_cfg, device)
            print(row(model, n, f"--lora {rank}" if rank else "full", f"{predicted / 2**20:.1f}",
                      f"{measured / 2**20:.1f}", f"{100 * (predicted / measured - 1):+.1f}%"), flush=True)


if __name__ == "__main__":
    main()

"""A training run, top to bottom (`dittrain run`).

    loop.py        the loop: setup, state, resume, steps, checkpoints, logs (read this first)
    setup.py       what a run is before it trains: process group, device, store, the configs it implies
    step.py        one optimizer step queued on the device (no host syncs), torch.compile
    optim.py       AdamW / 8-bit AdamW and the LR schedule
    losses.py      the loss terms beside the diffusion loss: LOSS_TERMS, one entry each (REPA's, the velocity cosine)
    repa.py        --repa: the projector and the alignment loss
    captionmix.py  --caption-mix: which caption set each sample's text is, drawn in the step (SANA's rules)
    checkpoint.py  RunState (every stateful part) and its atomic and background saves
    resume.py      the run record (config.json) and its resume rules: safe / learned / fixed
    log.py         what a run reports: metric records, the progress bar, sample grids, FID calls
    loggers.py     where the records go: metrics.jsonl, TensorBoard, W&B
    fid.py         FID of the EMA model during training (--eval-every)
    validation.py  a held-out validation loss at fixed t and noise (--val-fraction, --val-latents, --val-every)
    runs.py        `dittrain runs`: a table of run directories and their loss curves

The package itself imports nothing.
"""
